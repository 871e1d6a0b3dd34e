"""One rank's place in a re-formed world (docs/trainer.md, "In-process rejoin").

A plain value with no torch in it: the controller builds it, the agent relays it (a `rejoin`
Control, or a warm standby's assignment line) and the trainer joins the world it names
(trainer/rejoin.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

__all__ = ["MAX_EPOCH", "MAX_TIMEOUT_S", "MAX_WORLD_SIZE", "MEMBERSHIP_MAX_CHARS", "Membership"]

# The longest JSON form a Membership may have on the wire.
MEMBERSHIP_MAX_CHARS = 1024
MAX_WORLD_SIZE = 1_000_000
MAX_EPOCH = 2**53
MAX_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Membership:
    """One rank's place in the next world."""

    rank: int
    world_size: int
    # The rendezvous TCPStore (its server runs outside the ranks, so it outlives any of them).
    store_host: str
    store_port: int
    # The next attempt epoch: adopted by every rank of the new world; the directory's epoch is
    # raised to it, so a rank of an older epoch can never commit again.
    epoch: int
    # Bound on the rendezvous and on every collective of the new world: a peer that dies
    # during or after the rejoin is detected within it.
    timeout_s: float = 60.0
    backend: str = "gloo"
    # This rank (it must be rank 0) runs the rendezvous TCPStore itself at store_host:store_port,
    # so the new world needs nothing that outlives it; False: the store is run elsewhere.
    host_store: bool = False

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "store_port", "epoch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.store_host, str) or not 0 < len(self.store_host) <= 253:
            raise ValueError("store_host must be a host name of 1-253 characters")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool):
            raise ValueError(f"timeout_s must be a number, got {self.timeout_s!r}")
        if not isinstance(self.host_store, bool):
            raise ValueError(f"host_store must be true or false, got {self.host_store!r}")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not 0 < self.store_port < 65536:
            raise ValueError(f"store_port must be a TCP port, got {self.store_port}")
        if not 0 <= self.epoch <= MAX_EPOCH:
            raise ValueError(f"epoch must be in [0, {MAX_EPOCH}], got {self.epoch}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # NaN fails this too
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S}], got {self.timeout_s}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.host_store and self.rank != 0:
            raise ValueError(f"host_store is for rank 0 only, got rank {self.rank}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Membership:
        """Strict: an unknown or missing key is refused (ValueError naming it)."""
        if len(raw) > MEMBERSHIP_MAX_CHARS:
            raise ValueError(f"membership: longer than {MEMBERSHIP_MAX_CHARS} characters")
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"membership: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("membership: not a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"membership: unknown keys {unknown}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"membership: {e}") from None
