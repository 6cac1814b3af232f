"""The compiler: a pipeline spec → Argo WorkflowTemplate, Workflow and CronWorkflow, built with Hera.

The WorkflowTemplate is what users resubmit: it holds the DAG prepare → cpt → sft → rlhf → evaluate → deploy
(disabled stages are left out and the edges close up), the UI form, and the compiled spec. The Workflow and the
CronWorkflow only reference it, with explicit arguments, so "Resubmit" in the UI edits the same form.

The template and the CronWorkflow are named after the pipeline, or `<pipeline>-<profile>` when a profile was
applied, so a profile never replaces the plain template that the pipeline's schedule runs. Workflows keep the
generateName `<pipeline>-` either way (the training jobs' Service names are built from it).

The template's parts come from one module each: workflows/pipeline_dag.py (one model's DAG) and
workflows/variant_dag.py (a pipeline with variants), workflows/stage_steps.py (prepare, evaluate, deploy),
workflows/training_steps.py (a training stage's job, of the kind workflows/job_kinds.py selects),
workflows/search_steps.py (a Katib search), workflows/control_steps.py (serve, cleanup, notify, retention, the exit
handler) and workflows/deadline.py; workflows/step_templates.py holds what their steps share.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hera.workflows import CronWorkflow, Parameter, Workflow, WorkflowTemplate
from hera.workflows import models as m

from run.names import PIPELINE_LABEL
from spec.pipeline import MAX_PIPELINE_NAME_LENGTH, PipelineSpec
from workflows import parameters as params
from workflows.control_steps import EXIT_HANDLER, cleanup_template, exit_handler_template, notify_template
from workflows.deadline import workflow_deadline
from workflows.pipeline_dag import ENTRYPOINT, chain_templates
from workflows.pytorchjob import pod_security_context, run_dir
from workflows.step_templates import RUN_DIR
from workflows.variant_dag import variant_templates

MAX_TEMPLATE_NAME_LENGTH = 63
"""Argo refuses a longer WorkflowTemplate name (the limit of a Kubernetes label value)."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

MAX_OBJECT_BYTES = 1024 * 1024
"""The most a compiled document may weigh: etcd refuses requests over 1.5 MiB, and Argo copies the template into
every Workflow it starts, next to the workflow's own status."""


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


def _labels(spec: PipelineSpec) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "posttrain", PIPELINE_LABEL: spec.name, **spec.workflow.labels}


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
        # No token unless a template asks for one: only the resource steps do (job_creator_identity).
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
