"""Cron semantics: with skip_if_unchanged, a run whose data did not change since the last successful run ends
after prepare, as skipped, with the reason in the summary and the notification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workflows.loading import load_pipeline
from workflows.local import run_local
from workflows.notify import read_outcome, slack_message

CPT_ONLY = [
    "stages.sft.enabled=false",
    "stages.rlhf.enabled=false",
    "stages.evaluate.enabled=false",
    "stages.deploy.enabled=false",
    "stages.cpt.training.max_steps=2",
    "stages.cpt.training.save_steps=2",
]


def _run(run_dir: Path, *extra: str) -> int:
    loaded = load_pipeline("korean-llm", profile="local", overrides=[*CPT_ONLY, *extra])
    return run_local(loaded, run_dir)


def _record(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / stage / "stage.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_unchanged_data_ends_the_run_after_prepare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    assert _run(runs / "first", "stages.prepare.skip_if_unchanged=true") == 0
    assert _record(runs / "first", "cpt")["status"] == "succeeded"
    assert _record(runs / "first", "prepare")["extra"]["proceed"] == "true"  # nothing to compare with yet

    capsys.readouterr()
    assert _run(runs / "second", "stages.prepare.skip_if_unchanged=true") == 0
    prepare = _record(runs / "second", "prepare")
    assert prepare["extra"]["unchanged"] == "true" and prepare["extra"]["proceed"] == "false"
    assert "data unchanged since run first" in prepare["extra"]["skip-reason"]
    assert not (runs / "second" / "cpt").exists()  # the training stage never started
    assert not (runs / "second" / "prepare" / "tokenizer").exists()  # nor the tokenizer work it needs
    out = capsys.readouterr().out
    assert "ending the run: data unchanged since run first" in out and "skipped" in out

    # Without the setting the same data trains again.
    assert _run(runs / "third") == 0
    assert _record(runs / "third", "cpt")["status"] == "succeeded"


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
