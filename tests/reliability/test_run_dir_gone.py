"""A run directory deleted or replaced under a running stage stops the stage, and the runner: the stage notices at
the end of the next training step (or before its next record, checkpoint marker or model), prints one `error:`
line, exits 1 and writes nothing into a folder made again under the old name; the local runner reports the run
failed, never done, and starts no further stage."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import faults
import pytest
from training_fixtures import make_run_dir

from run.exits import EXIT_FAILED
from run.run_dir import LOCK_FILE, RunDir, RunDirGone, check_still_ours, write_json_atomic
from spec.loading import load_pipeline
from stages.contract import StageContext
from workflows import local, stage_process

STEPS = 6
OVERRIDES = [
    "stages.sft.enabled=false",
    "stages.rlhf.enabled=false",
    f"stages.cpt.training.max_steps={STEPS}",
    "stages.cpt.training.save_steps=3",
    "stages.cpt.training.logging_steps=1",
]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --------------------------------------------------------------------------- the check itself, in one process


def test_a_record_is_never_written_into_a_run_directory_made_again(tmp_path: Path) -> None:
    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, "evaluate", spec)
    assert ctx.begin()
    check_still_ours(run_dir.root)  # as it was locked: nothing to say

    # Renamed away and made again under the same name: neither the record nor any JSON beside it is written there.
    run_dir.root.rename(tmp_path / "moved")
    run_dir.root.mkdir()
    with pytest.raises(RunDirGone, match=rf"\[evaluate\] the run directory {run_dir.root} was deleted or replaced"):
        ctx.finish()
    with pytest.raises(RunDirGone):
        write_json_atomic(run_dir.stage_dir("evaluate") / "logs" / "x.json", {})
    with pytest.raises(RunDirGone):
        ctx.crash(FileNotFoundError("a file of the stage went with its folder"))  # no traceback file either
    assert files_under(run_dir.root) == []
    assert RunDir(tmp_path / "moved").read_result("evaluate").status == "running"  # what it said when it left

    # Only the stage's folder deleted: the same.
    other = RunDir(tmp_path / "other")
    other.write_spec(spec)
    ctx = StageContext(other, "evaluate", spec)
    assert ctx.begin()
    shutil.rmtree(other.stage_dir("evaluate"))
    with pytest.raises(RunDirGone, match=r"the stage folder .*evaluate was deleted or replaced while evaluate"):
        ctx.fail("whatever came next")
    assert not other.stage_dir("evaluate").exists()
    write_json_atomic(tmp_path / "elsewhere.json", {})  # outside the run directories: no business of the check

    # A new stage on the folder made again locks its new lock file (as a new process would).
    assert StageContext(other, "evaluate", spec).begin()
    assert (other.stage_dir("evaluate") / LOCK_FILE).is_file()


# --------------------------------------------------------------------------- a training stage, held mid-training


@pytest.fixture
def held_cpt(tmp_path: Path) -> tuple[RunDir, subprocess.Popen[str]]:
    """cpt training, held once checkpoint-3 of 6 is complete (the fault folder lies beside the run directory)."""
    run_dir = make_run_dir(tmp_path / "run", overrides=OVERRIDES, n_text=60, n_chat=10)
    child = faults.start(run_dir, "cpt", HOLD_AFTER_SAVE="3")
    faults.wait_held(run_dir, "after-save", 3, child)
    assert run_dir.read_result("cpt").status == "running"
    return run_dir, child


def assert_stopped_with_one_error(run_dir: RunDir, child: subprocess.Popen[str]) -> None:
    faults.release(run_dir, "after-save", 3)
    code = child.wait(timeout=120)
    output = faults.output_of(child)
    assert code == EXIT_FAILED, output[-3000:]
    assert "Traceback" not in output
    errors = error_lines(output)
    assert errors == [
        f"error: [cpt] the run directory {run_dir.root} was deleted or replaced while cpt was running; the stage "
        "stopped and wrote nothing more (what it wrote before went with the old folder)"
    ], output[-3000:]


@pytest.mark.slow
def test_a_deleted_run_directory_stops_training_and_is_not_made_again(
    held_cpt: tuple[RunDir, subprocess.Popen[str]],
) -> None:
    run_dir, child = held_cpt
    shutil.rmtree(run_dir.root)
    assert_stopped_with_one_error(run_dir, child)
    assert not run_dir.root.exists()  # no checkpoint, log, record or model made it again


@pytest.mark.slow
def test_a_replaced_run_directory_stops_training_and_the_new_one_stays_empty(
    held_cpt: tuple[RunDir, subprocess.Popen[str]],
) -> None:
    run_dir, child = held_cpt
    old = run_dir.root.with_name("run.old")
    run_dir.root.rename(old)
    run_dir.root.mkdir()
    assert_stopped_with_one_error(run_dir, child)
    assert files_under(run_dir.root) == []
    # The old folder holds what was there when it was moved: no step after 3 was saved, no success recorded.
    moved = RunDir(old)
    assert moved.read_result("cpt").status == "running"
    assert faults.complete_checkpoints(moved, "cpt") == [3] and not (old / "cpt" / "model").exists()


# --------------------------------------------------------------------------- the local runner


_FAKE_STAGE = """
import json, shutil, sys
from pathlib import Path
stage, root = sys.argv[1], Path(sys.argv[2])
if stage == "cpt":  # a stage that does not notice: its run directory deleted and made again, it records success there
    shutil.rmtree(root)
(root / stage).mkdir(parents=True, exist_ok=True)
(root / stage / "stage.json").write_text(json.dumps({"stage": stage, "status": "succeeded"}))
"""


def test_the_runner_reports_failure_when_the_run_directory_is_deleted_under_a_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever the stage says (here: succeeded, in the folder made again), the runner finds its `.runner.lock` gone
    with the run directory: the run failed, the next stage never starts, and no resume command names the folder."""
    run_root = tmp_path / "run"

    def fake(spec: Any, stage: str, root: Path, force: bool, gpus: int, forked: bool) -> tuple[list[str], dict]:
        return [sys.executable, "-c", _FAKE_STAGE, stage, str(root)], {}

    monkeypatch.setattr(stage_process, "stage_launch", fake)
    overrides = [f"stages.{s}.enabled=false" for s in ("sft", "rlhf", "deploy")] + ["tracking.wandb_project=null"]
    assert local.run_local(load_pipeline("korean-llm", "local", overrides), run_root) == EXIT_FAILED
    output = capsys.readouterr().out
    assert "prepare: succeeded" in output and "cpt: failed" in output, output
    assert "evaluate: running" not in output and "--run-dir" not in output
    assert error_lines(output) == [
        f"error: run directory {run_root} was deleted or replaced while cpt was running; the run stopped and wrote "
        "nothing more"
    ], output
    assert files_under(run_root) == ["cpt", "cpt/stage.json"]  # the stage's own doing; nothing of the runner's
