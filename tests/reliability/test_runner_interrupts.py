"""The local runner never leaves its stage training unsupervised. SIGTERM to `python -m workflows.submit ... --local`
(what `timeout` or a CI cancel sends) reaches the stage, which saves a checkpoint and exits 75; the runner waits for
it, shows it interrupted and exits. A SIGKILLed runner takes its stage with it (the stage gets SIGTERM from the
kernel and saves first). Either way the next runner on the run directory resumes the stage alone: its MLflow run
gets one value per step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import faults
import pytest
from training_fixtures import runner_env

from run.run_dir import LOCK_FILE, RunDir
from workflows.warm_starts import alive

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
OPTIONS = [f"--set=stages.{s}.enabled=false" for s in ("sft", "rlhf", "evaluate", "deploy")] + [
    "--set=tracking.wandb_project=null",
    f"--set=stages.cpt.training.max_steps={STEPS}",
    "--set=stages.cpt.training.save_steps=10",
    "--set=stages.cpt.training.logging_steps=1",
]


def runner(run_root: Path, log: Path, shared: bool) -> subprocess.Popen[str]:
    """`python -m workflows.submit korean-llm --local` on `run_root` (prepare and a 40-step cpt): with `shared`, its
    stages fork from the worker's warm-start server (POSTTRAIN_WARM_SERVER), else from a server of the runner's own,
    as for a user who set nothing."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(run_root.parent), "CUDA_VISIBLE_DEVICES": ""}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env = runner_env() if shared else env
    command = [sys.executable, "-m", "workflows.submit", "korean-llm", "--local", f"--run-dir={run_root}", *OPTIONS]
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=run_root.parent, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_until(what: str, ready: Callable[[], bool], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def training_stage(run_dir: RunDir, process: subprocess.Popen[str], after_checkpoint: int) -> int:
    """Wait until the runner's cpt has completed checkpoint-<after_checkpoint>; the pid of the cpt process."""
    marker = run_dir.stage_dir("cpt") / "checkpoints" / f"checkpoint-{after_checkpoint}" / "COMPLETE"
    wait_until(f"{marker} exists", lambda: marker.is_file() or process.poll() is not None)
    assert process.poll() is None, f"the runner ended ({process.returncode}) before {marker}"
    holder = (run_dir.stage_dir("cpt") / LOCK_FILE).read_text(encoding="utf-8")
    pid = int(holder.split()[1])
    assert alive(pid) and pid != process.pid
    return pid


def test_sigterm_or_sigkill_of_the_runner_never_leaves_its_stage_training(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    logs = [tmp_path / f"runner-{n}.log" for n in range(3)]

    # 1. SIGTERM to the runner mid-training: the stage saves and exits 75, the runner waits for it, then exits.
    first = runner(run_dir.root, logs[0], shared=True)
    stage = training_stage(run_dir, first, after_checkpoint=10)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 128 + signal.SIGTERM, logs[0].read_text()
    assert not alive(stage)  # no orphan left training
    output = logs[0].read_text()
    assert "cpt: interrupted" in output and "SIGTERM to the runner; the stage exited with 75" in output
    interrupted = run_dir.read_result("cpt")
    assert interrupted.status == "interrupted" and "SIGTERM" in interrupted.message, interrupted
    saved = faults.complete_checkpoints(run_dir, "cpt")[-1]
    assert 10 < saved < STEPS  # the checkpoint of the step in progress

    # 2. The next runner resumes; SIGKILL to it: the kernel sends the stage SIGTERM, and it saves and stops alone.
    # (A runner of the shared server's, killed: tests/test_warm_starts.py, the connection's server sends it.)
    second = runner(run_dir.root, logs[1], shared=False)
    stage = training_stage(run_dir, second, after_checkpoint=(saved // 10 + 1) * 10)
    second.send_signal(signal.SIGKILL)
    second.wait(timeout=60)
    wait_until("the orphaned stage exits", lambda: not alive(stage), timeout=120)
    killed = run_dir.read_result("cpt")
    assert killed.status == "interrupted" and "SIGTERM" in killed.message, killed  # it did not train on
    assert killed.attempts == 2 and killed.mlflow_run_id == interrupted.mlflow_run_id

    # 3. The third runner finishes it: one MLflow run, one logged loss per step (none trained twice at once).
    third = runner(run_dir.root, logs[2], shared=True)
    assert third.wait(timeout=300) == 0, logs[2].read_text()[-3000:]
    result = run_dir.read_result("cpt")
    assert result.status == "succeeded" and result.attempts == 3
    assert faults.mlflow_runs(run_dir, "cpt") == [result.mlflow_run_id] == [interrupted.mlflow_run_id]
    assert faults.metric_steps(run_dir, result.mlflow_run_id) == list(range(1, STEPS + 1))
    # each runner forked cpt from a warm-start server: the shared one, its own (killing the runner ended that server,
    # and the stage with it), the shared one
    log = (run_dir.stage_dir("cpt") / "logs" / "stage.log").read_text(encoding="utf-8")
    headers = [line.rsplit(" (", 1)[1] for line in log.splitlines() if line.startswith("===== ")]
    assert headers == ["warm start, shared server)", "warm start)", "warm start, shared server)"], headers
    history = json.loads((run_dir.stage_dir("cpt") / "logs" / "log_history.json").read_text())
    assert [e["step"] for e in history if "loss" in e] == list(range(1, STEPS + 1))
