"""Warm starts of local stages: the runner's side of the server in stages/warm.py, which forks each stage with its
libraries already imported.

The local runner (workflows/local.py) starts one server per run, with the run's stage environment, when no GPU is
visible (the tiny local models: a stage's imports take longer than its training), and forks every stage from it,
prepare included: prepare waits for the server's imports, which the next stage needs anyway (korean-llm `--local`
on 2 cores: 35 s and 27 s of CPU; with a fresh prepare beside the importing server, 40 s and 39 s). A stage forked
so is the process `python -m stages <stage> ...` would be: its own session, output, exit code and signals, and the
runner treats it through the same few calls it makes on a `subprocess.Popen` (`WarmProcess`). Anything the server
cannot take (a torchrun command, another environment, a server that failed to import or died) starts the usual way.
`POSTTRAIN_WARM_STARTS=0` turns warm starts off.

A server outlives its run when it is idle: the next local run of the same process (a notebook's, a test's, a
script's second `run_local`) forks from it if its stage environment differs at most in RUNTIME_VARIABLES; it ends
with the process.

Runs of different processes (one shell command after another) share a server started apart,
`python -m stages.warm --listen PATH`, when they have POSTTRAIN_WARM_SERVER=PATH: each run connects and gets a
server of its own forked from that one, which has imported everything already. A run whose environment differs from
that server's in a variable read at import, or that cannot connect, says so and starts its own server.

This module never imports torch: it only speaks the server's protocol (see stages/warm.py).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from typing import IO

READY_TIMEOUT_S = 300.0
"""How long a stage waits for the server's imports before it starts the usual way instead."""
MAX_MESSAGE = 1 << 16
SWITCH = "POSTTRAIN_WARM_STARTS"
"""Set to 0 to start every stage of a local run as a fresh process."""
SERVER = "POSTTRAIN_WARM_SERVER"
"""The socket of a server that local runs share (`python -m stages.warm --listen PATH`)."""
RUNTIME_VARIABLES = (
    "MLFLOW_TRACKING_URI",  # each run root has its own local store
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",  # the runner's own tracking sets these defaults in its environment
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "PYTEST_CURRENT_TEST",  # pytest names the running test
    SERVER,  # read by the runner alone
    "PWD",  # a shell's own: where it is, how deep, what it ran last (runs typed in other shells share a server)
    "OLDPWD",
    "SHLVL",
    "_",
    "COLUMNS",  # the terminal's size, read when something is printed
    "LINES",
)
"""Variables of the runner's stage environment that nothing reads at import (MLflow reads its own per request): a
server kept from an earlier run of the process still forks the next run's stages where only these differ."""


class WarmProcess:
    """A stage forked by the server: `pid`, `stdout`, `returncode`, `poll()`, `wait()`, `send_signal()`,
    `terminate()` and `kill()`, as on the `subprocess.Popen` the runner otherwise holds."""

    def __init__(self, args: list[str], stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> None:
        self.args = args
        self.stdout = stdout
        self.stderr = stderr
        self.pid = 0
        self.returncode: int | None = None
        self._forked = threading.Event()
        self._exited = threading.Event()

    def _ended(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarts:
    """One server, started with `env`, and the stages forked from it. A stage's environment must be `env`, or differ
    from it only in `runtime_variables`: variables that nothing reads at import (the local runner's are
    RUNTIME_VARIABLES). `server`: the server's command, without `--socket-fd` (the tests' adds its fault hooks).
    With `address`, none is started: the connection to the server listening there (`python -m stages.warm --listen`)
    is this run's server, and its ready message brings the environment (and more runtime variables) to match."""

    def __init__(
        self,
        env: dict[str, str],
        runtime_variables: Collection[str] = (),
        server: list[str] | None = None,
        address: str | None = None,
    ) -> None:
        self.env = dict(env)
        self.runtime_variables = frozenset(runtime_variables)
        self.error = ""
        self._ready = threading.Event()
        self._usable = False
        self._lock = threading.Lock()  # one request at a time: replies come in the order of the requests
        self._pending: queue.Queue[WarmProcess] = queue.Queue()
        self._running: dict[int, WarmProcess] = {}
        self._server: subprocess.Popen[bytes] | None = None
        self.shared = address is not None
        """Whether the server is one that runs share (a connection to a listening server)."""
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._sock.connect(address)
            except OSError:
                self._sock.close()
                raise
            self._start_reader()
            return
        self._sock, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._server = subprocess.Popen(
                [*(server or [sys.executable, "-m", "stages.warm"]), "--socket-fd", str(server_end.fileno())],
                pass_fds=[server_end.fileno()],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the stages through the runner only
            )
        finally:
            server_end.close()
        self._start_reader()

    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read, name="warm-starts", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Take the server's messages: ready, the pid of each request, the exit code of each stage."""
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "ready" in message:
                if "env" in message:  # a listening server's
                    self.env = message["env"]
                    self.runtime_variables |= frozenset(message.get("runtime_variables", ()))
                self._usable = bool(message["ready"])
                self.error = message.get("error", "")
                self._ready.set()
            elif "pid" in message:
                process = self._pending.get_nowait()
                process.pid = message["pid"]
                self._running[process.pid] = process
                process._forked.set()
            elif "exited" in message:
                process = self._running.pop(message["exited"], None)
                if process is not None:
                    process._ended(message["returncode"])
        # The server is gone: its stages got SIGTERM (stages/warm.py) and save before they exit; no exit code will
        # come for them, so each counts as ended, killed by SIGTERM, once its process is gone.
        self._usable = False
        self.error = self.error or "the warm-start server exited"
        self._ready.set()
        while not self._pending.empty():
            self._pending.get_nowait()._forked.set()  # never forked: pid stays 0
        for process in list(self._running.values()):
            while alive(process.pid):
                time.sleep(0.2)
            process._ended(-signal.SIGTERM)

    def start(
        self, command: list[str], env: dict[str, str], separate_stderr: bool = False, output: int | None = None
    ) -> WarmProcess | None:
        """The stage of `command` (`python -m stages ...`) forked from the server, its stderr in its stdout (or in
        `stderr` of its own; or both written to the file descriptor `output`, with no pipe), or None where it must
        start the usual way: another command or environment, a server that could not import. A stage waits for the
        server's imports (they are what it would import itself)."""
        if command[:3] != [sys.executable, "-m", "stages"] or not self._fits(env):
            return None
        if not self._ready.wait(READY_TIMEOUT_S) or not self._usable:
            return None
        pipes = [] if output is not None else [os.pipe() for _ in range(2 if separate_stderr else 1)]
        readers = [os.fdopen(read_end, "rb") for read_end, _ in pipes]
        process = WarmProcess(command, *readers)
        with self._lock:
            self._pending.put(process)
            try:
                request = {"argv": command[3:], "cwd": os.getcwd(), **({"env": env} if env != self.env else {})}
                fds = [output] if output is not None else [write_end for _, write_end in pipes]
                socket.send_fds(self._sock, [json.dumps(request).encode("utf-8")], fds)
            except OSError:
                self._pending.get()
                for reader in readers:
                    reader.close()
                return None
            finally:
                for _, write_end in pipes:
                    os.close(write_end)
            while not process._forked.wait(1.0):  # the reader has its pid, or the server is gone
                if not self._reader.is_alive():
                    break
        if not process.pid:
            for reader in readers:
                reader.close()
            return None
        return process

    def takes(self, env: dict[str, str]) -> bool:
        """Whether stages with `env` can be forked from this server now: it is ready and alive, and `env` differs
        from its own at most in its runtime variables."""
        return self._ready.is_set() and self._usable and self._fits(env)

    def _fits(self, env: dict[str, str]) -> bool:
        """Whether `env` differs from the server's environment at most in its runtime variables."""
        return not self.differences(env)

    def differences(self, env: dict[str, str]) -> list[str]:
        """The variables, other than its runtime variables, in which `env` differs from the server's environment."""
        differs = {name for name in env.keys() | self.env.keys() if env.get(name) != self.env.get(name)}
        return sorted(differs - self.runtime_variables)

    def idle(self) -> bool:
        """Ready, alive, and no stage of it running: what a later run can take over."""
        return self._ready.is_set() and self._usable and not self._running

    def close(self) -> None:
        """End the server: at once where no stage of it runs (it holds nothing but imports; a runner interrupted
        while the server imports does not wait for it), else once those stages have exited."""
        if self._running:
            with suppress(OSError):
                self._sock.send(json.dumps({"close": True}).encode("utf-8"))
        elif self._server is not None:
            self._server.kill()
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR if self._running or self._server is not None else socket.SHUT_RDWR)
        if self._server is not None:
            self._server.wait()
        # A listening server's connection: its server ends once its stages have (none running: at once).
        self._reader.join(timeout=None if self._running and self._server is None else 10)
        self._sock.close()


def alive(pid: int) -> bool:
    """Whether a process runs (an orphan's zombie, which nothing may reap in a container, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wanted(gpus: int) -> bool:
    """Whether a local run starts a warm-start server: on Linux, without GPUs, unless POSTTRAIN_WARM_STARTS=0."""
    return sys.platform.startswith("linux") and gpus == 0 and os.environ.get(SWITCH, "1") != "0"


_kept: list[WarmStarts] = []
"""The idle server of this process's last local run, for its next one."""


def _close_kept() -> None:
    while _kept:
        _kept.pop().close()


atexit.register(_close_kept)


@contextmanager
def warm_starts(env: dict[str, str], gpus: int) -> Iterator[WarmStarts | None]:
    """A server for a local run's stages (None where warm starts are not wanted): the one the process's last run
    left idle where it takes `env`, else a new one. At the end it is kept while idle, else closed."""
    if not wanted(gpus):
        yield None
        return
    address = os.environ.get(SERVER)
    shared = connect(address, env) if address else None
    if shared is not None:
        try:
            yield shared
        finally:
            shared.close()
        return
    starts = _kept.pop() if _kept and _kept[-1].takes(env) else None
    _close_kept()  # one that cannot take this run's stages
    starts = starts or WarmStarts(env, RUNTIME_VARIABLES)
    try:
        yield starts
    finally:
        if starts.idle():
            _kept.append(starts)
        else:  # still importing (the run was stopped early), or stages of it still running, or dead
            starts.close()


def connect(address: str, env: dict[str, str]) -> WarmStarts | None:
    """The connection to the server listening at `address`, for a run with the stage environment `env`; None, said
    on stderr, where it cannot be had or cannot fork this run's stages."""
    try:
        starts = WarmStarts({}, RUNTIME_VARIABLES, address=address)
    except OSError as exc:
        print(f"warning: {SERVER}={address}: {exc.strerror or exc}; this run starts its own", file=sys.stderr)
        return None
    if starts._ready.wait(READY_TIMEOUT_S) and starts.takes(env):
        return starts
    differs = starts.differences(env) if starts._usable else []
    why = f"this run's environment differs in {', '.join(differs)}" if differs else starts.error or "not ready"
    starts.close()
    print(f"warning: {SERVER}={address}: {why}; this run starts its own", file=sys.stderr)
    return None
