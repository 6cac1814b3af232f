"""The cluster kit as kustomize builds it: a small kustomize in Python for exactly the features manifests/ uses."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

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


def _load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _kustomization(directory: Path) -> Doc:
    return yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))


def _matches(doc: Doc, kind: str | None, name: str | None) -> bool:
    return (kind is None or doc["kind"] == kind) and (name is None or doc["metadata"]["name"] == name)


def _pod_specs(doc: Doc) -> list[Doc]:
    if doc["kind"] in POD_TEMPLATE_KINDS:
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "CronJob":
        return [doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
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


def _find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if _matches(d, kind, name)]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _kubectl_kustomize() -> str | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    probe = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None
    version = json.loads(probe.stdout).get("kustomizeVersion", "")
    return kubectl if version.startswith(("v5", "v4")) else None


def _all_objects(builds: dict[str, list[Doc]]) -> list[tuple[str, Doc]]:
    objects = [(name, doc) for name, docs in builds.items() for doc in docs]
    for component in COMPONENTS:
        for ref in _kustomization(component).get("resources", []):
            objects += [(component.name, doc) for doc in _load_docs(component / ref)]
    return objects


OVERLAY_PIPELINES = {"onprem": ["korean-llm", "qwen3-30b-a3b"], "gke": ["llama3-dolly"]}
