"""The kinds of field every spec section is made of: the strict base model, checked strings and bounded numbers."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from spec import validation

STAGE_ORDER: tuple[str, ...] = ("prepare", "cpt", "sft", "rlhf", "evaluate", "deploy")


"""The DAG, in order. prepare always runs; the others can be switched off."""


TRAINING_STAGES: tuple[str, ...] = ("cpt", "sft", "rlhf")


"""Stages that train and run as a PyTorchJob."""


OPTIONAL_STAGES: tuple[str, ...] = ("cpt", "sft", "rlhf", "evaluate", "deploy")


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$")


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class StrictModel(BaseModel):
    """Base for every spec model: unknown fields are errors, numbers are finite (no .inf or .nan), values are
    re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False)


class FieldError(ValueError):
    """A rule across fields that one field breaks: `loc` (relative to the model whose validator raises it) names
    that field, so the error points at its file and line."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def _check(problem: str | None, prefix: str = "") -> None:
    """Raise a validation error for a problem a `spec.validation` rule found."""
    if problem:
        raise ValueError(prefix + problem)


def _obeys(rule: Callable[[Any], str | None]) -> AfterValidator:
    """A validator for an annotated type: the value must pass a `spec.validation` rule."""

    def check(value: Any) -> Any:
        _check(rule(value))
        return value

    return AfterValidator(check)


Labels = Annotated[dict[str, str], _obeys(validation.labels)]


"""Label keys and values as the API server accepts them (labels, node selectors)."""


Annotations = Annotated[dict[str, str], _obeys(validation.annotations)]


"""Annotation keys, and their total size."""


KubernetesName = Annotated[str, _obeys(validation.dns_subdomain)]


"""The name of a Kubernetes object (a DNS-1123 subdomain)."""


ImageReference = Annotated[str, _obeys(validation.image_reference)]


"""A container image: [registry[:port]/]repository[:tag][@digest]."""


OneLine = Annotated[str, _obeys(validation.one_line)]


"""A name, path or URI: no control characters, so it cannot forge a line where a message or a log prints it."""


def _dns_label(value: str, what: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise ValueError(f"{what} must be a DNS-1123 label (lowercase letters, digits, '-'; at most 63), got {value!r}")
    return value


Quantity = Annotated[
    str,
    Field(pattern=_QUANTITY.pattern, description="A Kubernetes quantity, e.g. '8', '500m', '64Gi'."),
]


INT32_MAX = 2**31 - 1


INT64_MAX = 2**63 - 1


SEED_MAX = 2**32 - 1


"""numpy's seeds are unsigned 32-bit integers (transformers seeds it with the same value)."""


MAX_DURATION_SECONDS = 10 * 365 * 24 * 3600


"""The longest any duration field may be (ten years): Argo and Go hold durations in nanoseconds in an int64
(about 292 years), and the workflow's deadline adds the stages' up, retries included."""


class IntegerRange:
    """An after-validator: the integer lies in [low, high] (`what` says why in the error). A validator rather than
    ge/le, which a field's own ge/le would replace instead of tightening."""

    def __init__(self, low: int, high: int, what: str) -> None:
        self.low, self.high, self.what = low, high, what

    def __call__(self, value: int) -> int:
        if not self.low <= value <= self.high:
            raise ValueError(f"{value} is outside {self.low}..{self.high}, {self.what}")
        return value


Int32 = Annotated[
    int, AfterValidator(IntegerRange(-(2**31), INT32_MAX, "the range of an int32, as the cluster reads it"))
]


"""An integer the cluster reads as int32 (replica and trial counts, history limits, Argo's and the operator's TTLs,
backoff limits)."""


Int64 = Annotated[int, AfterValidator(IntegerRange(-(2**63), INT64_MAX, "the range of a 64-bit integer"))]


"""Any other integer: the API server, Argo, JSON readers and torch hold at most 64 bits."""


Seconds = Annotated[
    int, AfterValidator(IntegerRange(0, MAX_DURATION_SECONDS, "at most ten years (Go durations add them up)"))
]


"""A duration in whole seconds (deadlines, grace periods, timeouts): at most MAX_DURATION_SECONDS."""


Seed = Annotated[int, AfterValidator(IntegerRange(0, SEED_MAX, "the range of numpy's seeds"))]


"""A random seed (numpy's range)."""


def out_of_int64(node: Any) -> tuple[tuple[str | int, ...], int] | None:
    """The path and value of the first integer in a document that does not fit in 64 bits, or None. Typed fields
    have tighter bounds; this covers the free-form sections too (affinity, deepspeed_config, extra_args), whose
    readers (the API server, Go, JSON decoders) hold no more."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(node, ())]
    while stack:
        value, where = stack.pop()
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value <= INT64_MAX:
            return where, value
        if isinstance(value, dict):
            stack.extend((v, (*where, k)) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, (*where, i)) for i, v in reversed(list(enumerate(value))))
    return None


CronExpression = Annotated[
    str,
    _obeys(validation.cron_expression),
    Field(description="Five fields (minute hour day-of-month month day-of-week) or @daily, @weekly, @every 6h..."),
]
