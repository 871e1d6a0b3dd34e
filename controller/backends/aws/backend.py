"""The aws backend: jobs run as on the torchrun backend (the agents launch torchrun on the EC2
instances), and the nodes' machines are cloud instances in Auto Scaling Groups, so a retired
node is replaced through its group (Capability.CLOUD_REPLACE: the tick plans the
terminate_instance steps, controller.backends.aws.plan; the step is
controller.backends.aws.terminate)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from trainguard.command_args import PreflightArgs
from trainguard.controller.backends.aws.asg import AsgClient, Boto3AsgClient
from trainguard.controller.backends.aws.plan import CloudNode, ReplacementPlanner
from trainguard.controller.backends.aws.terminate import TerminateInstanceHandler
from trainguard.controller.backends.base import BackendDeps, Capability
from trainguard.controller.backends.config import AwsBackendConfig
from trainguard.controller.backends.torchrun.backend import TorchrunBackend, build_as
from trainguard.controller.livestate import LiveState
from trainguard.controller.store import Store


class AwsBackend(TorchrunBackend):
    """The torchrun backend on EC2 instances, with cloud replacement."""

    name = "aws"
    capabilities = TorchrunBackend.capabilities | {Capability.CLOUD_REPLACE}


def build(deps: BackendDeps) -> AwsBackend:
    """The registry's factory: the torchrun backend's parts, under the aws name."""
    return build_as(AwsBackend, deps)


class CloudReplacement:
    """The two parts of cloud replacement the composition root wires: the terminate_instance
    step's handler and the tick's planner. Clients are built per region on first use (the
    `aws` extra's boto3); `client_for` replaces them (tests)."""

    def __init__(
        self,
        config: AwsBackendConfig,
        *,
        store: Store,
        live: LiveState,
        wake: Callable[[], None],
        dry_run: bool,
        set_role: Callable[[str, str], None],
        preflight: PreflightArgs,
        client_for: Callable[[str], AsgClient] | None = None,
    ) -> None:
        self._config = config
        self._clients: dict[str, AsgClient] = {}
        self._client_for = client_for
        self.handler = TerminateInstanceHandler(
            client_for=self.client,
            ops=live,
            node_of_instance=lambda instance_id: _node_of_instance(
                live, label=config.instance_id_label, instance_id=instance_id
            ),
            set_role=set_role,
            preflight=preflight,
            timeout_s=config.replace_timeout_s,
            poll_interval_s=config.poll_interval_s,
        )
        self.planner = ReplacementPlanner(
            store=store,
            config=config,
            nodes=lambda: _cloud_nodes(live),
            wake=wake,
            dry_run=dry_run,
        )

    def client(self, region: str) -> AsgClient:
        client = self._clients.get(region)
        if client is None:
            if self._client_for is not None:
                client = self._client_for(region)
            else:
                client = Boto3AsgClient(
                    region=region,
                    endpoint_url=self._config.endpoint_url,
                    timeout_s=self._config.call_timeout_s,
                )
            self._clients[region] = client
        return client


def _node_of_instance(live: LiveState, *, label: str, instance_id: str) -> str | None:
    for n in live.all_nodes():
        if n.labels.get(label) == instance_id:
            return n.name
    return None


def _cloud_nodes(live: LiveState) -> Iterable[CloudNode]:
    return [
        CloudNode(
            name=n.name, state=n.state, job=n.job, labels=dict(n.labels), reason=n.drain_reason
        )
        for n in live.all_nodes()
    ]


__all__ = ["AwsBackend", "CloudReplacement", "build"]
