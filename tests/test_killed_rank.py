"""One rank of a two-process training stage is killed mid-training (SIGKILL, as the OOM killer or a lost node
does it); the stage launched again as its pod is launched (torchrun over `python -m stages`, the Training
Operator's variables: workflows/launch.py) resumes from the newest complete checkpoint, with the data order and
the random state restored: every loss after the checkpoint is the one an uninterrupted run logs. Two CPU processes
over gloo; bench/resume_gpu.py runs the same on GPUs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from training_fixtures import child_env, make_run_dir

from run.run_dir import RunDir
from stages.checkpoints import MARKER
from stages.training import read_log_history
from workflows.launch import local_launch

PLAN = [
    "stages.cpt.training.max_steps=10",
    "stages.cpt.training.save_steps=2",
    "stages.cpt.training.logging_steps=1",
]


def launch(run_dir: RunDir) -> subprocess.Popen[str]:
    """cpt as its pod starts it, two processes on this node."""
    command, env = local_launch(run_dir.load_spec(), "cpt", run_dir.root, 2)
    return subprocess.Popen(command, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rank_process(agent: int, local_rank: int) -> int | None:
    """The pid of `local_rank` among the torchrun agent's children (their environment says which rank)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == agent and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(entry.name)
    return None


def losses(run_dir: RunDir) -> dict[int, float]:
    history = read_log_history(run_dir.stage_dir("cpt") / "logs/log_history.json")
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


@pytest.mark.slow
def test_a_killed_rank_relaunched_as_the_pod_resumes_where_an_uninterrupted_run_would_be(tmp_path: Path) -> None:
    reference = make_run_dir(tmp_path / "uninterrupted", PLAN, n_text=120, n_chat=10)
    killed = RunDir(tmp_path / "killed")
    shutil.copytree(reference.root, killed.root)

    whole = launch(reference)
    attempt = launch(killed)
    marker = killed.stage_dir("cpt") / "checkpoints" / "checkpoint-2" / MARKER
    deadline = time.monotonic() + 240
    while not marker.is_file() and attempt.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = rank_process(attempt.pid, 1)
    assert victim is not None, attempt.communicate()[0][-3000:]
    os.kill(victim, signal.SIGKILL)
    output = attempt.communicate(timeout=120)[0]
    assert attempt.returncode != 0, output[-3000:]  # the group went down with its rank
    assert "SIGKILL" in output or "Signal 9" in output, output[-3000:]
    interrupted = killed.read_result("cpt")
    assert interrupted is not None and interrupted.status != "succeeded"

    again = launch(killed)
    output = again.communicate(timeout=300)[0]
    assert again.returncode == 0, output[-3000:]
    assert whole.wait(timeout=300) == 0, whole.communicate()[0][-3000:]

    result = killed.read_result("cpt")
    assert result is not None and result.status == "succeeded" and result.attempts == 2
    resumed_at = result.extra["resumed_from_step"]
    assert 2 <= resumed_at < 10 and result.extra["resumed_from"] == f"checkpoint-{resumed_at}"
    assert result.metrics["steps"] == 10
    expected, got = losses(reference), losses(killed)
    assert sorted(got) == sorted(expected) == list(range(1, 11))
    after = {step: got[step] for step in got if step > resumed_at}
    assert after and after == {step: expected[step] for step in after}  # bit-identical on CPU
