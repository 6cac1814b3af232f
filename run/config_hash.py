"""What a stage's outputs are made from (its config hash), and which stages of a run directory another config refuses.

A completed stage with the same config hash is a no-op; with another, it is refused unless forced, and so are
checkpoints or a model made with another config (`conflicting_stages`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from run.run_dir import RunDir, StageResult, write_text_atomic
from spec.fields import STAGE_ORDER, TRAINING_STAGES
from spec.pipeline import PipelineSpec

# Parts of a stage's spec that change where or how fast it runs, not what it produces.
_NOT_HASHED = {"enabled", "resources", "run_policy", "env"}


CHECKPOINTS_CONFIG = "config_hash"
"""`<stage>/checkpoints/config_hash`: the config hash the checkpoints (and the model next to them) were made with."""


def canonical_hash(data: Any) -> str:
    """sha256 of canonical JSON."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def stage_config(spec: PipelineSpec, stage: str) -> dict[str, Any]:
    """What determines a stage's outputs: the model, the data version, the stage's own settings, and the
    config hashes of the enabled stages before it (a changed upstream changes this stage too)."""
    section = spec.stage(stage).model_dump(mode="json", exclude=_NOT_HASHED)
    upstream = [s for s in STAGE_ORDER[: STAGE_ORDER.index(stage)] if spec.stage(s).enabled]
    config = {
        "stage": stage,
        "model": spec.model.model_dump(mode="json"),
        "data_version": spec.data_version,
        "section": section,
        "upstream": {s: canonical_hash(stage_config(spec, s)) for s in upstream},
    }
    if stage == "prepare":
        # prepare reads and normalizes every enabled stage's data: their data sections shape its outputs.
        config["data"] = {
            s: section["data"]
            for s in STAGE_ORDER
            if spec.stage(s).enabled
            and (section := spec.stage(s).model_dump(mode="json", include={"data"})).get("data") is not None
        }
        include = spec.stages.evaluate.lm_eval_include_path
        if spec.stages.evaluate.enabled and include is not None and include.startswith("builtin:"):
            config["lm_eval_tasks"] = include  # prepare writes this builtin task folder too
    return config


def config_hash(spec: PipelineSpec, stage: str) -> str:
    """Hash of `stage_config`."""
    return canonical_hash(stage_config(spec, stage))


def conflicting_stages(run_dir: RunDir, spec: PipelineSpec) -> list[str]:
    """Stages of `run_dir` that running `spec` there would refuse: completed with another config than `spec`
    gives them, or holding checkpoints of another config. Their spec.json must not replace the one they were
    made from."""
    conflicts = []
    for stage in spec.stages.enabled():
        try:
            previous = run_dir.read_result(stage)
        except ValueError:  # an unreadable record is not a completed stage
            continue
        wanted = config_hash(spec, stage)
        changed = previous is not None and previous.status == "succeeded" and previous.config_hash != wanted
        if changed or (stage in TRAINING_STAGES and stale_outputs(run_dir.stage_dir(stage), previous, wanted)):
            conflicts.append(stage)
    return conflicts


def record_outputs_config(stage_dir: Path, wanted: str) -> None:
    """Record that the checkpoints about to be written in `stage_dir` belong to the config `wanted` (read back by
    `outputs_config`), atomically: under torchrun the other ranks read it as they begin while rank 0 writes it, and a
    torn or empty record reads as another config."""
    write_text_atomic(stage_dir / "checkpoints" / CHECKPOINTS_CONFIG, wanted + "\n")


def outputs_config(stage_dir: Path, previous: StageResult | None) -> str | None:
    """The config hash a training stage's checkpoints and model were made with: the one recorded next to the
    checkpoints, else the stage record's; None when neither is there."""
    recorded = stage_dir / "checkpoints" / CHECKPOINTS_CONFIG
    try:
        return recorded.read_text(encoding="utf-8").strip() or None
    except OSError:
        return previous.config_hash if previous is not None else None


def has_outputs(stage_dir: Path) -> bool:
    """Whether a training stage left checkpoints or a model."""
    checkpoints = stage_dir / "checkpoints"
    trained = checkpoints.is_dir() and any(p.name.startswith("checkpoint-") for p in checkpoints.iterdir())
    return trained or (stage_dir / "model").exists()


def stale_outputs(stage_dir: Path, previous: StageResult | None, wanted: str) -> bool:
    """Whether a training stage holds checkpoints or a model made with another config than `wanted` (or with an
    unknown one): resuming from them would continue what another config trained."""
    return has_outputs(stage_dir) and outputs_config(stage_dir, previous) != wanted
