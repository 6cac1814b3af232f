"""Syntax of the values the spec hands to Kubernetes, Argo and cron, checked before anything is submitted.

Each function returns None for a good value and otherwise one sentence saying what is wrong, so the spec's
validators can name the field. The rules are the API server's and the controllers' own:
- label keys and values, annotation keys, DNS-1123 names (k8s.io/apimachinery validation);
- image references (the distribution/reference grammar the kubelet parses);
- cron expressions as Argo's CronWorkflow parses them (robfig/cron v3's standard parser: five fields with their
  ranges, names, `?`, steps greater than zero, and the @-descriptors);
- core/v1 objects given as mappings (an Affinity): every field known, required fields present, enum values
  valid (the Kubernetes Python client's models describe the fields).
"""

from __future__ import annotations

import re
from typing import Any

from spec.quoting import control_character, quoted

MAX_ANNOTATIONS_BYTES = 256 * 1024
"""The API server's limit on the total size of an object's annotations (keys and values)."""

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# github.com/distribution/reference: [domain/]path[:tag][@digest]
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
# The first component is a registry only when it has a '.' or a port, or is localhost (as docker reads it).
_DOMAIN = (
    rf"(?:(?:localhost|{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})+|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
    rf"|{_DOMAIN_COMPONENT}:[0-9]+)"
)
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)


def dns_label(value: str) -> str | None:
    """A DNS-1123 label: lowercase letters, digits and '-', at most 63."""
    if len(value) > 63 or not _DNS_LABEL.match(value):
        return f"{value!r} is not a DNS-1123 label (lowercase letters, digits and '-', at most 63 characters)"
    return None


def dns_subdomain(value: str) -> str | None:
    """A DNS-1123 subdomain (the form of most object names): labels joined by '.', at most 253."""
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        return (
            f"{value!r} is not a valid Kubernetes name (lowercase letters, digits, '-' and '.', starting and ending "
            "with a letter or digit, at most 253 characters)"
        )
    return None


def qualified_name(key: str) -> str | None:
    """A label or annotation key: `[prefix/]name`, the prefix a DNS subdomain, the name at most 63 of
    letters, digits, '-', '_' and '.', alphanumeric at both ends."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or dns_subdomain(prefix) is not None):
        return f"key {key!r}: the prefix before '/' must be a DNS subdomain such as example.com"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return (
            f"key {key!r} is not a valid label or annotation key (at most 63 letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit, optionally after a 'prefix/')"
        )
    return None


def label_value(value: str) -> str | None:
    """A label value: empty, or at most 63 letters, digits, '-', '_' and '.', alphanumeric at both ends."""
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return (
            f"label value {value!r} is not valid (at most 63 letters, digits, '-', '_' and '.', starting and ending "
            "with a letter or digit)"
        )
    return None


def labels(mapping: dict[str, str]) -> str | None:
    """Every key and value of a label mapping (labels, node selectors)."""
    for key, value in mapping.items():
        problem = qualified_name(key) or label_value(value)
        if problem:
            return problem
    return None


def annotations(mapping: dict[str, str]) -> str | None:
    """Annotation keys, and the total size the API server accepts."""
    for key in mapping:
        if problem := qualified_name(key):
            return problem
    size = sum(len(k.encode()) + len(v.encode()) for k, v in mapping.items())
    if size > MAX_ANNOTATIONS_BYTES:
        return f"annotations total {size} bytes, over the {MAX_ANNOTATIONS_BYTES} the API server accepts"
    return None


def image_reference(value: str) -> str | None:
    """A container image reference: `[registry[:port]/]path[:tag][@digest]`."""
    if not _IMAGE.match(value):
        return (
            f"{value!r} is not an image reference ([registry[:port]/]repository[:tag][@sha256:digest], lowercase "
            "repository, no spaces or newlines)"
        )
    return None


# --------------------------------------------------------------------------- cron

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (field name, low, high, names) as robfig/cron v3 bounds them.
_CRON_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {name: i + 1 for i, name in enumerate(_MONTHS)}),
    ("day of week", 0, 6, {name: i for i, name in enumerate(_DAYS)}),
)
CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_GO_DURATION = re.compile(rf"^(?:{_GO_DURATION_PART.pattern})+$")
_GO_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def go_duration_seconds(value: str) -> float | None:
    """The seconds of a Go duration ('90s', '2m', '1h30m', as Argo and robfig/cron read them), None when `value`
    is not one."""
    if not _GO_DURATION.match(value):
        return None
    return sum(float(n) * _GO_UNIT_SECONDS[unit] for n, unit in _GO_DURATION_PART.findall(value))


def _cron_number(text: str, low: int, high: int, names: dict[str, int], field: str) -> int:
    value = names.get(text.lower())
    if value is None:
        if not text.isdigit():
            raise ValueError(f"{field} {text!r} is neither a number nor a name")
        value = int(text)
    if not low <= value <= high:
        raise ValueError(f"{field} {value} is outside {low}-{high}")
    return value


def _cron_field(text: str, field: str, low: int, high: int, names: dict[str, int]) -> None:
    for part in text.split(","):
        if not part:
            raise ValueError(f"{field} has an empty list item")
        span, slash, step = part.partition("/")
        if slash and (not step.isdigit() or int(step) == 0):
            raise ValueError(f"{field} step {step!r} must be a number greater than 0")
        if span in ("*", "?"):
            if span == "?" and field not in ("day of month", "day of week"):
                raise ValueError(f"'?' is only for day of month and day of week, not {field}")
            continue
        first, dash, last = span.partition("-")
        start = _cron_number(first, low, high, names, field)
        if dash:
            end = _cron_number(last, low, high, names, field)
            if end < start:
                raise ValueError(f"{field} range {span} runs backwards")


def cron_expression(expr: str) -> str | None:
    """A schedule as Argo's CronWorkflow reads it: five fields (minute hour day-of-month month day-of-week) with
    their ranges, or @yearly/@monthly/@weekly/@daily/@hourly/@every <duration>."""
    text = expr.strip()
    if text.startswith(("TZ=", "CRON_TZ=")):
        return f"cron expression {expr!r}: set the timezone in schedule.timezone, not in the expression"
    if text.startswith("@"):
        if text.lower() in CRON_DESCRIPTORS:
            return None
        every, _, duration = text.partition(" ")
        if every.lower() == "@every" and go_duration_seconds(duration.strip()) is not None:
            return None
        return (
            f"cron expression {expr!r}: unknown descriptor (use {', '.join(CRON_DESCRIPTORS)} or "
            "'@every <duration>' such as '@every 6h')"
        )
    fields = text.split()
    if len(fields) != 5:
        return f"cron expression {expr!r} must have 5 fields (minute hour day-of-month month day-of-week)"
    if not all(re.match(r"^[0-9A-Za-z*/,?-]+$", f) for f in fields):
        return f"cron expression {expr!r} has characters cron does not use"
    for value, (field, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        try:
            _cron_field(value, field, low, high, names)
        except ValueError as exc:
            return f"cron expression {expr!r}: {exc}"
    return None


# --------------------------------------------------------------------------- core/v1 objects

# Fields whose value is one of a fixed set (the client's models do not say so).
_ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("V1NodeSelectorRequirement", "operator"): ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"),
    ("V1LabelSelectorRequirement", "operator"): ("In", "NotIn", "Exists", "DoesNotExist"),
}
_SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def kubernetes_object(data: Any, kind: str) -> str | None:
    """Whether `data` (a mapping as written in a pod spec, camelCase keys) is a valid core/v1 `kind`, e.g.
    "V1Affinity": every key known, every required field there, scalars of the right type, operators valid."""
    from kubernetes.client import models  # only when such an object is in the spec: the import takes ~0.5 s

    def check(value: Any, type_name: str, path: str) -> Any:
        if type_name.startswith("list["):
            if not isinstance(value, list):
                raise ValueError(f"{path}: expected a list")
            return [check(v, type_name[5:-1], f"{path}[{i}]") for i, v in enumerate(value)]
        if type_name.startswith("dict("):
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"{path}: expected a mapping")
            inner = type_name[type_name.index(",") + 1 : -1].strip()
            return {k: check(v, inner, f"{path}.{k}") for k, v in value.items()}
        if type_name in _SCALARS:
            if not isinstance(value, _SCALARS[type_name]) or (type_name != "bool" and isinstance(value, bool)):
                raise ValueError(f"{path}: expected {type_name}, got {type(value).__name__}")
            return value
        if type_name == "object":
            return value
        cls = getattr(models, type_name)
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping ({type_name.removeprefix('V1')})")
        by_key = {key: attr for attr, key in cls.attribute_map.items()}
        kwargs = {}
        for key, item in value.items():
            if key not in by_key:
                known = ", ".join(sorted(by_key))
                raise ValueError(f"{path}.{key}: unknown field of {type_name.removeprefix('V1')} (known: {known})")
            attr = by_key[key]
            allowed = _ENUMS.get((type_name, attr))
            if allowed is not None and item not in allowed:
                raise ValueError(f"{path}.{key}: {item!r} is not one of {', '.join(allowed)}")
            kwargs[attr] = check(item, cls.openapi_types[attr], f"{path}.{key}")
        try:
            return cls(**kwargs)
        except ValueError as exc:  # "Invalid value for `operator`, must not be `None`"
            missing = re.search(r"`(\w+)`", str(exc))
            field = cls.attribute_map.get(missing.group(1), missing.group(1)) if missing else "?"
            raise ValueError(f"{path}: {field} is required") from None

    try:
        check(data, kind, kind.removeprefix("V1").lower())
    except ValueError as exc:
        return str(exc)
    return None


def one_line(value: str) -> str | None:
    """A name, path or URI holds no control character (a newline, a carriage return, a terminal escape): printed
    in a message or a log, it could otherwise forge a line of its own."""
    c = control_character(value)
    return None if c is None else f"holds the control character {quoted(c)}; names, paths and URIs are one line"
