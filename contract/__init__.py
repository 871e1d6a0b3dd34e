"""trainguard: the contract every part speaks (wire schemas and their one decoder, the signal
table, clock, hardware model, XID catalog, systemd notify).

The subpackages build on it and never on each other: `trainguard.agent` (node daemon),
`trainguard.controller` (central daemon and agentctl), `trainguard.trainer` (the torch library
inside the training loop) and `trainguard.devkit` (a local cluster for demos and tests).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainguard")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"
