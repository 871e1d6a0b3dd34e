"""Helpers for integration tests that run a real `trainguard-controller` process: its rules,
tokens and controller.yaml files, starting it, its URL from the log, and stopping it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from tests.helpers import wait_for
from trainguard.controller.auth import hash_token
from trainguard.model import GpuSample
from trainguard.protocol import Report, encode_json

BIN = Path(sys.executable).parent
OP_TOKEN = "op-token"
AGENT_TOKEN = "agent-token"
OP = {"Authorization": f"Bearer {OP_TOKEN}"}
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}


def dbe_rules(actions: Sequence[str] = ("notify",)) -> str:
    """A rules file with one rule: an uncorrectable ECC error on a GPU runs `actions`."""
    return f"""
rules:
  - name: gpu_dbe
    scope: gpu
    condition: ecc_uncorrected_volatile_total > 0
    severity: critical
    summary: uncorrectable ECC error
    actions: [{", ".join(actions)}]
"""


def post_gpu_report(url: str, *, node: str, dbe: int, seq: int) -> None:
    """POST one agent report for `node`: GPU 0 with `dbe` uncorrectable ECC errors."""
    gpu = GpuSample(
        index=0,
        uuid="GPU-0",
        pci_bus_id="0000:18:00.0",
        name="H100",
        ecc_uncorrected_volatile_total=dbe,
    )
    report = Report(node=node, instance="i1", seq=seq, sent_at=time.time(), gpus=(gpu,))
    r = httpx.post(f"{url}/v1/reports", content=encode_json(report), headers=AGENT, timeout=10)
    assert r.status_code == 200, r.text


def write_config(
    directory: Path,
    *,
    rules: str,
    max_body_bytes: int | None = None,
    tick_interval_s: float | None = None,
    stale_after_s: float | None = None,
    extra_yaml: str = "",
    agent_tokens: Mapping[str, str] | None = None,
    store: Mapping[str, object] | None = None,
) -> Path:
    """rules.yaml, tokens.yaml (OP_TOKEN for an operator, AGENT_TOKEN shared by the agents of
    every node, allowed by api.allow_shared_agent_tokens) and controller.yaml in `directory`,
    the store in c.db there, the API on a free loopback port; `extra_yaml` (whole top-level
    sections) is appended as it is. `agent_tokens` ({node: token}): one token bound to each
    node instead of the shared one. `store`: the store section instead of {path: c.db} (a
    PostgreSQL url and password_file). Returns controller.yaml."""
    (directory / "rules.yaml").write_text(rules)
    agents = (
        f'  - {{name: agents, role: agent, sha256: "{hash_token(AGENT_TOKEN)}"}}\n'
        if agent_tokens is None
        else "".join(
            f'  - {{name: agent-{n}, role: agent, node: {n}, sha256: "{hash_token(t)}"}}\n'
            for n, t in agent_tokens.items()
        )
    )
    (directory / "tokens.yaml").write_text(
        f'tokens:\n  - {{name: ops, role: operator, sha256: "{hash_token(OP_TOKEN)}"}}\n' + agents
    )
    api = f"host: 127.0.0.1, port: 0, tokens_file: {directory / 'tokens.yaml'}"
    if agent_tokens is None:
        api += ", allow_shared_agent_tokens: true"
    if max_body_bytes is not None:
        api += f", max_body_bytes: {max_body_bytes}"
    store = store if store is not None else {"path": str(directory / "c.db")}
    text = (
        f"store: {{{', '.join(f'{k}: {v!r}' for k, v in store.items())}}}\n"
        f"rules: [{directory / 'rules.yaml'}]\n"
        f"api: {{{api}}}\n"
    )
    if tick_interval_s is not None:
        text += f"tick_interval_s: {tick_interval_s}\n"
    if stale_after_s is not None:
        text += f"stale_after_s: {stale_after_s}\n"
    cfg = directory / "controller.yaml"
    cfg.write_text(text + extra_yaml)
    return cfg


class ControllerProcess:
    """One run of the real controller with its stdout and stderr in `log_path`. Starting does
    not wait: call `wait_listening`, or use `start_controller`. `program`: what runs instead
    of the trainguard-controller script (a wrapper that calls its main), before `--config`."""

    def __init__(
        self,
        config: Path,
        *,
        log_path: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        program: Sequence[str] = (str(BIN / "trainguard-controller"),),
    ) -> None:
        self.log_path = log_path
        with log_path.open("w") as f:
            self.popen = subprocess.Popen(
                [*program, "--config", str(config), *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(
        self, *, timeout_s: float = 30.0, what: str = "the controller to listen"
    ) -> None:
        wait_for(
            lambda: "event=api_listening" in self.log() or self.popen.poll() is not None,
            timeout_s=timeout_s,
            what=what,
        )
        assert self.popen.poll() is None, self.log()

    @property
    def url(self) -> str:
        m = re.search(r"event=api_listening url=(\S+)", self.log())
        assert m, self.log()
        return m.group(1)

    def terminate(self, *, timeout_s: float = 30.0) -> int:
        """SIGTERM, then its exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is flushed or closed) if it still runs."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)


def start_controller(
    config: Path,
    *,
    log_path: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    what: str = "the controller to listen",
    program: Sequence[str] = (str(BIN / "trainguard-controller"),),
) -> ControllerProcess:
    """Start the controller and wait until it listens; a start that fails is killed."""
    proc = ControllerProcess(config, log_path=log_path, args=args, env=env, program=program)
    try:
        proc.wait_listening(timeout_s=timeout_s, what=what)
    except BaseException:
        proc.kill()
        raise
    return proc
