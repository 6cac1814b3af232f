"""The control steps of a run, which run no stage code: serve, cleanup, notify, retention, the exit handler."""

from __future__ import annotations

from typing import Any

from hera.workflows import Container, RawArtifact, Step, Steps
from hera.workflows import models as m

from run import serving
from run.names import PIPELINE_LABEL, STAGE_LABEL
from spec.pipeline import PipelineSpec
from spec.sizing import PodSize
from spec.stage import Resources, StageBase, StepPolicy
from workflows.job_kinds import DEFAULT_JOB_KIND
from workflows.launch import SCRATCH_DIR, WRITABLE_ENV
from workflows.pytorchjob import SCRATCH_VOLUME, container_security_context, resource_requirements
from workflows.step_templates import (
    PARAMS_DIR,
    RETRY_BACKOFF_CAP,
    capped_seconds,
    container_template,
    job_creator_identity,
    step_identity,
    step_pod_spec_patch,
    step_retry_strategy,
)

NOTIFY = "notify"
EXIT_HANDLER = "exit-handler"
RETENTION = "retention"
CLEANUP = "cleanup"


SERVE_POLICY = StepPolicy(
    active_deadline_seconds=3600, retries=2, retry_backoff="30s", termination_grace_period_seconds=30
)
"""The serve step's retries (only what a retry can fix, as for the stages: a failed check is final); its timeout is
serve_deadline_seconds."""
SERVE_SLACK_SECONDS = 600
"""Time for the smoke checks and the API calls of the serve step, beyond its waits."""
NOTIFY_POLICY = StepPolicy(
    active_deadline_seconds=600, retries=2, retry_backoff="10s", termination_grace_period_seconds=30
)
"""The exit handler's timeout and retries (a notification is a courtesy: the step itself always exits 0)."""
RETENTION_POLICY = StepPolicy(
    active_deadline_seconds=1800, retries=2, retry_backoff="30s", termination_grace_period_seconds=30
)
"""The retention step (deleting old run directories of many GB takes a while on network storage)."""
CLEANUP_POLICY = StepPolicy(
    active_deadline_seconds=300, retries=3, retry_backoff="10s", termination_grace_period_seconds=30
)
"""Deleting unfinished jobs (workflows/cleanup.py, in the exit handler and before a training stage's retry): its
timeout and retries, after any failure (the API unreachable exits 1)."""

CONTROL_STEP_SIZE = PodSize(cpu="100m", memory="256Mi")
"""Steps that make a few API calls or read a few files (cleanup, notify, switches)."""
SERVE_SIZE = PodSize(cpu="250m", memory="512Mi")
"""The serve step: API calls, and smoke checks over HTTP."""


def serve_deadline_seconds(spec: PipelineSpec) -> int:
    """The serve step's timeout: a wait for the new revision, one per canary step (each held for the interval) and
    the full switch, one for a rollback, and slack for the smoke checks."""
    serving = spec.stages.deploy.serving
    waits = 2 + (len(serving.canary_traffic_percent) + 1 if serving.rollout == "canary" else 0)
    holds = serving.canary_interval_seconds * len(serving.canary_traffic_percent) if serving.rollout == "canary" else 0
    return waits * serving.smoke_check.ready_timeout_seconds + holds + SERVE_SLACK_SECONDS


def _read_only_run_dirs(spec: PipelineSpec) -> dict[str, Any]:
    """The volumes of a control step that reads run directories: the checkpoints volume read-only, and /tmp."""
    checkpoints = spec.cluster.checkpoints
    return {
        "volumes": [
            m.Volume(
                name="checkpoints",
                persistent_volume_claim=m.PersistentVolumeClaimVolumeSource(
                    claim_name=checkpoints.claim_name, read_only=True
                ),
            ),
            m.Volume(name=SCRATCH_VOLUME, empty_dir=m.EmptyDirVolumeSource()),
        ],
        "volume_mounts": [
            m.VolumeMount(name="checkpoints", mount_path=checkpoints.mount_path, read_only=True),
            m.VolumeMount(name=SCRATCH_VOLUME, mount_path=SCRATCH_DIR),
        ],
    }


def serve_template(spec: PipelineSpec, rundir: str) -> Container:
    """serve: roll the model deploy published out to its InferenceService (workflows/rollout.py): apply, wait for
    the new revision, smoke-check it, step canary traffic, then move `champion`, or roll back.

    A container step, not a resource template: Argo's success condition is evaluated as soon as the object is
    applied, when KServe still reports the previous revision as ready, and a label selector cannot say "the revision
    created after the one that served before". It runs as the account that may apply InferenceServices (with its
    token), with only the MLflow credentials, and holds a mutex per service, so two runs never roll one out at
    once."""
    cluster = spec.cluster
    secrets = {
        name: ref for name, ref in cluster.secrets.env().items() if name.startswith("MLFLOW_")
    }  # the alias move only
    env = [
        m.EnvVar(name="ARGO_WORKFLOW_NAME", value="{{workflow.name}}"),
        m.EnvVar(name="PYTHONUNBUFFERED", value="1"),
        m.EnvVar(name="HOME", value=WRITABLE_ENV["HOME"]),
        *(m.EnvVar(name=k, value=v) for k, v in cluster.env.items() if k != "HOME"),
        *(
            m.EnvVar(
                name=name,
                value_from=m.EnvVarSource(
                    secret_key_ref=m.SecretKeySelector(name=ref.name, key=ref.key, optional=True)
                ),
            )
            for name, ref in secrets.items()
        ),
    ]
    deadline = capped_seconds(serve_deadline_seconds(spec))
    return Container(
        name="serve",
        image=cluster.image,
        image_pull_policy=cluster.image_pull_policy,
        command=["python", "-m", "workflows.rollout", "--run-dir", rundir],
        env=env,
        **_read_only_run_dirs(spec),
        resources=m.ResourceRequirements.model_validate(resource_requirements(SERVE_SIZE)),
        security_context=m.SecurityContext.model_validate(container_security_context()),
        labels={PIPELINE_LABEL: spec.name, STAGE_LABEL: "serve"},
        synchronization=m.Synchronization(
            mutexes=[m.Mutex(name=f"posttrain-serve-{serving.inference_service_name(spec)}")]
        ),
        active_deadline_seconds=deadline,
        retry_strategy=step_retry_strategy(SERVE_POLICY),
        pod_spec_patch=step_pod_spec_patch(spec, SERVE_POLICY),
        **job_creator_identity(spec),
    )


def cleanup_template(spec: PipelineSpec, stage: str | None = None) -> Container:
    """Delete the run's unfinished PyTorchJobs (of one `stage`, named `<stage>-cleanup`, or all, named `cleanup`):
    workflows/cleanup.py, with the job-creating account's token (its Role allows listing and deleting them)."""
    # The names are Argo's own values for this workflow, never the form's: argv is safe.
    command = ["python", "-m", "workflows.cleanup", "--namespace", "{{workflow.namespace}}"]
    command += ["--workflow", "{{workflow.name}}"] + (["--stage", stage] if stage else [])
    if spec.cluster.job_kind != DEFAULT_JOB_KIND:
        command += ["--kind", spec.cluster.job_kind]
    if stage is None and any(getattr(spec.stage(s), "hpo", None) for s in spec.stages.enabled()):
        command.append("--experiments")  # the exit handler's: a stopped run's search must not go on
    return Container(
        name=f"{stage}-{CLEANUP}" if stage else CLEANUP,
        image=spec.cluster.image,
        image_pull_policy=spec.cluster.image_pull_policy,
        command=command,
        env=[m.EnvVar(name="HOME", value=WRITABLE_ENV["HOME"])],
        volumes=[m.Volume(name=SCRATCH_VOLUME, empty_dir=m.EmptyDirVolumeSource())],
        volume_mounts=[m.VolumeMount(name=SCRATCH_VOLUME, mount_path=SCRATCH_DIR)],
        resources=m.ResourceRequirements.model_validate(resource_requirements(CONTROL_STEP_SIZE)),
        security_context=m.SecurityContext.model_validate(container_security_context()),
        active_deadline_seconds=CLEANUP_POLICY.active_deadline_seconds,
        retry_strategy=m.RetryStrategy(
            limit=str(CLEANUP_POLICY.retries),
            retry_policy="Always",
            backoff=m.Backoff(duration=CLEANUP_POLICY.retry_backoff, factor="2", cap=RETRY_BACKOFF_CAP),
        ),
        pod_spec_patch=step_pod_spec_patch(spec, CLEANUP_POLICY),
        **job_creator_identity(spec),
    )


def exit_handler_template(spec: PipelineSpec) -> Steps:
    """The exit handler: when the run did not succeed (stopped, failed, past its deadline), delete its unfinished
    training jobs, so their GPUs are freed now rather than when the Workflow object is deleted; then, when
    notifications.slack is on, post the outcome (also when the cleanup failed). Argo runs no exit handler for a
    terminated workflow: `python -m workflows.runs stop --terminate` deletes the jobs itself."""
    steps = [
        Step(
            name=CLEANUP,
            template=CLEANUP,
            when="{{workflow.status}} != Succeeded",
            continue_on=m.ContinueOn(failed=True, error=True),
        )
    ]
    if spec.notifications.slack:
        steps.append(Step(name=NOTIFY, template=NOTIFY))
    return Steps(name=EXIT_HANDLER, sub_steps=steps)


def notify_template(spec: PipelineSpec, rundir: str) -> Container:
    """The exit handler: post the outcome to Slack. The webhook URL comes from a Secret, nothing else does."""
    ref = spec.cluster.secrets.slack_webhook
    assert ref is not None  # the spec validator guarantees it when notifications.slack is on
    values = {
        "pipeline": spec.name,
        "workflow-name": "{{workflow.name}}",
        "workflow-namespace": "{{workflow.namespace}}",
        "status": "{{workflow.status}}",
        "failures": "{{workflow.failures}}",
        "duration": "{{workflow.duration}}",
        "ui-url": spec.cluster.argo_ui_url or "",
        "grafana-url": spec.cluster.grafana_url or "",
        # The link is built only from an http(s) URI, with any credential in it masked (workflows/notify.py).
        "mlflow-uri": spec.tracking.mlflow_tracking_uri or spec.cluster.env.get("MLFLOW_TRACKING_URI", ""),
        "notify-on": ",".join(spec.notifications.on),
        "note": spec.notifications.channel_note or "",
    }
    inputs = [RawArtifact(name=k, path=f"{PARAMS_DIR}/{k}", data=v) for k, v in values.items()]
    # Only HOME: the exit handler imports no library that caches anything.
    env = [m.EnvVar(name="HOME", value=WRITABLE_ENV["HOME"])]
    return Container(
        name=NOTIFY,
        image=spec.cluster.image,
        image_pull_policy=spec.cluster.image_pull_policy,
        # The run directory (read-only) tells it why a scheduled run ended after prepare.
        command=["python", "-m", "workflows.notify", "--params-dir", PARAMS_DIR, "--run-dir", rundir],
        **_read_only_run_dirs(spec),
        env=[
            *env,
            m.EnvVar(
                name="SLACK_WEBHOOK_URL",
                value_from=m.EnvVarSource(secret_key_ref=m.SecretKeySelector(name=ref.name, key=ref.key)),
            ),
        ],
        resources=m.ResourceRequirements.model_validate(resource_requirements(CONTROL_STEP_SIZE)),
        security_context=m.SecurityContext.model_validate(container_security_context()),
        inputs=inputs,
        active_deadline_seconds=NOTIFY_POLICY.active_deadline_seconds,
        retry_strategy=step_retry_strategy(NOTIFY_POLICY),
        pod_spec_patch=step_pod_spec_patch(spec, NOTIFY_POLICY),
        **step_identity(spec),
    )


def retention_template(spec: PipelineSpec) -> Container:
    """retention: `python -m workflows.runs prune` over the pipeline's run directories, with the checkpoints volume
    mounted read-write. It runs as the job-creating ServiceAccount, whose token reads the InferenceService (what a
    serving revision uses is never deleted); the Argo server is not asked, the stage records say which runs ended."""
    retention = spec.retention
    command = ["python", "-m", "workflows.runs", "prune", "--pipeline", spec.name]
    command += ["--checkpoints", spec.cluster.checkpoints.mount_path]
    if retention.keep_last is not None:
        command += ["--keep-last", str(retention.keep_last)]
    if retention.keep_days is not None:
        command += ["--keep-days", f"{retention.keep_days:g}"]
    step = StageBase(resources=Resources(cpu="500m", memory="1Gi"), run_policy=RETENTION_POLICY)
    container = container_template(spec, RETENTION, step, command)
    container.service_account_name = spec.cluster.service_account
    container.automount_service_account_token = True
    return container
