"""The entry DAG of a pipeline with variants: the switches step, then one chain of stages per variant."""

from __future__ import annotations

from typing import Any

from hera.workflows import DAG, Container, Parameter, RawArtifact, Steps, Task
from hera.workflows import models as m

from spec.pipeline import PipelineSpec
from spec.stage import StepPolicy
from workflows import parameters as params
from workflows.control_steps import CLEANUP, CONTROL_STEP_SIZE, RETENTION
from workflows.launch import SCRATCH_DIR, WRITABLE_ENV
from workflows.pipeline_dag import ENTRYPOINT, chain_templates
from workflows.pytorchjob import SCRATCH_VOLUME, container_security_context, resource_requirements
from workflows.step_templates import (
    OUTPUTS_DIR,
    PARAMS_DIR,
    RUN_DIR,
    step_identity,
    step_pod_spec_patch,
    step_retry_strategy,
)

SWITCHES = "switches"
SWITCHES_POLICY = StepPolicy(
    active_deadline_seconds=300, retries=2, retry_backoff="10s", termination_grace_period_seconds=30
)
"""The first step of a pipeline with variants (workflows/switches.py): it only reads a few files."""


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
        **step_identity(spec),
    )


def variant_templates(spec: PipelineSpec) -> list[Any]:
    """The entry DAG `pipeline` of a pipeline with variants: `switches`, then one task per variant (run when its
    switch is on, at most workflow.parallelism at once); the switches' template and each variant's chain."""
    from spec.variants import variant_specs

    form_names = params.variant_form(spec)[1]
    tasks, templates = [Task(name=SWITCHES, template=SWITCHES)], [switches_template(spec)]
    for variant, vspec in variant_specs(spec).items():
        when = f"{{{{tasks.{SWITCHES}.outputs.parameters.run-{variant}}}}} == true"
        tasks.append(Task(name=variant, template=variant, depends=SWITCHES, when=when))
        templates += variant_chain(vspec, variant, form_names[variant])
    return [DAG(name=ENTRYPOINT, tasks=tasks, parallelism=spec.workflow.parallelism), *templates]
