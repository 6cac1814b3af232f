"""The cluster kit in manifests/: every overlay builds, every object validates, and the settings the pipelines
rely on (names, pod security, least-privilege RBAC) hold.

The overlays are built in Python by `build()` (tests/kustomize.py), a small kustomize for exactly the features the
kit uses: `resources`, `components`, `namespace` (with the Namespace object and ServiceAccount subjects following
it), `patches` (strategic-merge patch files, `$patch: delete` included, and inline JSON 6902 patches with a target,
where a renamed ServiceAccount or PVC carries its references along), `replacements`, `configMapGenerator` (files,
labels and annotations, without the name hash), and dropping `config.kubernetes.io/local-config` resources. CI has
no usable kubectl (Debian's kubernetes-client ships kustomize v2, which predates components and replacements), so
the tests do not need one; where a kubectl with kustomize v5 is on the PATH, `test_build_matches_kubectl_kustomize`
checks that `build()` gives exactly what `kubectl kustomize` gives, so the Python build cannot drift from the real
one unnoticed."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kustomize import (
    BUILDS,
    CLUSTER_SCOPED,
    CRD_KINDS,
    K8S_VERSION,
    MANIFESTS,
    OVERLAY_PIPELINES,
    OVERLAYS,
    Doc,
    _all_objects,
    _by_id,
    _find,
    _kubectl_kustomize,
    _load_docs,
    _matches,
    _pod_specs,
    build,
)
from schema_validation import SchemaViolation, validate_custom_resource
from test_rbac import PREFLIGHT_CRDS, _roles_bound_to, identity_problems

from spec.loading import load_pipeline

# --------------------------------------------------------------------------- a small kustomize


# --------------------------------------------------------------------------- building


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_build_matches_kubectl_kustomize(name: str) -> None:
    kubectl = _kubectl_kustomize()
    if kubectl is None:
        pytest.skip("no kubectl with kustomize v4+ on PATH: the overlays are checked with the Python build only")
    out = subprocess.run([kubectl, "kustomize", str(BUILDS[name])], capture_output=True, text=True, check=True)
    assert _by_id(build(BUILDS[name])) == _by_id(_load_docs_text(out.stdout))


def _load_docs_text(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_every_manifest_file_is_part_of_a_build() -> None:
    """A YAML file no kustomization names is never applied: only the secrets template may be one."""
    named: set[Path] = set()
    for kustomization in MANIFESTS.rglob("kustomization.yaml"):
        k = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
        named.add(kustomization)
        for ref in k.get("resources", []) + [p["path"] for p in k.get("patches", []) if "path" in p]:
            named.add((kustomization.parent / ref).resolve())
    loose = {p.relative_to(MANIFESTS) for p in MANIFESTS.rglob("*.yaml") if p.resolve() not in named}
    assert loose == {Path("secrets.example.yaml")}


# --------------------------------------------------------------------------- validation


RUNTIME_POD_FIELDS = {"containers", "volumes", "nodeSelector", "tolerations", "affinity", "imagePullSecrets"}
"""The ServingRuntime fields that KServe copies into the predictor's PodSpec."""


def _runtime_pod(doc: Doc) -> Doc:
    """The runtime's PodSpec fields as a core Pod, for kubernetes-validate."""
    spec = {k: v for k, v in doc["spec"].items() if k in RUNTIME_POD_FIELDS}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": doc["metadata"]["name"]}, "spec": spec}


def _kubernetes_error(doc: Doc) -> str | None:
    """kubernetes-validate's strict verdict on a core object, at the oldest Kubernetes the kit supports."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return str(exc.message)
    return None


def test_every_object_validates(builds: dict[str, list[Doc]]) -> None:
    """Core kinds against the Kubernetes schema, ServingRuntimes against KServe's and LocalQueues against Kueue's
    (tests/schemas); strict: unknown fields fail."""
    checked = dict.fromkeys(CRD_KINDS, 0)
    for where, doc in _all_objects(builds):
        what = f"{where}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] not in CRD_KINDS:
            assert (error := _kubernetes_error(doc)) is None, f"{what}: {error}"
            continue
        try:
            validate_custom_resource(doc)
        except SchemaViolation as exc:
            pytest.fail(f"{where}: {exc}")
        checked[doc["kind"]] += 1
        if doc["kind"] == "ServingRuntime":
            # KServe's schema embeds a newer Kubernetes' Pod fields; the oldest one the kit supports must know them.
            assert (error := _kubernetes_error(_runtime_pod(doc))) is None, f"{what}: {error}"
        for pod in _pod_specs(doc) if doc["kind"] == "ClusterTrainingRuntime" else []:
            # The Trainer's CRD embeds its Kubernetes' Pod fields too.
            pod_doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": doc["metadata"]["name"]}, "spec": pod}
            assert (error := _kubernetes_error(pod_doc)) is None, f"{what}: {error}"
    assert all(checked.values()), checked


def test_validation_catches_an_unknown_field() -> None:
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_custom_resource_validation_is_strict(builds: dict[str, list[Doc]]) -> None:
    """Guard: a misplaced field or a missing required one in the kit's ServingRuntime or LocalQueue fails."""
    runtime = copy.deepcopy(_find(builds["onprem"], "ServingRuntime", "kserve-vllm"))
    runtime["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(SchemaViolation, match=r"spec\.containers\[0\]: .*'resource' was unexpected"):
        validate_custom_resource(runtime)
    del runtime["spec"]["containers"]
    with pytest.raises(SchemaViolation, match=r"spec: 'containers' is a required property"):
        validate_custom_resource(runtime)
    queue = copy.deepcopy(_find(builds["onprem"], "LocalQueue", "h100-training"))
    queue["spec"]["stopPolicy"] = "Drain"
    with pytest.raises(SchemaViolation, match=r"spec\.stopPolicy: 'Drain' is not one of"):
        validate_custom_resource(queue)
    del queue["spec"]["clusterQueue"]
    with pytest.raises(SchemaViolation, match=r"spec: 'clusterQueue' is a required property"):
        validate_custom_resource(queue)


def test_no_image_is_floating(builds: dict[str, list[Doc]]) -> None:
    for where, doc in _all_objects(builds):
        for pod in _pod_specs(doc):
            for container in pod.get("containers", []):
                image = container["image"]
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                assert tag and tag != "latest", f"{where}: {doc['metadata']['name']} uses {image} (pin a tag)"


# --------------------------------------------------------------------------- pod security


def _container_issues(pod: Doc, container: Doc, writable_root: bool = False, token: bool = False) -> list[str]:
    """Why `container` of `pod` falls short of Pod Security `restricted`, of a read-only root filesystem (unless
    `writable_root`: a documented exception) and of running without a Kubernetes API token (unless `token`)."""
    pod_ctx = pod.get("securityContext", {})
    ctx = container.get("securityContext", {})
    issues = []
    if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
        issues.append("runAsNonRoot is not true")
    if ctx.get("runAsUser", pod_ctx.get("runAsUser")) in (None, 0):
        issues.append("no non-zero runAsUser (the images' USER is not trusted)")
    if ctx.get("allowPrivilegeEscalation") is not False:
        issues.append("allowPrivilegeEscalation is not false")
    if ctx.get("capabilities", {}).get("drop") != ["ALL"] or ctx.get("capabilities", {}).get("add"):
        issues.append("capabilities do not drop ALL (or add some)")
    if ctx.get("privileged"):
        issues.append("privileged")
    if ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type") != "RuntimeDefault":
        issues.append("seccomp profile is not RuntimeDefault")
    if not writable_root and ctx.get("readOnlyRootFilesystem") is not True:
        issues.append("the root filesystem is not read-only")
    if not token and pod.get("automountServiceAccountToken") is not False:
        issues.append("a ServiceAccount token is mounted")
    return issues


WRITABLE_ROOT: dict[tuple[str, str], str] = {
    ("StatefulSet", "mlflow-postgres"): "PostgreSQL writes its socket and lock files under /var/run/postgresql",
    ("ServingRuntime", "kserve-vllm"): "vLLM, Triton and torch.compile write caches outside HOME",
}
"""The kit's workloads whose root filesystem is writable, each with its reason (manifests/README.md)."""
TOKEN_HOLDERS: dict[tuple[str, str], str] = {
    ("ServingRuntime", "kserve-vllm"): "a ServingRuntime has no pod-level automountServiceAccountToken; KServe "
    "builds the predictor pod",
    ("CronJob", "posttrain-reaper"): "the reaper reads workflows and deletes their jobs through the API",
}
"""The kit's pod specs that mount a token or cannot say whether one is mounted, each with its reason."""


def test_every_workload_runs_restricted(builds: dict[str, list[Doc]]) -> None:
    workloads = 0
    for where, doc in _all_objects(builds):
        key = (doc["kind"], doc["metadata"]["name"])
        for pod in _pod_specs(doc):
            workloads += 1
            assert not any("hostPath" in v for v in pod.get("volumes", [])), f"{where}: hostPath volume"
            assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")), where
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                issues = _container_issues(pod, container, key in WRITABLE_ROOT, key in TOKEN_HOLDERS)
                assert not issues, f"{where}: {doc['kind']}/{doc['metadata']['name']}/{container['name']}: {issues}"
    assert workloads >= 4  # MLflow, TensorBoard, Postgres, the vLLM runtime


def test_pod_security_check_can_fail() -> None:
    pod = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000}}
    container = {"name": "c", "securityContext": {"allowPrivilegeEscalation": False}}
    assert _container_issues(pod, container) == [
        "capabilities do not drop ALL (or add some)",
        "seccomp profile is not RuntimeDefault",
        "the root filesystem is not read-only",
        "a ServiceAccount token is mounted",
    ]
    assert _container_issues(pod, container, writable_root=True, token=True) == [
        "capabilities do not drop ALL (or add some)",
        "seccomp profile is not RuntimeDefault",
    ]


def test_services_without_api_access_get_no_token(builds: dict[str, list[Doc]]) -> None:
    for docs in builds.values():
        for doc in docs:
            for pod in _pod_specs(doc):
                if (doc["kind"], doc["metadata"]["name"]) not in TOKEN_HOLDERS:
                    assert pod.get("automountServiceAccountToken") is False, doc["metadata"]["name"]


PSA = "pod-security.kubernetes.io/"


def test_restricted_enforcement_is_an_opt_in_component(builds: dict[str, list[Doc]], tmp_path: Path) -> None:
    """The overlays enforce `baseline` (other controllers' containers need settings outside the kit first) and
    warn about and audit `restricted`; components/pod-security-restricted turns enforcement to `restricted` and
    changes nothing else."""
    for name, docs in builds.items():
        (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
        labels = namespace["metadata"]["labels"]
        assert (labels[PSA + "enforce"], labels[PSA + "warn"], labels[PSA + "audit"]) == ("baseline",) + (
            "restricted",
        ) * 2, name
    overlay = tmp_path / "restricted"
    overlay.mkdir()
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(OVERLAYS["onprem"], overlay)],
        "components": [os.path.relpath(MANIFESTS / "components" / "pod-security-restricted", overlay)],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    restricted = build(overlay)
    expected = copy.deepcopy(builds["onprem"])
    (namespace,) = [d for d in expected if d["kind"] == "Namespace"]
    namespace["metadata"]["labels"][PSA + "enforce"] = "restricted"
    assert _by_id(restricted) == _by_id(expected)
    if (kubectl := _kubectl_kustomize()) is not None:
        out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True)
        assert _by_id(_load_docs_text(out.stdout)) == _by_id(expected)


def test_tensorboard_reads_the_runs_read_only(builds: dict[str, list[Doc]]) -> None:
    for name, docs in builds.items():
        (pod,) = _pod_specs(_find(docs, "Deployment", "tensorboard"))
        checkpoints = [
            p for p in docs if p["kind"] == "PersistentVolumeClaim" and "checkpoints" in p["metadata"]["name"]
        ]
        (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"] == {"claimName": checkpoints[0]["metadata"]["name"], "readOnly": True}
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True, name
        assert "--logdir=/mnt/checkpoints/runs" in container["args"]


def test_mlflow_server_settings(builds: dict[str, list[Doc]]) -> None:
    for name, docs in builds.items():
        (pod,) = _pod_specs(_find(docs, "Deployment", "mlflow"))
        (container,) = pod["containers"]
        assert "--serve-artifacts" in container["args"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["resources"]["requests"], name
        env = {e["name"]: e for e in container["env"]}
        assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-db", "key": "uri"}
        destination = env["MLFLOW_ARTIFACTS_DESTINATION"]["value"]
        if name == "gke":
            assert destination.startswith("gs://")
            assert not [d for d in docs if _matches(d, "PersistentVolumeClaim", "mlflow-artifacts")]
        else:
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "artifacts"]
            assert mount["mountPath"] == destination


# --------------------------------------------------------------------------- the reaper


def test_the_reaper_runs_its_module_on_a_schedule(
    builds: dict[str, list[Doc]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CronJob runs `python -m workflows.reaper` for its own namespace (the downward API) every few minutes, one
    run at a time, bounded in time and history, as its own account, whose token only this pod asks for."""
    from workflows import reaper

    called: list[tuple[str, bool]] = []
    monkeypatch.setattr(reaper, "reap", lambda ns, dry_run=False: called.append((ns, dry_run)) or [])
    for name, docs in builds.items():
        cronjob = _find(docs, "CronJob", "posttrain-reaper")
        spec = cronjob["spec"]
        minutes, *rest = spec["schedule"].split()
        assert minutes.startswith("*/") and 2 <= int(minutes[2:]) <= 5 and rest == ["*"] * 4, spec["schedule"]
        assert spec["concurrencyPolicy"] == "Forbid"
        assert spec["successfulJobsHistoryLimit"] <= 3 and spec["failedJobsHistoryLimit"] <= 3
        assert 0 < spec["startingDeadlineSeconds"] <= 60 * int(minutes[2:])
        job = spec["jobTemplate"]["spec"]
        assert 0 < job["activeDeadlineSeconds"] <= 600 and job["backoffLimit"] == 0
        (pod,) = _pod_specs(cronjob)
        assert pod["serviceAccountName"] == "posttrain-reaper" and pod["automountServiceAccountToken"] is True
        assert _find(docs, "ServiceAccount", "posttrain-reaper")["automountServiceAccountToken"] is False
        (container,) = pod["containers"]
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        python, flag, module, *args = container["command"]
        assert (python, flag, module) == ("python", "-m", "workflows.reaper") and "args" not in container
        namespace = cronjob["metadata"]["namespace"]
        called.clear()
        assert reaper.main([a.replace("$(POD_NAMESPACE)", namespace) for a in args]) == 0, name
        assert called == [(namespace, False)], name


# --------------------------------------------------------------------------- RBAC


# --------------------------------------------------------------------------- overlays against the pipelines


def _pvc_checks(docs: list[Doc], claim: str, storage_class: str | None) -> None:
    pvc = _find(docs, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"].get("storageClassName") == storage_class


@pytest.mark.parametrize(
    ("overlay", "pipelines", "storage_class"),
    [("onprem", OVERLAY_PIPELINES["onprem"], "nfs-client"), ("gke", OVERLAY_PIPELINES["gke"], "premium-rwx")],
)
def test_overlay_has_what_its_pipelines_name(
    builds: dict[str, list[Doc]], overlay: str, pipelines: list[str], storage_class: str
) -> None:
    docs = builds[overlay]
    for pipeline in pipelines:
        spec = load_pipeline(pipeline).spec
        ns = spec.cluster.namespace
        _find(docs, "Namespace", ns)
        assert all(d["metadata"]["namespace"] == ns for d in docs if d["kind"] not in CLUSTER_SCOPED)
        assert identity_problems(docs, spec.cluster) == [], pipeline
        _pvc_checks(docs, spec.cluster.datasets.claim_name, storage_class)
        _pvc_checks(docs, spec.cluster.checkpoints.claim_name, storage_class)
        _find(docs, "ServingRuntime", spec.stages.deploy.serving.runtime)
        for stage in spec.stages.enabled():
            resources = spec.stage(stage).resources
            if resources.priority_class:
                _find(docs, "PriorityClass", resources.priority_class)
            if resources.queue:
                _find(docs, "LocalQueue", resources.queue)
        # The runtime lands on the GPU nodes the evaluate stage uses, tolerating their GPU taint.
        runtime = _find(docs, "ServingRuntime", spec.stages.deploy.serving.runtime)["spec"]
        evaluate = spec.stages.evaluate.resources
        assert runtime_fits_evaluate_nodes(runtime, evaluate) == [], pipeline


def runtime_fits_evaluate_nodes(runtime: Doc, evaluate: Any) -> list[str]:
    """Why the ServingRuntime would not land on the evaluate stage's GPU nodes: a shared node-selector label with
    another value, no shared label at all, or a taint the stage tolerates that the runtime does not."""
    problems = []
    selector = runtime.get("nodeSelector") or {}
    shared = set(selector) & set(evaluate.node_selector)
    if not shared:
        problems.append(f"no node-selector label in common with evaluate's {evaluate.node_selector}")
    for key in sorted(shared):
        if selector[key] != evaluate.node_selector[key]:
            problems.append(f"{key}={selector[key]}, evaluate has {key}={evaluate.node_selector[key]}")
    for toleration in evaluate.tolerations:
        if toleration.to_k8s() not in (runtime.get("tolerations") or []):
            problems.append(f"does not tolerate {toleration.to_k8s()}")
    return problems


def test_the_runtime_placement_check_can_fail() -> None:
    evaluate = load_pipeline("qwen3-30b-a3b").spec.stages.evaluate.resources
    runtime = {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    assert runtime_fits_evaluate_nodes(runtime, evaluate) == [
        "nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB, evaluate has nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
        "does not tolerate {'key': 'dedicated', 'operator': 'Equal', 'value': 'llm-training', 'effect': 'NoSchedule'}",
    ]


def test_the_runtime_loads_safetensors_only(builds: dict[str, list[Doc]]) -> None:
    for name, docs in builds.items():
        for runtime in (d for d in docs if d["kind"] == "ServingRuntime"):
            (container,) = runtime["spec"]["containers"]
            formats = [a for a in container["args"] if a.startswith("--load-format")]
            assert formats == ["--load-format=safetensors"], name


def test_kit_pods_pull_a_pipeline_image_with_its_pull_secrets(builds: dict[str, list[Doc]]) -> None:
    """A kit workload that runs an image one of its overlay's pipelines pulls with pull secrets has them too;
    on-prem, TensorBoard and the reaper run the private registry's trainer image."""
    for overlay, pipelines in OVERLAY_PIPELINES.items():
        secrets_for: dict[str, set[str]] = {}
        for pipeline in pipelines:
            cluster = load_pipeline(pipeline).spec.cluster
            secrets_for.setdefault(cluster.image, set()).update(cluster.image_pull_secrets)
        for doc in builds[overlay]:
            for pod in _pod_specs(doc):
                pulled = {s["name"] for s in pod.get("imagePullSecrets", [])}
                for container in pod["containers"]:
                    missing = secrets_for.get(container["image"], set()) - pulled
                    assert not missing, (
                        f"{overlay}: {doc['metadata']['name']} pulls {container['image']} without {missing}"
                    )
    for kind, name in (("Deployment", "tensorboard"), ("CronJob", "posttrain-reaper")):
        (pod,) = _pod_specs(_find(builds["onprem"], kind, name))
        assert pod["containers"][0]["image"] == load_pipeline("qwen3-30b-a3b").spec.cluster.image, name


def test_gke_overlay_uses_workload_identity(builds: dict[str, list[Doc]]) -> None:
    docs = builds["gke"]
    for account in ("posttrain-gke-wi", "posttrain-mlflow"):
        annotations = _find(docs, "ServiceAccount", account)["metadata"]["annotations"]
        assert annotations["iam.gke.io/gcp-service-account"].endswith(".iam.gserviceaccount.com")
    # Cloud identity is the stage pods' (they read gs:// data and publish the model), never the token holder's.
    assert load_pipeline("llama3-dolly").spec.cluster.pod_service_account == "posttrain-gke-wi"
    assert not _roles_bound_to(docs, "posttrain-gke-wi")
    assert "annotations" not in _find(docs, "ServiceAccount", "posttrain-workflow")["metadata"]
    assert not [d for d in docs if _matches(d, "ServiceAccount", "posttrain-runner")]


def test_base_uses_the_spec_defaults(builds: dict[str, list[Doc]]) -> None:
    from spec.cluster import ClusterSpec

    cluster = ClusterSpec()
    docs = builds["base"]
    _find(docs, "Namespace", cluster.namespace)
    assert identity_problems(docs, cluster) == []
    _pvc_checks(docs, cluster.datasets.claim_name, None)
    _pvc_checks(docs, cluster.checkpoints.claim_name, None)


# --------------------------------------------------------------------------- secrets


def _secret_refs(builds: dict[str, list[Doc]]) -> set[tuple[str, str]]:
    refs = set()
    for _, doc in _all_objects(builds):
        for pod in _pod_specs(doc):
            for container in pod.get("containers", []):
                for env in container.get("env", []):
                    if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                        refs.add((ref["name"], ref["key"]))
    return refs


def test_secrets_template_names_every_key_and_holds_no_value(builds: dict[str, list[Doc]]) -> None:
    template = _load_docs(MANIFESTS / "secrets.example.yaml")
    keys: set[tuple[str, str]] = set()
    for secret in template:
        assert secret["kind"] == "Secret"
        data = secret.get("stringData", {})
        assert all(value == "" for value in data.values()), f"{secret['metadata']['name']} holds a value"
        keys |= {(secret["metadata"]["name"], key) for key in data}
    assert _secret_refs(builds) <= keys
    for pipeline in ("korean-llm", "qwen3-30b-a3b", "llama3-dolly"):
        secrets = load_pipeline(pipeline).spec.cluster.secrets
        named = {(ref.name, ref.key) for ref in (getattr(secrets, f) for f in type(secrets).model_fields) if ref}
        assert named <= keys, f"{pipeline}: {named - keys} missing from secrets.example.yaml"


# --------------------------------------------------------------------------- Kubeflow Trainer v2 runtime


def test_trainer_v2_component_builds_onto_an_overlay(builds: dict[str, list[Doc]], tmp_path: Path) -> None:
    """components/trainer-v2 adds the ClusterTrainingRuntime, cluster-scoped (no namespace), and changes nothing
    else; `kubectl kustomize` agrees where one with kustomize v4+ is on the PATH."""
    overlay = tmp_path / "trainer-v2"
    overlay.mkdir()
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(OVERLAYS["onprem"], overlay)],
        "components": [os.path.relpath(MANIFESTS / "components" / "trainer-v2", overlay)],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    built = build(overlay)
    runtime = _find(built, "ClusterTrainingRuntime", "posttrain-torch")
    assert "namespace" not in runtime["metadata"]
    assert _by_id([d for d in built if d is not runtime]) == _by_id(builds["onprem"])
    validate_custom_resource(runtime)
    if (kubectl := _kubectl_kustomize()) is not None:
        out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True)
        assert _by_id(built) == _by_id(_load_docs_text(out.stdout))


def test_trainer_v2_runtime_fits_the_trainjobs_the_pipelines_render() -> None:
    """What workflows/trainjob.py relies on: `node` first with a torch policy, the container named `node`, the
    volumes the TrainJob's override replaces by name, the kit's claims and accounts, and the settings the spec's
    defaults give a PyTorchJob pod (user, grace period, metrics port)."""
    from workflows.pytorchjob import volumes
    from workflows.trainjob import NODE, job_manifest

    (runtime,) = _load_docs(MANIFESTS / "components" / "trainer-v2" / "clustertrainingruntime.yaml")
    spec = load_pipeline("korean-llm", "trainjob").spec
    assert runtime["metadata"]["name"] == spec.cluster.training_runtime
    assert "torch" in runtime["spec"]["mlPolicy"]
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"]["maxRestarts"] > 0
    first = jobset["replicatedJobs"][0]
    assert first["name"] == NODE
    assert first["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert first["template"]["spec"]["backoffLimit"] == 0  # a failed node fails the Job: the JobSet restarts all
    (pod,) = _pod_specs(runtime)
    (container,) = pod["containers"]
    assert container["name"] == NODE
    assert pod["serviceAccountName"] == spec.cluster.pod_service_account
    assert pod["securityContext"]["runAsUser"] == spec.cluster.run_as_user
    stage = spec.stages.cpt
    assert pod["terminationGracePeriodSeconds"] == stage.run_policy.termination_grace_period_seconds
    assert container["ports"] == [{"name": "metrics", "containerPort": spec.cluster.metrics_port, "protocol": "TCP"}]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    vols, mounts = volumes(spec, "64Gi")
    assert {v["name"] for v in pod["volumes"]} == {v["name"] for v in vols}
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {m["name"]: m["mountPath"] for m in mounts}
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"
    kit_claims = {d["metadata"]["name"] for d in _load_docs(MANIFESTS / "base" / "volumes.yaml")}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims <= kit_claims
    # The override a TrainJob sends names only volumes and a container the runtime has.
    (override,) = job_manifest(spec, "cpt")["spec"]["podTemplateOverrides"]
    assert override["targetJobs"] == [{"name": NODE}]
    assert [c["name"] for c in override["spec"]["containers"]] == [NODE]
    assert {v["name"] for v in override["spec"]["volumes"]} <= {v["name"] for v in pod["volumes"]}


def test_preflight_access_reads_every_crd_preflight_checks() -> None:
    from workflows.preflight import CRDS

    assert tuple(sorted(CRDS)) == PREFLIGHT_CRDS


# --------------------------------------------------------------------------- Katib


def test_katib_component_labels_the_namespace_for_metrics_collection(
    builds: dict[str, list[Doc]], tmp_path: Path
) -> None:
    """components/katib adds the label Katib's pod webhook selects namespaces by (its namespaceSelector), and
    changes nothing else; `kubectl kustomize` agrees where one with kustomize v4+ is on the PATH."""
    overlay = tmp_path / "katib"
    overlay.mkdir()
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(OVERLAYS["onprem"], overlay)],
        "components": [os.path.relpath(MANIFESTS / "components" / "katib", overlay)],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    built = build(overlay)
    expected = copy.deepcopy(builds["onprem"])
    (namespace,) = [d for d in expected if d["kind"] == "Namespace"]
    namespace["metadata"]["labels"]["katib.kubeflow.org/metrics-collector-injection"] = "enabled"
    assert _by_id(built) == _by_id(expected)
    if (kubectl := _kubectl_kustomize()) is not None:
        out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True)
        assert _by_id(_load_docs_text(out.stdout)) == _by_id(expected)
