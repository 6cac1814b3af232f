"""Every pod a compiled pipeline creates runs restricted: non-root, no privilege escalation, all capabilities
dropped, the RuntimeDefault seccomp profile. Checked with tests/test_manifests.py's rule (which also covers the
kit's own workloads, and the Role table that keeps RBAC verbs minimal) on the PyTorchJob pods and on the Argo
container templates, whose pod-level settings come from the workflow's securityContext."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import PIPELINE_VARIANTS, fresh_spec, variant_id
from test_manifests import _container_issues

from workflows.compile import compile_pipeline
from workflows.loading import SpecError, load_pipeline


def compiled_pods(documents: dict[str, dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, pod-level securityContext holder, container) for every container the template runs."""
    spec = documents["workflowtemplate.yaml"]["spec"]
    workflow_pod = {"securityContext": spec.get("securityContext", {})}
    for template in spec["templates"]:
        if "container" in template:
            yield template["name"], workflow_pod, template["container"]
        if "resource" in template:
            job = yaml.safe_load(template["resource"]["manifest"])
            if job["kind"] != "PyTorchJob":  # serve applies an InferenceService: KServe owns its pods
                continue
            for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
                pod = replica["template"]["spec"]
                for container in pod["containers"]:
                    yield f"{template['name']}/{role}", pod, container


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def test_every_compiled_pod_runs_restricted(variant: tuple[str, str | None]) -> None:
    documents = compile_pipeline(fresh_spec(*variant)).documents()
    pods = list(compiled_pods(documents))
    assert any("/Master" in where for where, _, _ in pods) and any("/" not in where for where, _, _ in pods)
    for where, pod, container in pods:
        assert _container_issues(pod, container) == [], where


def test_without_a_uid_the_pods_still_refuse_root() -> None:
    spec = fresh_spec("korean-llm")
    spec.cluster.run_as_user = None  # the image's user: the kubelet then refuses to start it as root
    for where, pod, container in compiled_pods(compile_pipeline(spec).documents()):
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert _container_issues(pod, container) == ["no non-zero runAsUser (the images' USER is not trusted)"]


def test_root_is_not_a_uid_the_spec_accepts() -> None:
    with pytest.raises(SpecError, match=r"cluster\.run_as_user.*non-root"):
        load_pipeline("korean-llm", overrides=["cluster.run_as_user=0"])
