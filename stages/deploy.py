"""The deploy stage: register the candidate, move the aliases, publish the model, render its InferenceService.

    python -m stages deploy --run-dir DIR

Reads top to bottom:

1. evaluate's stage.json: the candidate stage, the gate decision and the numbers behind it. A run that evaluate
   skipped (data unchanged) is skipped here too. deploy only runs after gate=pass, in the cluster and under
   --local; run by hand after a failed gate, it registers the model as `challenger` only, says so and tags the
   version `posttrain.gate_overridden=true`.
2. The model as it is served: full weights in safetensors with the tokenizer, in `deploy/model/` (an adapter is
   merged into its base first). The candidate's folders must be exactly what evaluate measured: their content
   fingerprints (read as the files are copied or loaded) are held to evaluate's recorded inputs `candidate` and
   `candidate_base`; anything else is refused before a byte is published or registered.
3. Published where the InferenceService reads it (run/serving.py): gs:// (google-cloud-storage) or s3://
   (boto3) under `<storage_uri>/<run>`, with credentials from the environment only (Workload Identity / Google
   ADC, AWS_* or a web identity; AWS_ENDPOINT_URL(_S3) for an S3-compatible store, STORAGE_EMULATOR_HOST for a
   GCS emulator), a refusal (no such bucket, access denied) being one error that names the field; pvc:// on the
   checkpoints claim by a copy, into a folder strictly inside the volume and outside `runs/` (never over a run
   directory); by default the run directory on the checkpoints volume itself.
4. The MLflow Model Registry: the model is logged on deploy's run (with the candidate's metrics) by
   `mlflow.transformers.log_model` as a chat model (task `llm/v1/chat`; its MLmodel names the base model, and for
   an adapter, merged first, what it was trained on; the adapter's own files go to the run's `adapter/`), so that
   `mlflow.pyfunc.load_model("models:/<name>@champion")` and `mlflow.transformers.load_model` load it. A new
   version of the registered model (deploy.registered_model, else the pipeline name) is created from it with
   lineage tags, alias `challenger` points at it, and `champion` moves to it only when the gate passed. In the
   cluster with serving on, `champion` moves later, in the serve step, once the served model answered its smoke
   check (workflows/rollout.py), and under --local likewise where vLLM serves it (workflows/local_serving.py);
   here it moves only where nothing is served.
5. `deploy/inferenceservice.yaml`: the KServe InferenceService for the vLLM runtime at the model's storage.
6. Outside the cluster (no ARGO_WORKFLOW_NAME): the model is loaded back from the registry by alias with
   `mlflow.pyfunc.load_model` (`models:/<name>@champion`, or `@challenger` when not promoted) and answers one chat
   message; recorded in stage.json.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from run.names import RUN_ROOT
from run.release import CHALLENGER, CHAMPION, GATE_PASS, GATE_SKIPPED
from run.run_dir import RunDir, StageRefused
from run.serving import LOCAL_SERVE_VARIABLE, inference_service, model_storage_uri, to_yaml
from spec.fields import STAGE_ORDER
from spec.pipeline import PipelineSpec
from stages.contract import StageContext
from stages.data import DataError, within
from stages.entry import run_stage
from stages.registry import HELDOUT_TAG, METRIC_TAG_PREFIX, registered_model_name, registry_client
from stages.sources import gcs_client, s3_client

if TYPE_CHECKING:
    from stages.modeling import ModelInputs

MAX_TAG_VALUE = 5000  # MLflow's limit for a model version tag value
MODEL_FILES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken")
"""What is published of a model directory: weights in safetensors, configs and tokenizer files; never pickles."""
CHAT_TASK = "llm/v1/chat"
"""The MLflow task the model is registered with: chat messages in, an OpenAI-style chat completion out."""
SMOKE_PROMPT = "안녕하세요"
SMOKE_TOKENS = 16


class PublishError(RuntimeError):
    """The model cannot be published to the storage the spec names (a library or credentials missing)."""


# --------------------------------------------------------------------------- the evaluated candidate


def evaluation(run_dir: RunDir) -> dict[str, Any]:
    """evaluate's record: its status and extra (gate, candidate_stage, candidate metrics, ...)."""
    result = run_dir.read_result("evaluate")
    if result is None or result.status not in ("succeeded", "skipped"):
        state = "has not run" if result is None else f"is {result.status}"
        raise StageRefused(
            f"evaluate {state} in {run_dir.root}: deploy needs its gate decision; "
            f"run it first: python -m stages evaluate --run-dir {run_dir.root}"
        )
    return {"status": result.status, "message": result.message, **result.extra}


# --------------------------------------------------------------------------- the model as served


def export_model(run_dir: RunDir, spec: PipelineSpec, stage: str, out: Path, inputs: ModelInputs) -> tuple[str, str]:
    """Write the candidate as full safetensors weights with its tokenizer into `out`; returns what the stage
    left ('full' copied, or 'adapter' merged into its base) and the content fingerprint of `out`. `inputs`
    (stages.modeling.ModelInputs, measured_by evaluate) holds the candidate's folders to what evaluate measured:
    a full model is hashed as it is copied (the bytes checked are the bytes published), an adapter and its base
    before they load."""
    from stages.modeling import fingerprint_of, load_stage_model, load_tokenizer, model_fingerprint, stage_output

    output = stage_output(run_dir, stage)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    try:
        if output.kind == "full":
            digests, copied = copy_model_files(output.path, out)
            inputs.check("candidate", output.path, digests=digests)
        else:
            tokenizer = load_tokenizer(run_dir, spec.model)
            merged = load_stage_model(run_dir, spec, stage, tokenizer, inputs, name="candidate")
    except StageRefused:
        shutil.rmtree(out, ignore_errors=True)  # no copy of a model that was not measured is left behind
        raise
    if output.kind == "full":
        if not list(out.glob("*.safetensors")):
            raise RuntimeError(f"{output.path} has no safetensors weights")
        return output.kind, fingerprint_of(copied)
    merged.config.use_cache = True
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return output.kind, model_fingerprint(out)


def copy_model_files(model_dir: Path, out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Copy what is published of a full model folder (its top-level MODEL_FILES) into `out`, hashing each byte as
    it is copied, and hash the rest; returns (sha256 of every file of `model_dir`, of the files copied), by
    relative path (stages.modeling.file_digests' form): one read of the folder checks it and fingerprints the
    copy."""
    from stages.modeling import file_sha256

    everything: dict[str, str] = {}
    copied: dict[str, str] = {}
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        name = path.relative_to(model_dir).as_posix()
        if path.parent == model_dir and path.name.endswith(MODEL_FILES) and path.name != "training_args.bin":
            everything[name] = copied[name] = _copy_hashing(path, out / path.name)
        else:
            everything[name] = file_sha256(path)
    return everything, copied


def _copy_hashing(source: Path, target: Path) -> str:
    """Copy a file; returns the sha256 (hex) of the bytes written."""
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    return digest.hexdigest()


def model_files(model_dir: Path) -> list[Path]:
    """The files of a model directory, relative, in a stable order."""
    return sorted(p.relative_to(model_dir) for p in model_dir.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- publishing


def split_uri(uri: str) -> tuple[str, str, str]:
    """('gs'|'s3'|'pvc', bucket or claim, key prefix) of a storage URI."""
    scheme, rest = uri.split("://", 1)
    bucket, _, prefix = rest.partition("/")
    return scheme, bucket, prefix.strip("/")


MISSING_BUCKET = "the bucket does not exist; create it, or correct the bucket name"
S3_DENIED = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
"""S3 error codes that mean the credentials may not write to the bucket."""


def upload_failed(storage_uri: str, target: str, reason: str, hint: str = "") -> PublishError:
    """An upload the store refused, as one line: the field, the object, what the store said, the fix."""
    said = " ".join(reason.split())  # stores answer with multi-line bodies; the log gets one `error:` line
    return PublishError(
        f"stages.deploy.storage_uri ({storage_uri}): uploading {target} failed ({said})" + (f": {hint}" if hint else "")
    )


def upload_s3(model_dir: Path, storage_uri: str) -> None:
    """Upload with boto3, through the client the data sources use (`stages.sources.s3_client`): credentials from the
    environment (AWS_*, a web identity or an instance role), the endpoint of an S3-compatible store from
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (boto3 reads both)."""
    try:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        raise PublishError(
            "stages.deploy.storage_uri is s3://, which needs boto3 in the image (pip install boto3)"
        ) from None
    _, bucket, prefix = split_uri(storage_uri)
    try:
        client = s3_client(f"stages.deploy.storage_uri ({storage_uri})")
    except DataError as exc:
        raise PublishError(str(exc)) from None
    for rel in model_files(model_dir):
        key = f"{prefix}/{rel.as_posix()}".lstrip("/")
        try:
            client.upload_file(str(model_dir / rel), bucket, key)
        except (S3UploadFailedError, ClientError, BotoCoreError) as exc:
            # upload_file wraps the store's answer (a ClientError) in S3UploadFailedError
            error = (exc.__cause__ or exc.__context__) if isinstance(exc, S3UploadFailedError) else exc
            code = error.response["Error"].get("Code", "") if isinstance(error, ClientError) else ""
            said = f"{code}: {error.response['Error'].get('Message', '')}" if code else str(error)
            hint = MISSING_BUCKET if code == "NoSuchBucket" else ""
            if code in S3_DENIED:
                hint = "access denied; give the pod's AWS identity s3:PutObject on the bucket, or check its keys"
            reason = f"{said}, at {client.meta.endpoint_url}"
            raise upload_failed(storage_uri, f"s3://{bucket}/{key}", reason, hint) from None


def upload_gcs(model_dir: Path, storage_uri: str) -> None:
    """Upload with google-cloud-storage, through the client the data sources use (`stages.sources.gcs_client`):
    credentials from Google ADC (Workload Identity in GKE); with STORAGE_EMULATOR_HOST set, the client's own emulator
    mode (that endpoint, anonymous credentials, the project from GOOGLE_CLOUD_PROJECT)."""
    try:
        import google.auth.exceptions
        from google.api_core.exceptions import GoogleAPICallError
    except ImportError:
        raise PublishError(
            "stages.deploy.storage_uri is gs://, which needs google-cloud-storage in the image "
            "(pip install google-cloud-storage)"
        ) from None
    _, bucket, prefix = split_uri(storage_uri)
    try:
        client = gcs_client(f"stages.deploy.storage_uri ({storage_uri})")
    except DataError as exc:
        raise PublishError(str(exc)) from None
    target = client.bucket(bucket)
    for rel in model_files(model_dir):
        key = f"{prefix}/{rel.as_posix()}".lstrip("/")
        try:
            target.blob(key).upload_from_filename(str(model_dir / rel))
        except GoogleAPICallError as exc:
            hint = MISSING_BUCKET if exc.code == 404 else ""
            if exc.code in (401, 403):
                hint = "access denied; give the pod's Google service account roles/storage.objectUser on the bucket"
            raise upload_failed(storage_uri, f"gs://{bucket}/{key}", str(exc), hint) from None
        except google.auth.exceptions.GoogleAuthError as exc:
            hint = "the pod's Google credentials were refused; check its Workload Identity binding"
            raise upload_failed(storage_uri, f"gs://{bucket}/{key}", str(exc), hint) from None


def _overlaps(a: Path, b: Path) -> bool:
    """Whether one of two paths is the other or inside it (symlinks and `..` resolved)."""
    return within(a, b) or within(b, a)


def pvc_target(spec: PipelineSpec, claim: str, path: str, run_root: Path) -> Path:
    """Where a pvc:// storage URI lands on the checkpoints volume (the only claim this pod mounts), symlinks and
    `..` resolved. It must lie strictly inside the mount and away from every run directory (this run's and the
    others' stage outputs), since publishing replaces whatever is there."""
    volume = spec.cluster.checkpoints
    field = f"stages.deploy.storage_uri (pvc://{claim}/{path})"
    if claim != volume.claim_name:
        raise PublishError(
            f"{field} names a claim deploy does not mount; use the checkpoints claim ({volume.claim_name}), "
            "gs:// or s3://"
        )
    mount = Path(volume.mount_path).resolve()
    target = (mount / path).resolve()
    if target == mount or not within(target, mount):
        raise PublishError(
            f"{field} resolves to {target}, not a folder inside the checkpoints volume ({volume.mount_path}); "
            f"use a path below it without '..', e.g. pvc://{claim}/models"
        )
    runs = mount / RUN_ROOT
    for protected in (runs, run_root.resolve()):
        if _overlaps(target, protected):
            raise PublishError(
                f"{field} resolves to {target}, which overlaps {protected}, where runs keep their stage outputs; "
                f"publishing there would replace them: use a folder outside {runs}, e.g. pvc://{claim}/models"
            )
    return target


def copy_to_pvc(spec: PipelineSpec, model_dir: Path, claim: str, path: str, run_root: Path) -> None:
    """Copy onto the checkpoints volume, replacing an earlier attempt's copy of this run."""
    target = pvc_target(spec, claim, path, run_root)
    if not Path(spec.cluster.checkpoints.mount_path).is_dir():
        raise PublishError(
            f"the checkpoints volume is not mounted at {spec.cluster.checkpoints.mount_path}: cannot publish to it"
        )
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(model_dir, target)


def publish(spec: PipelineSpec, model_dir: Path, storage_uri: str, run_root: Path) -> None:
    """Put the model where `storage_uri` says."""
    scheme, bucket, prefix = split_uri(storage_uri)
    print(f"[deploy] publishing the model to {storage_uri}", flush=True)
    if scheme == "s3":
        upload_s3(model_dir, storage_uri)
    elif scheme == "gs":
        upload_gcs(model_dir, storage_uri)
    elif scheme == "pvc":
        copy_to_pvc(spec, model_dir, bucket, prefix, run_root)
    else:
        raise PublishError(f"unsupported storage URI {storage_uri!r}: use gs://, s3:// or pvc://")


# --------------------------------------------------------------------------- the registry


def _tag(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text[:MAX_TAG_VALUE]


def lineage_tags(
    ctx: StageContext, evaluated: dict[str, Any], model_kind: str, storage_uri: str, fingerprint: str = ""
) -> dict[str, str]:
    """Tags of the model version: where it comes from (run, workflow, data fingerprints, parent stages and
    their config hashes, base model, commit, the content fingerprints of the registered files and of the
    candidate evaluate measured) and the gate decision with its numbers."""
    from stages.tracking_mlflow_server import run_tags

    run_dir, spec = ctx.run_dir, ctx.spec
    tags = dict(run_tags(spec, run_dir.root))
    prepare = run_dir.read_result("prepare")
    if prepare is not None:
        tags["posttrain.data_fingerprint"] = str(prepare.extra.get("fingerprint", ""))
        tags["posttrain.tokenizer_hash"] = str(prepare.extra.get("tokenizer_hash", ""))
        for stage, counts in (prepare.extra.get("data") or {}).items():
            tags[f"posttrain.data.{stage}.fingerprint"] = str(counts.get("fingerprint", ""))
            tags[f"posttrain.data.{stage}.uri"] = str(counts.get("uri", ""))
    parents = [s for s in STAGE_ORDER[: STAGE_ORDER.index("deploy")] if spec.stage(s).enabled]
    tags["posttrain.parent_stages"] = ",".join(parents)
    for stage in parents:
        result = run_dir.read_result(stage)
        if result is not None:
            tags[f"posttrain.stage.{stage}.config_hash"] = result.config_hash
    tags["posttrain.stage.deploy.config_hash"] = ctx.config_hash
    candidate = ctx.result.inputs.get("candidate") if ctx.result is not None else None
    tags.update(
        {
            "posttrain.model_fingerprint": fingerprint,
            "posttrain.candidate_fingerprint": candidate.fingerprint if candidate is not None else "",
            "posttrain.candidate_stage": evaluated["candidate_stage"],
            "posttrain.model_kind": "merged adapter" if model_kind == "adapter" else model_kind,
            "posttrain.storage_uri": storage_uri,
            "posttrain.gate": evaluated["gate"],
            # deploy runs after gate=pass in the DAG; after a failed gate only by hand (register it anyway)
            "posttrain.gate_overridden": "false" if evaluated["gate"] == GATE_PASS else "true",
            "posttrain.gate_reference": str(evaluated.get("reference", "")),
            "posttrain.gate_reasons": " | ".join(evaluated.get("gate_reasons") or []),
            "posttrain.champion_before": str(evaluated.get("champion_version") or "none"),
            HELDOUT_TAG: str(evaluated.get("heldout_fingerprint", "")),
        }
    )
    for name, value in (evaluated.get("candidate") or {}).items():
        tags[f"{METRIC_TAG_PREFIX}{name}"] = repr(float(value))
    for name, value in (evaluated.get("base") or {}).items():
        tags[f"posttrain.base_metric.{name}"] = repr(float(value))
    return {k[:250]: _tag(v) for k, v in tags.items()}


def model_metadata(spec: PipelineSpec, stage: str, model_kind: str, adapter_base: str) -> dict[str, str]:
    """What the registered model's MLmodel says of it: the pipeline's base model, the stage that made it, and for
    an adapter (merged before it is registered) what it was trained on: the base model or an earlier stage's."""
    metadata = {
        "posttrain.pipeline": spec.name,
        "posttrain.base_model": spec.model.name_or_path,
        "posttrain.candidate_stage": stage,
        "posttrain.model_kind": "merged adapter" if model_kind == "adapter" else model_kind,
    }
    if model_kind == "adapter":
        metadata["posttrain.adapter"] = "adapter/ (artifacts of the run)"
        metadata["posttrain.adapter_base"] = adapter_base
    return metadata


def existing_version(client: Any, name: str, run_id: str) -> Any:
    """The version an earlier attempt of this deploy run registered, or None."""
    quoted = name.replace("'", "\\'")
    for version in client.search_model_versions(f"name='{quoted}'"):
        if version.run_id == run_id:
            return version
    return None


@contextmanager
def fluent_uri(uri: str) -> Iterator[None]:
    """mlflow's process-wide tracking and registry URI set to `uri` for the block, then put back: the fluent calls
    (`mlflow.transformers.log_model`, `models:/` resolution) read them, and a stage must not leave them changed."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    before = tracking_utils._tracking_uri, registry_utils._registry_uri
    # The setters also export MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI for subprocesses, and setting None back
    # does not remove them: the environment is put back by hand.
    environment = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def log_chat_model(
    client: Any, tracking_uri: str, run_id: str, model_dir: Path, spec: PipelineSpec, metadata: dict[str, str]
) -> Any:
    """Log `model_dir` (full safetensors weights and tokenizer) on deploy's run as an MLflow transformers model for
    chat (task CHAT_TASK: OpenAI-style messages in, a chat completion out), so that `mlflow.pyfunc.load_model` and
    `mlflow.transformers.load_model` load it. `metadata` goes into its MLmodel. Returns mlflow's ModelInfo."""
    import mlflow
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # MLflow 3.17 cannot log a checkpoint folder under transformers 5 (it reads the task's pipeline class by a
    # name that is now a string): the model is loaded and logged as components instead, in the dtype it was saved
    # in (not upcast on a CPU pod), safetensors in and out.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="auto", use_safetensors=True, trust_remote_code=spec.model.trust_remote_code
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=spec.model.trust_remote_code)
    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name="model", source_run_id=run_id)
    requirements = [f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
    with fluent_uri(tracking_uri):
        return mlflow.transformers.log_model(
            {"model": model, "tokenizer": tokenizer},
            name="model",
            task=CHAT_TASK,
            run_id=run_id,
            model_id=logged.model_id,
            metadata=metadata,
            pip_requirements=requirements,  # mlflow's defaults name torchvision, which nothing here uses
        )


def register(
    client: Any,
    name: str,
    run_id: str,
    tags: dict[str, str],
    promote: bool,
    log_model: Callable[[], Any] | None = None,
) -> Any:
    """A new version of `name` (the version an earlier attempt of this run registered, when there is one): the
    model `log_model` logs (mlflow's ModelInfo), else the run's `model` artifacts; its tags, alias challenger, and
    champion when `promote`."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="Post-trained models of the posttrain pipelines.")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = existing_version(client, name, run_id)
    if version is None:
        info = log_model() if log_model is not None else None
        source = info.model_uri if info is not None else f"runs:/{run_id}/model"
        model_id = info.model_id if info is not None else None
        version = client.create_model_version(name, source=source, run_id=run_id, tags=tags, model_id=model_id)
    else:
        for key, value in tags.items():
            client.set_model_version_tag(name, version.version, key, value)
    client.set_registered_model_alias(name, CHALLENGER, version.version)
    if promote:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    return version


def smoke_generation(client: Any, tracking_uri: str, name: str, alias: str) -> dict[str, str]:
    """Load `models:/<name>@<alias>` back from the registry as its users do (`mlflow.pyfunc.load_model`) and ask
    it one chat message (SMOKE_TOKENS new tokens at most, with the generation config it was saved with)."""
    import mlflow

    version = client.get_model_version_by_alias(name, alias)
    uri = f"models:/{name}@{alias}"
    with fluent_uri(tracking_uri):
        model = mlflow.pyfunc.load_model(uri)
    messages = [{"role": "user", "content": SMOKE_PROMPT}]
    (answer,) = model.predict({"messages": messages, "max_tokens": SMOKE_TOKENS})
    return {
        "uri": uri,
        "version": str(version.version),
        "prompt": SMOKE_PROMPT,
        "output": answer["choices"][0]["message"]["content"],
        "new_tokens": str(answer["usage"]["completion_tokens"]),
    }


# --------------------------------------------------------------------------- the stage


def run(ctx: StageContext) -> int:
    """Register, alias, publish and render; returns the process exit code. Refused without a gate decision, or
    for a model other than the one evaluate measured: nothing published."""
    return run_stage(ctx, lambda: deploy(ctx), (PublishError,))


def deploy(ctx: StageContext) -> int:
    from stages.modeling import FINGERPRINT, ModelInputs, stage_output
    from stages.tracking import StageTracker

    run_dir, spec = ctx.run_dir, ctx.spec
    run_name = run_dir.root.name
    name = registered_model_name(spec)

    # 1. The gate decision; nothing to do when evaluate was skipped.
    evaluated = evaluation(run_dir)
    if evaluated["status"] == "skipped" or evaluated.get("gate") == GATE_SKIPPED:
        message = f"evaluate was skipped ({evaluated.get('message') or 'nothing to evaluate'}): nothing to deploy"
        print(f"[deploy] {message}", flush=True)
        return ctx.finish(status="skipped", message=message, extra={"promoted": "false"})
    promote = evaluated.get("gate") == GATE_PASS
    # The serve step (the cluster's rollout, or the local one with vLLM) moves champion after its smoke check; it
    # moves here only when nothing is served.
    serve_follows = os.environ.get("ARGO_WORKFLOW_NAME") or os.environ.get(LOCAL_SERVE_VARIABLE) == "1"
    served = bool(serve_follows) and spec.stages.deploy.serving.enabled
    promote_here = promote and not served
    stage = evaluated["candidate_stage"]
    evaluate_result = run_dir.read_result("evaluate")
    ctx.add_input("evaluation", "evaluate/stage.json", evaluate_result.config_hash if evaluate_result else "")
    if not promote:
        print(f"[deploy] the gate did not pass ({evaluated.get('gate')}): registering as {CHALLENGER} only", flush=True)

    # 2-3. The model as served, published where the InferenceService reads it.
    model_dir = ctx.dir / "model"
    measured = ModelInputs(ctx, measured_by="evaluate")  # the candidate's folders, held to evaluate's record
    model_kind, fingerprint = export_model(run_dir, spec, stage, model_dir, measured)
    storage_uri = model_storage_uri(spec, run_name)
    if spec.stages.deploy.storage_uri is not None:
        publish(spec, model_dir, storage_uri, run_dir.root)

    with StageTracker(ctx) as tracker:
        tracker.log_params({"registered_model": name, "candidate_stage": stage, "storage_uri": storage_uri})
        tracker.log_metrics(evaluated.get("candidate") or {}, step=0)
        run_id = tracker.run_id
        if run_id is None:
            raise RuntimeError("the MLflow tracking server could not be reached: the model cannot be registered")

        # 4. The registry: the model for chat, version, lineage, aliases.
        client, tracking_uri = registry_client(spec, run_dir.root)
        tags = lineage_tags(ctx, evaluated, model_kind, storage_uri, fingerprint)
        output = stage_output(run_dir, stage)
        if output.kind == "adapter":  # kept with the run; its adapter_config.json names the base too
            client.log_artifacts(run_id, str(output.path), "adapter")
        metadata = model_metadata(spec, stage, model_kind, output.base.name if output.kind == "adapter" else "")
        with fluent_uri(tracking_uri):  # the registry resolves the version's `models:/m-...` source through it
            version = register(
                client,
                name,
                run_id,
                tags,
                promote_here,
                lambda: log_chat_model(client, tracking_uri, run_id, model_dir, spec, metadata),
            )
        aliases = [CHALLENGER, CHAMPION] if promote_here else [CHALLENGER]
        print(f"[deploy] {name} version {version.version}: aliases {', '.join(aliases)}", flush=True)

        # 5. The InferenceService.
        outputs: dict[str, Path] = {"model": model_dir}
        if spec.stages.deploy.serving.enabled:
            manifest = inference_service(spec, storage_uri, run_name, model_version=str(version.version))
            isvc = ctx.dir / "inferenceservice.yaml"
            isvc.write_text(to_yaml(manifest), encoding="utf-8")
            tracker.log_artifact(isvc)
            outputs["inferenceservice"] = isvc

        # 6. Locally: the model, loaded back from the registry by alias, generates.
        smoke: dict[str, str] = {}
        if not os.environ.get("ARGO_WORKFLOW_NAME"):
            alias = CHAMPION if promote_here else CHALLENGER
            smoke = smoke_generation(client, tracking_uri, name, alias)
            print(f"[deploy] {smoke['uri']} generates: {smoke['output']!r}", flush=True)

        if promote_here:
            message = f"registered {name} v{version.version} as {CHAMPION} (gate passed)"
        elif promote:
            message = (
                f"registered {name} v{version.version} as {CHALLENGER} (gate passed): {CHAMPION} moves to it once "
                "the serve step's smoke check passes"
            )
        else:
            message = (
                f"registered {name} v{version.version} as {CHALLENGER} only: the gate did not pass, "
                f"{CHAMPION} stays at {evaluated.get('champion_version') or 'none'}"
            )
        return ctx.finish(
            outputs=outputs,
            metrics={},
            message=message,
            extra={
                "registered_model": name,
                "model_version": str(version.version),
                "aliases": aliases,
                "promoted": "true" if promote_here else "false",
                "gate": str(evaluated.get("gate")),
                "champion_before": str(evaluated.get("champion_version") or "none"),
                "storage_uri": storage_uri,
                "model_uri": f"models:/{name}/{version.version}",
                "model_kind": model_kind,
                FINGERPRINT: fingerprint,  # of deploy/model: the files registered and published
                "smoke": smoke,
            },
        )
