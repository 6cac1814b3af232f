"""Tracking outages never fail a stage: a real `mlflow server` on 127.0.0.1 stopped in the middle of a training
stage and started again, and W&B online with no network (a fake key and a closed local port). Training finishes,
with one warning per backend, every metric reaches MLflow once the server is back, and W&B costs seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import faults
import mlflow
import pytest
from test_tracking import free_port
from training_fixtures import make_run_dir

from stages.contract import RunDir, StageContext
from stages.tracking import WANDB_INIT_TIMEOUT_SECONDS, StageTracker
from workflows.loading import load_pipeline


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
            command, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory, start_new_session=True
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
