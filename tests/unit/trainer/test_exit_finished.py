"""`exit_finished`: the exit code is the one given, and what the process wrote to its
standard streams and through logging is out before it ends (no teardown runs: atexit
handlers do not)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_finished_flushes_what_was_written_and_skips_the_teardown() -> None:
    code = textwrap.dedent(
        """
        import atexit, logging, sys
        from trainguard.trainer.exiting import exit_finished
        logging.basicConfig(stream=sys.stderr, format="%(message)s")
        atexit.register(lambda: print("atexit ran", flush=True))
        sys.stdout.write("no newline yet")  # buffered: a pipe is not a tty
        logging.getLogger("job").warning("event=done")
        exit_finished(3)
        print("never")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 3
    assert done.stdout == "no newline yet"
    assert done.stderr.strip() == "event=done"
