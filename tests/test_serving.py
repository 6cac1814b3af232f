"""The KServe InferenceService (workflows/serving.py): the v1beta1 shape, storage URIs, safetensors only, no secrets,
no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from conftest import fresh_spec

from workflows.serving import (
    ARGO_RUN_NAME,
    argo_manifest,
    default_storage_uri,
    inference_service,
    model_storage_uri,
    to_yaml,
)
from workflows.spec import PipelineSpec

REPO = Path(__file__).resolve().parents[1]

_LABELS = {
    "type": "object",
    "propertyNames": {"pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"},
    "additionalProperties": {"type": "string", "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"},
}
_GPUS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["nvidia.com/gpu"],
    "properties": {"nvidia.com/gpu": {"type": "string", "pattern": "^[1-9][0-9]*$"}},
}
# The fields the renderer emits, as KServe's v1beta1 CRD defines them; strict: anything else is an error.
INFERENCE_SERVICE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace", "labels"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "namespace": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "labels": _LABELS,
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["predictor"],
            "properties": {
                "predictor": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["model"],
                    "properties": {
                        "serviceAccountName": {"type": "string", "minLength": 1},
                        "minReplicas": {"type": "integer", "minimum": 0},
                        "maxReplicas": {"type": "integer", "minimum": 1},
                        "model": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["modelFormat", "storageUri"],
                            "properties": {
                                "modelFormat": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["name"],
                                    "properties": {"name": {"const": "vllm"}, "version": {"type": "string"}},
                                },
                                "runtime": {"type": "string", "minLength": 1},
                                "storageUri": {"type": "string", "pattern": "^(gs|s3|pvc)://[^/]+/.+"},
                                "args": {"type": "array", "items": {"type": "string", "pattern": "^--[a-z-]+=.+$"}},
                                "resources": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"requests": _GPUS, "limits": _GPUS},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def spec_with(**deploy: Any) -> PipelineSpec:
    spec = fresh_spec("korean-llm")
    for key, value in deploy.items():
        setattr(spec.stages.deploy, key, value)
    return spec


def test_the_rendered_inference_service_has_the_kserve_v1beta1_shape(spec: PipelineSpec) -> None:
    manifest = inference_service(spec, model_storage_uri(spec, "run-1"), "run-1", model_version="7")
    jsonschema.validate(manifest, INFERENCE_SERVICE_SCHEMA)
    assert yaml.safe_load(to_yaml(manifest)) == manifest


def test_serving_settings_reach_the_predictor() -> None:
    spec = fresh_spec("korean-llm")
    serving = spec.stages.deploy.serving
    serving.gpus, serving.max_model_len, serving.min_replicas, serving.max_replicas = 2, 8192, 0, 3
    manifest = inference_service(spec, "gs://bucket/models/run-1", "run-1", model_version="4")
    predictor = manifest["spec"]["predictor"]
    assert predictor["model"] == {
        "modelFormat": {"name": "vllm"},
        "runtime": "kserve-vllm",
        "storageUri": "gs://bucket/models/run-1",
        "args": ["--load-format=safetensors", "--max-model-len=8192", "--tensor-parallel-size=2"],
        "resources": {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}},
    }
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (0, 3)
    # The predictor never runs as the workflow's account (which may create jobs); only as the one named for it.
    assert "serviceAccountName" not in predictor
    named = spec.model_copy(deep=True)
    named.stages.deploy.serving.service_account = "model-reader"
    served = inference_service(named, "gs://bucket/models/run-1", "run-1")["spec"]["predictor"]
    assert served["serviceAccountName"] == "model-reader"
    meta = manifest["metadata"]
    assert meta["name"] == "korean-llm" and meta["namespace"] == "llm-training"
    assert meta["labels"]["posttrain.dev/pipeline"] == "korean-llm" and meta["labels"]["posttrain.dev/run"] == "run-1"
    assert meta["annotations"] == {"posttrain.dev/registered-model": "korean-llm", "posttrain.dev/model-version": "4"}

    serving.gpus, serving.max_model_len = 0, None
    model = inference_service(spec, "gs://bucket/m", "run-1")["spec"]["predictor"]["model"]
    assert "resources" not in model and model["args"] == ["--load-format=safetensors"]


def test_every_inference_service_loads_safetensors_only(spec: PipelineSpec) -> None:
    """In the deploy stage's file and in the DAG's resource step alike; no other load format can follow it."""
    for manifest in (inference_service(spec, "s3://b/m", "run-1"), yaml.safe_load(argo_manifest(spec))):
        args = manifest["spec"]["predictor"]["model"]["args"]
        assert [a for a in args if a.startswith("--load-format")] == ["--load-format=safetensors"]


def test_the_runtime_exists_in_the_manifests() -> None:
    runtime = yaml.safe_load((REPO / "manifests/components/kserve-vllm/servingruntime.yaml").read_text())
    manifest = inference_service(fresh_spec("korean-llm"), "s3://b/m", "run-1")
    assert runtime["metadata"]["name"] == manifest["spec"]["predictor"]["model"]["runtime"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert manifest["spec"]["predictor"]["model"]["modelFormat"]["name"] in formats


@pytest.mark.parametrize(
    ("storage_uri", "expected"),
    [
        (None, "pvc://checkpoints-rwx/runs/run-1/deploy/model"),
        ("gs://models-bucket/korean-llm", "gs://models-bucket/korean-llm/run-1"),
        ("s3://models/korean-llm/", "s3://models/korean-llm/run-1"),
        ("pvc://serving-models/korean-llm", "pvc://serving-models/korean-llm/run-1"),
    ],
)
def test_storage_uris(storage_uri: str | None, expected: str) -> None:
    spec = spec_with(storage_uri=storage_uri)
    assert model_storage_uri(spec, "run-1") == expected
    assert default_storage_uri(spec, "run-1") == "pvc://checkpoints-rwx/runs/run-1/deploy/model"
    manifest = inference_service(spec, model_storage_uri(spec, "run-1"), "run-1")
    assert manifest["spec"]["predictor"]["model"]["storageUri"] == expected


def test_the_argo_manifest_names_the_run_through_the_workflow() -> None:
    spec = spec_with(storage_uri="s3://models/korean-llm")
    manifest = yaml.safe_load(argo_manifest(spec))
    assert manifest["spec"]["predictor"]["model"]["storageUri"] == f"s3://models/korean-llm/{ARGO_RUN_NAME}"
    assert manifest["metadata"]["labels"]["posttrain.dev/run"] == ARGO_RUN_NAME
    local = fresh_spec("korean-llm")
    assert yaml.safe_load(argo_manifest(local))["spec"]["predictor"]["model"]["storageUri"] == (
        f"pvc://checkpoints-rwx/runs/{ARGO_RUN_NAME}/deploy/model"
    )


def test_the_inference_service_carries_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-aws-value",
        "HF_TOKEN": "hf_tokenvalue123",
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE42",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    spec = spec_with(storage_uri="s3://models/korean-llm")
    spec.cluster.secrets.aws_access_key_id = {"name": "s3-credentials", "key": "access-key"}  # type: ignore[assignment]
    spec.cluster.secrets.aws_secret_access_key = {"name": "s3-credentials", "key": "secret-key"}  # type: ignore[assignment]
    manifest = inference_service(spec, model_storage_uri(spec, "run-1"), "run-1")
    text = json.dumps(manifest) + argo_manifest(spec)
    for value in secrets.values():
        assert value not in text
    assert "s3-credentials" not in text and "secret" not in text.lower() and "token" not in text.lower()

    def keys(node: Any) -> set[str]:
        if isinstance(node, dict):
            return set(node) | {k for v in node.values() for k in keys(v)}
        if isinstance(node, list):
            return {k for v in node for k in keys(v)}
        return set()

    assert not keys(manifest) & {"env", "envFrom", "valueFrom", "secretKeyRef", "imagePullSecrets"}


def test_serving_does_not_import_torch() -> None:
    code = "import sys, workflows.serving; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
