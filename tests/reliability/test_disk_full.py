"""A full disk (ENOSPC) while saving: the checkpoint being written is not taken for a complete one, the previous
checkpoint and stage.json stay usable, the stage says why it failed, and a rerun with space resumes."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import faults
import pytest
from training_fixtures import make_run_dir

from run.run_dir import write_json_atomic
from run.tracking import local_store_uri

OVERRIDES = ["stages.cpt.training.max_steps=6", "stages.cpt.training.save_steps=3"]


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stage.json"
    write_json_atomic(path, {"status": "running"})

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        write_json_atomic(path, {"status": "succeeded", "padding": "x" * 100_000})
    assert err.value.errno == errno.ENOSPC
    assert json.loads(path.read_text()) == {"status": "running"}
    assert [p.name for p in tmp_path.iterdir()] == ["stage.json"]  # no temporary file left


@pytest.mark.slow
def test_enospc_while_checkpointing_or_recording_then_a_rerun_resumes(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", overrides=OVERRIDES, n_text=40, n_chat=10)

    # 1. The disk fills up while checkpoint-6 is written (after its weights, before the optimizer state).
    failed = faults.run(run_dir, "cpt", ENOSPC_IN_SAVE="6")
    assert failed.returncode == 1
    assert "no space left on the disk holding" in failed.stderr
    result = run_dir.read_result("cpt")
    assert result.status == "failed" and "No space left on device" in result.message
    assert "resumes from the newest complete checkpoint" in result.message
    assert faults.complete_checkpoints(run_dir, "cpt") == [3]  # the torn checkpoint-6 is not taken for complete

    # 2. The rerun trains to the end, then cannot record it: stage.json keeps its last good state.
    before = run_dir.result_path("cpt").read_text(encoding="utf-8")
    full = faults.run(run_dir, "cpt", ENOSPC_STAGE_JSON="succeeded,failed")
    assert full.returncode == 1, full.stderr[-3000:]
    last_line = full.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: [cpt] no space left on the disk holding"), full.stderr[-3000:]
    assert "stage.json" in last_line and "Free space" in last_line
    assert json.loads(run_dir.result_path("cpt").read_text(encoding="utf-8"))["status"] == "running"
    assert json.loads(before)["status"] == "failed"
    assert faults.complete_checkpoints(run_dir, "cpt") == [3, 6]

    # 3. With space again: resumes from the newest complete checkpoint and finishes.
    done = faults.run(run_dir, "cpt")
    assert done.returncode == 0, done.stderr[-3000:]
    result = run_dir.read_result("cpt")
    assert result.status == "succeeded" and result.attempts == 3
    assert result.extra["resumed_from"] == "checkpoint-6"
    assert [p.name.rsplit("-", 1)[0] for p in (run_dir.stage_dir("cpt") / "checkpoints").glob("torn-*")] == [
        "torn-checkpoint-6"
    ]
    faults.assert_clean_outputs(run_dir, "cpt")


@pytest.mark.slow
def test_a_stage_that_cannot_record_success_is_not_finished_in_mlflow(tmp_path: Path) -> None:
    import mlflow

    run_dir = make_run_dir(tmp_path / "run", overrides=["stages.cpt.training.max_steps=2"], n_text=20, n_chat=10)
    assert faults.run(run_dir, "cpt", ENOSPC_STAGE_JSON="succeeded,failed").returncode == 1
    run_id = run_dir.read_result("cpt").mlflow_run_id
    client = mlflow.tracking.MlflowClient(local_store_uri(run_dir.root))
    assert client.get_run(run_id).info.status != "FINISHED"
