"""The whole DAG, prepare → cpt → sft → rlhf → evaluate → deploy, on the unmodified `local` profile, through the
command a user types (`python -m workflows.submit korean-llm --local --run-dir DIR`), each stage launched as its pod
launches it (no warm start: each training stage under torchrun with the operator's variables, the others as
`python -m stages <stage>`, as their Argo steps run them): every stage succeeds, MLflow
holds the pipeline run with one nested run per stage, the model is registered and loads back by alias, W&B
offline holds one run per training stage, the builtin lm-eval task is measured and gated, the report is written,
the training losses go down, and the real vLLM engine serves the deployed model. It is also korean-llm's run of
tests/test_shipped_pipelines.py: its progress lines, and its gate stopping a candidate that learned nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REAL_VLLM_PYTHON, require_real_vllm
from training_fixtures import wandb_offline_runs
from worse_candidate import assert_the_gate_stopped_it, untrained_overrides

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
    if REAL_VLLM_PYTHON.is_file():  # the serve step with the real engine (test_the_deployed_model_is_served)
        env["POSTTRAIN_VLLM_PYTHON"] = str(REAL_VLLM_PYTHON)
    command = [sys.executable, "-m", "workflows.submit", "korean-llm", "--local", "--run-dir", str(root)]
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=root.parent, capture_output=True, text=True, timeout=1200)
    print(f"\nthe local DAG took {time.monotonic() - started:.0f} s")  # reported, not asserted
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (root.parent / "submit.out").write_text(done.stdout, encoding="utf-8")  # what the user saw
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
    # deploy loaded the model from the registry and generated: as champion, or, where the serve step runs (the real
    # vLLM engine here), as challenger, champion moving once the served model answered
    alias = "challenger" if REAL_VLLM_PYTHON.is_file() else "champion"
    smoke = deploy.extra["smoke"]
    assert smoke["uri"] == f"models:/{MODEL}@{alias}" and smoke["version"] == str(challenger.version)
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


def test_the_progress_lines_are_the_stages_own(dag: RunDir) -> None:
    """No terminal here (as in CI or a pod's log): each training stage's progress lines come as they are printed,
    library noise does not, and the summary is one whole line per stage."""
    said = (dag.root.parent / "submit.out").read_text(encoding="utf-8")
    assert "[profile local]" in said  # the runner said what the profile swapped
    lines = said.splitlines()
    for stage in TRAINING_STAGES:
        assert any(line.startswith(f"[{stage}] step ") and "loss" in line for line in lines), stage
    assert not any(line.startswith(("{'loss'", "{'train_runtime'")) for line in lines)
    assert any(line.split()[:2] == ["deploy", "succeeded"] for line in lines if line.startswith("  deploy "))


def test_the_deployed_model_is_served_by_vllm(dag: RunDir) -> None:
    """The deployed folder (the adapters merged into full weights) served by the real vLLM engine, answering chat
    requests through the family's template; the champion moved only after that."""
    require_real_vllm()
    said = (dag.root.parent / "submit.out").read_text(encoding="utf-8")
    lines = said.splitlines()
    assert any(line.split()[:2] == ["serve", "succeeded"] for line in lines if line.startswith("  serve "))
    deployed = dag.read_result("deploy").extra
    served = deployed["served"]
    assert served["engine"] == "vllm" and served["engine_version"] == "0.32.0", served
    assert served["answers"] and all(a["answer"].strip() for a in served["answers"]), served["answers"]
    assert deployed["promoted"] == "false" and "is champion" in said  # promoted by the serve step, not deploy
    config = json.loads((dag.stage_dir("deploy") / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]


def test_the_gate_stops_a_candidate_that_learned_nothing(
    dag: RunDir, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline again beside the first run (so against the champion it promoted), one step a stage at each
    learning rate divided by 10,000: the gate fails, deploy does not run, --fail-on-gate exits 3. (This run may fork
    its stages from the tests' warm-start server: the launch path is the first run's.)"""
    from workflows.submit import main as submit_main

    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(dag.root.parent)
    worse = dag.root.parent / "worse"
    untrained = untrained_overrides(json.loads((dag.root / "spec.json").read_text()))
    code = submit_main(["korean-llm", "--local", "--run-dir", str(worse), "--fail-on-gate", *untrained])
    said = capsys.readouterr()
    assert code == 3, said.out[-4000:] + said.err[-4000:]
    assert_the_gate_stopped_it(worse)
