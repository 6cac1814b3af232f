"""Fault injection for the reliability tests: a stage run in a child process that pauses, or fails, at a chosen
point of its checkpointing, so that a test can kill it there with no race.

The child is `python -m stages` with the hooks of tests/stage_hooks.py (forked from the tests' warm-start server,
which has them, or a fresh script with them), switched on by the environment variables listed there. A paused
child writes `<FAULT_DIR>/held-<what>-<step>` and waits, at most 300 s, for `<FAULT_DIR>/release-<what>-<step>`
(or to be killed).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from training_fixtures import child_env, run_stage, start_stage, wait_for_file

from run.run_dir import RunDir
from run.tracking import local_store_uri
from stages.checkpoints import MARKER, check_safetensors, list_checkpoints, why_invalid
from workflows.warm_starts import WarmProcess


def _fault_vars(run_dir: RunDir, **extra: str) -> dict[str, str | None]:
    # The run's own SQLite store unless the spec names a server.
    return {"FAULT_DIR": str(fault_dir(run_dir)), "MLFLOW_TRACKING_URI": None, **extra}


def fault_env(run_dir: RunDir, **extra: str) -> dict[str, str]:
    """The environment of a fresh stage process with faults (`extra`: the switches)."""
    return child_env(**_fault_vars(run_dir, **extra))


def fault_dir(run_dir: RunDir) -> Path:
    path = run_dir.root.parent / f"{run_dir.root.name}.faults"
    path.mkdir(exist_ok=True)
    return path


def start(run_dir: RunDir, stage: str, **env: str) -> subprocess.Popen[str] | WarmProcess:
    """Start a stage with faults (markers of earlier children cleared); its output goes to
    `<run>.faults/<stage>-<n>.log`."""
    for marker in [*fault_dir(run_dir).glob("held-*"), *fault_dir(run_dir).glob("release-*")]:
        marker.unlink()
    log = fault_dir(run_dir) / f"{stage}-{time.time_ns()}.log"
    process = start_stage(run_dir, stage, log, **_fault_vars(run_dir, **env))
    _LOGS[process.pid] = log
    return process


_LOGS: dict[int, Path] = {}


def output_of(process: subprocess.Popen[str] | WarmProcess) -> str:
    """What a started stage printed so far."""
    return _LOGS[process.pid].read_text(encoding="utf-8", errors="replace")


def run(run_dir: RunDir, stage: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a stage with faults to its end (`args`: more options, e.g. --force)."""
    return run_stage(run_dir, stage, *args, **_fault_vars(run_dir, **env))


def wait_held(run_dir: RunDir, what: str, step: int, process: subprocess.Popen[str] | WarmProcess) -> None:
    """Wait until the child pauses at `what` (before-save, in-save, after-save) of `step`."""
    wait_for_file(fault_dir(run_dir) / f"held-{what}-{step}", process)


def release(run_dir: RunDir, what: str, step: int) -> None:
    (fault_dir(run_dir) / f"release-{what}-{step}").touch()


def sigkill(process: subprocess.Popen[str] | WarmProcess) -> None:
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
