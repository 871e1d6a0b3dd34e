"""The controller's rules: condition language, rule files, the evaluation engine and the
Prometheus export. Signals the rules read live in `trainguard.controller.signals`."""

from trainguard.controller.rules.engine import EngineMemory, evaluate
from trainguard.controller.rules.export import to_prometheus_rules
from trainguard.controller.rules.loader import (
    Rule,
    RuleError,
    RuleSet,
    default_rules_path,
    load_rules,
)

__all__ = [
    "EngineMemory",
    "Rule",
    "RuleError",
    "RuleSet",
    "default_rules_path",
    "evaluate",
    "load_rules",
    "to_prometheus_rules",
]
