"""A run shared by two reliability modules: one local DAG run that fails mid-DAG and is resubmitted, with fake
secrets in its environment (the resubmission tests and the secrets-at-rest tests read the same run)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from spec.document import LoadedPipeline
from spec.loading import load_pipeline
from workflows.local import run_local

FAKE_SECRETS = {
    "HF_TOKEN": "hf_FAKEreliabilityTOKEN0123456789",
    "WANDB_API_KEY": "FAKEwandbReliabilityKey0123456789abcdef01",
    "MLFLOW_TRACKING_PASSWORD": "FAKE-mlflow-pa55word-reliability",
    "AWS_SECRET_ACCESS_KEY": "FAKEawsSecretAccessKey/reliability+0123",
}
CANARY = ("POSTTRAIN_CANARY_TOKEN", "FAKEcanaryTOKENprintedByTheStage42")
"""A secret that the injected fault prints on purpose, so the log masking is seen at work."""

DAG_OVERRIDES = [
    "stages.rlhf.enabled=false",
    "stages.evaluate.enabled=false",
    "stages.deploy.enabled=false",
    "stages.cpt.training.max_steps=4",
    "stages.cpt.training.save_steps=2",
    "stages.sft.training.max_steps=6",
    "stages.sft.training.save_steps=3",
    "stages.sft.training.logging_steps=1",
]

# Imported by every Python process of the run (it is on PYTHONPATH): prints the canary secret, and with
# CRASH_STAGE set, kills that stage at the end of step CRASH_AT_STEP like the OOM killer would.
_SITECUSTOMIZE = """
import os

if os.environ.get("CRASH_STAGE"):
    try:
        from stages import checkpoints
    except ImportError:
        checkpoints = None
    if checkpoints is not None:
        on_step_end = checkpoints.CheckpointMarker.on_step_end

        def crashing_step_end(self, args, state, control, **kwargs):
            stage = os.path.basename(os.path.dirname(args.output_dir))
            if stage == os.environ["CRASH_STAGE"] and state.global_step == int(os.environ["CRASH_AT_STEP"]):
                print("crashing on purpose; token", os.environ.get("POSTTRAIN_CANARY_TOKEN"), flush=True)
                os._exit(137)
            return on_step_end(self, args, state, control, **kwargs)

        checkpoints.CheckpointMarker.on_step_end = crashing_step_end
"""


@dataclass
class Resubmitted:
    """The run directory and what each of the two runner invocations returned and printed."""

    root: Path
    loaded: LoadedPipeline
    first_code: int
    first_out: str
    second_code: int
    second_out: str
    before: dict[str, str]  # stage → stage.json text after the failed run


_DONE: list[Resubmitted] = []


def resubmitted_dag(tmp_path_factory: pytest.TempPathFactory) -> Resubmitted:
    """`submit --local` of prepare → cpt → sft in which sft dies at step 4 (after checkpoint-3), then the same
    command again; W&B offline and TensorBoard on, fake secrets in the environment. Runs once per session: the
    modules that read it call this from their own fixture."""
    if not _DONE:
        _DONE.append(_resubmit(tmp_path_factory))
    return _DONE[0]


def _resubmit(tmp_path_factory: pytest.TempPathFactory) -> Resubmitted:
    base = tmp_path_factory.mktemp("dag")
    hooks = base / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_SITECUSTOMIZE, encoding="utf-8")
    root = base / "run"
    loaded = load_pipeline("korean-llm", "local", DAG_OVERRIDES)  # wandb_project on: offline W&B files too
    env = {
        **FAKE_SECRETS,
        CANARY[0]: CANARY[1],
        "WANDB_MODE": "offline",
        "PYTHONPATH": str(hooks),
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    saved = {k: os.environ.get(k) for k in (*env, "MLFLOW_TRACKING_URI", "CRASH_STAGE", "CRASH_AT_STEP")}
    capture = pytest.MonkeyPatch()
    try:
        for name, value in env.items():
            capture.setenv(name, value)
        capture.delenv("MLFLOW_TRACKING_URI", raising=False)
        capture.setenv("CRASH_STAGE", "sft")
        capture.setenv("CRASH_AT_STEP", "4")
        first_code, first_out = _run(loaded, root)
        before = {s: (root / s / "stage.json").read_text(encoding="utf-8") for s in ("prepare", "cpt", "sft")}
        capture.delenv("CRASH_STAGE")
        capture.delenv("CRASH_AT_STEP")
        second_code, second_out = _run(loaded, root)
    finally:
        capture.undo()
    assert {k: os.environ.get(k) for k in saved} == saved
    return Resubmitted(root, loaded, first_code, first_out, second_code, second_out, before)


def _run(loaded: LoadedPipeline, root: Path) -> tuple[int, str]:
    """run_local with its console output captured."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_local(loaded, root)
    return code, out.getvalue()
