"""collect_stacks: which pids get SIGUSR1 (only the job's launch, only with a handler), the
bounded wait for each dump, the bounded result; plus one real process with faulthandler."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainguard.agent.commands import CommandExecutor
from trainguard.agent.stacks import collect_stacks, dump_lines, handles_signal, stacks_handler
from trainguard.clock import SYSTEM_CLOCK, FakeClock
from trainguard.protocol import Command, RankState

USR1_BIT = 1 << (signal.SIGUSR1 - 1)


class Source:
    def __init__(self, log: Path | None, launch: set[int]) -> None:
        self.log = log
        self.launch = launch

    def launch_processes(self, job: str) -> set[int]:
        return self.launch

    def log_path(self, job: str) -> Path | None:
        return self.log


def proc_tree(root: Path, pids: dict[int, int]) -> str:
    """A /proc with a status file per pid, SigCgt set to the given mask."""
    for pid, mask in pids.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "status").write_text(
            f"Name:\tpython\nPid:\t{pid}\nSigBlk:\t0000000000000000\nSigCgt:\t{mask:016x}\n"
        )
    return str(root)


def rank(r: int, pid: int, job: str = "j") -> RankState:
    return RankState(job=job, rank=r, step=5, pid=pid)


def dump(pid: int) -> str:
    return (
        f"Thread 0x00007f00000{pid} (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        f"Current thread 0x00007f11111{pid} (most recent call first):\n"
        f'  File "/job/train.py", line {pid} in main\n'
    )


def writing_signal(log: Path, sent: list[tuple[int, int]]) -> object:
    def send(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        with log.open("a") as f:
            f.write(dump(pid))

    return send


def test_only_faulthandler_lines_are_kept_from_interleaved_output() -> None:
    raw = (
        b'{"step": 7, "loss": 1.5}\n'
        b"Thread 0x00007f01 (most recent call first):\n"
        b'  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        b'{"step": 8, "loss": 1.4}\n'
        b"\n"
        b"Current thread 0x00007f02 (most recent call first):\n"
        b'  File "/job/train.py", line 88 in main\n'
        b"  <no Python frame>\n"
        b"INFO checkpoint committed\n"
    )
    assert dump_lines(raw) == (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/job/train.py", line 88 in main\n'
        "  <no Python frame>\n"
    )
    assert dump_lines(b'{"step": 9}\n') == ""


def test_handles_signal_reads_sigcgt(tmp_path: Path) -> None:
    root = proc_tree(tmp_path / "proc", {10: USR1_BIT | 1 << 14, 11: 1 << 14})
    assert handles_signal(10, signal.SIGUSR1, proc_root=root)
    assert not handles_signal(11, signal.SIGUSR1, proc_root=root)
    assert not handles_signal(12, signal.SIGUSR1, proc_root=root)  # gone


def test_each_rank_of_the_launch_is_dumped_in_rank_order(tmp_path: Path) -> None:
    log = tmp_path / "j-0.log"
    log.write_text("step 1\nstep 2\n")
    root = proc_tree(tmp_path / "proc", {101: USR1_BIT, 102: USR1_BIT})
    sent: list[tuple[int, int]] = []
    result = collect_stacks(
        job="j",
        ranks=[rank(1, 102), rank(0, 101), rank(0, 999, job="other")],
        source=Source(log, {100, 101, 102}),
        clock=FakeClock(),
        timeout_s=5.0,
        max_bytes=16384,
        send_signal=writing_signal(log, sent),  # type: ignore[arg-type]
        proc_root=root,
    )
    assert result.ok, result.message
    assert sent == [(101, signal.SIGUSR1), (102, signal.SIGUSR1)]
    stacks = result.data["stacks"]
    assert stacks.index("--- rank 0 pid 101 ---") < stacks.index("--- rank 1 pid 102 ---")
    assert 'train.py", line 101' in stacks and 'train.py", line 102' in stacks
    assert "step 1" not in stacks  # only what the dump wrote
    assert result.data["ranks"] == [
        {"rank": 0, "pid": 101, "status": "dumped"},
        {"rank": 1, "pid": 102, "status": "dumped"},
    ]


def test_a_pid_outside_the_launch_or_without_a_handler_is_never_signalled(
    tmp_path: Path,
) -> None:
    log = tmp_path / "j-0.log"
    log.write_text("")
    # 201: recycled pid (not in the launch); 202: in the launch, SIGUSR1 not handled
    root = proc_tree(tmp_path / "proc", {201: USR1_BIT, 202: 0, 203: USR1_BIT})
    sent: list[tuple[int, int]] = []
    result = collect_stacks(
        job="j",
        ranks=[rank(0, 201), rank(1, 202), rank(2, 203)],
        source=Source(log, {202, 203}),
        clock=FakeClock(),
        timeout_s=5.0,
        max_bytes=16384,
        send_signal=writing_signal(log, sent),  # type: ignore[arg-type]
        proc_root=root,
    )
    assert sent == [(203, signal.SIGUSR1)]
    assert not result.ok
    assert "rank 0: not_in_launch" in result.message and "rank 1: no_handler" in result.message
    assert "--- rank 2 pid 203 ---" in result.data["stacks"]


def test_a_rank_that_never_dumps_costs_at_most_the_timeout(tmp_path: Path) -> None:
    log = tmp_path / "j-0.log"
    log.write_text("")
    root = proc_tree(tmp_path / "proc", {301: USR1_BIT})
    clock = FakeClock()
    t0 = clock.monotonic()
    result = collect_stacks(
        job="j",
        ranks=[rank(0, 301)],
        source=Source(log, {301}),
        clock=clock,
        timeout_s=2.0,
        max_bytes=16384,
        send_signal=lambda pid, sig: None,
        proc_root=root,
    )
    assert not result.ok and "rank 0: no_dump" in result.message
    assert 2.0 <= clock.monotonic() - t0 <= 2.2


def test_the_stack_text_is_bounded(tmp_path: Path) -> None:
    log = tmp_path / "j-0.log"
    log.write_text("")
    root = proc_tree(tmp_path / "proc", {401: USR1_BIT})

    def huge_dump(pid: int, sig: int) -> None:
        with log.open("a") as f:
            f.write(
                "Thread 0x1 (most recent call first):\n" + '  File "x.py", line 1 in f\n' * 5000
            )

    result = collect_stacks(
        job="j",
        ranks=[rank(0, 401)],
        source=Source(log, {401}),
        clock=FakeClock(),
        timeout_s=5.0,
        max_bytes=4096,
        send_signal=huge_dump,
        proc_root=root,
    )
    assert result.ok
    assert len(result.data["stacks"].encode()) <= 4096
    assert "chars cut" in result.data["stacks"]


@pytest.mark.parametrize(
    ("source", "ranks", "expect"),
    [
        (Source(None, set()), [rank(0, 1)], "not running under this agent"),
        (Source(Path("/nonexistent"), {5}), [], "no rank of job 'j' heartbeats"),
    ],
    ids=["job-not-launched-here", "no-heartbeating-rank"],
)
def test_nothing_to_dump_is_a_clear_failure(
    source: Source, ranks: list[RankState], expect: str
) -> None:
    result = collect_stacks(
        job="j", ranks=ranks, source=source, clock=FakeClock(), timeout_s=1.0, max_bytes=4096
    )
    assert not result.ok and expect in result.message


def test_handler_checks_its_arguments(tmp_path: Path) -> None:
    ex = CommandExecutor(
        stacks_handler(
            source=Source(None, set()),
            ranks=lambda: (),
            clock=FakeClock(),
            timeout_s=1.0,
            max_bytes=4096,
        )
    )
    bad = ex.execute(Command(id="c1", kind="collect_stacks", args={}))  # type: ignore[arg-type]
    assert not bad.ok and bad.message == "args.job: required non-empty string"
    typo = ex.execute(Command(id="c2", kind="collect_stacks", args={"job": "j", "jbo": 1}))  # type: ignore[arg-type]
    assert not typo.ok and "args.jbo: unknown key" in typo.message


def test_a_real_process_with_faulthandler_dumps_its_stack(tmp_path: Path) -> None:
    log = tmp_path / "j-0.log"
    program = (
        "import faulthandler, signal, sys, time\n"
        "faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)\n"
        "def waiting_in_the_loop():\n"
        "    print('ready', file=sys.stderr, flush=True)\n"
        "    time.sleep(60)\n"
        "waiting_in_the_loop()\n"
    )
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", program], stderr=out)
    try:

        def ready() -> bool:
            assert proc.poll() is None, "child exited early"
            return "ready" in log.read_text()

        wait_for(ready, timeout_s=15, what="the child to print ready")
        result = collect_stacks(
            job="j",
            ranks=[rank(0, proc.pid)],
            source=Source(log, {proc.pid}),
            clock=SYSTEM_CLOCK,
            timeout_s=10.0,
            max_bytes=16384,
        )
        assert result.ok, result.message
        assert "in waiting_in_the_loop" in result.data["stacks"]
        assert proc.poll() is None  # dumped, not killed
    finally:
        proc.kill()
        proc.wait(timeout=10)
