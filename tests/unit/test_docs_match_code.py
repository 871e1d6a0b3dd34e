"""What docs/*.md and README.md quote exists in the code: every metric name, rule name,
agentctl, trainguard-controller and trainguard-ckpt subcommand, and controller or agent config
key. A doc that names something the code does not have (a renamed rule, a removed subcommand,
a misspelt key) fails here with the file and the name."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from trainguard.agent.config import AgentConfig
from trainguard.controller.cli.parser import build_parser
from trainguard.controller.config import ControllerConfig
from trainguard.controller.main import SUBCOMMANDS as CONTROLLER_SUBCOMMANDS
from trainguard.signals import SIGNALS
from trainguard.trainer.ckpttool.cli import build_parser as build_ckpt_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
CODE_DIRS = ("agent", "controller", "contract", "trainer")


def _quoted(text: str) -> Iterator[str]:
    """The text of every inline code span and every fenced block's line: what a doc quotes."""
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            yield line
        else:
            yield from re.findall(r"`([^`]+)`", line)


def _doc_quotes() -> Iterator[tuple[str, str]]:
    for path in DOCS:
        for quote in _quoted(path.read_text()):
            yield path.name, quote


# --- metrics -------------------------------------------------------------------------------

_METRIC = re.compile(r"\btrainguard_[a-z0-9_]+[a-z0-9]")
_SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_total")


def _code_metric_names() -> set[str]:
    names: set[str] = set()
    for top in CODE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            names.update(_METRIC.findall(path.read_text()))
    return names


def test_every_metric_the_docs_name_is_one_the_code_exports() -> None:
    known = _code_metric_names()
    unknown = set()
    for doc, quote in _doc_quotes():
        if re.match(r"\s*-?\s*alert:", quote):
            continue  # an example alert's own name
        for m in _METRIC.finditer(quote):
            name = m.group(0)
            if quote[m.end() : m.end() + 1] == "*" or quote[m.end() : m.end() + 2] == "_*":
                continue  # a family prefix: trainguard_gpu_*
            base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)
            if name not in known and base not in known:
                unknown.add(f"{doc}: {name}")
    assert not unknown, "metrics in the docs that no code exports:\n" + "\n".join(sorted(unknown))


# --- rules -------------------------------------------------------------------------------

_RULE_REFS = (
    re.compile(r"""["']?rule["']?\s*[:=]\s*["']?([a-z][a-z0-9_]+)"""),
    re.compile(r"--rule[ =]([a-z][a-z0-9_]+)"),
    re.compile(r'alertname\s*=~?\s*"([a-z][a-z0-9_]+)"'),
    re.compile(r"\[(?:CRITICAL|WARNING|INFO|RESOLVED)\] ([a-z][a-z0-9_]+):"),
    re.compile(r'"class":\s*"([a-z][a-z0-9_]+)"'),
    re.compile(r"\*Rule\*\\n([a-z][a-z0-9_]+)"),
)


def _shipped_rule_names() -> set[str]:
    """The rules of the shipped rule files, and the controller's own (`PAGE_RULE = "..."`)."""
    names: set[str] = set()
    for path in (ROOT / "controller").rglob("*.py"):
        names.update(re.findall(r'^[A-Z_]*RULE[A-Z_]* = "([a-z_]+)"', path.read_text(), re.M))
    for path in (ROOT / "rules").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("rules"), list):
            names.update(r["name"] for r in doc["rules"])
    return names


def test_every_rule_the_docs_name_is_shipped_or_defined_there() -> None:
    shipped = _shipped_rule_names()
    unknown = set()
    for path in DOCS:
        text = path.read_text()
        # a doc may define its own example rule (`- name: my_rule` in a rules file)
        defined = set(re.findall(r"^\s*-?\s*name:\s*([a-z][a-z0-9_]+)\s*$", text, re.MULTILINE))
        named = [n for q in _quoted(text) for p in _RULE_REFS for n in p.findall(q)]
        # prose: "the `gpu_uncorrectable_ecc` rule", "rule `node_silent`"
        named += re.findall(r"`([a-z][a-z0-9_]+)`'?s? rule\b", text)
        named += re.findall(r"\brule `([a-z][a-z0-9_]+)`", text)
        for name in named:
            if name not in shipped | defined:
                unknown.add(f"{path.name}: {name}")
    assert not unknown, "rules the docs name that no rule file has:\n" + "\n".join(sorted(unknown))


# --- commands ------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers here, and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


# agentctl's global options that take a value (the next word is not a subcommand)
_VALUE_OPTIONS = {"--url", "--token-file", "--ca-file", "--config", "--timeout", "-o", "--output"}


def _agentctl_words(quote: str) -> Iterator[tuple[str, str | None]]:
    """(subcommand, the word after it or None) of every `agentctl ...` in a quote, its
    global options skipped; a shell comment is prose, not a command."""
    code = re.split(r"(?:^|\s)#", quote, maxsplit=1)[0]
    for m in re.finditer(r"\bagentctl\b", code):
        words = [w for w in code[m.end() :].split() if w != "\\"]
        plain: list[str] = []
        skip = False
        for w in words:
            if skip:
                skip = False
            elif w.startswith("-"):
                skip = w in _VALUE_OPTIONS
            elif re.fullmatch(r"[a-z][a-z-]*", w):
                plain.append(w)
            else:
                break
            if len(plain) == 2:
                break
        if plain:
            yield plain[0], plain[1] if len(plain) > 1 else None


def test_every_agentctl_subcommand_the_docs_quote_exists() -> None:
    top = _subcommands(build_parser())
    wrong = set()
    for doc, quote in _doc_quotes():
        for sub, second in _agentctl_words(quote):
            if sub not in top:
                wrong.add(f"{doc}: agentctl {sub}")
                continue
            nested = _subcommands(top[sub])
            if nested and second is not None and second not in nested:
                wrong.add(f"{doc}: agentctl {sub} {second}")
    assert not wrong, "agentctl commands in the docs that agentctl refuses:\n" + "\n".join(
        sorted(wrong)
    )


def test_every_agentctl_inject_kind_the_docs_quote_is_accepted() -> None:
    inject = _subcommands(build_parser())["inject"]
    (kind,) = [a for a in inject._actions if a.dest == "kind"]
    assert kind.choices is not None
    wrong = {
        f"{doc}: {m.group(1)}"
        for doc, quote in _doc_quotes()
        for m in re.finditer(r"agentctl inject \S+ ([a-z_]+)", quote)
        if m.group(1) not in kind.choices
    }
    assert not wrong, wrong


def test_every_controller_subcommand_the_docs_quote_exists() -> None:
    wrong = {
        f"{doc}: trainguard-controller {m.group(1)}"
        for doc, quote in _doc_quotes()
        for m in re.finditer(r"\btrainguard-controller\s+([a-z][a-z-]*)", quote)
        if m.group(1) not in CONTROLLER_SUBCOMMANDS
    }
    assert not wrong, wrong


def test_every_trainguard_ckpt_subcommand_the_docs_quote_exists() -> None:
    ckpt = _subcommands(build_ckpt_parser())
    wrong = {
        f"{doc}: trainguard-ckpt {m.group(1)}"
        for doc, quote in _doc_quotes()
        for m in re.finditer(r"\btrainguard-ckpt\s+([a-z][a-z-]*)", quote)
        if m.group(1) not in ckpt
    }
    assert not wrong, wrong


# --- config keys ---------------------------------------------------------------------------

_KEY = re.compile(r"^[a-z_]+(?:\.[a-z_0-9]+)+$")
_FILE_SUFFIXES = (
    ".yaml", ".yml", ".md", ".py", ".json", ".service", ".sock", ".token", ".crt", ".key",
    ".pem", ".db", ".conf", ".sh", ".txt", ".png", ".sbatch", ".toml", ".internal", ".org",
    ".com", ".example", ".d", ".csr",
)  # fmt: skip


def _field_type(cls: type, name: str) -> object | None:
    hints = typing.get_type_hints(cls)
    if name not in {f.name for f in dataclasses.fields(cls)}:
        return None
    return hints[name]


def _resolves(cls: type, parts: list[str]) -> bool:
    """Whether the dotted key `parts` names a field under the config dataclass `cls`."""
    tp: object = cls
    for part in parts:
        # Optional[X], list[X]: look into X
        while typing.get_origin(tp) in (typing.Union, list, tuple, type(int | None)):
            args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
            if len(args) != 1:
                break
            tp = args[0]
        if typing.get_origin(tp) is dict:
            return True  # a free mapping (labels, node_names): any key
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return False
        found = _field_type(tp, part)
        if found is None:
            return False
        tp = found
    return True


def _names_code(parts: list[str]) -> bool:
    """Whether a dotted name is a module (`store.jobs`, `controller.stallguard`) or a signal
    (`node.gpus`) rather than a config key."""
    for base in (ROOT, ROOT / "controller"):
        here = base.joinpath(*parts)
        if here.with_suffix(".py").exists() or (here / "__init__.py").exists():
            return True
    return len(parts) == 2 and (parts[0], parts[1]) in {(s.scope, s.name) for s in SIGNALS}


def _config_sections() -> dict[str, list[type]]:
    sections: dict[str, list[type]] = {}
    for cls in (ControllerConfig, AgentConfig):
        for f in dataclasses.fields(cls):
            sections.setdefault(f.name, []).append(cls)
    return sections


def test_every_config_key_the_docs_quote_exists() -> None:
    sections = _config_sections()
    unknown = set()
    for doc, quote in _doc_quotes():
        if "unknown key" in quote:
            continue  # an example of the error a misspelt key gets
        for token in re.split(r"[\s,()=:\[\]{}|/]+", quote):
            key = token.strip("`'\".;")
            if not _KEY.match(key) or key.endswith(_FILE_SUFFIXES):
                continue
            parts = key.split(".")
            if parts[0] not in sections or _names_code(parts):
                continue
            if not any(_resolves(cls, parts) for cls in sections[parts[0]]):
                unknown.add(f"{doc}: {key}")
    assert not unknown, "config keys in the docs that no config has:\n" + "\n".join(sorted(unknown))


@pytest.mark.parametrize(
    ("key", "known"),
    [
        ("api.tls_client_ca_file", True),
        ("backend.slurm.spare_reservation", True),
        ("notify.webhooks.min_severity", True),
        ("node.labels.rack", True),
        ("api.tls_client_ca", False),
        ("store.jobs", False),
    ],
    ids=["controller", "nested", "in-a-list", "free-mapping", "misspelt", "not-a-key"],
)
def test_the_key_check_resolves_keys_through_the_dataclasses(key: str, known: bool) -> None:
    sections = _config_sections()
    parts = key.split(".")
    assert any(_resolves(cls, parts) for cls in sections[parts[0]]) is known


# --- extras and the port -------------------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _extras() -> set[str]:
    import tomllib  # noqa: PLC0415 - only this test reads pyproject.toml

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def test_every_extra_the_docs_and_examples_name_is_in_pyproject() -> None:
    extras = _extras()
    wrong = set()
    for path in [*DOCS, *EXAMPLES]:
        text = path.read_text()
        named = [
            e for group in re.findall(r"trainguard\[([a-z,]+)\]", text) for e in group.split(",")
        ]
        named += re.findall(r"`([a-z]+)` extra\b", text)
        named += re.findall(r"\bextra `([a-z]+)`", text)
        named += re.findall(r"\badd `([a-z]+)`", text)
        wrong.update(f"{path.name}: {e}" for e in named if e not in extras)
    assert not wrong, "extras that pyproject.toml does not define:\n" + "\n".join(sorted(wrong))


def test_the_docs_and_examples_give_the_controller_one_port() -> None:
    # a controller URL: its host names the controller (ctl, controller, trainguard)
    url = re.compile(r"https?://[\w.-]*(?:ctl|controller|trainguard)[\w.-]*:(\d+)")
    ports = {
        f"{path.name}: {m.group(0)}"
        for path in [*DOCS, *EXAMPLES]
        for m in url.finditer(path.read_text())
        if m.group(1) != "8800"
    }
    assert not ports, "controller URLs with another port than 8800:\n" + "\n".join(sorted(ports))
