"""A training stage's steps: each attempt creates the stage's job and waits on its verdict, retried with a fresh job."""

from __future__ import annotations

from typing import Any

import yaml
from hera.workflows import Parameter, Resource, Step, Steps
from hera.workflows import models as m

from spec.pipeline import PipelineSpec
from spec.stage import StepPolicy
from workflows.control_steps import CLEANUP, CLEANUP_POLICY, cleanup_template
from workflows.job_kinds import job_kind
from workflows.pytorchjob import WORKFLOW_LABEL
from workflows.step_templates import (
    DEADLINE_BACKSTOP_SECONDS,
    RETRY_BACKOFF_CAP,
    RUN_DIR,
    duration_seconds,
    job_creator_identity,
    worst_case_seconds,
)

CREATE_TIMEOUT_SECONDS = 600
"""The step that creates a training stage's PyTorchJob: scheduling its pod and one API call."""
WAIT_RETRIES = 10
WAIT_RETRY_BACKOFF = "30s"
WAIT_FINAL_MESSAGES = ("failure condition", "deadline", "not found", "has been deleted")
"""What ends the wait on a job for good (Argo's node message): the operator's verdict (the failure condition
matched), the step's timeout, the job gone. Anything else (the wait pod deleted, evicted or lost with its node) is
retried: the wait only reads the job, so a retry watches the same job on."""
WAIT_RETRY_EXPRESSION = " && ".join(f'!(lastRetry.message contains "{m}")' for m in WAIT_FINAL_MESSAGES)


def training_templates(spec: PipelineSpec, stage_name: str, run_name: str = RUN_DIR) -> list[Any]:
    """A training stage: the steps template `<stage>` (one attempt: delete what an earlier attempt left running,
    create a PyTorchJob, wait on the operator's verdict), retried with a fresh job, and the templates it runs.

    One job per stage at a time. Argo cannot tell a job that failed from a wait pod that was lost: an evicted pod
    is Failed too, and a single create-and-wait step retried after losing its pod would create a second job that
    trains into the same run directory while the first still runs. So creating and waiting are separate steps:
    `create` is never retried by itself (a retry cannot know whether the lost attempt's job exists), `wait` only
    reads the job and is retried freely on anything but a final answer (WAIT_RETRY_EXPRESSION), and the whole
    attempt is retried on a failure, its first step deleting the stage's unfinished jobs (a job whose create or
    wait pod was lost) before a new one is created."""
    stage = spec.stage(stage_name)
    rp = stage.run_policy
    kind = job_kind(spec)
    job = kind.job_manifest(spec, stage_name, run_name)
    success, failure = kind.SUCCESS_CONDITION, kind.FAILURE_CONDITION
    job["metadata"]["labels"][WORKFLOW_LABEL] = RUN_DIR  # a variant's run too: cleanup finds the workflow's jobs
    create = Resource(
        name=f"{stage_name}-create",
        action="create",
        set_owner_reference=True,
        manifest=yaml.safe_dump(job, sort_keys=False, allow_unicode=True),
        outputs=[Parameter(name="job-name", value_from=m.ValueFrom(json_path="{.metadata.name}"))],
        timeout=f"{CREATE_TIMEOUT_SECONDS}s",
        **job_creator_identity(spec),
    )
    watched = {
        "apiVersion": job["apiVersion"],
        "kind": job["kind"],
        "metadata": {"name": "{{inputs.parameters.job-name}}", "namespace": job["metadata"]["namespace"]},
    }
    # activeDeadlineSeconds does not apply to resource templates; `timeout` bounds any leaf node, including a job
    # the operator never starts (stuck at Created, where its own deadline may never fire).
    wait = Resource(
        name=f"{stage_name}-wait",
        action="get",
        manifest=yaml.safe_dump(watched, sort_keys=False),
        success_condition=success,
        failure_condition=failure,
        inputs=[Parameter(name="job-name")],
        outputs=[Parameter(name="job-name", value_from=m.ValueFrom(json_path="{.metadata.name}"))],
        retry_strategy=m.RetryStrategy(
            limit=str(WAIT_RETRIES),
            retry_policy="Always",
            expression=WAIT_RETRY_EXPRESSION,
            backoff=m.Backoff(duration=WAIT_RETRY_BACKOFF, factor="2", cap=RETRY_BACKOFF_CAP),
        ),
        timeout=f"{rp.active_deadline_seconds + DEADLINE_BACKSTOP_SECONDS}s",
        **job_creator_identity(spec),
    )
    created = "{{steps.create.outputs.parameters.job-name}}"
    attempt = Steps(
        name=stage_name,
        sub_steps=[
            # `retries` is this template's own attempt number: the first attempt has nothing to clean up.
            Step(name="reap", template=f"{stage_name}-{CLEANUP}", when="{{retries}} > 0"),
            Step(name="create", template=create.name),
            Step(name="wait", template=wait.name, arguments=[Parameter(name="job-name", value=created)]),
        ],
        outputs=[Parameter(name="job-name", value_from=m.ValueFrom(parameter=created))],
        retry_strategy=m.RetryStrategy(
            limit=str(rp.retries),
            retry_policy="Always",
            backoff=m.Backoff(duration=rp.retry_backoff, factor="2", cap=RETRY_BACKOFF_CAP),
        ),
    )
    return [attempt, cleanup_template(spec, stage_name), create, wait]


def training_attempt_seconds(policy: StepPolicy) -> float:
    """The longest one attempt of a training stage can take (training_templates): the cleanup before a retry, the
    create step, and the wait, whose retries all watch the same job (bounded by its deadline plus an hour) with
    Argo's waits between them."""
    base, cap = duration_seconds(WAIT_RETRY_BACKOFF), duration_seconds(RETRY_BACKOFF_CAP)
    wait_pauses = sum(min(base * 2**i, cap) for i in range(WAIT_RETRIES))
    wait = policy.active_deadline_seconds + DEADLINE_BACKSTOP_SECONDS + wait_pauses
    return worst_case_seconds(CLEANUP_POLICY, CLEANUP_POLICY.active_deadline_seconds) + CREATE_TIMEOUT_SECONDS + wait
