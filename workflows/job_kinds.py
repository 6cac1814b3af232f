"""The training job kinds a stage can create (`cluster.job_kind`), behind the one interface the compiler uses.

Each kind is a module that builds its job and says how Argo watches it: workflows/pytorchjob.py (Kubeflow Training
Operator v1) and workflows/trainjob.py (Kubeflow Trainer v2). A new kind is a new such module, named in KINDS and in
the spec's `cluster.job_kind`; the compiler, cleanup and preflight select it by name and never branch on it.
"""

from __future__ import annotations

from typing import Any, Protocol

from spec.pipeline import PipelineSpec
from workflows import pytorchjob, trainjob


class JobKind(Protocol):
    """What the control plane needs of a kind of training job: a module with these names."""

    API_VERSION: str
    """`<group>/<version>` of the job's resource."""
    KIND: str
    PLURAL: str
    """The resource's plural (its API path, and its RBAC and CRD names)."""
    SUCCESS_CONDITION: str
    """Argo's success condition on the job, evaluated by the stage's wait step."""
    FAILURE_CONDITION: str
    """Argo's failure condition on the job."""

    def job_manifest(self, spec: PipelineSpec, stage_name: str, run_name: str = ...) -> dict[str, Any]:
        """The job one training stage of a run creates (metadata by pytorchjob.job_metadata, whatever the kind)."""
        ...


KINDS: dict[str, JobKind] = {"pytorchjob": pytorchjob, "trainjob": trainjob}
"""`cluster.job_kind` → its module."""

DEFAULT_JOB_KIND = "pytorchjob"
"""The kind of workflows/cleanup.py's `--kind` when it is not given (the spec's default too)."""


def job_kind(spec: PipelineSpec) -> JobKind:
    """The kind of job the spec's training stages create."""
    return KINDS[spec.cluster.job_kind]


def job_resource(name: str) -> tuple[str, str, str]:
    """(group, version, plural) of the kind `name`: what the API paths and CRD names of its jobs are built from."""
    kind = KINDS[name]
    group, version = kind.API_VERSION.split("/")
    return group, version, kind.PLURAL
