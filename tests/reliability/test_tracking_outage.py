"""Tracking outages never fail a stage: a real `mlflow server` on 127.0.0.1 stopped in the middle of a training
stage and started again, and W&B online with no network (a fake key and a closed local port). Training finishes,
with one warning per backend, every metric reaches MLflow once the server is back, and W&B costs seconds.

A stage SIGKILLed while the server is down loses nothing: its journal is on disk, `python -m workflows.runs
sync-tracking` sends it and ends the dead attempt's run, and the next attempt continues that run with every step
once; a password in MLFLOW_TRACKING_URI reaches no file of the run, no W&B file, no MLflow param or tag."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faults
import mlflow
import pytest
from test_tracking import SERVER_ENV, free_port, history, tensorboard_points, wandb_points
from training_fixtures import make_run_dir, stage_script, wait_for_file

from run.run_dir import RunDir
from spec.loading import load_pipeline
from stages.contract import StageContext
from stages.tracking import StageTracker
from stages.tracking_wandb import WANDB_INIT_TIMEOUT_SECONDS


class MlflowServer:
    """`mlflow server` on a fixed port and SQLite store, so it can be stopped and started again in place."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.store = f"sqlite:///{directory / 'server.db'}"
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--backend-store-uri", self.store, "--artifacts-destination", str(self.directory / "artifacts")]
        command += ["--workers", "1"]
        log = (self.directory / "server.log").open("ab")
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory, start_new_session=True, env=SERVER_ENV
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not start: {(self.directory / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None


@pytest.fixture
def mlflow_server(tmp_path: Path):
    server = MlflowServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_training_outlives_an_mlflow_restart_and_an_unreachable_wandb(tmp_path: Path, mlflow_server) -> None:
    overrides = [
        f"tracking.mlflow_tracking_uri={mlflow_server.uri}",
        "stages.cpt.training.max_steps=9",
        "stages.cpt.training.save_steps=3",
        "stages.cpt.training.logging_steps=1",
        "tracking.wandb_project=reliability",
    ]
    run_dir = make_run_dir(tmp_path / "run", overrides=overrides, n_text=60, n_chat=10)
    closed = free_port()  # nothing listens there: W&B online with no network
    wandb_env = {"WANDB_API_KEY": "f" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{closed}", "WANDB_MODE": ""}

    child = faults.start(run_dir, "cpt", HOLD_AFTER_SAVE="3", HOLD_BEFORE_SAVE="6", **wandb_env)
    faults.wait_held(run_dir, "after-save", 3, child)
    mlflow_server.stop()  # the server goes away mid-stage
    faults.release(run_dir, "after-save", 3)
    faults.wait_held(run_dir, "before-save", 6, child)  # steps 4-6 trained with no server
    mlflow_server.start()  # and comes back
    faults.release(run_dir, "before-save", 6)
    assert child.wait(timeout=600) == 0, faults.output_of(child)[-4000:]

    output = faults.output_of(child)
    result = run_dir.read_result("cpt")
    assert result.status == "succeeded" and result.metrics["steps"] == 9
    assert output.count("tracking warning: MLflow") == 1, output[-4000:]  # one warning, not one per call
    assert "tracking warning: W&B: starting the run failed" in output
    client = mlflow.tracking.MlflowClient(mlflow_server.store)
    steps = sorted(m.step for m in client.get_metric_history(result.mlflow_run_id, "loss"))
    assert steps == list(range(1, 10))  # nothing lost: the outage's metrics were sent once it was back
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    assert not (run_dir.stage_dir("cpt") / "logs" / "tracking-unsent.jsonl").exists()


def test_wandb_online_without_network_costs_seconds_not_minutes(tmp_path: Path, monkeypatch) -> None:
    """W&B's own start timeout is 90 s; the tracker's is WANDB_INIT_TIMEOUT_SECONDS."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "f" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = load_pipeline("korean-llm", "local").spec  # wandb_project set
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, "sft", spec)
    assert ctx.begin()
    started = time.monotonic()
    with StageTracker(ctx) as tracker:
        waited = time.monotonic() - started
        tracker.log_metrics({"loss": 1.0}, step=1)
        ctx.finish()
    assert any("W&B: starting the run failed" in w for w in tracker.warnings)
    assert waited < WANDB_INIT_TIMEOUT_SECONDS + 30 < 90, f"W&B took {waited:.0f}s to give up"
    assert run_dir.read_result("sft").status == "succeeded"


# --------------------------------------------------------------------------- SIGKILL during an outage

PASSWORD = "Pa55-w0rd-of-the-tracking-server"
GIT_TOKEN = "ghp_FAKEtokenInTheRemoteUrl0123456789ab"
GIT_REMOTE = f"https://{GIT_TOKEN}:x-oauth-basic@github.com/example/posttrain.git"

# Prints the tracking URI as a careless library would, while W&B runs: the stage's masking stream hides it in the
# log, and W&B must not capture the text before it is masked.
_PRINTS_THE_URI = """
import os
from stages import tracking as _tracking

_log_metrics = _tracking.StageTracker.log_metrics

def _printing_log_metrics(self, metrics, step=None):
    if step == 2 and not getattr(self, "printed", False):
        self.printed = True
        print("tracking to", os.environ["MLFLOW_TRACKING_URI"], flush=True)
    return _log_metrics(self, metrics, step)

_tracking.StageTracker.log_metrics = _printing_log_metrics
"""


@dataclass
class Journaled:
    """A cpt stage SIGKILLed during an MLflow outage, synced with `sync-tracking`, then run again to the end."""

    run_dir: Any
    store: str
    journal_before_kill: str
    killed_run_id: str | None
    after_sync: dict[str, Any]
    sync_output: str
    outputs: list[str]


@pytest.fixture(scope="module")
def journaled(tmp_path_factory: pytest.TempPathFactory) -> Journaled:
    base = tmp_path_factory.mktemp("journaled")
    server = MlflowServer(base)  # its port is chosen; it is not started: the server is down
    overrides = [
        "stages.cpt.training.max_steps=6",
        "stages.cpt.training.save_steps=3",
        "stages.cpt.training.logging_steps=1",
        "stages.cpt.training.eval_steps=3",
        "tracking.wandb_project=journal",
    ]
    run_dir = make_run_dir(base / "run", overrides=overrides, n_text=60, n_chat=10)
    script = run_dir.root.parent / "run_tracked_stage.py"
    script.write_text(_PRINTS_THE_URI + stage_script(run_dir.root).read_text(encoding="utf-8"), encoding="utf-8")
    command = [sys.executable, str(script), "cpt", "--run-dir", str(run_dir.root)]
    env = faults.fault_env(run_dir, WANDB_MODE="offline", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    env["MLFLOW_TRACKING_URI"] = f"http://posttrain:{PASSWORD}@127.0.0.1:{server.port}"
    env.pop("WANDB_SERVICE", None)  # each stage starts its own W&B service, as in a pod (not this process's)
    outputs = []
    # The stages run from a checkout cloned with a token in its remote URL, as CI jobs often are.
    checkout = base / "checkout"
    checkout.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(["git", "remote", "add", "origin", GIT_REMOTE], cwd=checkout, check=True)

    # 1. The server is down for the whole first attempt, which is killed at the end of step 5 (after checkpoint-3).
    log = base / "attempt-1.log"
    with log.open("w") as out:
        child = subprocess.Popen(
            command, env={**env, "HOLD_BEFORE_SAVE": "5"}, cwd=checkout, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for_file(faults.fault_dir(run_dir) / "held-before-save-5", child)
        journal = run_dir.stage_dir("cpt") / "logs" / "tracking-unsent.jsonl"
        journal_before_kill = journal.read_text(encoding="utf-8")
    finally:
        child.kill()
        child.wait(timeout=60)
    outputs.append(log.read_text(encoding="utf-8", errors="replace"))
    killed_run_id = run_dir.read_result("cpt").mlflow_run_id

    # 2. The server is back: sync-tracking sends the journal and ends the dead attempt's run.
    server.start()
    try:
        synced = subprocess.run(
            [sys.executable, "-m", "workflows.runs", "sync-tracking", str(run_dir.root)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert synced.returncode == 0, synced.stdout + synced.stderr
        outputs.append(synced.stdout + synced.stderr)
        client = mlflow.tracking.MlflowClient(server.store)
        run_id = run_dir.read_result("cpt").mlflow_run_id
        run = client.get_run(run_id)
        parent = client.get_run(run.data.tags["mlflow.parentRunId"])
        after_sync = {
            "run_id": run_id,
            "status": run.info.status,
            "parent_status": parent.info.status,
            "history": history(client, run_id),
            "journal_left": journal.exists(),
        }

        # 3. The next attempt resumes from checkpoint-3 and trains steps 4-6.
        rerun = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        outputs.append(rerun.stdout + rerun.stderr)
    finally:
        server.stop()
    return Journaled(run_dir, server.store, journal_before_kill, killed_run_id, after_sync, synced.stdout, outputs)


@pytest.mark.slow
def test_a_stage_killed_during_an_outage_loses_no_metric_and_leaves_no_run_running(journaled: Journaled) -> None:
    lines = [json.loads(line) for line in journaled.journal_before_kill.splitlines()]
    assert sorted(r["step"] for r in lines if r.get("metric") == "loss") == [1, 2, 3, 4]  # on disk before the kill
    assert journaled.killed_run_id is None  # the run was never created: the server was down from the start

    after = journaled.after_sync  # sync-tracking created the run, sent the journal, ended the dead attempt
    assert "cpt: sent" in journaled.sync_output and "ended KILLED" in journaled.sync_output, journaled.sync_output
    assert (after["status"], after["parent_status"], after["journal_left"]) == ("KILLED", "KILLED", False)
    assert [s for s, _ in after["history"]["loss"]] == [1, 2, 3, 4]

    result = journaled.run_dir.read_result("cpt")  # the next attempt continued the same run, to its end
    assert result.status == "succeeded" and result.attempts == 2 and result.mlflow_run_id == after["run_id"]
    client = mlflow.tracking.MlflowClient(journaled.store)
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    metrics = history(client, result.mlflow_run_id)
    assert [s for s, _ in metrics["loss"]] == list(range(1, 7))
    assert metrics["loss"][3] == after["history"]["loss"][3]  # step 4 trained twice: the first value stays


@pytest.mark.slow
def test_the_real_trainer_logs_one_value_per_metric_and_step_in_every_backend(journaled: Journaled) -> None:
    result = journaled.run_dir.read_result("cpt")
    metrics = history(mlflow.tracking.MlflowClient(journaled.store), result.mlflow_run_id)
    for key, points in metrics.items():
        assert len({s for s, _ in points}) == len(points), f"MLflow {key}: several values at a step: {points}"
    assert [s for s, _ in metrics["eval_loss"]] == [3, 6]  # in training, final evaluate() and summary: once
    assert [s for s, _ in metrics["epoch"]] == [s for s, _ in metrics["num_input_tokens_seen"]] == list(range(1, 7))
    assert {"train_runtime", "perplexity", "tokens"} <= set(metrics)
    # Both attempts' files. W&B writes its offline file in the background: the killed attempt's holds what W&B
    # wrote before the kill (often nothing); the resumed attempt's has steps 5 and 6.
    stage_logs = journaled.run_dir.stage_dir("cpt") / "logs"
    # TensorBoard's tags carry the Trainer's sections (train/loss, eval/loss); W&B's keys are MLflow's.
    for name, points, at_least, loss, eval_loss in (
        ("TensorBoard", tensorboard_points(stage_logs), set(range(1, 7)), "train/loss", "eval/loss"),
        ("W&B", wandb_points(journaled.run_dir.root), {5, 6}, "loss", "eval_loss"),
    ):
        repeated = sorted({p for p in points if points.count(p) > 1})
        assert not repeated, f"{name} has several values for {repeated[:5]}"
        assert at_least <= {s for k, s in points if k == loss} <= set(range(1, 7)), (name, points)
        assert at_least & {3, 6} <= {s for k, s in points if k == eval_loss} <= {3, 6}, (name, points)


@pytest.mark.slow
def test_no_credential_reaches_a_file_of_the_run_nor_mlflow(journaled: Journaled) -> None:
    """The password of MLFLOW_TRACKING_URI (printed by the stage, in MLflow's errors) and a token in the git remote."""
    root = journaled.run_dir.root
    files = [p for p in root.rglob("*") if p.is_file()]
    assert list(root.glob("wandb/offline-run-*/run-*.wandb")) and list(root.glob("cpt/logs/tensorboard/events.*"))
    for secret in (PASSWORD, GIT_TOKEN):
        found = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not found, f"{secret} is in {found}"
    assert PASSWORD not in journaled.journal_before_kill
    leaks = [line for output in journaled.outputs for line in output.splitlines() if PASSWORD in line]
    assert not leaks, leaks[:3]  # the stage's log (both attempts) and sync-tracking's
    assert "tracking to http://***@127.0.0.1" in journaled.outputs[0]  # printed, and masked by the stage's stream
    client = mlflow.tracking.MlflowClient(journaled.store)
    for run in client.search_runs([e.experiment_id for e in client.search_experiments()]):
        sent = json.dumps([run.data.params, run.data.tags])
        assert PASSWORD not in sent, run.info.run_name
