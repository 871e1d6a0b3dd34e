"""`exit_finished`: leave a finished distributed training process without the interpreter's
teardown.

torch's gloo worker threads can still be releasing the last collective's work (tensors that
own Python objects) when the main thread returns from `main()`; once the interpreter is
finalizing, such a thread cannot take the GIL, its forced exit unwinds through a C++
destructor and the process aborts with SIGABRT ("terminate called without an active
exception"). torchrun then reports a job that trained, saved and stopped as failed. A loop
the job owns avoids it with `dist.destroy_process_group()` after `Trainguard.close()`; a
framework's loop (the HF Trainer's last `store_flos` all-gather, Lightning's teardown) leaves
the default group to the teardown, and destroying it there can hang on a peer that already
left. Ending the process at once, after flushing what it wrote, does neither.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_finished"]


def exit_finished(code: int = 0) -> NoReturn:
    """Flush the logging handlers and standard streams, then end the process with `code`
    without the interpreter's teardown (no atexit handlers, no finalizers). Call it last, once
    training returned and everything the job writes is closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush
            pass
    os._exit(code)
