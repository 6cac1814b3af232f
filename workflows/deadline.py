"""The workflow's deadline: the worst case of the steps its template holds, unless the spec sets one."""

from __future__ import annotations

import math

from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec
from workflows.control_steps import (
    CLEANUP_POLICY,
    NOTIFY_POLICY,
    RETENTION_POLICY,
    SERVE_POLICY,
    serve_deadline_seconds,
)
from workflows.search_steps import hpo_attempt_seconds
from workflows.step_templates import DEADLINE_BACKSTOP_SECONDS, capped_seconds, worst_case_seconds
from workflows.training_steps import training_attempt_seconds
from workflows.variant_dag import SWITCHES_POLICY


def workflow_deadline(spec: PipelineSpec) -> int:
    """workflow.active_deadline_seconds, or when unset the worst case of the steps the template holds, in DAG order
    (each may run, whatever the form switches off), plus an hour for scheduling and the exit handler."""
    if spec.workflow.active_deadline_seconds is not None:
        return spec.workflow.active_deadline_seconds
    if spec.variants:
        return variants_deadline(spec)
    total = float(DEADLINE_BACKSTOP_SECONDS)
    for name in spec.stages.enabled():
        policy = spec.stage(name).run_policy
        timeout = policy.active_deadline_seconds
        if name in TRAINING_STAGES:
            timeout = training_attempt_seconds(policy)
            if getattr(spec.stage(name), "hpo", None) is not None:
                total += hpo_attempt_seconds(spec.stage(name))
        total += worst_case_seconds(policy, timeout)
    if spec.stages.deploy.enabled and spec.stages.deploy.serving.enabled:
        total += worst_case_seconds(SERVE_POLICY, serve_deadline_seconds(spec))
    total += worst_case_seconds(CLEANUP_POLICY, CLEANUP_POLICY.active_deadline_seconds)  # the exit handler's
    if spec.retention.enabled:
        total += worst_case_seconds(RETENTION_POLICY, RETENTION_POLICY.active_deadline_seconds)
    if spec.notifications.slack:
        total += worst_case_seconds(NOTIFY_POLICY, NOTIFY_POLICY.active_deadline_seconds)
    return capped_seconds(total)


def variants_deadline(spec: PipelineSpec) -> int:
    """The deadline of a pipeline with variants: each chain's own worst case (workflow_deadline of the variant,
    its hour of slack and exit handler included), the longest when all chains run at once, else their sum. Argo's
    `parallelism` admits pods, not chains, so fewer slots than chains may interleave them: only the sum bounds
    that."""
    from spec.variants import variant_specs

    chains = [workflow_deadline(vspec) for vspec in variant_specs(spec).values()]
    parallelism = spec.workflow.parallelism
    switches = worst_case_seconds(SWITCHES_POLICY, SWITCHES_POLICY.active_deadline_seconds)
    return capped_seconds(
        math.ceil(switches) + (max(chains) if parallelism is None or parallelism >= len(chains) else sum(chains))
    )
