"""Rule files: strict YAML loading into an immutable RuleSet.

`load_rules` reads files or directories (*.yaml, *.yml), checks every key, duration, action
and condition, and returns a RuleSet or raises RuleError naming the file, the rule and the
reason. It has no side effects, so a failed reload leaves the running rules untouched.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from trainguard.controller.actionkinds import rule_actions
from trainguard.controller.rules.lang import (
    MAX_DURATION_S,
    Call,
    CompiledCondition,
    ConditionError,
    Node,
    Sig,
    compile_condition,
    format_duration,
    parse_condition,
    parse_duration,
    walk,
)
from trainguard.controller.signals import SCOPES
from trainguard.rules import shipped_dir

__all__ = [
    "ACTIONS",
    "SEVERITIES",
    "Condition",
    "Rule",
    "RuleError",
    "RuleSet",
    "default_rules_path",
    "load_rules",
    "parse_rules",
]

# The actions a rule may list: the action kinds the table marks `in_rules`, in its order.
ACTIONS: tuple[str, ...] = rule_actions()
SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")
# Files in a rules directory that hold other tables, not rules.
NON_RULE_FILES = frozenset({"xid_catalog.yaml", "xid_catalog.yml"})

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,99}$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RESERVED_LABELS = frozenset({"severity", "alertname", "rule", "scope"})
_TOP_KEYS = ("rules",)
_RULE_KEYS = (
    "name",
    "scope",
    "condition",
    "for",
    "severity",
    "actions",
    "cooldown",
    "summary",
    "description",
    "labels",
)
_REQUIRED = ("name", "scope", "condition", "severity", "summary")


class RuleError(ValueError):
    """A bad rule file: str(e) is "FILE: rule NAME: reason" (or "FILE: reason")."""

    def __init__(self, file: str, rule: str | None, reason: str) -> None:
        self.file = file
        self.rule = rule
        self.reason = reason
        where = f"{file}: rule {rule}: " if rule else f"{file}: "
        super().__init__(f"{where}{reason}")


@dataclass(frozen=True)
class Condition:
    """A parsed, type-checked condition: the source text, its AST and the compiled form."""

    source: str
    ast: Node = field(compare=False)
    compiled: CompiledCondition = field(compare=False, repr=False)

    def signals(self) -> frozenset[str]:
        """Every signal name the condition reads."""
        return frozenset(n.name for n in walk(self.ast) if isinstance(n, Sig))

    def uses_age(self) -> bool:
        """True if the result can change with time alone through age()."""
        return any(isinstance(n, Call) and n.func == "age" for n in walk(self.ast))

    def longest_window_s(self) -> float:
        """The longest range a windowed function reads (`increase(x[10m])`: 600), else 0."""
        return max(
            (n.window_s for n in walk(self.ast) if isinstance(n, Call) and n.window_s is not None),
            default=0.0,
        )

    def history_needs(self) -> frozenset[str]:
        """Signals read through windowed functions or age(): they need history."""
        out = set()
        for n in walk(self.ast):
            if isinstance(n, Call) and (n.window_s is not None or n.func == "age"):
                out.add(n.arg.name)  # type: ignore[union-attr]
        return frozenset(out)


@dataclass(frozen=True)
class Rule:
    name: str
    scope: str
    condition: Condition
    for_s: float
    severity: str
    actions: tuple[str, ...]
    cooldown_s: float
    summary: str
    description: str = ""
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""  # the file it came from


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...]
    sources: tuple[str, ...]

    def get(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def names(self) -> list[str]:
        return [r.name for r in self.rules]

    def history_needs(self) -> dict[str, frozenset[str]]:
        """scope -> signals whose history the rules read (feed to SignalState.track)."""
        out: dict[str, set[str]] = {}
        for r in self.rules:
            needs = r.condition.history_needs()
            if needs:
                out.setdefault(r.scope, set()).update(needs)
        return {s: frozenset(n) for s, n in out.items()}


def default_rules_path() -> Path:
    """The shipped rules directory (package data of `trainguard.rules`)."""
    return shipped_dir()


def load_rules(paths: Sequence[str | Path]) -> RuleSet:
    """Load rule files and directories (*.yaml, *.yml, sorted; xid_catalog.yaml is skipped).
    A rule name defined twice, in one file or across files, is an error."""
    if isinstance(paths, str | Path):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(
                f
                for f in path.iterdir()
                if f.suffix in (".yaml", ".yml") and f.is_file() and f.name not in NON_RULE_FILES
            )
            if not found:
                raise RuleError(str(path), None, "no rule files (*.yaml, *.yml) in directory")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise RuleError(str(path), None, "file not found")
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RuleError(str(f), None, f"cannot read: {e}") from None
        for rule in parse_rules(text, source=str(f)):
            if rule.name in seen:
                where = (
                    "earlier in this file" if seen[rule.name] == str(f) else f"in {seen[rule.name]}"
                )
                raise RuleError(str(f), rule.name, f"duplicate rule name (also defined {where})")
            seen[rule.name] = str(f)
            rules.append(rule)
    return RuleSet(rules=tuple(rules), sources=tuple(str(f) for f in files))


def parse_rules(text: str, *, source: str = "<string>") -> list[Rule]:
    """Parse one rule file's text (no duplicate check across files)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RuleError(source, None, f"invalid YAML: {e}") from None
    if data is None:
        raise RuleError(source, None, "empty file: expected a mapping with 'rules'")
    if not isinstance(data, dict):
        raise RuleError(source, None, f"expected a mapping with 'rules', got {_tname(data)}")
    _check_keys(data, _TOP_KEYS, source, None, "")
    if "rules" not in data:
        raise RuleError(source, None, "missing key 'rules'")
    items = data["rules"]
    if not isinstance(items, list):
        raise RuleError(source, None, f"rules: expected a list, got {_tname(items)}")
    out: list[Rule] = []
    names: set[str] = set()
    for i, item in enumerate(items):
        rule = _parse_rule(item, source, i)
        if rule.name in names:
            raise RuleError(
                source, rule.name, "duplicate rule name (also defined earlier in this file)"
            )
        names.add(rule.name)
        out.append(rule)
    return out


def _parse_rule(item: Any, source: str, index: int) -> Rule:
    label = f"#{index + 1}"
    if not isinstance(item, dict):
        raise RuleError(source, label, f"expected a mapping, got {_tname(item)}")
    raw_name = item.get("name")
    if isinstance(raw_name, str) and raw_name:
        label = raw_name
    _check_keys(item, _RULE_KEYS, source, label, "")
    for key in _REQUIRED:
        if key not in item:
            raise RuleError(source, label, f"missing key '{key}'")
    name = _str(item, "name", source, label)
    if not _NAME_RE.match(name):
        raise RuleError(
            source, label, "name: use lower-case letters, digits and '_', starting with a letter"
        )
    scope = _str(item, "scope", source, name)
    if scope not in SCOPES:
        raise RuleError(source, name, f"scope: must be one of {', '.join(SCOPES)}, got {scope!r}")
    cond_text = item["condition"]
    if isinstance(cond_text, bool | int | float):
        cond_text = str(cond_text)
    if not isinstance(cond_text, str) or not cond_text.strip():
        raise RuleError(source, name, "condition: expected a non-empty string")
    try:
        ast = parse_condition(cond_text, scope)
    except ConditionError as e:
        raise RuleError(
            source, name, f"condition: {e}\n    {cond_text}\n    {' ' * e.pos}^"
        ) from None
    severity = _str(item, "severity", source, name)
    if severity not in SEVERITIES:
        raise RuleError(
            source, name, f"severity: must be one of {', '.join(SEVERITIES)}, got {severity!r}"
        )
    actions_raw = item.get("actions", ["notify"])
    if not isinstance(actions_raw, list) or not all(isinstance(a, str) for a in actions_raw):
        raise RuleError(source, name, "actions: expected a list of action names")
    for a in actions_raw:
        if a not in ACTIONS:
            close = difflib.get_close_matches(a, ACTIONS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RuleError(
                source, name, f"actions: unknown action {a!r}{hint}; allowed: {', '.join(ACTIONS)}"
            )
    if len(set(actions_raw)) != len(actions_raw):
        raise RuleError(source, name, "actions: an action is listed twice")
    labels_raw = item.get("labels", {})
    if labels_raw is None:
        labels_raw = {}
    if not isinstance(labels_raw, dict):
        raise RuleError(source, name, f"labels: expected a mapping, got {_tname(labels_raw)}")
    labels: dict[str, str] = {}
    for k, v in labels_raw.items():
        if not isinstance(k, str) or not _LABEL_RE.match(k):
            raise RuleError(source, name, f"labels: invalid label name {k!r}")
        if k in _RESERVED_LABELS:
            raise RuleError(source, name, f"labels: {k!r} is set by trainguard itself")
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise RuleError(source, name, f"labels.{k}: expected a string, got {_tname(v)}")
        labels[k] = str(v)
    description = item.get("description", "")
    if not isinstance(description, str):
        raise RuleError(source, name, f"description: expected a string, got {_tname(description)}")
    return Rule(
        name=name,
        scope=scope,
        condition=Condition(cond_text, ast, compile_condition(ast, scope)),
        for_s=_duration(item, "for", source, name),
        severity=severity,
        actions=tuple(actions_raw),
        cooldown_s=_duration(item, "cooldown", source, name),
        summary=_str(item, "summary", source, name),
        description=description.strip(),
        labels=MappingProxyType(labels),
        source=source,
    )


def _check_keys(
    data: dict[Any, Any], allowed: Sequence[str], source: str, rule: str | None, prefix: str
) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RuleError(source, rule, f"{prefix}{key}: unknown key{hint}")


def _str(item: dict[str, Any], key: str, source: str, rule: str) -> str:
    v = item[key]
    if not isinstance(v, str) or not v:
        raise RuleError(source, rule, f"{key}: expected a non-empty string, got {_tname(v)}")
    return v


def _duration(item: dict[str, Any], key: str, source: str, rule: str) -> float:
    v = item.get(key, "0s")
    if v == 0 and not isinstance(v, bool):
        return 0.0
    if not isinstance(v, str):
        raise RuleError(
            source, rule, f"{key}: expected a duration with a unit such as 90s or 5m, got {v!r}"
        )
    try:
        seconds = parse_duration(v)
    except ValueError as e:
        raise RuleError(source, rule, f"{key}: {e}") from None
    if seconds > MAX_DURATION_S:
        raise RuleError(
            source, rule, f"{key}: {v} is longer than {format_duration(MAX_DURATION_S)}"
        )
    return seconds


def _tname(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}.get(
        type(v), "mapping" if isinstance(v, dict) else type(v).__name__
    )
