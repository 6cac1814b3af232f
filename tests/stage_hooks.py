"""Test hooks in a stage process: pause, or fail, at a chosen point of its checkpointing, so that a test can signal
or kill it there with no race. Each hook is off unless its environment variable is set when the point is reached,
so they are installed once, in the tests' warm-start server (training_fixtures) or in a fresh stage script, and a
stage without the variables runs exactly as in the product. Each `<step>`:

    HOLD_AFTER_CHECKPOINT   pause once that step's checkpoint is complete, until the stage gets SIGTERM or SIGINT
    HOLD_BEFORE_SAVE        pause at the end of that step, before its checkpoint is written
    HOLD_IN_SAVE            pause while writing that step's checkpoint: weights written, optimizer, trainer state and
                            the COMPLETE marker not yet (what a pod killed mid-save leaves)
    HOLD_AFTER_SAVE         pause once that step's checkpoint is complete
    ENOSPC_IN_SAVE          fail writing that step's checkpoint with OSError(ENOSPC), after the weights
    ENOSPC_STAGE_JSON       (statuses, comma-separated) fail writing stage.json with OSError(ENOSPC) when it records
                            one of them
    HOLD_IN_MEASURE         (a path) evaluate writes it when it measures the candidate (inside its MLflow run), then
                            waits there until it is signalled
    KILL_PREPARE_WORKER     (a batch number) a worker process of prepare (never the stage's own process) kills itself
                            with SIGKILL, as the OOM killer would, when it starts that batch of rows of its own; each
                            worker writes `<FAULT_DIR>/worker-<pid>` at its first batch, the killed one
                            `<FAULT_DIR>/killed-<pid>` just before it dies, once a second worker has written its
                            file (at most 60 s)

The HOLD_*_SAVE and HOLD_IN_SAVE pauses write `<FAULT_DIR>/held-<what>-<step>` and wait, at most 300 s, for
`<FAULT_DIR>/release-<what>-<step>` (or to be killed).
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

SWITCHES = (
    "HOLD_AFTER_CHECKPOINT",
    "HOLD_BEFORE_SAVE",
    "HOLD_IN_SAVE",
    "HOLD_AFTER_SAVE",
    "ENOSPC_IN_SAVE",
    "ENOSPC_STAGE_JSON",
    "HOLD_IN_MEASURE",
    "KILL_PREPARE_WORKER",
    "FAULT_DIR",
)
"""The variables the hooks read, each when its point is reached: a stage forked from a server that has the hooks
may differ from the server's environment in them."""


def _step(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value else None


def _hold(what: str, step: int) -> None:
    fault_dir = Path(os.environ.get("FAULT_DIR", "."))
    (fault_dir / f"held-{what}-{step}").write_text(str(os.getpid()))
    release, deadline = fault_dir / f"release-{what}-{step}", time.monotonic() + 300
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def install() -> None:
    """Patch the trainer's checkpointing and the stage record with the hooks (each off until its variable is set)."""
    from transformers import Trainer

    import stages.evaluate
    import stages.prepared_data
    from run.run_dir import RunDir
    from stages import checkpoints

    save_rest, on_save = Trainer._save_optimizer_and_scheduler, checkpoints.CheckpointMarker.on_save
    step_end = checkpoints.CheckpointMarker.on_step_end
    handle, write_result = checkpoints.SigtermCheckpoint._handle, RunDir.write_result
    measure = stages.evaluate.measure_loaded
    process_rows = stages.prepared_data.process_rows
    woken: list[int] = []
    started_batches: dict[int, int] = {}  # per process: forked workers start from their parent's count

    def faulty_save_rest(self: Any, output_dir: str) -> Any:
        if self.state.global_step == _step("ENOSPC_IN_SAVE"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(output_dir, "optimizer.pt"))
        if self.state.global_step == _step("HOLD_IN_SAVE"):
            _hold("in-save", self.state.global_step)
        return save_rest(self, output_dir)

    def held_step_end(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        result = step_end(self, args, state, control, **kwargs)
        if state.global_step == _step("HOLD_BEFORE_SAVE"):
            _hold("before-save", state.global_step)
        return result

    def held_on_save(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control = on_save(self, args, state, control, **kwargs)
        if state.global_step == _step("HOLD_AFTER_SAVE"):
            _hold("after-save", state.global_step)
        if state.global_step == _step("HOLD_AFTER_CHECKPOINT"):
            print("holding after checkpoint", state.global_step, flush=True)
            deadline = time.monotonic() + 300
            while not woken and time.monotonic() < deadline:
                time.sleep(0.05)
        return control

    def waking_handle(self: Any, signum: int, frame: Any) -> None:
        handle(self, signum, frame)
        woken.append(signum)

    def full_disk_write_result(self: Any, result: Any) -> Any:
        if result.status in os.environ.get("ENOSPC_STAGE_JSON", "").split(","):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.result_path(result.stage)))
        return write_result(self, result)

    def held_measure(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("HOLD_IN_MEASURE"):
            Path(os.environ["HOLD_IN_MEASURE"]).write_text(str(os.getpid()))
            while True:
                time.sleep(0.05)
        return measure(*args, **kwargs)

    def killed_process_rows(batch: Any) -> Any:
        if os.environ.get("KILL_PREPARE_WORKER") and multiprocessing.parent_process() is not None:
            started = started_batches[os.getpid()] = started_batches.get(os.getpid(), 0) + 1
            if started == 1:
                (Path(os.environ.get("FAULT_DIR", ".")) / f"worker-{os.getpid()}").touch()
            if started == _step("KILL_PREPARE_WORKER"):
                # a worker fast enough to reach its batch before a sibling starts waits for one (at most 60 s), so
                # that the test knows every worker, to find none left behind
                fault_dir, deadline = Path(os.environ.get("FAULT_DIR", ".")), time.monotonic() + 60
                while len(list(fault_dir.glob("worker-*"))) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                (fault_dir / f"killed-{os.getpid()}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return process_rows(batch)

    Trainer._save_optimizer_and_scheduler = faulty_save_rest
    checkpoints.CheckpointMarker.on_step_end = held_step_end
    checkpoints.CheckpointMarker.on_save = held_on_save
    checkpoints.SigtermCheckpoint._handle = waking_handle
    RunDir.write_result = full_disk_write_result
    stages.evaluate.measure_loaded = held_measure
    stages.prepared_data.process_rows = killed_process_rows


_INSTALLED = (
    f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nimport stage_hooks\nstage_hooks.install()\n"
)
"""Python source that installs the hooks in a new interpreter."""


def script() -> str:
    """A script that runs `python -m stages <args>` with the hooks: a fresh stage process, usable by torchrun; a
    torchrun rank with warm ranks asked for forks its stage from the tests' warm-start server instead
    (tests/warm_ranks.py), before any import of the stages'."""
    forked = (
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\nimport warm_ranks\n"
        "if (code := warm_ranks.forked(sys.argv[1:])) is not None:\n    warm_ranks.end_as(code)\n"
    )
    return "import sys\n" + forked + _INSTALLED + "from stages.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"


def server_command() -> list[str]:
    """The tests' warm-start server: stages/warm.py with the hooks installed before it forks any stage. Its
    environment is put back as it started before the server's main runs: the hooks' imports set variables
    (torch's inductor its cache directory), and a listening server tells runners the environment it started with."""
    started = "import os\nstarted_with = dict(os.environ)\n"
    restored = "os.environ.clear()\nos.environ.update(started_with)\n"
    return [sys.executable, "-c", started + _INSTALLED + restored + "from stages.warm import main\nsys.exit(main())\n"]
