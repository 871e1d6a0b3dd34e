"""The rule condition language: tokenizer, recursive-descent parser, type checker, compiler.

A condition is parsed once per scope into a typed AST (never `eval`), checked (signal names
for the scope, function arity, windows, operand types, boolean at the top) and compiled into
closures over an `EvalContext`. Absent values propagate: arithmetic or a comparison with an
absent operand is absent, `and`/`or`/`not` use three-valued logic, and a condition that ends
absent is false. `finite(x)` and `present(x)` are always true or false.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.controller.signals import SIGNALS, EvalContext, getter, series_getter

__all__ = [
    "FUNCTIONS",
    "MAX_CONDITION_CHARS",
    "MAX_CONDITION_TOKENS",
    "MAX_DURATION_S",
    "MAX_NESTING",
    "MAX_NUMBER",
    "MAX_WINDOW_S",
    "And",
    "Arith",
    "Call",
    "Cmp",
    "CompiledCondition",
    "ConditionError",
    "InList",
    "Neg",
    "Node",
    "Not",
    "Num",
    "Or",
    "Sig",
    "Str",
    "compile_condition",
    "format_duration",
    "parse_condition",
    "parse_duration",
    "walk",
]


# Bounds on what a rule file may ask of the controller: each condition is parsed by recursive
# descent and evaluated every tick, so its size and nesting are capped (a 90-deep parenthesis or
# a 1,000-term `or` chain must be a clear error, never a RecursionError), numbers are finite,
# and windows are capped because the history they need is kept in memory.
MAX_CONDITION_CHARS = 2_000
MAX_CONDITION_TOKENS = 400
MAX_NESTING = 16  # parentheses, `not` and unary minus, one level each
MAX_NUMBER = 1e15  # a magnitude no signal threshold comes near; 1e999 (inf) is refused
MAX_WINDOW_S = 86_400.0  # 1 day of history per windowed signal
MAX_DURATION_S = 7 * 86_400.0  # `for:` and `cooldown:` at most a week


class ConditionError(ValueError):
    """A condition that does not parse or type-check; `pos` is the 0-based column."""

    def __init__(self, pos: int, reason: str) -> None:
        self.pos = pos
        self.reason = reason
        super().__init__(f"column {pos + 1}: {reason}")


# --- durations ------------------------------------------------------------------------------

_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w))+$")
_DURATION_PART_RE = re.compile(r"(\d+)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> float:
    """'90s', '5m', '1h30m', '0s' -> seconds. Raises ValueError naming the problem."""
    if not _DURATION_RE.match(text):
        raise ValueError(
            f"invalid duration {text!r}: use whole numbers with units ms, s, m, h, d, w "
            "(e.g. 30s, 5m, 1h30m)"
        )
    return sum(int(n) * _UNITS_S[u] for n, u in _DURATION_PART_RE.findall(text))


def format_duration(seconds: float) -> str:
    """Seconds -> the shortest Prometheus duration ('90s' -> '1m30s', 0 -> '0s')."""
    ms = round(seconds * 1000)
    if ms == 0:
        return "0s"
    out = []
    for unit, size in (("w", 604_800_000), ("d", 86_400_000), ("h", 3_600_000), ("m", 60_000)):
        if ms >= size:
            out.append(f"{ms // size}{unit}")
            ms %= size
    if ms >= 1000:
        out.append(f"{ms // 1000}s")
        ms %= 1000
    if ms:
        out.append(f"{ms}ms")
    return "".join(out)


# --- AST ------------------------------------------------------------------------------------

NUM, STR, BOOL = "number", "string", "boolean"


@dataclass(frozen=True)
class Num:
    value: float
    pos: int
    type: str = NUM


@dataclass(frozen=True)
class Str:
    value: str
    pos: int
    type: str = STR


@dataclass(frozen=True)
class Sig:
    name: str
    pos: int
    type: str = NUM


@dataclass(frozen=True)
class Neg:
    operand: Node
    pos: int
    type: str = NUM


@dataclass(frozen=True)
class Arith:
    op: str
    left: Node
    right: Node
    pos: int
    type: str = NUM


@dataclass(frozen=True)
class Cmp:
    op: str
    left: Node
    right: Node
    pos: int
    type: str = BOOL


@dataclass(frozen=True)
class InList:
    operand: Node
    items: tuple[float | str, ...]
    negate: bool
    pos: int
    type: str = BOOL


@dataclass(frozen=True)
class And:
    left: Node
    right: Node
    pos: int
    type: str = BOOL


@dataclass(frozen=True)
class Or:
    left: Node
    right: Node
    pos: int
    type: str = BOOL


@dataclass(frozen=True)
class Not:
    operand: Node
    pos: int
    type: str = BOOL


@dataclass(frozen=True)
class Call:
    func: str
    arg: Node
    pos: int
    window_s: float | None = None
    window_text: str | None = None
    type: str = NUM


Node = Num | Str | Sig | Neg | Arith | Cmp | InList | And | Or | Not | Call


@dataclass(frozen=True)
class FuncSpec:
    window: bool  # takes `signal[duration]`
    signal_arg: bool  # the argument must be a bare signal name
    arg_type: str | None  # required argument type (None: any)
    result: str
    rank_only: bool = False
    doc: str = ""


FUNCTIONS: dict[str, FuncSpec] = {
    "rate": FuncSpec(True, True, NUM, NUM, doc="per-second increase over the window (resets)"),
    "increase": FuncSpec(True, True, NUM, NUM, doc="increase over the window (resets)"),
    "changes": FuncSpec(True, True, NUM, NUM, doc="number of value changes in the window"),
    "max_over_time": FuncSpec(True, True, NUM, NUM, doc="highest value in the window"),
    "min_over_time": FuncSpec(True, True, NUM, NUM, doc="lowest value in the window"),
    "age": FuncSpec(False, True, NUM, NUM, doc="seconds since the value last changed"),
    "finite": FuncSpec(False, False, NUM, BOOL, doc="present and not NaN/Inf"),
    "present": FuncSpec(False, False, None, BOOL, doc="the value is present"),
    "abs": FuncSpec(False, False, NUM, NUM, doc="absolute value"),
    "job_median": FuncSpec(False, True, NUM, NUM, True, "median over the job's ranks"),
    "job_max": FuncSpec(False, True, NUM, NUM, True, "maximum over the job's ranks"),
    "job_min": FuncSpec(False, True, NUM, NUM, True, "minimum over the job's ranks"),
    "job_count": FuncSpec(False, True, None, NUM, True, "ranks of the job where x is present"),
}

# --- tokenizer ------------------------------------------------------------------------------

_KEYWORDS = {"and", "or", "not", "in"}
_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?P<unit>[A-Za-z_]\w*)?
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<op>==|!=|<=|>=|<|>|\+|-|\*|/|\(|\)|\[|\]|,)
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Tok:
    kind: str  # num, dur, str, ident, kw, op, end
    text: str
    pos: int
    value: Any = None


def _tokenize(src: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(src):
        m = _TOKEN_RE.match(src, pos)
        if m is None:
            if src[pos] in "\"'":
                raise ConditionError(pos, "unterminated string")
            raise ConditionError(pos, f"unexpected character {src[pos]!r}")
        kind = m.lastgroup
        text = m.group(0)
        if m.group("num") is not None:
            unit = m.group("unit")
            if unit is not None:
                try:
                    out.append(_Tok("dur", text, pos, parse_duration(text)))
                except ValueError:
                    raise ConditionError(
                        pos, f"invalid number or duration {text!r} (durations: 30s, 5m, 1h)"
                    ) from None
            else:
                value = float(text)
                if not abs(value) <= MAX_NUMBER:  # also catches inf (1e999)
                    raise ConditionError(
                        pos, f"number {text} is out of range (at most {MAX_NUMBER:g} in magnitude)"
                    )
                out.append(_Tok("num", text, pos, value))
        elif kind == "str":
            out.append(_Tok("str", text, pos, _unquote(text)))
        elif kind == "ident":
            out.append(_Tok("kw" if text in _KEYWORDS else "ident", text, pos))
        elif kind == "op":
            out.append(_Tok("op", text, pos))
        pos = m.end()
    out.append(_Tok("end", "", len(src)))
    return out


def _unquote(text: str) -> str:
    body = text[1:-1]
    return re.sub(r"\\(.)", r"\1", body)


# --- parser ---------------------------------------------------------------------------------


class _Parser:
    def __init__(self, src: str, scope: str) -> None:
        if len(src) > MAX_CONDITION_CHARS:
            raise ConditionError(
                MAX_CONDITION_CHARS,
                f"condition is {len(src)} characters long, the limit is {MAX_CONDITION_CHARS}: "
                "split it into several rules",
            )
        self.src = src
        self.scope = scope
        self.toks = _tokenize(src)
        if len(self.toks) - 1 > MAX_CONDITION_TOKENS:
            raise ConditionError(
                self.toks[MAX_CONDITION_TOKENS].pos,
                f"condition has {len(self.toks) - 1} terms and operators, the limit is "
                f"{MAX_CONDITION_TOKENS}: split it into several rules",
            )
        self.i = 0
        self.depth = 0

    def _nest(self, t: _Tok) -> None:
        """One more level of parentheses / `not` / unary minus; bounded (recursive descent)."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise ConditionError(t.pos, f"nested more than {MAX_NESTING} levels deep")

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def _is(self, kind: str, text: str | None = None) -> bool:
        t = self.tok
        return t.kind == kind and (text is None or t.text == text)

    def _take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def _expect(self, kind: str, text: str, what: str) -> _Tok:
        if not self._is(kind, text):
            raise ConditionError(self.tok.pos, f"expected {what}, found {self._desc(self.tok)}")
        return self._take()

    @staticmethod
    def _desc(t: _Tok) -> str:
        return "end of condition" if t.kind == "end" else repr(t.text)

    def parse(self) -> Node:
        if self._is("end"):
            raise ConditionError(0, "empty condition")
        node = self._or()
        if not self._is("end"):
            raise ConditionError(self.tok.pos, f"unexpected {self._desc(self.tok)}")
        if node.type != BOOL:
            raise ConditionError(
                0, f"a condition must be true/false (a comparison), but this is a {node.type}"
            )
        return node

    def _bool_operand(self, node: Node, op: str) -> None:
        if node.type != BOOL:
            raise ConditionError(
                node.pos, f"'{op}' needs true/false operands (comparisons), got a {node.type}"
            )

    def _or(self) -> Node:
        return self._logic_chain("or", Or, self._and)

    def _and(self) -> Node:
        return self._logic_chain("and", And, self._not)

    def _logic_chain(
        self, kw: str, make: type[And] | type[Or], operand: Callable[[], Node]
    ) -> Node:
        """`operand (kw operand)*`, left-associative, every operand true/false."""
        left = operand()
        while self._is("kw", kw):
            t = self._take()
            right = operand()
            self._bool_operand(left, kw)
            self._bool_operand(right, kw)
            left = make(left, right, t.pos)
        return left

    def _not(self) -> Node:
        if self._is("kw", "not"):
            t = self._take()
            self._nest(t)
            operand = self._not()
            self.depth -= 1
            self._bool_operand(operand, "not")
            return Not(operand, t.pos)
        return self._cmp()

    def _cmp(self) -> Node:
        left = self._add()
        if self._is("op") and self.tok.text in ("==", "!=", "<", "<=", ">", ">="):
            t = self._take()
            right = self._add()
            self._check_cmp(t, left, right)
            node: Node = Cmp(t.text, left, right, t.pos)
            if self._is("op") and self.tok.text in ("==", "!=", "<", "<=", ">", ">="):
                raise ConditionError(
                    self.tok.pos, "comparisons do not chain: write 'a < b and b < c'"
                )
            return node
        negate = False
        if self._is("kw", "not") and self.toks[self.i + 1].kind == "kw":
            if self.toks[self.i + 1].text == "in":
                self._take()
                negate = True
        if self._is("kw", "in"):
            t = self._take()
            items = self._list(left)
            return InList(left, items, negate, t.pos)
        if negate:
            raise ConditionError(self.tok.pos, "expected 'in' after 'not'")
        return left

    def _check_cmp(self, t: _Tok, left: Node, right: Node) -> None:
        for side in (left, right):
            if side.type == BOOL:
                raise ConditionError(side.pos, f"cannot compare a true/false value with '{t.text}'")
        if left.type != right.type:
            raise ConditionError(t.pos, f"cannot compare a {left.type} with a {right.type}")
        if left.type == STR and t.text not in ("==", "!="):
            raise ConditionError(t.pos, f"strings compare only with == and !=, not '{t.text}'")

    def _list(self, operand: Node) -> tuple[float | str, ...]:
        self._expect("op", "[", "'[' to start the list after 'in'")
        items: list[float | str] = []
        while True:
            neg = False
            if self._is("op", "-"):
                self._take()
                neg = True
            t = self._take()
            if t.kind == "num":
                items.append(-t.value if neg else t.value)
                kind = NUM
            elif t.kind == "str" and not neg:
                items.append(t.value)
                kind = STR
            else:
                raise ConditionError(
                    t.pos, f"list items must be numbers or strings, got {self._desc(t)}"
                )
            if kind != operand.type:
                raise ConditionError(
                    t.pos, f"list item is a {kind} but the value tested is a {operand.type}"
                )
            if self._is("op", ","):
                self._take()
                continue
            self._expect("op", "]", "',' or ']' in the list")
            return tuple(items)

    def _add(self) -> Node:
        return self._arith_chain(("+", "-"), self._mul)

    def _mul(self) -> Node:
        return self._arith_chain(("*", "/"), self._unary)

    def _arith_chain(self, ops: tuple[str, ...], operand: Callable[[], Node]) -> Node:
        """`operand (op operand)*` for the operators `ops`, left-associative."""
        left = operand()
        while self._is("op") and self.tok.text in ops:
            t = self._take()
            right = operand()
            left = self._arith(t, left, right)
        return left

    def _arith(self, t: _Tok, left: Node, right: Node) -> Node:
        for side in (left, right):
            if side.type != NUM:
                raise ConditionError(side.pos, f"'{t.text}' needs numbers, got a {side.type}")
        return Arith(t.text, left, right, t.pos)

    def _unary(self) -> Node:
        if self._is("op", "-"):
            t = self._take()
            self._nest(t)
            operand = self._unary()
            self.depth -= 1
            if operand.type != NUM:
                raise ConditionError(operand.pos, f"'-' needs a number, got a {operand.type}")
            if isinstance(operand, Num):
                return Num(-operand.value, t.pos)
            return Neg(operand, t.pos)
        return self._primary()

    def _primary(self) -> Node:
        t = self._take()
        if t.kind == "num":
            return Num(t.value, t.pos)
        if t.kind == "dur":
            raise ConditionError(
                t.pos, f"durations like {t.text!r} are only allowed in windows such as x[{t.text}]"
            )
        if t.kind == "str":
            return Str(t.value, t.pos)
        if t.kind == "op" and t.text == "(":
            self._nest(t)
            inner = self._or()
            self._expect("op", ")", "')'")
            self.depth -= 1
            return inner
        if t.kind == "ident":
            if self._is("op", "("):
                return self._call(t)
            return self._signal(t)
        raise ConditionError(t.pos, f"expected a value, found {self._desc(t)}")

    def _signal(self, t: _Tok) -> Sig:
        names = SIGNALS[self.scope]
        spec = names.get(t.text)
        if spec is None:
            if t.text in FUNCTIONS:
                raise ConditionError(t.pos, f"{t.text} is a function: write {t.text}(...)")
            close = difflib.get_close_matches(t.text, list(names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConditionError(t.pos, f"unknown signal {t.text!r} for scope {self.scope}{hint}")
        return Sig(t.text, t.pos, NUM if spec.kind == "number" else STR)

    def _call(self, t: _Tok) -> Call:
        spec = FUNCTIONS.get(t.text)
        if spec is None:
            close = difflib.get_close_matches(t.text, list(FUNCTIONS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConditionError(t.pos, f"unknown function {t.text!r}{hint}")
        if spec.rank_only and self.scope != "rank":
            raise ConditionError(t.pos, f"{t.text}() works only in rank scope, not {self.scope}")
        self._take()  # "("
        if self._is("op", ")"):
            raise ConditionError(self.tok.pos, f"{t.text}() takes exactly one argument, got none")
        if spec.signal_arg:
            at = self._take()
            if at.kind != "ident" or self._is("op", "("):
                raise ConditionError(
                    at.pos, f"{t.text}() takes a signal name, got {self._desc(at)}"
                )
            arg: Node = self._signal(at)
        else:
            arg = self._or()
        window_s: float | None = None
        window_text: str | None = None
        if spec.window:
            if not self._is("op", "["):
                raise ConditionError(
                    self.tok.pos, f"{t.text}() needs a window: {t.text}({arg_text(arg)}[5m])"
                )
            self._take()
            w = self._take()
            if w.kind != "dur":
                raise ConditionError(
                    w.pos, f"expected a duration like 5m in the window, got {self._desc(w)}"
                )
            if w.value <= 0:
                raise ConditionError(w.pos, "the window must be longer than 0s")
            if w.value > MAX_WINDOW_S:
                raise ConditionError(
                    w.pos, f"the window {w.text} is longer than {format_duration(MAX_WINDOW_S)}"
                )
            window_s, window_text = w.value, w.text
            self._expect("op", "]", "']' to close the window")
        elif self._is("op", "["):
            raise ConditionError(self.tok.pos, f"{t.text}() takes no window")
        if self._is("op", ","):
            raise ConditionError(self.tok.pos, f"{t.text}() takes exactly one argument")
        self._expect("op", ")", f"')' to close {t.text}(")
        if spec.arg_type is not None and arg.type != spec.arg_type:
            raise ConditionError(arg.pos, f"{t.text}() needs a {spec.arg_type}, got a {arg.type}")
        return Call(t.text, arg, t.pos, window_s, window_text, spec.result)


def arg_text(node: Node) -> str:
    return node.name if isinstance(node, Sig) else "x"


def parse_condition(source: str, scope: str) -> Node:
    """Parse and type-check `source` for `scope`; raises ConditionError."""
    if scope not in SIGNALS:
        raise ConditionError(0, f"unknown scope {scope!r}")
    return _Parser(source, scope).parse()


def walk(node: Node) -> list[Node]:
    """Every node of the tree, parents first."""
    out: list[Node] = [node]
    if isinstance(node, Arith | Cmp | And | Or):
        out += walk(node.left) + walk(node.right)
    elif isinstance(node, Neg | Not | InList):
        out += walk(node.operand)
    elif isinstance(node, Call):
        out += walk(node.arg)
    return out


# --- compiler -------------------------------------------------------------------------------

Fn = Callable[[EvalContext], Any]


@dataclass(frozen=True)
class CompiledCondition:
    """`test(ctx)` is True when the condition holds; `value(ctx)` is its left-hand value."""

    test: Callable[[EvalContext], bool]
    value: Fn


def compile_condition(node: Node, scope: str) -> CompiledCondition:
    fn = _compile(node, scope)
    return CompiledCondition(test=lambda c: fn(c) is True, value=_compile_value(node, scope))


def _compile_value(node: Node, scope: str) -> Fn:
    if isinstance(node, Cmp):
        return _compile(node.left, scope)
    if isinstance(node, InList):
        return _compile(node.operand, scope)
    if isinstance(node, Not):
        return _compile_value(node.operand, scope)
    if isinstance(node, And | Or):
        a = _compile_value(node.left, scope)
        b = _compile_value(node.right, scope)

        def first(c: EvalContext) -> Any:
            v = a(c)
            return b(c) if v is None else v

        return first
    if isinstance(node, Call) and node.type == BOOL:
        return _compile(node.arg, scope)
    return lambda c: None


_ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: None if b == 0 else a / b,
}
_CMP: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def _compile(node: Node, scope: str) -> Fn:
    if isinstance(node, Num | Str):
        const = node.value
        return lambda c: const
    if isinstance(node, Sig):
        return getter(scope, node.name)
    if isinstance(node, Neg):
        f = _compile(node.operand, scope)

        def neg(c: EvalContext) -> Any:
            v = f(c)
            return None if v is None else -v

        return neg
    if isinstance(node, Arith | Cmp):
        a = _compile(node.left, scope)
        b = _compile(node.right, scope)
        op = _ARITH[node.op] if isinstance(node, Arith) else _CMP[node.op]

        def binary(c: EvalContext) -> Any:
            x = a(c)
            if x is None:
                return None
            y = b(c)
            if y is None:
                return None
            return op(x, y)

        return binary
    if isinstance(node, InList):
        f = _compile(node.operand, scope)
        items = frozenset(node.items)
        negate = node.negate

        def in_list(c: EvalContext) -> Any:
            v = f(c)
            if v is None:
                return None
            return (v in items) != negate

        return in_list
    if isinstance(node, And | Or):
        a = _compile(node.left, scope)
        b = _compile(node.right, scope)
        # three-valued logic: the deciding value (False for and, True for or) wins over an
        # unknown (None) side; otherwise an unknown side makes the result unknown
        decides = isinstance(node, Or)

        def logic(c: EvalContext) -> Any:
            x = a(c)
            if x is decides:
                return decides
            y = b(c)
            if y is decides:
                return decides
            return None if x is None or y is None else not decides

        return logic
    if isinstance(node, Not):
        f = _compile(node.operand, scope)

        def not_(c: EvalContext) -> Any:
            v = f(c)
            return None if v is None else not v

        return not_
    return _compile_call(node, scope)


def _compile_call(node: Call, scope: str) -> Fn:
    func = node.func
    if func in ("finite", "present", "abs"):
        f = _compile(node.arg, scope)
        if func == "finite":
            return lambda c: (v := f(c)) is not None and math.isfinite(v)
        if func == "present":
            return lambda c: f(c) is not None
        return lambda c: None if (v := f(c)) is None else abs(v)
    assert isinstance(node.arg, Sig)
    name = node.arg.name
    if func.startswith("job_"):
        return _compile_job_agg(func, name)
    cur = getter(scope, name)
    series_of = series_getter(scope, name)
    window_s = node.window_s or 0.0

    def windowed(c: EvalContext) -> Any:
        v = cur(c)
        if v is None or not c.signals.is_tracked(scope, name):
            return None
        s, first_seen = series_of(c)
        now = c.now
        if func == "age":
            return now - (first_seen if s is None else s.last_change_t)
        if s is None:
            if func in ("rate", "increase", "changes"):
                return 0.0
            return v
        if func == "increase":
            return s.increase(now, window_s)
        if func == "rate":
            return s.increase(now, window_s) / window_s
        if func == "changes":
            return s.changes(now, window_s)
        if func == "max_over_time":
            return max(s.extreme(now, window_s, highest=True), v)
        return min(s.extreme(now, window_s, highest=False), v)

    return windowed


def _compile_job_agg(func: str, name: str) -> Fn:
    read = getter("rank", name)

    def agg(c: EvalContext) -> Any:
        job = c.job
        if job is None:
            return None
        key = (func, name, job.name)
        cache = c.cache
        if key in cache:
            return cache[key]
        saved = c.rank
        vals = []
        for r in job.ranks.values():
            c.rank = r
            v = read(c)
            if v is not None and not math.isnan(v):  # NaN has no place in a median
                vals.append(v)
        c.rank = saved
        out: Any
        if func == "job_count":
            out = len(vals)
        elif not vals:
            out = None
        elif func == "job_max":
            out = max(vals)
        elif func == "job_min":
            out = min(vals)
        else:
            vals.sort()
            mid = len(vals) // 2
            out = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
        cache[key] = out
        return out

    return agg
