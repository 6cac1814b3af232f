"""The DAG of one model's stages, prepare → the enabled stages in order, with the templates it runs."""

from __future__ import annotations

from typing import Any

from hera.workflows import DAG, Task

from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec
from workflows.control_steps import RETENTION, retention_template, serve_template
from workflows.pytorchjob import run_dir
from workflows.search_steps import hpo_templates
from workflows.stage_steps import deploy_template, evaluate_template, prepare_template
from workflows.training_steps import training_templates

ENTRYPOINT = "pipeline"


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
