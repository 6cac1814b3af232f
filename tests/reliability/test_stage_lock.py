"""One process at a time runs a stage: the process itself holds `<stage>/.lock` (a flock the kernel releases when
the process dies), so a second process on the same stage (a stage started by hand, an Argo retry while the old
pod still runs, a rank 0 of another torchrun job) is refused with one `error:` line and exit 75, and writes
nothing; once the holder is gone (even SIGKILLed) the lock is free and the next attempt resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import faults
import pytest
from test_parameters import _params_dir
from training_fixtures import REPO, child_env, make_run_dir, stage_script

from run.exits import EXIT_RETRYABLE
from run.run_dir import LOCK_FILE, RunDir, StageBusy, hold_stage_lock, holds_stage_lock
from spec.loading import load_pipeline
from stages.__main__ import main as stages_main
from stages.contract import StageContext

STEPS = 6
OVERRIDES = [
    "stages.sft.enabled=false",
    f"stages.cpt.training.max_steps={STEPS}",
    "stages.cpt.training.save_steps=3",
    "stages.cpt.training.logging_steps=1",
]

_HOLDER = """
import sys
from run.run_dir import RunDir, hold_stage_lock
hold_stage_lock(RunDir(sys.argv[1]), sys.argv[2])
print("held", flush=True)
sys.stdin.read()
"""


@contextmanager
def held_by_another_process(run_dir: RunDir, stage: str) -> Iterator[subprocess.Popen[str]]:
    """The stage's lock, held by a child process until the block ends (or the child is killed)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir.root), stage],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait(timeout=30)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (TensorBoard's event files apart: their writer flushes on its own schedule)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "tensorboard" not in p.parts and not p.name.startswith("mlflow.db")
    }


# --------------------------------------------------------------------------- in one process, against a holder


def test_a_held_stage_refuses_before_reading_or_writing_its_record(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    with held_by_another_process(run_dir, "evaluate") as holder:
        lock = run_dir.stage_dir("evaluate") / LOCK_FILE
        assert lock.read_text(encoding="utf-8").startswith(f"pid {holder.pid} on ")
        run_dir.stage_dir("evaluate").joinpath("stage.json").write_text("not even a record", encoding="utf-8")
        before = snapshot(run_dir.root)
        ctx = StageContext(run_dir, "evaluate", run_dir.load_spec())
        with pytest.raises(StageBusy, match=rf"\[evaluate\] is being run by another process \(pid {holder.pid} on "):
            ctx.begin()  # the record is not even read (this one is garbage): the lock comes first
        assert snapshot(run_dir.root) == before and ctx.result is None
        assert not holds_stage_lock(run_dir, "evaluate")
    # The holder is gone (killed): the lock is free, and this process takes it (again and again: a no-op).
    hold_stage_lock(run_dir, "evaluate")
    assert hold_stage_lock(run_dir, "evaluate") == lock.resolve() and holds_stage_lock(run_dir, "evaluate")
    assert lock.read_text(encoding="utf-8").startswith(f"pid {os.getpid()} on ")


def test_a_busy_stage_exits_75_with_one_error_line_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    run_dir.stage_dir("prepare").mkdir(parents=True)
    with held_by_another_process(run_dir, "prepare") as holder:
        before = snapshot(run_dir.root)
        refused = subprocess.run(
            [sys.executable, "-m", "stages", "prepare", "--run-dir", str(run_dir.root)],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode == EXIT_RETRYABLE, refused.stderr
        lines = [line for line in (refused.stdout + refused.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            f"error: [prepare] is being run by another process (pid {holder.pid}"
        )
        assert "run the stage again" in lines[0]
        assert snapshot(run_dir.root) == before  # no record, no log, no traceback, the holder's lock file as it was


def test_a_second_prepare_pod_does_not_rewrite_the_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the cluster prepare writes spec.json from the form's parameters: only while it holds prepare's lock."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    params = _params_dir(tmp_path, {"overrides": "stages.sft.training.learning_rate=1e-4"})
    with held_by_another_process(run_dir, "prepare"):
        before = snapshot(run_dir.root)
        argv = ["prepare", "--run-dir", str(run_dir.root), "--params-dir", str(params)]
        assert stages_main([*argv, "--outputs-dir", str(tmp_path / "outputs")]) == EXIT_RETRYABLE
        assert "error: [prepare] is being run by another process" in capsys.readouterr().err
        assert snapshot(run_dir.root) == before and not (tmp_path / "outputs").exists()


# --------------------------------------------------------------------------- two trainers on one stage


@pytest.mark.slow
def test_a_second_trainer_is_refused_and_the_stage_resumes_after_the_first_is_killed(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", overrides=OVERRIDES, n_text=60, n_chat=10)
    first = faults.start(run_dir, "cpt", HOLD_AFTER_SAVE="3")
    faults.wait_held(run_dir, "after-save", 3, first)
    running = run_dir.read_result("cpt")
    assert running.status == "running"
    before = snapshot(run_dir.stage_dir("cpt"))

    # Started by hand (or by a retry) while the first trains: refused, nothing written, the record stays the first's.
    second = faults.run(run_dir, "cpt")
    assert second.returncode == EXIT_RETRYABLE, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"error: [cpt] is being run by another process (pid {first.pid} on " in second.stderr
    assert "Traceback" not in second.stderr + second.stdout
    assert snapshot(run_dir.stage_dir("cpt")) == before
    assert run_dir.read_result("cpt") == running

    # SIGKILL: the kernel drops the lock with the process. The record still says running: a dead attempt, resumed.
    faults.sigkill(first)
    done = faults.run(run_dir, "cpt")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = run_dir.read_result("cpt")
    assert result.status == "succeeded" and result.attempts == 2 and result.extra["resumed_from"] == "checkpoint-3"
    assert faults.metric_steps(run_dir, result.mlflow_run_id) == list(range(1, STEPS + 1))  # each step once
    faults.assert_clean_outputs(run_dir, "cpt")


@pytest.mark.slow
def test_under_torchrun_rank_0_is_refused_and_no_rank_writes(tmp_path: Path) -> None:
    """Every rank of a job runs the stage; rank 0 takes the lock. Refused, it exits 75, torchrun stops the other
    rank, and neither has written anything (the other ranks never write records, and wait for rank 0 before they
    touch the run directory)."""
    overrides = [*OVERRIDES, "stages.cpt.training.per_device_batch_size=2"]
    run_dir = make_run_dir(tmp_path / "run", overrides=overrides, n_text=40, n_chat=10)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command = [*launcher, str(stage_script(run_dir.root)), "cpt", "--run-dir", str(run_dir.root)]
    with held_by_another_process(run_dir, "cpt"):
        before = snapshot(run_dir.root)
        # Rank 1 waits in the process group's rendezvous (C++, where Python's signal handlers wait too) until
        # torchrun, seeing rank 0 fail, stops it: SIGTERM, then SIGKILL after this many seconds.
        env = child_env(OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5")
        refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        output = refused.stdout + refused.stderr
        assert refused.returncode != 0, output[-3000:]
        assert "error: [cpt] is being run by another process" in output
        assert "exitcode  : 75" in output  # rank 0's status, as torchrun reports the first failure
        assert snapshot(run_dir.root) == before
        assert not run_dir.result_path("cpt").exists()
