"""SIGKILL of each training stage, then a rerun of the stage.

One run directory carries the chain cpt → sft → rlhf (each stage starts from the one before). Each stage is killed
three times before it is let finish, once at each point that matters, in this order:

    before the first checkpoint               → the next attempt starts from step 0
    between checkpoints (checkpoint-3 done)   → the next attempt resumes from checkpoint-3
    while writing a checkpoint                → the next attempt sets it aside and resumes from the one before

The finished stage has one MLflow run (the one the first attempt opened), one logged loss per step, complete
checkpoints only, whole safetensors and no temporary files.
"""

from __future__ import annotations

from pathlib import Path

import faults
import pytest
from training_fixtures import make_run_dir, write_jsonl

from stages.contract import RunDir
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


def kill_at(run_dir: RunDir, stage: str, what: str, step: int) -> None:
    """Start the stage, wait until it pauses at `what` of `step`, SIGKILL it."""
    env = {"before-save": "HOLD_BEFORE_SAVE", "in-save": "HOLD_IN_SAVE"}[what]
    child = faults.start(run_dir, stage, **{env: str(step)})
    faults.wait_held(run_dir, what, step, child)
    faults.sigkill(child)
    result = run_dir.read_result(stage)
    assert result is not None and result.status == "running"  # the record of a killed attempt: still running


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
    resume_from = complete[-1]

    done = faults.run(run_dir, stage)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    torn = KILLS[stage][-1][1]
    assert f"checkpoint-{torn} is torn" in done.stderr
    result = run_dir.read_result(stage)
    assert result.status == "succeeded" and result.attempts == len(KILLS[stage]) + 1
    assert result.extra["resumed_from"] == f"checkpoint-{resume_from}" and result.metrics["steps"] == STEPS
    assert [p.name.rsplit("-", 1)[0] for p in checkpoints.glob("torn-*")] == [f"torn-checkpoint-{torn}"]
    assert faults.complete_checkpoints(run_dir, stage)[-1] == STEPS
    faults.assert_clean_outputs(run_dir, stage)

    history = read_log_history(run_dir.stage_dir(stage) / "logs/log_history.json")
    assert [e["step"] for e in history if "loss" in e] == list(range(1, STEPS + 1))
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
