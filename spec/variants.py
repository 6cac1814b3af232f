"""Pipeline variants: the spec of each model a pipeline with `variants` trains, resolved from its document.

A variant's spec is the pipeline's document (with its profile and `--set` values) → the variant's `overrides` →
the variant's own overlay for that profile, named `<pipeline>-<variant>` and validated as a whole. Whatever
names a run after the pipeline then names it after the variant: its run directories, training jobs, MLflow
parent runs, registered model (`<registered_model>-<variant>` when the variant sets none, so each gates against
its own champion) and InferenceService. The variants share the MLflow experiment (the pipeline's, unless set),
their runs tagged with the variant. An error names the variant's field (`variants[0].overrides.stages...`) at
its line in the file.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from spec.document import LoadedPipeline, Origins, SpecError, check_no_credentials, deep_merge
from spec.fields import FieldError
from spec.pipeline import PipelineSpec

Path_ = tuple[str | int, ...]


def _dotted(loc: Path_) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def fold_profile(doc: dict[str, Any], origins: Origins, profile: str) -> None:
    """Merge each variant's overlay for `profile` into its overrides (the profile is applied once, when the
    pipeline is loaded, so a resolved spec carries its variants' final overrides); the overlay's values keep
    their lines."""
    variants = doc.get("variants")
    if not isinstance(variants, list):
        return
    for index, variant in enumerate(variants):
        if not isinstance(variant, dict):
            continue
        overlay = (variant.get("profiles") or {}).get(profile) if isinstance(variant.get("profiles"), dict) else None
        if not isinstance(overlay, dict) or not isinstance(variant.get("overrides", {}), dict):
            continue
        variant["overrides"] = deep_merge(variant.get("overrides") or {}, overlay)
        prefix = ("variants", index, "profiles", profile)
        for path, where in list(origins.by_path.items()):
            if path[: len(prefix)] == prefix and len(path) > len(prefix):
                origins.by_path[("variants", index, "overrides", *path[len(prefix) :])] = where


def _error_lines(exc: ValidationError, loaded: LoadedPipeline, index: int, variant: str) -> str:
    """One line per error: 'file:line: variants[i].overrides.field: message', or the pipeline's own field, said
    to be the variant's."""
    prefix: Path_ = ("variants", index, "overrides")
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            loc = loc + cause.loc
        where = field = None
        for n in range(len(loc), 0, -1):  # the deepest part the variant's overrides set
            if (found := loaded.origins.by_path.get((*prefix, *loc[:n]))) is not None:
                where, field = found, _dotted((*prefix, *loc))
                break
        if where is None:
            where = loaded.origins.find(loc) or loaded.source
            field = f"{_dotted(loc)} (in variant {variant})"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the spec reference in docs/spec.md)"
        lines.append(f"{where}: {field}: {message}")
    return "\n".join(lines)


def variant_document(document: dict[str, Any], index: int) -> dict[str, Any]:
    """The spec document of the variant at `index` of a pipeline's (validated) document, not yet validated."""
    base_name = document["name"]
    variant = document["variants"][index]
    name, overrides = variant["name"], variant.get("overrides") or {}
    doc = {k: copy.deepcopy(v) for k, v in document.items() if k not in ("variants", "profiles")}
    doc = deep_merge(doc, overrides)
    doc["name"] = f"{base_name}-{name}"
    doc["variant"] = name
    tracking = doc.setdefault("tracking", {})
    if isinstance(tracking, dict) and tracking.get("mlflow_experiment") is None:
        tracking["mlflow_experiment"] = base_name  # one experiment for all variants
    own = ((overrides.get("stages") or {}).get("deploy") or {}).get("registered_model")
    base_model = ((document.get("stages") or {}).get("deploy") or {}).get("registered_model")
    if own is None and base_model is not None:  # None: the variant's name, its own already
        doc["stages"]["deploy"]["registered_model"] = f"{base_model}-{name}"
    return doc


def variant_specs(spec: PipelineSpec) -> dict[str, PipelineSpec]:
    """Variant name → its resolved spec, from a validated spec (its profile, and the variants' overlays for it,
    already applied); empty for a pipeline without variants."""
    document = spec.model_dump(mode="json")
    return {
        variant.name: PipelineSpec.model_validate(variant_document(document, index))
        for index, variant in enumerate(spec.variants)
    }


def variant_pipelines(loaded: LoadedPipeline) -> dict[str, LoadedPipeline]:
    """Variant name → its resolved pipeline, in the file's order; empty for a pipeline without variants. A
    SpecError names the variant's field at its line; two variants that would promote one registered model are
    refused."""
    out: dict[str, LoadedPipeline] = {}
    promoted: dict[str, str] = {}
    for index, variant in enumerate(loaded.spec.variants):
        doc = variant_document(loaded.document, index)
        check_no_credentials(doc, Origins(), f"{loaded.source} (variant {variant.name})")
        try:
            spec = PipelineSpec.model_validate(doc)
        except ValidationError as exc:
            raise SpecError(_error_lines(exc, loaded, index, variant.name)) from None
        model = spec.stages.deploy.registered_model or spec.name
        if spec.stages.deploy.enabled and model in promoted:
            raise SpecError(
                f"{loaded.source}: variants[{index}]: variants {promoted[model]} and {variant.name} would both "
                f"promote the registered model {model!r}: give each its own stages.deploy.registered_model"
            )
        promoted[model] = variant.name
        if loaded.profile is not None:  # what the profile changed, for the runner's plan
            overlay = variant.profiles.get(loaded.profile, {})
            doc["profiles"] = {loaded.profile: deep_merge(loaded.spec.profiles.get(loaded.profile, {}), overlay)}
        out[variant.name] = replace(loaded, spec=spec, document=doc)
    return out


def select(loaded: LoadedPipeline, names: list[str]) -> dict[str, LoadedPipeline]:
    """The variants named in `names` (all when empty); a SpecError for a name the pipeline has not."""
    variants = variant_pipelines(loaded)
    unknown = [n for n in names if n not in variants]
    if unknown:
        known = ", ".join(variants) or "none"
        raise SpecError(f"{loaded.source}: no variant {unknown[0]!r} (variants: {known})")
    return {n: p for n, p in variants.items() if not names or n in names}
