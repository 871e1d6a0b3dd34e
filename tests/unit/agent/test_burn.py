"""The compute burn's own logic: exact products pass their checksums, one flipped bit is
caught (numpy and torch on the CPU), the loop is bounded by its time and runs at least once,
and the worker's JSON line."""

from __future__ import annotations

import json

import pytest

from trainguard.agent import burn as burn_mod
from trainguard.agent.burn import burn, burn_device
from trainguard.clock import FakeClock


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_exact_products_pass_and_one_flipped_bit_is_caught(engine: str) -> None:
    ops = (
        burn_mod._numpy_ops(64)
        if engine == "numpy"
        else burn_mod._torch_ops(burn_mod._torch_inputs(64), "cpu")
    )
    clean = burn_device(ops, gpu=0, size=64, seconds=0.05, corrupt=False)
    assert clean.iterations >= 1 and clean.mismatches == 0
    bad = burn_device(ops, gpu=0, size=64, seconds=0.05, corrupt=True)
    assert bad.mismatches == 1  # the first product only: the others are exact again


def test_the_loop_runs_once_even_when_its_time_is_zero_and_stops_on_time() -> None:
    clock = FakeClock()
    calls = []

    class Ops:
        def matmul(self) -> int:
            calls.append(1)
            clock.advance(0.4)
            return 0

        def check(self, c: int) -> bool:
            return True

        def flip(self, c: int) -> None:
            raise AssertionError("not asked to corrupt")

    once = burn_device(Ops(), gpu=3, size=8, seconds=0.0, corrupt=False, clock=clock)  # type: ignore[arg-type]
    assert (once.gpu, once.iterations) == (3, 1)
    calls.clear()
    timed = burn_device(Ops(), gpu=3, size=8, seconds=1.0, corrupt=False, clock=clock)  # type: ignore[arg-type]
    assert timed.iterations == len(calls) == 3  # 0.4, 0.8, 1.2 s: stops at the first past 1 s
    assert timed.tflops == pytest.approx(2 * 8**3 * 3 / 1.2 / 1e12)


def test_cpu_burn_covers_every_gpu_and_corrupts_only_those_named() -> None:
    out = burn(gpus=[0, 1, 2], seconds=0.06, device="cpu", corrupt=[1], size=32)
    assert [r.gpu for r in out] == [0, 1, 2]
    assert [r.mismatches for r in out] == [0, 1, 0]
    assert all(r.error == "" and r.tflops > 0 for r in out)


def test_a_failing_device_is_that_devices_result(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(size: int) -> object:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(burn_mod, "_cpu_ops", broken)
    (r,) = burn(gpus=[4], seconds=0.01, device="cpu")
    assert (r.gpu, r.iterations) == (4, 0)
    assert "illegal memory access" in r.error


def test_worker_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    spec = {"gpus": [0], "seconds": 0.01, "device": "cpu", "size": 16}
    assert burn_mod.main([json.dumps(spec)]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    (result,) = json.loads(line)["results"]
    assert result["gpu"] == 0 and result["mismatches"] == 0
