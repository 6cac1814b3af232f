"""How the prepare step resolves the Argo form's values into the pipeline spec, within what the form may change.

Argo writes each form parameter (workflows/parameters.py) into a file; prepare reads them here, in the pod, and
validates them with the same model as the CLI, so a bad value fails the run at its first step with the parameter and
field named.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from spec.document import Origins, SpecError
from spec.fields import OPTIONAL_STAGES, STAGE_ORDER, TRAINING_STAGES
from spec.loading import override, parse_override, validate_document
from spec.pipeline import PipelineSpec
from spec.release import EvaluateStage, GateRule
from spec.training import FORM_EXTRA_ARGS

SPEC_FILE = "pipeline.json.b64"
"""The compiled spec inside the template, base64-encoded so Argo never reads '{{' in it as an expression."""

OVERRIDES = "overrides"

# Sections compiled into the template (pods, volumes, schedule...): changing them needs a new template.
COMPILED_SECTIONS = ("name", "cluster", "schedule", "workflow", "notifications", "retention", "profiles")
COMPILED_STAGE_FIELDS = ("enabled", "resources", "run_policy", "env")
COMPILED_FIELDS = (("stages", "deploy", "serving"),)  # the serve step's InferenceService manifest
PIPELINE_FILE_ONLY: dict[tuple[str, ...], str] = {
    ("model", "trust_remote_code"): "it lets code from the model's repository run in the pods",
    ("tracking", "mlflow_tracking_uri"): "the pods send their MLflow credentials to that server",
    ("stages", "evaluate", "lm_eval_include_path"): "lm-eval task files there can import and run Python code",
    ("stages", "evaluate", "backend"): "it decides which engine runs the models whose numbers the gate compares",
    ("stages", "deploy", "storage_uri"): "deploy uploads the model there with the pods' cloud credentials",
    ("stages", "rlhf", "reward_modules"): "they name the Python modules a reward function may import and run",
    ("stages", "deploy", "registered_model"): "it decides whose champion and challenger aliases a run moves",
}
"""Fields that decide what code runs, where credentials go or which registered model a run may promote: whoever
registers the pipeline sets them in its file; the form (anyone who may submit) cannot."""

GATE = ("stages", "evaluate", "gate")
"""The form may tighten the gate (add rules, lower a max_regression), never loosen it (`check_gate_kept`)."""

EXTRA_ARGS = ("training", "extra_args")
"""Below a training stage: the form may change only the keys of FORM_EXTRA_ARGS there (`check_extra_args_kept`)."""


def _compiled_fields() -> list[tuple[str, ...]]:
    """The field paths the form may not change: compiled sections, compiled stage fields, pipeline-file-only."""
    stage_fields = [("stages", s, f) for s in STAGE_ORDER for f in COMPILED_STAGE_FIELDS]
    return (
        [(section,) for section in COMPILED_SECTIONS] + stage_fields + list(COMPILED_FIELDS) + list(PIPELINE_FILE_ONLY)
    )


def fixed_field(keys: Sequence[str]) -> tuple[str, ...] | None:
    """The field the form may not change that an override of `keys` would set: the field itself, one it lies
    in, or one inside the section it replaces (`tracking={...}`); None when the form may set `keys`."""
    path = tuple(keys)
    for fixed in _compiled_fields():
        if path[: len(fixed)] == fixed or fixed[: len(path)] == path:
            return fixed
    return None


def _check_not_compiled(keys: list[str], where: str) -> None:
    """Refuse an override that sets a compiled field, or replaces a section holding one (`tracking={...}`)."""
    fixed = fixed_field(keys)
    if fixed is None:
        return
    field, fixed_name = ".".join(keys), ".".join(fixed)
    if len(fixed) > len(keys):  # a mapping value would replace the whole section, the fixed field with it
        raise SpecError(
            f"{where}: {field} would replace the whole section, {fixed_name} included, which the form cannot "
            f"change; set the fields below {field} one per line instead"
        )
    if fixed in PIPELINE_FILE_ONLY:
        raise SpecError(
            f"{where}: {field} cannot be set from the form: {PIPELINE_FILE_ONLY[fixed]}; set it in the "
            "pipeline file and register it again"
        )
    hint = "use the run-<stage> parameter" if fixed[-1] == "enabled" else "edit the pipeline file and register again"
    raise SpecError(f"{where}: {field} is fixed when the template is compiled and cannot be changed per run; {hint}")


def form_line(number: int) -> str:
    """How an error names a line of the form's overrides parameter."""
    return f"parameter {OVERRIDES}, line {number}"


def _gate_rules(document: dict) -> list[GateRule]:
    """The gate rules of a spec document (the model's default when it names none)."""
    rules = ((document.get("stages") or {}).get("evaluate") or {}).get("gate")
    if rules is None:
        return list(EvaluateStage().gate)
    return [GateRule.model_validate(rule) for rule in rules]


def _describe(rule: GateRule) -> str:
    direction = "higher" if rule.higher_is_better else "lower"
    extra = "".join(
        f", {name} {value:g}"
        for name, value in (
            ("max_regression_relative", rule.max_regression_relative),
            ("min_significance", rule.min_significance),
        )
        if value is not None
    )
    return f"{rule.metric} ({direction} is better, max_regression {rule.max_regression:g}{extra})"


def check_gate_kept(template: list[GateRule], resolved: list[GateRule], where: str) -> None:
    """SpecError unless `resolved` keeps every rule of the template's gate, as strict or stricter: same metric and
    direction, max_regression and max_regression_relative no larger, min_significance no smaller. Added rules are
    fine (they only make the gate harder to pass)."""
    for rule in template:
        if not any(r.at_least_as_strict_as(rule) for r in resolved):
            raise SpecError(
                f"{where}: stages.evaluate.gate would no longer hold the rule {_describe(rule)}: the form may only "
                "tighten the gate (add rules, lower a max_regression), never remove, relax or reverse a rule; "
                "change the gate in the pipeline file and register it again"
            )


def _as_json(value: object) -> str:
    """A value compared as JSON, so true, 1 and 1.0 differ."""
    return json.dumps(value, sort_keys=True)


def check_extra_args_kept(document: dict, spec: PipelineSpec, lines: list[tuple[tuple[str, ...], str]]) -> None:
    """SpecError unless every training stage's `training.extra_args` in `spec` differs from the template's
    `document` only in keys of FORM_EXTRA_ARGS (added, changed or removed); `lines` are the override lines applied,
    (keys, where), in order: the error names the last one that reached the key, however it did (the key itself,
    `extra_args={...}`, `training={...}`)."""
    missing = object()
    for stage in TRAINING_STAGES:
        template = ((document.get("stages") or {}).get(stage) or {}).get("training") or {}
        before = template.get("extra_args") or {}
        after = spec.stage(stage).training.extra_args
        for key in sorted(set(before) | set(after)):
            old, new = before.get(key, missing), after.get(key, missing)
            if key in FORM_EXTRA_ARGS or (old is not missing and new is not missing and _as_json(old) == _as_json(new)):
                continue
            path = ("stages", stage, *EXTRA_ARGS, key)
            where = next(
                (w for keys, w in reversed(lines) if path[: len(keys)] == keys or keys[: len(path)] == path),
                f"parameter {OVERRIDES}",
            )
            raise SpecError(
                f"{where}: {'.'.join(path)} cannot be set from the form: it may change only the optimizer, loss and "
                "memory settings listed under training.extra_args in docs/spec.md; set it in the pipeline file and "
                "register it again"
            )


def _index(parameter: str) -> int:
    """The dataset index at the end of a `<stage>-data-<index>` parameter."""
    return int(parameter.rsplit("-", 1)[1])


def resolve_parameters(
    document: dict, values: dict[str, str], line_origin: Callable[[int], str] = form_line
) -> PipelineSpec:
    """Apply UI parameter values to the embedded spec document and validate the result: fields the template
    fixes are refused, the gate may only get stricter, training.extra_args change only in FORM_EXTRA_ARGS.
    `line_origin` names line N of the overrides parameter in errors (submit names the --set it came from)."""
    doc = json.loads(json.dumps(document))  # deep copy, JSON types only
    origins = Origins()
    known = set(values)
    gate_changed_by = ""
    applied: list[tuple[tuple[str, ...], str]] = []

    def put(keys: list[str], value: object, where: str) -> None:
        override(doc, origins, keys, value, where)

    if "base-model" in known:
        if not values["base-model"].strip():
            raise SpecError("parameter base-model: must not be empty")
        put(["model", "name_or_path"], values["base-model"].strip(), "parameter base-model")
    if "data-version" in known:
        put(["data_version"], values["data-version"].strip(), "parameter data-version")
    for stage in OPTIONAL_STAGES:
        if f"{stage}-data" in known:
            put(["stages", stage, "data", "uri"], values[f"{stage}-data"].strip(), f"parameter {stage}-data")
        for name in sorted((n for n in known if re.fullmatch(rf"{stage}-data-\d+", n)), key=_index):
            index = name.rsplit("-", 1)[1]
            put(["stages", stage, "data", index, "uri"], values[name].strip(), f"parameter {name}")
        if f"run-{stage}" in known:
            raw = values[f"run-{stage}"].strip()
            if raw not in ("true", "false"):
                raise SpecError(f"parameter run-{stage}: expected true or false, got {raw!r}")
            put(["stages", stage, "enabled"], raw == "true", f"parameter run-{stage}")
    for number, line in enumerate(values.get(OVERRIDES, "").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = line_origin(number)
        try:
            keys, value = parse_override(line.strip())
        except SpecError as exc:
            raise SpecError(f"{where}: {str(exc).removeprefix('--set ')}") from None
        _check_not_compiled(keys, where)
        if tuple(keys[: len(GATE)]) == GATE[: len(keys)]:
            gate_changed_by = where
        applied.append((tuple(keys), where))
        put(keys, value, where)
    spec = validate_document(doc, origins, "parameters")
    if gate_changed_by:
        check_gate_kept(_gate_rules(document), spec.stages.evaluate.gate, gate_changed_by)
    check_extra_args_kept(document, spec, applied)
    return spec


def read_params_dir(path: Path) -> tuple[dict, dict[str, str]]:
    """The embedded spec document and the parameter values Argo wrote as files into `path`."""
    spec_file = path / SPEC_FILE
    if not spec_file.is_file():
        raise SpecError(f"{spec_file} is missing: the template must provide the pipeline spec")
    try:
        document = json.loads(base64.b64decode(spec_file.read_text(encoding="ascii")))
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecError(f"{spec_file}: not a base64-encoded JSON spec ({exc})") from None
    values = {}
    for file in sorted(path.iterdir()):
        if file.name != SPEC_FILE and file.is_file():
            try:
                values[file.name] = file.read_bytes().decode("utf-8")  # as written: no newline translation
            except UnicodeDecodeError:
                raise SpecError(f"parameter {file.name}: not UTF-8 text") from None
    return document, values


def resolve_params_dir(path: Path) -> PipelineSpec:
    """What prepare does first in the cluster: the resolved spec from the template's spec and the form."""
    document, values = read_params_dir(path)
    return resolve_parameters(document, values)


def stage_switches(spec: PipelineSpec) -> dict[str, str]:
    """Output parameters of prepare that gate the DAG's tasks: run-<stage> → 'true'/'false'."""
    return {f"run-{stage}": str(spec.stage(stage).enabled).lower() for stage in OPTIONAL_STAGES}
