"""The local serve step: the deployed model answers through the real vLLM engine on 127.0.0.1, as it will in KServe.

    python -m workflows.local_serving --run-dir DIR

Under `--local` it runs after deploy, where the cluster DAG runs workflows/rollout.py:

1. Start vLLM's OpenAI-compatible server from the serving environment (`.venv-vllm/bin/python` of this checkout,
   which `make local` sets up, or `$POSTTRAIN_VLLM_PYTHON`; `off` serves nothing) with the command line of the
   predictor pod (`run.serving.server_argv`, the same function that renders the InferenceService's arguments), on
   a free port of 127.0.0.1 and the model deploy wrote in `<run>/deploy/model`. vLLM pins its own transformers,
   so it lives in an environment of its own, as it has a pod of its own.
2. Wait for `/health`, within stages.deploy.serving.smoke_check.ready_timeout_seconds; a server that exits
   first fails the step with the last lines of its log (`<run>/deploy/logs/vllm.log`).
3. The cluster rollout's smoke check (workflows/rollout.py `smoke_check`): the same prompts and rules.
4. Record the engine (vLLM's `/version`), the command line and the answers in deploy's stage.json (`extra.served`),
   stop the server, and move `champion` to the deployed version when its gate passed, as the rollout does.

A machine without the serving environment says so in one line and skips the step; deploy then promoted the model
itself (the runner tells deploy whether a serve step follows: POSTTRAIN_LOCAL_SERVE=1). A failed start or check
leaves `champion` where it was and exits 1.

Control plane: no torch; vLLM runs in its own process and environment.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import requests

from run.run_dir import RunDir, StageResult
from run.serving import RUNTIME_ENV, inference_service_name, server_argv
from spec.pipeline import PipelineSpec
from workflows.rollout import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    BadInput,
    RolloutFailed,
    not_promoted,
    promote,
    read_run,
    smoke_check,
    smoke_prompts,
)
from workflows.stage_process import die_with_runner

VLLM_PYTHON_VARIABLE = "POSTTRAIN_VLLM_PYTHON"
ENV_DIR = Path(__file__).resolve().parent.parent / ".venv-vllm"
HOST = "127.0.0.1"
"""The pod's server listens on all of its own interfaces; here it must not be reachable from other machines."""
CPU_KV_CACHE_GIB = "1"
"""VLLM_CPU_KVCACHE_SPACE where unset: vLLM's CPU build otherwise reserves most of the machine's memory."""
LOG_LINES = 15


def vllm_python() -> Path | None:
    """The serving environment's python: $POSTTRAIN_VLLM_PYTHON, else `.venv-vllm/bin/python` of this checkout;
    None when neither exists, or the variable says `off` (local runs that need no serving)."""
    named = os.environ.get(VLLM_PYTHON_VARIABLE)
    if named == "off":
        return None
    if named:
        return Path(named) if Path(named).is_file() else None
    python = ENV_DIR / "bin" / "python"
    return python if python.is_file() else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class Server:
    """vLLM's server process, in a session of its own (its engine core is a child process: stopping the session
    stops both)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_runner(),  # SIGTERM to vLLM if this step dies before it can stop it
            )

    def tail(self) -> str:
        try:
            with self.log.open(encoding="utf-8", errors="replace") as f:
                return "\n".join(line.rstrip() for line in deque(f, LOG_LINES))
        except OSError:
            return ""

    def wait_ready(self, base_url: str, timeout: float) -> float:
        """Seconds until /health answered 200; RolloutFailed when the server exits or the time is up."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RolloutFailed(
                    f"vLLM exited with {self.process.returncode} before it was ready; last lines of {self.log}:\n"
                    + self.tail()
                )
            try:
                if requests.get(f"{base_url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RolloutFailed(
            f"vLLM was not ready within ready_timeout_seconds={timeout:g}; last lines of {self.log}:\n" + self.tail()
        )

    def stop(self, grace: float = 20) -> None:
        """SIGTERM to the server's session, SIGKILL to what is left of it after `grace` seconds (vLLM's engine
        core and workers are processes of their own, which may outlive the API server)."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def cpu_binding(shards: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU build serving over `shards` tensor-parallel workers (the pod's
    --tensor-parallel-size, kept here): this machine's cores split between them (`0|1` on two), since its automatic
    binding wants a NUMA node per worker. The GPU build ignores it."""
    cores = sorted(os.sched_getaffinity(0))
    groups = [cores[i::shards] or cores[i % len(cores) :][:1] for i in range(shards)]
    return "|".join(",".join(map(str, group)) for group in groups)


def engine_version(base_url: str) -> str:
    try:
        return str(requests.get(f"{base_url}/version", timeout=5).json()["version"])
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return "unknown"


def serve(spec: PipelineSpec, run_dir: Path, python: Path) -> dict[str, Any]:
    """Start vLLM on the deployed model, check it as the rollout does, stop it; the record of what answered."""
    deploy_dir = RunDir(run_dir).stage_dir("deploy")
    model_dir = deploy_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise BadInput(f"{model_dir} holds no model: deploy writes it")
    name = inference_service_name(spec)
    port = free_port()
    argv = [*server_argv(spec, str(python), str(model_dir), name, port), f"--host={HOST}"]
    env = {**os.environ, **RUNTIME_ENV}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    if (shards := spec.stages.deploy.serving.gpus) > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(shards))
    base_url = f"http://{HOST}:{port}"
    print(f"[serve] starting vLLM: {' '.join(argv)}", flush=True)
    server = Server(argv, env, deploy_dir / "logs" / "vllm.log")
    try:
        ready = server.wait_ready(base_url, spec.stages.deploy.serving.smoke_check.ready_timeout_seconds)
        version = engine_version(base_url)
        print(f"[serve] vLLM {version} ready on {base_url} after {ready:.0f}s", flush=True)
        answers = smoke_check(base_url, name, smoke_prompts(spec), spec.stages.deploy.serving)
    finally:
        server.stop()
    return {
        "engine": "vllm",
        "engine_version": version,
        "argv": argv,
        "ready_seconds": round(ready, 1),
        "answers": [{"prompt": a.prompt, "answer": a.text, "seconds": round(a.seconds, 2)} for a in answers],
    }


def record(run_dir: Path, served: dict[str, Any]) -> None:
    """deploy's stage.json with `extra.served`, written atomically."""
    run = RunDir(run_dir)
    result = run.read_result("deploy")
    assert result is not None  # read_run checked it
    run.write_result(StageResult(**{**result.model_dump(), "extra": {**result.extra, "served": served}}))


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflows.local_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="The run directory (deploy has run in it).")
    args = parser.parse_args(argv)
    # SIGTERM (the runner passing an interrupt on) unwinds like Ctrl-C, so that the server is stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        spec, deployed, _ = read_run(args.run_dir)
        python = vllm_python()
        if python is None:
            where = os.environ.get(VLLM_PYTHON_VARIABLE) or ENV_DIR
            print(
                f"[serve] skipped: no vLLM serving environment at {where} (`make local` sets it up); deploy "
                "promoted the model itself",
                flush=True,
            )
            return EXIT_OK
        served = serve(spec, args.run_dir, python)
    except BadInput as exc:
        print(f"[serve] error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except RolloutFailed as exc:
        print(not_promoted(deployed, exc), file=sys.stderr, flush=True)
        return EXIT_FAILED
    record(args.run_dir, served)
    if deployed.get("promoted") == "true":  # deploy moved it already: nothing was to be served when it ran
        print(f"[serve] vLLM {served['engine_version']} served it (deploy had promoted it)", flush=True)
        return EXIT_OK
    promoted = promote(spec, args.run_dir, deployed)
    print(f"[serve] vLLM {served['engine_version']} served it; {promoted}", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
