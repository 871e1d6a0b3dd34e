"""The import layers (DESIGN.md, "Layout"): the contract at the bottom imports none of the
parts; agent and controller never import each other; the trainer imports only the contract;
torch, pynvml and boto3 are never imported when a module is imported (outside the trainer,
which is the torch library)."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
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
HEAVY = ("torch", "pynvml", "boto3")

# layer -> the trainguard parts it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "contract": PARTS,
    "rules": (*PARTS, "contract"),
    "agent": ("controller", "trainer", "devkit"),
    "controller": ("agent", "trainer", "devkit"),
    "trainer": ("agent", "controller", "devkit"),
    "devkit": ("trainer",),
}


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    module: str
    top_level: bool  # executed when the importing module is imported


def _imports(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    out: list[Import] = []

    def visit(node: ast.AST, *, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    out.append(Import(name, child.lineno, alias.name, top))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append(Import(name, child.lineno, child.module, top))
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


def _all_imports() -> dict[str, list[Import]]:
    return {
        folder: [i for f in sorted((REPO / folder).rglob("*.py")) for i in _imports(f)]
        for folder in FOLDERS
    }


IMPORTS = _all_imports()


@pytest.mark.parametrize("layer", list(FORBIDDEN), ids=list(FORBIDDEN))
def test_layer_imports_only_what_lies_below_it(layer: str) -> None:
    bad = [
        f"{i.file}:{i.line} imports {i.module}"
        for i in IMPORTS[layer]
        if _part_of(i.module) in FORBIDDEN[layer]
    ]
    assert not bad, f"{layer} must not import {FORBIDDEN[layer]}:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", [f for f in FOLDERS if f != "trainer"])
def test_heavy_libraries_are_never_imported_at_import_time(layer: str) -> None:
    bad = [
        f"{i.file}:{i.line} imports {i.module} at module level"
        for i in IMPORTS[layer]
        if i.top_level and i.module.split(".")[0] in HEAVY
    ]
    assert not bad, "\n".join(bad)


def test_no_repository_folder_shadows_the_installed_namespace() -> None:
    # A folder named like the package at the root wins over the package-dir mapping.
    assert not (REPO / "trainguard").exists()


def test_the_checkers_catch_a_violation(tmp_path: Path) -> None:
    """The scanner itself: a contract module importing the agent, and a top-level torch import,
    are both found (a scanner that found nothing would pass every test above)."""
    f = tmp_path / "probe.py"
    f.write_text(
        "import torch\nfrom trainguard.agent import daemon\n\ndef g():\n    import boto3\n"
    )
    found = _imports(f)
    assert [(i.module, i.top_level) for i in found] == [
        ("torch", True),
        ("trainguard.agent", True),
        ("boto3", False),
    ]
    assert _part_of("trainguard.agent") == "agent"
    assert _part_of("trainguard.strict") == "contract"


IMPORT_ALL = """
import importlib, pkgutil, sys
for name in ("torch", "pynvml", "boto3"):
    sys.modules[name] = None
import trainguard
names = []
for pkg in ("trainguard", "trainguard.agent", "trainguard.controller", "trainguard.devkit"):
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        if info.name.startswith("trainguard.trainer"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
assert "trainguard.trainer" not in sys.modules, "something imported the trainer"
print(len(names))
"""


def test_every_module_outside_the_trainer_imports_without_torch_pynvml_or_boto3() -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 40


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
