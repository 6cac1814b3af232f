"""The WorkflowTemplate's UI parameters: the Argo form, its defaults, the spec the template carries.

The Argo UI form edits a handful of parameters (base model, data version and URIs, which stages run, free-form
overrides). Their values never reach a shell or a command line: Argo writes each one into a file (a raw input
artifact of the prepare step), and prepare validates them (spec/form.py) with the same model as the CLI, so a bad
value fails the run at its first step with the parameter and field named.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from spec.fields import OPTIONAL_STAGES
from spec.form import OVERRIDES, PIPELINE_FILE_ONLY
from spec.pipeline import PipelineSpec


@dataclass(frozen=True)
class UIParameter:
    """One parameter of the Argo UI form."""

    name: str
    default: str
    description: str
    enum: tuple[str, ...] | None = None


def _data_stages(spec: PipelineSpec) -> list[str]:
    return [s for s in OPTIONAL_STAGES if spec.stage(s).enabled and getattr(spec.stage(s), "data", None) is not None]


def _switchable_stages(spec: PipelineSpec) -> list[str]:
    return [s for s in OPTIONAL_STAGES if spec.stage(s).enabled]


def ui_parameters(spec: PipelineSpec) -> list[UIParameter]:
    """The form: defaults come from the spec the template was compiled from (with variants: variant_form)."""
    if spec.variants:
        return variant_form(spec)[0]
    params = [
        UIParameter("base-model", spec.model.name_or_path, "Base model: Hugging Face hub id or a path on a volume."),
        UIParameter(
            "data-version",
            spec.data_version,
            "Version label of the input data; replaces {data_version} in the data URIs and is recorded as lineage.",
        ),
    ]
    for stage in _data_stages(spec):
        data = spec.stage(stage).data
        if not isinstance(data, list):
            params.append(
                UIParameter(f"{stage}-data", data.uri, f"{stage} data ({data.format}): path, hf://, gs://, s3://.")
            )
            continue
        for i, dataset in enumerate(data):  # a mixture: one parameter per dataset, by its index in the list
            weight = f", weight {dataset.weight:g}" if dataset.weight is not None else ""
            params.append(
                UIParameter(
                    f"{stage}-data-{i}",
                    dataset.uri,
                    f"{stage} dataset {i} of {len(data)} ({dataset.format}{weight}): path, hf://, gs://, s3://.",
                )
            )
    for stage in _switchable_stages(spec):
        params.append(UIParameter(f"run-{stage}", "true", f"Run the {stage} stage.", ("true", "false")))
    file_only = [".".join(path) for path in PIPELINE_FILE_ONLY]
    params.append(
        UIParameter(
            OVERRIDES,
            "",
            "Extra settings, one path.to.field=value per line (e.g. stages.sft.training.learning_rate=1e-4). "
            f"Pods, volumes, {', '.join(file_only[:-1])} and {file_only[-1]} are fixed in the template: change "
            "them in the pipeline file and register again.",
        )
    )
    return params


def variant_form(spec: PipelineSpec) -> tuple[list[UIParameter], dict[str, dict[str, str]]]:
    """The form of a pipeline with variants, and per variant its parameters' names in it (plain → form).

    A switch `run-<variant>` per variant, then each variant's parameters: shared (its plain name) when every
    variant that has it agrees on the default, else one per variant, `<variant>-<name>`. Each variant's prepare
    reads its values under the plain names, so resolving them is the same as for a pipeline of one model."""
    from spec.variants import variant_specs

    forms = {name: ui_parameters(vspec) for name, vspec in variant_specs(spec).items()}
    defaults: dict[str, set[str]] = {}
    for form in forms.values():
        for p in form:
            defaults.setdefault(p.name, set()).add(p.default)
    params = [
        UIParameter(
            f"run-{v.name}",
            "true",
            f"Train the variant {v.name}" + (f": {v.description}" if v.description else "."),
            ("true", "false"),
        )
        for v in spec.variants
    ]
    names: dict[str, dict[str, str]] = {name: {} for name in forms}
    shared_done: set[str] = set()
    order = list(dict.fromkeys(p.name for form in forms.values() for p in form))
    for plain in order:
        holders = [(variant, p) for variant, form in forms.items() for p in form if p.name == plain]
        if len(defaults[plain]) == 1:
            for variant, _ in holders:
                names[variant][plain] = plain
            if plain not in shared_done:
                shared_done.add(plain)
                variant, p = holders[0]
                where = "" if len(holders) == len(forms) else f" (variants {', '.join(v for v, _ in holders)})"
                params.append(UIParameter(plain, p.default, p.description + where, p.enum))
            continue
        for variant, p in holders:
            names[variant][plain] = f"{variant}-{plain}"
            params.append(UIParameter(f"{variant}-{plain}", p.default, f"{variant}: {p.description}", p.enum))
    return params, names


def variant_values(spec: PipelineSpec, variant: str, values: dict[str, str]) -> dict[str, str]:
    """The form's values (by form name) that reach `variant`'s prepare, by their plain names."""
    names = variant_form(spec)[1][variant]
    return {plain: values[form] for plain, form in names.items() if form in values}


def ui_parameter_names(spec: PipelineSpec) -> list[str]:
    """Names of the template's parameters, in form order."""
    return [p.name for p in ui_parameters(spec)]


def embedded_document(spec: PipelineSpec) -> dict[str, Any]:
    """The spec document the template carries (profiles already applied and dropped)."""
    return spec.model_dump(mode="json", exclude={"profiles"})


def embed_spec(spec: PipelineSpec) -> str:
    """The spec as stored in the template: its embedded document, as base64-encoded JSON."""
    blob = json.dumps(embedded_document(spec), sort_keys=True, ensure_ascii=False)
    return base64.b64encode(blob.encode()).decode()
