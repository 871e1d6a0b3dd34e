"""Builders of the contract values tests feed a controller: a GPU sample, and successive
reports of one node the way its agent would send them."""

from __future__ import annotations

from trainguard.model import GpuSample
from trainguard.protocol import Event, JobProcess, Report


def gpu(index: int = 0, *, dbe: int = 0, temp: float = 50.0) -> GpuSample:
    """GPU `index` of an H100 node: `dbe` uncorrectable ECC errors, `temp` degrees Celsius."""
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        pci_bus_id=f"0000:{index:02x}:00.0",
        name="H100",
        temperature_celsius=temp,
        ecc_uncorrected_volatile_total=dbe,
    )


class Reporter:
    """Builds successive reports for one node the way an agent would."""

    def __init__(self, node: str, *, instance: str = "inst-1", role: str | None = None) -> None:
        self.node = node
        self.instance = instance
        self.role = role
        self.seq = 0

    def report(
        self,
        *,
        now: float,
        dbe: int = 0,
        temp: float = 50.0,
        events: tuple[Event, ...] = (),
        job: str | None = None,
    ) -> Report:
        self.seq += 1
        jobs = (JobProcess(job=job, attempt=1, state="running", pid=100),) if job else ()
        return Report(
            node=self.node,
            instance=self.instance,
            seq=self.seq,
            sent_at=now,
            role_hint=self.role,  # type: ignore[arg-type]
            gpus=(gpu(0, dbe=dbe, temp=temp),),
            jobs=jobs,
            events=events,
        )
