"""Warm starts: one process imports the stages' libraries once, then forks each stage of a local run from itself.

    python -m stages.warm --socket-fd FD        started by the local runner (workflows/warm_starts.py), never by hand
    python -m stages.warm --listen PATH         a server that local runs share: POSTTRAIN_WARM_SERVER=PATH

A stage process spends most of its start importing torch, transformers, TRL, PEFT, MLflow and W&B (5 to 8 s on a
laptop core, against a second or two of work for a tiny local model); the local runner runs six of them and more
with a search. This server imports them once and forks a child per stage request: the child is what
`python -m stages <stage> ...` would be (the same `stages.__main__.main`, its own session, process id, stdout and
exit code), only without the imports. In a pod, and for torchrun, stages start the usual way.

multiprocessing's forkserver does the forking part, but one per parent process and for its whole life: its
environment is the first caller's, while a local run's stages need the run's own (libraries read some variables,
HF_HUB_OFFLINE for one, when they are imported). A server here is started with a run's stage environment, and the
runner forks from it only for stages whose environment differs from it at most in variables nothing reads at import
(workflows/warm_starts.py: RUNTIME_VARIABLES); an idle server may serve the next run of the same runner process.

The protocol, over a SOCK_SEQPACKET socket pair (one JSON message a packet):
- server → runner: `{"ready": true}` once the imports are done (or `{"ready": false, "error": ...}`);
- runner → server: `{"argv": [...]}` with the stage's stdout and stderr attached (one descriptor for both, or two),
  and `"env": {...}` where the stage's environment is not the server's: it may differ only in variables that are read
  when a stage runs, never at import (its local MLflow store; the tests' fault switches), and `"cwd"`, the
  runner's working directory, which the stage's becomes (a server may outlive the run that started it);
- server → runner: `{"pid": N}` for that request, and `{"exited": N, "returncode": R}` when the child ends (R as
  `subprocess.Popen.returncode`: negative for a signal).

  `{"close": true}` before the runner shuts its end: the server waits for the stages still running, then exits.
  Its end closed without that, the runner is gone: the server sends its stages SIGTERM, as the kernel would.

Children get SIGTERM when the server dies, and the server when the runner dies (Linux `PR_SET_PDEATHSIG`), so a
killed runner still stops its stage the way it does without warm starts (the stage saves and exits).

With `--listen PATH` the server imports once for many runs, of any process of the same user: each runner that
connects to the Unix socket PATH (SOCK_SEQPACKET, mode 0600, the peer's user checked) gets a server of its own, forked
from this one, that speaks the protocol above on that connection. Its ready message also carries the listening
server's environment and `--runtime-variable` names: the runner forks from it only stages whose environment differs
from that one at most in variables read when a stage runs. A runner that dies closes its connection, and its stages
get SIGTERM. Stop the server with SIGTERM or Ctrl-C; its connections' servers and their stages get SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import errno
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import traceback

PRELOAD = (
    "torch",
    "numpy",
    "pyarrow.parquet",
    "datasets",
    "transformers",
    "transformers.trainer",
    "peft",
    "trl",
    "trl.trainer.sft_trainer",
    "trl.trainer.dpo_trainer",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.model_registry.sqlalchemy_store",
    "mlflow.transformers",
    "wandb",
    "wandb.sdk.launch.inputs.internal",  # wandb.init imports it at every start (its Launch inputs), 1-2 s
    "lm_eval.tasks",
    "matplotlib.pyplot",
    "stages.__main__",
    "stages.prepare",
    "stages.cpt",
    "stages.sft",
    "stages.rlhf",
    "stages.evaluate",
    "stages.deploy",
)
"""What the server imports before it forks anything: the libraries every stage imports, and the stages."""

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
MAX_MESSAGE = 1 << 16


def die_with_parent(signum: int) -> None:
    """This process gets `signum` when its parent dies; exits at once where the parent is already gone."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(75)


def send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode("utf-8"))


def preload() -> None:
    """Import PRELOAD, fill the caches every stage would fill again, and freeze what there is for the children."""
    from stages.float8 import quiet_torchao_import

    quiet_torchao_import()
    for name in PRELOAD:
        importlib.import_module(name)
    # MLflow maps modules to the installed packages once per process, reading every package's metadata (about a
    # second), when deploy logs the model with its requirements: once here, not in every deploy.
    from mlflow.utils import requirements_utils

    fill_package_map = getattr(requirements_utils, "_init_packages_to_modules_map", None)  # private: may go away
    if fill_package_map is not None:
        fill_package_map()
    # The imports' objects stay for the process's life: frozen, a child's garbage collections skip them (a full
    # collection over them takes about 0.4 s, and accelerate runs one after each training) and leave their pages
    # shared with the server.
    gc.freeze()


class CurrentStream:
    """Writes to whatever `sys.<name>` is when it writes: a log handler made in the server, which holds the server's
    stream object, then goes through the stage's masking (stages/__main__.py) as it would in a fresh process."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(text)

    def flush(self) -> None:
        getattr(sys, self.name).flush()


def follow_current_streams() -> None:
    """Point the log handlers the imports made at the current sys.stdout/sys.stderr."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
                continue
            name = "stderr" if handler.stream is sys.stderr else "stdout" if handler.stream is sys.stdout else ""
            if name and not isinstance(type(handler).__dict__.get("stream"), property):  # not logging's lastResort
                handler.setStream(CurrentStream(name))


def run_child(request: dict, output_fds: list[int], sock: socket.socket) -> None:
    """In the forked child: become `python -m stages <request's argv>` writing to `output_fds` (stdout and stderr,
    or one for both), in the request's `env` and `cwd` where given, then exit with its code."""
    argv = request["argv"]
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the server's: its fd is closed here, and the number may be reused
        sock.close()
        os.setsid()  # its own session, as the runner starts every stage: signals reach it only through the runner
        die_with_parent(signal.SIGTERM)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output_fds[0], 1)
        os.dup2(output_fds[-1], 2)
        for fd in (devnull, *output_fds):
            os.close(fd)
        # The signal dispositions of a fresh interpreter (the server set its own).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        if "env" in request:
            os.environ.clear()
            os.environ.update(request["env"])
        if "cwd" in request:
            os.chdir(request["cwd"])
        follow_current_streams()
        import numpy

        numpy.random.seed()  # a fresh interpreter's numpy draws its seed from the OS; a fork would share the server's
        from stages.__main__ import main

        sys.argv = [sys.modules["stages.__main__"].__file__, *argv]
        sys.modules["__main__"] = sys.modules["stages.__main__"]  # what `python -m stages` runs as __main__
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()  # as the interpreter would (fd 2 is the stage's output from the first lines on)
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (W&B and MLflow flush there)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def reap(sock: socket.socket, children: set[int]) -> None:
    """Tell the runner of every child that has exited."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> int:
    """Answer fork requests until the runner closes its end; then wait for the children still running, having sent
    them SIGTERM where the runner went without saying `close` (it died)."""
    children: set[int] = set()
    closing = False
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup pipe
    while True:
        ready, _, _ = select.select([sock, wakeup_r], [], [])
        if wakeup_r in ready:
            os.read(wakeup_r, 512)
        reap(sock, children)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except ConnectionResetError:
            data, fds = b"", []
        if not data:  # the runner is done (or gone)
            for fd in fds:
                os.close(fd)
            break
        request = json.loads(data)
        if request.get("close"):
            closing = True
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(wakeup_r)
            os.close(wakeup_w)
            run_child(request, fds, sock)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        send(sock, {"pid": pid})
    for pid in list(children):
        if not closing:  # the runner is gone: its stages save and stop, as when the runner's own server dies with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    for pid in list(children):
        os.waitpid(pid, 0)
    return 0


def bind(address: str) -> socket.socket:
    """A listening SOCK_SEQPACKET socket at `address`, readable and writable by this user alone. A socket file left
    by a server that is gone is replaced; one that a server still listens on is not (OSError)."""
    if os.path.exists(address):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(address)
        except ConnectionRefusedError:
            os.unlink(address)  # what a killed server left
        else:
            raise OSError(errno.EADDRINUSE, f"a warm-start server already listens at {address}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    umask = os.umask(0o177)
    try:
        listener.bind(address)
    finally:
        os.umask(umask)
    listener.listen(16)
    return listener


def same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of `conn` runs as this process's user (Linux SO_PEERCRED)."""
    credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid == os.getuid()


def listen(address: str, runtime_variables: list[str]) -> int:
    """Serve the runners that connect to `address`, each with a server of its own forked from this one, until
    SIGTERM or SIGINT."""
    env = dict(os.environ)  # before the imports, which set variables of their own
    listener = bind(address)  # before the imports: a runner that connects meanwhile waits for its ready message
    stop = signal.getsignal(signal.SIGINT)

    def stopped(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopped)
    connections: set[int] = set()
    try:
        try:
            preload()
        except Exception as exc:  # the runners that connected see the connection close, and start their own
            print(f"error: the warm-start server could not import: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            ready, _, _ = select.select([listener, wakeup_r], [], [])
            if wakeup_r in ready:
                os.read(wakeup_r, 512)
            while connections:  # reap the servers of connections that ended
                pid, _status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                connections.discard(pid)
            if listener not in ready:
                continue
            conn, _ = listener.accept()
            if not same_user(conn):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:  # this connection's server
                code = 1
                try:
                    signal.set_wakeup_fd(-1)
                    for fd in (wakeup_r, wakeup_w):
                        os.close(fd)
                    listener.close()
                    for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, stop)):
                        signal.signal(signum, default)
                    die_with_parent(signal.SIGTERM)
                    send(conn, {"ready": True, "env": env, "runtime_variables": runtime_variables})
                    code = serve(conn)
                finally:
                    os._exit(code)
            conn.close()
            connections.add(pid)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.warm", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket-fd", type=int, help="The runner's end of a SOCK_SEQPACKET pair.")
    where.add_argument("--listen", metavar="PATH", help="Serve the local runs that have POSTTRAIN_WARM_SERVER=PATH.")
    parser.add_argument(
        "--runtime-variable",
        action="append",
        default=[],
        metavar="NAME",
        help="With --listen: a variable the stages read only when they run (never at import), in which a run's "
        "environment may differ from the server's. Repeat for more.",
    )
    args = parser.parse_args(argv)
    if args.listen:
        try:
            return listen(args.listen, args.runtime_variable)
        except OSError as exc:
            print(f"error: {args.listen}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    sock = socket.socket(fileno=args.socket_fd)
    die_with_parent(signal.SIGTERM)
    try:
        preload()
    except Exception as exc:  # the runner starts its stages the usual way and says why
        send(sock, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    send(sock, {"ready": True})
    return serve(sock)


if __name__ == "__main__":
    sys.exit(main())
