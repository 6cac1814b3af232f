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

This module never imports torch: it only speaks the server's protocol (see stages/warm.py).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO

READY_TIMEOUT_S = 300.0
"""How long a stage waits for the server's imports before it starts the usual way instead."""
MAX_MESSAGE = 1 << 16
SWITCH = "POSTTRAIN_WARM_STARTS"
"""Set to 0 to start every stage of a local run as a fresh process."""


class WarmProcess:
    """A stage forked by the server: `pid`, `stdout`, `returncode`, `poll()`, `wait()` and `send_signal()`, as on
    the `subprocess.Popen` the runner otherwise holds."""

    def __init__(self, args: list[str], stdout: IO[bytes], stderr: IO[bytes] | None = None) -> None:
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


class WarmStarts:
    """One server, started with `env`, and the stages forked from it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.error = ""
        self._ready = threading.Event()
        self._usable = False
        self._lock = threading.Lock()  # one request at a time: replies come in the order of the requests
        self._pending: queue.Queue[WarmProcess] = queue.Queue()
        self._running: dict[int, WarmProcess] = {}
        self._sock, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "stages.warm", "--socket-fd", str(server_end.fileno())],
                pass_fds=[server_end.fileno()],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the stages through the runner only
            )
        finally:
            server_end.close()
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

    def start(self, command: list[str], env: dict[str, str], separate_stderr: bool = False) -> WarmProcess | None:
        """The stage of `command` (`python -m stages ...`) forked from the server, its stderr in its stdout (or in
        `stderr` of its own), or None where it must start the usual way: another command or environment, a server
        that could not import. A stage waits for the server's imports (they are what it would import itself)."""
        if command[:3] != [sys.executable, "-m", "stages"] or env != self.env:
            return None
        if not self._ready.wait(READY_TIMEOUT_S) or not self._usable:
            return None
        pipes = [os.pipe() for _ in range(2 if separate_stderr else 1)]
        readers = [os.fdopen(read_end, "rb") for read_end, _ in pipes]
        process = WarmProcess(command, readers[0], readers[1] if separate_stderr else None)
        with self._lock:
            self._pending.put(process)
            try:
                request = json.dumps({"argv": command[3:]}).encode("utf-8")
                socket.send_fds(self._sock, [request], [write_end for _, write_end in pipes])
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

    def close(self) -> None:
        """End the server: at once where no stage of it runs (it holds nothing but imports; a runner interrupted
        while the server imports does not wait for it), else once those stages have exited."""
        if not self._running:
            self._server.kill()
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        self._server.wait()
        self._reader.join(timeout=10)
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


@contextmanager
def warm_starts(env: dict[str, str], gpus: int) -> Iterator[WarmStarts | None]:
    """A server for a local run's stages (None where warm starts are not wanted), closed at the end."""
    if not wanted(gpus):
        yield None
        return
    starts = WarmStarts(env)
    try:
        yield starts
    finally:
        starts.close()
