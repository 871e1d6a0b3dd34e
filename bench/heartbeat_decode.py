"""Decoding one trainer heartbeat datagram: the cost per datagram of the agent's decoder.

Times `trainguard.protocol.decode_json(Heartbeat, raw)` (the one compiled decoder, what the
agent's heartbeat reader runs) on a typical 320-byte heartbeat, and `json.loads(raw)` alone
beside it: the floor that any decoder written by hand in Python pays before it has checked a
single field. Blocks of calls alternate between the two; the figure is the median block.

    .venv/bin/python bench/heartbeat_decode.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from trainguard.protocol import Heartbeat, decode_json, encode_json

HEARTBEAT = Heartbeat(
    job="train-llama",
    rank=3,
    step=12345,
    t=1.7e9,
    local_rank=3,
    world_size=16,
    pid=4242,
    loss=2.31,
    grad_norm=0.9,
    samples_per_s=812.5,
    tokens_per_s=1.6e6,
    step_time_s=0.41,
    compute_time_s=0.33,
    phase="train",
    ckpt_step=12000,
    control_socket="/run/trainguard/ctl-3.sock",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--block", type=int, default=2000, help="calls per timed block")
    args = ap.parse_args()
    raw = encode_json(HEARTBEAT)
    assert decode_json(Heartbeat, raw) == HEARTBEAT
    variants: dict[str, Callable[[], Any]] = {
        "compiled_decode_json": lambda: decode_json(Heartbeat, raw),
        "json_loads_only": lambda: json.loads(raw),
    }
    per_call: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(args.block):
                fn()
            per_call[name].append((time.perf_counter() - t0) / args.block)
    out: dict[str, Any] = {"heartbeat_bytes": len(raw)}
    for name, times in per_call.items():
        out[f"{name}_median_us"] = round(statistics.median(times) * 1e6, 2)
        out[f"{name}_min_us"] = round(min(times) * 1e6, 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
