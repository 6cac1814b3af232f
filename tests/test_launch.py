"""A training stage starts under --local as its pod starts it: the argv of the PyTorchJob's (and TrainJob's)
container, torchrun's node variables as the Training Operator sets them, and the container's plain settings
(workflows/launch.py). The run of the whole DAG through this path is tests/test_local_dag.py's."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from training_fixtures import child_env, make_run_dir

from spec.fields import TRAINING_STAGES
from spec.loading import known_pipelines, load_pipeline
from workflows import launch, pytorchjob, trainjob
from workflows.launch import (
    CLUSTER_PATHS,
    LOCAL_PORTS,
    LOCAL_TORCHRUN,
    container_env,
    free_port,
    local_launch,
    operator_env,
)
from workflows.stage_process import StageRun, launch_stage, port_was_taken, stage_launch

SHIPPED = [(name, profile) for name in known_pipelines() for profile in (None, "local", "gpu")]


def _containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers that run the stage: the PyTorchJob's Master and Workers, or the TrainJob's trainer."""
    if manifest["kind"] == "TrainJob":
        return [manifest["spec"]["trainer"]]
    replicas = manifest["spec"]["pytorchReplicaSpecs"].values()
    return [c for r in replicas for c in r["template"]["spec"]["containers"]]


def _effective(env: list[dict[str, Any]]) -> dict[str, Any]:
    """A container's environment as the kubelet resolves it: the later of two equal names wins."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


@pytest.mark.parametrize(("pipeline", "profile"), SHIPPED)
def test_the_local_launch_is_the_pods(pipeline: str, profile: str | None, tmp_path: Path) -> None:
    spec = load_pipeline(pipeline, profile).spec
    kinds = [pytorchjob, trainjob]
    stages = [s for s in spec.stages.enabled() if s in TRAINING_STAGES]
    assert stages
    for stage in stages:
        command, env = local_launch(spec, stage, tmp_path, gpus=4)
        assert command[: len(LOCAL_TORCHRUN)] == list(LOCAL_TORCHRUN)
        settings = container_env(spec, stage)
        for kind in kinds:
            for container in _containers(kind.job_manifest(spec, stage)):
                rendered = container["command"]
                assert rendered[0] == "torchrun" and rendered[1:-1] == command[len(LOCAL_TORCHRUN) : -1], rendered
                seen = _effective(container["env"])
                for name, value in settings.items():  # every plain setting reaches the pod with the same value
                    assert seen.get(name) == value, (kind.__name__, stage, name)
        # Locally: the same settings but the pod's own paths, and the node variables of one node of 4 processes.
        assert {k: v for k, v in settings.items() if k not in CLUSTER_PATHS}.items() <= env.items()
        assert not CLUSTER_PATHS & env.keys()
        node = {k: env[k] for k in operator_env(4, 1, 0, "127.0.0.1", 1) if k not in ("MASTER_PORT", "PET_MASTER_PORT")}
        assert node == {
            "MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_ADDR": "127.0.0.1",
            "WORLD_SIZE": "4",
            "RANK": "0",
            "PET_NNODES": "1",
            "PET_NPROC_PER_NODE": "4",
            "PET_NODE_RANK": "0",
        }
        assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] and int(env["MASTER_PORT"]) > 0


def test_the_spec_env_reaches_both_and_the_cluster_paths_stay_in_the_pod(tmp_path: Path) -> None:
    overrides = [
        "cluster.env.NCCL_DEBUG=INFO",
        "stages.sft.env.NCCL_DEBUG=TRACE",
        "cluster.env.HF_HOME=/mnt/checkpoints/hf",
        "stages.sft.run_policy.termination_grace_period_seconds=600",
    ]
    spec = load_pipeline("korean-llm", None, overrides).spec
    seen = _effective(_containers(pytorchjob.job_manifest(spec, "sft"))[0]["env"])
    _, env = local_launch(spec, "sft", tmp_path, gpus=2)
    assert seen["NCCL_DEBUG"] == env["NCCL_DEBUG"] == "TRACE"  # the stage's env over the cluster's
    assert seen["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "585"
    assert seen["HF_HOME"] == "/mnt/checkpoints/hf" and "HF_HOME" not in env  # a path of the cluster


def test_which_stages_start_as_their_pod(tmp_path: Path) -> None:
    spec = load_pipeline("korean-llm", "local").spec
    python = [sys.executable, "-m", "stages"]
    for gpus in (0, 1, 2):
        command, env = stage_launch(spec, "sft", tmp_path, force=False, gpus=gpus, forked=False)
        assert command[:3] == list(LOCAL_TORCHRUN) and env["PET_NPROC_PER_NODE"] == str(max(gpus, 1))
        assert command[3:] == ["--module", "stages", "sft", "--run-dir", str(tmp_path)]
    # Forked from the warm-start server (a machine without GPUs): the stage's own entry point, in the server.
    assert stage_launch(spec, "sft", tmp_path, force=True, gpus=0, forked=True) == (
        [*python, "sft", "--run-dir", str(tmp_path), "--force"],
        {},
    )
    for stage in ("prepare", "evaluate", "deploy"):  # as their Argo steps run them
        assert stage_launch(spec, stage, tmp_path, force=False, gpus=2, forked=False) == (
            [*python, stage, "--run-dir", str(tmp_path)],
            {},
        )
    command, _ = stage_launch(spec, "cpt", tmp_path, force=True, gpus=2, forked=False)
    assert command[-1] == "--force"  # the runner's own flag, after the pod's argv


def test_the_local_master_port_is_below_the_ephemeral_range() -> None:
    # Outgoing connections take ports of 32768-60999 at any moment; the master's port is never one of them.
    ports = {free_port() for _ in range(20)}
    assert all(port in LOCAL_PORTS and port < 32768 for port in ports)
    assert len(ports) > 1  # drawn at random: runners started together do not try the same port


def test_a_stage_whose_master_port_was_taken_is_launched_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The port the runner chose is taken (a listener) before torchrun binds it: torchrun cannot start its store, and
    # the runner launches again on another port, where the stage runs (and fails for its own reason: no tokenizer).
    run_dir = make_run_dir(tmp_path / "run", n_text=20, n_chat=20)
    shutil.rmtree(run_dir.root / "prepare" / "tokenizer")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or free_port())
        run = StageRun("sft")
        log = run_dir.root / "sft" / "logs" / "stage.log"
        code = launch_stage(run, run_dir.load_spec(), "sft", run_dir.root, child_env(), log, lambda: None)
    text = log.read_text(encoding="utf-8")
    assert code != 0 and run.returncode == code
    assert text.count("torch.distributed.run --module stages sft") == 2, text
    first, second = text.split("launching again")
    assert "EADDRINUSE" in first and "prepare/tokenizer" not in first
    assert "prepare/tokenizer" in second and "EADDRINUSE" not in second


def test_a_stage_that_ran_is_not_launched_again() -> None:
    # A stage that printed its own lines has run: whatever it said later, launching it again is not the runner's call.
    run = StageRun("sft", returncode=1)
    run.tail.extend(["[sft] step 1/4 · loss 9.1", "RuntimeError: address already in use"])
    assert not port_was_taken(run, "sft")
    run.tail.clear()
    run.tail.append("DistNetworkError: ... port: 42121 ... EADDRINUSE, message: address already in use")
    assert port_was_taken(run, "sft")
    run.returncode = 0
    assert not port_was_taken(run, "sft")
