"""Fault injection for the reliability tests: a stage run in a child process that pauses, or fails, at a chosen
point of its checkpointing, so that a test can kill it there with no race.

The child is `python -m stages` (through training_fixtures' runner script, so HOLD_AFTER_CHECKPOINT works too)
with these environment switches, each `<step>`:

    HOLD_BEFORE_SAVE    pause at the end of that step, before its checkpoint is written
    HOLD_IN_SAVE        pause while writing that step's checkpoint: weights written, optimizer, trainer state and
                        the COMPLETE marker not yet (what a pod killed mid-save leaves)
    HOLD_AFTER_SAVE     pause once that step's checkpoint is complete
    ENOSPC_IN_SAVE      fail writing that step's checkpoint with OSError(ENOSPC), after the weights
    ENOSPC_STAGE_JSON   (statuses, comma-separated) fail writing stage.json with OSError(ENOSPC) when it records
                        one of them

A paused child writes `<FAULT_DIR>/held-<what>-<step>` and waits, at most 300 s, for
`<FAULT_DIR>/release-<what>-<step>` (or to be killed).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from training_fixtures import child_env, stage_command, wait_for_file

from stages.checkpoints import MARKER, check_safetensors, list_checkpoints, why_invalid
from stages.contract import RunDir
from stages.tracking import local_store_uri

_HOOKS = """
import errno, os, time
from pathlib import Path

def _step(name):
    value = os.environ.get(name, "")
    return int(value) if value else None

_fault_dir = Path(os.environ.get("FAULT_DIR", "."))

def _hold(what, step):
    (_fault_dir / f"held-{what}-{step}").write_text(str(os.getpid()))
    release, deadline = _fault_dir / f"release-{what}-{step}", time.monotonic() + 300
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)

if any(_step(n) for n in ("HOLD_BEFORE_SAVE", "HOLD_IN_SAVE", "HOLD_AFTER_SAVE", "ENOSPC_IN_SAVE")):
    from transformers import Trainer
    from stages import checkpoints

    save_rest, on_save = Trainer._save_optimizer_and_scheduler, checkpoints.CheckpointMarker.on_save

    def faulty_save_rest(self, output_dir):
        if self.state.global_step == _step("ENOSPC_IN_SAVE"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(output_dir, "optimizer.pt"))
        if self.state.global_step == _step("HOLD_IN_SAVE"):
            _hold("in-save", self.state.global_step)
        return save_rest(self, output_dir)

    def held_step_end(self, args, state, control, **kwargs):
        if state.global_step == _step("HOLD_BEFORE_SAVE"):
            _hold("before-save", state.global_step)
        return control

    def held_on_save(self, args, state, control, **kwargs):
        control = on_save(self, args, state, control, **kwargs)
        if state.global_step == _step("HOLD_AFTER_SAVE"):
            _hold("after-save", state.global_step)
        return control

    Trainer._save_optimizer_and_scheduler = faulty_save_rest
    checkpoints.CheckpointMarker.on_step_end = held_step_end
    checkpoints.CheckpointMarker.on_save = held_on_save

if os.environ.get("ENOSPC_STAGE_JSON"):
    from stages import contract

    write_result = contract.RunDir.write_result

    def full_disk_write_result(self, result):
        if result.status in os.environ["ENOSPC_STAGE_JSON"].split(","):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.result_path(result.stage)))
        return write_result(self, result)

    contract.RunDir.write_result = full_disk_write_result
"""


def fault_script(run_dir: RunDir) -> Path:
    """training_fixtures' runner script with the fault hooks in front of it."""
    runner = Path(stage_command(run_dir, "prepare")[1])
    path = run_dir.root / "run_faulty_stage.py"
    path.write_text(_HOOKS + runner.read_text(encoding="utf-8"), encoding="utf-8")
    return path


def faulty_command(run_dir: RunDir, stage: str) -> list[str]:
    command = stage_command(run_dir, stage)
    command[1] = str(fault_script(run_dir))
    return command


def fault_env(run_dir: RunDir, **extra: str) -> dict[str, str]:
    env = child_env(FAULT_DIR=str(fault_dir(run_dir)), **extra)
    env.pop("MLFLOW_TRACKING_URI", None)  # the run's own SQLite store unless the spec names a server
    return env


def fault_dir(run_dir: RunDir) -> Path:
    path = run_dir.root.parent / f"{run_dir.root.name}.faults"
    path.mkdir(exist_ok=True)
    return path


def start(run_dir: RunDir, stage: str, **env: str) -> subprocess.Popen[str]:
    """Start a stage with faults (markers of earlier children cleared); its output goes to
    `<run>.faults/<stage>-<n>.log`."""
    for marker in [*fault_dir(run_dir).glob("held-*"), *fault_dir(run_dir).glob("release-*")]:
        marker.unlink()
    log = fault_dir(run_dir) / f"{stage}-{time.time_ns()}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            faulty_command(run_dir, stage), env=fault_env(run_dir, **env), stdout=out, stderr=subprocess.STDOUT
        )
    _LOGS[process.pid] = log
    return process


_LOGS: dict[int, Path] = {}


def output_of(process: subprocess.Popen[str]) -> str:
    """What a started stage printed so far."""
    return _LOGS[process.pid].read_text(encoding="utf-8", errors="replace")


def run(run_dir: RunDir, stage: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a stage with faults to its end (`args`: more options, e.g. --force)."""
    return subprocess.run(
        [*faulty_command(run_dir, stage), *args],
        env=fault_env(run_dir, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def wait_held(run_dir: RunDir, what: str, step: int, process: subprocess.Popen[str]) -> None:
    """Wait until the child pauses at `what` (before-save, in-save, after-save) of `step`."""
    wait_for_file(fault_dir(run_dir) / f"held-{what}-{step}", process)


def release(run_dir: RunDir, what: str, step: int) -> None:
    (fault_dir(run_dir) / f"release-{what}-{step}").touch()


def sigkill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)


# --------------------------------------------------------------------------- what a finished stage must leave


def complete_checkpoints(run_dir: RunDir, stage: str) -> list[int]:
    """Steps of the stage's checkpoints that are complete (marker and readable files)."""
    return sorted(
        int(p.name.split("-")[1])
        for p in list_checkpoints(run_dir.stage_dir(stage) / "checkpoints")
        if why_invalid(p) is None
    )


def assert_clean_outputs(run_dir: RunDir, stage: str) -> None:
    """No torn or duplicate output: every checkpoint-<step> is complete, a torn one is only ever kept aside as
    torn-checkpoint-*, the model's safetensors are whole, and no temporary file is left behind."""
    stage_dir = run_dir.stage_dir(stage)
    for checkpoint in list_checkpoints(stage_dir / "checkpoints"):
        assert why_invalid(checkpoint) is None, f"{checkpoint} is torn: {why_invalid(checkpoint)}"
        assert (checkpoint / MARKER).is_file()
    weights = [p for p in (stage_dir / "model").iterdir() if p.suffix == ".safetensors"]
    assert weights, f"{stage_dir / 'model'} has no safetensors"
    for path in weights:
        check_safetensors(path)
    leftovers = [p for p in stage_dir.rglob("*.tmp") if "torn-" not in str(p)]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    assert not [p for p in (stage_dir / "model").iterdir() if p.suffix in (".bin", ".pt", ".pkl", ".pth")]


def mlflow_runs(run_dir: RunDir, stage: str) -> list[str]:
    """Ids of the MLflow runs of a stage in the run's own store."""
    import mlflow

    client = mlflow.tracking.MlflowClient(local_store_uri(run_dir.root))
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, filter_string=f"tags.`posttrain.stage` = '{stage}'")
    return [r.info.run_id for r in found if r.data.tags.get("posttrain.run_dir") == str(run_dir.root)]


def metric_steps(run_dir: RunDir, run_id: str, key: str = "loss") -> list[int]:
    import mlflow

    client = mlflow.tracking.MlflowClient(local_store_uri(run_dir.root))
    return sorted(m.step for m in client.get_metric_history(run_id, key))
