"""The namespace a command acts in when no pipeline spec names one, chosen as kubectl and argo choose it.

    --namespace  >  $ARGO_NAMESPACE  >  the current kubeconfig context's namespace  >  posttrain

`posttrain` is cluster.namespace's default (spec/cluster.py) and the cluster kit's base (manifests/base); the
overlays set their own (llm-training, ml-training) in the spec and, by `kubectl config set-context --current
--namespace ...`, in the context a user works in. Commands on a pipeline (submit, register, preflight) act in its
cluster.namespace instead: the jobs are compiled for it.

The kubeconfig is read as plain YAML ($KUBECONFIG, a list of files as kubectl merges them, else ~/.kube/config):
the first file that sets `current-context` names the context, and the first file that defines that context gives
its namespace. A kubeconfig that is missing or unreadable names none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from spec.cluster import ClusterSpec

DEFAULT_NAMESPACE: str = ClusterSpec.model_fields["namespace"].default
"""The namespace when nothing else names one: cluster.namespace's default."""

RULE = "--namespace, else $ARGO_NAMESPACE, else the kubeconfig context's namespace, else " + DEFAULT_NAMESPACE
"""The rule in words, for --help."""


def kubeconfig_files(env: Mapping[str, str]) -> list[Path]:
    """The kubeconfig files kubectl reads, in order: $KUBECONFIG's entries, else ~/.kube/config."""
    listed = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p.strip()]
    return [Path(os.path.expanduser(p)) for p in listed or ["~/.kube/config"]]


def _documents(files: list[Path]) -> list[dict]:
    docs = []
    for path in files:
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


def kubeconfig_namespace(env: Mapping[str, str] | None = None) -> str | None:
    """The namespace of the kubeconfig's current context, or None when it names none."""
    docs = _documents(kubeconfig_files(os.environ if env is None else env))
    current = next((d["current-context"] for d in docs if d.get("current-context")), None)
    if not current:
        return None
    for doc in docs:
        for entry in doc.get("contexts") or []:
            if isinstance(entry, dict) and entry.get("name") == current:
                context = entry.get("context") or {}
                namespace = str(context.get("namespace") or "").strip() if isinstance(context, dict) else ""
                return namespace or None
    return None


def resolve_namespace(flag: str | None, env: Mapping[str, str] | None = None) -> str:
    """The namespace by the rule above: `flag` (--namespace), $ARGO_NAMESPACE, the kubeconfig's, the default."""
    env = os.environ if env is None else env
    for candidate in (flag, env.get("ARGO_NAMESPACE")):
        if candidate and candidate.strip():
            return candidate.strip()
    return kubeconfig_namespace(env) or DEFAULT_NAMESPACE
