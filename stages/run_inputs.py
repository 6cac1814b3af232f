"""What decides a run's result, fingerprinted part by part, and the parts that changed since another run.

The cron rule (`stages.prepare.skip_if_unchanged`) ends a run as skipped only when nothing that shapes its model
or its verdict changed since the last completed run: each stage's data (by content, `stages.data`), the model, each
enabled stage's configuration and the project's version. Where a stage runs and for how long (resources, run_policy,
env) and where its data lies (`data.uri`: the same rows under a new data_version are the same data) are left out.
prepare records the parts in its stage.json (`inputs`), so the next run can say which of them changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from run.config_hash import canonical_hash
from run.version import git_sha, package_version
from spec.pipeline import PipelineSpec

CONFIGURED_STAGES = ("prepare", "cpt", "sft", "rlhf", "evaluate")
"""The stages whose configuration shapes the model or the verdict (deploy only publishes it)."""

NOT_CONFIGURATION = ("resources", "run_policy", "env", "skip_if_unchanged", "num_proc")
"""Stage fields that change where, how long or how fast a stage runs, not what it makes."""

MAX_NAMED_FIELDS = 4
"""Changed fields named per part in the message; the rest are counted."""


def project_version() -> str:
    """The installed project's version and the commit it was built from (POSTTRAIN_GIT_SHA in the image)."""
    return f"{package_version()}+{git_sha() or 'unknown'}"


def stage_configuration(section: dict[str, Any]) -> dict[str, Any]:
    """A stage's section (as spec.json holds it) without what does not shape its result."""
    config = {key: value for key, value in section.items() if key not in NOT_CONFIGURATION}
    data = config.get("data")
    if isinstance(data, dict):
        config["data"] = {key: value for key, value in data.items() if key != "uri"}
    elif isinstance(data, list):  # a mixture: each dataset without its URI
        config["data"] = [{k: v for k, v in d.items() if k != "uri"} if isinstance(d, dict) else d for d in data]
    return config


def run_inputs(spec: PipelineSpec, data_fingerprints: dict[str, str]) -> dict[str, str]:
    """Part → fingerprint: `data:<stage>` for each stage's data, `model`, `config:<stage>` for each enabled stage,
    `version`."""
    document = spec.model_dump(mode="json")
    parts = {f"data:{stage}": fingerprint for stage, fingerprint in data_fingerprints.items()}
    parts["model"] = "sha256:" + canonical_hash(document["model"])
    for stage in CONFIGURED_STAGES:
        section = document["stages"][stage]
        if section.get("enabled", True):
            parts[f"config:{stage}"] = "sha256:" + canonical_hash(stage_configuration(section))
    parts["version"] = project_version()
    return parts


def _changed_paths(before: Any, after: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON documents differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        paths: list[str] = []
        for key in sorted(set(before) | set(after), key=str):
            paths += _changed_paths(before.get(key), after.get(key), f"{prefix}.{key}" if prefix else str(key))
        return paths
    return [] if before == after else [prefix or "(all)"]


def _named(paths: list[str]) -> str:
    shown = ", ".join(paths[:MAX_NAMED_FIELDS])
    return shown + (f" and {len(paths) - MAX_NAMED_FIELDS} more" if len(paths) > MAX_NAMED_FIELDS else "")


def what_changed(spec: PipelineSpec, inputs: dict[str, str], previous_root: Path) -> list[str]:
    """The parts of `inputs` that differ from the run in `previous_root`, in words ('data of sft', 'model
    (name_or_path)', 'stages.sft (training.learning_rate)', 'project version (0.1.0+abc → 0.1.0+def)'); a run
    recorded before the parts were is said to be so."""
    try:
        record = json.loads((previous_root / "prepare" / "stage.json").read_text(encoding="utf-8"))
        before_spec = json.loads((previous_root / "spec.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return [f"run {previous_root.name}'s record is unreadable"]
    before = record.get("extra", {}).get("inputs")
    if not isinstance(before, dict):
        return [f"run {previous_root.name} recorded its data only, not its model, configuration and version"]
    document = spec.model_dump(mode="json")
    changes: list[str] = []
    for part in sorted(set(before) | set(inputs)):
        if before.get(part) == inputs.get(part):
            continue
        kind, _, stage = part.partition(":")
        if kind == "data":
            changes.append(f"data of {stage}")
        elif kind == "model":
            changes.append(f"model ({_named(_changed_paths(before_spec.get('model'), document['model']))})")
        elif kind == "config":
            old = stage_configuration(before_spec.get("stages", {}).get(stage) or {})
            new = stage_configuration(document["stages"][stage])
            changes.append(f"stages.{stage} ({_named(_changed_paths(old, new))})")
        elif kind == "version":
            changes.append(f"project version ({before.get(part)} → {inputs.get(part)})")
        else:
            changes.append(part)
    return changes
