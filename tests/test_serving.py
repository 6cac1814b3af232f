"""The KServe InferenceService (run/serving.py): valid against KServe's v1beta1 schema, storage URIs,
safetensors only, no secrets, no torch."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import fresh_spec
from schema_validation import SchemaViolation, validate_custom_resource

from run.serving import (
    default_storage_uri,
    inference_service,
    model_storage_uri,
    to_yaml,
    with_canary_traffic,
)
from spec.pipeline import PipelineSpec

REPO = Path(__file__).resolve().parents[1]

# What the API server checks of every object's metadata beyond the schema: DNS-1035 name, DNS-1123 namespace,
# qualified label keys and label values.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


def _serve_steps(documents: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The `serve` step of each compiled document: it rolls out the file deploy rendered."""
    return [
        template
        for doc in documents.values()
        for template in doc.get("spec", {}).get("templates", []) or []
        if template["name"] == "serve" or template["name"].endswith("-serve")  # a variant's: <variant>-serve
    ]


def spec_with(**deploy: Any) -> PipelineSpec:
    spec = fresh_spec("korean-llm")
    for key, value in deploy.items():
        setattr(spec.stages.deploy, key, value)
    return spec


def test_the_rendered_inference_service_validates_against_kserve(
    spec: PipelineSpec, compile_pipeline: Callable[..., Any]
) -> None:
    """The deploy stage's document, which the compiled serve step applies, for every shipped pipeline and profile,
    against KServe's v1beta1 schema, strictly, with each traffic setting the rollout gives it (with variants: each
    variant's own, from its own serve step)."""
    from spec.variants import variant_specs

    served = list(variant_specs(spec).values()) or [spec]
    for one in served:
        _validate_inference_service(one)
    steps = _serve_steps(compile_pipeline(spec).documents())
    serving = spec.stages.deploy.enabled and spec.stages.deploy.serving.enabled
    assert len(steps) == (len(served) if serving else 0)
    for step in steps:
        assert step["container"]["command"][:3] == ["python", "-m", "workflows.rollout"]


def _validate_inference_service(spec: PipelineSpec) -> None:
    manifest = inference_service(spec, model_storage_uri(spec, "run-1"), "run-1", model_version="7")
    validate_custom_resource(manifest)
    assert yaml.safe_load(to_yaml(manifest)) == manifest
    meta = manifest["metadata"]
    assert _NAME.match(meta["name"]) and _NAMESPACE.match(meta["namespace"]), meta
    assert all(_LABEL_KEY.match(k) and _LABEL_VALUE.match(v) for k, v in meta["labels"].items()), meta["labels"]
    # A scheme KServe's storage initializer fetches, and a path below the bucket or claim.
    assert re.match(r"^(gs|s3|pvc)://[^/]+/.+", manifest["spec"]["predictor"]["model"]["storageUri"])

    for percent in (None, 0, 10):
        validate_custom_resource(with_canary_traffic(manifest, percent))


def test_the_kserve_validator_is_strict() -> None:
    """Guard: a misspelt or misplaced predictor field and a missing required one are errors, not dropped."""
    manifest = inference_service(fresh_spec("korean-llm"), "s3://b/m", "run-1")
    unknown = copy.deepcopy(manifest)
    unknown["spec"]["predictor"]["replicas"] = 2
    with pytest.raises(SchemaViolation, match=r"spec\.predictor: .*'replicas' was unexpected"):
        validate_custom_resource(unknown)
    nested = copy.deepcopy(manifest)
    nested["spec"]["predictor"]["model"]["resources"]["limit"] = {"nvidia.com/gpu": "1"}
    with pytest.raises(SchemaViolation, match=r"spec\.predictor\.model\.resources: .*'limit' was unexpected"):
        validate_custom_resource(nested)
    missing = copy.deepcopy(manifest)
    del missing["spec"]["predictor"]["model"]["modelFormat"]
    with pytest.raises(SchemaViolation, match=r"spec\.predictor\.model: 'modelFormat' is a required property"):
        validate_custom_resource(missing)
    quantity = copy.deepcopy(manifest)
    quantity["spec"]["predictor"]["model"]["resources"]["limits"]["nvidia.com/gpu"] = "one"
    with pytest.raises(SchemaViolation, match=r"limits\.nvidia\.com/gpu: 'one' does not match"):
        validate_custom_resource(quantity)


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
        "args": [
            "--load-format=safetensors",
            "--max-model-len=8192",
            "--tensor-parallel-size=2",
            "--enable-auto-tool-choice",  # the pipeline's hermes parser: Qwen3's <tool_call> syntax as tool_calls
            "--tool-call-parser=hermes",
        ],
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
    assert meta["annotations"] == {
        "posttrain.dev/registered-model": "korean-llm",
        "serving.kserve.io/deploymentMode": "Knative",  # revisions and traffic splitting (KServe >= 0.20 names)
        "posttrain.dev/model-version": "4",
    }
    assert "scaleMetric" not in predictor and "canaryTrafficPercent" not in predictor

    serving.gpus, serving.max_model_len, serving.tool_call_parser = 0, None, None
    model = inference_service(spec, "gs://bucket/m", "run-1")["spec"]["predictor"]["model"]
    assert "resources" not in model and model["args"] == ["--load-format=safetensors"]


def test_every_inference_service_loads_safetensors_only(spec: PipelineSpec) -> None:
    """In the deploy stage's file and in the DAG's resource step alike; no other load format can follow it."""
    for manifest in (inference_service(spec, "s3://b/m", "run-1"),):
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
    text = json.dumps(manifest)
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
    code = "import sys, run.serving; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
