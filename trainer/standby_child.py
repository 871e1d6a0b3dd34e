"""The warm standby process: imports torch and the job's entry module, writes its ready file, then
waits on stdin for its assignment (one line of Membership JSON) and runs the entry module.

Started by the agent's standby pool (agent/standby.py) in the job's interpreter:
`python -m trainguard.trainer.standby_child --ready-file PATH MODULE [ARGS...]`; the agent
itself never loads torch. CUDA stays uninitialised until
the assignment (importing torch does not create a CUDA context).
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

MEMBERSHIP_ENV = "TRAINGUARD_MEMBERSHIP"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--ready-file":
        print("usage: standby_child --ready-file PATH MODULE [ARGS...]", file=sys.stderr)
        return 2
    ready, module, args = argv[1], argv[2], argv[3:]
    # deferred heavy imports: the point of a warm standby is to pay for them before it is needed
    import torch  # noqa: F401, PLC0415 (imported here: paid before the assignment, by design)

    from trainguard.membership import Membership  # noqa: PLC0415

    importlib.import_module(module)
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the agent closed stdin: stopped before any assignment
    membership = Membership.from_json(line)
    os.environ[MEMBERSHIP_ENV] = membership.to_json()
    sys.argv = [module, *args, "--membership", membership.to_json()]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
