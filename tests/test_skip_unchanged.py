"""Cron semantics: with skip_if_unchanged, a run whose data did not change since the last completed run ends after
prepare, as skipped, with the reason in the summary and the notification. A run whose gate failed completed as
designed (deploy skipped, as the cluster DAG does): the champion stays, and it counts as the last run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run.run_dir import RunDir
from spec.loading import load_pipeline
from workflows.local import run_local
from workflows.notify import read_outcome, slack_message

CHAIN = [  # cpt → evaluate → deploy, briefly
    "tracking.wandb_project=null",
    "stages.sft.enabled=false",
    "stages.rlhf.enabled=false",
    "stages.cpt.training.max_steps=2",
    "stages.cpt.training.save_steps=2",
    "stages.evaluate.max_new_tokens=4",
]
GATE_PASSES = "stages.evaluate.gate=[{metric: perplexity, higher_is_better: false, max_regression: 1.0e9}]"
GATE_FAILS = "stages.evaluate.gate=[{metric: not_measured}]"  # a gated metric nobody measures fails its rule


def _run(run_dir: Path, *extra: str) -> int:
    loaded = load_pipeline("korean-llm", profile="local", overrides=[*CHAIN, *extra])
    return run_local(loaded, run_dir)


def _record(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / stage / "stage.json").read_text(encoding="utf-8"))


def _parent_run(client, run_dir: Path):
    """The run's MLflow parent run (the pipeline run)."""
    tracking = json.loads((run_dir / "tracking.json").read_text(encoding="utf-8"))
    return client.get_run(tracking["mlflow"]["parent_run_id"])


@pytest.mark.slow
def test_a_failed_gate_skips_deploy_and_unchanged_data_then_ends_the_next_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'registry.db'}"  # one registry for the three runs, as in the cluster
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri, registry_uri=uri)
    runs = tmp_path / "runs"

    # A champion, from a run of another folder (so that it is not a sibling of the runs below).
    champion_run = tmp_path / "earlier" / "champion"
    assert _run(champion_run, GATE_PASSES) == 0
    assert _record(champion_run, "deploy")["extra"]["aliases"] == ["challenger", "champion"]
    assert _parent_run(client, champion_run).data.tags["posttrain.end_reason"] == "completed"

    # The gate fails: deploy is skipped, as in the cluster (its `when` is gate == pass); nothing is registered.
    capsys.readouterr()
    assert _run(runs / "second", GATE_FAILS) == 0
    out = capsys.readouterr().out
    evaluate = _record(runs / "second", "evaluate")
    assert evaluate["status"] == "succeeded" and evaluate["extra"]["gate"] == "fail"
    assert "skipping deploy: gate fail: not_measured: not measured for the candidate" in out
    assert "deploy: running" not in out and not (runs / "second" / "deploy").exists()
    deploy_row = next(line for line in out.splitlines() if line.startswith("  deploy "))
    assert "skipped" in deploy_row and "gate fail" in deploy_row
    assert str(client.get_model_version_by_alias("korean-llm", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("korean-llm", "challenger").version) == "1"
    assert len(client.search_model_versions("name='korean-llm'")) == 1
    parent = _parent_run(client, runs / "second")  # closed by evaluate, not left RUNNING
    assert parent.info.status == "FINISHED" and parent.data.tags["posttrain.end_reason"] == "gate-fail"
    assert "not_measured" in parent.data.tags["posttrain.end_message"]

    # The next scheduled run, same data and configuration: the gate-failed run completed, so nothing to train.
    capsys.readouterr()
    assert _run(runs / "third", GATE_FAILS, "stages.prepare.skip_if_unchanged=true") == 0
    prepare = _record(runs / "third", "prepare")
    assert prepare["extra"]["unchanged"] == "true" and prepare["extra"]["proceed"] == "false"
    assert "data and configuration unchanged since run second" in prepare["extra"]["skip-reason"]
    assert not (runs / "third" / "cpt").exists()  # the training stage never started
    assert not (runs / "third" / "prepare" / "tokenizer").exists()  # nor the tokenizer work it needs
    out = capsys.readouterr().out
    assert "ending the run: data and configuration unchanged since run second" in out and "skipped" in out
    parent = _parent_run(client, runs / "third")  # closed by prepare
    assert parent.info.status == "FINISHED" and parent.data.tags["posttrain.end_reason"] == "skipped"
    assert "data and configuration unchanged since run second" in parent.data.tags["posttrain.end_message"]

    # The same data with another learning rate is another run: prepare goes on, and says what changed.
    fourth = RunDir(runs / "fourth")
    fourth.root.mkdir()
    changed = [*CHAIN, GATE_FAILS, "stages.prepare.skip_if_unchanged=true", "stages.cpt.training.learning_rate=1e-3"]
    fourth.write_spec(load_pipeline("korean-llm", profile="local", overrides=changed).spec)
    done = subprocess.run(
        [sys.executable, "-m", "stages", "prepare", "--run-dir", str(fourth.root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[prepare] changed since run second: stages.cpt (training.learning_rate)" in done.stdout
    assert _record(fourth.root, "prepare")["extra"]["proceed"] == "true"


def test_the_notification_says_why_the_run_was_skipped(tmp_path: Path) -> None:
    params = tmp_path / "params"
    params.mkdir()
    for name, value in {"workflow-name": "korean-llm-abcde", "status": "Succeeded", "notify-on": "Succeeded"}.items():
        (params / name).write_text(value, encoding="utf-8")
    run_dir = tmp_path / "run"
    (run_dir / "prepare").mkdir(parents=True)
    record = {"extra": {"proceed": "false", "skip-reason": "data unchanged since run korean-llm-zzzzz"}}
    (run_dir / "prepare" / "stage.json").write_text(json.dumps(record), encoding="utf-8")

    message = slack_message(read_outcome(params, run_dir))
    assert message["text"].startswith(":fast_forward: korean-llm: Succeeded, skipped")
    assert any("data unchanged since run korean-llm-zzzzz" in json.dumps(b) for b in message["blocks"])

    record["extra"]["proceed"] = "true"
    (run_dir / "prepare" / "stage.json").write_text(json.dumps(record), encoding="utf-8")
    assert "skipped" not in slack_message(read_outcome(params, run_dir))["text"]
