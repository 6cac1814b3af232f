"""Preemption: SIGTERM during training saves a checkpoint within 30 s and exits with the retryable status; the
compiled workflow's retry (a fresh PyTorchJob running the same entry point) then resumes from it. Also under
torchrun, as the pods run it: SIGTERM to the launcher reaches every rank, which all save the same checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
import yaml
from training_fixtures import child_env, make_run_dir, stage_script

from run.exits import EXIT_RETRYABLE
from spec.loading import load_pipeline
from stages.checkpoints import MARKER, why_invalid
from workflows.compile import compile_pipeline
from workflows.launch import training_command

pytestmark = pytest.mark.slow

STEPS = 9
OVERRIDES = [
    "stages.cpt.enabled=false",  # sft starts from the base model
    f"stages.sft.training.max_steps={STEPS}",
    "stages.sft.training.save_steps=3",
    "stages.sft.training.logging_steps=1",
]
GRACE_SECONDS = 30


def test_the_compiled_retry_reruns_the_same_entry_point() -> None:
    """What the simulated retry below stands for: Argo retries the step with a fresh PyTorchJob whose pods run
    `python -m stages sft --run-dir <the same run directory>` (through torchrun)."""
    loaded = load_pipeline("korean-llm")
    template = compile_pipeline(loaded.spec).documents()["workflowtemplate.yaml"]
    templates = {t["name"]: t for t in template["spec"]["templates"]}
    sft = templates["sft"]  # an attempt: reap the stage's unfinished jobs (on a retry), create a job, wait on it
    assert sft["retryStrategy"]["retryPolicy"] == "Always" and int(sft["retryStrategy"]["limit"]) >= 1
    assert [step["template"] for group in sft["steps"] for step in group] == ["sft-cleanup", "sft-create", "sft-wait"]
    create = templates["sft-create"]
    assert create["resource"]["action"] == "create"  # every retry creates a fresh job
    command = training_command("sft", "/mnt/checkpoints/runs/{{workflow.name}}")
    assert command[1:] == ["--module", "stages", "sft", "--run-dir", "/mnt/checkpoints/runs/{{workflow.name}}"]
    pod = yaml.safe_load(create["resource"]["manifest"])["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["containers"][0]["command"] == command
    grace = loaded.spec.stages.sft.run_policy.termination_grace_period_seconds
    assert pod["terminationGracePeriodSeconds"] == grace >= GRACE_SECONDS


def test_sigterm_checkpoints_within_30s_exits_75_and_the_retry_resumes(tmp_path) -> None:
    run_dir = make_run_dir(tmp_path / "run", overrides=OVERRIDES, n_text=20, n_chat=60)
    checkpoints = run_dir.stage_dir("sft") / "checkpoints"

    child = faults.start(run_dir, "sft", HOLD_AFTER_SAVE="3")
    faults.wait_held(run_dir, "after-save", 3, child)
    child.send_signal(signal.SIGTERM)  # the kubelet's SIGTERM, mid-training
    sent = time.monotonic()
    faults.release(run_dir, "after-save", 3)
    code = child.wait(timeout=120)
    elapsed = time.monotonic() - sent
    assert code == EXIT_RETRYABLE, faults.output_of(child)[-3000:]
    assert elapsed < GRACE_SECONDS, f"{elapsed:.1f}s from SIGTERM to exit"
    assert (checkpoints / "checkpoint-4" / MARKER).is_file()  # saved at the end of the step in progress
    interrupted = run_dir.read_result("sft")
    assert interrupted.status == "interrupted" and "checkpoint-4" in interrupted.message
    assert "SIGTERM received" in faults.output_of(child)

    retry = faults.run(run_dir, "sft")  # the retry's fresh pod: the same entry point, the same run directory
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    result = run_dir.read_result("sft")
    assert result.status == "succeeded" and result.attempts == 2
    assert result.extra["resumed_from"] == "checkpoint-4" and result.metrics["steps"] == STEPS
    assert result.mlflow_run_id == interrupted.mlflow_run_id
    assert faults.mlflow_runs(run_dir, "sft") == [result.mlflow_run_id]
    faults.assert_clean_outputs(run_dir, "sft")


# --------------------------------------------------------------------------- under torchrun

TORCHRUN_STEPS = 6
TORCHRUN_OVERRIDES = [
    "stages.sft.enabled=false",
    f"stages.cpt.training.max_steps={TORCHRUN_STEPS}",
    "stages.cpt.training.save_steps=3",
    "stages.cpt.training.logging_steps=1",
    "stages.cpt.training.per_device_batch_size=2",
]

# Runs a stage script and writes each rank's exit status to $EXIT_CODES/rank-<RANK> (torchrun does not report its
# workers' statuses when it was itself signalled).
_EXIT_RECORDER = """
import os, runpy, sys
from pathlib import Path

script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exc:
    Path(os.environ["EXIT_CODES"], "rank-" + os.environ["RANK"]).write_text(str(exc.code))
    raise
"""


def torchrun(run_dir, script: Path, stage: str) -> list[str]:
    """The pods' launcher: torchrun with two processes on this machine (DDP over gloo on CPU)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return [*launcher, str(script), stage, "--run-dir", str(run_dir.root)]


def test_sigterm_to_torchrun_checkpoints_on_every_rank_and_the_retry_resumes(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", overrides=TORCHRUN_OVERRIDES, n_text=160, n_chat=10)
    checkpoints = run_dir.stage_dir("cpt") / "checkpoints"
    recorder, codes = tmp_path / "record_exit.py", tmp_path / "exit-codes"
    recorder.write_text(_EXIT_RECORDER, encoding="utf-8")
    codes.mkdir()
    command = torchrun(run_dir, recorder, "cpt")
    command.insert(command.index("cpt"), str(stage_script(run_dir.root)))
    # The pod's environment: torchrun gives its workers this long after forwarding SIGTERM before it kills them.
    env = faults.fault_env(
        run_dir, OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60", HOLD_AFTER_SAVE="3", EXIT_CODES=str(codes)
    )
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    faults.wait_held(run_dir, "after-save", 3, launcher)
    launcher.send_signal(signal.SIGTERM)  # the kubelet signals the container's main process: torchrun
    faults.release(run_dir, "after-save", 3)
    code = launcher.wait(timeout=180)
    output = log.read_text(encoding="utf-8", errors="replace")
    workers = sorted(p.read_text() for p in codes.iterdir())
    print(f"torchrun exited with {code} after SIGTERM; its workers with {workers}")

    # torchrun re-raises the signal as an error (status 1 with torch 2.13): non-zero, so the job fails and Argo
    # retries it. Each rank saved the same checkpoint and exited with the stage's retryable status.
    assert code != 0, output[-3000:]
    assert "Received 15 death signal, shutting down workers" in output
    assert output.count("SIGTERM received") == 2
    assert {p.name: p.read_text() for p in codes.iterdir()} == {"rank-0": "75", "rank-1": "75"}
    assert why_invalid(checkpoints / "checkpoint-4") is None  # complete: marker and readable files
    interrupted = run_dir.read_result("cpt")
    assert interrupted.status == "interrupted" and "checkpoint-4" in interrupted.message

    # The retry: a fresh launcher, the same entry point and run directory.
    retry = subprocess.run(
        torchrun(run_dir, stage_script(run_dir.root), "cpt"),
        env=child_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    result = run_dir.read_result("cpt")
    assert result.status == "succeeded" and result.attempts == 2
    assert result.extra["resumed_from"] == "checkpoint-4" and result.metrics["steps"] == TORCHRUN_STEPS
    assert result.mlflow_run_id == interrupted.mlflow_run_id
    faults.assert_clean_outputs(run_dir, "cpt")
    distributed = json.loads((run_dir.stage_dir("cpt") / "logs" / "distributed.json").read_text())
    assert distributed["world_size"] == 2 and distributed["ddp_backend"] == "gloo"
    assert distributed["strategy"] == "ddp" and distributed["parallel_mode"] == "distributed"
