"""MLflow, W&B and TensorBoard as their users expect them: the registered model loads with mlflow.pyfunc and
mlflow.transformers by alias and answers a chat message; an adapter's version names its base; local runs in one
folder share one MLflow store (the gate's champion carries over) and each run says which; training stages log
MLflow's system metrics; W&B honours WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY and a `wandb login`; TensorBoard's tags
are the Trainer's (`train/loss`, `eval/loss`); the local run's summary says where to look.

The candidate is a tiny model built from config (or a LoRA adapter over it), deployed as tests/test_deploy.py
deploys it: no training here."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from test_deploy import make_run, run_deploy
from training_fixtures import wandb_offline_runs

import stages.tracking_wandb as tracking_wandb
from run.run_dir import RunDir
from run.tracking import TRACKING_FILE, local_store_uri, resolve_tracking_uri
from spec.loading import load_pipeline
from stages.contract import StageContext
from stages.registry import download_champion, find_champion, registry_client
from stages.tracking import StageTracker
from workflows.local import where_to_look

mlflow = pytest.importorskip("mlflow")

MODEL = "korean-llm"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("MLFLOW_TRACKING_URI", "ARGO_WORKFLOW_NAME", "ARGO_WORKFLOW_UID", "WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_BASE_URL", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` of this machine counts


def make_ctx(root: Path, stage: str, *overrides: str) -> StageContext:
    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null", *overrides]).spec
    run_dir = RunDir(root)
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, stage, spec)
    assert ctx.begin()
    return ctx


# --------------------------------------------------------------------------- the registered model


def test_the_champion_loads_with_pyfunc_and_transformers_and_answers_a_chat_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = make_run(tmp_path, "run", "pass")
    result = run_deploy(run_dir)
    assert result.extra["smoke"]["output"] and int(result.extra["smoke"]["new_tokens"]) > 0
    uri = run_dir.load_spec().tracking.mlflow_tracking_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@champion")
    (answer,) = model.predict({"messages": [{"role": "user", "content": "서울은 어떤 도시인가요?"}], "max_tokens": 8})
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str) and message["content"]
    assert model.metadata.metadata["posttrain.base_model"] == run_dir.load_spec().model.name_or_path

    import transformers

    pipeline = mlflow.transformers.load_model(f"models:/{MODEL}@champion")
    assert isinstance(pipeline, transformers.TextGenerationPipeline)
    assert pipeline("서울은", max_new_tokens=4, do_sample=False)[0]["generated_text"].startswith("서울은")

    # The gate's champion is measured again from the same registered files (weights and tokenizer in one folder).
    client, _ = registry_client(run_dir.load_spec(), run_dir.root)
    champion = find_champion(client, MODEL)
    assert champion is not None and champion.version == result.extra["model_version"]
    folder = download_champion(client, champion, tmp_path / "champion", uri)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    transformers.AutoModelForCausalLM.from_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(folder)


def test_an_adapters_version_names_its_base_and_keeps_the_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = make_run(tmp_path, "run", "pass", adapter=True)
    result = run_deploy(run_dir)
    spec = run_dir.load_spec()
    client, _ = registry_client(spec, run_dir.root)
    version = client.get_model_version(MODEL, result.extra["model_version"])
    uri = spec.tracking.mlflow_tracking_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    metadata = mlflow.models.get_model_info(f"models:/{MODEL}/{version.version}").metadata
    assert metadata["posttrain.base_model"] == spec.model.name_or_path
    assert metadata["posttrain.model_kind"] == "merged adapter"
    assert version.tags["posttrain.model"] == spec.model.name_or_path
    downloaded = mlflow.artifacts.download_artifacts(
        run_id=version.run_id, artifact_path="adapter", dst_path=str(tmp_path / "dl"), tracking_uri=uri
    )
    adapter = Path(downloaded)
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    assert config["peft_type"] == "LORA" and (adapter / "adapter_model.safetensors").is_file()


# --------------------------------------------------------------------------- the local store


def test_local_runs_in_one_folder_share_one_store_and_each_says_which(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first, second = runs / "korean-llm-a", runs / "korean-llm-b"
    assert local_store_uri(first) == local_store_uri(second) == f"sqlite:///{runs / 'mlflow.db'}"

    ctx = make_ctx(first, "prepare")
    with StageTracker(ctx):
        pass
    recorded = json.loads((first / TRACKING_FILE).read_text(encoding="utf-8"))["mlflow"]
    assert recorded["tracking_uri"] == f"sqlite:///{runs / 'mlflow.db'}"
    assert (runs / "mlflow.db").is_file() and not (first / "mlflow.db").exists()

    # A run keeps the store it recorded (moved next to other runs), and one made with its own database keeps it.
    moved = tmp_path / "elsewhere" / "korean-llm-a"
    moved.parent.mkdir()
    first.rename(moved)
    assert local_store_uri(moved) == recorded["tracking_uri"]
    legacy = tmp_path / "old" / "korean-llm-c"
    legacy.mkdir(parents=True)
    (legacy / "mlflow.db").write_bytes(b"")
    assert local_store_uri(legacy) == f"sqlite:///{legacy / 'mlflow.db'}"
    spec = ctx.spec.model_copy(deep=True)
    spec.tracking.mlflow_tracking_uri = "http://mlflow:5000"
    assert resolve_tracking_uri(spec, legacy) == "http://mlflow:5000"  # a named server always wins


def test_a_training_stage_logs_mlflows_system_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    ctx = make_ctx(tmp_path / "run", "cpt")
    client = mlflow.MlflowClient(local_store_uri(ctx.run_dir.root))
    with StageTracker(ctx) as tracker:
        assert tracker.mlflow.system_metrics is not None
        deadline = time.monotonic() + 60  # waits for the monitor's first batch; asserts nothing about time
        while not any(k.startswith("system/") for k in client.get_run(tracker.run_id).data.metrics):
            assert time.monotonic() < deadline, "no system metrics were logged"
            time.sleep(0.2)
    metrics = client.get_run(ctx.result.mlflow_run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics

    prepare = make_ctx(tmp_path / "run", "prepare")
    with StageTracker(prepare) as tracker:
        assert tracker.mlflow.system_metrics is None  # only the training stages


# --------------------------------------------------------------------------- W&B


def test_wandb_mode_follows_wandb_mode_and_a_wandb_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracking_wandb.wandb_mode() == "offline"  # no key anywhere
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'a' * 40}\n", encoding="utf-8")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))  # what `wandb login` writes
    assert tracking_wandb.wandb_logged_in() and tracking_wandb.wandb_mode() == "online"
    for mode in ("disabled", "offline", "online"):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert tracking_wandb.wandb_mode() == mode
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert tracking_wandb.wandb_mode() == "offline"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    assert tracking_wandb.wandb_mode() == "online"


def test_wandb_disabled_writes_no_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    ctx = make_ctx(tmp_path / "run", "prepare", "tracking.wandb_project=korean-llm")
    with StageTracker(ctx) as tracker:
        assert tracker.wandb is None
    assert not (ctx.run_dir.root / "wandb").exists() and ctx.result.wandb_run_path is None


def test_wandb_project_and_entity_from_the_environment_beat_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=from-spec"]).spec
    assert tracking_wandb.wandb_target(spec) == ("from-spec", spec.tracking.wandb_entity)
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_ENTITY", "my-team")
    assert tracking_wandb.wandb_target(spec) == ("from-env", "my-team")

    # WANDB_PROJECT alone turns W&B on; without a key the run is offline, ready for `wandb sync`.
    ctx = make_ctx(tmp_path / "run", "prepare")
    with StageTracker(ctx):
        pass
    (run,) = wandb_offline_runs(ctx.run_dir.root)
    assert run["project"] == "from-env" and run["job_type"] == "prepare"


def test_deploy_puts_back_the_process_wide_mlflow_uris_and_their_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlflow's setters export MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI to subprocesses: left behind, a later
    stage or runner started from this process would register its model in another store."""
    from stages.deploy import fluent_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    with fluent_uri(f"sqlite:///{tmp_path / 'a.db'}"):
        assert mlflow.get_registry_uri() == f"sqlite:///{tmp_path / 'a.db'}"
    assert "MLFLOW_TRACKING_URI" not in os.environ and "MLFLOW_REGISTRY_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "sqlite:///kept.db")
    with fluent_uri(f"sqlite:///{tmp_path / 'b.db'}"):
        pass
    assert os.environ["MLFLOW_REGISTRY_URI"] == "sqlite:///kept.db" and "MLFLOW_TRACKING_URI" not in os.environ


# --------------------------------------------------------------------------- TensorBoard and the summary


def tensorboard_tags(logs: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return {
        value.tag
        for path in logs.glob("tensorboard/events.out.tfevents.*")
        for event in EventFileLoader(str(path)).Load()
        for value in event.summary.value
    }


def test_tensorboard_tags_are_the_trainers_own(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "run", "cpt")
    with StageTracker(ctx) as tracker:
        tracker.log_metrics({"loss": 2.5, "learning_rate": 1e-4, "eval_loss": 2.4, "candidate/perplexity": 11.0}, 1)
    assert tensorboard_tags(ctx.logs_dir) == {"train/loss", "train/learning_rate", "eval/loss", "candidate/perplexity"}


def test_tensorboard_tags_follow_transformers_rewrite_logs() -> None:
    from transformers.integrations.integration_utils import rewrite_logs

    from stages.tracking_tensorboard import tensorboard_tags as tags

    plain = {"loss": 1.0, "eval_loss": 2.0, "test_accuracy": 3.0, "evaluation": 4.0, "eval_": 5.0, "tests": 6.0}
    assert tags(plain) == rewrite_logs(plain)
    assert tags({**plain, "candidate/perplexity": 7.0}) == {**rewrite_logs(plain), "candidate/perplexity": 7.0}


def test_the_summary_says_where_the_report_mlflow_tensorboard_and_offline_wandb_runs_are(tmp_path: Path) -> None:
    spec = load_pipeline("korean-llm", "local").spec
    run_root = tmp_path / "runs" / "korean-llm-a"
    report = run_root / "evaluate" / "report" / "report.html"
    report.parent.mkdir(parents=True)
    report.write_text("<html></html>", encoding="utf-8")
    record: dict[str, Any] = {"status": "succeeded", "extra": {"report": "evaluate/report/report.html"}}
    (run_root / "evaluate" / "stage.json").write_text(json.dumps(record), encoding="utf-8")
    (run_root / "cpt" / "logs" / "tensorboard").mkdir(parents=True)
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    lines = where_to_look(spec, run_root, uri)
    assert lines == [
        f"Report: {report}",
        f"MLflow UI: mlflow ui --backend-store-uri {uri}",
        f"TensorBoard: tensorboard --logdir {run_root}",
    ]
    (run_root / "wandb" / "offline-run-20260101_000000-abc").mkdir(parents=True)
    sync = f"W&B (offline runs): wandb sync {run_root / 'wandb'}/offline-run-*"
    assert where_to_look(spec, run_root, uri)[-1] == sync
