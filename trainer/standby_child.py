"""The warm standby process: imports torch and the job's entry module, writes its ready file, then
waits on stdin for its assignment and runs the entry module.

The assignment is one line: a Membership as JSON, or `{"membership": {...}, "env": {...}}` when
the agent hands the rank its job's environment too (TRAINGUARD_JOB, the agent socket, the
checkpoint directory, ...: the standby was started before its job was known).

Started by the agent's standby pool (agent/standby.py) in the job's interpreter:
`python -m trainguard.trainer.standby_child --ready-file PATH MODULE [ARGS...]`; the agent
itself never loads torch. CUDA stays uninitialised until
the assignment (importing torch does not create a CUDA context).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

from trainguard.membership import Membership

MEMBERSHIP_ENV = "TRAINGUARD_MEMBERSHIP"


def parse_assignment(line: str) -> tuple[Membership, dict[str, str]]:
    """(membership, environment to add) from the assignment line; ValueError if malformed."""
    data = json.loads(line)
    if not isinstance(data, dict) or "membership" not in data:
        return Membership.from_json(line), {}
    unknown = sorted(set(data) - {"membership", "env"})
    env = data.get("env", {})
    if unknown or not isinstance(env, dict):
        raise ValueError(f"assignment: unknown keys {unknown} or env not an object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("assignment: env must map names to strings")
    return Membership.from_json(json.dumps(data["membership"])), env


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--ready-file":
        print("usage: standby_child --ready-file PATH MODULE [ARGS...]", file=sys.stderr)
        return 2
    ready, module, args = argv[1], argv[2], argv[3:]
    # deferred heavy imports: the point of a warm standby is to pay for them before it is needed
    import torch  # noqa: F401, PLC0415 (imported here: paid before the assignment, by design)

    importlib.import_module(module)
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the agent closed stdin: stopped before any assignment
    membership, env = parse_assignment(line)
    os.environ.update(env)
    os.environ[MEMBERSHIP_ENV] = membership.to_json()
    sys.argv = [module, *args, "--membership", membership.to_json()]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
