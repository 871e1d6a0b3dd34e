"""Rules engine cost at cluster scale: SignalState.ingest per 8-GPU report and one evaluate()
tick of rules/default.yaml over N healthy nodes (8 GPUs x 18 NVLinks, 8 IB ports, 8 ranks).

Usage: .venv/bin/python bench/rules_tick.py [--nodes 2048] [--ticks 5]
Prints medians; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

from trainguard.controller.rules import EngineMemory, default_rules_path, evaluate, load_rules
from trainguard.controller.signals import SignalState
from trainguard.model import GpuSample, IbPortSample, NvLinkSample
from trainguard.protocol import RankState, Report

T0 = 1_700_000_000.0


def report(node: int, i: int) -> Report:
    gpus = tuple(
        GpuSample(
            index=g,
            uuid=f"GPU-{node}-{g}",
            pci_bus_id=f"0000:{g:02x}:00.0",
            name="H100",
            temperature_celsius=60.0 + (i + g) % 5,
            power_watts=500.0 + i % 7,
            ecc_corrected_volatile_total=0,
            ecc_uncorrected_volatile_total=0,
            remapped_rows_pending=False,
            remapped_rows_failure=False,
            throttle_hw_slowdown=False,
            throttle_hw_thermal=False,
            nvlinks=tuple(
                NvLinkSample(
                    link=k,
                    up=True,
                    crc_flit_errors_total=0,
                    crc_data_errors_total=0,
                    replay_errors_total=0,
                    recovery_errors_total=0,
                )
                for k in range(18)
            ),
        )
        for g in range(8)
    )
    ports = tuple(
        IbPortSample(
            device=f"mlx5_{p}",
            port=1,
            state_code=4,
            phys_state_code=5,
            rate_gbps=400.0,
            counters={
                "symbol_error": 0,
                "link_downed": 0,
                "port_rcv_errors": 0,
                "port_xmit_data": i * 1000,
                "port_rcv_data": i * 1000,
            },
        )
        for p in range(8)
    )
    ranks = tuple(
        RankState(
            job=f"job-{node // 64}",
            rank=(node % 64) * 8 + r,
            step=i,
            loss=2.0,
            step_time_s=0.5,
            samples_per_s=64.0,
            heartbeat_age_s=0.2,
            step_age_s=0.2,
        )
        for r in range(8)
    )
    return Report(
        node=f"node-{node}",
        instance="i",
        seq=i,
        sent_at=T0 + i,
        gpus=gpus,
        ib_ports=ports,
        ranks=ranks,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--ticks", type=int, default=5)
    args = ap.parse_args()
    rules = load_rules([default_rules_path()])
    signals = SignalState()
    signals.track(rules.history_needs())
    ingest_s: list[float] = []
    memory = EngineMemory()
    tick_s: list[float] = []
    for i in range(args.ticks):
        reports = [report(n, i) for n in range(args.nodes)]
        started = time.perf_counter()
        for rep in reports:
            signals.ingest(rep, now=T0 + i, new_events=())
        ingest_s.append((time.perf_counter() - started) / args.nodes)
        if i == 0:
            for n in range(args.nodes):
                signals.set_node_meta(f"node-{n}", role="active", state="active", job=None)
        started = time.perf_counter()
        decisions, memory = evaluate(rules=rules, signals=signals, now=T0 + i, memory=memory)
        tick_s.append(time.perf_counter() - started)
        assert not decisions, decisions[:3]
    n = args.nodes
    print(f"nodes={n} gpus={n * 8} nvlinks={n * 144} rules={len(rules.rules)}")
    print(f"ingest_ms_per_report_median={statistics.median(ingest_s[1:] or ingest_s) * 1e3:.3f}")
    steady = statistics.median(tick_s[1:] or tick_s)
    print(f"tick_ms_first={tick_s[0] * 1e3:.0f} tick_ms_median={steady * 1e3:.0f}")


if __name__ == "__main__":
    main()
