"""The compiler: a pipeline spec → Argo WorkflowTemplate, Workflow and CronWorkflow, built with Hera.

The WorkflowTemplate is what users resubmit: it holds the DAG prepare → cpt → sft → rlhf → evaluate → deploy
(disabled stages are left out and the edges close up), the UI form, and the compiled spec. The Workflow and the
CronWorkflow only reference it, with explicit arguments, so "Resubmit" in the UI edits the same form.

The template and the CronWorkflow are named after the pipeline, or `<pipeline>-<profile>` when a profile was
applied, so a profile never replaces the plain template that the pipeline's schedule runs. Workflows keep the
generateName `<pipeline>-` either way (the training jobs' Service names are built from it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import yaml
from hera.workflows import (
    DAG,
    Container,
    CronWorkflow,
    Parameter,
    RawArtifact,
    Resource,
    Step,
    Steps,
    Task,
    Workflow,
    WorkflowTemplate,
)
from hera.workflows import models as m

from workflows import katib, serving, trainjob
from workflows import parameters as params
from workflows.pytorchjob import (
    FAILURE_CONDITION,
    PIPELINE_LABEL,
    SCRATCH_DIR,
    SCRATCH_VOLUME,
    STAGE_LABEL,
    SUCCESS_CONDITION,
    WORKFLOW_LABEL,
    WRITABLE_ENV,
    container_security_context,
    pod_env,
    pod_security_context,
    pytorchjob_manifest,
    resource_requirements,
    run_dir,
    stage_image,
    volumes,
)
from workflows.sizing import PodSize, pod_size
from workflows.spec import (
    MAX_PIPELINE_NAME_LENGTH,
    TRAINING_STAGES,
    PipelineSpec,
    Resources,
    StageBase,
    StepPolicy,
)
from workflows.validation import go_duration_seconds

MAX_TEMPLATE_NAME_LENGTH = 63
"""Argo refuses a longer WorkflowTemplate name (the limit of a Kubernetes label value)."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

MAX_OBJECT_BYTES = 1024 * 1024
"""The most a compiled document may weigh: etcd refuses requests over 1.5 MiB, and Argo copies the template into
every Workflow it starts, next to the workflow's own status."""

ENTRYPOINT = "pipeline"
PARAMS_DIR = "/params"
OUTPUTS_DIR = "/tmp/outputs"
RUN_DIR = "{{workflow.name}}"
NOTIFY = "notify"
EXIT_HANDLER = "exit-handler"
RETENTION = "retention"
CLEANUP = "cleanup"
SWITCHES = "switches"

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

SWITCHES_POLICY = StepPolicy(
    active_deadline_seconds=300, retries=2, retry_backoff="10s", termination_grace_period_seconds=30
)
"""The first step of a pipeline with variants (workflows/switches.py): it only reads a few files."""

CREATE_TIMEOUT_SECONDS = 600
"""The step that creates a training stage's PyTorchJob: scheduling its pod and one API call."""
WAIT_RETRIES = 10
WAIT_RETRY_BACKOFF = "30s"
WAIT_FINAL_MESSAGES = ("failure condition", "deadline", "not found", "has been deleted")
"""What ends the wait on a job for good (Argo's node message): the operator's verdict (the failure condition
matched), the step's timeout, the job gone. Anything else (the wait pod deleted, evicted or lost with its node) is
retried: the wait only reads the job, so a retry watches the same job on."""
WAIT_RETRY_EXPRESSION = " && ".join(f'!(lastRetry.message contains "{m}")' for m in WAIT_FINAL_MESSAGES)

CONTROL_STEP_SIZE = PodSize(cpu="100m", memory="256Mi")
"""Steps that make a few API calls or read a few files (cleanup, notify, switches)."""
SERVE_SIZE = PodSize(cpu="250m", memory="512Mi")
"""The serve step: API calls, and smoke checks over HTTP."""

EXECUTOR_CONTAINERS = {"initContainers": "init", "containers": "wait"}
"""Argo's own containers in a container step's pod (emissary executor, the default pod layout)."""


@dataclass
class CompiledPipeline:
    """What a spec compiles to."""

    spec: PipelineSpec
    template: WorkflowTemplate
    workflow: Workflow
    cron: CronWorkflow | None

    def documents(self) -> dict[str, dict[str, Any]]:
        """File name → resource, as plain dicts ready for YAML."""
        docs = {"workflowtemplate.yaml": self.template.to_dict(), "workflow.yaml": self.workflow.to_dict()}
        if self.cron is not None:
            docs["cronworkflow.yaml"] = self.cron.to_dict()
        return docs


# --------------------------------------------------------------------------- names


def template_name(spec: PipelineSpec, profile: str | None = None) -> str:
    """The name of the WorkflowTemplate and the CronWorkflow: the pipeline's, or `<pipeline>-<profile>`.

    A scheduled profile's runs are named `<pipeline>-<profile>-<10 digits>` by the CronWorkflow, and the training
    jobs' Services after them, so that name must fit the same limit as a pipeline name."""
    if profile is None:
        return spec.name
    name = f"{spec.name}-{profile}"
    if not _DNS_LABEL.match(profile):
        raise ValueError(
            f"profile {profile!r} names the WorkflowTemplate {name!r}: a profile name must be lowercase letters, "
            "digits and '-', starting and ending with a letter or digit"
        )
    objects, limit, why = "WorkflowTemplate", MAX_TEMPLATE_NAME_LENGTH, "Argo's limit for a WorkflowTemplate name"
    if spec.schedule.cron:
        objects, limit = "WorkflowTemplate and CronWorkflow", MAX_PIPELINE_NAME_LENGTH
        why = "the training jobs' Services of a scheduled run are named after it"
    if len(name) > limit:
        raise ValueError(
            f"profile {profile!r} names the {objects} {name!r} ({len(name)} characters), over the {limit} that "
            f"fit ({why}): shorten the profile name"
        )
    return name


# --------------------------------------------------------------------------- templates


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


def _step_identity(spec: PipelineSpec) -> dict[str, Any]:
    """A pod that runs stage code: the account without a Role, no token for the stage's container; Argo mounts the
    executor account's token into its own init and wait containers only."""
    cluster = spec.cluster
    return {
        "service_account_name": cluster.pod_service_account,
        "automount_service_account_token": False,
        "executor": m.ExecutorConfig(service_account_name=cluster.executor_service_account),
    }


def _job_creator_identity(spec: PipelineSpec) -> dict[str, Any]:
    """A resource step (create a PyTorchJob, apply the InferenceService): the account whose Role allows exactly
    that, with its token (the workflow's default is no token)."""
    return {"service_account_name": spec.cluster.service_account, "automount_service_account_token": True}


def _container_template(
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
        **_step_identity(spec),
    )


def prepare_template(spec: PipelineSpec, rundir: str) -> Container:
    """prepare: every UI parameter arrives as a file, the compiled spec too; the step resolves and validates
    them, writes `<run-dir>/spec.json`, and outputs which stages run."""
    inputs = [RawArtifact(name="pipeline-spec", path=f"{PARAMS_DIR}/{params.SPEC_FILE}", data=params.embed_spec(spec))]
    inputs += [
        RawArtifact(name=p.name, path=f"{PARAMS_DIR}/{p.name}", data=f"{{{{workflow.parameters.{p.name}}}}}")
        for p in params.ui_parameters(spec)
    ]
    switches = params.stage_switches(spec)
    outputs = [Parameter(name=name, value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/{name}")) for name in switches]
    outputs.append(Parameter(name="proceed", value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/proceed")))
    # Global, so the Argo UI shows on the workflow why a scheduled run ended after prepare.
    outputs.append(
        Parameter(
            name="skip-reason",
            global_name="skip-reason",
            value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/skip-reason", default=""),
        )
    )
    command = [
        "python", "-m", "stages", "prepare",
        "--run-dir", rundir,
        "--params-dir", PARAMS_DIR,
        "--outputs-dir", OUTPUTS_DIR,
    ]  # fmt: skip
    return _container_template(spec, "prepare", spec.stages.prepare, command, inputs=inputs, outputs=outputs)


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
    if spec.cluster.job_kind == "trainjob":
        job = trainjob.trainjob_manifest(spec, stage_name, run_name)
        success, failure = trainjob.SUCCESS_CONDITION, trainjob.FAILURE_CONDITION
    else:
        job = pytorchjob_manifest(spec, stage_name, run_name)
        success, failure = SUCCESS_CONDITION, FAILURE_CONDITION
    job["metadata"]["labels"][WORKFLOW_LABEL] = RUN_DIR  # a variant's run too: cleanup finds the workflow's jobs
    create = Resource(
        name=f"{stage_name}-create",
        action="create",
        set_owner_reference=True,
        manifest=yaml.safe_dump(job, sort_keys=False, allow_unicode=True),
        outputs=[Parameter(name="job-name", value_from=m.ValueFrom(json_path="{.metadata.name}"))],
        timeout=f"{CREATE_TIMEOUT_SECONDS}s",
        **_job_creator_identity(spec),
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
        **_job_creator_identity(spec),
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


HPO_SELECT_POLICY = StepPolicy(
    active_deadline_seconds=1800, retries=2, retry_backoff="30s", termination_grace_period_seconds=30
)
"""The step after a search that records its best trial and writes the values into the run's spec."""
OPTIMAL_TRIAL_FILE = "optimal-trial.json"


def search_wait_seconds(stage: StageBase) -> float:
    """The wait on a stage's Experiment: every round of parallel trials running to the trial job's deadline (the
    stage's), plus the backstop for scheduling and Katib's own bookkeeping."""
    rounds = katib.search_waves(stage)  # type: ignore[arg-type]
    return rounds * stage.run_policy.active_deadline_seconds + DEADLINE_BACKSTOP_SECONDS


def hpo_attempt_seconds(stage: StageBase) -> float:
    """The longest a stage's search can take (hpo_templates): create, wait (retried on a lost pod, as a training
    stage's wait is) and select."""
    base, cap = duration_seconds(WAIT_RETRY_BACKOFF), duration_seconds(RETRY_BACKOFF_CAP)
    wait = search_wait_seconds(stage) + sum(min(base * 2**i, cap) for i in range(WAIT_RETRIES))
    select = worst_case_seconds(HPO_SELECT_POLICY, HPO_SELECT_POLICY.active_deadline_seconds)
    return CREATE_TIMEOUT_SECONDS + wait + select


def hpo_templates(spec: PipelineSpec, stage_name: str, run_name: str = RUN_DIR) -> list[Any]:
    """A stage's hyperparameter search for the run `run_name`: the steps template `<stage>-hpo` (create the Katib
    Experiment, wait on its verdict, then `select`: record the search and write the best values into the run's
    spec.json, which the stage reads next), and the templates it runs. Not retried as a whole: a search that failed
    has used up its trials, and one whose wait pod was lost is watched on by the wait's own retries."""
    stage = spec.stage(stage_name)
    name = f"{stage_name}-hpo"
    rundir = run_dir(spec, run_name)
    experiment = katib.experiment_manifest(spec, stage_name, run_name)
    # A variant's search too: cleanup finds the workflow's Experiments and trial jobs by the workflow's name.
    experiment["metadata"]["labels"][WORKFLOW_LABEL] = RUN_DIR
    experiment["spec"]["trialTemplate"]["trialSpec"]["metadata"]["labels"][WORKFLOW_LABEL] = RUN_DIR
    create = Resource(
        name=f"{name}-create",
        action="create",
        set_owner_reference=True,  # the Workflow's deletion deletes the Experiment, and Katib its trials
        manifest=yaml.safe_dump(experiment, sort_keys=False, allow_unicode=True),
        outputs=[Parameter(name="experiment-name", value_from=m.ValueFrom(json_path="{.metadata.name}"))],
        timeout=f"{CREATE_TIMEOUT_SECONDS}s",
        **_job_creator_identity(spec),
    )
    watched = {
        "apiVersion": katib.API_VERSION,
        "kind": katib.KIND,
        "metadata": {"name": "{{inputs.parameters.experiment-name}}", "namespace": spec.cluster.namespace},
    }
    wait = Resource(
        name=f"{name}-wait",
        action="get",
        manifest=yaml.safe_dump(watched, sort_keys=False),
        success_condition=katib.SUCCESS_CONDITION,
        failure_condition=katib.FAILURE_CONDITION,
        inputs=[Parameter(name="experiment-name")],
        outputs=[Parameter(name="optimal-trial", value_from=m.ValueFrom(json_path="{.status.currentOptimalTrial}"))],
        retry_strategy=m.RetryStrategy(
            limit=str(WAIT_RETRIES),
            retry_policy="Always",
            expression=WAIT_RETRY_EXPRESSION,
            backoff=m.Backoff(duration=WAIT_RETRY_BACKOFF, factor="2", cap=RETRY_BACKOFF_CAP),
        ),
        timeout=f"{capped_seconds(search_wait_seconds(stage))}s",
        **_job_creator_identity(spec),
    )
    # The best trial reaches the select step as a file (never on a command line), like the form's values.
    inputs: list[Any] = [
        Parameter(name="optimal-trial"),
        RawArtifact(
            name="optimal-trial-file",
            path=f"{PARAMS_DIR}/{OPTIMAL_TRIAL_FILE}",
            data="{{inputs.parameters.optimal-trial}}",
        ),
    ]
    command = ["python", "-m", "stages", "hpo-select", "--run-dir", rundir, "--stage", stage_name]
    command += ["--optimal-trial", f"{PARAMS_DIR}/{OPTIMAL_TRIAL_FILE}"]
    step = StageBase(
        resources=Resources(cpu="500m", memory="1Gi", shm_size=None, image=stage.resources.image),
        env=dict(stage.env),
        run_policy=HPO_SELECT_POLICY,
    )
    select = _container_template(spec, f"{name}-select", step, command, inputs=inputs)
    created = "{{steps.create.outputs.parameters.experiment-name}}"
    search = Steps(
        name=name,
        sub_steps=[
            Step(name="create", template=create.name),
            Step(name="wait", template=wait.name, arguments=[Parameter(name="experiment-name", value=created)]),
            Step(
                name="select",
                template=select.name,
                arguments=[Parameter(name="optimal-trial", value="{{steps.wait.outputs.parameters.optimal-trial}}")],
            ),
        ],
        outputs=[Parameter(name="experiment-name", value_from=m.ValueFrom(parameter=created))],
    )
    return [search, create, wait, select]


def evaluate_template(spec: PipelineSpec, rundir: str) -> Container:
    """evaluate: one pod; its `gate` output ('pass'/'fail') decides whether deploy runs."""
    command = ["python", "-m", "stages", "evaluate", "--run-dir", rundir, "--outputs-dir", OUTPUTS_DIR]
    outputs = [Parameter(name="gate", value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/gate"))]
    return _container_template(spec, "evaluate", spec.stages.evaluate, command, outputs=outputs)


def deploy_template(spec: PipelineSpec, rundir: str) -> Container:
    """deploy: register the model and move the aliases."""
    command = ["python", "-m", "stages", "deploy", "--run-dir", rundir, "--outputs-dir", OUTPUTS_DIR]
    return _container_template(spec, "deploy", spec.stages.deploy, command)


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
        **_job_creator_identity(spec),
    )


def cleanup_template(spec: PipelineSpec, stage: str | None = None) -> Container:
    """Delete the run's unfinished PyTorchJobs (of one `stage`, named `<stage>-cleanup`, or all, named `cleanup`):
    workflows/cleanup.py, with the job-creating account's token (its Role allows listing and deleting them)."""
    # The names are Argo's own values for this workflow, never the form's: argv is safe.
    command = ["python", "-m", "workflows.cleanup", "--namespace", "{{workflow.namespace}}"]
    command += ["--workflow", "{{workflow.name}}"] + (["--stage", stage] if stage else [])
    if spec.cluster.job_kind != "pytorchjob":
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
        **_job_creator_identity(spec),
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
        **_step_identity(spec),
    )


# --------------------------------------------------------------------------- the DAG


def _when_enabled(stage: str) -> str:
    """Run `stage` when the form switched it on and prepare did not end the run (unchanged data)."""
    outputs = "tasks.prepare.outputs.parameters"
    return f"{{{{{outputs}.run-{stage}}}}} == true && {{{{{outputs}.proceed}}}} == true"


def pipeline_dag(spec: PipelineSpec) -> DAG:
    """prepare → enabled stages in order. A stage switched off at run time is Skipped, and a skipped task still
    satisfies a plain `depends`, so the chain closes up; deploy needs evaluate to have Succeeded with gate=pass."""
    tasks = [Task(name="prepare", template="prepare")]
    previous = "prepare"
    for stage in spec.stages.enabled():
        if stage == "prepare":
            continue
        if stage == "deploy":
            tasks.append(
                Task(
                    name="deploy",
                    template="deploy",
                    depends="evaluate.Succeeded",
                    when=f"{_when_enabled('deploy')} && {{{{tasks.evaluate.outputs.parameters.gate}}}} == pass",
                )
            )
            if spec.stages.deploy.serving.enabled:
                tasks.append(Task(name="serve", template="serve", depends="deploy.Succeeded"))
            continue
        if getattr(spec.stage(stage), "hpo", None) is not None:
            search = f"{stage}-hpo"
            tasks.append(Task(name=search, template=search, depends=previous, when=_when_enabled(stage)))
            previous = search
        tasks.append(Task(name=stage, template=stage, depends=previous, when=_when_enabled(stage)))
        previous = stage
    if spec.retention.enabled:
        tasks.append(Task(name=RETENTION, template=RETENTION, depends=retention_depends([t.name for t in tasks])))
    return DAG(name=ENTRYPOINT, tasks=tasks)


def retention_depends(task_names: list[str]) -> str:
    """When the retention step runs: after the last task, also when the gate kept deploy from running (deploy
    Skipped, the tasks after it Omitted), never after a failure. A task that runs after a failed one makes Argo
    count the failure as handled and the DAG Succeeded, so it must not depend on any `.Failed`."""
    last = task_names[-1]
    if "deploy" not in task_names or last == "deploy":
        return last
    return f"{last}.Succeeded || {last}.Skipped || deploy.Skipped"


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
    container = _container_template(spec, RETENTION, step, command)
    container.service_account_name = spec.cluster.service_account
    container.automount_service_account_token = True
    return container


# --------------------------------------------------------------------------- the deadline


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


def training_attempt_seconds(policy: StepPolicy) -> float:
    """The longest one attempt of a training stage can take (training_templates): the cleanup before a retry, the
    create step, and the wait, whose retries all watch the same job (bounded by its deadline plus an hour) with
    Argo's waits between them."""
    base, cap = duration_seconds(WAIT_RETRY_BACKOFF), duration_seconds(RETRY_BACKOFF_CAP)
    wait_pauses = sum(min(base * 2**i, cap) for i in range(WAIT_RETRIES))
    wait = policy.active_deadline_seconds + DEADLINE_BACKSTOP_SECONDS + wait_pauses
    return worst_case_seconds(CLEANUP_POLICY, CLEANUP_POLICY.active_deadline_seconds) + CREATE_TIMEOUT_SECONDS + wait


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
    from workflows.variants import variant_specs

    chains = [workflow_deadline(vspec) for vspec in variant_specs(spec).values()]
    parallelism = spec.workflow.parallelism
    switches = worst_case_seconds(SWITCHES_POLICY, SWITCHES_POLICY.active_deadline_seconds)
    return capped_seconds(
        math.ceil(switches) + (max(chains) if parallelism is None or parallelism >= len(chains) else sum(chains))
    )


def _labels(spec: PipelineSpec) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "posttrain", PIPELINE_LABEL: spec.name, **spec.workflow.labels}


def chain_templates(spec: PipelineSpec, run_name: str) -> list[Any]:
    """The DAG `pipeline` of one model's stages and the templates it runs, for the run `run_name` (its run
    directory and its jobs' names)."""
    rundir = run_dir(spec, run_name)
    templates: list[Any] = [pipeline_dag(spec), prepare_template(spec, rundir)]
    for stage in spec.stages.enabled():
        if stage in TRAINING_STAGES:
            if getattr(spec.stage(stage), "hpo", None) is not None:
                templates += hpo_templates(spec, stage, run_name)
            templates += training_templates(spec, stage, run_name)
    if spec.stages.evaluate.enabled:
        templates.append(evaluate_template(spec, rundir))
    if spec.stages.deploy.enabled:
        templates.append(deploy_template(spec, rundir))
        if spec.stages.deploy.serving.enabled:
            templates.append(serve_template(spec, rundir))
    if spec.retention.enabled:
        templates.append(retention_template(spec))
    return templates


# --------------------------------------------------------------------------- variants


def variant_run_name(variant: str) -> str:
    """A variant's run in the cluster, `<workflow>-<variant>`: its run directory, and the start of its jobs'
    names (a flat name, so the runs and retention commands find it as any run)."""
    return f"{RUN_DIR}-{variant}"


def _prefixed(template: Any, prefix: str) -> Any:
    """`template` renamed `<prefix><name>`, and the templates its DAG tasks or steps call likewise."""
    template.name = f"{prefix}{template.name}"
    if isinstance(template, DAG):
        for task in template.tasks:
            task.template = f"{prefix}{task.template}"
    elif isinstance(template, Steps):
        for step in template.sub_steps:
            step.template = f"{prefix}{step.template}"
    return template


def variant_chain(spec: PipelineSpec, variant: str, form_names: dict[str, str]) -> list[Any]:
    """One variant's templates, named `<variant>-<template>`, its chain the DAG `<variant>`: its prepare reads the
    form's values for it (`form_names`: plain name → the form's) under the plain names, the cleanup before a
    training retry deletes its own jobs only, and retention spares its current run."""
    run_name = variant_run_name(variant)
    templates = chain_templates(spec, run_name)
    for template in templates:
        if template.name == "prepare":
            for artifact in template.inputs:
                if artifact.name in form_names:
                    artifact.data = f"{{{{workflow.parameters.{form_names[artifact.name]}}}}}"
            for output in template.outputs:
                if output.global_name:  # one per variant: Argo's global outputs are the workflow's
                    output.global_name = f"{variant}-{output.global_name}"
        elif template.name.endswith(f"-{CLEANUP}"):  # the stages share names across variants; the jobs do not
            template.command += ["--pipeline", spec.name]
        elif template.name == RETENTION:
            template.command += ["--current", run_name]
    chain = templates[0]
    _prefixed(chain, f"{variant}-")
    chain.name = variant
    return [chain, *(_prefixed(t, f"{variant}-") for t in templates[1:])]


def switches_template(spec: PipelineSpec) -> Container:
    """switches: the form's run-<variant> values, as files, checked and turned into outputs the DAG's conditions
    read (workflows/switches.py), so a value never reaches an expression. No token, a read-only root filesystem."""
    names = [v.name for v in spec.variants]
    command = ["python", "-m", "workflows.switches", "--params-dir", PARAMS_DIR, "--outputs-dir", OUTPUTS_DIR]
    return Container(
        name=SWITCHES,
        image=spec.cluster.image,
        image_pull_policy=spec.cluster.image_pull_policy,
        command=[*command, *names],
        env=[m.EnvVar(name="HOME", value=WRITABLE_ENV["HOME"])],
        volumes=[m.Volume(name=SCRATCH_VOLUME, empty_dir=m.EmptyDirVolumeSource())],
        volume_mounts=[m.VolumeMount(name=SCRATCH_VOLUME, mount_path=SCRATCH_DIR)],
        resources=m.ResourceRequirements.model_validate(resource_requirements(CONTROL_STEP_SIZE)),
        security_context=m.SecurityContext.model_validate(container_security_context()),
        inputs=[
            RawArtifact(name=f"run-{n}", path=f"{PARAMS_DIR}/run-{n}", data=f"{{{{workflow.parameters.run-{n}}}}}")
            for n in names
        ],
        outputs=[Parameter(name=f"run-{n}", value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/run-{n}")) for n in names],
        active_deadline_seconds=SWITCHES_POLICY.active_deadline_seconds,
        retry_strategy=step_retry_strategy(SWITCHES_POLICY),
        pod_spec_patch=step_pod_spec_patch(spec, SWITCHES_POLICY),
        **_step_identity(spec),
    )


def variant_templates(spec: PipelineSpec) -> list[Any]:
    """The entry DAG `pipeline` of a pipeline with variants: `switches`, then one task per variant (run when its
    switch is on, at most workflow.parallelism at once); the switches' template and each variant's chain."""
    from workflows.variants import variant_specs

    form_names = params.variant_form(spec)[1]
    tasks, templates = [Task(name=SWITCHES, template=SWITCHES)], [switches_template(spec)]
    for variant, vspec in variant_specs(spec).items():
        when = f"{{{{tasks.{SWITCHES}.outputs.parameters.run-{variant}}}}} == true"
        tasks.append(Task(name=variant, template=variant, depends=SWITCHES, when=when))
        templates += variant_chain(vspec, variant, form_names[variant])
    return [DAG(name=ENTRYPOINT, tasks=tasks, parallelism=spec.workflow.parallelism), *templates]


def workflow_template(spec: PipelineSpec, name: str | None = None) -> WorkflowTemplate:
    """The WorkflowTemplate (named `name`, default the pipeline's): DAG, templates, UI form, retention and the
    exit handler."""
    rundir = run_dir(spec, RUN_DIR)  # with variants, the exit handler's notification finds no run of its own
    templates = variant_templates(spec) if spec.variants else chain_templates(spec, RUN_DIR)
    templates += [exit_handler_template(spec), cleanup_template(spec)]
    if spec.notifications.slack:
        templates.append(notify_template(spec, rundir))
    wf = spec.workflow
    annotations = {"workflows.argoproj.io/description": spec.description} if spec.description else None
    return WorkflowTemplate(
        name=name or spec.name,
        namespace=spec.cluster.namespace,
        labels=_labels(spec),
        annotations=annotations,
        entrypoint=ENTRYPOINT,
        # No token unless a template asks for one: only the resource steps do (_job_creator_identity).
        service_account_name=spec.cluster.pod_service_account,
        automount_service_account_token=False,
        arguments=[
            Parameter(name=p.name, value=p.default, description=p.description, enum=list(p.enum) if p.enum else None)
            for p in params.ui_parameters(spec)
        ],
        templates=templates,
        on_exit=EXIT_HANDLER,
        pod_gc=m.PodGC(strategy=wf.pod_gc),
        ttl_strategy=m.TTLStrategy(
            seconds_after_success=wf.ttl_seconds_after_success,
            seconds_after_failure=wf.ttl_seconds_after_failure,
        ),
        active_deadline_seconds=workflow_deadline(spec),
        security_context=m.PodSecurityContext.model_validate(pod_security_context(spec)),
        image_pull_secrets=[m.LocalObjectReference(name=n) for n in spec.cluster.image_pull_secrets] or None,
    )


def _arguments(spec: PipelineSpec, values: dict[str, str] | None) -> list[Parameter]:
    known = {p.name: p.default for p in params.ui_parameters(spec)}
    unknown = sorted(set(values or {}) - set(known))
    if unknown:
        raise ValueError(f"unknown workflow parameters {unknown}; the template has {sorted(known)}")
    return [Parameter(name=k, value=(values or {}).get(k, v)) for k, v in known.items()]


def submitted_workflow(
    spec: PipelineSpec, values: dict[str, str] | None = None, template: str | None = None
) -> Workflow:
    """A run of the template (named `template`, default the pipeline's), with every argument explicit so the
    UI's Resubmit shows them."""
    return Workflow(
        generate_name=f"{spec.name}-",
        namespace=spec.cluster.namespace,
        labels=_labels(spec),
        workflow_template_ref=m.WorkflowTemplateRef(name=template or spec.name),
        arguments=_arguments(spec, values),
    )


def cron_workflow(spec: PipelineSpec, name: str | None = None) -> CronWorkflow | None:
    """The schedule, named like the template it references (`name`, default the pipeline's); None when the spec
    has no cron expressions."""
    sched = spec.schedule
    if not sched.cron:
        return None
    name = name or spec.name
    return CronWorkflow(
        name=name,
        namespace=spec.cluster.namespace,
        labels=_labels(spec),
        schedules=list(sched.cron),
        timezone=sched.timezone,
        concurrency_policy=sched.concurrency_policy,
        starting_deadline_seconds=sched.starting_deadline_seconds,
        successful_jobs_history_limit=sched.successful_history,
        failed_jobs_history_limit=sched.failed_history,
        cron_suspend=sched.suspend or None,
        workflow_template_ref=m.WorkflowTemplateRef(name=name),
        arguments=_arguments(spec, None),
    )


def compile_pipeline(
    spec: PipelineSpec, parameters: dict[str, str] | None = None, profile: str | None = None
) -> CompiledPipeline:
    """Compile a validated spec. `parameters` overrides UI parameter values of the submitted Workflow; `profile`
    (the one applied to `spec`, if any) names the template and the schedule."""
    name = template_name(spec, profile)
    compiled = CompiledPipeline(
        spec=spec,
        template=workflow_template(spec, name),
        workflow=submitted_workflow(spec, parameters, name),
        cron=cron_workflow(spec, name),
    )
    for file, document in compiled.documents().items():
        size = len(json.dumps(document, separators=(",", ":")).encode())
        if size > MAX_OBJECT_BYTES:
            raise ValueError(
                f"the compiled {document['kind']} ({file}) is {size} bytes, over the {MAX_OBJECT_BYTES} a Kubernetes "
                "object may have: shorten the pipeline's description, prompts or other long values"
            )
    return compiled
