"""What the compiled workflow's step templates are built from: paths, retries, pod settings, identities, worst cases."""

from __future__ import annotations

import json
import math
from typing import Any

from hera.workflows import Container, Parameter, RawArtifact
from hera.workflows import models as m

from run.names import PIPELINE_LABEL, STAGE_LABEL
from spec.pipeline import PipelineSpec
from spec.sizing import pod_size
from spec.stage import StageBase, StepPolicy
from spec.validation import go_duration_seconds
from workflows.pytorchjob import container_security_context, pod_env, resource_requirements, stage_image, volumes

PARAMS_DIR = "/params"
OUTPUTS_DIR = "/tmp/outputs"
RUN_DIR = "{{workflow.name}}"


MAX_RENDERED_SECONDS = 100 * 365 * 24 * 3600
"""The longest deadline or timeout the compiler writes (a hundred years): Argo reads them into Go durations (int64
nanoseconds, about 292 years), and the worst cases it adds up from the spec's (each at most ten years) could pass
that."""


def capped_seconds(seconds: float) -> int:
    """Whole seconds, at most MAX_RENDERED_SECONDS."""
    return min(math.ceil(seconds), MAX_RENDERED_SECONDS)


# Slack of the template-level deadline over the job's own deadline: the operator is the detector.
DEADLINE_BACKSTOP_SECONDS = 3600

# The longest wait between two retries of a stage. Argo's `cap` bounds each wait; `maxDuration` would instead stop
# retrying once that long has passed since the first attempt, i.e. never retry a stage that ran longer.
RETRY_BACKOFF_CAP = "1h"


RETRYABLE_EXIT_CODES = ("75", "137", "143")
"""Exit codes of a stage's container that a retry can fix: 75, a stage interrupted by SIGTERM or SIGINT (it recorded
itself as interrupted), or one that found its stage held by another process; 137 and 143, killed by SIGKILL or
SIGTERM before it could say so (preemption past the grace period, a node shutting down)."""

STEP_RETRY_EXPRESSION = (
    'lastRetry.status == "Error" || (lastRetry.exitCode in ['
    + ", ".join(f'"{code}"' for code in RETRYABLE_EXIT_CODES)
    + '] && !(lastRetry.message contains "OOMKilled"))'
)
"""When Argo retries a single-pod step (an expr-lang expression over the failed attempt; Argo's `lastRetry.exitCode`
is a string). Status Error: the pod never ran the stage to its end (deleted, evicted, its node lost, or Argo's own
init or wait container failed). Status Failed: the stage's container exited non-zero, retried only for
RETRYABLE_EXIT_CODES and never when the kernel's OOM killer ended it (the same limits would end the retry the same
way). A failed stage (exit 1: its record says why) and bad input (exit 2) are never retried: the same input fails
the same way."""


EXECUTOR_CONTAINERS = {"initContainers": "init", "containers": "wait"}
"""Argo's own containers in a container step's pod (emissary executor, the default pod layout)."""


def step_retry_strategy(policy: StepPolicy) -> m.RetryStrategy:
    """Retries of a single-pod step: only what a retry can fix (STEP_RETRY_EXPRESSION), waits doubling from the
    policy's backoff up to RETRY_BACKOFF_CAP."""
    return m.RetryStrategy(
        limit=str(policy.retries),
        retry_policy="Always",  # both phases reach the expression, which decides
        expression=STEP_RETRY_EXPRESSION,
        backoff=m.Backoff(duration=policy.retry_backoff, factor="2", cap=RETRY_BACKOFF_CAP),
    )


def step_pod_spec_patch(spec: PipelineSpec, policy: StepPolicy) -> str:
    """The pod settings a container template has no field for: the grace period, and Argo's init and wait
    containers held to the restricted settings (cluster.executor_security_context)."""
    patch: dict[str, Any] = {"terminationGracePeriodSeconds": policy.termination_grace_period_seconds}
    if spec.cluster.executor_security_context:
        for field, name in EXECUTOR_CONTAINERS.items():
            patch[field] = [{"name": name, "securityContext": container_security_context()}]
    return json.dumps(patch, separators=(",", ":"))


def step_identity(spec: PipelineSpec) -> dict[str, Any]:
    """A pod that runs stage code: the account without a Role, no token for the stage's container; Argo mounts the
    executor account's token into its own init and wait containers only."""
    cluster = spec.cluster
    return {
        "service_account_name": cluster.pod_service_account,
        "automount_service_account_token": False,
        "executor": m.ExecutorConfig(service_account_name=cluster.executor_service_account),
    }


def job_creator_identity(spec: PipelineSpec) -> dict[str, Any]:
    """A resource step (create a PyTorchJob, apply the InferenceService): the account whose Role allows exactly
    that, with its token (the workflow's default is no token)."""
    return {"service_account_name": spec.cluster.service_account, "automount_service_account_token": True}


def container_template(
    spec: PipelineSpec,
    name: str,
    stage: StageBase,
    command: list[str],
    inputs: list[RawArtifact] | None = None,
    outputs: list[Parameter] | None = None,
    secret_env: bool = True,
) -> Container:
    """A single-pod step running in the trainer image with the volumes mounted (prepare, evaluate, deploy): no API
    token, a read-only root filesystem, a timeout and retries (stage.run_policy)."""
    res = stage.resources
    vols, mounts = volumes(spec, res.shm_size)
    env = pod_env(spec, stage) if secret_env else []
    policy = stage.run_policy
    return Container(
        name=name,
        image=stage_image(spec, stage),
        image_pull_policy=spec.cluster.image_pull_policy,
        command=command,
        env=[m.EnvVar.model_validate(e) for e in env],
        resources=m.ResourceRequirements.model_validate(
            resource_requirements(pod_size(spec, name, res), res.gpus_per_node)
        ),
        volume_mounts=[m.VolumeMount.model_validate(v) for v in mounts],
        volumes=[m.Volume.model_validate(v) for v in vols],
        security_context=m.SecurityContext.model_validate(container_security_context()),
        node_selector=dict(res.node_selector) or None,
        tolerations=[m.Toleration.model_validate(t.to_k8s()) for t in res.tolerations] or None,
        affinity=m.Affinity.model_validate(res.affinity) if res.affinity else None,
        priority_class_name=res.priority_class,
        labels={PIPELINE_LABEL: spec.name, STAGE_LABEL: name, **res.labels},
        annotations=dict(res.annotations) or None,
        inputs=inputs,
        outputs=outputs,
        active_deadline_seconds=policy.active_deadline_seconds,
        retry_strategy=step_retry_strategy(policy),
        pod_spec_patch=step_pod_spec_patch(spec, policy),
        **step_identity(spec),
    )


def duration_seconds(value: str) -> float:
    """Seconds in a retry backoff as Argo reads it: whole seconds ('120') or a Go duration ('90s', '1h30m')."""
    seconds = float(value) if value.isdigit() else go_duration_seconds(value)
    if seconds is None:
        raise ValueError(f"{value!r} is neither whole seconds nor a Go duration")
    return seconds


def worst_case_seconds(policy: StepPolicy, timeout_seconds: float) -> float:
    """The longest a step can take: every attempt running to its timeout, and Argo's waits between them (doubling
    from the backoff, each at most RETRY_BACKOFF_CAP)."""
    base, cap = duration_seconds(policy.retry_backoff), duration_seconds(RETRY_BACKOFF_CAP)
    waits = sum(min(base * 2**i, cap) for i in range(policy.retries))
    return (policy.retries + 1) * timeout_seconds + waits
