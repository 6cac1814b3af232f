"""The KServe InferenceService (serving.kserve.io/v1beta1) that serves a pipeline's model with vLLM.

The deploy stage renders it for its run into `<run>/deploy/inferenceservice.yaml`; the cluster DAG's serve step
applies that file and rolls it out (workflows/rollout.py). It runs in KServe's Knative mode (annotated, since
KServe >= 0.20 defaults to Standard mode), where each model is a new revision and traffic can be split between the
new revision and the previous one (canaryTrafficPercent, set by the rollout). Its predictor selects the
`kserve-vllm` ServingRuntime (manifests/components/kserve-vllm) by modelFormat vllm; its args, which KServe
appends to the runtime's, always hold `--load-format=safetensors`. KServe's storage initializer fetches
`storageUri` (gs://, s3://, pvc://) into /mnt/models with the predictor's ServiceAccount (Workload Identity, IRSA,
or the PVC mount). No credential or Secret reference appears in the document.

Where a run's model is published:
- `stages.deploy.storage_uri` unset: on the checkpoints volume, where deploy wrote it:
  `pvc://<checkpoints claim>/runs/<run>/deploy/model`;
- set (gs://bucket/prefix, s3://bucket/prefix, pvc://claim/prefix): under the prefix, one folder per run
  (`<prefix>/<run>`), so publishing a run never overwrites the model being served.

Both planes read this module: it never imports torch or transformers.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from run.names import PART_OF, PIPELINE_LABEL, RUN_ROOT
from spec.pipeline import PipelineSpec

API_VERSION = "serving.kserve.io/v1beta1"
KIND = "InferenceService"
MODEL_FORMAT = "vllm"
LOAD_FORMAT_ARG = "--load-format=safetensors"
"""vLLM loads the weights from safetensors only (a pickle can run code when it is loaded)."""
SERVER_COMMAND = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
"""The kserve-vllm runtime's command: vLLM's OpenAI-compatible server (manifests/components/kserve-vllm/)."""
RUNTIME_PORT = 8080
LOCAL_HOST = "127.0.0.1"
"""Where a server this project starts itself listens (the local serve step, evaluate's vLLM backend): not reachable
from other machines."""
RUNTIME_MODEL_DIR = "/mnt/models"
"""Where KServe's storage initializer puts the model in the predictor pod."""
LOCAL_SERVE_VARIABLE = "POSTTRAIN_LOCAL_SERVE"
"""Set to 1 by the local runner for deploy when its serve step follows (workflows/local_serving.py): champion then
moves after vLLM answered, as in the cluster (where ARGO_WORKFLOW_NAME says a serve step follows)."""
RUNTIME_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
"""Environment the runtime gives vLLM, besides HOME and HF_HOME (writable folders of the pod): no download from
the Hub, no usage report."""
RUN_LABEL = "posttrain.dev/run"
REGISTERED_MODEL_ANNOTATION = "posttrain.dev/registered-model"
MODEL_VERSION_ANNOTATION = "posttrain.dev/model-version"
DEPLOYMENT_MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
DEPLOYMENT_MODE = "Knative"
"""Revisions and traffic splitting need Knative mode (named Serverless before KServe 0.20, which still accepts it)."""
TAG_ROUTING_ANNOTATION = "serving.kserve.io/enable-tag-routing"
"""With it KServe tags the newest revision's traffic target `latest` (and the previous one `prev`), so Knative gives
the canary an address of its own, where the smoke check reaches it alone."""


def inference_service_name(spec: PipelineSpec) -> str:
    """The InferenceService's name: the pipeline's (stable across runs, so each deploy moves the same
    service to the new model). Pipeline names are DNS-1035 labels already (the spec requires a leading letter)."""
    return spec.name


def default_storage_uri(spec: PipelineSpec, run_name: str) -> str:
    """The model deploy writes into the run directory, as KServe reads it from the checkpoints volume."""
    return f"pvc://{spec.cluster.checkpoints.claim_name}/{RUN_ROOT}/{run_name}/deploy/model"


def model_storage_uri(spec: PipelineSpec, run_name: str) -> str:
    """Where the run's model is served from: `<storage_uri>/<run>` when the spec names storage, else the
    run directory on the checkpoints volume."""
    prefix = spec.stages.deploy.storage_uri
    if prefix is None:
        return default_storage_uri(spec, run_name)
    return f"{prefix.rstrip('/')}/{run_name}"


def _label_value(value: str) -> str:
    """A Kubernetes label value (<= 63 characters of [A-Za-z0-9._-], alphanumeric at both ends); Argo
    expressions ({{...}}) pass through, they are resolved before the document reaches the API server."""
    if value.startswith("{{"):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", value)[:63]
    return cleaned.strip("-._")


def inference_service(
    spec: PipelineSpec, storage_uri: str, run_name: str, model_version: str | None = None
) -> dict[str, Any]:
    """The InferenceService serving the model at `storage_uri` with the spec's runtime, GPUs, vLLM arguments
    and replicas, labelled with the pipeline and run. `model_version` (the registry version) is recorded as an
    annotation when known."""
    deploy = spec.stages.deploy
    serving = deploy.serving
    model: dict[str, Any] = {
        "modelFormat": {"name": MODEL_FORMAT},
        "runtime": serving.runtime,
        "storageUri": storage_uri,
    }
    model["args"] = predictor_args(spec)
    if serving.gpus > 0:
        gpus = str(serving.gpus)
        model["resources"] = {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    annotations = {
        REGISTERED_MODEL_ANNOTATION: deploy.registered_model or spec.name,
        DEPLOYMENT_MODE_ANNOTATION: DEPLOYMENT_MODE,
    }
    if serving.rollout == "canary":
        annotations[TAG_ROUTING_ANNOTATION] = "true"
    if model_version is not None:
        annotations[MODEL_VERSION_ANNOTATION] = str(model_version)
    manifest: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": inference_service_name(spec),
            "namespace": spec.cluster.namespace,
            "labels": {
                "app.kubernetes.io/part-of": PART_OF,
                "app.kubernetes.io/name": inference_service_name(spec),
                PIPELINE_LABEL: spec.name,
                RUN_LABEL: _label_value(run_name),
            },
            "annotations": annotations,
        },
        "spec": {
            "predictor": {
                "minReplicas": serving.min_replicas,
                "maxReplicas": serving.max_replicas,
                "model": model,
            }
        },
    }
    if serving.service_account:
        manifest["spec"]["predictor"]["serviceAccountName"] = serving.service_account
    if serving.autoscaling is not None:
        # KServe turns these into Knative's autoscaling.knative.dev/metric and /target on the revision.
        manifest["spec"]["predictor"]["scaleMetric"] = serving.autoscaling.metric
        manifest["spec"]["predictor"]["scaleTarget"] = serving.autoscaling.target
    return manifest


def predictor_args(spec: PipelineSpec) -> list[str]:
    """vLLM's arguments for this pipeline's model, which the InferenceService appends to the runtime's: safetensors
    only (whatever runtime serves it), the context length, the GPUs to shard over, the dtype, and the tool-call
    parser that turns the model's tool-call syntax into OpenAI `tool_calls`."""
    serving = spec.stages.deploy.serving
    args = [LOAD_FORMAT_ARG]
    if serving.max_model_len is not None:
        args.append(f"--max-model-len={serving.max_model_len}")
    if serving.gpus > 1:
        args.append(f"--tensor-parallel-size={serving.gpus}")
    if serving.dtype != "auto":
        args.append(f"--dtype={serving.dtype}")
    if serving.tool_call_parser is not None:
        args += ["--enable-auto-tool-choice", f"--tool-call-parser={serving.tool_call_parser}"]
    return args


def runtime_args(model_dir: str, served_name: str, port: int) -> list[str]:
    """The arguments the kserve-vllm runtime gives vLLM before the InferenceService's (there: port 8080, the model
    in /mnt/models, served under the InferenceService's name; tests/test_serving.py holds the runtime to this)."""
    return [f"--port={port}", f"--model={model_dir}", f"--served-model-name={served_name}", LOAD_FORMAT_ARG]


def server_argv(spec: PipelineSpec, python: str, model_dir: str, served_name: str, port: int) -> list[str]:
    """The whole vLLM command line of the predictor pod, with `python` for the runtime's python3: what the local
    serve step runs (workflows/local_serving.py), so that the model is served here as KServe will serve it."""
    return [python, *SERVER_COMMAND[1:], *runtime_args(model_dir, served_name, port), *predictor_args(spec)]


def with_canary_traffic(manifest: dict[str, Any], percent: int | None) -> dict[str, Any]:
    """A copy of the InferenceService whose newest revision gets `percent` of the traffic and the previous rolled-out
    revision the rest (0 pins all traffic to the previous one: a rollback); None gives the newest revision all of
    it, once ready."""
    copy = yaml.safe_load(to_yaml(manifest))
    if percent is not None:
        copy["spec"]["predictor"]["canaryTrafficPercent"] = percent
    return copy


def to_yaml(manifest: dict[str, Any]) -> str:
    """The manifest as a YAML document."""
    return yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True)


def evaluation_server_argv(
    python: str,
    model_dir: str,
    served_name: str,
    port: int,
    *,
    max_model_len: int,
    dtype: str,
    tensor_parallel: int,
    seed: int,
) -> list[str]:
    """vLLM's command line for evaluate's vLLM backend (stages/vllm_measures.py): the runtime's server and loading
    rule (safetensors only) on the folder evaluate saved, on 127.0.0.1, the length a scored row and a generation
    need, the dtype evaluate loads models in, its GPUs, and the candidate stage's seed."""
    argv = [python, *SERVER_COMMAND[1:], *runtime_args(model_dir, served_name, port), f"--host={LOCAL_HOST}"]
    argv += [f"--max-model-len={max_model_len}", f"--seed={seed}"]
    if dtype != "auto":
        argv.append(f"--dtype={dtype}")
    if tensor_parallel > 1:
        argv.append(f"--tensor-parallel-size={tensor_parallel}")
    return argv
