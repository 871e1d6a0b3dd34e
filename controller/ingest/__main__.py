"""`python -m trainguard.controller.ingest --worker N ...`: one ingest worker process (the
controller starts these itself; see trainguard.controller.ingest.worker)."""

from __future__ import annotations

import sys

from trainguard.controller.ingest.worker import main

if __name__ == "__main__":
    sys.exit(main())
