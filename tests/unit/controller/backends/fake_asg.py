"""FakeAsg: one region's Auto Scaling Groups in memory, recording every call (the aws
backend's AsgClient), and the instance ids of the nodes the `cloud` fixture starts with."""

from __future__ import annotations

from trainguard.controller.backends.aws.asg import GroupInstance

OLD = {"n1": "i-0a1b2c3d4e5f60001", "n2": "i-0a1b2c3d4e5f60002", "n4": "i-0a1b2c3d4e5f60004"}


class FakeAsg:
    """One region's groups: `terminate` marks the instance Terminating; `settle` lets the
    group finish (the terminated instance leaves, a replacement reaches InService)."""

    def __init__(self, group: str = "gpu-workers") -> None:
        self.group = group
        self.states: dict[str, str] = dict.fromkeys(OLD.values(), "InService")
        self.calls: list[tuple[str, str]] = []
        self.fail_next: Exception | None = None
        self._launched = 0

    def describe_instance(self, instance_id: str) -> GroupInstance | None:
        self.calls.append(("describe", instance_id))
        state = self.states.get(instance_id)
        return None if state is None else GroupInstance(instance_id, self.group, state)

    def group_instances(self, group: str) -> list[GroupInstance]:
        self.calls.append(("group", group))
        return [GroupInstance(i, group, s) for i, s in self.states.items()]

    def terminate(self, instance_id: str) -> None:
        self.calls.append(("terminate", instance_id))
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        assert self.states.get(instance_id) == "InService", f"{instance_id} terminated twice"
        self.states[instance_id] = "Terminating"

    def settle(self) -> list[str]:
        """Terminated instances leave the group; a replacement for each is InService."""
        new: list[str] = []
        for instance_id, state in list(self.states.items()):
            if state == "Terminating":
                del self.states[instance_id]
                self._launched += 1
                replacement = f"i-0feed{self._launched:012x}"
                self.states[replacement] = "InService"
                new.append(replacement)
        return new

    def terminated(self) -> list[str]:
        return [i for kind, i in self.calls if kind == "terminate"]
