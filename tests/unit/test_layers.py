"""The import layers (DESIGN.md, "Layout"), relative imports resolved and checked like absolute
ones:
- between the parts: the contract at the bottom imports none of them; agent and controller
  never import each other; the trainer imports only the contract;
- third-party libraries: each part imports, when it is imported, only its own extra's libraries
  (pyproject.toml): an agent module imports on a node installed with `[agent]` (no web server,
  no scheduler, no PostgreSQL driver), the trainer on a training image (nothing of the agent's
  or controller's extras), the controller without torch or pynvml; pynvml, boto3 and psycopg
  are imported only inside the function that uses them;
- inside the controller: contract <- base <- store <- state <- rules <- actions <- services
  <- top; a module imports only from its own layer or those below it (CONTROLLER_LAYER_OF)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# folder in the checkout -> installed package
FOLDERS = {
    "contract": "trainguard",
    "agent": "trainguard.agent",
    "controller": "trainguard.controller",
    "trainer": "trainguard.trainer",
    "devkit": "trainguard.devkit",
    "rules": "trainguard.rules",
}
PARTS = ("agent", "controller", "trainer", "devkit")

# layer -> the trainguard parts it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "contract": PARTS,
    "rules": (*PARTS, "contract"),
    "agent": ("controller", "trainer", "devkit"),
    "controller": ("agent", "trainer", "devkit"),
    "trainer": ("agent", "controller", "devkit"),
    "devkit": ("trainer",),
}


# --- the scanner ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    module: str  # absolute, relative imports resolved
    names: tuple[str, ...] = ()  # `from module import names` (empty for `import module`)
    top_level: bool = True  # executed when the importing module is imported

    @property
    def candidates(self) -> tuple[str, ...]:
        """What the statement may bring in: the module and, for `from m import x`, `m.x` (a
        submodule when x is one: `from trainguard import agent`)."""
        return (self.module, *(f"{self.module}.{n}" for n in self.names if n != "*"))


def module_name(path: Path) -> str:
    """The installed name of a file in the checkout (a package's `__init__` is the package)."""
    folder, *rest = path.relative_to(REPO).with_suffix("").parts
    if rest and rest[-1] == "__init__":
        rest = rest[:-1]
    return ".".join((FOLDERS[folder], *rest))


def _resolve(node: ast.ImportFrom, *, module: str, is_package: bool) -> str:
    """The absolute module of a `from` import; a relative one is resolved against `module`
    as Python does (`from . import x` in a package's `__init__` is the package itself)."""
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    parts = package.split(".") if package else []
    if node.level - 1 >= len(parts):
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(path: Path, *, module: str | None = None) -> list[Import]:
    """Every import in a file. `module` is its installed name (derived from the path for the
    checkout's files); relative imports are resolved against it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    module = module_name(path) if module is None else module
    is_package = path.name == "__init__.py"
    out: list[Import] = []

    def visit(node: ast.AST, *, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    out.append(Import(name, child.lineno, alias.name, top_level=top))
            elif isinstance(child, ast.ImportFrom):
                resolved = _resolve(child, module=module, is_package=is_package)
                names = tuple(a.name for a in child.names)
                out.append(Import(name, child.lineno, resolved, names, top_level=top))
            visit(child, top=inner)

    visit(tree, top=True)
    return out


def _part_of(module: str) -> str | None:
    """Which layer an imported trainguard module belongs to (None: not trainguard)."""
    if module != "trainguard" and not module.startswith("trainguard."):
        return None
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in (*PARTS, "rules"):
        return parts[1]
    return "contract"


def _parts_imported(i: Import) -> set[str]:
    return {p for p in map(_part_of, i.candidates) if p is not None}


def _files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


IMPORTS = {folder: [i for f in _files(folder) for i in _imports(f)] for folder in FOLDERS}


# --- between the parts ------------------------------------------------------------------------


@pytest.mark.parametrize("layer", list(FORBIDDEN), ids=list(FORBIDDEN))
def test_layer_imports_only_what_lies_below_it(layer: str) -> None:
    bad = [
        f"{i.file}:{i.line} imports {i.module}"
        for i in IMPORTS[layer]
        if _parts_imported(i) & set(FORBIDDEN[layer])
    ]
    assert not bad, f"{layer} must not import {FORBIDDEN[layer]}:\n" + "\n".join(bad)


def test_no_repository_folder_shadows_the_installed_namespace() -> None:
    # A folder named like the package at the root wins over the package-dir mapping.
    assert not (REPO / "trainguard").exists()


def test_the_part_checker_catches_a_violation_absolute_or_relative(tmp_path: Path) -> None:
    """The scanner itself: a contract module importing the agent (absolutely, relatively, or
    as a name of the namespace package), and a top-level torch import, are all found (a
    scanner that found nothing would pass every test above)."""
    f = tmp_path / "probe.py"
    f.write_text(
        "import torch\n"
        "from trainguard.agent import daemon\n"
        "from . import agent\n"
        "from .controller.store import Store\n"
        "\n"
        "def g():\n"
        "    import boto3\n"
    )
    found = _imports(f, module="trainguard.probe")
    assert [(i.module, i.names, i.top_level) for i in found] == [
        ("torch", (), True),
        ("trainguard.agent", ("daemon",), True),
        ("trainguard", ("agent",), True),
        ("trainguard.controller.store", ("Store",), True),
        ("boto3", (), False),
    ]
    assert [sorted(_parts_imported(i)) for i in found[1:4]] == [
        ["agent"],
        ["agent", "contract"],
        ["controller"],
    ]
    assert _part_of("trainguard.agent") == "agent"
    assert _part_of("trainguard.strict") == "contract"


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("from . import x", "tg.ctl.tick", False, "tg.ctl"),
        ("from .store import y", "tg.ctl.tick", False, "tg.ctl.store"),
        ("from . import x", "tg.ctl.actions", True, "tg.ctl.actions"),
        ("from .base import y", "tg.ctl.actions", True, "tg.ctl.actions.base"),
        ("from ..jobs import y", "tg.ctl.actions.drain", False, "tg.ctl.jobs"),
        ("from ...agent import y", "tg.ctl.actions.drain", False, "tg.agent"),
        ("from tg.clock import y", "tg.agent.daemon", False, "tg.clock"),
    ],
)
def test_relative_imports_resolve_as_python_resolves_them(
    source: str, module: str, is_package: bool, expected: str
) -> None:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve(node, module=module, is_package=is_package) == expected


def test_a_relative_import_beyond_the_top_level_package_is_an_error() -> None:
    node = ast.parse("from ... import x").body[0]
    assert isinstance(node, ast.ImportFrom)
    with pytest.raises(ValueError, match="beyond the top-level package"):
        _resolve(node, module="trainguard.agent.daemon", is_package=False)


def test_module_names_follow_the_package_dir_mapping() -> None:
    assert module_name(REPO / "contract" / "clock.py") == "trainguard.clock"
    assert module_name(REPO / "contract" / "__init__.py") == "trainguard"
    assert module_name(REPO / "controller" / "actions" / "base.py") == (
        "trainguard.controller.actions.base"
    )
    assert module_name(REPO / "controller" / "actions" / "__init__.py") == (
        "trainguard.controller.actions"
    )


# --- third-party libraries: each part imports only its own extra ------------------------------

# distribution in a pyproject extra -> the import names it (and what it pulls in) provides
EXTRA_IMPORTS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "numpy": ("numpy",),
    "nvidia-ml-py": ("pynvml",),
    "fastapi": ("fastapi", "starlette"),
    "uvicorn": ("uvicorn",),
    "httptools": ("httptools",),
    "uvloop": ("uvloop",),
    "apscheduler": ("apscheduler",),
    "boto3": ("boto3", "botocore"),
    "psycopg": ("psycopg", "psycopg2", "psycopg_binary", "psycopg_pool"),
}
# the extras that are machines (README, "Install"); `all` is their union, `dev` test tools
MACHINE_EXTRAS = ("trainer", "agent", "controller", "aws", "postgres")
# part -> the extras whose libraries it may import when it is imported (every other extra's
# library is imported inside the function that uses it, if at all): the agent's pynvml, the
# trainer's and the controller's boto3 and the store's psycopg are all lazy
IMPORT_TIME_EXTRAS: dict[str, tuple[str, ...]] = {
    "contract": (),
    "rules": (),
    "agent": (),
    "controller": ("controller",),
    "trainer": ("trainer",),
    "devkit": (),
}


def _requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group(0).lower()


def _extras() -> dict[str, tuple[str, ...]]:
    """Extra -> the import names of its distributions, from pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    out: dict[str, tuple[str, ...]] = {}
    for extra in MACHINE_EXTRAS:
        dists = [_requirement_name(r) for r in declared[extra]]
        unknown = [d for d in dists if d not in EXTRA_IMPORTS]
        assert not unknown, (
            f"extra [{extra}] needs {unknown}: add their import names to EXTRA_IMPORTS"
        )
        out[extra] = tuple(n for d in dists for n in EXTRA_IMPORTS[d])
    return out


def _blocked(part: str) -> list[str]:
    """The libraries `part` must not import when it is imported."""
    allowed = IMPORT_TIME_EXTRAS[part]
    return sorted({n for extra, names in _extras().items() if extra not in allowed for n in names})


def test_every_extra_is_known_and_the_agent_never_needs_the_controller_extra() -> None:
    extras = _extras()
    assert {"fastapi", "starlette", "uvicorn", "httptools", "uvloop", "apscheduler"} <= set(
        extras["controller"]
    )
    assert {"psycopg", "psycopg2"} <= set(extras["postgres"])
    for name in (*extras["controller"], *extras["postgres"], "torch", "numpy", "pynvml"):
        assert name in _blocked("agent")
        assert name in _blocked("contract")
    for name in (*extras["agent"], *extras["controller"], *extras["postgres"], "boto3"):
        assert name in _blocked("trainer")
    assert {"torch", "numpy", "pynvml", "boto3", "psycopg"} <= set(_blocked("controller"))


def _top_level_imports_of(imports: Iterable[Import], blocked: Iterable[str]) -> list[str]:
    banned = set(blocked)
    return [
        f"{i.file}:{i.line} imports {i.module} at module level"
        for i in imports
        if i.top_level and i.module.split(".")[0] in banned
    ]


@pytest.mark.parametrize("part", list(IMPORT_TIME_EXTRAS))
def test_no_module_imports_another_extras_library_at_module_level(part: str) -> None:
    bad = _top_level_imports_of(IMPORTS[part], _blocked(part))
    assert not bad, "\n".join(bad)


IMPORT_PART = """
import importlib, json, pkgutil, sys
blocked, package, parts = json.loads(sys.argv[1])
for name in blocked:
    sys.modules[name] = None  # `import name` raises ImportError, as where it is not installed
root = importlib.import_module(package)
names = [package]
if package == "trainguard":  # the contract: the namespace's own modules, not the parts
    infos = [i for i in pkgutil.iter_modules(root.__path__, "trainguard.")
             if i.name.split(".")[1] not in (*parts, "rules")]
else:
    infos = list(pkgutil.walk_packages(root.__path__, package + "."))
for info in infos:
    importlib.import_module(info.name)
    names.append(info.name)
others = sorted(p for p in parts
                if "trainguard." + p in sys.modules and "trainguard." + p != package)
print(json.dumps({"modules": names, "parts_imported": others}))
"""


def _import_part(part: str, blocked: Iterable[str]) -> dict[str, list[str]]:
    arg = json.dumps([sorted(blocked), FOLDERS[part], list(PARTS)])
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PART, arg],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, list[str]] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("part", list(IMPORT_TIME_EXTRAS))
def test_every_module_of_a_part_imports_without_the_other_extras_installed(part: str) -> None:
    """Each module imported in a process where every library outside the part's own extra is
    missing: the agent on a node installed with `[agent]`, the trainer on a training image,
    the controller without torch or pynvml."""
    result = _import_part(part, _blocked(part))
    assert sorted(result["modules"]) == sorted(module_name(f) for f in _files(part))
    assert result["parts_imported"] == [], f"importing {part} pulled in other parts"


def test_the_import_check_fails_when_a_module_needs_a_blocked_library() -> None:
    """The runtime check itself: the controller's API module needs FastAPI, so with the
    controller extra blocked, importing the controller fails."""
    with pytest.raises(AssertionError, match="fastapi"):
        _import_part("controller", ["fastapi"])


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """pyproject lists the packages explicitly (package-dir mapping); a new subpackage that is
    not listed works in a checkout but is missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for folder, package in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *rel)))
    assert found == listed


# --- inside the controller ----------------------------------------------------------------------

# lowest first; a module imports only from its own layer and the layers below it (and the
# contract, below them all)
CONTROLLER_LAYERS = (
    "base",  # the controller's vocabulary: config, errors, read models, its metrics
    "store",  # durable state: the store, its SQL dialects, the lease that fences it, backup
    "state",  # what is known now: live node state, signals, jobs
    "rules",  # deciding: the rules engine, incidents, the safety rails
    "actions",  # doing: the action steps and the scheduler backends they drive
    "services",  # the services the composition root wires: reports, ticks, queries, ...
    "top",  # the edges and the composition root: API, ingest, agentctl, main, HA
)
# module-name prefix (dotted, below trainguard.controller; matched by whole components, the
# longest wins) -> layer. A new or moved module matching no prefix fails the test below.
CONTROLLER_LAYER_OF: dict[str, str] = {
    "": "base",  # the package itself: imports nothing of its own
    "config": "base",
    "backends.config": "base",  # the `backend:` config section, part of the config
    "errors": "base",
    "views": "base",
    "metrics": "base",
    "records": "base",  # the store's record types: plain dataclasses every layer reads
    "hostlist": "base",  # Slurm hostlist expressions: the Slurm backend and the token tools
    "storeurl": "base",  # store.url's schemes and password rule: the config checks them
    "actionkinds": "base",  # the ActionKind table: rules, jobs and actions all ask it
    "nodestate": "base",  # the NodeState table: the store, metrics and the drain steps ask it
    "ckptinterval": "base",  # Young/Daly and the expected waste: pure arithmetic
    "failurecost": "base",  # GPU-hours and money lost to failures: pure arithmetic
    "ckptspec": "base",  # a job spec's checkpoint block and the launch environment it becomes
    "recoveryspec": "base",  # a job spec's recovery block (in-process recovery opt-in)
    "store": "store",
    "backup": "store",
    "livestate": "state",
    "jobnames": "state",  # the budget of job names a node introduces, and their expiry
    "signals": "state",
    "jobs": "state",
    "jobstate": "state",
    "unknownxids": "state",  # XID codes the catalog does not list, per node
    "lemons": "state",  # the per-node hardware incident history and the lemon verdict
    "ckptadvisor": "state",  # each job's checkpoint interval advice from what was measured
    "ckptauto": "state",  # checkpoint.interval auto: the advice decided on and sent to the ranks
    "repairplan": "state",  # the lifecycle's repair after a hardware drain: rows and rate limit
    "rules": "rules",
    "model": "rules",  # what a rule is about and what the engine decided
    "incidents": "rules",
    "safety": "rules",  # the verdicts between a decision and an action (incidents ask them)
    "growplan": "rules",  # which shrunk jobs grow back: a pure planner over snapshots
    "actions": "actions",
    "actions.inprocess": "actions",  # the in-process recovery within the restart step
    "backends": "actions",
    "reports": "services",
    "jobscope": "services",  # what a report may say about which job (the ingest stage asks)
    "stallguard": "services",  # the tick's own stall, and the grace it gives the nodes
    "queries": "services",
    "operations": "services",
    "tick": "services",
    "maintenance": "services",
    "storewatch": "services",
    "service": "services",
    "api": "top",
    "auth": "top",
    "tlsauth": "top",
    "tokenissue": "top",
    "scrapetargets": "top",  # Prometheus file_sd target files (trainguard-controller targets)
    "ingest": "top",
    "runtime": "top",
    "watchdog": "top",
    "cli": "top",
    "completion": "top",
    "composition": "top",  # the composition root
    "connlimits": "top",  # connection and body limits, around the app and its server
    "ha": "top",
    "main": "top",
}
# Today's imports against the layering, each kept on purpose until its fix lands:
# (importing module prefix, imported module prefix) -> why. An entry that no longer matches
# any import fails the test (delete it), so this list only shrinks.
CONTROLLER_LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("incidents", "actions"): "incidents plan actions: the handler registry a plan is checked "
    "against (actions.base) and a step's label in the incident timeline "
    "(actions.worker.step_label); the registry and the labels belong below the rules layer "
    "beside the ActionKind table (actionkinds)",
}


def _component_prefix(prefix: str, name: str) -> bool:
    return prefix == name or (prefix != "" and name.startswith(prefix + "."))


def _longest_prefix(name: str, prefixes: Iterable[str]) -> str | None:
    matching = [p for p in prefixes if _component_prefix(p, name)]
    return max(matching, key=len, default=None)


@dataclass
class Layering:
    violations: list[str] = field(default_factory=list)  # not excepted
    unmapped: list[str] = field(default_factory=list)  # modules in no layer
    excepted: list[str] = field(default_factory=list)  # violations on the exception list
    unused_exceptions: list[tuple[str, str]] = field(default_factory=list)
    unused_prefixes: list[str] = field(default_factory=list)


def check_layering(
    modules: Mapping[str, list[Import]],
    *,
    package: str,
    layers: tuple[str, ...],
    layer_of: Mapping[str, str],
    exceptions: Mapping[tuple[str, str], str],
) -> Layering:
    """`modules`: each module's name below `package` ("" for the package itself) and its
    imports. Every import of a module of `package` (absolute or relative, at any depth, a
    function-level one too) must go to the same layer or a lower one. Importing a module runs
    the `__init__` of every package above it first, so those imports count as the module's
    own: a low module kept in a higher package needs that package's `__init__` to stay low."""
    rank = {layer: n for n, layer in enumerate(layers)}
    assert set(layer_of.values()) <= set(rank), set(layer_of.values()) - set(rank)
    out = Layering()
    used_prefixes: set[str] = set()
    used_exceptions: set[tuple[str, str]] = set()

    def local(module: str) -> str | None:
        if module == package:
            return ""
        if module.startswith(package + "."):
            return module[len(package) + 1 :]
        return None

    def layer(name: str) -> str | None:
        prefix = _longest_prefix(name, layer_of)
        if prefix is None:
            return None
        used_prefixes.add(prefix)
        return layer_of[prefix]

    for name in sorted(modules):
        if layer(name) is None:
            out.unmapped.append(f"{package}.{name}" if name else package)
    for name in sorted(modules):
        own = layer(name)
        if own is None:
            continue
        parts = name.split(".") if name else []
        packages = [".".join(parts[:n]) for n in range(len(parts))]  # "", "a", "a.b", ...
        for source in (*[p for p in packages if p in modules], name):
            via = "" if source == name else f" on importing {package}.{name}"
            for i in modules[source]:
                # `from package.x import y` imports the module package.x.y when there is one
                targets = [local(c) for c in i.candidates[1:] if local(c) in modules] or [
                    local(i.module)
                ]
                for target in targets:
                    if target is None or (there := layer(target)) is None:
                        continue
                    if rank[there] <= rank[own]:
                        continue
                    what = f"{i.file}:{i.line} ({own}{via}) imports {package}.{target} ({there})"
                    key = next(
                        (
                            k
                            for k in exceptions
                            if _component_prefix(k[0], name) and _component_prefix(k[1], target)
                        ),
                        None,
                    )
                    if key is None:
                        out.violations.append(what)
                    else:
                        used_exceptions.add(key)
                        out.excepted.append(f"{what}: {exceptions[key]}")
    out.unused_exceptions = [k for k in exceptions if k not in used_exceptions]
    out.unused_prefixes = [p for p in layer_of if p not in used_prefixes]
    return out


def _controller_modules() -> dict[str, list[Import]]:
    package = FOLDERS["controller"]
    out: dict[str, list[Import]] = {}
    for f in _files("controller"):
        name = module_name(f)
        out[name[len(package) + 1 :] if name != package else ""] = _imports(f)
    return out


CONTROLLER = check_layering(
    _controller_modules(),
    package=FOLDERS["controller"],
    layers=CONTROLLER_LAYERS,
    layer_of=CONTROLLER_LAYER_OF,
    exceptions=CONTROLLER_LAYER_EXCEPTIONS,
)


def test_every_controller_module_has_a_layer() -> None:
    assert not CONTROLLER.unmapped, (
        "controller modules in no layer: add each to the layer map (CONTROLLER_LAYER_OF in "
        "tests/unit/test_layers.py) under the layer its imports and importers put it in:\n"
        + "\n".join(CONTROLLER.unmapped)
    )


def test_controller_modules_import_only_their_own_layer_and_those_below() -> None:
    assert not CONTROLLER.violations, (
        f"lower layers never import higher ones ({' <- '.join(CONTROLLER_LAYERS)}); move the "
        "code to the layer it belongs in (or, with the reason, add the pair to "
        "CONTROLLER_LAYER_EXCEPTIONS):\n" + "\n".join(CONTROLLER.violations)
    )


def test_the_layer_map_and_its_exceptions_name_only_what_exists() -> None:
    """A prefix that matches no module (renamed, moved) and an exception no import needs any
    more (fixed) are removed, so the map stays true and the exceptions only shrink."""
    assert not CONTROLLER.unused_prefixes, (
        f"layer map prefixes matching no controller module: {CONTROLLER.unused_prefixes}"
    )
    assert not CONTROLLER.unused_exceptions, (
        f"layer exceptions no import needs any more (delete them): {CONTROLLER.unused_exceptions}"
    )


def test_the_layering_checker_catches_upward_imports_and_unmapped_modules(
    tmp_path: Path,
) -> None:
    """The checker on synthetic modules of a package `pkg`: an upward import (absolute,
    relative, function-level, or as a name of a package) is a violation unless excepted; a
    module in no layer is reported; stale map entries and exceptions are reported."""
    sources = {
        "": "",
        "low": "from .high import thing\n",  # up, relative
        "low2": "def f():\n    from pkg import high\n",  # up, function-level, as a name
        "low3": "import pkg.high.sub\n",  # up, plain import
        "low4": "from pkg.high import sub\n",  # up, excepted
        "high": "from .. import low\nfrom . import sub\n",  # down, and its own layer: fine
        "high.sub": "from ..low import x\n",  # down from a subpackage: fine
        "high.base": "",  # a low module in a high package: runs high's __init__ (up)
        "stray": "from .low import x\n",  # in no layer
    }
    modules: dict[str, list[Import]] = {}
    for name, source in sources.items():
        f = tmp_path / f"{name}.py"
        if name in ("", "high"):  # packages
            f = tmp_path / (name or "root") / "__init__.py"
            f.parent.mkdir()
        f.write_text(source)
        modules[name] = _imports(f, module=f"pkg.{name}" if name else "pkg")
    result = check_layering(
        modules,
        package="pkg",
        layers=("lower", "upper"),
        layer_of={"": "lower", "low": "lower", "low2": "lower", "low3": "lower",
                  "low4": "lower", "high": "upper", "high.base": "lower", "gone": "upper"},
        exceptions={("low4", "high"): "on purpose", ("low", "nothing"): "fixed long ago"},
    )  # fmt: skip
    assert [v.split(" ", 1)[1] for v in result.violations] == [
        "(lower on importing pkg.high.base) imports pkg.high.sub (upper)",
        "(lower) imports pkg.high (upper)",
        "(lower) imports pkg.high (upper)",
        "(lower) imports pkg.high.sub (upper)",
    ]
    assert [v.split(":")[0] for v in result.violations] == [
        str(tmp_path / "high" / "__init__.py"),
        str(tmp_path / "low.py"),
        str(tmp_path / "low2.py"),
        str(tmp_path / "low3.py"),
    ]
    assert len(result.excepted) == 1 and result.excepted[0].endswith("on purpose")
    assert result.unmapped == ["pkg.stray"]
    assert result.unused_prefixes == ["gone"]
    assert result.unused_exceptions == [("low", "nothing")]
