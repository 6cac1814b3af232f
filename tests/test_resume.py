"""Preemption: a killed stage resumes from its newest valid checkpoint (a torn one falls back to the one
before), SIGTERM saves a checkpoint and exits 75, and the rerun keeps the same MLflow run. Checkpoints belong to
the config that made them: another config is refused, and --force moves them aside and starts over."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from training_fixtures import make_run_dir, run_stage, start_stage, wait_for_file

from run.config_hash import (
    CHECKPOINTS_CONFIG,
    config_hash,
    conflicting_stages,
    outputs_config,
    record_outputs_config,
    stale_outputs,
)
from run.exits import EXIT_RETRYABLE, EXIT_USAGE
from spec.loading import load_pipeline
from stages.checkpoints import MARKER, mark_complete, newest_valid_checkpoint, set_aside_torn
from stages.training import read_log_history

FAST = [
    "stages.cpt.training.max_steps=12",
    "stages.cpt.training.save_steps=3",
    "stages.cpt.training.logging_steps=1",
]


def logged_steps(run_dir) -> list[int]:
    history = read_log_history(run_dir.stage_dir("cpt") / "logs/log_history.json")
    return [e["step"] for e in history if "loss" in e]


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_resumes_past_a_torn_checkpoint(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", overrides=FAST, n_text=80, n_chat=10)
    checkpoints = run_dir.stage_dir("cpt") / "checkpoints"

    child = start_stage(run_dir, "cpt", HOLD_AFTER_CHECKPOINT="6")
    wait_for_file(checkpoints / "checkpoint-6" / MARKER, child)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    killed = run_dir.read_result("cpt")
    assert killed is not None and killed.status == "running"

    # The pod died while writing the next checkpoint: no marker, weights cut short.
    torn = checkpoints / "checkpoint-9"
    shutil.copytree(checkpoints / "checkpoint-6", torn)
    (torn / MARKER).unlink()
    weights = torn / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    done = run_stage(run_dir, "cpt")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint-9 is torn" in done.stderr
    result = run_dir.read_result("cpt")
    assert result is not None and result.status == "succeeded"
    assert result.attempts == 2
    assert result.extra["resumed_from"] == "checkpoint-6" and result.extra["resumed_from_step"] == 6
    assert result.metrics["steps"] == 12
    assert logged_steps(run_dir) == list(range(1, 13))  # steps 1-6 from the first attempt, 7-12 from the rerun
    if importlib.util.find_spec("stages.tracking") is not None:
        assert killed.mlflow_run_id is not None  # recorded early, so the rerun continues the same run
    assert result.mlflow_run_id == killed.mlflow_run_id
    assert list(checkpoints.glob("torn-checkpoint-9-*"))
    assert newest_valid_checkpoint(checkpoints).name == "checkpoint-12"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_retryable(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", overrides=FAST, n_text=80, n_chat=10)
    checkpoints = run_dir.stage_dir("cpt") / "checkpoints"

    child = start_stage(run_dir, "cpt", HOLD_AFTER_CHECKPOINT="3")
    wait_for_file(checkpoints / "checkpoint-3" / MARKER, child)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=300) == EXIT_RETRYABLE

    result = run_dir.read_result("cpt")
    assert result is not None and result.status == "interrupted"
    assert "checkpoint-4" in result.message
    assert newest_valid_checkpoint(checkpoints).name == "checkpoint-4"  # saved at the end of the next step

    done = run_stage(run_dir, "cpt")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = run_dir.read_result("cpt")
    assert resumed.status == "succeeded" and resumed.extra["resumed_from_step"] == 4
    assert resumed.mlflow_run_id == result.mlflow_run_id


def fake_checkpoint(checkpoints: Path, step: int) -> Path:
    path = checkpoints / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(64, 64)}, path / "model.safetensors")
    (path / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    mark_complete(path, step)
    return path


def test_newest_valid_checkpoint_skips_torn_ones(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    assert newest_valid_checkpoint(tmp_path).name == "checkpoint-6"

    (tmp_path / "checkpoint-6" / MARKER).unlink()  # killed before the marker
    with pytest.warns(UserWarning, match="checkpoint-6"):
        assert newest_valid_checkpoint(tmp_path).name == "checkpoint-4"

    weights = tmp_path / "checkpoint-4" / "model.safetensors"  # marker there, but a file cut short
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.warns(UserWarning) as caught:
        assert newest_valid_checkpoint(tmp_path).name == "checkpoint-2"
    assert ["checkpoint-6" in str(w.message) for w in caught] == [True, False]
    assert "model.safetensors is unreadable" in str(caught[1].message)

    moved = set_aside_torn(tmp_path, tmp_path / "checkpoint-2")
    assert sorted(p.name.rsplit("-", 1)[0] for p in moved) == ["torn-checkpoint-4", "torn-checkpoint-6"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")] == ["checkpoint-2"]

    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert newest_valid_checkpoint(tmp_path) is None


# --------------------------------------------------------------------------- checkpoints belong to a config

SHORT = ["stages.cpt.training.max_steps=6", "stages.cpt.training.save_steps=3", "stages.cpt.training.logging_steps=1"]


def changed_spec(run_dir, learning_rate: str):
    """The run's spec with another cpt learning rate (a new config hash for cpt)."""
    overrides = ["tracking.wandb_project=null", *SHORT, f"stages.cpt.training.learning_rate={learning_rate}"]
    return load_pipeline("korean-llm", profile="local", overrides=overrides).spec


@pytest.mark.slow
def test_checkpoints_of_another_config_are_refused_and_forced_aside(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", overrides=SHORT, n_text=80, n_chat=10)
    stage_dir = run_dir.stage_dir("cpt")
    checkpoints = stage_dir / "checkpoints"

    # Interrupted with checkpoint-4 of the first config.
    child = start_stage(run_dir, "cpt", HOLD_AFTER_CHECKPOINT="3")
    wait_for_file(checkpoints / "checkpoint-3" / MARKER, child)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=300) == EXIT_RETRYABLE
    interrupted = run_dir.read_result("cpt")
    assert interrupted.status == "interrupted"
    assert (checkpoints / CHECKPOINTS_CONFIG).read_text().strip() == interrupted.config_hash

    # The config changes: resuming from checkpoint-4 would continue what the old learning rate trained.
    spec = changed_spec(run_dir, "1e-3")
    assert conflicting_stages(run_dir, spec) == ["cpt"]  # the local runner refuses before writing spec.json
    run_dir.write_spec(spec)
    refused = run_stage(run_dir, "cpt")
    assert refused.returncode == EXIT_USAGE, refused.stderr[-3000:]
    assert "holds checkpoints of another config" in refused.stderr and "--force" in refused.stderr
    assert run_dir.read_result("cpt") == interrupted and newest_valid_checkpoint(checkpoints).name == "checkpoint-4"

    # Forced: the old checkpoints and record are moved aside, and training starts from scratch.
    forced = run_stage(run_dir, "cpt", "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    (aside,) = stage_dir.glob(f"superseded-{interrupted.config_hash[:8]}-*")
    assert f"moved aside to cpt/{aside.name}" in forced.stdout
    assert (aside / "checkpoints" / "checkpoint-4" / MARKER).is_file()
    assert json.loads((aside / "stage.json").read_text())["status"] == "interrupted"
    result = run_dir.read_result("cpt")
    assert result.status == "succeeded" and result.config_hash == config_hash(spec, "cpt") != interrupted.config_hash
    assert result.attempts == 1 and result.extra["resumed_from_step"] == 0 and "resumed_from" not in result.extra
    assert result.metrics["steps"] == 6 and logged_steps(run_dir) == list(range(1, 7))  # all trained anew
    assert result.mlflow_run_id != interrupted.mlflow_run_id
    assert (checkpoints / CHECKPOINTS_CONFIG).read_text().strip() == result.config_hash

    # A completed stage: another config is refused; forced, it trains again instead of resuming from its last
    # checkpoint (which would train no step at all).
    spec = changed_spec(run_dir, "5e-4")
    run_dir.write_spec(spec)
    assert run_stage(run_dir, "cpt").returncode == EXIT_USAGE
    forced = run_stage(run_dir, "cpt", "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert len(list(stage_dir.glob(f"superseded-{result.config_hash[:8]}-*"))) == 1
    again = run_dir.read_result("cpt")
    assert again.config_hash == config_hash(spec, "cpt") and again.extra["resumed_from_step"] == 0
    assert again.metrics["steps"] == 6 and logged_steps(run_dir) == list(range(1, 7))


def test_a_rank_beginning_while_rank_0_records_the_config_never_reads_another(tmp_path: Path) -> None:
    """Under torchrun every rank checks the checkpoints' config record as it begins while rank 0 rewrites it (the
    same hash, on a resumed attempt): the record is replaced whole, so a reader never finds it empty or torn, which
    would read as another config and refuse the resume (seen once on four processes)."""
    stage_dir = tmp_path / "cpt"
    (stage_dir / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    wanted = "c" * 64
    record_outputs_config(stage_dir, wanted)
    seen: set[str | None] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(outputs_config(stage_dir, None))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3000):
            record_outputs_config(stage_dir, wanted)
    finally:
        done.set()
        reader.join()
    assert seen == {wanted}
    assert not stale_outputs(stage_dir, None, wanted)
    # no temporary file left behind
    assert sorted(path.name for path in (stage_dir / "checkpoints").iterdir()) == ["checkpoint-3", CHECKPOINTS_CONFIG]
