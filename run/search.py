"""A run's hyperparameter searches on disk: where the trials and the record live, and what a finished search chose.

    <run>/hpo/<stage>/trials/<trial>/   one run directory per trial (stages/trials.py)
    <run>/hpo/<stage>/search.json       the selection's record (`python -m stages hpo-select`, stages/hpo.py)

A search is identified by `search_fingerprint` (the stage's config without the searched fields); a search.json made
for the same search is applied to the spec the runner and the stages load (`apply_selections`), so the selected
values are not mistaken for a changed config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from run.config_hash import canonical_hash, stage_config
from run.run_dir import RunDir, StageRefused
from spec.document import Origins
from spec.fields import TRAINING_STAGES
from spec.loading import validate_document
from spec.pipeline import PipelineSpec
from spec.search import HpoSpec, SearchValue


def search_dir(run_root: Path, stage: str) -> Path:
    """`<run>/hpo/<stage>/`: the stage's search (its trials and search.json)."""
    return Path(run_root) / "hpo" / stage


def trials_dir(run_root: Path, stage: str) -> Path:
    """`<run>/hpo/<stage>/trials/`: one run directory per trial."""
    return search_dir(run_root, stage) / "trials"


SEARCH_JSON = "search.json"


def search_path(run_root: Path, stage: str) -> Path:
    """`<run>/hpo/<stage>/search.json`."""
    return search_dir(run_root, stage) / SEARCH_JSON


def search_fingerprint(spec: PipelineSpec, stage: str) -> str:
    """What identifies a search: the stage's config (`run.config_hash.stage_config`: its section, hpo included, the
    model, the data, the stages before it) without the searched fields, so the same before and after the
    selection set them."""
    config = stage_config(spec, stage)
    for parameter in stage_hpo(spec, stage).parameters:
        *parents, last = parameter.keys
        node = config["section"]
        for key in parents:
            node = node[key]
        node.pop(last, None)
    return canonical_hash(config)


def stage_hpo(spec: PipelineSpec, stage: str) -> HpoSpec:
    """The stage's search; StageRefused when it has none."""
    if stage not in TRAINING_STAGES:
        raise StageRefused(f"{stage} is not a training stage; searches run {', '.join(TRAINING_STAGES)}")
    hpo = getattr(spec.stage(stage), "hpo", None)
    if hpo is None:
        raise StageRefused(f"stages.{stage} has no hpo section in the run's spec.json: there is no search to select")
    return hpo


def value_at(section: Any, path: str) -> Any:
    """The value at a dotted path inside a stage's section (a model or a dumped document)."""
    for key in path.split("."):
        section = section[key] if isinstance(section, dict) else getattr(section, key)
    return section


def read_search(run_root: Path, stage: str) -> dict[str, Any] | None:
    """The stage's search.json, None when missing or unreadable."""
    try:
        return json.loads(search_path(run_root, stage).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def finished_search(spec: PipelineSpec, run_root: Path, stage: str) -> dict[str, Any] | None:
    """The stage's search.json when it was made for this very search (same fingerprint), else None."""
    record = read_search(run_root, stage)
    if record is None or record.get("search") != search_fingerprint(spec, stage):
        return None
    return record


def apply_selections(spec: PipelineSpec, run_root: Path) -> PipelineSpec:
    """`spec` with the best values of every finished search of the run directory set in it: what the run's
    spec.json says once those searches selected, and what the stages after them were made with."""
    document = None
    for stage in spec.stages.enabled():
        if getattr(spec.stage(stage), "hpo", None) is None:
            continue
        record = finished_search(spec, run_root, stage)
        if record is None:
            continue
        document = document or spec.model_dump(mode="json", exclude={"profiles"})
        set_values(document, stage, record["best_values"])
    if document is None:
        return spec
    return validate_document(document, Origins(), str(RunDir(run_root).spec_path))


def set_values(document: dict[str, Any], stage: str, values: dict[str, SearchValue]) -> None:
    """Set `values` (by path inside the stage's section) in a spec document, in place."""
    for path, value in values.items():
        *parents, last = path.split(".")
        target = document["stages"][stage]
        for key in parents:
            target = target[key]
        target[last] = value
