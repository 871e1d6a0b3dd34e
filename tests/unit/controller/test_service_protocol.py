"""Every implementation of `ControllerService` (controller/service.py) defines each of its
methods with the Protocol's parameters: the Controller, the HA controller that serves it
(no forwarding through `__getattr__`, so a new method cannot be forgotten there) and the
recording fake the API and agent tests run against."""

from __future__ import annotations

import inspect

import pytest

from tests.fakes.controller_service import FakeService
from trainguard.controller.composition import Controller
from trainguard.controller.ha import HaController
from trainguard.controller.service import ControllerService

SERVICE_METHODS = sorted(
    name
    for name, value in vars(ControllerService).items()
    if inspect.isfunction(value) and not name.startswith("_")
)
IMPLEMENTATIONS = [Controller, HaController, FakeService]


def _parameters(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_the_protocol_has_the_methods_the_api_calls() -> None:
    assert {"ingest_report", "refuse_report", "drain", "list_nodes", "reload_rules"} <= set(
        SERVICE_METHODS
    )


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", SERVICE_METHODS)
def test_each_implementation_defines_every_service_method(cls: type, name: str) -> None:
    defined = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)
    assert inspect.isfunction(defined), f"{cls.__name__} does not define {name}"
    assert _parameters(defined) == _parameters(getattr(ControllerService, name))


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_no_implementation_forwards_through_getattr(cls: type) -> None:
    assert not any("__getattr__" in vars(k) for k in cls.__mro__ if k is not object)
