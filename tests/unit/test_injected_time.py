"""Time is injected (STYLE.md, 2): the agent and the controller read the clock only through a
`Clock` (trainguard.clock: `now()`, `monotonic()`, `sleep()`), so a test drives them on a
FakeClock. An AST scan finds every other read of the clock in agent/ and controller/.

Allowed without an entry:
- `time.perf_counter()` (and `_ns`): how long our own code took, observed into a histogram or
  a log line. It measures the code, not the world the Clock models (on a FakeClock every such
  duration would read 0 and hide a slow tick), and no decision is taken on it; a deadline, an
  interval, an age or a timestamp is a Clock read.
- converting a time the code already has: `time.gmtime(ts)`, `time.localtime(ts)`,
  `time.strftime(fmt, struct)` (with the argument: without it they read the clock).
Everything else is on ALLOWED below, with its reason."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("agent", "controller")

MEASURES_CODE = {"perf_counter", "perf_counter_ns"}
# time function -> how many positional arguments make it a pure conversion
CONVERTS = {"gmtime": 1, "localtime": 1, "strftime": 2}
# calls on datetime/date that read the clock
DATETIME_READS = {"now", "utcnow", "today"}

# (file, what) -> why it may read time itself
ALLOWED: dict[tuple[str, str], str] = {
    ("agent/jobwrap.py", "time.monotonic"): "the launch wrapper is a process of its own, "
    "standard library only by design (it imports nothing of trainguard); its bounded wait "
    "for SIGKILLed leftovers is real time",
    ("agent/jobwrap.py", "time.sleep"): "the launch wrapper's poll between SIGKILL rounds "
    "(see its time.monotonic entry)",
    ("controller/ingest/frontend.py", "time.sleep"): "time.sleep(0) hands the GIL to the "
    "tick thread between back-to-back ingests: a yield, not a wait",
    ("controller/maintenance.py", "datetime.now"): "APScheduler runs its jobs on the real "
    "clock: their first and next run times are real datetimes (a FakeClock's date would make "
    "every job overdue at once)",
}


@dataclass(frozen=True)
class Read:
    file: str
    line: int
    what: str  # "time.monotonic", "from time import", "datetime.now", ...


def _time_names(tree: ast.Module) -> set[str]:
    """The names the module binds to the time module (`import time`)."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "time"
    }


def _is_datetime(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("datetime", "date")
    return isinstance(node, ast.Attribute) and node.attr in ("datetime", "date")


def clock_reads(path: Path, *, name: str) -> Iterator[Read]:
    """Every read of the clock in one file that does not go through a Clock."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    time_names = _time_names(tree)
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "time" and node.level == 0:
            yield Read(name, node.lineno, "from time import")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "time" and alias.asname not in (None, "time"):
                    yield Read(name, node.lineno, f"import time as {alias.asname}")
        elif isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id in time_names:
                if node.attr in MEASURES_CODE:
                    continue
                call = calls.get(id(node))
                if node.attr in CONVERTS and call is not None:
                    if len(call.args) >= CONVERTS[node.attr]:
                        continue
                yield Read(name, node.lineno, f"time.{node.attr}")
            elif node.attr in DATETIME_READS and _is_datetime(value):
                yield Read(name, node.lineno, f"datetime.{node.attr}")


def _all_reads() -> list[Read]:
    return [
        read
        for folder in SCANNED
        for f in sorted((REPO / folder).rglob("*.py"))
        for read in clock_reads(f, name=str(f.relative_to(REPO)))
    ]


READS = _all_reads()


def test_agent_and_controller_read_time_only_through_the_injected_clock() -> None:
    bad = [f"{r.file}:{r.line} {r.what}" for r in READS if (r.file, r.what) not in ALLOWED]
    assert not bad, (
        "read the time through the Clock the code is given (trainguard.clock; a module "
        "without one takes `clock: Clock = SYSTEM_CLOCK`), or add the read to ALLOWED in "
        "tests/unit/test_injected_time.py with the reason:\n" + "\n".join(bad)
    )


def test_every_allowed_read_still_exists() -> None:
    """An entry whose read is gone (moved to the Clock, or the code moved) is deleted, so the
    list only shrinks."""
    found = {(r.file, r.what) for r in READS}
    assert not [k for k in ALLOWED if k not in found], [k for k in ALLOWED if k not in found]


def test_the_scan_finds_every_kind_of_clock_read(tmp_path: Path) -> None:
    f = tmp_path / "probe.py"
    f.write_text(
        "import time\n"
        "import time as t\n"
        "from time import monotonic\n"
        "from datetime import datetime, timezone\n"
        "import datetime as dt\n"
        "a = time.monotonic()\n"
        "b = time.time()\n"
        "time.sleep(1)\n"
        "c = time.strftime('%H')\n"
        "d = time.gmtime()\n"
        "e = datetime.now(timezone.utc)\n"
        "f = dt.date.today()\n"
        "g = t.monotonic\n"
        # allowed: measuring code, converting a time we have
        "h = time.perf_counter()\n"
        "i = time.strftime('%H', time.gmtime(b))\n"
        "j = time.localtime(b)\n"
    )
    found = [(r.line, r.what) for r in clock_reads(f, name="probe.py")]
    assert sorted(found) == [
        (2, "import time as t"),
        (3, "from time import"),
        (6, "time.monotonic"),
        (7, "time.time"),
        (8, "time.sleep"),
        (9, "time.strftime"),
        (10, "time.gmtime"),
        (11, "datetime.now"),
        (12, "datetime.today"),
        (13, "time.monotonic"),
    ]
