"""Every stage turns a signal or an error it did not expect into a truthful record. Ctrl-C (SIGINT) during training
saves a checkpoint at the end of the step and exits 75 (a second Ctrl-C stops at once); SIGTERM and SIGINT of
evaluate record it interrupted and exit 75; an unexpected error in prepare records it failed with one `error:` line
and the traceback kept; and an outcome already recorded is never overwritten by what comes after it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import faults
import pytest
from training_fixtures import make_run_dir, start_stage, text_rows, wait_for_file, write_jsonl

import stages.prepare
from run.exits import EXIT_FAILED, EXIT_OK, EXIT_RETRYABLE, StageInterrupted
from run.run_dir import RunDir, StageResult, now
from run.tracking import local_store_uri
from spec.lm_eval_tasks import LM_EVAL_TASKS
from spec.loading import load_pipeline
from stages.__main__ import main as stages_main
from stages.builtin_data import write_lm_eval_tasks
from stages.contract import StageContext
from stages.data import BUILTIN_TASKS_DIR

STEPS = 9
OVERRIDES = [
    "stages.sft.enabled=false",
    "stages.rlhf.enabled=false",
    f"stages.cpt.training.max_steps={STEPS}",
    "stages.cpt.training.save_steps=3",
    "stages.cpt.training.logging_steps=1",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A run as prepare leaves it, cpt the candidate that evaluate measures (held-out rows, builtin lm-eval tasks)."""
    root = tmp_path_factory.mktemp("interrupts") / "run"
    run_dir = make_run_dir(root, overrides=OVERRIDES, n_text=60, n_chat=10)
    write_jsonl(root / "prepare/data/evaluate/eval.jsonl", text_rows(8, seed=7))
    write_lm_eval_tasks(LM_EVAL_TASKS, root / BUILTIN_TASKS_DIR)
    return run_dir


def wait_for_output(process: subprocess.Popen[str], text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in faults.output_of(process):
        assert process.poll() is None, faults.output_of(process)[-3000:]
        assert time.monotonic() < deadline, f"{text!r} was not printed"
        time.sleep(0.05)


# --------------------------------------------------------------------------- training: Ctrl-C


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_75_and_twice_stops_at_once(run_dir: RunDir) -> None:
    checkpoints = run_dir.stage_dir("cpt") / "checkpoints"

    # Once: the step in progress ends, its checkpoint is saved, and the stage exits 75 recorded as interrupted.
    child = faults.start(run_dir, "cpt", HOLD_AFTER_SAVE="3")
    faults.wait_held(run_dir, "after-save", 3, child)
    child.send_signal(signal.SIGINT)
    wait_for_output(child, "SIGINT received: saving a checkpoint at the end of this step")
    faults.release(run_dir, "after-save", 3)
    assert child.wait(timeout=120) == EXIT_RETRYABLE, faults.output_of(child)[-3000:]
    assert "Traceback" not in faults.output_of(child)
    assert faults.complete_checkpoints(run_dir, "cpt") == [3, 4]
    first = run_dir.read_result("cpt")
    assert first.status == "interrupted" and "checkpoint-4" in first.message

    # Twice: the second Ctrl-C stops it where it is, without a checkpoint of that step; the record says so.
    child = faults.start(run_dir, "cpt", HOLD_AFTER_SAVE="6")
    faults.wait_held(run_dir, "after-save", 6, child)
    child.send_signal(signal.SIGINT)
    wait_for_output(child, "SIGINT received")
    child.send_signal(signal.SIGINT)  # while it still waits in step 6: no release, no step 7
    assert child.wait(timeout=120) == EXIT_RETRYABLE, faults.output_of(child)[-3000:]
    output = faults.output_of(child)
    assert "SIGINT again: stopping now" in output and "Traceback" not in output
    assert faults.complete_checkpoints(run_dir, "cpt") == [3, 4, 6] and not (checkpoints / "checkpoint-7").exists()
    second = run_dir.read_result("cpt")
    assert second.status == "interrupted" and second.attempts == 2
    assert second.message.startswith("interrupted by SIGINT; running the stage again resumes from its newest")

    # The rerun resumes from checkpoint-6 and logs each step once.
    done = faults.run(run_dir, "cpt")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = run_dir.read_result("cpt")
    assert result.status == "succeeded" and result.extra["resumed_from"] == "checkpoint-6"
    assert faults.metric_steps(run_dir, result.mlflow_run_id) == list(range(1, STEPS + 1))


# --------------------------------------------------------------------------- evaluate: SIGTERM and Ctrl-C


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_evaluate_records_it_interrupted_and_exits_75(run_dir: RunDir, signum: int) -> None:
    import mlflow

    trained = run_dir.read_result("cpt")
    if trained is None or trained.status != "succeeded":  # the Ctrl-C test above did not finish it
        done = faults.run(run_dir, "cpt")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    held = run_dir.root.parent / f"held-{signum}"  # evaluate pauses while it measures the candidate
    log = run_dir.root.parent / f"evaluate-{signum}.log"
    child = start_stage(run_dir, "evaluate", log, HOLD_IN_MEASURE=str(held), MLFLOW_TRACKING_URI=None)
    wait_for_file(held, child)
    attempt = run_dir.read_result("evaluate")
    assert attempt.status == "running"

    child.send_signal(signum)
    assert child.wait(timeout=120) == EXIT_RETRYABLE, log.read_text()[-3000:]
    name = signal.Signals(signum).name
    output = log.read_text()
    assert "Traceback" not in output and f"[evaluate] interrupted by {name}; running the stage again" in output
    result = run_dir.read_result("evaluate")
    assert result.status == "interrupted" and result.message.startswith(f"interrupted by {name}")
    assert result.ended_at is not None and result.attempts == attempt.attempts
    client = mlflow.tracking.MlflowClient(local_store_uri(run_dir.root))
    assert client.get_run(result.mlflow_run_id).info.status == "KILLED"  # not left RUNNING


# --------------------------------------------------------------------------- prepare: an error nobody expected


def test_an_unexpected_error_in_prepare_is_recorded_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = RunDir(tmp_path / "run")
    others = [f"stages.{s}.enabled=false" for s in ("sft", "rlhf", "evaluate", "deploy")]
    run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null", *others]).spec)

    def broken(*args: object) -> None:
        raise KeyError("vocab_size")

    monkeypatch.setattr(stages.prepare, "build_tokenizer_and_caches", broken)
    assert stages_main(["prepare", "--run-dir", str(run_dir.root)]) == EXIT_FAILED
    err = capsys.readouterr().err
    trace = run_dir.stage_dir("prepare") / "logs" / "traceback.txt"
    assert err.strip().splitlines()[-1] == f"[prepare] error: unexpected KeyError: 'vocab_size'; traceback in {trace}"
    assert "in broken" in trace.read_text(encoding="utf-8")
    result = run_dir.read_result("prepare")
    assert result.status == "failed" and result.message.startswith("unexpected KeyError: 'vocab_size'")


# --------------------------------------------------------------------------- records are written while running only


def test_an_outcome_recorded_before_is_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    ctx = StageContext(run_dir, "evaluate", run_dir.load_spec())
    assert ctx.begin()
    assert ctx.finish(extra={"gate": "pass"}) == EXIT_OK
    recorded = run_dir.result_path("evaluate").read_bytes()
    # A signal, or an error, after the record said succeeded (e.g. while the tracker closes its runs).
    assert ctx.interrupted(StageInterrupted(signal.SIGTERM)) == EXIT_RETRYABLE
    try:
        raise RuntimeError("the tracker failed after the record")
    except RuntimeError as exc:
        assert ctx.crash(exc) == EXIT_FAILED
    capsys.readouterr()
    assert run_dir.result_path("evaluate").read_bytes() == recorded
    assert ctx.result.status == "succeeded"


def test_only_the_holder_of_the_lock_writes_the_record(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    ctx = StageContext(run_dir, "deploy", run_dir.load_spec())
    ctx.result = StageResult(stage="deploy", status="running", config_hash=ctx.config_hash, started_at=now())
    with pytest.raises(RuntimeError, match=r"written only by the process holding \.lock"):
        ctx.finish()  # a record without begin(), so without the lock
    assert not run_dir.result_path("deploy").exists()


def test_the_training_handlers_wait_for_the_step_and_give_the_entry_points_back() -> None:
    from run.exits import interrupts_raise
    from stages.checkpoints import SigtermCheckpoint

    with interrupts_raise():
        central = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        checkpoint = SigtermCheckpoint().install()
        try:
            signal.raise_signal(signal.SIGTERM)  # preemption: wait for the end of the step
            signal.raise_signal(signal.SIGINT)  # the first Ctrl-C waits too
            assert checkpoint.requested and checkpoint.signal_name == "SIGTERM"
            with pytest.raises(StageInterrupted) as stopped:
                signal.raise_signal(signal.SIGINT)  # the second stops at once
            assert stopped.value.signum == signal.SIGINT
        finally:
            checkpoint.uninstall()
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == central
        with pytest.raises(StageInterrupted):  # outside training, the entry point's handlers raise at once
            signal.raise_signal(signal.SIGTERM)
