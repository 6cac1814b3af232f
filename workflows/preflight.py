"""`python -m workflows.preflight`: is the cluster ready for this pipeline? Every check with the fix for each failure.

The checks are a table; each fix is a line of its own after it (`fix for CHECK: ...`), printed whole at any width
so that the commands in it can be copied.

    python -m workflows.preflight korean-llm
    python -m workflows.preflight qwen3-30b-a3b --profile qlora --set stages.sft.resources.nodes=1

Checks, against the cluster of the current kubeconfig context (or the in-cluster config):

- the CRDs the pipeline needs (PyTorchJob, or TrainJob with cluster.job_kind trainjob, Argo's
  Workflow/WorkflowTemplate, CronWorkflow when scheduled, InferenceService when deploying, Kueue's LocalQueue when
  a stage names a queue, Katib's Experiment when a stage searches hyperparameters), the ServingRuntime, and with
  job_kind trainjob the ClusterTrainingRuntime (a torch runtime whose first replicated job is `node`);
- the namespace; the three ServiceAccounts (the resource steps' account, which must not switch its token off; the
  stage pods' account; Argo's executor account and the token Secret Argo mounts from it); the two volumes (exist,
  Bound, ReadWriteMany);
- every Secret the spec names exists: only its metadata is requested (a PartialObjectMetadata GET), so no key
  or value is ever read; the keys inside cannot be known without reading the Secret and are not checked;
- for every GPU stage, enough nodes whose labels match its node_selector (and required node affinity), whose
  taints it tolerates and whose allocatable nvidia.com/gpu, cpu and memory cover gpus_per_node and the pod's
  requests (spec/sizing.py: the spec's, or derived from the model's size); its PriorityClass and queue;
- the Argo server (ARGO_SERVER, ARGO_TOKEN, ARGO_INSECURE_SKIP_VERIFY): set, reachable, and v3.6 or later when
  the pipeline is scheduled (CronWorkflow `schedules`). submit and register need it, so an unset ARGO_SERVER
  fails.

The exit status is 1 when a blocking check fails, 2 for a spec error, 0 otherwise (warnings do not block).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec
from spec.sizing import PodSize, pod_size, quantity
from spec.stage import Resources
from workflows import trainjob
from workflows.job_kinds import job_resource

Status = Literal["ok", "warn", "fail"]

MIN_ARGO_FOR_SCHEDULES = (3, 6)
"""CronWorkflow `schedules` (a list of cron expressions) came with Argo Workflows v3.6."""

REQUEST_TIMEOUT_S = 10.0
JSON = "application/json"
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
"""Accept header that makes the API server answer with an object's metadata alone (no data, no keys)."""
GPU_RESOURCE = "nvidia.com/gpu"
KIT_HINT = "kubectl apply -k manifests/overlays/<onprem|gke> (see manifests/README.md)"
ACCESS_HINT = (
    "ask for read access: bind the posttrain-preflight roles of manifests/components/preflight-access to your "
    "user or group"
)

CRDS: dict[str, tuple[str, str]] = {
    "pytorchjobs.kubeflow.org": (
        "v1",
        "install the Kubeflow Training Operator (v1.9): kubectl apply --server-side -k "
        "'github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.4'",
    ),
    "trainjobs.trainer.kubeflow.org": (
        "v1alpha1",
        "install Kubeflow Trainer (v2.1+): kubectl apply --server-side -k "
        "'github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.1.0', or set cluster.job_kind=pytorchjob",
    ),
    "experiments.kubeflow.org": (
        "v1beta1",
        "install Katib (v0.19) with PyTorchJob among its trial resources (see manifests/README.md), or drop the "
        "stage's hpo",
    ),
    "workflows.argoproj.io": ("v1alpha1", "install Argo Workflows (v3.6+): see https://argo-workflows.readthedocs.io"),
    "workflowtemplates.argoproj.io": ("v1alpha1", "install Argo Workflows (v3.6+)"),
    "cronworkflows.argoproj.io": ("v1alpha1", "install Argo Workflows (v3.6+)"),
    "inferenceservices.serving.kserve.io": (
        "v1beta1",
        "install KServe, or turn serving off with --set stages.deploy.serving.enabled=false",
    ),
    "localqueues.kueue.x-k8s.io": (
        "v1beta1",
        "install Kueue, or drop the queue with --set stages.<stage>.resources.queue=null",
    ),
}
"""CRD name → (version the pipeline uses, how to install it)."""


# --------------------------------------------------------------------------- report


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class PreflightReport:
    """What preflight found: `.ok` is False when any check failed."""

    pipeline: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No blocking check failed (warnings do not block)."""
        return all(c.status != "fail" for c in self.checks)

    def add(self, name: str, status: Status, detail: str, fix: str = "") -> Check:
        """Record a check."""
        check = Check(name, status, detail, fix if status != "ok" else "")
        self.checks.append(check)
        return check

    def failed(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if c.status == "fail"]

    def render(self) -> Any:
        """A rich Table of the checks; the fixes are lines of their own after it (`fix_lines`, `show`)."""
        from rich.table import Table
        from rich.text import Text

        styles = {"ok": "green", "warn": "yellow", "fail": "bold red"}
        table = Table(title=f"preflight: {self.pipeline}", show_lines=False, expand=False)
        table.add_column("check", no_wrap=True)
        table.add_column("status", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for c in self.checks:
            table.add_row(c.name, Text(c.status, style=styles[c.status]), Text(c.detail))
        return table

    def fix_lines(self) -> list[str]:
        """One line per check that did not pass and says how to fix it: 'fix for <check>: <fix>'. Printed whole, never
        wrapped, so that a command in it can be copied (a table cell would break it mid-word at 80 columns)."""
        return [f"fix for {c.name}: {' '.join(c.fix.split())}" for c in self.checks if c.status != "ok" and c.fix]

    def show(self, console: Any) -> None:
        """Print the table, then each fix on a line of its own that no console width wraps or cuts."""
        from rich.text import Text

        console.print(self.render())
        for line in self.fix_lines():
            console.print(Text(line), soft_wrap=True)

    def render_text(self, width: int = 200) -> str:
        """The table, the fixes and the verdict as plain text."""
        from rich.console import Console

        console = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
        self.show(console)
        console.print(self.verdict())
        text = console.export_text()
        console.file.close()
        return text

    def verdict(self) -> str:
        """One line: ready, or how many checks failed."""
        failed, warned = len(self.failed()), sum(c.status == "warn" for c in self.checks)
        if failed:
            return f"not ready: {failed} check(s) failed" + (f", {warned} warning(s)" if warned else "")
        return "ready" + (f" ({warned} warning(s))" if warned else "")


# --------------------------------------------------------------------------- Kubernetes access


class _Forbidden(Exception):
    """The API server answered 403."""


class _Unreachable(Exception):
    """No answer from the API server."""


class _Kube:
    """GETs against the API server through the kubernetes client's ApiClient; bodies are parsed as plain JSON."""

    def __init__(self, api_client: Any) -> None:
        self.api = api_client

    @property
    def host(self) -> str:
        return self.api.configuration.host

    def get(self, path: str, accept: str = JSON) -> dict[str, Any] | None:
        """The object at `path`, or None when it does not exist (404)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = self.api.call_api(
                path,
                "GET",
                header_params={"Accept": accept},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status in (401, 403):
                raise _Forbidden(f"{exc.status} {exc.reason}") from None
            raise _Unreachable(f"{exc.status} {exc.reason} for GET {path}") from None
        except (HTTPError, OSError) as exc:
            raise _Unreachable(f"{type(exc).__name__}") from None
        try:
            body = json.loads(response.data)
        except ValueError:  # e.g. a proxy's HTML login page answering 200
            body = None
        if not isinstance(body, dict):
            raise _Unreachable(f"GET {path} returned a body that is not a JSON object, e.g. a proxy's HTML page")
        return body


def _default_api_client() -> Any:
    """An ApiClient from the kubeconfig, else from the in-cluster service account; ValueError when neither."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        return config.new_client_from_config()
    except (ConfigException, OSError, TypeError) as kube_exc:
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException:
            raise ValueError(f"no kubeconfig ({kube_exc}) and not running in a pod") from None
        return client.ApiClient(configuration)


# --------------------------------------------------------------------------- the checks


def _guarded(report: PreflightReport, name: str, fn: Callable[[], None]) -> None:
    """Run one check; a 403 becomes a warning (not checked), anything unreachable a failure."""
    try:
        fn()
    except _Forbidden as exc:
        report.add(name, "warn", f"not checked: the API server refused the read ({exc})", ACCESS_HINT)


def _needed_crds(spec: PipelineSpec) -> list[str]:
    crds = ["workflows.argoproj.io", "workflowtemplates.argoproj.io"]
    if any(spec.stage(s).enabled for s in TRAINING_STAGES):
        group, _, plural = job_resource(spec.cluster.job_kind)
        crds.insert(0, f"{plural}.{group}")
    if any(getattr(spec.stage(s), "hpo", None) is not None for s in spec.stages.enabled()):
        crds.append("experiments.kubeflow.org")
    if spec.schedule.cron:
        crds.append("cronworkflows.argoproj.io")
    if spec.stages.deploy.enabled and spec.stages.deploy.serving.enabled:
        crds.append("inferenceservices.serving.kserve.io")
    if any(spec.stage(s).resources.queue for s in spec.stages.enabled()):
        crds.append("localqueues.kueue.x-k8s.io")
    return crds


def _check_crds(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    for name in _needed_crds(spec):
        version, install = CRDS[name]

        def check(name: str = name, version: str = version, install: str = install) -> None:
            crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            if crd is None:
                report.add(f"CRD {name}", "fail", "not installed", install)
                return
            served = [v["name"] for v in crd.get("spec", {}).get("versions", []) if v.get("served")]
            if version not in served:
                report.add(f"CRD {name}", "fail", f"{version} is not served (served: {', '.join(served)})", install)
            else:
                report.add(f"CRD {name}", "ok", f"{version} served")

        _guarded(report, f"CRD {name}", check)


def _check_training_runtime(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    """With job_kind trainjob: the ClusterTrainingRuntime the TrainJobs name exists, has a torch ML policy, and
    lists `node` first (the success condition reads that job's status at index 0: workflows/trainjob.py)."""
    if spec.cluster.job_kind != "trainjob" or not any(spec.stage(s).enabled for s in TRAINING_STAGES):
        return
    runtime = spec.cluster.training_runtime
    name = f"clustertrainingruntime {runtime}"
    fix = f"{KIT_HINT} with components/trainer-v2, or set cluster.training_runtime"

    def check() -> None:
        body = kube.get(f"/apis/{trainjob.API_GROUP}/v1alpha1/{trainjob.RUNTIME_PLURAL}/{runtime}")
        if body is None:
            report.add(name, "fail", "no ClusterTrainingRuntime of that name", fix)
            return
        spec_ = body.get("spec") or {}
        jobs = [j.get("name") for j in ((spec_.get("template") or {}).get("spec") or {}).get("replicatedJobs") or []]
        if "torch" not in (spec_.get("mlPolicy") or {}):
            report.add(
                name, "fail", "has no torch ML policy (mlPolicy.torch): nothing sets torchrun's PET_* variables", fix
            )
        elif not jobs or jobs[0] != trainjob.NODE:
            found = ", ".join(str(j) for j in jobs) or "none"
            report.add(
                name,
                "fail",
                f"its first replicated job must be `{trainjob.NODE}` (found: {found}): the stages' wait reads it there",
                fix,
            )
        else:
            report.add(name, "ok", f"torch runtime, replicated jobs: {', '.join(jobs)}")

    _guarded(report, name, check)


def _check_namespace(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> bool:
    """The namespace check; False when the namespace is missing (the namespaced checks are then skipped)."""
    ns = spec.cluster.namespace
    name = f"namespace {ns}"
    try:
        obj = kube.get(f"/api/v1/namespaces/{ns}")
    except _Forbidden as exc:
        report.add(name, "warn", f"not checked ({exc})", ACCESS_HINT)
        return True
    if obj is None:
        report.add(name, "fail", "does not exist", f"{KIT_HINT}, or set cluster.namespace to an existing namespace")
        return False
    if obj.get("status", {}).get("phase") == "Terminating":
        report.add(name, "fail", "is being deleted", "wait for the deletion to finish, then apply the kit again")
        return False
    report.add(name, "ok", "exists")
    return True


ARGO_TOKEN_ANNOTATION = "workflows.argoproj.io/service-account-token.name"


def executor_token_secret(account: dict[str, Any], name: str) -> str:
    """The Secret whose token Argo mounts into its init and wait containers for executor account `name`, found as
    Argo finds it: the account's first listed secret, else the one its annotation names, else
    `<name>.service-account-token`."""
    listed = account.get("secrets") or []
    if listed and listed[0].get("name"):
        return str(listed[0]["name"])
    annotations = account.get("metadata", {}).get("annotations") or {}
    return str(annotations.get(ARGO_TOKEN_ANNOTATION) or f"{name}.service-account-token")


def _check_service_accounts(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    cluster, ns = spec.cluster, spec.cluster.namespace
    roles = {
        "service_account": "the steps that create the jobs and the InferenceService",
        "pod_service_account": "the pods that run stage code",
        "executor_service_account": "Argo's init and wait containers",
    }
    accounts: dict[str, list[str]] = {}
    for field_name in roles:
        accounts.setdefault(getattr(cluster, field_name), []).append(field_name)
    for sa, fields in accounts.items():
        name = f"serviceaccount {sa}"
        uses = "; ".join(roles[f] for f in fields)

        def check(sa: str = sa, fields: list[str] = fields, name: str = name, uses: str = uses) -> None:
            account = kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}")
            if account is None:
                fix = f"{KIT_HINT}, or set {' / '.join('cluster.' + f for f in fields)}"
                report.add(name, "fail", f"not found in {ns} ({uses})", fix)
                return
            if "service_account" in fields and account.get("automountServiceAccountToken") is False:
                report.add(
                    name,
                    "fail",
                    "sets automountServiceAccountToken: false: the resource steps would run without a token (Argo "
                    "writes only `false` into a pod, so the account's setting decides)",
                    f"kubectl -n {ns} patch serviceaccount {sa} --type json "
                    '-p \'[{"op": "remove", "path": "/automountServiceAccountToken"}]\'',
                )
                return
            report.add(name, "ok", f"exists ({uses})")
            if "executor_service_account" in fields:
                _check_executor_token(kube, ns, sa, executor_token_secret(account, sa), report)

        _guarded(report, name, check)


def _check_executor_token(kube: _Kube, ns: str, account: str, secret: str, report: PreflightReport) -> None:
    """The token Secret Argo mounts into its init and wait containers (Kubernetes 1.24+ creates none by itself)."""
    name = f"secret {secret}"

    try:
        exists = _secret_exists(kube, ns, secret)
    except _Forbidden as exc:
        # preflight-access does not grant it: the token may write any step's outputs, evaluate's gate among them.
        fix = f"a namespace administrator can check it: kubectl -n {ns} get secret {secret}"
        report.add(name, "warn", f"not checked: the API server refused the read ({exc})", fix)
        return
    if exists:
        report.add(name, "ok", f"exists (the token of {account} that Argo's init and wait containers use)")
        return
    fix = (
        f"{KIT_HINT} (serviceaccounts.yaml creates it), or create a Secret {secret} of type "
        f"kubernetes.io/service-account-token annotated kubernetes.io/service-account.name: {account}"
    )
    report.add(name, "fail", f"not found in {ns}: Argo cannot start the pods that run stage code", fix)


def _check_volumes(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    ns = spec.cluster.namespace
    for role, volume in (("datasets", spec.cluster.datasets), ("checkpoints", spec.cluster.checkpoints)):
        name = f"pvc {volume.claim_name} ({role})"

        def check(volume: Any = volume, name: str = name, role: str = role) -> None:
            pvc = kube.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{volume.claim_name}")
            if pvc is None:
                fix = f"{KIT_HINT}, or set cluster.{role}.claim_name to an existing ReadWriteMany PVC"
                report.add(name, "fail", f"not found in {ns}", fix)
                return
            phase = pvc.get("status", {}).get("phase", "Unknown")
            modes = pvc.get("status", {}).get("accessModes") or pvc.get("spec", {}).get("accessModes", [])
            shared = "ReadWriteMany" in modes or (volume.read_only and "ReadOnlyMany" in modes)
            if phase != "Bound":
                storage_class = pvc.get("spec", {}).get("storageClassName") or "the default class"
                fix = (
                    f"`kubectl -n {ns} describe pvc {volume.claim_name}`: check that storage class "
                    f"{storage_class} exists and can provision ReadWriteMany volumes"
                )
                report.add(name, "fail", f"{phase}, not Bound", fix)
            elif not shared:
                fix = "use a ReadWriteMany storage class (NFS, Filestore, CephFS...): pods of a run land on many nodes"
                report.add(name, "fail", f"access modes {', '.join(modes) or 'none'}: not ReadWriteMany", fix)
            else:
                report.add(name, "ok", f"Bound, {', '.join(modes)}")

        _guarded(report, name, check)


def _secret_refs(spec: PipelineSpec) -> dict[str, set[str]]:
    """Secret name → keys the spec reads from it (image pull secrets: no particular key)."""
    refs: dict[str, set[str]] = {}
    secrets = spec.cluster.secrets
    for field_name in type(secrets).model_fields:
        ref = getattr(secrets, field_name)
        if ref is not None:
            refs.setdefault(ref.name, set()).add(ref.key)
    for pull_secret in spec.cluster.image_pull_secrets:
        refs.setdefault(pull_secret, set())
    return refs


def _secret_exists(kube: _Kube, ns: str, name: str) -> bool:
    """Whether the Secret exists, from its metadata alone: its keys and values are never requested."""
    return kube.get(f"/api/v1/namespaces/{ns}/secrets/{name}", accept=METADATA_ONLY) is not None


def _check_secrets(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    ns = spec.cluster.namespace
    for secret, wanted in sorted(_secret_refs(spec).items()):
        name = f"secret {secret}"

        def check(secret: str = secret, wanted: set[str] = wanted, name: str = name) -> None:
            if _secret_exists(kube, ns, secret):
                keys = f" (keys are not read; the spec expects {', '.join(sorted(wanted))})" if wanted else ""
                report.add(name, "ok", "exists" + keys)
                return
            create = f"kubectl -n {ns} create secret generic {secret} " + " ".join(
                f"--from-literal={k}=..." for k in sorted(wanted)
            )
            report.add(name, "fail", f"not found in {ns}", create.strip() + " (see manifests/secrets.example.yaml)")

        _guarded(report, name, check)


# --------------------------------------------------------------------------- GPU nodes


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator", "Equal") == "Exists":
            if t.get("key") in (None, taint.get("key")):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _expression_holds(labels: dict[str, str], expr: dict[str, Any]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt") and key in labels and values:
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def _affinity_holds(labels: dict[str, str], affinity: dict[str, Any] | None) -> bool:
    """Required node affinity: any term whose expressions all hold (matchFields are not evaluated)."""
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    terms = required.get("nodeSelectorTerms") or []
    return any(all(_expression_holds(labels, e) for e in term.get("matchExpressions") or []) for term in terms)


def _gpus(node: dict[str, Any]) -> int:
    raw = str(node.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE, "0"))
    return int(raw) if raw.isdigit() else 0


@dataclass
class _NodeFit:
    """Why each node does or does not fit a stage."""

    fits: list[str] = field(default_factory=list)
    wrong_labels: dict[str, list[str]] = field(default_factory=dict)  # node → label mismatches
    untolerated: dict[str, list[str]] = field(default_factory=dict)  # node → taints
    too_few_gpus: dict[str, int] = field(default_factory=dict)  # node → allocatable GPUs
    too_small: dict[str, list[str]] = field(default_factory=dict)  # node → what its allocatable cpu/memory lacks
    cordoned: list[str] = field(default_factory=list)


def _short_of(node: dict[str, Any], size: PodSize) -> list[str]:
    """What of the pod's CPU and memory requests the node's allocatable amounts cannot hold (an amount the node
    does not report is not checked)."""
    allocatable = node.get("status", {}).get("allocatable", {})
    short = []
    for resource, wanted in (("cpu", size.cpu), ("memory", size.memory)):
        have = allocatable.get(resource)
        try:
            if have is not None and quantity(str(have)) < quantity(wanted):
                short.append(f"{resource} {wanted} (node: {have})")
        except ValueError:
            continue
    return short


def _fit(nodes: Iterable[dict[str, Any]], res: Resources, size: PodSize) -> _NodeFit:
    tolerations = [t.to_k8s() for t in res.tolerations]
    fit = _NodeFit()
    for node in nodes:
        name = node["metadata"]["name"]
        labels = node["metadata"].get("labels") or {}
        mismatches = [
            f"{k}={v} (node: {labels.get(k, 'unset')})" for k, v in res.node_selector.items() if labels.get(k) != v
        ]
        if not _affinity_holds(labels, res.affinity):
            mismatches.append("required nodeAffinity")
        taints = [
            f"{t['key']}{'=' + t['value'] if t.get('value') else ''}:{t['effect']}"
            for t in node.get("spec", {}).get("taints") or []
            if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, t)
        ]
        if mismatches:
            fit.wrong_labels[name] = mismatches
        elif taints:
            fit.untolerated[name] = taints
        elif _gpus(node) < res.gpus_per_node:
            fit.too_few_gpus[name] = _gpus(node)
        elif short := _short_of(node, size):
            fit.too_small[name] = short
        elif node.get("spec", {}).get("unschedulable"):
            fit.cordoned.append(name)
        else:
            fit.fits.append(name)
    return fit


def _fewer_gpus_fix(spec: PipelineSpec, stage: str, most: int) -> str:
    """What to set when the nodes have at most `most` GPUs: a GPU count the stage's tensor- and expert-parallel
    groups divide (they stay inside one node) and whose total over the nodes its pipeline stages divide, or, where
    none fits, smaller groups."""
    section = spec.stage(stage)
    distributed = getattr(section, "distributed", None)
    group = math.lcm(distributed.tensor_parallel, distributed.expert_parallel) if distributed is not None else 1
    stages = distributed.pipeline_parallel if distributed is not None else 1
    fitting = most - most % group
    while fitting > 0 and (section.resources.nodes * fitting) % stages:
        fitting -= group
    if fitting == 0:
        return (
            f"add nodes of {group} GPUs or more, or lower stages.{stage}.distributed.tensor_parallel/expert_parallel/"
            f"pipeline_parallel (their groups of {group} GPUs stay inside one node, and the pipelines take "
            f"{stages} GPUs each; these nodes have at most {most})"
        )
    multiple = f" (a multiple of {group}: the tensor/expert-parallel groups stay inside one node)" if group > 1 else ""
    if stages > 1:
        multiple += f" (with {section.resources.nodes} nodes, a total the {stages} pipeline stages divide)"
    return f"lower stages.{stage}.resources.gpus_per_node to {fitting} or less{multiple}, or add bigger nodes"


def _check_gpu_stage(spec: PipelineSpec, stage: str, nodes: list[dict[str, Any]], report: PreflightReport) -> None:
    res, size = spec.stage(stage).resources, pod_size(spec, stage)
    name = f"gpu nodes: {stage}"
    want = f"{res.nodes} node(s) × {res.gpus_per_node} {GPU_RESOURCE}, cpu {size.cpu}, memory {size.memory}"
    fit = _fit(nodes, res, size)
    if len(fit.fits) >= res.nodes:
        report.add(name, "ok", f"{len(fit.fits)} node(s) fit, {want} needed (allocatable, not free)")
        return
    gpu_nodes = [n for n in nodes if _gpus(n) > 0]
    reasons = [f"{len(fit.fits)} of {len(nodes)} node(s) fit; {want} needed"]
    fixes = []
    if fit.wrong_labels:
        example = next(iter(fit.wrong_labels.items()))
        reasons.append(f"{len(fit.wrong_labels)} do not match the labels, e.g. {example[0]}: {'; '.join(example[1])}")
        products = sorted({n["metadata"].get("labels", {}).get("nvidia.com/gpu.product", "") for n in gpu_nodes} - {""})
        hint = f" (GPU nodes here have nvidia.com/gpu.product: {', '.join(products)})" if products else ""
        fixes.append(f"set stages.{stage}.resources.node_selector/affinity to labels the GPU nodes have{hint}")
    if fit.untolerated:
        taints = sorted({t for ts in fit.untolerated.values() for t in ts})
        reasons.append(f"{len(fit.untolerated)} have taints the stage does not tolerate: {', '.join(taints)}")
        fixes.append(f"add tolerations for {', '.join(taints)} to stages.{stage}.resources.tolerations")
    if fit.too_few_gpus:
        most = max(fit.too_few_gpus.values())
        reasons.append(f"{len(fit.too_few_gpus)} have fewer than {res.gpus_per_node} GPUs (at most {most})")
        fixes.append(_fewer_gpus_fix(spec, stage, most))
    if fit.too_small:
        example = next(iter(fit.too_small.items()))
        short = "; ".join(example[1])
        reasons.append(f"{len(fit.too_small)} cannot hold the pod's requests, e.g. {example[0]}: {short}")
        fixes.append(
            f"set stages.{stage}.resources.cpu/memory to what the nodes allocate (unset, they are derived from the "
            "model's size), or add bigger nodes"
        )
    if fit.cordoned:
        reasons.append(f"{len(fit.cordoned)} cordoned: {', '.join(fit.cordoned)}")
        fixes.append("uncordon the nodes (kubectl uncordon)")
    if fit.fits:
        fixes.append(f"lower stages.{stage}.resources.nodes to {len(fit.fits)}, or add matching nodes")
    if not nodes:
        fixes.append("no nodes are visible: check the kubeconfig context")
    report.add(name, "fail", "; ".join(reasons), "; ".join(fixes))


def _check_gpus(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    stages = [s for s in spec.stages.enabled() if spec.stage(s).resources.gpus_per_node > 0]
    if not stages:
        return

    def check() -> None:
        listing = kube.get("/api/v1/nodes") or {}
        nodes = listing.get("items", [])
        for stage in stages:
            _check_gpu_stage(spec, stage, nodes, report)

    _guarded(report, "gpu nodes", check)


def _check_scheduling(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    ns = spec.cluster.namespace
    priority_classes = sorted(
        {r.priority_class for s in spec.stages.enabled() if (r := spec.stage(s).resources).priority_class}
    )
    queues = sorted({r.queue for s in spec.stages.enabled() if (r := spec.stage(s).resources).queue})
    for pc in priority_classes:
        name = f"priorityclass {pc}"

        def check_pc(pc: str = pc, name: str = name) -> None:
            if kube.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/{pc}") is None:
                fix = "apply manifests/components/priority-class (cluster admin), or unset resources.priority_class"
                report.add(name, "fail", "does not exist: the stage's pods would be rejected", fix)
            else:
                report.add(name, "ok", "exists")

        _guarded(report, name, check_pc)
    for queue in queues:
        name = f"localqueue {queue}"

        def check_queue(queue: str = queue, name: str = name) -> None:
            if kube.get(f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{ns}/localqueues/{queue}") is None:
                fix = "apply manifests/components/kueue (or create the LocalQueue), or unset resources.queue"
                report.add(name, "fail", f"not found in {ns}: Kueue would hold the jobs forever", fix)
            else:
                report.add(name, "ok", "exists")

        _guarded(report, name, check_queue)


def _check_serving_runtime(kube: _Kube, spec: PipelineSpec, report: PreflightReport) -> None:
    if not (spec.stages.deploy.enabled and spec.stages.deploy.serving.enabled):
        return
    runtime, ns = spec.stages.deploy.serving.runtime, spec.cluster.namespace
    name = f"servingruntime {runtime}"

    def check() -> None:
        if kube.get(f"/apis/serving.kserve.io/v1alpha1/namespaces/{ns}/servingruntimes/{runtime}") is not None:
            report.add(name, "ok", f"exists in {ns}")
        elif kube.get(f"/apis/serving.kserve.io/v1alpha1/clusterservingruntimes/{runtime}") is not None:
            report.add(name, "ok", "exists as a ClusterServingRuntime")
        else:
            fix = f"{KIT_HINT} (components/kserve-vllm), or set stages.deploy.serving.runtime"
            report.add(name, "fail", "no ServingRuntime or ClusterServingRuntime of that name", fix)

    _guarded(report, name, check)


# --------------------------------------------------------------------------- Argo server


def _parse_version(raw: str) -> tuple[int, int, int] | None:
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", raw.strip())
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


def _check_argo(spec: PipelineSpec, argo_server: str | None, report: PreflightReport) -> None:
    import requests

    from workflows.argo import ArgoConfig, ArgoError

    name = "argo server"
    env = dict(os.environ)
    if argo_server:
        env["ARGO_SERVER"] = argo_server
    if not env.get("ARGO_SERVER", "").strip():
        report.add(
            name,
            "fail",
            "ARGO_SERVER is unset: submit and register talk to the Argo server",
            'set ARGO_SERVER and ARGO_TOKEN, e.g. ARGO_SERVER=localhost:2746 ARGO_TOKEN="$(argo auth token)" after '
            "`kubectl -n argo port-forward svc/argo-server 2746:2746`",
        )
        return
    try:
        config = ArgoConfig.from_env(spec.cluster.namespace, env)  # the same settings submit uses
    except ArgoError as exc:
        report.add(name, "fail", str(exc), "fix the ARGO_* variables")
        return
    url = config.api_root + "api/v1/version"
    headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
    verify = config.verify_tls
    try:
        resp = requests.get(url, headers=headers, timeout=REQUEST_TIMEOUT_S, verify=verify)
    except requests.exceptions.SSLError:
        report.add(name, "fail", f"TLS failed for {url}", "set ARGO_INSECURE_SKIP_VERIFY=true for a self-signed cert")
        return
    except requests.RequestException as exc:
        report.add(name, "fail", f"cannot reach {url} ({type(exc).__name__})", "check ARGO_SERVER (host:port or URL)")
        return
    if resp.status_code in (401, 403):
        report.add(name, "fail", f"{resp.status_code} from {url}", 'set ARGO_TOKEN (e.g. "$(argo auth token)")')
        return
    try:
        raw = str(resp.json().get("version", "")) if resp.ok else ""
    except ValueError:
        raw = ""
    if not raw:
        fix = "check ARGO_SERVER and ARGO_BASE_HREF (the server's path prefix)"
        report.add(name, "fail", f"no Argo version at {url} (HTTP {resp.status_code})", fix)
        return
    version = _parse_version(raw)
    if not spec.schedule.cron:
        report.add(name, "ok", f"{raw} at {config.server}{config.base_href}")
    elif version is None:
        report.add(name, "warn", f"version {raw!r} is not a release: cannot tell whether it supports `schedules`")
    elif version[:2] < MIN_ARGO_FOR_SCHEDULES:
        need = ".".join(map(str, MIN_ARGO_FOR_SCHEDULES))
        fix = f"upgrade Argo Workflows to v{need}+, or register without a schedule (--set schedule.cron=[])"
        report.add(name, "fail", f"{raw}: the pipeline is scheduled and CronWorkflow `schedules` needs v{need}+", fix)
    else:
        report.add(name, "ok", f"{raw} (schedules supported)")


# --------------------------------------------------------------------------- entry points


def run_preflight(spec: PipelineSpec, kube_api_client: Any = None, argo_server: str | None = None) -> PreflightReport:
    """Check the cluster for `spec`. `kube_api_client`: a kubernetes ApiClient (default: kubeconfig or
    in-cluster); `argo_server`: the Argo server's URL or host:port (default: ARGO_SERVER)."""
    report = PreflightReport(pipeline=spec.name)
    if kube_api_client is None:
        try:
            kube_api_client = _default_api_client()
        except ValueError as exc:
            report.add(
                "cluster access",
                "fail",
                str(exc),
                "set KUBECONFIG or pick a context (`kubectl config use-context NAME`)",
            )
            _check_argo(spec, argo_server, report)
            return report
    kube = _Kube(kube_api_client)
    try:
        _check_crds(kube, spec, report)
        _check_training_runtime(kube, spec, report)
        if _check_namespace(kube, spec, report):
            _check_service_accounts(kube, spec, report)
            _check_volumes(kube, spec, report)
            _check_secrets(kube, spec, report)
            _check_serving_runtime(kube, spec, report)
        _check_scheduling(kube, spec, report)
        _check_gpus(kube, spec, report)
    except _Unreachable as exc:
        report.add(
            "cluster access",
            "fail",
            f"no usable answer from the Kubernetes API at {kube.host} ({exc})",
            "check the kubeconfig context and that the cluster is reachable (`kubectl get ns`); the server URL must "
            "be the API server itself, not a proxy's login page",
        )
    _check_argo(spec, argo_server, report)
    return report


def parser() -> argparse.ArgumentParser:
    """The command line."""
    from workflows.commands import add_version_option

    p = argparse.ArgumentParser(
        prog="python -m workflows.preflight",
        description="Check that the cluster has what the pipeline needs, in the pipeline's cluster.namespace: a table "
        "of the checks, then one `fix for CHECK: ...` line (never wrapped) per check that did not pass; exit 1 when a "
        "blocking check fails.",
    )
    add_version_option(p)
    p.add_argument("pipeline", metavar="NAME|PATH", help="A pipeline of workflows/pipelines/ or a YAML file.")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE", help="Override a spec field."
    )
    p.add_argument("--profile", help="Merge the named profile of the spec before the --set overrides.")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print the table and the fixes; returns the exit code."""
    from rich.console import Console

    from spec.document import SpecError
    from spec.loading import load_pipeline

    args = parser().parse_args(argv)
    try:
        spec = load_pipeline(args.pipeline, args.profile, args.overrides).spec
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from spec.variants import variant_specs

    console, ok = Console(), True
    for run_spec in list(variant_specs(spec).values()) or [spec]:  # each variant's own GPUs, volumes, model
        report = run_preflight(run_spec)
        report.show(console)
        console.print(report.verdict())
        ok = ok and report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
