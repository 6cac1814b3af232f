"""The cluster kit in manifests/: every overlay builds, every object validates, and the settings the pipelines
rely on (names, pod security, least-privilege RBAC) hold.

The overlays are built here in Python by `build()`, a small kustomize for exactly the features the kit uses:
`resources`, `components`, `namespace` (with the Namespace object and ServiceAccount subjects following it),
`patches` (strategic-merge patch files, `$patch: delete` included, and inline JSON 6902 patches with a target,
where a renamed ServiceAccount or PVC carries its references along), `replacements`, `configMapGenerator` (files,
labels and annotations, without the name hash), and dropping
`config.kubernetes.io/local-config` resources. CI has no usable kubectl (Debian's kubernetes-client ships
kustomize v2, which predates components and replacements), so the tests do not need one; where a kubectl with
kustomize v5 is on the PATH, `test_build_matches_kubectl_kustomize` checks that `build()` gives exactly what
`kubectl kustomize` gives, so the Python build cannot drift from the real one unnoticed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from schema_validation import SchemaViolation, validate_custom_resource

from spec.loading import load_pipeline

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
OVERLAYS = {"onprem": MANIFESTS / "overlays" / "onprem", "gke": MANIFESTS / "overlays" / "gke"}
BUILDS = {"base": MANIFESTS / "base", **OVERLAYS}
COMPONENTS = sorted(p.parent for p in (MANIFESTS / "components").glob("*/kustomization.yaml"))
K8S_VERSION = "1.32.0"
"""Kubernetes version the core kinds are validated against (the oldest the kit supports)."""

Doc = dict[str, Any]

CLUSTER_SCOPED = {
    "Namespace",
    "PriorityClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "ClusterTrainingRuntime",
}
CRD_KINDS = {
    "ServingRuntime",
    "LocalQueue",
    "PodMonitor",
    "ServiceMonitor",
    "PrometheusRule",
    "AlertmanagerConfig",
    "ClusterTrainingRuntime",
}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
"""Strategic-merge keys of the core lists the kit's patches touch (as in the Kubernetes OpenAPI)."""


# --------------------------------------------------------------------------- a small kustomize


def _load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _kustomization(directory: Path) -> Doc:
    return yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))


def _matches(doc: Doc, kind: str | None, name: str | None) -> bool:
    return (kind is None or doc["kind"] == kind) and (name is None or doc["metadata"]["name"] == name)


def _pod_specs(doc: Doc) -> list[Doc]:
    if doc["kind"] in POD_TEMPLATE_KINDS:
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "ServingRuntime":
        return [doc["spec"]]
    if doc["kind"] == "ClusterTrainingRuntime":
        return [
            job["template"]["spec"]["template"]["spec"] for job in doc["spec"]["template"]["spec"]["replicatedJobs"]
        ]
    return []


def _strategic_merge(base: Doc, patch: Doc, typed: bool) -> Doc:
    """`patch` merged onto `base`: maps recursively, null deletes, merge-keyed lists by key (core kinds only)."""
    for key, value in patch.items():
        if key == "$patch":
            continue
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _strategic_merge(base[key], value, typed)
        elif typed and key in MERGE_KEYS and isinstance(value, list) and isinstance(base.get(key), list):
            base[key] = _merge_list(base[key], value, MERGE_KEYS[key])
        else:
            base[key] = copy.deepcopy(value)
    return base


def _merge_list(base: list[Doc], patch: list[Doc], key: str) -> list[Doc]:
    """kyaml's order: the patch's items first (merged with their originals), then the untouched originals."""
    by_key = {item[key]: item for item in base}
    merged: list[Doc] = []
    touched = set()
    for item in patch:
        touched.add(item[key])
        if item.get("$patch") == "delete":
            continue
        merged.append(_strategic_merge(copy.deepcopy(by_key.get(item[key], {})), item, typed=True))
    return merged + [item for item in base if item[key] not in touched]


def _json_pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json6902(doc: Doc, ops: list[Doc]) -> None:
    for op in ops:
        *parents, last = _json_pointer(op["path"])
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] in ("add", "replace"):
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[last]
        else:
            raise AssertionError(f"JSON patch op {op['op']!r} is not supported by this build; extend build()")


def _follow_rename(docs: list[Doc], kind: str, old: str, new: str) -> None:
    """Update references to a renamed ServiceAccount or PVC, as kustomize's name references do."""
    for doc in docs:
        if kind == "ServiceAccount" and doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in doc.get("subjects", []):
                if subject["kind"] == "ServiceAccount" and subject["name"] == old:
                    subject["name"] = new
        for pod in _pod_specs(doc):
            if kind == "ServiceAccount" and pod.get("serviceAccountName") == old:
                pod["serviceAccountName"] = new
            for volume in pod.get("volumes", []):
                claim = volume.get("persistentVolumeClaim")
                if kind == "PersistentVolumeClaim" and claim and claim["claimName"] == old:
                    claim["claimName"] = new


def _apply_patches(directory: Path, entries: list[Doc], docs: list[Doc]) -> list[Doc]:
    for entry in entries:
        if "path" in entry:
            assert "target" not in entry, "build() supports path patches that name their target themselves"
            for patch in _load_docs(directory / entry["path"]):
                kind, name = patch["kind"], patch["metadata"]["name"]
                targets = [d for d in docs if _matches(d, kind, name)]
                assert targets, f"{entry['path']}: no {kind}/{name} to patch"
                if patch.get("$patch") == "delete":
                    docs = [d for d in docs if not _matches(d, kind, name)]
                    continue
                for target in targets:
                    _strategic_merge(target, patch, typed=kind not in CRD_KINDS)
            continue
        target = entry["target"]
        ops = yaml.safe_load(entry["patch"])
        assert isinstance(ops, list), "build() supports inline patches as JSON 6902 operations"
        selected = [d for d in docs if _matches(d, target.get("kind"), target.get("name"))]
        assert selected, f"no resource matches patch target {target}"
        for doc in selected:
            old = doc["metadata"]["name"]
            _json6902(doc, ops)
            if doc["metadata"]["name"] != old:
                _follow_rename(docs, doc["kind"], old, doc["metadata"]["name"])
    return docs


def _field(doc: Doc, dotted: str) -> Any:
    node: Any = doc
    for part in dotted.split("."):
        node = node[part]
    return node


def _apply_replacements(replacements: list[Doc], docs: list[Doc]) -> None:
    for replacement in replacements:
        src = replacement["source"]
        (source,) = [d for d in docs if _matches(d, src.get("kind"), src.get("name"))]
        value = _field(source, src["fieldPath"])
        for target in replacement["targets"]:
            select = target["select"]
            for doc in docs:
                if not _matches(doc, select.get("kind"), select.get("name")):
                    continue
                for dotted in target["fieldPaths"]:
                    *parents, last = dotted.split(".")
                    node = doc
                    for part in parents:
                        node = node.setdefault(part, {}) if target.get("options", {}).get("create") else node[part]
                    node[last] = copy.deepcopy(value)


def _set_namespace(namespace: str, docs: list[Doc]) -> None:
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    for doc in docs:
        if doc["kind"] == "Namespace":
            doc["metadata"]["name"] = namespace
        elif doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = namespace
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in doc.get("subjects", []):
                if subject["kind"] == "ServiceAccount" and (
                    subject.get("namespace") in (None, "", "default") or subject["name"] in accounts
                ):
                    subject["namespace"] = namespace


def _generated_config_map(directory: Path, generator: Doc) -> Doc:
    """The ConfigMap a configMapGenerator entry makes from files (`key=path` or `path`, keyed by its file name)."""
    options = generator.get("options", {})
    assert set(generator) <= {"name", "files", "options"}, f"{directory}: build() supports generators of files only"
    assert options.get("disableNameSuffixHash"), f"{directory}: build() does not add name hashes; extend it"
    data = {}
    for entry in generator.get("files", []):
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = (directory / path).read_text(encoding="utf-8")
    metadata: Doc = {"name": generator["name"]}
    for field in ("labels", "annotations"):
        if options.get(field):
            metadata[field] = dict(options[field])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _accumulate(directory: Path, docs: list[Doc]) -> list[Doc]:
    """Add a kustomization's (or component's) resources to `docs` and run its transformers over them."""
    k = _kustomization(directory)
    known = {"apiVersion", "kind", "resources", "components", "namespace", "patches", "replacements"}
    known.add("configMapGenerator")
    assert set(k) <= known, f"{directory}: build() does not support {sorted(set(k) - known)}; extend it"
    for ref in k.get("resources", []):
        path = directory / ref
        docs = docs + (build(path, keep_local=True) if path.is_dir() else _load_docs(path))
    docs = docs + [_generated_config_map(directory, generator) for generator in k.get("configMapGenerator", [])]
    for component in k.get("components", []):
        docs = _accumulate(directory / component, docs)
    docs = _apply_patches(directory, k.get("patches", []), docs)
    if "namespace" in k:
        _set_namespace(k["namespace"], docs)
    _apply_replacements(k.get("replacements", []), docs)
    return docs


def build(directory: Path, keep_local: bool = False) -> list[Doc]:
    """The objects `kubectl kustomize directory` prints (in no particular order)."""
    docs = _accumulate(directory, [])
    if keep_local:
        return docs
    local = "config.kubernetes.io/local-config"
    return [d for d in docs if d["metadata"].get("annotations", {}).get(local) != "true"]


def _by_id(docs: list[Doc]) -> dict[tuple[str, str, str], Doc]:
    out = {}
    for doc in docs:
        key = (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
        assert key not in out, f"{key} appears twice"
        out[key] = doc
    return out


@pytest.fixture(scope="module")
def builds() -> dict[str, list[Doc]]:
    return {name: build(path) for name, path in BUILDS.items()}


def _find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if _matches(d, kind, name)]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


# --------------------------------------------------------------------------- building


def _kubectl_kustomize() -> str | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    probe = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None
    version = json.loads(probe.stdout).get("kustomizeVersion", "")
    return kubectl if version.startswith(("v5", "v4")) else None


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


def _all_objects(builds: dict[str, list[Doc]]) -> list[tuple[str, Doc]]:
    objects = [(name, doc) for name, docs in builds.items() for doc in docs]
    for component in COMPONENTS:
        for ref in _kustomization(component).get("resources", []):
            objects += [(component.name, doc) for doc in _load_docs(component / ref)]
    return objects


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
}
"""The kit's pod specs that cannot say whether a token is mounted, each with its reason."""


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
                if doc["kind"] != "ServingRuntime":
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


# --------------------------------------------------------------------------- RBAC

ALL: tuple[str, ...] = ()
"""resourceNames of a rule that names none: every object of the resource."""
PREFLIGHT_CRDS = (
    "cronworkflows.argoproj.io",
    "experiments.kubeflow.org",
    "inferenceservices.serving.kserve.io",
    "localqueues.kueue.x-k8s.io",
    "pytorchjobs.kubeflow.org",
    "trainjobs.trainer.kubeflow.org",
    "workflows.argoproj.io",
    "workflowtemplates.argoproj.io",
)
PREFLIGHT_SECRETS = ("aws-credentials", "hf-token", "mlflow-auth", "registry-credentials", "slack-webhook", "wandb")
"""The names preflight's rules are limited to, sorted (as `_grants` sorts them)."""

Grant = tuple[str, str, str, tuple[str, ...]]
"""(apiGroup, resource, verb, resourceNames): one permission a role grants."""

VERB_REASONS: dict[tuple[str, str], dict[Grant, str]] = {
    ("Role", "posttrain-workflow"): {
        ("argoproj.io", "workflowtaskresults", "create", ALL): "a resource step's executor reports its outputs",
        ("argoproj.io", "workflowtaskresults", "patch", ALL): "a resource step's executor updates the step's result",
        ("kubeflow.org", "pytorchjobs", "create", ALL): "training steps are resource templates with action create",
        (
            "kubeflow.org",
            "pytorchjobs",
            "get",
            ALL,
        ): "the resource step polls the job for its success/failure condition",
        (
            "kubeflow.org",
            "pytorchjobs",
            "list",
            ALL,
        ): "cleanup (exit handler, a training stage's retry) finds the run's jobs by their workflow label",
        (
            "kubeflow.org",
            "pytorchjobs",
            "delete",
            ALL,
        ): "cleanup deletes a stopped or failed run's unfinished jobs, freeing their GPUs at once",
        ("kubeflow.org", "experiments", "create", ALL): "a stage's hpo step creates its Katib Experiment",
        ("kubeflow.org", "experiments", "get", ALL): "the hpo wait step polls the Experiment for Katib's verdict",
        (
            "kubeflow.org",
            "experiments",
            "list",
            ALL,
        ): "the exit handler's cleanup finds the run's Experiments by their workflow label",
        (
            "kubeflow.org",
            "experiments",
            "delete",
            ALL,
        ): "cleanup deletes a stopped run's unfinished search (Katib deletes its trials and their jobs)",
        ("trainer.kubeflow.org", "trainjobs", "create", ALL): "with job_kind trainjob, training steps create TrainJobs",
        ("trainer.kubeflow.org", "trainjobs", "get", ALL): "the resource step polls the TrainJob for its conditions",
        (
            "trainer.kubeflow.org",
            "trainjobs",
            "list",
            ALL,
        ): "cleanup --kind trainjob finds the run's TrainJobs by their workflow label",
        (
            "trainer.kubeflow.org",
            "trainjobs",
            "delete",
            ALL,
        ): "cleanup deletes a stopped or failed run's unfinished TrainJobs (their JobSet and pods go with them)",
        (
            "serving.kserve.io",
            "inferenceservices",
            "create",
            ALL,
        ): "serve (workflows.rollout) server-side applies the InferenceService; the first apply creates it",
        (
            "serving.kserve.io",
            "inferenceservices",
            "get",
            ALL,
        ): "serve reads the revision serving before its apply, then polls the new revision, traffic and rollback",
        (
            "serving.kserve.io",
            "inferenceservices",
            "patch",
            ALL,
        ): "serve's apply moves the InferenceService to the run's model, its canary steps and rollback set traffic",
        (
            "serving.knative.dev",
            "revisions",
            "get",
            ALL,
        ): "retention reads the storageUri of each revision the service still names, never pruning a served model",
    },
    ("Role", "posttrain-executor"): {
        (
            "argoproj.io",
            "workflowtaskresults",
            "create",
            ALL,
        ): "Argo's wait container of a stage pod reports the step's outputs (its token is mounted there only)",
        ("argoproj.io", "workflowtaskresults", "patch", ALL): "Argo's wait container updates the step's result",
    },
    ("Role", "posttrain-submitter"): {
        ("argoproj.io", "workflows", "create", ALL): "submit a run (CLI, or the UI's submit dialog)",
        ("argoproj.io", "workflows", "get", ALL): "`submit --watch` follows the run it submitted",
        ("argoproj.io", "workflowtemplates", "get", ALL): "a run references its pipeline's registered template",
    },
    ("Role", "posttrain-registrar"): {
        ("argoproj.io", "workflowtemplates", "create", ALL): "register a new pipeline",
        ("argoproj.io", "workflowtemplates", "get", ALL): "register reads the resourceVersion to update",
        ("argoproj.io", "workflowtemplates", "update", ALL): "register an existing pipeline again",
        ("argoproj.io", "cronworkflows", "create", ALL): "register a scheduled pipeline",
        ("argoproj.io", "cronworkflows", "get", ALL): "register reads the resourceVersion, and finds stale schedules",
        ("argoproj.io", "cronworkflows", "update", ALL): "register a changed schedule",
    },
    ("ClusterRole", "posttrain-preflight"): {
        (
            "apiextensions.k8s.io",
            "customresourcedefinitions",
            "get",
            PREFLIGHT_CRDS,
        ): "preflight: the CRDs are installed",
        ("", "namespaces", "get", ALL): "preflight: the namespace exists",
        ("", "nodes", "list", ALL): "preflight: GPU nodes with the stages' labels, taints and GPUs",
        ("scheduling.k8s.io", "priorityclasses", "get", ALL): "preflight: the stages' PriorityClasses exist",
        ("serving.kserve.io", "clusterservingruntimes", "get", ALL): "preflight: the serving runtime, cluster-wide",
        (
            "trainer.kubeflow.org",
            "clustertrainingruntimes",
            "get",
            ALL,
        ): "preflight: with job_kind trainjob, the TrainJobs' runtime exists and fits",
    },
    ("Role", "posttrain-preflight"): {
        ("", "serviceaccounts", "get", ALL): "preflight: the pipeline's three ServiceAccounts exist",
        ("", "persistentvolumeclaims", "get", ALL): "preflight: the volumes exist, are Bound and ReadWriteMany",
        ("", "secrets", "get", PREFLIGHT_SECRETS): (
            "preflight: the spec's Secrets exist; it requests their metadata only (PartialObjectMetadata), and "
            "RBAC has no narrower verb than get"
        ),
        ("kueue.x-k8s.io", "localqueues", "get", ALL): "preflight: the stages' Kueue LocalQueues exist",
        ("serving.kserve.io", "servingruntimes", "get", ALL): "preflight: the deploy stage's ServingRuntime exists",
    },
}
"""Every permission any Role of the kit grants, with the reason it is needed. A verb, resource or widened
resourceNames without a row here fails."""


def _grants(role: Doc) -> set[Grant]:
    out = set()
    for rule in role.get("rules", []):
        assert "nonResourceURLs" not in rule
        names = tuple(sorted(rule.get("resourceNames") or ()))
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"{role['metadata']['name']}: wildcard in {rule}"
                    out.add((group, resource, verb, names))
    return out


def rbac_differences(roles: list[Doc]) -> list[str]:
    """What differs between the roles' grants and VERB_REASONS: each unexplained or unused grant, one line each."""
    problems = []
    seen = set()
    for role in roles:
        key = (role["kind"], role["metadata"]["name"])
        seen.add(key)
        reasons = VERB_REASONS.get(key)
        if reasons is None:
            problems.append(f"{key}: a role with no entry in VERB_REASONS")
            continue
        granted = _grants(role)
        problems += [f"{key}: {g} is granted without a reason" for g in sorted(granted - set(reasons))]
        problems += [f"{key}: {g} has a reason but is not granted" for g in sorted(set(reasons) - granted)]
    problems += [f"{key}: in VERB_REASONS but in no manifest" for key in sorted(set(VERB_REASONS) - seen)]
    return problems


def _all_roles(builds: dict[str, list[Doc]]) -> list[Doc]:
    roles: dict[tuple[str, str], Doc] = {}
    for _, doc in _all_objects(builds):
        if doc["kind"] in ("Role", "ClusterRole"):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in roles or roles[key]["rules"] == doc["rules"], f"{key} differs between builds"
            roles[key] = doc
    return list(roles.values())


def test_roles_grant_exactly_the_verbs_with_a_reason(builds: dict[str, list[Doc]]) -> None:
    assert rbac_differences(_all_roles(builds)) == []


def _role(roles: list[Doc], kind: str, name: str) -> Doc:
    return next(r for r in roles if (r["kind"], r["metadata"]["name"]) == (kind, name))


def test_an_extra_verb_fails_the_rbac_check(builds: dict[str, list[Doc]]) -> None:
    roles = copy.deepcopy(_all_roles(builds))
    _role(roles, "Role", "posttrain-workflow")["rules"][1]["verbs"].append("update")
    _role(roles, "Role", "posttrain-submitter")["rules"][1]["verbs"].append("update")
    assert rbac_differences(roles) == [
        "('Role', 'posttrain-workflow'): ('kubeflow.org', 'pytorchjobs', 'update', ()) is granted without a reason",
        "('Role', 'posttrain-submitter'): ('argoproj.io', 'workflowtemplates', 'update', ()) is granted without a "
        "reason",
    ]


def test_widening_a_named_resource_rule_fails_the_rbac_check(builds: dict[str, list[Doc]]) -> None:
    roles = copy.deepcopy(_all_roles(builds))
    secrets = next(r for r in _role(roles, "Role", "posttrain-preflight")["rules"] if r["resources"] == ["secrets"])
    del secrets["resourceNames"]  # every Secret of the namespace
    problems = rbac_differences(roles)
    assert problems == [
        "('Role', 'posttrain-preflight'): ('', 'secrets', 'get', ()) is granted without a reason",
        f"('Role', 'posttrain-preflight'): ('', 'secrets', 'get', {PREFLIGHT_SECRETS}) has a reason but is not granted",
    ]


def test_submitters_cannot_write_templates(builds: dict[str, list[Doc]]) -> None:
    """What a run executes is decided by whoever registers templates, not by whoever submits runs."""
    submitter = _grants(_role(_all_roles(builds), "Role", "posttrain-submitter"))
    writes = {"create", "update", "patch", "delete"}
    assert not {g for g in submitter if g[1] in ("workflowtemplates", "cronworkflows") and g[2] in writes}
    for name in ("posttrain-submitters", "posttrain-registrars"):
        for docs in builds.values():
            _find(docs, "RoleBinding", name)


def test_nothing_cluster_wide_outside_the_optional_components(builds: dict[str, list[Doc]]) -> None:
    for name, docs in builds.items():
        kinds = {d["kind"] for d in docs}
        assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, name


def _roles_bound_to(docs: list[Doc], account: str) -> list[str]:
    """The roles the kit binds to ServiceAccount `account` (by RoleBinding or ClusterRoleBinding)."""
    return sorted(
        f"{doc['roleRef']['kind']}/{doc['roleRef']['name']}"
        for doc in docs
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for subject in doc.get("subjects", [])
        if subject["kind"] == "ServiceAccount" and subject["name"] == account
    )


def identity_problems(docs: list[Doc], cluster: Any) -> list[str]:
    """What the kit gets wrong about a pipeline's three ServiceAccounts (cluster.*), one line each:
    - service_account (the resource steps): bound to the posttrain-workflow Role only, its token not switched off
      on the account (Argo writes only `false` into a pod, so the account's setting would win);
    - pod_service_account (every pod that runs stage code): no role at all, no token;
    - executor_service_account (Argo's init/wait): the posttrain-executor Role only, and the token Secret Argo
      mounts, `<name>.service-account-token`."""
    problems = []
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    wanted = {
        cluster.service_account: ["Role/posttrain-workflow"],
        cluster.pod_service_account: [],
        cluster.executor_service_account: ["Role/posttrain-executor"],
    }
    for account, roles in wanted.items():
        if account not in accounts:
            problems.append(f"ServiceAccount {account} is missing")
        elif (bound := _roles_bound_to(docs, account)) != roles:
            problems.append(f"ServiceAccount {account} is bound to {bound}, expected {roles}")
    if accounts.get(cluster.service_account, {}).get("automountServiceAccountToken") is False:
        problems.append(f"{cluster.service_account} switches its token off: the resource steps would have none")
    for account in (cluster.pod_service_account, cluster.executor_service_account):
        if account in accounts and accounts[account].get("automountServiceAccountToken") is not False:
            problems.append(f"{account} does not set automountServiceAccountToken: false")
    token = f"{cluster.executor_service_account}.service-account-token"
    secrets = [d for d in docs if _matches(d, "Secret", token)]
    if not secrets:
        problems.append(f"Secret {token} (the executor's token, which Argo mounts) is missing")
    elif (
        secrets[0].get("type") != "kubernetes.io/service-account-token"
        or secrets[0]["metadata"].get("annotations", {}).get("kubernetes.io/service-account.name")
        != cluster.executor_service_account
    ):
        problems.append(f"Secret {token} is not a token of {cluster.executor_service_account}")
    return problems


def test_the_identities_hold_only_what_their_steps_need(builds: dict[str, list[Doc]]) -> None:
    from spec.cluster import ClusterSpec

    for name, docs in builds.items():
        pipelines = [load_pipeline(p).spec.cluster for p in OVERLAY_PIPELINES.get(name, [])] or [ClusterSpec()]
        for cluster in pipelines:
            assert identity_problems(docs, cluster) == [], name
        binding = _find(docs, "RoleBinding", "posttrain-workflow")
        namespace = _find(docs, "Namespace", binding["metadata"]["namespace"])["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "posttrain-workflow", "namespace": namespace}]


def test_the_identity_check_can_fail(builds: dict[str, list[Doc]]) -> None:
    from spec.cluster import ClusterSpec

    docs = copy.deepcopy(builds["base"])
    cluster = ClusterSpec()
    _find(docs, "RoleBinding", "posttrain-workflow")["subjects"].append(
        {"kind": "ServiceAccount", "name": "posttrain-runner", "namespace": "posttrain"}
    )
    del _find(docs, "ServiceAccount", "posttrain-runner")["automountServiceAccountToken"]
    _find(docs, "ServiceAccount", "posttrain-workflow")["automountServiceAccountToken"] = False
    docs = [d for d in docs if not _matches(d, "Secret", "posttrain-executor.service-account-token")]
    assert identity_problems(docs, cluster) == [
        "ServiceAccount posttrain-runner is bound to ['Role/posttrain-workflow'], expected []",
        "posttrain-workflow switches its token off: the resource steps would have none",
        "posttrain-runner does not set automountServiceAccountToken: false",
        "Secret posttrain-executor.service-account-token (the executor's token, which Argo mounts) is missing",
    ]


# --------------------------------------------------------------------------- overlays against the pipelines


def _pvc_checks(docs: list[Doc], claim: str, storage_class: str | None) -> None:
    pvc = _find(docs, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"].get("storageClassName") == storage_class


OVERLAY_PIPELINES = {"onprem": ["korean-llm", "qwen3-30b-a3b"], "gke": ["llama3-dolly"]}


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
    on-prem, TensorBoard runs the private registry's trainer image."""
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
    (tensorboard,) = _pod_specs(_find(builds["onprem"], "Deployment", "tensorboard"))
    assert tensorboard["containers"][0]["image"] == load_pipeline("qwen3-30b-a3b").spec.cluster.image


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
