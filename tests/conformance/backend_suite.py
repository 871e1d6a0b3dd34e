"""The scheduler backends' conformance suite: what every backend (controller.backends.base.
SchedulerBackend), and the recording fake, must do alike. A backend's test module subclasses
BackendSuite as `Test<Name>Backend` and gives it a `harness` fixture (a BackendHarness over
the backend and a cluster it can drive); tests/README.md says how a new backend starts from
it.

What it holds a backend to: drain / poll / undrain semantics (a local drain waits for the
node's job to stop, a scheduler-side one is done at once and leaves others' drains alone), a
node returned to a pool again staying in service,
the outcome of every job step on a node that runs no job (done, `skipped: ...`), a repeated
step with the same key acting once, the declared capabilities honoured (a step the backend
cannot do answers `skipped`, whoever asks), and job_views only with
Capability.EXTERNAL_JOB_VIEWS.
"""

from __future__ import annotations

from typing import Any, Protocol

import pytest

from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.drain import DrainState
from trainguard.controller.backends.base import (
    JOB_STEP_KINDS,
    STEP_CAPABILITY,
    BackendKind,
    Capability,
    SchedulerBackend,
    step_handlers,
    step_methods,
)
from trainguard.controller.views import ActionView

# Simulated seconds a local drain may take to see the node's job stop, and a step to finish.
MAX_WAIT_S = 30


class BackendHarness(Protocol):
    """A backend under test and the cluster around it: `job_nodes` run the job that
    start_job starts, `spare` is a free hot spare, `idle` an active node that runs nothing."""

    backend: SchedulerBackend
    registered: BackendKind | None  # the registry row it was built from; None for the fake
    job_nodes: tuple[str, str]
    spare: str
    idle: str

    def now(self) -> float: ...

    def start_job(self) -> str:
        """Run a job on job_nodes (reporting ranks where the backend needs them); its name."""

    def advance(self) -> None:
        """One simulated second: the nodes report, the backend reads its scheduler."""

    def node_state(self, node: str) -> str:
        """trainguard's node state: active, draining or drained."""

    def drain_by_others(self, node: str, *, reason: str) -> None:
        """Someone else drains the node in the scheduler (SCHEDULER_SIDE_DRAIN backends)."""


def step_ctx(
    kind: str,
    *,
    now: float,
    params: dict[str, Any],
    key: str | None = None,
    progress: dict[str, Any] | None = None,
    previous: dict[str, dict[str, Any]] | None = None,
) -> ActionContext:
    view = ActionView(
        id=1,
        incident_id=None,
        kind=kind,
        target=str(params.get("node", params.get("job", ""))),
        state="running",
        attempts=1,
        idempotency_key=key or f"conformance:{kind}",
        created_at=now,
        updated_at=now,
        params=params,
    )
    return ActionContext(
        action=view,
        incident=None,
        now=now,
        attempt=1,
        previous=previous or {},
        progress=progress or {},
    )


def _drained(h: BackendHarness, node: str, *, key: str, progress: dict[str, Any]) -> DrainState:
    """Poll a drain until it is drained, a simulated second apart (bounded)."""
    state = h.backend.poll(node, key=key, progress=progress)
    for _ in range(MAX_WAIT_S):
        if state == "drained":
            break
        h.advance()
        state = h.backend.poll(node, key=key, progress=progress)
    return state


def _finished(h: BackendHarness, kind: str, params: dict[str, Any], *, key: str) -> Outcome:
    """Run a step until it is done, polled a simulated second apart (bounded)."""
    handler = {x.kind: x for x in step_handlers(h.backend)}[kind]
    outcome = handler.run(step_ctx(kind, now=h.now(), params=params, key=key))
    for _ in range(MAX_WAIT_S):
        if outcome.done:
            break
        h.advance()
        ctx = step_ctx(kind, now=h.now(), params=params, key=key, progress=outcome.output)
        outcome = handler.run(ctx)
    assert outcome.done, f"{kind} not done within {MAX_WAIT_S} simulated s: {outcome.message}"
    return outcome


class BackendSuite:
    """Subclass as Test<Name>Backend with a `harness` fixture."""

    # --- what it declares ------------------------------------------------------------------

    def test_it_declares_the_capabilities_of_its_registry_row(self, harness: Any) -> None:
        caps = harness.backend.capabilities
        assert isinstance(caps, frozenset) and all(isinstance(c, Capability) for c in caps)
        if harness.registered is not None:
            assert harness.registered.name == harness.backend.name
            assert harness.registered.capabilities == caps

    def test_every_job_step_kind_has_one_handler_calling_its_method(self, harness: Any) -> None:
        handlers = step_handlers(harness.backend)
        assert [h.kind for h in handlers] == list(JOB_STEP_KINDS)
        assert set(step_methods(harness.backend)) == set(JOB_STEP_KINDS)

    # --- drain / poll / undrain ------------------------------------------------------------

    def test_an_idle_node_drains_and_undrain_brings_it_back(self, harness: Any) -> None:
        h: BackendHarness = harness
        state, progress = h.backend.drain(h.idle, reason="conformance", key="drain:idle")
        if state != "drained":
            state = _drained(h, h.idle, key="drain:idle", progress=progress)
        assert state == "drained"
        assert h.node_state(h.idle) == "drained"
        h.backend.undrain(h.idle, key="undrain:idle")
        assert h.node_state(h.idle) == "active"

    def test_a_drain_or_undrain_repeated_with_its_key_is_harmless(self, harness: Any) -> None:
        h: BackendHarness = harness
        first, _ = h.backend.drain(h.idle, reason="conformance", key="drain:again")
        again, progress = h.backend.drain(h.idle, reason="conformance", key="drain:again")
        assert first == again == "drained"
        assert h.backend.poll(h.idle, key="drain:again", progress=progress) == "drained"
        h.backend.undrain(h.idle, key="undrain:again")
        h.backend.undrain(h.idle, key="undrain:again")
        assert h.node_state(h.idle) == "active"

    def test_a_node_returned_to_a_pool_again_stays_in_service(self, harness: Any) -> None:
        # the lifecycle's validation calls it, and calls it again when re-run after a crash
        h: BackendHarness = harness
        for role in ("spare", "spare", "active", "active"):
            h.backend.return_to_pool(h.idle, role=role)
            h.advance()
            assert h.node_state(h.idle) == "active"

    def test_a_node_of_a_running_job_drains_the_backends_way(self, harness: Any) -> None:
        h: BackendHarness = harness
        h.start_job()
        node = h.job_nodes[0]
        state, progress = h.backend.drain(node, reason="conformance", key="drain:busy")
        if Capability.SCHEDULER_SIDE_DRAIN in h.backend.capabilities:
            # done at once: the scheduler takes no new work there; the job leaves at requeue
            assert state == "drained"
            assert h.backend.poll(node, key="drain:busy", progress=progress) == "drained"
            assert h.node_state(node) in ("draining", "drained")
        else:
            # trainguard's own drain: draining until the job's processes left the node
            assert state == "draining"
            assert h.node_state(node) == "draining"
            assert _drained(h, node, key="drain:busy", progress=progress) == "drained"
            assert h.node_state(node) == "drained"

    def test_a_drain_made_by_someone_else_is_kept_and_undone_only_by_force(
        self, harness: Any
    ) -> None:
        h: BackendHarness = harness
        if Capability.SCHEDULER_SIDE_DRAIN not in h.backend.capabilities:
            pytest.skip("drains live in trainguard: nobody else makes them")
        h.drain_by_others(h.idle, reason="NHC: disk full")
        state, _ = h.backend.drain(h.idle, reason="conformance", key="drain:foreign")
        assert state == "drained"
        with pytest.raises(PermanentError, match="someone else"):
            h.backend.undrain(h.idle, key="undrain:foreign")
        assert h.node_state(h.idle) == "drained"
        h.backend.undrain(h.idle, key="undrain:foreign", force=True)
        assert h.node_state(h.idle) == "active"

    # --- job steps -------------------------------------------------------------------------

    @pytest.mark.parametrize("kind", JOB_STEP_KINDS)
    def test_a_step_on_a_node_without_a_job_is_skipped(self, harness: Any, kind: str) -> None:
        h: BackendHarness = harness
        h.start_job()
        handler = {x.kind: x for x in step_handlers(h.backend)}[kind]
        outcome = handler.run(step_ctx(kind, now=h.now(), params={"node": h.idle}))
        assert outcome.done and outcome.skipped
        assert outcome.message.startswith("skipped: ")

    @pytest.mark.parametrize("kind", JOB_STEP_KINDS)
    def test_a_step_the_backend_cannot_do_is_skipped(self, harness: Any, kind: str) -> None:
        h: BackendHarness = harness
        if STEP_CAPABILITY[kind] in h.backend.capabilities:
            pytest.skip(f"the backend declares {STEP_CAPABILITY[kind].name}")
        job = h.start_job()
        params = {"node": h.job_nodes[0], "job": job, "attempt": 1, "spares": [h.spare]}
        handler = {x.kind: x for x in step_handlers(h.backend)}[kind]
        by_handler = handler.run(step_ctx(kind, now=h.now(), params=params))
        direct = step_methods(h.backend)[kind](step_ctx(kind, now=h.now(), params=params))
        for outcome in (by_handler, direct):
            assert outcome.done and outcome.skipped and "not supported" in outcome.message

    def test_a_replace_repeated_with_its_key_places_the_job_once(self, harness: Any) -> None:
        h: BackendHarness = harness
        if Capability.REPLACE not in h.backend.capabilities:
            pytest.skip("the backend does not replace nodes")
        h.start_job()
        healthy, sick = h.job_nodes
        params = {"node": sick}
        first = _finished(h, "replace", params, key="replace:once")
        assert not first.skipped
        assert sick not in first.output["nodes"] and healthy in first.output["nodes"]
        assert h.spare in first.output["nodes"]
        handler = {x.kind: x for x in step_handlers(h.backend)}["replace"]
        again = handler.run(
            step_ctx(
                "replace", now=h.now(), params=params, key="replace:once", progress=first.output
            )
        )
        assert again.done and not again.skipped
        assert again.output["nodes"] == first.output["nodes"]

    # --- views -----------------------------------------------------------------------------

    def test_job_views_show_the_schedulers_jobs_only_with_the_capability(
        self, harness: Any
    ) -> None:
        h: BackendHarness = harness
        job = h.start_job()
        views = h.backend.job_views(now=h.now())
        if Capability.EXTERNAL_JOB_VIEWS not in h.backend.capabilities:
            assert views == []  # every job is in trainguard's own job table
            return
        assert [v.name for v in views] == [job]
        assert views[0].scheduler == h.backend.name and views[0].scheduler_job_id
        assert set(views[0].nodes) == set(h.job_nodes)

    def test_job_nodes_name_the_schedulers_jobs_only_with_the_capability(
        self, harness: Any
    ) -> None:
        h: BackendHarness = harness
        job = h.start_job()
        assert h.backend.job_nodes("no-such-job") is None
        if Capability.EXTERNAL_JOB_VIEWS not in h.backend.capabilities:
            assert h.backend.job_nodes(job) is None  # the job table scopes its jobs
            return
        assert h.backend.job_nodes(job) == frozenset(h.job_nodes)


__all__ = ["BackendHarness", "BackendSuite", "step_ctx"]
