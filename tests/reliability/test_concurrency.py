"""Two runs of the same pipeline in one run root never clobber each other: default run directory names are
unique even for runners started in the same second, one run directory is held by one runner at a time, and
what the runs build (tokenizer, token caches, MLflow store) stays inside each run."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from training_fixtures import runner_env

import workflows.local as local
from spec.loading import load_pipeline

REPO = Path(__file__).resolve().parents[2]
PREPARE_ONLY = [f"--set=stages.{s}.enabled=false" for s in ("cpt", "sft", "rlhf", "evaluate", "deploy")]
PREPARE_ONLY += ["--set=tracking.wandb_project=null"]


class _FrozenClock(datetime):
    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        return datetime(2026, 11, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_default_run_dirs_of_the_same_second_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "datetime", _FrozenClock)
    spec = load_pipeline("korean-llm", "local").spec
    first, second, third = (local.default_run_dir(spec, tmp_path) for _ in range(3))
    assert first.name == "korean-llm-20261102-030405"
    assert [second.name, third.name] == [f"{first.name}-2", f"{first.name}-3"]
    assert all(p.is_dir() for p in (first, second, third))


def test_a_run_directory_is_held_by_one_runner(tmp_path: Path) -> None:
    held = local.lock_run_dir(tmp_path / "run")
    try:
        with pytest.raises(local.RunDirBusy, match=r"in use by another runner \(pid \d+"):
            local.lock_run_dir(tmp_path / "run")
    finally:
        held.close()
    local.lock_run_dir(tmp_path / "run").close()  # free again once its runner is done


def _runner(cwd: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "workflows.submit", "korean-llm", "--local", *PREPARE_ONLY, *args]
    return subprocess.Popen(
        command, cwd=cwd, env=runner_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_concurrent_runners_in_one_run_root(tmp_path: Path) -> None:
    shared = tmp_path / "runs" / "shared"
    runners = [_runner(tmp_path), _runner(tmp_path), _runner(tmp_path, f"--run-dir={shared}")]
    runners.append(_runner(tmp_path, f"--run-dir={shared}"))
    outputs = [p.communicate(timeout=600)[0] for p in runners]
    codes = [p.returncode for p in runners]

    # Two runners with default names: two run directories, each complete and its own.
    assert codes[:2] == [0, 0], outputs[:2]
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if p.name.startswith("korean-llm-"))
    assert len(runs) == 2, runs
    for run in runs:
        prepare = json.loads((run / "prepare" / "stage.json").read_text(encoding="utf-8"))
        assert prepare["status"] == "succeeded"
        assert json.loads((run / "spec.json").read_text(encoding="utf-8"))["name"] == "korean-llm"
        assert (run / "prepare" / "tokenizer" / "tokenizer.json").is_file()
        assert str(run) in (run / "prepare" / "logs" / "stage.log").read_text(encoding="utf-8")
    assert (tmp_path / "runs" / "mlflow.db").is_file()  # the runs' shared local store
    fingerprints = {json.loads((r / "prepare" / "stage.json").read_text())["extra"]["fingerprint"] for r in runs}
    assert len(fingerprints) == 1  # the same data, prepared twice side by side

    # Two runners on the same run directory: one runs it, the other is turned away and touches nothing.
    assert sorted(codes[2:]) == [0, 2], outputs[2:]
    refused = outputs[2:][codes[2:].index(2)]
    assert "in use by another runner" in refused
    assert json.loads((shared / "prepare" / "stage.json").read_text(encoding="utf-8"))["attempts"] == 1
