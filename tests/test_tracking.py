"""Experiment tracking (stages/tracking.py): MLflow parent and nested runs (the parent closed by the stage that
ends the pipeline run), resumption, a server that dies mid-run, W&B offline runs with their group and job type,
Langfuse events, and no secrets in params."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from training_fixtures import wandb_offline_runs

from stages.contract import RunDir, StageContext
from stages.tracking import TRACKING_FILE, StageTracker
from workflows.loading import load_pipeline

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module: creating an MLflow database takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, shared_store: str) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "LANGFUSE_HOST", "LANGFUSE_PUBLIC_KEY", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_store)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def make_ctx(root: Path, stage: str = "cpt", *overrides: str) -> StageContext:
    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null", *overrides]).spec
    run_dir = RunDir(root)
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, stage, spec)
    assert ctx.begin()
    return ctx


def client_for(root: Path | None = None) -> Any:
    """A client on the run directory's own database, or (None) on the module's shared store."""
    return mlflow.tracking.MlflowClient(
        f"sqlite:///{root / 'mlflow.db'}" if root else os.environ["MLFLOW_TRACKING_URI"]
    )


def test_stages_are_nested_runs_of_one_parent_with_params_metrics_and_artifacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the default: SQLite in the run directory
    root = tmp_path / "korean-llm-20260101-000000"
    prepare = make_ctx(root, "prepare")
    with StageTracker(prepare) as tracker:
        prepare.finish()
    parent_id = tracker.parent_run_id
    ctx = StageContext(prepare.run_dir, "cpt", prepare.spec)
    assert ctx.begin()
    with StageTracker(ctx) as tracker:
        tracker.log_params({"optimizer": {"name": "adamw", "betas": [0.9, 0.95]}})
        for step in range(3):
            tracker.log_metrics({"loss": 3.0 - step, "note": "not a number"}, step=step)
        tracker.log_figure_loss_curve([0, 1, 2], [3.0, 2.0, 1.0])
        ctx.finish(metrics={"loss": 1.0})

    client = client_for(root)
    run = client.get_run(ctx.result.mlflow_run_id)
    assert run.info.run_name == "cpt" and run.info.status == "FINISHED"
    assert (
        run.data.tags["mlflow.parentRunId"]
        == parent_id
        == json.loads((root / TRACKING_FILE).read_text())["mlflow"]["parent_run_id"]
    )
    assert client.get_run(parent_id).info.run_name == root.name
    assert run.data.params["optimizer.name"] == "adamw" and run.data.params["stage"] == "cpt"
    assert "cpt.training.learning_rate" in run.data.params
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [3.0, 2.0, 1.0]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"stage.json", "loss_curve.png"}
    assert list((root / "cpt" / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert not tracker.warnings


def test_the_stage_that_ends_the_pipeline_run_closes_its_parent_run(tmp_path: Path):
    ctx = make_ctx(tmp_path / "skipped", "prepare")  # prepare ends the run: unchanged data
    with StageTracker(ctx) as tracker:
        tracker.end_pipeline_run("skipped", "data unchanged since run before")
        ctx.finish(status="succeeded")
    parent = client_for().get_run(tracker.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["posttrain.end_reason"] == "skipped"
    assert parent.data.tags["posttrain.end_message"] == "data unchanged since run before"

    ctx = make_ctx(tmp_path / "running", "prepare")  # a stage followed by others leaves it open
    with StageTracker(ctx) as tracker:
        ctx.finish()
    parent = client_for().get_run(tracker.parent_run_id)
    assert parent.info.status == "RUNNING" and "posttrain.end_reason" not in parent.data.tags


def test_a_resumed_attempt_continues_the_same_run(tmp_path: Path):
    ctx = make_ctx(tmp_path / "run")
    tracker = StageTracker(ctx)
    tracker.start()
    tracker.log_metrics({"loss": 5.0}, step=1)
    first_run = ctx.result.mlflow_run_id
    tracker.finish("interrupted")
    ctx.fail("preempted", retryable=True)

    again = StageContext(ctx.run_dir, "cpt", ctx.spec)
    assert again.begin() and again.resumed and again.result.attempts == 2
    with StageTracker(again) as tracker:
        tracker.log_metrics({"loss": 4.0}, step=2)
        again.finish()
    assert again.result.mlflow_run_id == first_run
    client = client_for()
    assert [(m.step, m.value) for m in client.get_metric_history(first_run, "loss")] == [(1, 5.0), (2, 4.0)]
    assert client.get_run(first_run).info.status == "FINISHED"
    parent = client.get_run(first_run).data.tags["mlflow.parentRunId"]
    assert ctx.run_dir.root.name == client.get_run(parent).info.run_name


def test_no_secret_reaches_the_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_123")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pa55word-xyz")
    ctx = make_ctx(tmp_path / "run")
    with StageTracker(ctx) as tracker:
        tracker.log_params({"hf_token": "x", "api_key": "y", "lr": 0.1, "note": "uses hf_not_a_real_token_123"})
        ctx.finish()
    params = client_for().get_run(ctx.result.mlflow_run_id).data.params
    assert params["lr"] == "0.1"
    assert not {"hf_token", "api_key", "note"} & set(params)
    assert not any("hf_not_a_real" in v or "pa55word" in v for v in params.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path: Path):
    """A real `mlflow server` on 127.0.0.1 with a SQLite store; yields (uri, store uri, process)."""
    port = free_port()
    store = f"sqlite:///{tmp_path / 'server.db'}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", store, "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"]
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
            pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri, store, process
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    log.close()


def test_a_tracking_server_killed_mid_run_costs_a_warning_not_the_stage(tmp_path: Path, mlflow_server):
    uri, store, server = mlflow_server
    ctx = make_ctx(tmp_path / "run", "cpt", f"tracking.mlflow_tracking_uri={uri}")
    with StageTracker(ctx) as tracker:
        for step in range(3):
            tracker.log_metrics({"loss": 10.0 - step}, step=step)
        assert not tracker.warnings
        os.killpg(server.pid, signal.SIGKILL)  # the server dies while the stage is logging
        server.wait()
        for step in range(3, 6):
            tracker.log_metrics({"loss": 10.0 - step}, step=step)
        ctx.finish(metrics={"loss": 5.0})

    assert ctx.run_dir.read_result("cpt").status == "succeeded"
    assert any("MLflow" in w and "failed" in w for w in tracker.warnings)
    assert sum("failed" in w for w in tracker.warnings) == 1  # warned once, not per call
    unsent = [json.loads(line) for line in (ctx.logs_dir / "tracking-unsent.jsonl").read_text().splitlines()]
    assert [u["step"] for u in unsent if u.get("metric") == "loss"] == [3, 4, 5]
    stored = mlflow.tracking.MlflowClient(store)  # what reached the server before it died
    history = stored.get_metric_history(ctx.result.mlflow_run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2]


def test_wandb_offline_writes_a_run_directory_under_the_run(tmp_path: Path):
    pytest.importorskip("wandb")
    spec = load_pipeline("korean-llm", "local").spec  # wandb_project: korean-llm
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, "sft", spec)
    assert ctx.begin()
    with StageTracker(ctx) as tracker:
        tracker.log_metrics({"loss": 1.5}, step=1)
        ctx.finish()
    offline = list((run_dir.root / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    assert ctx.result.wandb_run_path == str(offline[0])
    # What the run file records (read back as W&B would sync it): grouped by pipeline run, typed by stage.
    (run,) = wandb_offline_runs(run_dir.root)
    assert (run["project"], run["group"], run["job_type"], run["name"]) == ("korean-llm", "run", "sft", "run/sft")
    assert run["dir"] == ctx.result.wandb_run_path


class _Collector(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append((self.headers["Authorization"], body))
        self.send_response(207)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def test_langfuse_gets_start_and_end_events_only_when_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ctx = make_ctx(tmp_path / "quiet")
    with StageTracker(ctx) as tracker:
        ctx.finish()
    assert tracker.langfuse is not None and not tracker.langfuse.enabled

    server = HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("LANGFUSE_HOST", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    ctx = make_ctx(tmp_path / "traced")
    with pytest.raises(RuntimeError), StageTracker(ctx):
        raise RuntimeError("boom")
    server.shutdown()
    names = [event["body"]["name"] for _, body in _Collector.received for event in body["batch"]]
    assert [n for n in names if n.startswith("cpt.")] == ["cpt.start", "cpt.error", "cpt.end"]
    auth = _Collector.received[0][0]
    assert auth == "Basic " + base64.b64encode(b"pk-lf-test:sk-lf-test").decode()
    assert client_for().get_run(ctx.result.mlflow_run_id).info.status == "FAILED"


def test_hf_callback_forwards_trainer_logs_and_plots_the_loss(tmp_path: Path):
    pytest.importorskip("transformers")
    ctx = make_ctx(tmp_path / "run")
    with StageTracker(ctx) as tracker:
        callback = tracker.hf_callback()
        for step, loss in ((5, 2.0), (10, 1.5)):
            state = SimpleNamespace(global_step=step, is_world_process_zero=True)
            callback.on_log(None, state, None, logs={"loss": loss, "learning_rate": 1e-3, "epoch": 0.5})
        callback.on_train_end(None, SimpleNamespace(global_step=10, is_world_process_zero=True), None)
        ctx.finish()
    client = client_for()
    assert [(m.step, m.value) for m in client.get_metric_history(ctx.result.mlflow_run_id, "loss")] == [
        (5, 2.0),
        (10, 1.5),
    ]
    assert (ctx.logs_dir / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_only_rank_zero_tracks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ctx = make_ctx(tmp_path / "run")
    monkeypatch.setenv("RANK", "1")
    with StageTracker(ctx) as tracker:
        tracker.log_metrics({"loss": 1.0}, step=1)
    assert tracker.run_id is None and ctx.result.mlflow_run_id is None
    assert not (ctx.run_dir.root / TRACKING_FILE).exists() and not (ctx.logs_dir / "tensorboard").exists()
