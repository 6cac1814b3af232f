"""One stage as a process of the local runner: its command, its output into its log, and how it is stopped.

Each stage is its own process in its own session (a warm-start fork where workflows/warm_starts.py can, else a
fresh one), its output masked into `<stage>/logs/stage.log`; SIGTERM or Ctrl-C to the runner is passed on to the
stage's process group, which saves a checkpoint and exits with 75, and a stage that outlives its grace is killed.
The runner's table shows a `StageRun` per stage (workflows/local.py), and a search's trials too (workflows/search.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from run.exits import StageInterrupted, die_with_runner, interrupt_signal
from run.masking import mask_secrets, secret_values
from run.run_dir import LOCK_FILE, RunDir, now, try_lock
from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec
from workflows.launch import local_launch
from workflows.warm_starts import WarmProcess, WarmStarts

LOG_TAIL_LINES = 25
"""Lines of a stage's output kept for the runner's failure summary."""


@dataclass
class StageRun:
    """The runner's view of one stage: its status, timing, last output line and outcome."""

    name: str
    status: str = "pending"
    started: float | None = None
    ended: float | None = None
    last_line: str = ""
    returncode: int | None = None
    metric: str = ""
    message: str = ""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))

    @property
    def elapsed(self) -> str:
        if self.started is None:
            return ""
        seconds = (self.ended or time.monotonic()) - self.started
        return f"{int(seconds // 60)}:{seconds % 60:04.1f}" if seconds >= 60 else f"{seconds:.1f}s"


def stage_launch(
    spec: PipelineSpec, stage: str, run_root: Path, force: bool, gpus: int, forked: bool
) -> tuple[list[str], dict[str, str]]:
    """The argv of a stage and what it adds to the runner's environment. A training stage starts as its pod starts
    it (workflows/launch.py: torchrun over one process per GPU, one without GPUs, with the container's settings),
    unless it is to be forked from the warm-start server (`forked`: a machine without GPUs, where a stage's
    imports take longer than its training); any other stage runs `python -m stages <stage>`, as its Argo step
    does. `--force` is the runner's own."""
    forced = ["--force"] if force else []
    if stage in TRAINING_STAGES and not forked:
        command, env = local_launch(spec, stage, run_root, gpus)
        return [*command, *forced], env
    return [sys.executable, "-m", "stages", stage, "--run-dir", str(run_root), *forced], {}


def own_line(stage: str, line: str) -> bool:
    """Whether an output line is the stage's own (its progress, `[sft] step 120/500 · loss ... · ETA`, and what it
    reports) rather than a library's (warnings, MLflow's INFO lines, the Trainer's raw dicts)."""
    return line.startswith((f"[{stage}]", "error:", "warning:"))


def _pump(stream: Any, log_file: Any, run: StageRun, echo: Callable[[str], None] | None = None) -> None:
    """Copy a stage's output into its log (secret values masked), remembering the last lines; the stage's own
    lines become the live view's last line, and go to `echo` as they come."""
    secrets = secret_values()
    stage = run.name.split()[0]  # a trial's row is named `<stage> trial n/N`
    for raw in iter(stream.readline, b""):
        if secrets:
            raw = mask_secrets(raw.decode("utf-8", errors="replace"), secrets).encode()
        log_file.write(raw)
        log_file.flush()
        text = raw.decode("utf-8", errors="replace").rstrip()
        line = text.split("\r")[-1].strip() if text else ""
        if line:
            run.tail.append(line)
            if own_line(stage, line):
                run.last_line = line
                if echo is not None:
                    echo(line)


KILL_AFTER_SIGNALS = 3
"""The how-manyth signal to the runner, while it waits for an interrupted stage, kills the stage."""


STOP_GRACE_S = 120.0
"""How long an interrupted stage may take to save and exit before the runner kills it, where the spec does not say
(the runner uses the stage's `run_policy.termination_grace_period_seconds`, as the pod's grace period)."""


def signal_stage(process: subprocess.Popen[bytes] | WarmProcess, signum: int) -> None:
    """Send `signum` to the stage's process group (the stage leads its own session: torchrun's workers and anything
    else it started get it too); to the process alone where the group is gone."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        process.send_signal(signum)  # a no-op once it has exited


def stop_stage(process: subprocess.Popen[bytes] | WarmProcess, signum: int, grace: float = STOP_GRACE_S) -> int:
    """Pass `signum` on to the stage and wait until it has exited (a training stage saves a checkpoint first), at
    most `grace` seconds: then it is killed (SIGKILL to its group). Signals that come while it stops are passed on
    too; the KILL_AFTER_SIGNALS-th kills it. Returns its exit code (negative: killed by that signal)."""
    signals = 1
    signal_stage(process, signum)
    deadline = time.monotonic() + grace
    while True:
        try:
            return process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"the stage did not exit within {grace:g} s of {signal.Signals(signum).name}: killing it", flush=True)
            signal_stage(process, signal.SIGKILL)
            deadline = float("inf")
        except (StageInterrupted, KeyboardInterrupt) as again:
            signals += 1
            if signals >= KILL_AFTER_SIGNALS:
                signal_stage(process, signal.SIGKILL)
            else:
                signal_stage(process, interrupt_signal(again))


def record_interrupted(run_root: Path, stage: str, message: str) -> None:
    """After the stage's process has exited: a record it left `running` (it was killed before it could record how
    it ended) is set to interrupted with `message`, under the stage's lock, so that stage.json tells the truth. A
    record the stage wrote itself is left as it is."""
    handle, _ = try_lock(run_root / stage / LOCK_FILE, f"pid {os.getpid()} (the local runner, recording the stage)")
    if handle is None:  # a process still holds the stage (a worker left behind): it records, not the runner
        return
    try:
        run_dir = RunDir(run_root)
        try:
            result = run_dir.read_result(stage)
        except ValueError:
            return
        if result is None or result.status != "running":
            return
        result.status, result.message, result.ended_at = "interrupted", message, now()
        run_dir.write_result(result)
    finally:
        handle.close()


def run_stage(
    run: StageRun,
    command: list[str],
    env: dict[str, str],
    log_path: Path,
    refresh: Any,
    grace: float = STOP_GRACE_S,
    warm: WarmStarts | None = None,
    echo: Callable[[str], None] | None = None,
) -> int:
    """Run one stage to completion, its output appended to `log_path`; returns its exit code. Interrupted (SIGTERM
    or Ctrl-C to the runner), it passes the signal on, waits for the stage to exit (at most `grace` seconds, then
    kills it), records its exit code in `run` and raises the interruption again. The stage's output is read until
    it exits, so the stage never dies of a broken pipe while it saves. With `warm`, the stage is forked from the
    run's warm-start server where it can be (workflows/warm_starts.py), else started as a fresh process. `echo` gets
    the stage's own output lines as they come (where no terminal shows the live view)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        process: subprocess.Popen[bytes] | WarmProcess | None = warm.start(command, env) if warm else None
        how = "" if process is None else " (warm start, shared server)" if warm and warm.shared else " (warm start)"
        log_file.write(f"===== {started_at} {' '.join(command)}{how}\n".encode())
        log_file.flush()
        if process is None:
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the stage through the runner only, once
                preexec_fn=die_with_runner(),  # only a prctl call runs between fork and exec
            )
        pump = threading.Thread(target=_pump, args=(process.stdout, log_file, run, echo), daemon=True)
        try:
            pump.start()
            while process.poll() is None:
                refresh()
                time.sleep(0.25)
        except (StageInterrupted, KeyboardInterrupt) as exc:
            run.returncode = stop_stage(process, interrupt_signal(exc), grace)  # checkpoint, then EXIT_RETRYABLE
            if pump.ident is not None:
                pump.join(timeout=30)
            raise
        pump.join(timeout=30)
        return process.returncode


PORT_TAKEN = ("EADDRINUSE", "address already in use")
"""What torchrun's store prints when it cannot bind the master's port."""

LAUNCH_ATTEMPTS = 3
"""How often the runner launches a training stage whose master port another process took in the meantime."""


def port_was_taken(run: StageRun, stage: str) -> bool:
    """Whether the stage's process failed because torchrun could not bind the master's port (another process took it
    after the runner chose it), before the stage printed anything of its own: then nothing of the stage ran."""
    lines = list(run.tail)
    return (
        run.returncode not in (0, None)
        and any(marker in line for line in lines for marker in PORT_TAKEN)
        and not any(own_line(stage, line) for line in lines)
    )


def launch_stage(
    run: StageRun,
    spec: PipelineSpec,
    stage: str,
    run_root: Path,
    env: dict[str, str],
    log_path: Path,
    refresh: Any,
    grace: float = STOP_GRACE_S,
    warm: WarmStarts | None = None,
    echo: Callable[[str], None] | None = None,
    force: bool = False,
    gpus: int = 0,
    args: Sequence[str] = (),
) -> int:
    """Start a stage as `stage_launch` says, over the runner's `env`, and run it to completion (`run_stage`); `args`
    are extra arguments of its command (a trial's). A training stage whose master port was taken before torchrun
    bound it (`port_was_taken`) is launched again on another port, up to LAUNCH_ATTEMPTS times. Returns the exit
    code, also recorded in `run`."""
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        command, launch_env = stage_launch(spec, stage, run_root, force, gpus, warm is not None)
        run.tail.clear()
        run.returncode = run_stage(run, [*command, *args], {**env, **launch_env}, log_path, refresh, grace, warm, echo)
        if attempt == LAUNCH_ATTEMPTS or not port_was_taken(run, stage):
            break
        with open(log_path, "ab") as log_file:
            log_file.write(b"===== the master's port was taken before torchrun bound it: launching again\n")
    return run.returncode
