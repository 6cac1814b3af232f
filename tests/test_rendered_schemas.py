"""Every rendered document of every shipped pipeline validates strictly: Argo resources against the Argo schema,
embedded PyTorchJobs and TrainJobs against their CRDs, and each watch condition parses the way Argo parses it."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from argo_model import parse_selector
from schema_validation import (
    SchemaViolation,
    pod_template_object,
    require_schemas,
    validate_argo,
    validate_core,
    validate_custom_resource,
    validate_pytorchjob,
)

from run.names import STAGE_LABEL
from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec
from spec.variants import variant_specs
from workflows import pytorchjob, trainjob
from workflows.pytorchjob import WORKFLOW_LABEL

EXPECTED_KINDS = {
    "workflowtemplate.yaml": "WorkflowTemplate",
    "workflow.yaml": "Workflow",
    "cronworkflow.yaml": "CronWorkflow",
}


def _resource_templates(
    documents: dict[str, dict[str, Any]], action: str = "create", kind: str = "PyTorchJob"
) -> Iterator[dict[str, Any]]:
    """The training steps: resource templates that create a job of `kind` (`action` get: that wait on one)."""
    for doc in documents.values():
        for template in doc.get("spec", {}).get("templates", []) or []:
            resource = template.get("resource")
            if not resource or resource["action"] != action:
                continue
            if yaml.safe_load(resource["manifest"])["kind"] == kind:
                yield template


def _expected_jobs(spec: PipelineSpec, manifest: Callable[..., dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Create template name → the job it creates: one per enabled training stage, or with variants one per variant
    and stage (`<variant>-<stage>-create`), in the variant's run, labelled with the workflow that cleanup selects."""
    if not spec.variants:
        return {f"{s}-create": manifest(spec, s) for s in TRAINING_STAGES if spec.stage(s).enabled}
    jobs = {}
    for variant, vspec in variant_specs(spec).items():
        for stage in (s for s in TRAINING_STAGES if vspec.stage(s).enabled):
            job = manifest(vspec, stage, f"{{{{workflow.name}}}}-{variant}")
            job["metadata"]["labels"][WORKFLOW_LABEL] = "{{workflow.name}}"
            jobs[f"{variant}-{stage}-create"] = job
    return jobs


def test_documents_validate_against_the_argo_schema(
    spec: PipelineSpec, compile_pipeline: Callable[..., Any], schemas_dir: Any
) -> None:
    documents = compile_pipeline(spec).documents()
    assert set(documents) == set(EXPECTED_KINDS) - (set() if spec.schedule.cron else {"cronworkflow.yaml"})
    for filename, doc in documents.items():
        assert doc["kind"] == EXPECTED_KINDS[filename], filename
        assert doc["apiVersion"] == "argoproj.io/v1alpha1", filename
        validate_argo(doc)


def test_documents_survive_a_yaml_round_trip(spec: PipelineSpec, compile_pipeline: Callable[..., Any]) -> None:
    """What is written to disk and applied reads back as the same objects."""
    for filename, doc in compile_pipeline(spec).documents().items():
        assert yaml.safe_load(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)) == doc, filename


def test_embedded_pytorchjobs_validate_against_the_crd(
    spec: PipelineSpec, compile_pipeline: Callable[..., Any], schemas_dir: Any
) -> None:
    templates = list(_resource_templates(compile_pipeline(spec).documents()))
    if spec.cluster.job_kind != "pytorchjob":
        assert templates == []
        return
    expected = _expected_jobs(spec, pytorchjob.job_manifest)
    assert sorted(t["name"] for t in templates) == sorted(expected)
    for template in templates:
        manifest = yaml.safe_load(template["resource"]["manifest"])
        validate_pytorchjob(manifest)
        assert manifest == expected[template["name"]], template["name"]


def test_embedded_trainjobs_validate_against_the_crd(spec: PipelineSpec, compile_pipeline: Callable[..., Any]) -> None:
    """Every pipeline compiled with job_kind trainjob (the shipped trainjob profile, and every other variant
    switched to it): one TrainJob per enabled training stage, valid against Trainer v2.1's CRD, strictly."""
    spec.cluster.job_kind = "trainjob"
    documents = compile_pipeline(spec).documents()
    templates = list(_resource_templates(documents, kind="TrainJob"))
    expected = _expected_jobs(spec, trainjob.job_manifest)
    assert sorted(t["name"] for t in templates) == sorted(expected)
    assert list(_resource_templates(documents)) == []  # no PyTorchJob left
    for template in templates:
        manifest = yaml.safe_load(template["resource"]["manifest"])
        validate_custom_resource(manifest)
        assert manifest == expected[template["name"]], template["name"]
        stage = manifest["metadata"]["labels"][STAGE_LABEL]
        assert manifest["spec"]["trainer"]["command"][:4] == ["torchrun", "--module", "stages", stage]
    watched = list(_resource_templates(documents, action="get", kind="TrainJob"))
    assert [t["name"].removesuffix("-wait") for t in watched] == [t["name"].removesuffix("-create") for t in templates]


def test_the_trainjob_validator_is_strict(spec: PipelineSpec) -> None:
    """Guard: a field a TrainJob does not have (a PyTorchJob's, or a pod field the override cannot set) fails."""
    stage = next(s for s in TRAINING_STAGES if spec.stage(s).enabled)
    manifest = trainjob.job_manifest(spec, stage)
    validate_custom_resource(manifest)
    misplaced = copy.deepcopy(manifest)
    misplaced["spec"]["podTemplateOverrides"][0]["spec"]["securityContext"] = {"runAsNonRoot": True}
    with pytest.raises(SchemaViolation, match="securityContext"):
        validate_custom_resource(misplaced)
    misplaced = copy.deepcopy(manifest)
    misplaced["spec"]["runPolicy"] = {"backoffLimit": 0}
    with pytest.raises(SchemaViolation, match="runPolicy"):
        validate_custom_resource(misplaced)


def test_embedded_manifests_are_plain_yaml(spec: PipelineSpec, compile_pipeline: Callable[..., Any]) -> None:
    """The manifest is shown in the Argo UI and read by people debugging a stage: no YAML anchors/aliases
    (they appear when the Master and Worker pod templates are one shared object when dumped)."""
    for template in _resource_templates(compile_pipeline(spec).documents()):
        manifest = template["resource"]["manifest"]
        events = list(yaml.parse(manifest, Loader=yaml.SafeLoader))
        anchored = [e for e in events if getattr(e, "anchor", None) or isinstance(e, yaml.AliasEvent)]
        assert not anchored, f"{template['name']}: manifest uses YAML anchors/aliases: {anchored[:2]}"


def test_resource_templates_create_and_watch(spec: PipelineSpec, compile_pipeline: Callable[..., Any]) -> None:
    documents = compile_pipeline(spec).documents()
    created = list(_resource_templates(documents))
    watched = list(_resource_templates(documents, action="get"))
    assert [t["name"].removesuffix("-create") for t in created] == [t["name"].removesuffix("-wait") for t in watched]
    for template in created:
        assert template["resource"].get("setOwnerReference") is True  # the job goes when the workflow goes
    for template in watched:
        resource = template["resource"]
        assert parse_selector(resource["successCondition"]), template["name"]
        assert parse_selector(resource["failureCondition"]), template["name"]
        # The object read: the job the create step named, in the namespace it was created in.
        metadata = yaml.safe_load(resource["manifest"])["metadata"]
        assert metadata == {"name": "{{inputs.parameters.job-name}}", "namespace": spec.cluster.namespace}


def test_workflow_and_cron_reference_the_template(spec: PipelineSpec, compile_pipeline: Callable[..., Any]) -> None:
    documents = compile_pipeline(spec).documents()
    template = documents["workflowtemplate.yaml"]
    declared = [p["name"] for p in template["spec"]["arguments"]["parameters"]]
    for filename in ("workflow.yaml", "cronworkflow.yaml"):
        if filename not in documents:
            continue
        doc = documents[filename]
        body = doc["spec"] if filename == "workflow.yaml" else doc["spec"]["workflowSpec"]
        assert body["workflowTemplateRef"] == {"name": template["metadata"]["name"]}, filename
        given = [p["name"] for p in body["arguments"]["parameters"]]
        assert given == declared, filename
        assert doc["metadata"]["namespace"] == template["metadata"]["namespace"] == spec.cluster.namespace


def test_the_argo_validator_is_strict(
    spec: PipelineSpec, compile_pipeline: Callable[..., Any], schemas_dir: Any
) -> None:
    """Guard: a misplaced field in a compiled document is an error, not silently ignored."""
    documents = compile_pipeline(spec).documents()
    template = copy.deepcopy(documents["workflowtemplate.yaml"])
    template["spec"]["templates"][0]["retryStrategy"] = {"limt": 1}
    with pytest.raises(SchemaViolation, match=r"spec\.templates\[0\]\.retryStrategy: .*'limt'"):
        validate_argo(template)
    workflow = copy.deepcopy(documents["workflow.yaml"])
    workflow["spec"]["arguments"]["parameters"][0]["value"] = {"not": "a string"}
    with pytest.raises(SchemaViolation, match=r"spec\.arguments\.parameters\[0\]\.value"):
        validate_argo(workflow)


@pytest.mark.parametrize(("required", "outcome"), [("", pytest.skip.Exception), ("1", pytest.fail.Exception)])
def test_missing_schemas_skip_unless_required(
    required: str, outcome: type[BaseException], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """CI sets POSTTRAIN_REQUIRE_SCHEMAS=1: there a test that needs the schemas fails without them, for the
    same reason it would skip elsewhere."""
    monkeypatch.setenv("POSTTRAIN_SHARED_DIR", str(tmp_path))
    monkeypatch.setenv("POSTTRAIN_REQUIRE_SCHEMAS", required)
    with pytest.raises(outcome, match=f"not found in {tmp_path}"):
        require_schemas()


def test_pod_spec_patches_are_strict_pod_specs(spec: PipelineSpec, compile_pipeline: Callable[..., Any]) -> None:
    """A template's podSpecPatch is a string to the Argo schema; Argo reads it as a PodSpec and merges it into the
    pod. Each one is a valid PodSpec (unknown fields fail), and a misspelt field would be caught."""
    templates = compile_pipeline(spec).documents()["workflowtemplate.yaml"]["spec"]["templates"]
    patches = {t["name"]: json.loads(t["podSpecPatch"]) for t in templates if "podSpecPatch" in t}
    prepare = f"{spec.variants[0].name}-prepare" if spec.variants else "prepare"
    assert prepare in patches
    for name, patch in patches.items():
        validate_core(pod_template_object({"spec": patch}, name=name))
    broken = copy.deepcopy(patches[prepare])
    broken["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(SchemaViolation, match="readOnlyRootFileSystem"):
        validate_core(pod_template_object({"spec": broken}, name="prepare"))


def test_embedded_experiments_validate_against_katibs_schema(
    spec: PipelineSpec, compile_pipeline: Callable[..., Any], schemas_dir: Any
) -> None:
    """Every pipeline with a search on each enabled training stage: the compiled documents still validate, and
    each stage's Katib Experiment validates strictly, its trial template as a PyTorchJob against the CRD."""
    from workflows.katib import experiment_manifest

    if spec.variants:  # refused by the spec (tests/test_variants.py)
        return
    document = spec.model_dump(mode="json", by_alias=True)
    document["cluster"]["job_kind"] = "pytorchjob"  # Katib runs the trials as PyTorchJobs
    enabled = [s for s in TRAINING_STAGES if spec.stage(s).enabled]
    for stage in enabled:
        document["stages"][stage]["hpo"] = {
            "objective": {"metric": "train_loss_last"},
            "parameters": [{"path": "training.learning_rate", "type": "log_uniform", "min": 1e-6, "max": 1e-4}],
            "max_trials": 4,
        }
    searched = PipelineSpec.model_validate(document)
    documents = compile_pipeline(searched).documents()
    for doc in documents.values():
        validate_argo(doc)
    created = list(_resource_templates(documents, kind="Experiment"))
    if not searched.variants:
        assert sorted(t["name"] for t in created) == sorted(f"{s}-hpo-create" for s in enabled)
    # With variants, each variant's chain has its own (`<variant>-<stage>-hpo-create`).
    assert {s for t in created for s in enabled if t["name"].endswith(f"{s}-hpo-create")} == set(enabled)
    for template in created:
        manifest = yaml.safe_load(template["resource"]["manifest"])
        validate_custom_resource(manifest)
        validate_pytorchjob(manifest["spec"]["trialTemplate"]["trialSpec"])
        assert manifest["metadata"]["labels"]["workflows.argoproj.io/workflow"] == "{{workflow.name}}"
        if not searched.variants:
            assert manifest == experiment_manifest(searched, template["name"].removesuffix("-hpo-create"))
    watched = list(_resource_templates(documents, action="get", kind="Experiment"))
    assert [t["name"].removesuffix("-wait") for t in watched] == [t["name"].removesuffix("-create") for t in created]
