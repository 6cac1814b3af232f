"""The steps of the single-pod stages: prepare, evaluate, deploy."""

from __future__ import annotations

from hera.workflows import Container, Parameter, RawArtifact
from hera.workflows import models as m

from spec.form import SPEC_FILE, stage_switches
from spec.pipeline import PipelineSpec
from workflows import parameters as params
from workflows.step_templates import OUTPUTS_DIR, PARAMS_DIR, container_template


def prepare_template(spec: PipelineSpec, rundir: str) -> Container:
    """prepare: every UI parameter arrives as a file, the compiled spec too; the step resolves and validates
    them, writes `<run-dir>/spec.json`, and outputs which stages run."""
    inputs = [RawArtifact(name="pipeline-spec", path=f"{PARAMS_DIR}/{SPEC_FILE}", data=params.embed_spec(spec))]
    inputs += [
        RawArtifact(name=p.name, path=f"{PARAMS_DIR}/{p.name}", data=f"{{{{workflow.parameters.{p.name}}}}}")
        for p in params.ui_parameters(spec)
    ]
    switches = stage_switches(spec)
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
    return container_template(spec, "prepare", spec.stages.prepare, command, inputs=inputs, outputs=outputs)


def evaluate_template(spec: PipelineSpec, rundir: str) -> Container:
    """evaluate: one pod; its `gate` output ('pass'/'fail') decides whether deploy runs."""
    command = ["python", "-m", "stages", "evaluate", "--run-dir", rundir, "--outputs-dir", OUTPUTS_DIR]
    outputs = [Parameter(name="gate", value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/gate"))]
    return container_template(spec, "evaluate", spec.stages.evaluate, command, outputs=outputs)


def deploy_template(spec: PipelineSpec, rundir: str) -> Container:
    """deploy: register the model and move the aliases."""
    command = ["python", "-m", "stages", "deploy", "--run-dir", rundir, "--outputs-dir", OUTPUTS_DIR]
    return container_template(spec, "deploy", spec.stages.deploy, command)
