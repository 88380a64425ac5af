"""A PromQL parser small enough to read: enough of the grammar for dashboards (selectors,
range vectors, functions, aggregations with by/without, binary operators with
on/ignoring/group_left/right, numbers, strings) to reject malformed expressions and to
name every series an expression selects and every label it groups or matches on.
Grafana's `$variables` may stand for a range (`[$__rate_interval]`) or sit in strings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "group", "topk",
                "bottomk", "quantile", "count_values", "limitk", "limit_ratio"}
FUNCTIONS = {"rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile",
             "clamp", "clamp_min", "clamp_max", "abs", "ceil", "floor", "round", "sqrt",
             "exp", "ln", "log2", "log10", "vector", "scalar", "time", "timestamp",
             "absent", "absent_over_time", "changes", "resets", "label_replace",
             "label_join", "sort", "sort_desc", "predict_linear", "avg_over_time",
             "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
             "quantile_over_time", "last_over_time", "present_over_time",
             "histogram_count", "histogram_sum", "histogram_fraction"}
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", "<=", ">=", "<", ">", "and", "or",
          "unless", "atan2"}
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[(?:\$\{?\w+\}?|\d+[smhdwy](?:\d+[smhdwy])*)(?::(?:\d+[smhdwy])*)?\])
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>=(){},])
""", re.X)


class PromQLError(ValueError):
    pass


@dataclass
class Parsed:
    """What an expression reads: series names and, per name, the labels matched on it;
    labels grouped on (by/without, on/ignoring)."""

    metrics: set[str] = field(default_factory=set)
    matchers: dict[str, set[str]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)


def tokenize(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"unexpected {expr[pos:pos + 20]!r} at {pos} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "ws":
            out.append((m.lastgroup or "", m.group()))
    return out


class _Parser:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.toks = tokenize(expr)
        self.i = 0
        self.out = Parsed()

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        k, v = self.peek()
        if (value is not None and v != value) or (kind is not None and k != kind) \
                or k == "end":
            raise PromQLError(f"expected {value or kind}, got {v or 'the end'!r} "
                              f"in {self.expr!r}")
        self.i += 1
        return v

    def parse(self) -> Parsed:
        self.expression()
        if self.peek()[0] != "end":
            raise PromQLError(f"trailing {self.peek()[1]!r} in {self.expr!r}")
        return self.out

    def expression(self) -> None:
        self.unary()
        while self.peek()[1] in BINARY:
            self.take()
            if self.peek()[1] == "bool":
                self.take()
            if self.peek()[1] in ("on", "ignoring"):
                self.take()
                self.labels()
            if self.peek()[1] in ("group_left", "group_right"):
                self.take()
                if self.peek()[1] == "(":
                    self.labels()
            self.unary()

    def unary(self) -> None:
        if self.peek()[1] in ("-", "+"):
            self.take()
        self.primary()
        if self.peek()[0] == "range":
            self.take()
        if self.peek()[1] == "offset":
            self.take()
            self.take(kind="number")  # a duration such as 5m reads as number + unit
            self.take(kind="ident")

    def primary(self) -> None:
        kind, value = self.peek()
        if kind in ("number", "string"):
            self.take()
        elif value == "(":
            self.take("(")
            self.expression()
            self.take(")")
        elif value == "{":
            self.selector(None)
        elif kind == "ident" and value in AGGREGATIONS and self._called():
            self.aggregation()
        elif kind == "ident" and value in FUNCTIONS and self._called():
            self.take()
            self.arguments()
        elif kind == "ident":
            if self.toks[self.i + 1:self.i + 2] == [("op", "(")]:
                raise PromQLError(f"unknown function {value!r} in {self.expr!r}")
            self.selector(self.take())
        else:
            raise PromQLError(f"unexpected {value or 'end'!r} in {self.expr!r}")

    def _called(self) -> bool:
        nxt = self.toks[self.i + 1:self.i + 2]
        return bool(nxt) and nxt[0][1] in ("(", "by", "without")

    def aggregation(self) -> None:
        self.take()
        if self.peek()[1] in ("by", "without"):
            self.take()
            self.labels()
        self.arguments()
        if self.peek()[1] in ("by", "without"):
            self.take()
            self.labels()

    def arguments(self) -> None:
        self.take("(")
        if self.peek()[1] != ")":
            self.expression()
            while self.peek()[1] == ",":
                self.take(",")
                self.expression()
        self.take(")")

    def labels(self) -> None:
        self.take("(")
        while self.peek()[1] != ")":
            self.out.grouping.add(self.take(kind="ident"))
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")

    def selector(self, name: str | None) -> None:
        matched: set[str] = set()
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take(kind="ident")
                if self.peek()[1] not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"expected a matcher after {label!r} in {self.expr!r}")
                self.take()
                value = self.take(kind="string")
                if label == "__name__":
                    name = value[1:-1]
                else:
                    matched.add(label)
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        if name is None:
            raise PromQLError(f"a selector with no metric name in {self.expr!r}")
        self.out.metrics.add(name)
        self.out.matchers.setdefault(name, set()).update(matched)


def parse(expr: str) -> Parsed:
    """The series and labels `expr` reads; PromQLError when it is not PromQL."""
    return _Parser(expr).parse()


_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<expr>.+),\s*)?(?P<label>\w+)\)$")


def parse_variable_query(query: str) -> Parsed:
    """Grafana's `label_values(selector, label)` variable query."""
    m = _LABEL_VALUES.match(query.strip())
    if m is None:
        raise PromQLError(f"not a label_values() query: {query!r}")
    out = parse(m["expr"]) if m["expr"] else Parsed()
    out.grouping.add(m["label"])
    return out
