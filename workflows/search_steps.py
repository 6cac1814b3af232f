"""A training stage's hyperparameter search in the cluster: the steps around its Katib Experiment."""

from __future__ import annotations

from typing import Any

import yaml
from hera.workflows import Parameter, RawArtifact, Resource, Step, Steps
from hera.workflows import models as m

from spec.pipeline import PipelineSpec
from spec.stage import Resources, StageBase, StepPolicy
from workflows import katib
from workflows.pytorchjob import WORKFLOW_LABEL, run_dir
from workflows.step_templates import (
    DEADLINE_BACKSTOP_SECONDS,
    PARAMS_DIR,
    RETRY_BACKOFF_CAP,
    RUN_DIR,
    capped_seconds,
    container_template,
    duration_seconds,
    job_creator_identity,
    worst_case_seconds,
)
from workflows.training_steps import CREATE_TIMEOUT_SECONDS, WAIT_RETRIES, WAIT_RETRY_BACKOFF, WAIT_RETRY_EXPRESSION

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
        **job_creator_identity(spec),
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
        **job_creator_identity(spec),
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
    select = container_template(spec, f"{name}-select", step, command, inputs=inputs)
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
