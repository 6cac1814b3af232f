"""The embedded runner (workflows/local.py): stages as subprocesses in DAG order, logs, summary, failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workflows.local as local
from run.run_dir import RunDir
from spec.loading import load_pipeline
from workflows import stage_process

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU: plain `python -m stages`, never torchrun


def test_the_runner_does_not_import_torch():
    code = "import sys, workflows.local; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_gpu_count_and_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    for visible, count in (("", 0), ("-1", 0), ("0", 1), ("0,1,2,3", 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert local.gpu_count() == count


def test_stage_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_root = tmp_path / "run"
    env = local.stage_env(run_root)
    # one store beside the run directories, shared by the local runs there
    assert env["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert env["WANDB_MODE"] == "disabled" and env["PYTHONUNBUFFERED"] == "1"  # W&B's own switch is honoured
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    env = local.stage_env(run_root)
    assert "WANDB_MODE" not in env and env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"


def test_a_missing_stage_module_is_reported_not_skipped(monkeypatch, tmp_path: Path, capsys):
    monkeypatch.setattr(local, "stage_module_exists", lambda stage: False)
    loaded = load_pipeline("korean-llm", "local")
    assert local.run_local(loaded, tmp_path / "run") == 1
    out = capsys.readouterr().out
    assert "missing" in out and "stages/prepare.py does not exist yet" in out and "not run" in out
    assert (tmp_path / "run" / "spec.json").is_file() and not (tmp_path / "run" / "prepare").exists()


def test_a_failing_stage_stops_the_run_with_the_log_tail_and_the_rerun_command(tmp_path: Path, capsys):
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "문서"}\n{"text": null}\n', encoding="utf-8")
    loaded = load_pipeline("korean-llm", "local", [f"stages.cpt.data.uri={bad}", "tracking.wandb_project=null"])
    run_root = tmp_path / "run"
    assert local.run_local(loaded, run_root) == 1
    out = capsys.readouterr().out
    assert f"{bad}:2: field 'text': expected a string, got null" in out  # the log tail
    assert f"python -m workflows.submit korean-llm --local --run-dir {run_root}" in out
    assert "not run" in out
    log = (run_root / "prepare" / "logs" / "stage.log").read_text(encoding="utf-8")
    assert "corpus.jsonl:2" in log and RunDir(run_root).read_result("prepare").status == "failed"
    assert not (run_root / "cpt").exists()


def test_prepare_runs_through_the_runner_and_a_rerun_is_a_no_op(monkeypatch, tmp_path: Path, capsys):
    # Only prepare: the training stages are reported missing so this test does not train.
    monkeypatch.setattr(local, "stage_module_exists", lambda stage: stage == "prepare")
    loaded = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"])
    run_root = tmp_path / "run"
    assert local.run_local(loaded, run_root) == 1
    out = capsys.readouterr().out
    metrics = RunDir(run_root).read_result("prepare").metrics
    # the builtin corpus quotes the articles the builtin lm-eval task asks about: decontamination drops those rows
    assert metrics["cpt_dropped_contaminated"] > 0
    assert "prepare: succeeded" in out and f"cpt {int(metrics['cpt_rows'])}" in out
    assert "stages/cpt.py does not exist yet" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}" in out
    assert "[prepare] tokenizer:" in (run_root / "prepare" / "logs" / "stage.log").read_text(encoding="utf-8")
    assert RunDir(run_root).read_result("prepare").status == "succeeded"

    assert local.run_local(loaded, run_root) == 1
    assert "prepare: done before" in capsys.readouterr().out


def test_deploy_is_skipped_unless_the_gate_passed():
    passed = {"status": "succeeded", "extra": {"gate": "pass", "gate_reasons": ["perplexity: ... holds"]}}
    assert local.deploy_skip_reason(passed) == ""
    check = {"metric": "perplexity", "passed": False, "reason": "perplexity: candidate 9 vs base model 8: fails"}
    failed = {"status": "succeeded", "extra": {"gate": "fail", "gate_checks": [check], "gate_reasons": ["x"]}}
    assert local.deploy_skip_reason(failed) == "gate fail: perplexity: candidate 9 vs base model 8: fails"
    skipped = {"status": "skipped", "message": "nothing new", "extra": {"gate": "skipped", "gate_reasons": ["same"]}}
    assert local.deploy_skip_reason(skipped) == "gate skipped: same"


def test_the_summary_shows_the_gate_and_the_registered_version() -> None:
    from workflows.local import key_metric

    evaluate = {"metrics": {"eval_loss": 6.6, "perplexity": 744.69}, "extra": {"gate": "pass"}}
    deploy = {
        "metrics": {},
        "extra": {"registered_model": "korean-llm", "model_version": "3", "aliases": ["challenger"]},
    }
    assert key_metric("evaluate", evaluate) == "gate pass, perplexity 744.7"
    assert key_metric("deploy", deploy) == "korean-llm v3 (challenger)"
    assert key_metric("sft", {"metrics": {"train_loss": 2.0, "eval_loss": 1.5}}) == "eval_loss 1.5"


# --------------------------------------------------------------------------- signals: the runner never orphans a stage

_STAGE = """
import signal, sys, time
from pathlib import Path
from run.run_dir import write_text_atomic

def stop(signum, frame):  # the name appears whole: a reader never sees the file created and not yet written
    write_text_atomic(Path(sys.argv[1]), signal.Signals(signum).name)
    sys.exit(75)

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
Path(sys.argv[1] + ".ready").touch()
time.sleep(120)
"""

_RUNNER = """
import subprocess, sys, time
from run.exits import die_with_runner

stage = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], preexec_fn=die_with_runner())
time.sleep(120)
"""


def _wait_for(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
    return path.read_text()


def test_a_stage_gets_sigterm_when_its_runner_is_killed(tmp_path: Path) -> None:
    got = tmp_path / "got"
    runner = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, _STAGE, str(got)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    _wait_for(Path(f"{got}.ready"))
    runner.kill()  # SIGKILL: the runner cannot pass anything on
    runner.wait(timeout=30)
    assert _wait_for(got) == "SIGTERM"  # from the kernel, on the runner's death


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_runner_is_passed_on_and_the_stage_awaited(tmp_path: Path, signum: int) -> None:
    got = tmp_path / "got"
    stage = subprocess.Popen([sys.executable, "-c", _STAGE, str(got)], start_new_session=True)
    _wait_for(Path(f"{got}.ready"))
    assert stage_process.stop_stage(stage, signum) == 75  # returns once the stage has exited
    assert got.read_text() == signal.Signals(signum).name


def test_the_runner_says_what_a_profile_swapped_before_it_starts() -> None:
    from workflows.local import effective_plan

    profiled = effective_plan(load_pipeline("llama3-dolly", profile="local"))
    assert profiled[0].startswith("profile local: sets model, stages.sft.data, stages.sft.training")
    assert profiled[1].startswith("model: tiny-llama3 (built from config: llama") and "[profile local]" in profiled[1]
    sft = next(line for line in profiled if line.startswith("sft:"))
    assert "builtin:korean-dolly (alpaca; input←context, output←response) [profile local]" in sft
    assert "30 steps [profile local] (the pipeline file says 3 epochs)" in sft
    # The user's own settings are shown as they are, never marked as a profile's.
    own = effective_plan(load_pipeline("llama3-dolly"))
    assert own[1] == "sft: data hf://databricks/databricks-dolly-15k (alpaca; input←context, output←response), 3 epochs"
    assert not any("[profile" in line for line in own)
