"""Experiment tracking (stages/tracking*.py): MLflow parent and nested runs (the parent closed by the stage that
ends the pipeline run), resumption, a server that dies mid-run, W&B offline runs with their group and job type,
Langfuse events, and no secrets in params.

Outages: what the server cannot take is journaled on disk as it comes (a SIGKILLed stage keeps it) and sent by the
next attempt, the next stage or `python -m workflows.runs sync-tracking`, once, ending the runs the journal ended.
A server that is down is a URI with a closed port; "back" is the module's store. One value per (metric, step) in
MLflow, TensorBoard and W&B, across attempts; no credential in anything tracking writes or sends."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_langfuse import FakeLangfuse
from training_fixtures import wandb_offline_runs

from run.exits import StageInterrupted
from run.run_dir import RunDir
from run.tracking import TRACKING_FILE, local_store_uri
from spec.loading import load_pipeline
from spec.pipeline import PipelineSpec
from stages.contract import StageContext
from stages.tracking import StageTracker

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
    """A client on the run directory's local store, or (None) on the module's shared store."""
    return mlflow.tracking.MlflowClient(local_store_uri(root) if root else os.environ["MLFLOW_TRACKING_URI"])


def test_stages_are_nested_runs_of_one_parent_with_params_metrics_and_artifacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the default: the local store beside the run directory
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


SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""The environment of the tests' `mlflow server`: no job runner process beside it (these tests start no jobs)."""


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
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=SERVER_ENV
    )
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


LANGFUSE_SECRETS = (
    "cluster.secrets.langfuse_public_key={name: langfuse, key: public-key}",
    "cluster.secrets.langfuse_secret_key={name: langfuse, key: secret-key}",
)


def test_langfuse_gets_start_checkpoint_error_and_end_events_only_when_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    ctx = make_ctx(tmp_path / "quiet")
    with FakeLangfuse() as server, StageTracker(ctx) as tracker:
        ctx.finish()
    assert tracker.langfuse is not None and not tracker.langfuse.enabled and not server.spans

    # Keys from the environment (a Secret in the cluster), the server from the spec.
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-events")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-events")
    with FakeLangfuse() as server:
        ctx = make_ctx(tmp_path / "traced", "cpt", f"tracking.langfuse_host={server.url}", *LANGFUSE_SECRETS)
        with pytest.raises(RuntimeError), StageTracker(ctx) as tracker:
            tracker.checkpoint_saved(20, ctx.dir / "checkpoints" / "checkpoint-20")
            raise RuntimeError("boom")
        cpt_spans = list(server.spans)
        # A later stage of the same run lands in the same trace.
        later = StageContext(ctx.run_dir, "evaluate", ctx.spec)
        assert later.begin()
        with StageTracker(later):
            later.finish()
    assert not server.problems
    assert [span.name for span in cpt_spans] == ["cpt.start", "cpt.checkpoint", "cpt.error", "cpt.end"]
    assert server.names()[len(cpt_spans) :] == ["evaluate.start", "evaluate.end"]
    assert {span.trace_id for span in server.spans} == {tracker.langfuse.trace_id}
    start, checkpoint, error, end = cpt_spans
    assert start.auth == "Basic " + base64.b64encode(b"pk-lf-events:sk-lf-events").decode()
    assert start.metadata()["stage"] == "cpt" and start.metadata()["attempt"] == 1
    assert start.attributes["langfuse.trace.name"] == "traced"
    assert checkpoint.metadata()["step"] == 20 and checkpoint.metadata()["checkpoint"].endswith("checkpoint-20")
    assert error.attributes["langfuse.observation.level"] == "ERROR"
    assert error.attributes["langfuse.observation.status_message"] == "RuntimeError: boom"
    assert end.metadata()["status"] == "failed"
    assert client_for().get_run(ctx.result.mlflow_run_id).info.status == "FAILED"


def test_a_langfuse_outage_is_one_warning_and_the_stage_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-outage")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-outage")
    with FakeLangfuse(status=503) as server:
        monkeypatch.setenv("LANGFUSE_HOST", server.url)
        ctx = make_ctx(tmp_path / "run")
        with StageTracker(ctx) as tracker:
            tracker.checkpoint_saved(5, ctx.dir / "checkpoint-5")  # skipped: the breaker waits after the failure
            ctx.finish()
    assert not server.spans and ctx.result.status == "succeeded"
    (warning,) = [w for w in tracker.warnings if "Langfuse" in w]
    assert "Langfuse at http://127.0.0.1" in warning and "Service Unavailable" in warning
    assert "events are skipped" in warning


def test_a_langfuse_host_needs_both_keys_from_secrets():
    spec = load_pipeline("korean-llm", "local").spec.model_dump(mode="json")
    spec["tracking"]["langfuse_host"] = "https://langfuse.example.com"
    with pytest.raises(ValueError, match=r"needs cluster\.secrets\.langfuse_public_key"):
        PipelineSpec.model_validate(spec)
    spec["cluster"]["secrets"]["langfuse_public_key"] = {"name": "langfuse", "key": "public-key"}
    spec["cluster"]["secrets"]["langfuse_secret_key"] = {"name": "langfuse", "key": "secret-key"}
    assert PipelineSpec.model_validate(spec).cluster.secrets.env()["LANGFUSE_SECRET_KEY"].key == "secret-key"
    spec["tracking"]["langfuse_host"] = "https://pk:sk@langfuse.example.com"
    with pytest.raises(ValueError, match="without credentials"):
        PipelineSpec.model_validate(spec)
    spec["tracking"]["langfuse_host"] = None
    with pytest.raises(ValueError, match=r"tracking\.langfuse_host is not"):
        PipelineSpec.model_validate(spec)


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


# --------------------------------------------------------------------------- outages: the journal and its replay

PASSWORD = "Pa55-w0rd-in-the-URI"


def closed_uri(password: str = PASSWORD) -> str:
    """An MLflow server URI with credentials in it, on a port where nothing listens: a server that is down."""
    return f"http://posttrain:{password}@127.0.0.1:{free_port()}"


def journal_lines(ctx: StageContext) -> list[dict[str, Any]]:
    path = ctx.logs_dir / "tracking-unsent.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def history(client: Any, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run: its (step, value) pairs in step order."""
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def sync(root: Path, capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`posttrain runs sync-tracking root` once the stage's process is gone (its stage locks released, as its end
    releases them): the sync runs in a process of its own and leaves a stage that a live process holds alone."""
    from run import run_dir
    from workflows.runs import main as runs_main

    for path in [p for p in run_dir._HELD_LOCKS if root.resolve() in p.parents]:
        run_dir._HELD_LOCKS.pop(path).handle.close()
    code = runs_main(["sync-tracking", str(root)])
    out, err = capfd.readouterr()
    return code, out, err


_KILLED_ATTEMPT = """
import os, signal, sys
from run.exits import StageInterrupted
from run.run_dir import RunDir
from stages.contract import StageContext
from stages.tracking import StageTracker

run_dir = RunDir(sys.argv[1])
ctx = StageContext(run_dir, "cpt", run_dir.load_spec())
assert ctx.begin()
tracker = StageTracker(ctx)
tracker.start()
for step in range(1, 6):
    tracker.log_metrics({"loss": 10.0 - step, "epoch": step / 2}, step=step)
os.kill(os.getpid(), signal.SIGKILL)  # the node is lost: no finish, no stage.json update
"""


def test_a_stage_killed_during_an_outage_keeps_its_metrics_and_its_next_attempt_sends_them_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / "run"
    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec
    run_dir = RunDir(root)
    run_dir.write_spec(spec)
    script = tmp_path / "killed_attempt.py"
    script.write_text(_KILLED_ATTEMPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "MLFLOW_TRACKING_URI": closed_uri()}
    killed = subprocess.run([sys.executable, str(script), str(root)], env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]

    ctx = StageContext(run_dir, "cpt", spec)
    lines = journal_lines(ctx)  # written as the metrics came, not at the end: the process never got there
    assert [(r["metric"], r["step"]) for r in lines if r.get("metric") == "loss"] == [("loss", s) for s in range(1, 6)]
    assert any("param" in r for r in lines) and not any("end" in r for r in lines)
    assert PASSWORD not in (ctx.logs_dir / "tracking-unsent.jsonl").read_text() + killed.stderr

    # The server is back; the next attempt resumes from "checkpoint-3" and trains steps 4-8 again.
    assert ctx.begin() and ctx.resumed
    with StageTracker(ctx) as tracker:
        for step in range(4, 9):
            tracker.log_metrics({"loss": 100.0 + step, "epoch": step / 2}, step=step)
        ctx.finish()
    assert not (ctx.logs_dir / "tracking-unsent.jsonl").exists()
    client = client_for()
    run = client.get_run(ctx.result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    losses = history(client, run.info.run_id)["loss"]
    assert [s for s, _ in losses] == list(range(1, 9))  # every step once
    assert losses[:5] == [(s, 10.0 - s) for s in range(1, 6)]  # the first value of a step wins
    assert [s for s, _ in history(client, run.info.run_id)["epoch"]] == list(range(1, 9))
    stage_runs = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{tracker.parent_run_id}'")
    assert [r.info.run_id for r in stage_runs] == [run.info.run_id]  # one run for both attempts


def test_a_stage_that_ended_during_an_outage_is_ended_by_sync_tracking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
):
    up = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed_uri())
    ctx = make_ctx(tmp_path / "run", "cpt")
    with pytest.raises(RuntimeError), StageTracker(ctx) as tracker:
        for step in range(1, 4):
            tracker.log_metrics({"loss": 4.0 - step}, step=step)
        raise RuntimeError("boom")
    assert [r.get("end") or r.get("end_pipeline") for r in journal_lines(ctx) if "time" in r] == ["FAILED"] * 2
    assert any("sync-tracking" in w for w in tracker.warnings)

    code, out, err = sync(ctx.run_dir.root, capfd)  # the server is still down
    assert code == 1 and err.startswith("error: MLflow at http://***@127.0.0.1") and "pending" in err, err
    assert PASSWORD not in out + err
    assert (ctx.logs_dir / "tracking-unsent.jsonl").exists()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", up)  # back
    code, out, err = sync(ctx.run_dir.root, capfd)
    assert code == 0 and "everything got through" in out and "cpt: sent" in out, out + err
    assert not (ctx.logs_dir / "tracking-unsent.jsonl").exists()
    client = client_for()
    result = ctx.run_dir.read_result("cpt")
    run = client.get_run(result.mlflow_run_id)  # created by the replay, and recorded for the next attempt
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert [s for s, _ in history(client, run.info.run_id)["loss"]] == [1, 2, 3]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"stage.json"}
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])  # a failed stage closes the pipeline run
    assert parent.info.status == "FAILED" and parent.data.tags["posttrain.end_reason"] == "failed"
    assert json.loads((ctx.run_dir.root / TRACKING_FILE).read_text())["mlflow"]["parent_run_id"] == parent.info.run_id

    code, out, _ = sync(ctx.run_dir.root, capfd)  # nothing left
    assert code == 0 and "nothing to send" in out


def test_the_next_stage_sends_what_an_earlier_stage_could_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    up = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed_uri())
    prepare = make_ctx(tmp_path / "run", "prepare")
    with StageTracker(prepare) as tracker:
        tracker.log_metrics({"cpt_rows": 40.0}, step=0)
        prepare.finish()
    assert prepare.run_dir.read_result("prepare").mlflow_run_id is None

    monkeypatch.setenv("MLFLOW_TRACKING_URI", up)
    ctx = StageContext(prepare.run_dir, "cpt", prepare.spec)
    assert ctx.begin()
    with StageTracker(ctx) as tracker:
        ctx.finish()
    assert not (prepare.logs_dir / "tracking-unsent.jsonl").exists()
    client = client_for()
    earlier = client.get_run(prepare.run_dir.read_result("prepare").mlflow_run_id)
    assert earlier.info.status == "FINISHED" and earlier.data.metrics == {"cpt_rows": 40.0}
    assert earlier.data.tags["mlflow.parentRunId"] == tracker.parent_run_id  # one parent for the run
    assert client.get_run(tracker.parent_run_id).info.status == "RUNNING"  # cpt does not end this pipeline run


def test_a_send_cut_short_is_done_again_without_duplicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
):
    up = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed_uri())
    ctx = make_ctx(tmp_path / "run", "cpt")
    with StageTracker(ctx) as tracker:
        tracker.log_params({"lr": 0.1})
        for step in range(1, 4):
            tracker.log_metrics({"loss": 4.0 - step}, step=step)
        ctx.finish()
    journal = ctx.logs_dir / "tracking-unsent.jsonl"
    kept = journal.read_bytes()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", up)
    assert sync(ctx.run_dir.root, capfd)[0] == 0
    journal.write_bytes(kept + b'{"metric": "loss", "va')  # died after sending, before removing; a torn line
    code, out, _ = sync(ctx.run_dir.root, capfd)
    assert code == 0 and "were there already" in out, out
    client = client_for()
    run_id = ctx.run_dir.read_result("cpt").mlflow_run_id
    assert history(client, run_id)["loss"] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert client.get_run(run_id).data.params["lr"] == "0.1"
    assert client.get_run(run_id).info.status == "FINISHED"


def test_sync_tracking_leaves_a_running_stage_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    up = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed_uri())
    ctx = make_ctx(tmp_path / "run", "cpt")  # this process runs cpt: it holds cpt's lock
    tracker = StageTracker(ctx)
    tracker.start()
    tracker.log_metrics({"loss": 1.0}, step=1)
    synced = subprocess.run(
        [sys.executable, "-m", "workflows.runs", "sync-tracking", str(ctx.run_dir.root)],
        env={**os.environ, "MLFLOW_TRACKING_URI": up},
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert synced.returncode == 1, synced.stdout + synced.stderr
    assert "still pending; a process runs the stage" in synced.stdout, synced.stdout
    assert (ctx.logs_dir / "tracking-unsent.jsonl").exists()
    tracker.finish()


def test_sync_tracking_refuses_a_directory_that_is_not_a_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    code, out, err = sync(tmp_path, capfd)
    assert code == 2 and not out and len(err.splitlines()) == 1
    assert err.startswith(f"error: {tmp_path} is not a run directory (has no spec.json)")
    (tmp_path / "spec.json").write_text("{not json", encoding="utf-8")
    code, _, err = sync(tmp_path, capfd)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {tmp_path}/spec.json")
    help_text = subprocess.run(
        [sys.executable, "-m", "workflows.runs", "sync-tracking", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    ).stdout
    assert "example:" in help_text and "python -m workflows.runs sync-tracking runs/" in help_text


# --------------------------------------------------------------------------- one value per (metric, step)


def trainer_logs(step: int, last: int, eval_steps: int) -> list[dict[str, float]]:
    """The log dicts transformers' Trainer (5.x) passes to on_log at `step`, as a real cpt run logs them:
    the training log, the held-out evaluation every eval_steps, and at the last step the training summary and
    the stage's own final evaluate()."""
    epoch, tokens = step / 2, 512.0 * step
    logs = [
        {
            "loss": 6.0 - step / 10,
            "grad_norm": 2.3,
            "learning_rate": 1e-3,
            "epoch": epoch,
            "num_input_tokens_seen": tokens,
            "train_runtime": 0.5 * step,
            "train_tokens_per_second": 1600.0,
        },
    ]
    evaluation = {
        "eval_loss": 5.0 + 1 / step,
        "eval_runtime": 0.01,
        "eval_samples_per_second": 77.0,
        "eval_steps_per_second": 77.0,
        "epoch": epoch,
        "num_input_tokens_seen": tokens,
    }
    if step % eval_steps == 0:
        logs.append(evaluation)
    if step == last:
        logs.append(
            {
                "train_runtime": 0.5 * step + 0.1,
                "train_samples_per_second": 8.5,
                "train_steps_per_second": 2.1,
                "total_flos": 2.9e9,
                "train_loss": 5.5,
                "epoch": epoch,
                "num_input_tokens_seen": tokens,
            }
        )
        logs.append({**evaluation, "eval_runtime": 0.09})
    return logs


def tensorboard_points(logs: Path) -> list[tuple[str, int]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [
        (value.tag, event.step)
        for path in sorted(logs.glob("tensorboard/events.out.tfevents.*"))
        for event in EventFileLoader(str(path)).Load()
        for value in event.summary.value
    ]


def wandb_points(root: Path) -> list[tuple[str, int]]:
    from training_fixtures import wandb_records

    points = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: i.value_json for i in record.history.item}
                step = int(items["_step"])
                points += [(key, step) for key in items if not key.startswith("_")]
    return points


def test_every_backend_gets_one_value_per_metric_and_step_across_attempts_and_the_final_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pytest.importorskip("transformers")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    ctx = make_ctx(tmp_path / "run", "cpt", "tracking.wandb_project=dedupe")

    def train(tracker: StageTracker, steps: range, last: int) -> None:
        callback = tracker.hf_callback()
        for step in steps:
            state = SimpleNamespace(global_step=step, is_world_process_zero=True)
            for logs in trainer_logs(step, last, eval_steps=3):
                callback.on_log(None, state, None, logs=logs)

    tracker = StageTracker(ctx)
    tracker.start()
    train(tracker, range(1, 6), last=8)  # killed at step 5, after checkpoint-3
    tracker.finish("interrupted")
    ctx.fail("preempted", retryable=True)

    again = StageContext(ctx.run_dir, "cpt", ctx.spec)
    assert again.begin() and again.resumed
    with StageTracker(again) as tracker:
        train(tracker, range(4, 9), last=8)  # resumed from checkpoint-3: steps 4 and 5 trained again
        summary = {"steps": 8, "tokens": 4096.0, "train_loss_first": 5.9, "train_loss_last": 5.2, "eval_loss": 5.125}
        tracker.log_metrics(summary, step=8)  # what the stage logs after training (summary_metrics)
        again.finish()

    client = client_for()
    metrics = history(client, again.result.mlflow_run_id)
    for key, points in metrics.items():
        assert len({s for s, _ in points}) == len(points), f"{key} has several values at a step: {points}"
    assert [s for s, _ in metrics["loss"]] == list(range(1, 9))
    assert [s for s, _ in metrics["eval_loss"]] == [3, 6, 8]
    assert [s for s, _ in metrics["epoch"]] == [s for s, _ in metrics["num_input_tokens_seen"]] == list(range(1, 9))
    assert metrics["train_runtime"][-1] == (8, 4.0)  # the first value logged at step 8 (the training log's)
    assert metrics["loss"][3] == (4, 5.6) and metrics["steps"] == [(8, 8.0)]
    for name, points in (("TensorBoard", tensorboard_points(again.logs_dir)), ("W&B", wandb_points(ctx.run_dir.root))):
        repeated = sorted({p for p in points if points.count(p) > 1})
        assert not repeated, f"{name} has several values for {repeated[:5]}"
        loss = "train/loss" if name == "TensorBoard" else "loss"  # TensorBoard's tags are the Trainer's own
        assert {s for k, s in points if k == loss} == set(range(1, 9)), name


# --------------------------------------------------------------------------- credentials


def test_a_password_in_the_tracking_uri_reaches_no_file_param_tag_warning_or_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
):
    up = os.environ["MLFLOW_TRACKING_URI"]
    down = closed_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", down)
    other = "https://reader:An0ther-Pa55word@mirror.example.com/data"  # a credential not from the environment
    collector = FakeLangfuse().__enter__()
    monkeypatch.setenv("LANGFUSE_HOST", collector.url)
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-masking")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-masking")
    ctx = make_ctx(tmp_path / "run", "cpt")
    with pytest.raises(RuntimeError), StageTracker(ctx) as tracker:
        tracker.log_params({"tracking_uri": down, "mirror": other, "lr": 0.1})
        tracker.log_metrics({"loss": 1.0}, step=1)
        raise RuntimeError(f"could not reach {down}")
    collector.__exit__()

    warning = next(w for w in tracker.warnings if "logging failed" in w)
    assert "API request to http://***@127.0.0.1" in warning  # MLflow's error names the whole URL
    events = json.dumps([span.attributes for span in collector.spans])
    assert "could not reach http://***@127.0.0.1" in events
    journal = (ctx.logs_dir / "tracking-unsent.jsonl").read_text(encoding="utf-8")
    assert "reader:***@mirror.example.com" not in journal and "https://***@mirror.example.com/data" in journal

    monkeypatch.setenv("MLFLOW_TRACKING_URI", up)
    assert sync(ctx.run_dir.root, capfd)[0] == 0
    client = client_for()
    run = client.get_run(ctx.run_dir.read_result("cpt").mlflow_run_id)
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert run.data.params["lr"] == "0.1" and "tracking_uri" not in run.data.params  # holds an env secret: left out
    assert run.data.params["mirror"] == "https://***@mirror.example.com/data"
    sent = json.dumps([run.data.params, run.data.tags, parent.data.tags])
    seen = [events, sent, *tracker.warnings, capfd.readouterr().err]
    seen += [p.read_text(errors="replace") for p in ctx.run_dir.root.rglob("*") if p.is_file()]
    for secret in (PASSWORD, "An0ther-Pa55word"):
        assert not [text[:200] for text in seen if secret in text], secret


def test_a_stage_interrupted_by_a_signal_ends_its_runs_killed(tmp_path: Path):
    ctx = make_ctx(tmp_path / "run", "cpt")
    with pytest.raises(StageInterrupted), StageTracker(ctx) as tracker:
        tracker.log_metrics({"loss": 1.0}, step=1)
        raise StageInterrupted(signal.SIGTERM)
    client = client_for()
    assert client.get_run(ctx.result.mlflow_run_id).info.status == "KILLED"
    parent = client.get_run(tracker.parent_run_id)
    assert parent.info.status == "KILLED" and parent.data.tags["posttrain.end_reason"] == "interrupted"


def test_a_new_local_store_is_the_cached_empty_database_with_the_schema_mlflow_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stages/tracking_mlflow_server.py seed_local_store: a new SQLite store is a copy of an empty database made once
    per MLflow version, at the schema MLflow's own migrations give; an existing store is left as it is."""
    import sqlite3

    from mlflow import MlflowClient

    from stages.tracking_mlflow_server import seed_local_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def schema(database: Path) -> list[Any]:
        """Every table and index with its columns and constraints (in any order: MLflow's migrations order a table's
        constraints differently from one process to the next), and the schema revision."""
        with sqlite3.connect(database) as db:
            objects = db.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
            revision = db.execute("SELECT * FROM alembic_version").fetchall()
        parts = [
            (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
            for kind, name, sql in objects
        ]
        return [sorted(parts), revision]

    migrated = tmp_path / "migrated.db"
    MlflowClient(tracking_uri=f"sqlite:///{migrated}").search_experiments()  # MLflow's own migrations
    for run in ("first", "second"):  # the template made, then taken from the cache
        seeded = tmp_path / run / "mlflow.db"
        seed_local_store(seeded)
        assert schema(seeded) == schema(migrated)
        client = MlflowClient(tracking_uri=f"sqlite:///{seeded}", registry_uri=f"sqlite:///{seeded}")
        experiment = client.create_experiment("x")
        client.log_metric(client.create_run(experiment).info.run_id, "loss", 1.0)
        client.create_registered_model("m")
        assert sorted(e.name for e in client.search_experiments()) == ["Default", "x"]
    assert [p.name for p in (tmp_path / "cache" / "posttrain").iterdir()] == [f"mlflow-{mlflow.__version__}-store.db"]
    before = (tmp_path / "first" / "mlflow.db").read_bytes()
    seed_local_store(tmp_path / "first" / "mlflow.db")
    assert (tmp_path / "first" / "mlflow.db").read_bytes() == before
