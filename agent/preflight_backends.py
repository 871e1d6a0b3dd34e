"""Where the preflight's compute burn and all-reduce run: child processes of the agent (the
workers agent.burn and agent.allreduce, on CUDA with real GPUs, on the CPU as a stand-in), and
for the sim backend the same children on the CPU with the sim's figures and faults on top.

A child gets a deadline; past it its whole process group is killed (a hung CUDA kernel or
collective cannot be stopped any other way), and the check fails saying so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainguard.agent.burn import DeviceBurn
from trainguard.agent.preflight_checks import Burner, Collective, CollectiveResult, WorkerError
from trainguard.agent.sim import SimHardware

# Output kept from a failed child for its error message.
STDERR_TAIL_BYTES = 400


@dataclass(frozen=True)
class WorkerRun:
    """How to start the workers: the interpreter (it needs torch for CUDA) and how long a
    child may take beyond its own measuring time (interpreter, torch and CUDA start-up)."""

    python: str = sys.executable
    startup_s: float = 120.0


def run_worker(
    module: str,
    spec: Mapping[str, Any],
    *,
    run: WorkerRun,
    seconds: float,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run `python -m <module> '<json spec>'` in its own session; its one JSON line back.
    Raises WorkerError when it fails, times out (`seconds + run.startup_s`) or answers
    nonsense."""
    timeout_s = seconds + run.startup_s
    proc = subprocess.Popen(
        [run.python, "-m", module, json.dumps(dict(spec))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # one group: the kill below reaches its ranks too
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise WorkerError(
            f"{module.rsplit('.', 1)[-1]}: no answer within {timeout_s:g} s (killed)"
        ) from None
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-STDERR_TAIL_BYTES:]
        last = tail.splitlines()[-1] if tail else ""
        raise WorkerError(f"{module.rsplit('.', 1)[-1]}: exit {proc.returncode}: {last}")
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise WorkerError(f"{module.rsplit('.', 1)[-1]}: no JSON answer") from None
    if not isinstance(answer, dict):
        raise WorkerError(f"{module.rsplit('.', 1)[-1]}: answer is not an object")
    return answer


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _cuda_env(gpus: Sequence[int]) -> dict[str, str]:
    # CUDA numbers GPUs fastest first unless told PCI order, which is NVML's
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}


class ProcessBurner:
    """The burn in a child: `device` "cuda" (each GPU itself) or "cpu" (a stand-in)."""

    def __init__(self, *, device: str, run: WorkerRun, corrupt: Sequence[int] = ()) -> None:
        self._device = device
        self._run = run
        self._corrupt = list(corrupt)

    def burn(
        self, *, gpus: Sequence[int], seconds: float, corrupt: Sequence[int] = ()
    ) -> list[DeviceBurn]:
        spec = {
            "gpus": list(gpus),
            "seconds": seconds,
            "device": self._device,
            "corrupt": [*self._corrupt, *corrupt],
        }
        env = _cuda_env(gpus) if self._device == "cuda" else {}
        answer = run_worker("trainguard.agent.burn", spec, run=self._run, seconds=seconds, env=env)
        try:
            return [DeviceBurn(**r) for r in answer["results"]]
        except (KeyError, TypeError) as e:
            raise WorkerError(f"burn: malformed answer: {e}") from None


class ProcessCollective:
    """The all-reduce in a child: NCCL among the GPUs, or gloo among two CPU processes."""

    def __init__(self, *, device: str, run: WorkerRun) -> None:
        self._device = device
        self._run = run

    def all_reduce(self, *, gpus: Sequence[int], seconds: float) -> CollectiveResult:
        cuda = self._device == "cuda"
        if cuda and len(gpus) < 2:
            return CollectiveResult(world=len(gpus), backend="nccl")
        spec = {"device": self._device, "world": len(gpus) if cuda else 0, "seconds": seconds}
        env = _cuda_env(gpus) if cuda else {}
        answer = run_worker(
            "trainguard.agent.allreduce", spec, run=self._run, seconds=seconds, env=env
        )
        try:
            return CollectiveResult(
                busbw_gbps=float(answer["busbw_gbps"]),
                world=int(answer["world"]),
                wrong=int(answer["wrong"]),
                backend=str(answer["backend"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise WorkerError(f"allreduce: malformed answer: {e}") from None


class SimBurner:
    """The sim's GPUs: the burn really runs (on the CPU) and is really checked, a GPU with the
    `sdc` fault gets a flipped bit, and each rate is what the simulated GPU reaches."""

    def __init__(self, sim: SimHardware, cpu: ProcessBurner) -> None:
        self._sim = sim
        self._cpu = cpu

    def burn(self, *, gpus: Sequence[int], seconds: float) -> list[DeviceBurn]:
        results = self._cpu.burn(gpus=gpus, seconds=seconds, corrupt=sorted(self._sim.sdc_gpus()))
        out = []
        for r in results:
            tflops = self._sim.burn_tflops(r.gpu)
            if tflops is None:
                out.append(replace(r, tflops=0.0, error="GPU is lost"))
            else:
                out.append(replace(r, tflops=tflops))
        return out


class SimCollective:
    """The sim's all-reduce: a real gloo all-reduce on the CPU, at the bandwidth the sim's
    NVLinks allow."""

    def __init__(self, sim: SimHardware, cpu: ProcessCollective) -> None:
        self._sim = sim
        self._cpu = cpu

    def all_reduce(self, *, gpus: Sequence[int], seconds: float) -> CollectiveResult:
        if len(gpus) < 2:
            return CollectiveResult(world=len(gpus), backend="sim")
        r = self._cpu.all_reduce(gpus=gpus, seconds=seconds)
        gbps = self._sim.collective_gbps()
        if gbps is None:
            return replace(r, error="a GPU is lost: the all-reduce cannot form")
        return replace(r, busbw_gbps=gbps, world=len(gpus), backend=f"sim over {r.backend}")


def build_workers(*, sim: SimHardware | None, run: WorkerRun) -> tuple[Burner, Collective]:
    """Real GPUs (CUDA children), or the sim over CPU children."""
    if sim is None:
        return ProcessBurner(device="cuda", run=run), ProcessCollective(device="cuda", run=run)
    return (
        SimBurner(sim, ProcessBurner(device="cpu", run=run)),
        SimCollective(sim, ProcessCollective(device="cpu", run=run)),
    )
