"""The whole DAG, prepare → cpt → sft → rlhf → evaluate → deploy, on the unmodified `local` profile, through the
command a user types (`python -m workflows.submit korean-llm --local --run-dir DIR`), each stage launched as its pod
launches it (no warm start: each training stage under torchrun with the operator's variables, the others as
`python -m stages <stage>`, as their Argo steps run them): every stage succeeds, MLflow
holds the pipeline run with one nested run per stage, the model is registered and loads back by alias, W&B
offline holds one run per training stage, the builtin lm-eval task is measured and gated, the report is written,
and the training losses go down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from training_fixtures import wandb_offline_runs

from run.run_dir import RunDir
from run.tracking import local_store_uri
from spec.fields import STAGE_ORDER, TRAINING_STAGES
from workflows.launch import LOCAL_TORCHRUN, training_command
from workflows.warm_starts import SERVER, SWITCH

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MODEL = "korean-llm"  # deploy.registered_model of the pipeline


@pytest.fixture(scope="module")
def dag(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """One run of the embedded runner over the whole DAG, on CPU, offline, with its own SQLite tracking store, each
    stage started as its pod starts it."""
    root = tmp_path_factory.mktemp("dag") / "run"
    dropped = ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE", SERVER)  # no shared warm-start server
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        {
            SWITCH: "0",  # every stage a fresh process, as in its pod
            "PYTHONPATH": str(REPO),
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    command = [sys.executable, "-m", "workflows.submit", "korean-llm", "--local", "--run-dir", str(root)]
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=root.parent, capture_output=True, text=True, timeout=1200)
    print(f"\nthe local DAG took {time.monotonic() - started:.0f} s")  # reported, not asserted
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return RunDir(root)


def test_every_stage_succeeded(dag: RunDir) -> None:
    spec = dag.load_spec()
    assert spec.stages.enabled() == list(STAGE_ORDER)  # the profile as shipped: nothing switched off
    for stage in STAGE_ORDER:
        result = dag.read_result(stage)
        assert result is not None and result.status == "succeeded", (stage, result and result.message)
        header = (dag.stage_dir(stage) / "logs" / "stage.log").read_text(encoding="utf-8").splitlines()[0]
        # `===== <time> <argv>`: the pod's argv (training_command; tests/test_launch.py holds it to the manifests)
        argv = header.split(" ", 2)[2].split(" ")
        if stage in TRAINING_STAGES:
            assert argv == training_command(stage, str(dag.root), LOCAL_TORCHRUN), header
        else:
            assert argv == [sys.executable, "-m", "stages", stage, "--run-dir", str(dag.root)], header


def test_training_losses_go_down(dag: RunDir) -> None:
    for stage in ("cpt", "sft"):
        metrics = dag.read_result(stage).metrics
        assert metrics["train_loss_last"] < metrics["train_loss_first"], (stage, metrics)
    for stage in TRAINING_STAGES:  # the generated distributed settings, for the user to read
        distributed = json.loads((dag.stage_dir(stage) / "logs" / "distributed.json").read_text())
        assert distributed["strategy"] == "ddp" and distributed["world_size"] == 1


def test_mlflow_holds_one_pipeline_run_with_a_nested_run_per_stage(dag: RunDir) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(local_store_uri(dag.root))
    experiment = client.get_experiment_by_name(dag.load_spec().tracking.mlflow_experiment)
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("posttrain.kind") == "pipeline"]
    assert parent.info.run_name == dag.root.name
    assert parent.info.status == "FINISHED" and parent.data.tags["posttrain.end_reason"] == "completed"
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in nested) == sorted(STAGE_ORDER)
    assert len(runs) == 1 + len(STAGE_ORDER)
    assert all(r.info.status == "FINISHED" for r in nested)
    for run in nested:
        assert dag.read_result(run.info.run_name).mlflow_run_id == run.info.run_id


def test_the_model_is_registered_and_loads_back_by_alias(dag: RunDir) -> None:
    from mlflow import MlflowClient

    uri = local_store_uri(dag.root)
    client = MlflowClient(uri, registry_uri=uri)
    evaluate, deploy = dag.read_result("evaluate"), dag.read_result("deploy")
    assert evaluate.extra["gate"] == "pass"  # the first run of a registry: against the base model
    challenger = client.get_model_version_by_alias(MODEL, "challenger")
    assert str(challenger.version) == deploy.extra["model_version"]
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == str(challenger.version)
    smoke = deploy.extra["smoke"]  # deploy loaded models:/korean-llm@champion from the registry and generated
    assert smoke["uri"] == f"models:/{MODEL}@champion" and smoke["version"] == str(challenger.version)
    assert int(smoke["new_tokens"]) > 0


def test_wandb_offline_holds_one_run_per_training_stage(dag: RunDir) -> None:
    runs = wandb_offline_runs(dag.root)
    for stage in TRAINING_STAGES:
        (run,) = [r for r in runs if r["job_type"] == stage]
        assert run["group"] == dag.root.name and run["project"] == "korean-llm"
        assert dag.read_result(stage).wandb_run_path == run["dir"]


def test_the_builtin_lm_eval_task_is_measured_and_gated(dag: RunDir) -> None:
    extra = dag.read_result("evaluate").extra
    assert extra["lm_eval_tasks"] == ["ko_constitution_mc"] and extra["errors"] == []
    for who in ("candidate", "base"):  # 60 questions of 4 choices: a share of 60
        assert round(extra[who]["ko_constitution_mc/acc"] * 60, 6).is_integer(), extra[who]
    (check,) = [c for c in extra["gate_checks"] if c["metric"] == "ko_constitution_mc/acc"]
    assert check["passed"] and check["reference"] == extra["base"]["ko_constitution_mc/acc"]


def test_the_report_is_written(dag: RunDir) -> None:
    report = dag.stage_dir("evaluate") / "report"
    assert dag.read_result("evaluate").extra["report"] == "evaluate/report/report.html"
    markdown = (report / "report.md").read_text(encoding="utf-8")
    assert "**Gate: PASS**" in markdown and "- lm-eval tasks: ko_constitution_mc" in markdown
    assert "| ko_constitution_mc/acc | higher |" in markdown  # its gate rule
    assert "| ko_constitution_mc/acc | " in markdown.split("## Metrics", 1)[1]
    # What prepare kept of each stage's data, and the personal data it masked (the bills' office contacts).
    data = markdown.split("## Training data", 1)[1].split("##", 1)[0]
    assert "| cpt | builtin:korean-corpus |" in data and "4 email, 4 phone |" in data, data
    assert (report / "report.html").stat().st_size > 0
