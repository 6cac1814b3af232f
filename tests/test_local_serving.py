"""The local serve step (workflows/local_serving.py): vLLM started with the predictor pod's command line, the
rollout's smoke check against it, its record in deploy's stage.json, champion moved only after it answered.

The command line is held to the kserve-vllm ServingRuntime and the InferenceService deploy renders. Faults the real
engine cannot be made to show on cue (a crash before it listens, a load that never ends, empty answers) come from
tests/fake_vllm_server.py; the real engine serves each shipped pipeline's model in tests/test_shipped_pipelines.py,
tests/test_local_dag.py and tests/test_variants.py, and a deploy folder here."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import requests
import yaml
from test_rollout import NAME, champion, deploy_run, make_spec

from run.serving import (
    RUNTIME_ENV,
    RUNTIME_MODEL_DIR,
    RUNTIME_PORT,
    SERVER_COMMAND,
    evaluation_server_argv,
    inference_service,
    predictor_args,
    runtime_args,
    server_argv,
)
from run.vllm_server import CPU_EAGER, CPU_ONE_PROCESS, server_env
from spec.loading import SpecError, load_pipeline
from workflows import local_serving

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "manifests" / "components" / "kserve-vllm" / "servingruntime.yaml"
FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"


def test_the_pods_command_line_is_the_runtimes_and_the_inference_services() -> None:
    """What the local step runs is what KServe runs: the runtime's command and arguments (there with /mnt/models and
    the InferenceService's name), then the InferenceService's arguments, which come from the same function."""
    container = yaml.safe_load(RUNTIME.read_text())["spec"]["containers"][0]
    assert container["command"] == SERVER_COMMAND
    assert container["args"] == runtime_args(RUNTIME_MODEL_DIR, "{{.Name}}", RUNTIME_PORT)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert RUNTIME_ENV.items() <= env.items()
    spec = load_pipeline("korean-llm").spec
    isvc_args = inference_service(spec, "pvc://c/m", "run-1")["spec"]["predictor"]["model"]["args"]
    pod = [*container["command"], *container["args"], *isvc_args]
    assert server_argv(spec, "python3", RUNTIME_MODEL_DIR, "{{.Name}}", RUNTIME_PORT) == pod


def test_evaluate_starts_vllm_with_the_runtimes_command_and_loading_rule() -> None:
    """evaluate's vLLM backend (stages/vllm_measures.py): the runtime's server and safetensors-only loading, on
    127.0.0.1, with the length, dtype, GPUs and seed evaluate asks for; tensor parallelism over whole heads."""
    from stages.vllm_measures import tensor_parallel

    argv = evaluation_server_argv(
        "py", "/m", "candidate", 9, max_model_len=384, dtype="bfloat16", tensor_parallel=2, seed=42
    )
    assert argv == [
        "py", "-m", "vllm.entrypoints.openai.api_server",
        *runtime_args("/m", "candidate", 9),
        "--host=127.0.0.1", "--max-model-len=384", "--seed=42", "--dtype=bfloat16", "--tensor-parallel-size=2",
    ]  # fmt: skip
    assert argv[1:3] == SERVER_COMMAND[1:]
    plain = evaluation_server_argv("py", "/m", "base", 9, max_model_len=64, dtype="auto", tensor_parallel=1, seed=0)
    assert not any(a.startswith(("--dtype", "--tensor-parallel-size")) for a in plain)
    # all the pod's GPUs where they divide the heads, else the most that do
    assert [tensor_parallel(g, h) for g, h in ((8, 64), (8, 28), (0, 4), (1, 4), (4, 2), (6, 4))] == [8, 4, 1, 1, 2, 2]


def test_dtype_and_the_tool_call_parser_reach_vllm() -> None:
    spec = load_pipeline(
        "qwen3-30b-a3b",
        overrides=["stages.deploy.serving.dtype=bfloat16", "stages.deploy.serving.tool_call_parser=hermes"],
    ).spec
    args = predictor_args(spec)
    assert args == [
        "--load-format=safetensors",
        "--max-model-len=16384",
        "--tensor-parallel-size=2",
        "--dtype=bfloat16",
        "--enable-auto-tool-choice",
        "--tool-call-parser=hermes",
    ]
    assert inference_service(spec, "pvc://c/m", "r")["spec"]["predictor"]["model"]["args"] == args
    with pytest.raises(SpecError, match="tool_call_parser"):
        load_pipeline("korean-llm", overrides=["stages.deploy.serving.tool_call_parser=qwen"])


def test_the_cpu_build_serves_a_whole_model_from_the_engine_core_and_splits_cores_between_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One shard: its worker in the engine core's process; several: a worker process each, with cores of their own;
    a value the environment sets wins."""
    monkeypatch.delenv(CPU_ONE_PROCESS, raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    whole, split = server_env({}, 1), server_env({}, 2)
    assert whole[CPU_ONE_PROCESS] == "0" and "VLLM_CPU_OMP_THREADS_BIND" not in whole
    assert server_env({}, 0) == whole  # serving.gpus 0: the predictor on CPU, the model whole
    assert CPU_ONE_PROCESS not in split and split["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert whole[CPU_EAGER] == split[CPU_EAGER] == "1"
    monkeypatch.setenv(CPU_ONE_PROCESS, "1")
    assert server_env({}, 1)[CPU_ONE_PROCESS] == "1"


def test_a_context_longer_than_the_models_positions_is_refused_before_anything_runs() -> None:
    with pytest.raises(SpecError) as info:
        load_pipeline("korean-llm", profile="local", overrides=["stages.deploy.serving.max_model_len=4096"])
    message = str(info.value)
    assert "stages.deploy.serving.max_model_len" in message and "max_position_embeddings (2048)" in message
    unserved = ["stages.deploy.serving.enabled=false", "stages.deploy.serving.max_model_len=4096"]
    served = load_pipeline("korean-llm", profile="local", overrides=unserved)
    assert served.spec.stages.deploy.serving.max_model_len == 4096  # nothing served: nothing to refuse


# --------------------------------------------------------------------------- the step, against the fake


@pytest.fixture
def deployed(tmp_path: Path) -> tuple[Path, object]:
    """A run directory as deploy leaves it under --local with a serve step to follow: version 2 registered as
    challenger (gate passed), champion on version 1, the model folder in deploy/model."""
    spec = make_spec(tmp_path)
    deploy_run(tmp_path, spec, "run-1", "1")
    from test_rollout import registry

    registry(spec).set_registered_model_alias(NAME, "champion", "1")
    run_dir = deploy_run(tmp_path, spec, "run-2", "2")
    (run_dir / "deploy" / "model").mkdir()
    (run_dir / "deploy" / "model" / "config.json").write_text("{}")
    return run_dir, spec


def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, behaviour: str) -> Path:
    wrapper = tmp_path / "vllm-python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(wrapper))
    monkeypatch.setenv("FAKE_VLLM", behaviour)
    monkeypatch.setenv("FAKE_VLLM_PID_FILE", str(tmp_path / "vllm.pid"))
    monkeypatch.setenv("FAKE_VLLM_ARGV_FILE", str(tmp_path / "vllm.argv"))
    return wrapper


def assert_stopped(tmp_path: Path) -> None:
    """The server is gone, and so is the directory of its sockets (VLLM_RPC_BASE_PATH, made for it)."""
    pid = int((tmp_path / "vllm.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    sockets = Path((tmp_path / "vllm.pid.sockets").read_text())
    assert sockets.name.startswith("vllm-ipc-") and not sockets.exists()


def served_record(run_dir: Path) -> dict | None:
    return json.loads((run_dir / "deploy" / "stage.json").read_text())["extra"].get("served")


def test_a_good_server_is_checked_recorded_stopped_and_its_model_promoted(
    tmp_path: Path,
    deployed: tuple[Path, object],
    real_vllm: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The real engine on a tiny model as deploy writes it: the rollout's smoke check answered through the qwen3
    template, the record, the server gone, champion moved, nothing of it left in the temporary directory."""
    from training_fixtures import write_tiny_model

    from run.run_dir import RunDir

    # A temporary directory of its own, short enough for vLLM's sockets (107 characters a path), not pytest's.
    temporary = Path(tempfile.mkdtemp(prefix="serve-"))
    request.addfinalizer(lambda: shutil.rmtree(temporary, ignore_errors=True))
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    run_dir, spec = deployed
    shutil.rmtree(run_dir / "deploy" / "model")
    shutil.move(write_tiny_model(tmp_path / "tiny"), run_dir / "deploy" / "model")
    spec.stages.deploy.serving.max_model_len = 2048  # the tiny model's positions
    RunDir(run_dir).write_spec(spec)
    assert local_serving.main(["--run-dir", str(run_dir)]) == 0
    assert champion(spec) == "2"
    served = served_record(run_dir)
    assert served["engine"] == "vllm" and served["engine_version"] == "0.32.0"
    assert [a["prompt"] for a in served["answers"]] == spec.stages.evaluate.prompts
    assert all(a["answer"].strip() and a["answer"] != a["prompt"] for a in served["answers"])
    # The predictor pod's command line, with the run's model and a port of 127.0.0.1.
    argv = served["argv"]
    port = next(int(a.split("=")[1]) for a in argv if a.startswith("--port="))
    model = str(run_dir / "deploy" / "model")
    assert argv == [*server_argv(spec, str(real_vllm), model, NAME, port), "--host=127.0.0.1"]
    with pytest.raises(requests.ConnectionError):  # stopped: nothing listens there any more
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert "[serve] smoke check:" in capsys.readouterr().out
    # Its sockets and its executor's rendezvous file (`vllm_dist_<hex>`) went with the server's own directory.
    assert list(temporary.iterdir()) == []
    # vLLM's CPU build ran the model eagerly (run.vllm_server.CPU_EAGER): no inductor compile of this folder; and in
    # the engine core's process (CPU_ONE_PROCESS): no worker process of its own.
    log = (run_dir / "deploy" / "logs" / "vllm.log").read_text()
    assert "Supported tasks" in log and "Warming up model for the compilation" not in log
    assert re.search(r"\(EngineCore pid=\d+\) .*Starting to load model", log) and "(Worker pid=" not in log


@pytest.mark.parametrize(
    ("behaviour", "said"),
    [
        ("crash", "vLLM exited with 1 before it was ready"),
        ("never", "vLLM was not ready within stages.deploy.serving.smoke_check.ready_timeout_seconds=3"),
        ("empty", "smoke check: the answer to '한국의 수도는 어디인가요?' is empty"),
    ],
)
def test_a_server_that_fails_leaves_champion_where_it_was(
    tmp_path: Path,
    deployed: tuple[Path, object],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    behaviour: str,
    said: str,
) -> None:
    run_dir, spec = deployed
    spec.stages.deploy.serving.smoke_check.ready_timeout_seconds = 3
    from run.run_dir import RunDir

    RunDir(run_dir).write_spec(spec)
    fake_python(tmp_path, monkeypatch, behaviour)
    assert local_serving.main(["--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert said in err and f"{NAME} v2 was not promoted" in err and "champion 1" in err
    if behaviour == "crash":  # the server's own last lines, from deploy/logs/vllm.log
        assert "ValueError: the model's head size is not supported" in err
    assert champion(spec) == "1" and served_record(run_dir) is None
    assert_stopped(tmp_path)


@pytest.mark.parametrize(("behaviour", "starts"), [("port-taken-once", 2), ("port-taken", 3)])
def test_a_port_taken_before_vllm_bound_it_is_tried_again_on_another(
    tmp_path: Path,
    deployed: tuple[Path, object],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    behaviour: str,
    starts: int,
) -> None:
    """A port is free when the step chooses it, and another process (a run or a test beside it) can bind it before
    vLLM does: vLLM exits saying so, and the step starts it again on another port, at most 3 times. (The fake's
    second start serves empty answers: the step got as far as the smoke check.)"""
    run_dir, spec = deployed
    fake_python(tmp_path, monkeypatch, behaviour)
    assert local_serving.main(["--run-dir", str(run_dir)]) == 1
    out, err = capsys.readouterr()
    argvs = [json.loads(line) for line in (tmp_path / "vllm.argv.starts").read_text().splitlines()]
    assert len(argvs) == starts and out.count("[serve] starting vLLM:") == starts
    if behaviour == "port-taken-once":
        assert "smoke check: the answer to" in err and "Address already in use" not in err
    else:  # given up: the last start's own words
        assert "vLLM exited with 1 before it was ready" in err and "Address already in use" in err
    assert champion(spec) == "1" and served_record(run_dir) is None


def test_without_a_serving_environment_the_step_says_so_in_one_line(
    deployed: tuple[Path, object], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, spec = deployed
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(run_dir / "no-such-python"))
    assert local_serving.main(["--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("[serve] skipped: no vLLM serving environment")
    assert served_record(run_dir) is None and champion(spec) == "1"


def test_a_qwen2_stand_in_is_sized_as_vllm_sizes_its_heads() -> None:
    """vLLM's Qwen2 (as Qwen2.5's own configs) takes a head as hidden_size / num_attention_heads wide, whatever
    head_dim says: a stand-in where the two differ trains with one width and would be served with another."""
    shape = "model.from_config={architecture: qwen2, hidden_size: 64, num_attention_heads: 4, head_dim: 32}"
    with pytest.raises(SpecError) as info:
        load_pipeline("korean-llm", profile="local", overrides=[shape])
    assert "model.from_config.head_dim" in str(info.value) and "hidden_size to 128" in str(info.value)
    fitting = shape.replace("num_attention_heads: 4", "num_attention_heads: 2, num_key_value_heads: 1")
    assert load_pipeline("korean-llm", profile="local", overrides=[fitting]).spec.model.from_config.head_dim == 32


def test_sigterm_to_the_step_stops_the_server_it_started(
    tmp_path: Path, deployed: tuple[Path, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner passes an interrupt on as SIGTERM: the step stops vLLM (in a session of its own, which no signal to
    the step's group reaches) before it exits, and champion stays."""
    import signal
    import subprocess
    import time

    run_dir, spec = deployed
    fake_python(tmp_path, monkeypatch, "never")
    step = subprocess.Popen([sys.executable, "-m", "workflows.local_serving", "--run-dir", str(run_dir)], cwd=REPO)
    pid_file = tmp_path / "vllm.pid"
    for _ in range(200):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.1)
    step.send_signal(signal.SIGTERM)
    assert step.wait(60) != 0
    assert_stopped(tmp_path)
    assert champion(spec) == "1" and served_record(run_dir) is None
