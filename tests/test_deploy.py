"""The deploy stage: registry versions and aliases decided by evaluate's gate, lineage tags, the model loaded back
from the registry by alias, the InferenceService file, publishing to object storage, and a skipped run.

The candidate here is a tiny model built from config (or a LoRA adapter over it) written as a training stage
writes it; evaluate's decision is written as evaluate records it. No training: these tests are about deploy.
Publishing goes through the real boto3 and google-cloud-storage clients to moto's S3 server and a GCS emulator
on 127.0.0.1 (tests/object_stores.py), configured only through the environment, as in a pod."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from object_stores import MotoS3, ObjectStore
from safetensors.torch import load_file
from training_fixtures import make_run_dir

import stages.deploy as deploy
from run.config_hash import config_hash
from run.exits import EXIT_FAILED
from run.run_dir import RunDir, StageRefused, StageResult
from stages.contract import StageContext
from stages.modeling import build_from_config, load_tokenizer, model_fingerprint
from stages.registry import registered_files

CANDIDATE = {"perplexity": 12.5, "eval_loss": 2.53}
CLOUD_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST",
)  # fmt: skip
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("MLFLOW_TRACKING_URI", "ARGO_WORKFLOW_NAME", "ARGO_WORKFLOW_UID", *CLOUD_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    # Cloud credentials come only from what a test sets: none from this machine's files or metadata services.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def record(
    run_dir: RunDir,
    stage: str,
    extra: dict[str, Any],
    status: str = "succeeded",
    inputs: dict[str, tuple[str, str]] | None = None,
) -> None:
    """A stage's stage.json as the stage itself leaves it (`inputs`: name → (uri, fingerprint))."""
    ctx = StageContext(run_dir, stage, run_dir.load_spec())
    assert ctx.begin()
    for name, (uri, fingerprint) in (inputs or {}).items():
        ctx.add_input(name, uri, fingerprint)
    ctx.finish(extra=extra, status=status)  # type: ignore[arg-type]


def make_run(
    tmp_path: Path,
    name: str,
    gate: str,
    adapter: bool = False,
    champion_version: str = "",
    overrides: tuple[str, ...] = (),
) -> RunDir:
    """A run in which cpt left a model (full, or a LoRA adapter over the base) and evaluate measured it (its
    content fingerprint, as cpt recorded it) and decided `gate`; every run of a test shares one MLflow database
    (one registry)."""
    tracking = f"tracking.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = ("stages.sft.enabled=false", "stages.rlhf.enabled=false", tracking, *overrides)
    run_dir = make_run_dir(tmp_path / name, overrides, n_text=40, n_chat=8)
    spec = run_dir.load_spec()
    record(
        run_dir,
        "prepare",
        {"fingerprint": "sha256:data", "tokenizer_hash": "sha256:tok", "data": {"cpt": {"fingerprint": "sha256:cpt"}}},
    )
    tokenizer = load_tokenizer(run_dir, spec.model)
    model = build_from_config(spec.model, tokenizer)
    cpt = StageContext(run_dir, "cpt", spec)  # the stage begins before it writes its model, as cpt does
    assert cpt.begin()
    out = run_dir.stage_dir("cpt") / "model"
    if adapter:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
        with torch.no_grad():  # a trained adapter is not zero: make merging visible in the weights
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.fill_(0.01)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    kind = "adapter" if adapter else "full"
    fingerprint = model_fingerprint(out)
    extra = {"model_kind": kind, "base": spec.model.name_or_path, "base_kind": "from_config"}
    cpt.finish(extra={**extra, "model_fingerprint": fingerprint})
    reasons = [
        f"perplexity: candidate 12.5 vs base model 40 (lower is better): {'holds' if gate == 'pass' else 'fails'}"
    ]
    record(
        run_dir,
        "evaluate",
        {
            "gate": gate,
            "gate_reasons": reasons,
            "candidate": CANDIDATE,
            "base": {"perplexity": 40.0},
            "champion": {},
            "champion_version": champion_version,
            "candidate_stage": "cpt",
            "reference": "base model",
        },
        inputs={"candidate": ("cpt/model", fingerprint)},
    )
    return run_dir


def run_deploy(run_dir: RunDir) -> StageResult:
    ctx = StageContext(run_dir, "deploy", run_dir.load_spec(), outputs_dir=run_dir.root / "outputs")
    assert deploy.run(ctx) == 0, (run_dir.read_result("deploy") or StageResult).message
    result = run_dir.read_result("deploy")
    assert result is not None
    return result


def registry(run_dir: RunDir) -> Any:
    from mlflow import MlflowClient

    uri = run_dir.load_spec().tracking.mlflow_tracking_uri
    return MlflowClient(uri, registry_uri=uri)


def aliases(run_dir: RunDir) -> dict[str, str]:
    return {k: str(v) for k, v in registry(run_dir).get_registered_model("korean-llm").aliases.items()}


def test_a_passing_gate_moves_champion_and_a_failing_gate_only_challenger(tmp_path: Path) -> None:
    first = make_run(tmp_path, "run-a", "pass")
    result = run_deploy(first)
    assert result.status == "succeeded" and result.extra["promoted"] == "true"
    assert result.extra["model_version"] == "1" and result.extra["aliases"] == ["challenger", "champion"]
    assert aliases(first) == {"champion": "1", "challenger": "1"}
    assert (first.root / "outputs" / "promoted").read_text() == "true"

    second = make_run(tmp_path, "run-b", "fail", champion_version="1")
    result = run_deploy(second)
    assert result.status == "succeeded" and result.extra["promoted"] == "false"
    assert "as challenger only" in result.message and "champion stays at 1" in result.message
    assert aliases(second) == {"champion": "1", "challenger": "2"}

    third = make_run(tmp_path, "run-c", "pass", champion_version="1")
    run_deploy(third)
    assert aliases(third) == {"champion": "3", "challenger": "3"}


def test_the_model_loads_back_from_the_registry_by_alias_and_generates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    run_dir = make_run(tmp_path, "run", "pass")
    result = run_deploy(run_dir)
    smoke = result.extra["smoke"]
    assert smoke["uri"] == "models:/korean-llm@champion" and smoke["version"] == "1" and int(smoke["new_tokens"]) > 0

    monkeypatch.setenv("MLFLOW_TRACKING_URI", run_dir.load_spec().tracking.mlflow_tracking_uri)
    downloaded = mlflow.artifacts.download_artifacts("models:/korean-llm@challenger", dst_path=str(tmp_path / "dl"))
    path = registered_files(Path(downloaded))  # an MLflow transformers model: weights in model/
    files = {p.name for p in path.iterdir()}
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert not {f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))}  # safetensors only
    served, trained = (
        load_file(path / "model.safetensors"),
        load_file(run_dir.stage_dir("cpt") / "model/model.safetensors"),
    )
    assert served.keys() == trained.keys() and all(torch.equal(served[k], trained[k]) for k in served)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("서울은", return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_an_adapter_is_merged_into_its_base_before_it_is_registered(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "run", "pass", adapter=True)
    result = run_deploy(run_dir)
    assert result.extra["model_kind"] == "adapter"
    model_dir = run_dir.stage_dir("deploy") / "model"
    weights = load_file(model_dir / "model.safetensors")
    assert not any("lora" in k for k in weights) and not (model_dir / "adapter_config.json").exists()
    spec = run_dir.load_spec()
    base = build_from_config(spec.model, load_tokenizer(run_dir, spec.model)).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[name], base[name])  # the adapter's update is in the weights
    assert int(result.extra["smoke"]["new_tokens"]) > 0


def test_lineage_tags_and_the_inference_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARGO_WORKFLOW_NAME", "korean-llm-x7k2p")
    monkeypatch.setenv("ARGO_WORKFLOW_UID", "0b7c2f5e-uid")
    run_dir = make_run(tmp_path, "korean-llm-x7k2p", "pass")
    result = run_deploy(run_dir)
    assert result.extra["smoke"] == {}  # in the cluster there is no smoke generation on the deploy pod
    # In the cluster the serve step moves champion after its smoke check (workflows/rollout.py); deploy does not.
    assert aliases(run_dir) == {"challenger": "1"} and result.extra["promoted"] == "false"
    assert "champion moves to it once the serve step's smoke check passes" in result.message

    version = registry(run_dir).get_model_version("korean-llm", result.extra["model_version"])
    tags = version.tags
    spec = run_dir.load_spec()
    assert tags["argo.workflow.name"] == "korean-llm-x7k2p" and tags["argo.workflow.uid"] == "0b7c2f5e-uid"
    assert tags["posttrain.run"] == "korean-llm-x7k2p" and tags["posttrain.pipeline"] == "korean-llm"
    assert (
        tags["posttrain.data_fingerprint"] == "sha256:data" and tags["posttrain.data.cpt.fingerprint"] == "sha256:cpt"
    )
    assert tags["posttrain.parent_stages"] == "prepare,cpt,evaluate"
    for stage in ("prepare", "cpt", "evaluate"):
        assert tags[f"posttrain.stage.{stage}.config_hash"] == config_hash(spec, stage)
    assert tags["posttrain.gate"] == "pass" and "perplexity: candidate 12.5" in tags["posttrain.gate_reasons"]
    assert float(tags["posttrain.metric.perplexity"]) == CANDIDATE["perplexity"]
    assert version.run_id == result.mlflow_run_id  # the deploy run holds the model files and the metrics
    assert registry(run_dir).get_run(version.run_id).data.metrics["perplexity"] == CANDIDATE["perplexity"]

    isvc = yaml.safe_load((run_dir.stage_dir("deploy") / "inferenceservice.yaml").read_text(encoding="utf-8"))
    claim = spec.cluster.checkpoints.claim_name
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == f"pvc://{claim}/runs/korean-llm-x7k2p/deploy/model"
    assert isvc["metadata"]["annotations"]["posttrain.dev/model-version"] == result.extra["model_version"]
    assert result.extra["storage_uri"] == isvc["spec"]["predictor"]["model"]["storageUri"]


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "adapter"])
def test_deploy_refuses_a_model_that_differs_from_what_evaluate_measured(tmp_path: Path, adapter: bool) -> None:
    """cpt/model rewritten after evaluate measured it (a stage rerun by hand, a copy over it): deploy publishes and
    registers nothing, and says what to do; cpt's own record is rewritten too, so only evaluate's record can tell."""
    run_dir = make_run(tmp_path, "run", "pass", adapter=adapter)
    model_dir = run_dir.stage_dir("cpt") / "model"
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    from safetensors.torch import save_file

    tensors = load_file(model_dir / weights)
    save_file({k: v + 0.01 for k, v in tensors.items()}, model_dir / weights)
    cpt = run_dir.read_result("cpt")
    cpt.extra["model_fingerprint"] = model_fingerprint(model_dir)
    run_dir.write_result(cpt)
    measured = run_dir.read_result("evaluate").inputs["candidate"].fingerprint

    ctx = StageContext(run_dir, "deploy", run_dir.load_spec(), outputs_dir=run_dir.root / "outputs")
    with pytest.raises(StageRefused) as refused:
        deploy.run(ctx)
    message = str(refused.value)
    assert message.startswith("[deploy] cpt/model is not the model evaluate measured: its files hash to ")
    assert f"evaluate/stage.json records {measured}" in message and "python -m stages evaluate" in message
    result = run_dir.read_result("deploy")
    assert result.status == "failed" and result.message == message
    assert not (run_dir.stage_dir("deploy") / "model").exists()
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):  # nothing registered: not even the registered model was created
        registry(run_dir).get_registered_model("korean-llm")


def test_deploy_records_and_tags_what_it_registered(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "run", "pass")
    result = run_deploy(run_dir)
    candidate = run_dir.read_result("evaluate").inputs["candidate"]
    assert result.inputs["candidate"] == candidate  # held to (and recorded as) what evaluate measured
    assert result.extra["model_fingerprint"] == model_fingerprint(run_dir.stage_dir("deploy") / "model")
    tags = registry(run_dir).get_model_version("korean-llm", result.extra["model_version"]).tags
    assert tags["posttrain.model_fingerprint"] == result.extra["model_fingerprint"]
    assert tags["posttrain.candidate_fingerprint"] == candidate.fingerprint


def test_a_skipped_evaluation_deploys_nothing(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    from spec.loading import load_pipeline

    run_dir.write_spec(load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec)
    record(run_dir, "evaluate", {"gate": "skipped"}, status="skipped")
    result = run_deploy(run_dir)
    assert result.status == "skipped" and "nothing to deploy" in result.message
    assert not (run_dir.stage_dir("deploy") / "model").exists()


# --------------------------------------------------------------------------- publishing

RUN = "korean-llm-x7k2p"


@pytest.fixture(params=["s3", "gcs"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each object store in turn, empty, with the deploy stage pointed at it."""
    return request.getfixturevalue(request.param)


def deploy_in_pod(run_dir: RunDir) -> int:
    """The deploy step as the pod runs it (no smoke generation in the cluster)."""
    return deploy.run(StageContext(run_dir, "deploy", run_dir.load_spec(), outputs_dir=run_dir.root / "outputs"))


def assert_one_error(run_dir: RunDir, err: str, starts: str) -> str:
    """deploy failed with one `error:` line that starts with `starts` and no traceback; returns the line."""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"[deploy] error: {starts}"), err
    assert "Traceback" not in err and not (run_dir.stage_dir("deploy") / "logs" / "traceback.txt").exists()
    result = run_dir.read_result("deploy")
    assert result is not None and result.status == "failed" and f"[deploy] error: {result.message}" == errors[0]
    return errors[0]


def test_deploy_publishes_every_model_file_to_the_store_and_no_credential(
    tmp_path: Path, store: ObjectStore, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARGO_WORKFLOW_NAME", RUN)
    store.create_bucket("models")
    uri = f"{store.scheme}://models/korean-llm/"
    run_dir = make_run(tmp_path, RUN, "pass", overrides=(f"stages.deploy.storage_uri={uri}",))
    assert deploy_in_pod(run_dir) == 0
    result = run_dir.read_result("deploy")
    assert result is not None and result.status == "succeeded"

    model_dir = run_dir.stage_dir("deploy") / "model"
    files = deploy.model_files(model_dir)
    expected = {f"models/korean-llm/{RUN}/{rel.as_posix()}": (model_dir / rel).read_bytes() for rel in files}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {key.rsplit("/", 1)[1] for key in expected}
    assert store.objects() == expected  # every file, byte for byte, under <storage_uri>/<run>, and nothing else
    served = f"{store.scheme}://models/korean-llm/{RUN}"
    isvc = yaml.safe_load((run_dir.stage_dir("deploy") / "inferenceservice.yaml").read_text(encoding="utf-8"))
    assert result.extra["storage_uri"] == served == isvc["spec"]["predictor"]["model"]["storageUri"]

    out, err = capfd.readouterr()
    mlflow_run = registry(run_dir).get_run(result.mlflow_run_id).data
    assert mlflow_run.params["storage_uri"] == served
    version = registry(run_dir).get_model_version("korean-llm", result.extra["model_version"])
    recorded = [out, err, *mlflow_run.params.values(), *mlflow_run.tags.values(), *version.tags.values()]
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]  # stage.json, logs, MLflow's database
    for name in CREDENTIALS:  # the GCS emulator takes anonymous credentials: nothing to leak there
        if name in store.env:
            secret = store.env[name]
            assert not any(secret in text for text in recorded), name
            assert not any(secret.encode() in data for data in written), name


def test_a_bucket_that_does_not_exist_fails_deploy_with_one_error(
    tmp_path: Path, store: ObjectStore, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARGO_WORKFLOW_NAME", RUN)
    uri = f"{store.scheme}://no-such-bucket/korean-llm"
    run_dir = make_run(tmp_path, RUN, "pass", overrides=(f"stages.deploy.storage_uri={uri}",))
    assert deploy_in_pod(run_dir) == EXIT_FAILED
    line = assert_one_error(run_dir, capfd.readouterr().err, f"stages.deploy.storage_uri ({uri}/{RUN}): uploading ")
    assert line.endswith("the bucket does not exist; create it, or correct the bucket name")
    assert store.objects() == {}


def test_credentials_without_write_access_fail_deploy_with_one_error(
    tmp_path: Path, s3: MotoS3, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARGO_WORKFLOW_NAME", RUN)
    uri = "s3://models/korean-llm"
    run_dir = make_run(tmp_path, RUN, "pass", overrides=(f"stages.deploy.storage_uri={uri}",))
    s3.create_bucket("models")
    with s3.read_only_keys() as keys:
        for name, value in keys.items():
            monkeypatch.setenv(name, value)
        assert deploy_in_pod(run_dir) == EXIT_FAILED
    err = capfd.readouterr().err
    line = assert_one_error(run_dir, err, f"stages.deploy.storage_uri ({uri}/{RUN}): uploading s3://models/")
    assert "(AccessDenied: " in line and "give the pod's AWS identity s3:PutObject on the bucket" in line
    assert keys["AWS_SECRET_ACCESS_KEY"] not in err + run_dir.result_path("deploy").read_text(encoding="utf-8")
    assert s3.objects() == {}


def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "sub" / "tokenizer.json").write_text("{}")
    return folder


def test_weights_larger_than_one_request_arrive_intact(tmp_path: Path, store: ObjectStore) -> None:
    """Above 8 MiB boto3 uploads in parts and google-cloud-storage resumably: how a real model's weights go."""
    from spec.loading import load_pipeline

    store.create_bucket("models")
    folder = model_dir(tmp_path)
    weights = random.Random(0).randbytes(9 * 2**20)
    (folder / "model.safetensors").write_bytes(weights)
    spec = load_pipeline("korean-llm", None).spec
    deploy.publish(spec, folder, f"{store.scheme}://models/korean-llm/run-1", tmp_path / "run")
    assert store.objects() == {
        "models/korean-llm/run-1/model.safetensors": weights,
        "models/korean-llm/run-1/sub/tokenizer.json": b"{}",
    }


def test_the_s3_endpoint_variable_wins_over_the_general_one(
    tmp_path: Path, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boto3 reads both standard variables; AWS_ENDPOINT_URL_S3 is the one for S3 alone."""
    from spec.loading import load_pipeline

    spec = load_pipeline("korean-llm", None).spec
    s3.create_bucket("models")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    deploy.publish(spec, model_dir(tmp_path), "s3://models/korean-llm/run-1", tmp_path / "run")
    assert s3.objects() == {
        "models/korean-llm/run-1/model.safetensors": b"weights",
        "models/korean-llm/run-1/sub/tokenizer.json": b"{}",
    }


def test_publish_says_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spec.loading import load_pipeline

    spec = load_pipeline("korean-llm", None).spec
    folder = model_dir(tmp_path)
    # No keys, no config files, no instance metadata (the `_env` fixture): boto3 finds no credentials.
    with pytest.raises(deploy.PublishError, match="no AWS credentials were found in the environment"):
        deploy.publish(spec, folder, "s3://models/x", tmp_path / "run")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    with pytest.raises(deploy.PublishError, match="no usable Google credentials were found"):
        deploy.publish(spec, folder, "gs://models/x", tmp_path / "run")
    monkeypatch.setitem(sys.modules, "boto3", None)  # not installed
    with pytest.raises(deploy.PublishError, match="needs boto3"):
        deploy.publish(spec, folder, "s3://models/x", tmp_path / "run")
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
    monkeypatch.delattr("google.cloud.storage", raising=False)  # imported by the tests above
    with pytest.raises(deploy.PublishError, match="needs google-cloud-storage"):
        deploy.publish(spec, folder, "gs://models/x", tmp_path / "run")
    with pytest.raises(deploy.PublishError, match="names a claim deploy does not mount"):
        deploy.publish(spec, folder, "pvc://other-claim/models/x", tmp_path / "run")
