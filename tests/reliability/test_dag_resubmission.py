"""Whole-DAG resubmission: after a stage dies mid-DAG, running the same local DAG again skips the completed stages
(same config hash) and continues the failed one from its checkpoint; a resubmission with another config is
refused before anything in the run directory changes."""

from __future__ import annotations

import json

import pytest
from resubmitted_dag import DAG_OVERRIDES, Resubmitted
from resubmitted_dag import resubmitted_dag as run_resubmitted_dag

from run.config_hash import config_hash
from run.exits import EXIT_USAGE
from run.run_dir import RunDir
from spec.loading import load_pipeline
from workflows.local import run_local

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resubmitted_dag(tmp_path_factory: pytest.TempPathFactory) -> Resubmitted:
    return run_resubmitted_dag(tmp_path_factory)


def test_the_first_run_stops_at_the_failed_stage(resubmitted_dag: Resubmitted) -> None:
    run = resubmitted_dag
    assert run.first_code == 137, run.first_out
    assert "prepare: succeeded" in run.first_out and "cpt: succeeded" in run.first_out
    assert "sft: failed" in run.first_out
    assert f"--local --run-dir {run.root}" in run.first_out  # how to resume
    sft = json.loads(run.before["sft"])
    assert sft["status"] == "running" and sft["attempts"] == 1  # killed: its record was never closed


def test_the_resubmission_skips_completed_stages_and_resumes_the_failed_one(resubmitted_dag: Resubmitted) -> None:
    run = resubmitted_dag
    assert run.second_code == 0, run.second_out
    assert "prepare: done before" in run.second_out and "cpt: done before" in run.second_out
    assert "sft: succeeded" in run.second_out
    run_dir = RunDir(run.root)
    for stage in ("prepare", "cpt"):  # untouched: the same record, byte for byte
        assert (run.root / stage / "stage.json").read_text(encoding="utf-8") == run.before[stage]
        assert run_dir.read_result(stage).config_hash == config_hash(run.loaded.spec, stage)
    log = (run.root / "cpt" / "logs" / "stage.log").read_text(encoding="utf-8")
    assert "already completed with the same config" in log
    sft = run_dir.read_result("sft")
    assert sft.status == "succeeded" and sft.attempts == 2
    assert sft.extra["resumed_from"] == "checkpoint-3" and sft.metrics["steps"] == 6
    assert sft.mlflow_run_id == json.loads(run.before["sft"])["mlflow_run_id"]


def test_a_resubmission_with_another_config_changes_nothing(resubmitted_dag: Resubmitted, capsys) -> None:
    run = resubmitted_dag
    files = {p: p.read_bytes() for p in run.root.rglob("*") if p.is_file() and p.name.endswith(".json")}
    changed = load_pipeline("korean-llm", "local", [*DAG_OVERRIDES, "stages.cpt.training.learning_rate=1e-3"])
    assert run_local(changed, run.root) == EXIT_USAGE
    out = capsys.readouterr().out
    assert "cpt, sft completed with another config" in out and "spec.json is left as it is" in out
    assert {p: p.read_bytes() for p in files} == files  # spec.json and every record as they were
