"""The compiler: DAG shape, training steps, UI form, Workflow and CronWorkflow."""

from __future__ import annotations

import pytest
import yaml

from workflows.compile import compile_pipeline, template_name
from workflows.loading import load_pipeline
from workflows.pytorchjob import FAILURE_CONDITION, SUCCESS_CONDITION
from workflows.spec import MAX_PIPELINE_NAME_LENGTH, RunPolicy


def _template(name: str = "korean-llm", overrides: tuple[str, ...] = ()) -> dict:
    spec = load_pipeline(name, overrides=list(overrides)).spec
    return compile_pipeline(spec).documents()["workflowtemplate.yaml"]


def _tasks(doc: dict) -> dict[str, dict]:
    dag = next(t for t in doc["spec"]["templates"] if t["name"] == doc["spec"]["entrypoint"])
    return {t["name"]: t for t in dag["dag"]["tasks"]}


def test_dag_runs_the_stages_in_order() -> None:
    tasks = _tasks(_template())
    assert list(tasks) == ["prepare", "cpt", "sft", "rlhf", "evaluate", "deploy", "serve"]
    assert tasks["cpt"]["depends"] == "prepare"
    assert tasks["sft"]["depends"] == "cpt"
    assert tasks["rlhf"]["depends"] == "sft"
    assert tasks["evaluate"]["depends"] == "rlhf"
    for stage in ("cpt", "sft", "rlhf", "evaluate"):
        assert tasks[stage]["when"] == (
            f"{{{{tasks.prepare.outputs.parameters.run-{stage}}}}} == true"
            " && {{tasks.prepare.outputs.parameters.proceed}} == true"
        )


def test_prepare_can_end_a_scheduled_run_with_the_reason_in_the_ui() -> None:
    templates = {t["name"]: t for t in _template()["spec"]["templates"]}
    outputs = {p["name"]: p for p in templates["prepare"]["outputs"]["parameters"]}
    assert outputs["proceed"]["valueFrom"] == {"path": "/tmp/outputs/proceed"}
    assert outputs["skip-reason"]["globalName"] == "skip-reason"  # shown on the workflow in the UI
    assert outputs["skip-reason"]["valueFrom"]["default"] == ""
    notify = templates["notify"]["container"]
    assert notify["command"][-2:] == ["--run-dir", "/mnt/checkpoints/runs/{{workflow.name}}"]
    assert notify["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/mnt/checkpoints", "readOnly": True}]


def test_disabled_stages_drop_out_and_edges_close_up() -> None:
    doc = _template(overrides=("stages.cpt.enabled=false", "stages.rlhf.enabled=false"))
    tasks = _tasks(doc)
    assert list(tasks) == ["prepare", "sft", "evaluate", "deploy", "serve"]
    assert tasks["sft"]["depends"] == "prepare"
    assert tasks["evaluate"]["depends"] == "sft"
    names = {t["name"] for t in doc["spec"]["templates"]}
    assert "cpt" not in names and "rlhf" not in names
    params = {p["name"] for p in doc["spec"]["arguments"]["parameters"]}
    assert "run-cpt" not in params and "cpt-data" not in params and "run-sft" in params


def test_deploy_runs_only_after_a_passed_gate() -> None:
    deploy = _tasks(_template())["deploy"]
    assert deploy["depends"] == "evaluate.Succeeded"
    assert "{{tasks.evaluate.outputs.parameters.gate}} == pass" in deploy["when"]
    evaluate = next(t for t in _template()["spec"]["templates"] if t["name"] == "evaluate")
    assert evaluate["outputs"]["parameters"] == [{"name": "gate", "valueFrom": {"path": "/tmp/outputs/gate"}}]


def test_training_steps_create_pytorchjobs_and_wait_on_the_operator() -> None:
    templates = {t["name"]: t for t in _template()["spec"]["templates"]}
    for stage in ("cpt", "sft", "rlhf"):
        step = templates[stage]
        resource = step["resource"]
        assert resource["action"] == "create"
        assert resource["setOwnerReference"] is True
        assert resource["successCondition"] == SUCCESS_CONDITION
        assert resource["failureCondition"] == FAILURE_CONDITION
        job = yaml.safe_load(resource["manifest"])
        assert job["kind"] == "PyTorchJob" and job["metadata"]["generateName"] == f"{{{{workflow.name}}}}-{stage}-"
        assert step["outputs"]["parameters"][0] == {"name": "job-name", "valueFrom": {"jsonPath": "{.metadata.name}"}}
        # A retry is a new node, so `create` makes a fresh job that resumes from the PVC checkpoints.
        assert step["retryStrategy"]["retryPolicy"] == "Always" and int(step["retryStrategy"]["limit"]) >= 1
    assert templates["cpt"]["timeout"] == f"{259200 + 3600}s"
    cpt_job = yaml.safe_load(templates["cpt"]["resource"]["manifest"])
    assert cpt_job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    sft_job = yaml.safe_load(templates["sft"]["resource"]["manifest"])
    assert "Worker" not in sft_job["spec"]["pytorchReplicaSpecs"]


def test_prepare_gets_every_parameter_as_a_file_never_on_the_command_line() -> None:
    doc = _template()
    prepare = next(t for t in doc["spec"]["templates"] if t["name"] == "prepare")
    command = prepare["container"]["command"]
    assert not any("{{workflow.parameters" in arg for arg in command)
    artifacts = {a["name"]: a for a in prepare["inputs"]["artifacts"]}
    for param in doc["spec"]["arguments"]["parameters"]:
        assert artifacts[param["name"]]["raw"]["data"] == f"{{{{workflow.parameters.{param['name']}}}}}"
        assert artifacts[param["name"]]["path"] == f"/params/{param['name']}"
    assert "{{" not in artifacts["pipeline-spec"]["raw"]["data"]  # base64: Argo sees no expression in it
    outputs = {p["name"] for p in prepare["outputs"]["parameters"]}
    assert outputs == {"run-cpt", "run-sft", "run-rlhf", "run-evaluate", "run-deploy", "proceed", "skip-reason"}


def test_ui_form_has_descriptions_and_closed_sets() -> None:
    params = {p["name"]: p for p in _template()["spec"]["arguments"]["parameters"]}
    assert params["base-model"]["value"] == "Qwen/Qwen3-8B-Base"
    assert params["run-cpt"]["enum"] == ["true", "false"]
    assert params["cpt-data"]["value"] == "/mnt/datasets/korean-corpus/{data_version}/"
    assert all(p.get("description") for p in params.values())


def test_exit_handler_posts_with_the_webhook_from_a_secret() -> None:
    doc = _template()
    assert doc["spec"]["onExit"] == "notify"
    notify = next(t for t in doc["spec"]["templates"] if t["name"] == "notify")
    (env,) = notify["container"]["env"]
    assert env == {"name": "SLACK_WEBHOOK_URL", "valueFrom": {"secretKeyRef": {"name": "slack-webhook", "key": "url"}}}
    no_slack = _template("qwen3-30b-a3b")
    assert "onExit" not in no_slack["spec"]


def test_retention_keeps_finished_runs_for_resubmission() -> None:
    spec = _template()["spec"]
    assert spec["podGC"] == {"strategy": "OnPodSuccess"}
    assert spec["ttlStrategy"] == {"secondsAfterSuccess": 604800, "secondsAfterFailure": 1209600}


def test_workflow_and_cron_reference_the_template_with_explicit_arguments() -> None:
    spec = load_pipeline("korean-llm").spec
    docs = compile_pipeline(spec, {"base-model": "Qwen/Qwen3-4B-Base"}).documents()
    wf = docs["workflow.yaml"]
    assert wf["metadata"]["generateName"] == "korean-llm-"
    assert wf["spec"]["workflowTemplateRef"] == {"name": "korean-llm"}
    args = {p["name"]: p["value"] for p in wf["spec"]["arguments"]["parameters"]}
    assert args["base-model"] == "Qwen/Qwen3-4B-Base" and args["run-sft"] == "true"
    cron = docs["cronworkflow.yaml"]["spec"]
    assert cron["schedules"] == ["0 2 * * 1"] and cron["timezone"] == "Asia/Seoul"
    assert cron["concurrencyPolicy"] == "Forbid" and cron["startingDeadlineSeconds"] == 3600
    assert cron["successfulJobsHistoryLimit"] == 5 and cron["failedJobsHistoryLimit"] == 5
    assert cron["workflowSpec"]["workflowTemplateRef"] == {"name": "korean-llm"}
    assert "cronworkflow.yaml" not in compile_pipeline(load_pipeline("llama3-dolly").spec).documents()


def test_unknown_workflow_parameter_is_refused() -> None:
    spec = load_pipeline("korean-llm").spec
    try:
        compile_pipeline(spec, {"base_model": "x"})
    except ValueError as exc:
        assert "base_model" in str(exc) and "base-model" in str(exc)
    else:
        raise AssertionError("an unknown parameter was accepted")


def test_a_passing_deploy_is_served_through_an_applied_inference_service() -> None:
    doc = _template()
    assert _tasks(doc)["serve"] == {"name": "serve", "template": "serve", "depends": "deploy.Succeeded"}
    serve = next(t for t in doc["spec"]["templates"] if t["name"] == "serve")["resource"]
    assert serve["action"] == "apply"
    service = yaml.safe_load(serve["manifest"])
    assert service["kind"] == "InferenceService"
    assert (
        service["spec"]["predictor"]["model"]["storageUri"]
        == "pvc://checkpoints-rwx/runs/{{workflow.name}}/deploy/model"
    )
    no_serving = _template(overrides=("stages.deploy.serving.enabled=false",))
    assert "serve" not in _tasks(no_serving)


def test_retries_wait_at_most_an_hour_and_are_never_cut_off() -> None:
    """Argo's backoff `maxDuration` stops retrying once that long has passed since the first attempt, so a stage
    that failed after a day of training would never be retried: each wait is capped with `cap` instead."""
    for stage in ("cpt", "sft", "rlhf"):
        template = next(t for t in _template()["spec"]["templates"] if t["name"] == stage)
        backoff = template["retryStrategy"]["backoff"]
        assert backoff == {"duration": "2m", "factor": "2", "cap": "1h"}
        assert "maxDuration" not in backoff


def test_every_training_step_has_a_timeout() -> None:
    """Without a deadline in the spec, a job stuck at Created would hold the step forever: the default deadline
    (7 days) still bounds it, and an explicit one is kept."""
    spec = load_pipeline("korean-llm").spec
    spec.stages.sft.run_policy = RunPolicy()
    templates = {t["name"]: t for t in compile_pipeline(spec).documents()["workflowtemplate.yaml"]["spec"]["templates"]}
    assert templates["sft"]["timeout"] == f"{7 * 24 * 3600 + 3600}s"
    assert templates["rlhf"]["timeout"] == f"{86400 + 3600}s"


def test_container_steps_know_their_image() -> None:
    templates = {
        t["name"]: t for t in _template(overrides=("stages.evaluate.resources.image=r/eval:1",))["spec"]["templates"]
    }
    for name in ("prepare", "evaluate", "deploy"):
        container = templates[name]["container"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["POSTTRAIN_IMAGE"] == container["image"]
    assert templates["evaluate"]["container"]["image"] == "r/eval:1"


def test_a_profile_names_the_template_and_schedule_but_not_the_runs() -> None:
    loaded = load_pipeline("korean-llm", "local")
    docs = compile_pipeline(loaded.spec, profile=loaded.profile).documents()
    assert docs["workflowtemplate.yaml"]["metadata"]["name"] == "korean-llm-local"
    assert docs["cronworkflow.yaml"]["metadata"]["name"] == "korean-llm-local"
    assert docs["cronworkflow.yaml"]["spec"]["workflowSpec"]["workflowTemplateRef"] == {"name": "korean-llm-local"}
    assert docs["workflow.yaml"]["spec"]["workflowTemplateRef"] == {"name": "korean-llm-local"}
    assert docs["workflow.yaml"]["metadata"]["generateName"] == "korean-llm-"
    assert docs["workflowtemplate.yaml"]["metadata"]["labels"]["posttrain.dev/pipeline"] == "korean-llm"


@pytest.mark.parametrize("profile", ["QLoRA", "q_lora", "-qlora", "qlora-"])
def test_a_profile_name_must_fit_a_dns_label(profile: str) -> None:
    with pytest.raises(ValueError, match=rf"profile '{profile}' names the WorkflowTemplate 'korean-llm-{profile}'"):
        template_name(load_pipeline("korean-llm").spec, profile)


def test_a_scheduled_profile_fits_the_service_names_of_its_runs() -> None:
    """The CronWorkflow names its runs `<template>-<10 digits>`, and the training jobs' Services after them."""
    spec = load_pipeline("korean-llm").spec  # scheduled
    longest = "p" * (MAX_PIPELINE_NAME_LENGTH - len("korean-llm-"))
    assert template_name(spec, longest) == f"korean-llm-{longest}"
    with pytest.raises(ValueError) as err:
        template_name(spec, longest + "p")
    assert f"({MAX_PIPELINE_NAME_LENGTH + 1} characters), over the {MAX_PIPELINE_NAME_LENGTH} that fit" in str(
        err.value
    )
    assert "(the training jobs' Services of a scheduled run are named after it): shorten the profile name" in str(
        err.value
    )


def test_an_unscheduled_profile_fits_argos_template_name_limit() -> None:
    spec = load_pipeline("llama3-dolly").spec  # not scheduled
    longest = "p" * (63 - len("llama3-dolly-"))
    assert template_name(spec, longest) == f"llama3-dolly-{longest}"
    with pytest.raises(ValueError, match=r"WorkflowTemplate 'llama3-dolly-p+' \(64 characters\), over the 63 that fit"):
        template_name(spec, longest + "p")
