"""Preemption: SIGTERM during training saves a checkpoint within 30 s and exits with the retryable status; the
compiled workflow's retry (a fresh PyTorchJob running the same entry point) then resumes from it."""

from __future__ import annotations

import signal
import time

import faults
import pytest
import yaml
from training_fixtures import make_run_dir

from stages.checkpoints import MARKER
from stages.contract import EXIT_RETRYABLE
from workflows.compile import compile_pipeline
from workflows.loading import load_pipeline
from workflows.pytorchjob import stage_command

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
    (sft,) = [t for t in template["spec"]["templates"] if t["name"] == "sft"]
    assert sft["retryStrategy"]["retryPolicy"] == "Always" and int(sft["retryStrategy"]["limit"]) >= 1
    assert sft["resource"]["action"] == "create"  # every retry creates a fresh job
    command = stage_command("sft", "/mnt/checkpoints/runs/{{workflow.name}}")
    assert command[1:] == ["--module", "stages", "sft", "--run-dir", "/mnt/checkpoints/runs/{{workflow.name}}"]
    pod = yaml.safe_load(sft["resource"]["manifest"])["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
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
