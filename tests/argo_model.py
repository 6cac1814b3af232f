"""A model of how Argo Workflows decides the outcome of a resource template from its conditions.

Argo's executor (workflow/executor/resource.go) parses `successCondition` and `failureCondition` with
Kubernetes' label-selector parser (`labels.Parse`, k8s.io/apimachinery/pkg/labels/selector.go) and then, on
every poll of the created resource, evaluates each requirement against the resource's JSON, where a label key
is a gjson path: `Has(key)` is "the path exists" and `Get(key)` is gjson's `Result.String()`.

- Failure requirements are OR-ed: if any matches, the step fails (checked first).
- Success requirements are AND-ed: if all match, the step succeeded (an empty success condition always does).
- Otherwise the executor keeps waiting.

This module reproduces the lexer, parser, requirement validation and matching of `labels.Parse`, and the part
of gjson that a valid label key can reach (dotted paths, numeric array indices, `String()` of every JSON type),
so the conditions the compiler renders can be tested against realistic resource documents without a cluster.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Any, Literal

Outcome = Literal["succeeded", "failed", "running"]


class SelectorParseError(ValueError):
    """A condition that `labels.Parse` rejects; Argo fails the step with "... failed to parse"."""


# --------------------------------------------------------------------------- validation (apimachinery)

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_QUALIFIED_NAME_MAX = 63
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1123_SUBDOMAIN_MAX = 253
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_VALUE_MAX = 63


def qualified_name_errors(value: str) -> list[str]:
    """`validation.IsQualifiedName`: an optional DNS-subdomain prefix and '/', then a name of at most 63."""
    parts = value.split("/")
    errors: list[str] = []
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors.append("prefix part must be non-empty")
        elif len(prefix) > _DNS1123_SUBDOMAIN_MAX or not _DNS1123_SUBDOMAIN.match(prefix):
            errors.append("prefix part must be a lowercase RFC 1123 subdomain")
    else:
        return ["a qualified name has at most one '/'"]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > _QUALIFIED_NAME_MAX:
        errors.append(f"name part must be no more than {_QUALIFIED_NAME_MAX} characters")
    if not _QUALIFIED_NAME.match(name):
        errors.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return errors


def label_value_errors(value: str) -> list[str]:
    """`validation.IsValidLabelValue`: empty, or at most 63 characters of [-A-Za-z0-9_.] with alphanumeric ends."""
    errors = []
    if len(value) > _LABEL_VALUE_MAX:
        errors.append(f"must be no more than {_LABEL_VALUE_MAX} characters")
    if not _LABEL_VALUE.match(value):
        errors.append(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return errors


# --------------------------------------------------------------------------- lexer


class Token(Enum):
    """The lexer's tokens (selector.go)."""

    ERROR = "error"
    END_OF_STRING = "end of string"
    CLOSED_PAR = ")"
    COMMA = ","
    DOES_NOT_EXIST = "!"
    DOUBLE_EQUALS = "=="
    EQUALS = "="
    GREATER_THAN = ">"
    IDENTIFIER = "identifier"
    IN = "in"
    LESS_THAN = "<"
    NOT_EQUALS = "!="
    NOT_IN = "notin"
    OPEN_PAR = "("


_STRING_TO_TOKEN = {
    ")": Token.CLOSED_PAR,
    ",": Token.COMMA,
    "!": Token.DOES_NOT_EXIST,
    "==": Token.DOUBLE_EQUALS,
    "=": Token.EQUALS,
    ">": Token.GREATER_THAN,
    "in": Token.IN,
    "<": Token.LESS_THAN,
    "!=": Token.NOT_EQUALS,
    "notin": Token.NOT_IN,
    "(": Token.OPEN_PAR,
}
_SPECIAL = frozenset("=!(),><")
_WHITESPACE = frozenset(" \t\r\n")
_EOF = "\0"  # Go's lexer reads byte 0 at the end of the input (and stops at a NUL byte too)


class _Lexer:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def _read(self) -> str:
        if self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            return ch
        return _EOF

    def _unread(self) -> None:
        self.pos -= 1

    def _scan_id_or_keyword(self) -> tuple[Token, str]:
        buffer = []
        while True:
            ch = self._read()
            if ch == _EOF:
                break
            if ch in _SPECIAL or ch in _WHITESPACE:
                self._unread()
                break
            buffer.append(ch)
        literal = "".join(buffer)
        return _STRING_TO_TOKEN.get(literal, Token.IDENTIFIER), literal

    def _scan_special_symbol(self) -> tuple[Token, str]:
        buffer = ""
        last: tuple[Token, str] | None = None
        while True:
            ch = self._read()
            if ch == _EOF:
                break
            if ch in _SPECIAL:
                buffer += ch
                if buffer in _STRING_TO_TOKEN:
                    last = (_STRING_TO_TOKEN[buffer], buffer)
                elif last is not None:
                    self._unread()
                    break
            else:
                self._unread()
                break
        if last is None:
            return Token.ERROR, f"error expected: keyword found '{buffer}'"
        return last

    def lex(self) -> tuple[Token, str]:
        ch = self._read()
        while ch in _WHITESPACE:
            ch = self._read()
        if ch == _EOF:
            return Token.END_OF_STRING, ""
        self._unread()
        if ch in _SPECIAL:
            return self._scan_special_symbol()
        return self._scan_id_or_keyword()


# --------------------------------------------------------------------------- requirements


class Operator(Enum):
    """selection.Operator values."""

    DOES_NOT_EXIST = "!"
    EQUALS = "="
    DOUBLE_EQUALS = "=="
    IN = "in"
    NOT_EQUALS = "!="
    NOT_IN = "notin"
    EXISTS = "exists"
    GREATER_THAN = "gt"
    LESS_THAN = "lt"


class Labels:
    """The two questions a requirement asks of the object it is matched against."""

    def has(self, key: str) -> bool:
        raise NotImplementedError

    def get(self, key: str) -> str:
        raise NotImplementedError


def _parse_int64(text: str) -> int | None:
    """Go's strconv.ParseInt(text, 10, 64): optional sign, decimal digits, within int64."""
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        return None
    value = int(text)
    return value if -(2**63) <= value < 2**63 else None


@dataclass(frozen=True)
class Requirement:
    """One requirement of a selector: key, operator and values (a set, as in Go)."""

    key: str
    operator: Operator
    values: frozenset[str]

    def matches(self, labels: Labels) -> bool:
        """`Requirement.Matches`."""
        op = self.operator
        if op in (Operator.IN, Operator.EQUALS, Operator.DOUBLE_EQUALS):
            return labels.has(self.key) and labels.get(self.key) in self.values
        if op in (Operator.NOT_IN, Operator.NOT_EQUALS):
            return not labels.has(self.key) or labels.get(self.key) not in self.values
        if op is Operator.EXISTS:
            return labels.has(self.key)
        if op is Operator.DOES_NOT_EXIST:
            return not labels.has(self.key)
        # GreaterThan / LessThan: the object's value must exist and parse as int64.
        if not labels.has(self.key):
            return False
        actual = _parse_int64(labels.get(self.key))
        if actual is None or len(self.values) != 1:
            return False
        wanted = _parse_int64(next(iter(self.values)))
        if wanted is None:
            return False
        return actual > wanted if op is Operator.GREATER_THAN else actual < wanted

    def __str__(self) -> str:
        """`Requirement.String`, e.g. `a.b in (x,y)` or `!a`."""
        symbols = {
            Operator.EQUALS: "=",
            Operator.DOUBLE_EQUALS: "==",
            Operator.NOT_EQUALS: "!=",
            Operator.IN: " in ",
            Operator.NOT_IN: " notin ",
            Operator.GREATER_THAN: ">",
            Operator.LESS_THAN: "<",
        }
        if self.operator is Operator.EXISTS:
            return self.key
        if self.operator is Operator.DOES_NOT_EXIST:
            return f"!{self.key}"
        values = sorted(self.values)
        shown = f"({','.join(values)})" if self.operator in (Operator.IN, Operator.NOT_IN) else values[0]
        return f"{self.key}{symbols[self.operator]}{shown}"


def new_requirement(key: str, op: Operator, values: Iterable[str]) -> Requirement:
    """`labels.NewRequirement`: validates the key, the number of values and each value."""
    values = list(values)
    errors = [f"key: Invalid value: {key!r}: {e}" for e in qualified_name_errors(key)]
    if op in (Operator.IN, Operator.NOT_IN) and not values:
        errors.append("values: for 'in', 'notin' operators, values set can't be empty")
    elif op in (Operator.EQUALS, Operator.DOUBLE_EQUALS, Operator.NOT_EQUALS) and len(values) != 1:
        errors.append("values: exact-match compatibility requires one single value")
    elif op in (Operator.EXISTS, Operator.DOES_NOT_EXIST) and values:
        errors.append("values: values set must be empty for exists and does not exist")
    elif op in (Operator.GREATER_THAN, Operator.LESS_THAN):
        if len(values) != 1:
            errors.append("values: for 'Gt', 'Lt' operators, exactly one value is required")
        errors += [
            f"values[{i}]: for 'Gt', 'Lt' operators, the value must be an integer"
            for i, v in enumerate(values)
            if _parse_int64(v) is None
        ]
    for i, value in enumerate(values):
        errors += [f"values[{i}]: Invalid value: {value!r}: {e}" for e in label_value_errors(value)]
    if errors:
        raise SelectorParseError("; ".join(errors))
    return Requirement(key, op, frozenset(values))


# --------------------------------------------------------------------------- parser


class _Parser:
    """selector.go's Parser: a token list and a position; `in`/`notin` read as identifiers among values."""

    KEY_AND_OPERATOR = 0
    VALUES = 1

    def __init__(self, text: str) -> None:
        lexer = _Lexer(text)
        self.items: list[tuple[Token, str]] = []
        while True:
            token, literal = lexer.lex()
            self.items.append((token, literal))
            if token is Token.END_OF_STRING:
                break
        self.position = 0

    def _as(self, item: tuple[Token, str], context: int) -> tuple[Token, str]:
        token, literal = item
        if context == self.VALUES and token in (Token.IN, Token.NOT_IN):
            token = Token.IDENTIFIER
        return token, literal

    def lookahead(self, context: int) -> tuple[Token, str]:
        return self._as(self.items[self.position], context)

    def consume(self, context: int) -> tuple[Token, str]:
        self.position += 1
        return self._as(self.items[self.position - 1], context)

    def parse(self) -> list[Requirement]:
        requirements: list[Requirement] = []
        while True:
            token, literal = self.lookahead(self.VALUES)
            if token in (Token.IDENTIFIER, Token.DOES_NOT_EXIST):
                try:
                    requirements.append(self.parse_requirement())
                except SelectorParseError as exc:
                    raise SelectorParseError(f"unable to parse requirement: {exc}") from None
                token, literal = self.consume(self.VALUES)
                if token is Token.END_OF_STRING:
                    return requirements
                if token is Token.COMMA:
                    next_token, next_literal = self.lookahead(self.VALUES)
                    if next_token not in (Token.IDENTIFIER, Token.DOES_NOT_EXIST):
                        raise SelectorParseError(f"found '{next_literal}', expected: identifier after ','")
                else:
                    raise SelectorParseError(f"found '{literal}', expected: ',' or 'end of string'")
            elif token is Token.END_OF_STRING:
                return requirements
            else:
                raise SelectorParseError(f"found '{literal}', expected: !, identifier, or 'end of string'")

    def parse_requirement(self) -> Requirement:
        key, operator = self.parse_key_and_infer_operator()
        if operator in (Operator.EXISTS, Operator.DOES_NOT_EXIST):
            return new_requirement(key, operator, [])
        operator = self.parse_operator()
        in_set = operator in (Operator.IN, Operator.NOT_IN)
        values = self.parse_values() if in_set else self.parse_exact_value()
        return new_requirement(key, operator, sorted(values))

    def parse_key_and_infer_operator(self) -> tuple[str, Operator | None]:
        operator: Operator | None = None
        token, literal = self.consume(self.VALUES)
        if token is Token.DOES_NOT_EXIST:
            operator = Operator.DOES_NOT_EXIST
            token, literal = self.consume(self.VALUES)
        if token is not Token.IDENTIFIER:
            raise SelectorParseError(f"found '{literal}', expected: identifier")
        if errors := qualified_name_errors(literal):
            raise SelectorParseError(f"key: Invalid value: {literal!r}: {'; '.join(errors)}")
        next_token, _ = self.lookahead(self.VALUES)
        if next_token in (Token.END_OF_STRING, Token.COMMA) and operator is not Operator.DOES_NOT_EXIST:
            operator = Operator.EXISTS
        return literal, operator

    def parse_operator(self) -> Operator:
        token, literal = self.consume(self.KEY_AND_OPERATOR)
        operators = {
            Token.IN: Operator.IN,
            Token.EQUALS: Operator.EQUALS,
            Token.DOUBLE_EQUALS: Operator.DOUBLE_EQUALS,
            Token.GREATER_THAN: Operator.GREATER_THAN,
            Token.LESS_THAN: Operator.LESS_THAN,
            Token.NOT_IN: Operator.NOT_IN,
            Token.NOT_EQUALS: Operator.NOT_EQUALS,
        }
        if token not in operators:
            raise SelectorParseError(f"found '{literal}', expected: in, notin, =, ==, !=, gt, lt")
        return operators[token]

    def parse_values(self) -> set[str]:
        token, literal = self.consume(self.VALUES)
        if token is not Token.OPEN_PAR:
            raise SelectorParseError(f"found '{literal}' expected: '('")
        token, literal = self.lookahead(self.VALUES)
        if token in (Token.IDENTIFIER, Token.COMMA):
            values = self.parse_identifiers_list()
            if self.consume(self.VALUES)[0] is not Token.CLOSED_PAR:
                raise SelectorParseError(f"found '{literal}', expected: ')'")
            return values
        if token is Token.CLOSED_PAR:  # "()"
            self.consume(self.VALUES)
            return {""}
        raise SelectorParseError(f"found '{literal}', expected: ',', ')' or identifier")

    def parse_identifiers_list(self) -> set[str]:
        values: set[str] = set()
        while True:
            token, literal = self.consume(self.VALUES)
            if token is Token.IDENTIFIER:
                values.add(literal)
                next_token, next_literal = self.lookahead(self.VALUES)
                if next_token is Token.COMMA:
                    continue
                if next_token is Token.CLOSED_PAR:
                    return values
                raise SelectorParseError(f"found '{next_literal}', expected: ',' or ')'")
            if token is Token.COMMA:  # "(," ",," ",)" all add the empty value
                if not values:
                    values.add("")
                next_token, _ = self.lookahead(self.VALUES)
                if next_token is Token.CLOSED_PAR:
                    values.add("")
                    return values
                if next_token is Token.COMMA:
                    self.consume(self.VALUES)
                    values.add("")
            else:
                raise SelectorParseError(f"found '{literal}', expected: ',', or identifier")

    def parse_exact_value(self) -> set[str]:
        token, _ = self.lookahead(self.VALUES)
        if token in (Token.END_OF_STRING, Token.COMMA):
            return {""}
        token, literal = self.consume(self.VALUES)
        if token is Token.IDENTIFIER:
            return {literal}
        raise SelectorParseError(f"found '{literal}', expected: identifier")


def parse_selector(text: str) -> list[Requirement]:
    """`labels.Parse`: the requirements of a selector, sorted by key; raises SelectorParseError."""
    return sorted(_Parser(text).parse(), key=lambda r: r.key)


# --------------------------------------------------------------------------- gjson


@dataclass(frozen=True)
class GjsonResult:
    """What Argo asks of a gjson lookup: `Exists()` and `String()`."""

    exists: bool
    string: str


_GJSON_UNSUPPORTED = frozenset("*?#|@![{")


def _split_gjson_path(path: str) -> list[str]:
    """Dotted components; a backslash escapes the next character. Wildcards, queries, modifiers and
    multipaths cannot occur in a label key, so they are refused rather than half-modelled."""
    parts, current, i = [], "", 0
    while i < len(path):
        ch = path[i]
        if ch == "\\" and i + 1 < len(path):
            current += path[i + 1]
            i += 2
            continue
        if ch in _GJSON_UNSUPPORTED:
            raise ValueError(f"gjson feature {ch!r} in {path!r} is not modelled")
        if ch == ".":
            parts.append(current)
            current = ""
        else:
            current += ch
        i += 1
    parts.append(current)
    return parts


def _go_format_float(value: float) -> str:
    """strconv.FormatFloat(value, 'f', -1, 64): shortest round-trip digits, never an exponent."""
    text = format(Decimal(repr(value)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _go_json(value: Any) -> str:
    """encoding/json's compact output for an unstructured object (sorted keys, HTML-safe escapes), which is
    what the API server returns and hence gjson's Raw for objects and arrays."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028")):
        text = text.replace(char, escaped)
    return text.replace("\u2029", "\\u2029")


def gjson_string(value: Any) -> str:
    """gjson `Result.String()` of a JSON value: null → '', integers as written, other numbers via
    FormatFloat('f'), objects and arrays as their raw JSON."""
    if value is None:
        return ""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _go_format_float(value)
    if isinstance(value, str):
        return value
    return _go_json(value)


def gjson_get(document: Any, path: str) -> GjsonResult:
    """`gjson.Get(json, path)` for dotted paths: object keys match exactly, all-digit components index arrays.
    A JSON null exists (its Raw is 'null') and reads as ''."""
    node = document
    for part in _split_gjson_path(path):
        if isinstance(node, Mapping):
            if part not in node:
                return GjsonResult(False, "")
            node = node[part]
        elif isinstance(node, list):
            if not part or not part.isdigit() or not part.isascii() or int(part) >= len(node):
                return GjsonResult(False, "")
            node = node[int(part)]
        else:
            return GjsonResult(False, "")
    return GjsonResult(True, gjson_string(node))


class GjsonLabels(Labels):
    """Argo's `gjsonLabels`: label keys are gjson paths into the resource JSON."""

    def __init__(self, document: Any) -> None:
        self.document = document

    def has(self, key: str) -> bool:
        return gjson_get(self.document, key).exists

    def get(self, key: str) -> str:
        return gjson_get(self.document, key).string


# --------------------------------------------------------------------------- the executor's verdict


def evaluate(resource: Mapping[str, Any] | str, success_condition: str = "", failure_condition: str = "") -> Outcome:
    """The outcome of one poll of `resource` (a JSON object or its text) under the two conditions.

    Raises SelectorParseError when either condition does not parse (Argo fails the step before polling).
    """
    success = parse_selector(success_condition)
    failure = parse_selector(failure_condition)
    document = json.loads(resource) if isinstance(resource, str) else json.loads(json.dumps(resource))
    labels = GjsonLabels(document)
    if any(req.matches(labels) for req in failure):
        return "failed"
    if all(req.matches(labels) for req in success):
        return "succeeded"
    return "running"
