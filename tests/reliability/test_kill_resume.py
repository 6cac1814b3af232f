"""SIGKILL of each training stage, then a rerun of the stage.

One run directory carries the chain cpt (full) → sft (LoRA) → rlhf (DPO, LoRA), each stage starting from the one
before. Each stage is killed four times before it is let finish, once at each point that matters, in this order:

    before the first checkpoint               → the next attempt starts from step 0
    between checkpoints (checkpoint-3 done)   → the next attempt resumes from checkpoint-3
    while writing a checkpoint                → the next attempt sets it aside and resumes from the one before
    after the last checkpoint, before the     → the next attempt trains no step: it evaluates, saves and records
    record (final evaluation, save, merge)      the last checkpoint's weights

The finished stage has one MLflow run (the one the first attempt opened), one logged loss per step and none past
the plan, the last checkpoint's weights as its model, complete checkpoints only, whole safetensors and no
temporary files.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import faults
import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import make_run_dir, write_jsonl

from run.run_dir import RunDir
from stages.training import read_log_history

pytestmark = pytest.mark.slow

STEPS, SAVE = 9, 3
OVERRIDES = [
    f"stages.{stage}.training.{key}={value}"
    for stage in ("cpt", "sft", "rlhf")
    for key, value in (("max_steps", STEPS), ("save_steps", SAVE), ("logging_steps", 1), ("eval_steps", "null"))
]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A run directory as prepare leaves it, with data for cpt, sft and rlhf."""
    root = tmp_path_factory.mktemp("kill") / "run"
    run_dir = make_run_dir(root, overrides=OVERRIDES, n_text=60, n_chat=60)
    from test_rlhf import preference_rows

    rows = preference_rows(40)
    write_jsonl(root / "prepare/data/rlhf/train.jsonl", rows[4:])
    write_jsonl(root / "prepare/data/rlhf/eval.jsonl", rows[:4])
    return run_dir


def ensure_done(run_dir: RunDir, stage: str) -> None:
    """Run `stage` plainly when an earlier test of the chain did not leave it succeeded."""
    result = run_dir.read_result(stage)
    if result is None or result.status != "succeeded":
        done = faults.run(run_dir, stage)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def kill_at(run_dir: RunDir, stage: str, what: str, step: int) -> subprocess.Popen[str]:
    """Start the stage, wait until it pauses at `what` of `step`, SIGKILL it; returns the killed child."""
    env = {"before-save": "HOLD_BEFORE_SAVE", "in-save": "HOLD_IN_SAVE", "after-save": "HOLD_AFTER_SAVE"}[what]
    child = faults.start(run_dir, stage, **{env: str(step)})
    faults.wait_held(run_dir, what, step, child)
    faults.sigkill(child)
    result = run_dir.read_result(stage)
    assert result is not None and result.status == "running"  # the record of a killed attempt: still running
    return child


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """The trained weights a model folder or checkpoint holds: the full model, or the (trained) LoRA adapter."""
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (folder / name).is_file():
            return load_file(folder / name)
    raise AssertionError(f"{folder} holds no weights")


KILLS = {
    "cpt": [("before-save", 2), ("before-save", 5), ("in-save", 9)],
    "sft": [("before-save", 2), ("before-save", 5), ("in-save", 9)],
    "rlhf": [("before-save", 2), ("before-save", 5), ("in-save", 6)],
}
"""Where each stage is killed: (point, step), in order: before checkpoint-3, between checkpoint-3 and -6, while
writing a checkpoint (the last one of the run, or for rlhf the next one, which keeps the chain short)."""


def point(what: str, step: int) -> str:
    """Which of the three points a kill of KILLS is."""
    if what == "in-save":
        return "while writing a checkpoint"
    return "before the first checkpoint" if step < SAVE else "between checkpoints"


def test_every_stage_is_killed_at_every_point() -> None:
    for stage, kills in KILLS.items():
        assert [point(*kill) for kill in kills] == [
            "before the first checkpoint",
            "between checkpoints",
            "while writing a checkpoint",
        ], stage


def check_kills_then_resume(run_dir: RunDir, stage: str) -> None:
    checkpoints = run_dir.stage_dir(stage) / "checkpoints"
    first_run_id = None
    for what, step in KILLS[stage]:
        kill_at(run_dir, stage, what, step)
        complete = [s for s in range(SAVE, STEPS + 1, SAVE) if s < step]
        assert faults.complete_checkpoints(run_dir, stage) == complete, (what, step)
        if what == "in-save":
            assert (checkpoints / f"checkpoint-{step}").is_dir()  # torn: weights only, no marker
        first_run_id = first_run_id or run_dir.read_result(stage).mlflow_run_id
    assert first_run_id  # recorded before training, so every later attempt continues the same run
    torn = KILLS[stage][-1][1]

    # The next attempt sets the torn checkpoint aside, resumes from the one before, trains to the end and is killed
    # once its last checkpoint is complete, before its record (during the final evaluation, save or merge).
    last_attempt = kill_at(run_dir, stage, "after-save", STEPS)
    assert f"checkpoint-{torn} is torn" in faults.output_of(last_attempt)
    assert faults.complete_checkpoints(run_dir, stage)[-1] == STEPS
    final = checkpoints / f"checkpoint-{STEPS}"

    # The rerun trains no step: it evaluates, saves and records what the last checkpoint holds.
    done = faults.run(run_dir, stage)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"checkpoint-{STEPS} is at the planned end (step {STEPS} of {STEPS})" in done.stdout
    result = run_dir.read_result(stage)
    assert result.status == "succeeded" and result.attempts == len(KILLS[stage]) + 2
    assert result.extra["resumed_from"] == f"checkpoint-{STEPS}" and result.extra["resumed_from_step"] == STEPS
    assert result.extra["trained_steps"] == 0 and result.metrics["steps"] == STEPS
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(f"checkpoint-{STEPS + 1}")]
    assert [p.name.rsplit("-", 1)[0] for p in checkpoints.glob("torn-*")] == [f"torn-checkpoint-{torn}"]
    assert faults.complete_checkpoints(run_dir, stage)[-1] == STEPS
    faults.assert_clean_outputs(run_dir, stage)
    model, checkpoint = weights(run_dir.stage_dir(stage) / "model"), weights(final)
    assert model.keys() == checkpoint.keys() and all(torch.equal(model[k], checkpoint[k]) for k in model)

    # The same record as a stage that was never killed: every step's loss once, none past the plan, eval after it.
    history = read_log_history(run_dir.stage_dir(stage) / "logs/log_history.json")
    losses = [e for e in history if "loss" in e]
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1))
    assert max(e["step"] for e in history) == STEPS
    assert (result.metrics["train_loss_first"], result.metrics["train_loss_last"]) == (
        losses[0]["loss"],
        losses[-1]["loss"],
    )
    assert "eval_loss" in result.metrics
    assert faults.mlflow_runs(run_dir, stage) == [first_run_id] == [result.mlflow_run_id]
    assert faults.metric_steps(run_dir, result.mlflow_run_id) == list(range(1, STEPS + 1))  # none twice


def test_cpt_survives_sigkill(chain: RunDir) -> None:
    check_kills_then_resume(chain, "cpt")


def test_sft_survives_sigkill(chain: RunDir) -> None:
    ensure_done(chain, "cpt")
    check_kills_then_resume(chain, "sft")


def test_rlhf_survives_sigkill(chain: RunDir) -> None:
    ensure_done(chain, "cpt")
    ensure_done(chain, "sft")
    check_kills_then_resume(chain, "rlhf")


def test_the_fault_hooks_can_fail(tmp_path: Path) -> None:
    """The checks above would notice a torn checkpoint left among the complete ones."""
    run_dir = RunDir(tmp_path / "run")
    (run_dir.stage_dir("cpt") / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    (run_dir.stage_dir("cpt") / "model").mkdir()
    with pytest.raises(AssertionError, match="checkpoint-3 is torn"):
        faults.assert_clean_outputs(run_dir, "cpt")
