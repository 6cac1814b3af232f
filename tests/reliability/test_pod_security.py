"""Every pod a compiled pipeline creates to run stage code runs restricted, with a read-only root filesystem and
no Kubernetes API token: non-root, no privilege escalation, all capabilities dropped, the RuntimeDefault seccomp
profile. Checked with tests/test_manifests.py's rule (which also covers the kit's own workloads, and the Role table
that keeps RBAC verbs minimal) on the PyTorchJob pods and on the pods of the Argo container templates: their main
container, and Argo's own init and wait containers as the template's podSpecPatch leaves them (Argo gives them no
securityContext of its own unless the controller's executor.securityContext is set). Pod-level settings of a
container template come from the workflow's securityContext and automountServiceAccountToken unless the template
sets its own.

The resource steps (create a PyTorchJob, apply the InferenceService) are the only pods that hold a token; Argo builds
their containers itself, with its restricted defaults (workflow/controller/workflowpod.go, MinimalCtrSC)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import PIPELINE_VARIANTS, fresh_spec, variant_id
from test_manifests import _container_issues

from spec.document import SpecError
from spec.loading import load_pipeline
from workflows.compile import compile_pipeline

Doc = dict[str, Any]

ARGO_EXECUTOR_IMAGE = "quay.io/argoproj/argoexec:v4.1.2"


def _strategic_merge_by_name(pod: Doc, patch: Doc) -> Doc:
    """`patch` (a podSpecPatch) applied as Kubernetes' strategic merge applies it to a PodSpec: containers and
    init containers merged by name (a name the pod lacks is added, as a container with no image), maps recursively,
    anything else replaced."""
    merged = copy.deepcopy(pod)
    for key, value in patch.items():
        if key in ("containers", "initContainers"):
            by_name = {c["name"]: c for c in merged.setdefault(key, [])}
            for item in value:
                target = by_name.get(item["name"])
                if target is None:
                    merged[key].append(copy.deepcopy(item))
                else:
                    _merge_maps(target, item)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            _merge_maps(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merge_maps(base: Doc, patch: Doc) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge_maps(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def argo_container_pod(workflow_spec: Doc, template: Doc) -> Doc:
    """The pod Argo's emissary executor (default layout) builds for a container template: its init container, the
    wait container and `main`, no securityContext on Argo's own containers, the pod-level settings of the template
    or else the workflow; then the template's podSpecPatch."""
    automount = template.get("automountServiceAccountToken", workflow_spec.get("automountServiceAccountToken"))
    pod: Doc = {
        "serviceAccountName": template.get("serviceAccountName", workflow_spec.get("serviceAccountName")),
        "securityContext": template.get("securityContext", workflow_spec.get("securityContext", {})),
        "initContainers": [{"name": "init", "image": ARGO_EXECUTOR_IMAGE}],
        "containers": [{"name": "wait", "image": ARGO_EXECUTOR_IMAGE}, {**template["container"], "name": "main"}],
    }
    if automount is False:  # Argo writes the field only when false
        pod["automountServiceAccountToken"] = False
    if "podSpecPatch" in template:
        pod = _strategic_merge_by_name(pod, json.loads(template["podSpecPatch"]))
    return pod


def compiled_pods(documents: dict[str, Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    """(where, pod spec, container) for every container of every pod that runs stage code."""
    spec = documents["workflowtemplate.yaml"]["spec"]
    for template in spec["templates"]:
        if "container" in template:
            pod = argo_container_pod(spec, template)
            for container in pod["initContainers"] + pod["containers"]:
                yield f"{template['name']}/{container['name']}", pod, container
        if "resource" in template:
            job = yaml.safe_load(template["resource"]["manifest"])
            # Only a created PyTorchJob has pods of ours: a wait step gets the job by name, and a TrainJob's pod
            # template is its ClusterTrainingRuntime's (tests/test_manifests.py checks the kit's).
            if job["kind"] != "PyTorchJob" or template["resource"]["action"] != "create":
                continue
            for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
                pod = replica["template"]["spec"]
                for container in pod["containers"]:
                    yield f"{template['name']}/{role}", pod, container


CONTROL_MODULES = {"workflows.cleanup", "workflows.rollout", "workflows.runs"}
"""The project's control-plane commands that run with the job-creating account's token: they load no model, data
or user module (README, "Security")."""


def control_steps(documents: dict[str, Doc]) -> set[str]:
    """The container templates that run a control-plane command (and so may hold a token)."""
    templates = documents["workflowtemplate.yaml"]["spec"]["templates"]
    return {
        t["name"]
        for t in templates
        if "container" in t
        and t["container"]["command"][:2] == ["python", "-m"]
        and t["container"]["command"][2] in CONTROL_MODULES
    }


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def test_every_compiled_pod_runs_restricted_read_only_and_without_a_token(variant: tuple[str, str | None]) -> None:
    spec = fresh_spec(*variant)
    documents = compile_pipeline(spec).documents()
    pods = list(compiled_pods(documents))
    wheres = {where for where, _, _ in pods}
    for prefix in [f"{v.name}-" for v in spec.variants] or [""]:  # a variant's templates carry its name
        assert {f"{prefix}prepare/init", f"{prefix}prepare/wait", f"{prefix}prepare/main"} <= wheres
    # A TrainJob's pods are its runtime's, checked with the kit (tests/test_manifests.py).
    assert any("/Master" in w for w in wheres) or spec.cluster.job_kind == "trainjob"
    controls = control_steps(documents)
    for where, pod, container in pods:
        assert _container_issues(pod, container, token=where.split("/")[0] in controls) == [], where
        assert "image" in container, f"{where}: the podSpecPatch names a container the pod does not have"


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def test_only_resource_and_control_steps_hold_a_token(variant: tuple[str, str | None]) -> None:
    spec = fresh_spec(*variant)
    documents = compile_pipeline(spec).documents()
    workflow = documents["workflowtemplate.yaml"]["spec"]
    holders = control_steps(documents)
    for template in workflow["templates"]:
        if "container" in template:
            pod = argo_container_pod(workflow, template)
            if template["name"] in holders:
                assert pod["serviceAccountName"] == spec.cluster.service_account, template["name"]
                continue
            assert pod["serviceAccountName"] == spec.cluster.pod_service_account, template["name"]
            assert pod.get("automountServiceAccountToken") is False, template["name"]
        elif "resource" in template:
            assert template["serviceAccountName"] == spec.cluster.service_account, template["name"]
            assert template["automountServiceAccountToken"] is True, template["name"]
    # The exit handler's cleanup, each training stage's reap, serve and retention (a variant's named after it):
    # nothing else.
    assert "cleanup" in holders
    own = {"serve", "retention"} | {f"{stage}-cleanup" for stage in ("cpt", "sft", "rlhf")}
    prefixes = [f"{v.name}-" for v in spec.variants] or [""]
    assert holders <= {"cleanup"} | {prefix + name for prefix in prefixes for name in own}


def test_the_pod_model_catches_a_patch_for_a_missing_container() -> None:
    """Guard: a podSpecPatch naming a container Argo does not create adds one without an image (an invalid pod)."""
    pod = argo_container_pod({}, {"container": {"image": "x"}, "podSpecPatch": '{"containers": [{"name": "waiter"}]}'})
    assert [c["name"] for c in pod["containers"]] == ["wait", "main", "waiter"]
    assert "image" not in pod["containers"][-1]


def test_without_the_executor_patch_argos_containers_are_not_restricted() -> None:
    """What cluster.executor_security_context=false leaves to the controller's executor.securityContext."""
    spec = fresh_spec("korean-llm")
    spec.cluster.executor_security_context = False
    documents = compile_pipeline(spec).documents()
    controls = control_steps(documents)
    issues = {
        where: _container_issues(pod, container, token=where.split("/")[0] in controls)
        for where, pod, container in compiled_pods(documents)
    }
    assert issues["prepare/wait"] == [
        "allowPrivilegeEscalation is not false",
        "capabilities do not drop ALL (or add some)",
        "the root filesystem is not read-only",
    ]
    assert issues["prepare/main"] == []


def test_without_a_uid_the_pods_still_refuse_root() -> None:
    spec = fresh_spec("korean-llm")
    spec.cluster.run_as_user = None  # the image's user: the kubelet then refuses to start it as root
    documents = compile_pipeline(spec).documents()
    controls = control_steps(documents)
    for where, pod, container in compiled_pods(documents):
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        token = where.split("/")[0] in controls
        assert _container_issues(pod, container, token=token) == [
            "no non-zero runAsUser (the images' USER is not trusted)"
        ]


def test_root_is_not_a_uid_the_spec_accepts() -> None:
    with pytest.raises(SpecError, match=r"cluster\.run_as_user.*non-root"):
        load_pipeline("korean-llm", overrides=["cluster.run_as_user=0"])
