"""The training stages' Prometheus metrics: what a scrape of the served port returns, who serves it, and the
container port and variable the compiled PyTorchJob gives the Master."""

from __future__ import annotations

import signal
import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import fresh_spec
from prometheus_client.parser import text_string_to_metric_families
from schema_validation import pod_template_object, validate_core, validate_pytorchjob
from test_progress import Clock, tiny_model
from training_fixtures import make_run_dir, start_stage, wait_for_file

from run.exits import EXIT_RETRYABLE
from run.names import METRICS_PORT_ENV
from run.run_dir import RunDir
from stages.checkpoints import MARKER
from stages.contract import StageContext
from stages.metrics import StageMetrics
from stages.progress import ProgressLog
from workflows.pytorchjob import METRICS_PORT_NAME, job_manifest

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample the server at 127.0.0.1:`port` returns, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode("utf-8")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


LABELS = (("pipeline", "korean-llm"), ("run", "korean-llm-x7k2p"), ("stage", "sft"))


def test_a_scrape_returns_the_progress_figures_after_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 61 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 70 * 2**30)
    clock = Clock()
    progress = ProgressLog("sft", tiny_model(), clock=clock)
    progress.flops_per_token = 6 * 1.7e9
    wall = Clock()
    wall.now = 1_760_000_000.0
    metrics = StageMetrics(
        progress, "korean-llm", "korean-llm-x7k2p", "sft", deadline_seconds=7 * 24 * 3600, started=1_759_990_000.0
    )
    metrics.clock = wall
    port = metrics.serve(0, addr="127.0.0.1")
    assert port
    try:
        before = scrape(port)
        # Before training: when it started and its deadline, nothing about progress yet.
        assert before == {
            ("posttrain_stage_start_timestamp_seconds", LABELS): 1_759_990_000.0,
            ("posttrain_deadline_timestamp_seconds", LABELS): 1_759_990_000.0 + 7 * 24 * 3600,
        }

        args = SimpleNamespace(world_size=1)
        state = SimpleNamespace(global_step=100, max_steps=1000, num_input_tokens_seen=0, is_world_process_zero=True)
        for callback in (progress, metrics):  # the trainer's order: the progress line first
            callback.on_train_begin(args, state, None)
        assert scrape(port)[("posttrain_last_step_timestamp_seconds", LABELS)] == wall.now
        assert scrape(port)[("posttrain_step", LABELS)] == 100  # resumed at step 100

        clock.now += 10.0
        wall.now += 10.0
        state.global_step, state.num_input_tokens_seen = 110, 436_000
        metrics.on_step_end(args, state, None)
        logs = {"loss": 2.5, "learning_rate": 1e-5}
        for callback in (progress, metrics):
            callback.on_log(args, state, None, logs=logs)
        after = scrape(port)
    finally:
        metrics.close()
    memory = dict(LABELS)
    assert after == {
        ("posttrain_stage_start_timestamp_seconds", LABELS): 1_759_990_000.0,
        ("posttrain_deadline_timestamp_seconds", LABELS): 1_759_990_000.0 + 7 * 24 * 3600,
        ("posttrain_step", LABELS): 110,
        ("posttrain_max_steps", LABELS): 1000,
        ("posttrain_last_step_timestamp_seconds", LABELS): 1_760_000_010.0,
        ("posttrain_loss", LABELS): 2.5,
        ("posttrain_tokens_per_second", LABELS): 43_600,
        ("posttrain_mfu", LABELS): pytest.approx(6 * 1.7e9 * 43_600 / 989e12),
        ("posttrain_eta_seconds", LABELS): pytest.approx(10 / 10 * 890),
        ("posttrain_gpu_memory_bytes", tuple(sorted({**memory, "kind": "max_allocated"}.items()))): 61 * 2**30,
        ("posttrain_gpu_memory_bytes", tuple(sorted({**memory, "kind": "reserved"}.items()))): 70 * 2**30,
    }


def test_on_cpu_there_is_no_mfu_nor_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    progress = ProgressLog("cpt", tiny_model(), clock=Clock())
    metrics = StageMetrics(progress, "p", "r", "cpt", deadline_seconds=60, started=0.0)
    port = metrics.serve(0, addr="127.0.0.1")
    assert port
    try:
        args = SimpleNamespace(world_size=1)
        state = SimpleNamespace(global_step=0, max_steps=10, num_input_tokens_seen=0, is_world_process_zero=True)
        progress.on_train_begin(args, state, None)
        progress.clock.now += 5
        state.global_step, state.num_input_tokens_seen = 1, 500
        for callback in (progress, metrics):
            callback.on_log(args, state, None, logs={"loss": 3.0})
        names = {name for name, _ in scrape(port)}
    finally:
        metrics.close()
    assert "posttrain_tokens_per_second" in names
    assert not names & {"posttrain_mfu", "posttrain_gpu_memory_bytes"}


def test_a_taken_port_costs_a_warning_not_the_stage(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = StageMetrics(ProgressLog("sft", tiny_model()), "p", "r", "sft", deadline_seconds=60)
        assert metrics.serve(port, addr="127.0.0.1") is None
    assert metrics.server is None
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"[sft] warning: metrics not served on port {port}: ")
    metrics.on_step_end(None, SimpleNamespace(global_step=3), None)  # the callbacks still work, unserved


def _context(tmp_path: Path) -> StageContext:
    return StageContext(RunDir(tmp_path / "korean-llm-x7k2p"), "sft", fresh_spec("korean-llm"))


@pytest.mark.parametrize(("rank", "served"), [("0", True), ("1", False)])
def test_rank_0_serves_on_the_port_the_job_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str, served: bool
) -> None:
    port = free_port()
    monkeypatch.setenv(METRICS_PORT_ENV, str(port))
    monkeypatch.setenv("RANK", rank)
    ctx = _context(tmp_path)
    metrics = StageMetrics.for_stage(ctx, ProgressLog("sft", tiny_model()))
    try:
        assert (metrics.server is not None) is served
        if served:
            samples = scrape(port)
            deadline = ctx.section.run_policy.active_deadline_seconds
            start = samples[("posttrain_stage_start_timestamp_seconds", LABELS)]
            assert samples[("posttrain_deadline_timestamp_seconds", LABELS)] == start + deadline
    finally:
        metrics.close()


def test_without_the_variable_nothing_is_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    assert StageMetrics.for_stage(_context(tmp_path), ProgressLog("sft", tiny_model())).server is None


# --------------------------------------------------------------------------- the PyTorchJob


def test_the_master_declares_the_metrics_port_and_the_workers_do_not(schemas_dir: Path) -> None:
    spec = fresh_spec("qwen3-30b-a3b")
    stage = next(s for s in ("cpt", "sft", "rlhf") if spec.stage(s).enabled and spec.stage(s).resources.nodes > 1)
    job = job_manifest(spec, stage)
    validate_pytorchjob(job)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    (master,) = replicas["Master"]["template"]["spec"]["containers"]
    assert master["ports"] == [{"name": METRICS_PORT_NAME, "containerPort": 9200, "protocol": "TCP"}]
    assert [e for e in master["env"] if e["name"] == METRICS_PORT_ENV] == [{"name": METRICS_PORT_ENV, "value": "9200"}]
    (worker,) = replicas["Worker"]["template"]["spec"]["containers"]
    assert "ports" not in worker
    assert METRICS_PORT_ENV not in {e["name"] for e in worker["env"]}
    for rtype, replica in replicas.items():
        validate_core(pod_template_object(replica["template"], name=rtype.lower()))


def test_a_stage_env_cannot_point_the_server_elsewhere() -> None:
    spec = fresh_spec("korean-llm")
    spec.stages.sft.env[METRICS_PORT_ENV] = "8000"
    (master,) = job_manifest(spec, "sft")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert [e["value"] for e in master["env"] if e["name"] == METRICS_PORT_ENV] == ["9200"]


def test_no_metrics_port_no_port_and_no_variable() -> None:
    spec = fresh_spec("korean-llm")
    spec.cluster.metrics_port = None
    (master,) = job_manifest(spec, "sft")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert "ports" not in master
    assert METRICS_PORT_ENV not in {e["name"] for e in master["env"]}


# --------------------------------------------------------------------------- a real stage


@pytest.mark.slow
def test_a_training_stage_serves_its_progress_while_it_trains(tmp_path: Path) -> None:
    overrides = [
        "stages.cpt.training.max_steps=8",
        "stages.cpt.training.save_steps=4",
        "stages.cpt.training.logging_steps=1",
    ]
    run_dir = make_run_dir(tmp_path / "korean-llm-m3tr1c", overrides=overrides, n_text=80, n_chat=10)
    port = free_port()
    child = start_stage(run_dir, "cpt", HOLD_AFTER_CHECKPOINT="4", **{METRICS_PORT_ENV: str(port)})
    try:
        wait_for_file(run_dir.stage_dir("cpt") / "checkpoints" / "checkpoint-4" / MARKER, child)
        samples = scrape(port)  # the stage is held right after checkpoint-4: step 4 of 8
    finally:
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=300) == EXIT_RETRYABLE
    labels = (("pipeline", "korean-llm"), ("run", "korean-llm-m3tr1c"), ("stage", "cpt"))
    assert samples[("posttrain_step", labels)] == 4
    assert samples[("posttrain_max_steps", labels)] == 8
    assert samples[("posttrain_loss", labels)] > 0
    assert samples[("posttrain_tokens_per_second", labels)] > 0
    assert samples[("posttrain_eta_seconds", labels)] >= 0
    start = samples[("posttrain_stage_start_timestamp_seconds", labels)]
    assert start <= samples[("posttrain_last_step_timestamp_seconds", labels)]
    deadline = run_dir.load_spec().stages.cpt.run_policy.active_deadline_seconds
    assert samples[("posttrain_deadline_timestamp_seconds", labels)] == start + deadline
