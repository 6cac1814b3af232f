"""The compiler: DAG shape, training steps, UI form, Workflow and CronWorkflow."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from spec.fields import MAX_DURATION_SECONDS
from spec.loading import load_pipeline
from spec.pipeline import MAX_PIPELINE_NAME_LENGTH
from spec.stage import RunPolicy
from workflows.compile import compile_pipeline, template_name
from workflows.pytorchjob import FAILURE_CONDITION, SUCCESS_CONDITION
from workflows.step_templates import duration_seconds
from workflows.training_steps import WAIT_RETRY_EXPRESSION


def _template(name: str = "korean-llm", overrides: tuple[str, ...] = ()) -> dict:
    spec = load_pipeline(name, overrides=list(overrides)).spec
    return compile_pipeline(spec).documents()["workflowtemplate.yaml"]


def _tasks(doc: dict) -> dict[str, dict]:
    dag = next(t for t in doc["spec"]["templates"] if t["name"] == doc["spec"]["entrypoint"])
    return {t["name"]: t for t in dag["dag"]["tasks"]}


def test_dag_runs_the_stages_in_order() -> None:
    tasks = _tasks(_template())
    assert list(tasks) == ["prepare", "cpt", "sft", "rlhf", "evaluate", "deploy", "serve", "retention"]
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
    assert notify["volumeMounts"] == [
        {"name": "checkpoints", "mountPath": "/mnt/checkpoints", "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def test_disabled_stages_drop_out_and_edges_close_up() -> None:
    doc = _template(overrides=("stages.cpt.enabled=false", "stages.rlhf.enabled=false"))
    tasks = _tasks(doc)
    assert list(tasks) == ["prepare", "sft", "evaluate", "deploy", "serve", "retention"]
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
        attempt, create, wait = templates[stage], templates[f"{stage}-create"], templates[f"{stage}-wait"]
        # One attempt: delete what an earlier attempt left running (not on the first), create, wait.
        assert attempt["steps"] == [
            [{"name": "reap", "template": f"{stage}-cleanup", "when": "{{retries}} > 0"}],
            [{"name": "create", "template": f"{stage}-create"}],
            [
                {
                    "name": "wait",
                    "template": f"{stage}-wait",
                    "arguments": {
                        "parameters": [{"name": "job-name", "value": "{{steps.create.outputs.parameters.job-name}}"}]
                    },
                }
            ],
        ]
        assert attempt["outputs"]["parameters"] == [
            {"name": "job-name", "valueFrom": {"parameter": "{{steps.create.outputs.parameters.job-name}}"}}
        ]
        # A genuine failure retries the whole attempt, so `create` makes a fresh job that resumes from the PVC
        # checkpoints; create itself is never retried (its lost pod may have created the job).
        assert attempt["retryStrategy"]["retryPolicy"] == "Always" and int(attempt["retryStrategy"]["limit"]) >= 1
        assert "retryStrategy" not in create
        assert create["resource"]["action"] == "create" and create["resource"]["setOwnerReference"] is True
        assert "successCondition" not in create["resource"]  # done once the job exists
        job = yaml.safe_load(create["resource"]["manifest"])
        assert job["kind"] == "PyTorchJob" and job["metadata"]["generateName"] == f"{{{{workflow.name}}}}-{stage}-"
        assert job["metadata"]["labels"]["workflows.argoproj.io/workflow"] == "{{workflow.name}}"  # cleanup's key
        assert create["outputs"]["parameters"] == [{"name": "job-name", "valueFrom": {"jsonPath": "{.metadata.name}"}}]
        # The wait only reads the job it is given, so it is retried on anything but a final answer.
        resource = wait["resource"]
        assert resource["action"] == "get" and "setOwnerReference" not in resource
        assert resource["successCondition"] == SUCCESS_CONDITION
        assert resource["failureCondition"] == FAILURE_CONDITION
        assert yaml.safe_load(resource["manifest"]) == {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": "{{inputs.parameters.job-name}}", "namespace": "llm-training"},
        }
        assert wait["retryStrategy"]["expression"] == WAIT_RETRY_EXPRESSION
        assert int(wait["retryStrategy"]["limit"]) >= 5
    assert templates["cpt-wait"]["timeout"] == f"{259200 + 3600}s"
    cpt_job = yaml.safe_load(templates["cpt-create"]["resource"]["manifest"])
    assert cpt_job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    sft_job = yaml.safe_load(templates["sft-create"]["resource"]["manifest"])
    assert "Worker" not in sft_job["spec"]["pytorchReplicaSpecs"]


@pytest.mark.parametrize(
    ("message", "retried"),
    [
        # A lost or evicted wait pod: the job trains on, watch it again.
        ("pod deleted", True),
        ("The node was low on resource: memory. Container wait was using 80Mi.", True),
        ("main: Error (exit code 1): Get https://10.0.0.1:443/apis: dial tcp: i/o timeout", True),
        # The operator's verdict, the step's timeout, the job gone: final.
        ("main: Error (exit code 1): failure condition 'status.conditions.2.type == Failed' evaluated true", False),
        ("Step exceeded its deadline", False),
        ('main: Error (exit code 1): Error from server (NotFound): pytorchjobs.kubeflow.org "x" not found', False),
        (
            "main: Error (exit code 1): The resource has been deleted while its status was still being checked. "
            "Will not be retried",
            False,
        ),
    ],
)
def test_the_wait_is_retried_unless_the_answer_is_final(message: str, retried: bool) -> None:
    assert _retried(WAIT_RETRY_EXPRESSION, "Failed", "1", message) is retried


def test_a_stage_can_never_run_two_jobs_at_once() -> None:
    """Each attempt after the first deletes the stage's unfinished jobs before it creates one; the stage's
    cleanup runs with the job-creating account, scoped to this workflow and stage."""
    templates = _templates(_template())
    for stage in ("cpt", "sft", "rlhf"):
        cleanup = templates[f"{stage}-cleanup"]
        assert cleanup["container"]["command"] == [
            "python", "-m", "workflows.cleanup",
            "--namespace", "{{workflow.namespace}}", "--workflow", "{{workflow.name}}", "--stage", stage,
        ]  # fmt: skip
        assert cleanup["serviceAccountName"] == "posttrain-workflow"
        assert cleanup["automountServiceAccountToken"] is True


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
    assert doc["spec"]["onExit"] == "exit-handler"
    notify = next(t for t in doc["spec"]["templates"] if t["name"] == "notify")
    home, env = notify["container"]["env"]
    assert home == {"name": "HOME", "value": "/tmp"}  # the root filesystem is read-only
    assert env == {"name": "SLACK_WEBHOOK_URL", "valueFrom": {"secretKeyRef": {"name": "slack-webhook", "key": "url"}}}
    no_slack = _template("qwen3-30b-a3b")
    assert no_slack["spec"]["onExit"] == "exit-handler"  # cleanup, without a notification
    assert "notify" not in _templates(no_slack)


def test_every_pipeline_cleans_up_after_a_run_that_did_not_succeed() -> None:
    """A stopped or failed run's PyTorchJobs keep their GPUs until the Workflow object goes: the exit handler of
    every shipped pipeline deletes them (then notifies, also when the cleanup failed, when Slack is on)."""
    for name in ("korean-llm", "qwen3-30b-a3b", "llama3-dolly"):
        spec = load_pipeline(name).spec
        templates = _templates(compile_pipeline(spec).documents()["workflowtemplate.yaml"])
        handler = templates["exit-handler"]
        cleanup = {
            "name": "cleanup",
            "template": "cleanup",
            "when": "{{workflow.status}} != Succeeded",
            "continueOn": {"failed": True, "error": True},
        }
        notify = [[{"name": "notify", "template": "notify"}]] if spec.notifications.slack else []
        assert handler["steps"] == [[cleanup], *notify], name
        command = templates["cleanup"]["container"]["command"]
        searches = any(getattr(spec.stage(s), "hpo", None) for s in spec.stages.enabled())
        assert command == [
            "python", "-m", "workflows.cleanup", "--namespace", "{{workflow.namespace}}",
            "--workflow", "{{workflow.name}}", *(["--experiments"] if searches else []),
        ], name  # fmt: skip
        assert templates["cleanup"]["serviceAccountName"] == spec.cluster.service_account, name
        assert templates["cleanup"]["retryStrategy"]["retryPolicy"] == "Always", name  # exit 1: the API refused


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


def test_a_passing_deploy_is_served_through_the_rollout() -> None:
    """serve rolls out the InferenceService deploy rendered in the run directory (read-only), one run per service
    at a time, with the MLflow credentials only (it moves champion) and no other secret."""
    doc = _template(
        overrides=(
            "cluster.secrets.mlflow_token.name=mlflow",
            "cluster.secrets.mlflow_token.key=token",
            "cluster.secrets.hf_token.name=hf",
            "cluster.secrets.hf_token.key=token",
        )
    )
    assert _tasks(doc)["serve"] == {"name": "serve", "template": "serve", "depends": "deploy.Succeeded"}
    serve = next(t for t in doc["spec"]["templates"] if t["name"] == "serve")
    container = serve["container"]
    assert container["command"] == [
        "python", "-m", "workflows.rollout", "--run-dir", "/mnt/checkpoints/runs/{{workflow.name}}"
    ]  # fmt: skip
    assert {"name": "checkpoints", "mountPath": "/mnt/checkpoints", "readOnly": True} in container["volumeMounts"]
    assert serve["synchronization"] == {"mutexes": [{"name": "posttrain-serve-korean-llm"}]}
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
    assert secrets["MLFLOW_TRACKING_TOKEN"] == "mlflow" and all(name.startswith("MLFLOW_") for name in secrets)
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
    assert templates["sft-wait"]["timeout"] == f"{7 * 24 * 3600 + 3600}s"
    assert templates["rlhf-wait"]["timeout"] == f"{86400 + 3600}s"
    assert templates["sft-create"]["timeout"] == "600s"


def test_container_steps_know_their_image() -> None:
    templates = {
        t["name"]: t for t in _template(overrides=("stages.evaluate.resources.image=r/eval:1",))["spec"]["templates"]
    }
    for name in ("prepare", "evaluate", "deploy"):
        container = templates[name]["container"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["POSTTRAIN_IMAGE"] == container["image"]
    assert templates["evaluate"]["container"]["image"] == "r/eval:1"


def test_the_object_store_secrets_reach_every_pod_that_reads_data() -> None:
    """s3:// data is read by prepare (and evaluate, and the training pods through their stage's data): the keys and
    the endpoint of an S3-compatible store reach each of them by secretKeyRef, never as a value."""
    overrides = (
        "cluster.secrets.aws_access_key_id={name: minio, key: access-key}",
        "cluster.secrets.aws_secret_access_key={name: minio, key: secret-key}",
        "cluster.secrets.aws_endpoint_url={name: minio, key: endpoint}",
    )
    templates = _templates(_template(overrides=overrides))
    wanted = {
        "AWS_ACCESS_KEY_ID": {"name": "minio", "key": "access-key", "optional": True},
        "AWS_SECRET_ACCESS_KEY": {"name": "minio", "key": "secret-key", "optional": True},
        "AWS_ENDPOINT_URL": {"name": "minio", "key": "endpoint", "optional": True},
    }
    containers = {name: templates[name]["container"] for name in ("prepare", "evaluate", "deploy")}
    for name in ("cpt", "sft", "rlhf"):
        job = yaml.safe_load(templates[f"{name}-create"]["resource"]["manifest"])
        for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
            containers[f"{name}/{role}"] = replica["template"]["spec"]["containers"][0]
    for name, container in containers.items():
        env = {e["name"]: e for e in container["env"]}
        for var, ref in wanted.items():
            assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": ref}}, (name, var)


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


# --------------------------------------------------------------------------- who holds a token

CONTAINER_STEPS = ("prepare", "evaluate", "deploy", "notify")
TRAINING_STEPS = tuple(f"{stage}-{step}" for stage in ("cpt", "sft", "rlhf") for step in ("create", "wait"))
RESOURCE_STEPS = TRAINING_STEPS
ROLLOUT_STEPS = ("serve",)
"""Container steps that hold the workflow account's token: the rollout applies the InferenceService."""
CLEANUP_STEPS = ("cleanup", "cpt-cleanup", "sft-cleanup", "rlhf-cleanup")
"""Container steps that call the Kubernetes API (workflows/cleanup.py): the job-creating account, with its token."""


def _templates(doc: dict) -> dict[str, dict]:
    return {t["name"]: t for t in doc["spec"]["templates"]}


def test_only_the_steps_that_create_jobs_hold_a_token() -> None:
    """Pods that run stage code run as the account without a Role and get no token (Argo mounts the executor
    account's token into its own init and wait containers only); the resource steps, which create the PyTorchJobs
    and apply the InferenceService, run as the workflow account with its token. The workflow's default is no token,
    so a template that names no account fails closed."""
    doc = _template(
        overrides=(
            "cluster.pod_service_account=runner-x",
            "cluster.executor_service_account=executor-x",
            "cluster.service_account=creator-x",
        )
    )
    assert doc["spec"]["serviceAccountName"] == "runner-x"
    assert doc["spec"]["automountServiceAccountToken"] is False
    assert "executor" not in doc["spec"]  # it would mount the executor token into the resource steps' main too
    templates = _templates(doc)
    for name in CONTAINER_STEPS:
        step = templates[name]
        assert step["serviceAccountName"] == "runner-x", name
        assert step["automountServiceAccountToken"] is False, name
        assert step["executor"] == {"serviceAccountName": "executor-x"}, name
    for name in RESOURCE_STEPS:
        step = templates[name]
        assert step["serviceAccountName"] == "creator-x", name
        assert step["automountServiceAccountToken"] is True, name
        assert "executor" not in step, name
    for name in (*CLEANUP_STEPS, *ROLLOUT_STEPS):
        step = templates[name]
        assert step["serviceAccountName"] == "creator-x", name
        assert step["automountServiceAccountToken"] is True, name
        assert "executor" not in step, name  # the one token serves Argo's containers and cleanup alike
    job = yaml.safe_load(templates["sft-create"]["resource"]["manifest"])
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["serviceAccountName"] == "runner-x" and pod["automountServiceAccountToken"] is False


def test_stage_containers_have_a_read_only_root_and_write_to_volumes() -> None:
    """/tmp is an emptyDir of the step (Argo's outputs under /tmp/outputs are then read from that volume by the
    wait container); the caches point into it; the root filesystem is read-only."""
    templates = _templates(_template())
    for name in CONTAINER_STEPS:
        step = templates[name]
        container = step["container"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"], name
        assert {"name": "tmp", "emptyDir": {}} in step["volumes"], name
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HOME"] == "/tmp", name
        for output in step.get("outputs", {}).get("parameters", []):
            assert output["valueFrom"]["path"].startswith("/tmp/outputs/"), (name, output)


def test_argos_init_and_wait_containers_are_held_to_restricted_settings() -> None:
    """Container steps patch Argo's own init and wait containers (template podSpecPatch), so their pods pass Pod
    Security `restricted` without controller settings; the patch also carries the grace period."""
    restricted = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}
    templates = _templates(_template(overrides=("stages.evaluate.run_policy.termination_grace_period_seconds=240",)))
    for name in (*CONTAINER_STEPS, *CLEANUP_STEPS, *ROLLOUT_STEPS):
        patch = json.loads(templates[name]["podSpecPatch"])
        assert patch["initContainers"] == [{"name": "init", "securityContext": restricted}], name
        assert patch["containers"] == [{"name": "wait", "securityContext": restricted}], name
    assert json.loads(templates["evaluate"]["podSpecPatch"])["terminationGracePeriodSeconds"] == 240
    assert json.loads(templates["prepare"]["podSpecPatch"])["terminationGracePeriodSeconds"] == 120
    for name in RESOURCE_STEPS:
        assert "podSpecPatch" not in templates[name], name  # their pods have other containers; Argo locks them down
    plain = _templates(_template(overrides=("cluster.executor_security_context=false",)))
    assert json.loads(plain["deploy"]["podSpecPatch"]) == {"terminationGracePeriodSeconds": 120}


# --------------------------------------------------------------------------- retries, timeouts, the deadline


class _Expr:
    """A small evaluator of the expr-lang subset the retry expression uses (the language Argo evaluates
    `retryStrategy.expression` in): `||`, `&&`, `!`, parentheses, `==`, `!=`, `in` over a list of strings,
    `contains`, string literals and dotted variables. Anything else is a syntax error, so the expression cannot
    drift outside what this model understands."""

    _TOKEN = re.compile(r'\s*(\|\||&&|==|!=|!|\(|\)|\[|\]|,|"[^"]*"|[A-Za-z_][A-Za-z0-9_.]*)')

    def __init__(self, source: str) -> None:
        self.tokens: list[str] = []
        pos = 0
        while pos < len(source.rstrip()):
            match = self._TOKEN.match(source, pos)
            if not match:
                raise SyntaxError(f"unexpected {source[pos:]!r}")
            self.tokens.append(match.group(1))
            pos = match.end()

    def evaluate(self, scope: dict[str, str]) -> bool:
        self.pos, self.scope = 0, scope
        value = self._or()
        if self.pos != len(self.tokens):
            raise SyntaxError(f"unexpected {self.tokens[self.pos]!r}")
        assert isinstance(value, bool)
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> str:
        token = self._peek()
        if token is None or (expected is not None and token != expected):
            raise SyntaxError(f"expected {expected!r}, got {token!r}")
        self.pos += 1
        return token

    def _or(self) -> object:
        value = self._and()
        while self._peek() == "||":
            self._take()
            right = self._and()
            value = bool(value) or bool(right)
        return value

    def _and(self) -> object:
        value = self._unary()
        while self._peek() == "&&":
            self._take()
            right = self._unary()
            value = bool(value) and bool(right)
        return value

    def _unary(self) -> object:
        if self._peek() == "!":
            self._take()
            return not self._unary()
        left = self._primary()
        operator = self._peek()
        if operator in ("==", "!=", "in", "contains"):
            self._take()
            right = self._primary()
            if operator == "==":
                return left == right
            if operator == "!=":
                return left != right
            if operator == "in":
                assert isinstance(right, list)
                return left in right
            assert isinstance(left, str) and isinstance(right, str)
            return right in left
        return left

    def _primary(self) -> object:
        token = self._take()
        if token == "(":
            value = self._or()
            self._take(")")
            return value
        if token == "[":
            items = []
            while self._peek() != "]":
                items.append(self._primary())
                if self._peek() == ",":
                    self._take()
            self._take("]")
            return items
        if token.startswith('"'):
            return token[1:-1]
        if token in self.scope:
            return self.scope[token]
        raise SyntaxError(f"unknown name {token!r}")


def _retried(expression: str, status: str, exit_code: str, message: str = "") -> bool:
    scope = {"lastRetry.status": status, "lastRetry.exitCode": exit_code, "lastRetry.message": message}
    return _Expr(expression).evaluate(scope)


@pytest.mark.parametrize(
    ("status", "exit_code", "message", "retried"),
    [
        ("Failed", "1", "main: Error (exit code 1)", False),  # the stage failed: its record says why
        ("Failed", "2", "main: Error (exit code 2)", False),  # bad input
        ("Failed", "75", "main: Error (exit code 75)", True),  # interrupted by SIGTERM, or its stage was held
        ("Failed", "143", "main: Error (exit code 143)", True),  # SIGTERM before it could record itself
        ("Failed", "137", "main: Error (exit code 137)", True),  # SIGKILL at the end of the grace period
        ("Failed", "137", "main: OOMKilled (exit code 137)", False),  # the same limits would kill it again
        ("Error", "-1", "pod deleted", True),  # preempted, evicted, node lost
        ("Error", "0", "wait: Error (exit code 1)", True),  # Argo's own container failed
    ],
)
def test_steps_retry_only_what_a_retry_can_fix(status: str, exit_code: str, message: str, retried: bool) -> None:
    for name in CONTAINER_STEPS:
        strategy = _templates(_template())[name]["retryStrategy"]
        assert strategy["retryPolicy"] == "Always"  # both phases reach the expression, which decides
        assert _retried(strategy["expression"], status, exit_code, message) is retried, name


def test_the_expression_model_is_strict() -> None:
    """Guard: the evaluator refuses what it does not model, instead of guessing."""
    assert _retried('lastRetry.exitCode in ["1", "2"] && !(lastRetry.status == "Error")', "Failed", "2")
    for unsupported in ("asInt(lastRetry.exitCode) > 1", 'lastRetry.status matches "E"', "retries < 2"):
        with pytest.raises(SyntaxError):
            _retried(unsupported, "Failed", "1")


def test_steps_have_a_timeout_and_retries_with_a_doubling_backoff() -> None:
    templates = _templates(
        _template(
            overrides=(
                "stages.evaluate.run_policy.active_deadline_seconds=7200",
                "stages.evaluate.run_policy.retries=4",
                "stages.evaluate.run_policy.retry_backoff=1m",
            )
        )
    )
    evaluate = templates["evaluate"]
    assert evaluate["activeDeadlineSeconds"] == 7200
    assert evaluate["retryStrategy"]["limit"] == "4"
    assert evaluate["retryStrategy"]["backoff"] == {"duration": "1m", "factor": "2", "cap": "1h"}
    for name in ("prepare", "deploy"):  # the defaults
        assert templates[name]["activeDeadlineSeconds"] == 24 * 3600, name
        assert templates[name]["retryStrategy"]["limit"] == "2", name
        assert templates[name]["retryStrategy"]["backoff"] == {"duration": "30s", "factor": "2", "cap": "1h"}, name
    assert templates["notify"]["activeDeadlineSeconds"] == 600
    serve = templates["serve"]
    # A wait for the new revision and one for a rollback (30 min each by default), and slack for the smoke checks.
    assert serve["activeDeadlineSeconds"] == 2 * 1800 + 600 and serve["retryStrategy"]["backoff"]["duration"] == "30s"
    assert "OOMKilled" in serve["retryStrategy"]["expression"]  # a failed smoke check (exit 1) is never retried


def test_the_workflow_deadline_is_the_steps_worst_case_unless_set() -> None:
    """(retries + 1) × timeout + the waits between retries, for every step the template holds, plus an hour."""
    overrides = (
        "stages.cpt.enabled=false",
        "stages.rlhf.enabled=false",
        "stages.deploy.serving.enabled=false",
        "notifications.slack=false",
        "retention.keep_last=null",  # its step's share: tests/test_runs.py
        "stages.prepare.run_policy.active_deadline_seconds=600",
        "stages.prepare.run_policy.retries=1",
        "stages.prepare.run_policy.retry_backoff=90s",
        "stages.sft.run_policy.active_deadline_seconds=3600",
        "stages.sft.run_policy.retries=2",
        "stages.sft.run_policy.retry_backoff=40m",
        "stages.evaluate.run_policy.active_deadline_seconds=1800",
        "stages.evaluate.run_policy.retries=0",
        "stages.deploy.run_policy.active_deadline_seconds=300",
        "stages.deploy.run_policy.retries=3",
        "stages.deploy.run_policy.retry_backoff=20",
    )
    prepare = 2 * 600 + 90
    cleanup = 4 * 300 + 10 + 20 + 40  # workflows/cleanup.py: 3 retries, backoff 10s
    wait = 3600 + 3600 + (30 + 60 + 120 + 240 + 480 + 960 + 1920 + 3 * 3600)  # the job's life, 10 retries' waits
    sft = 3 * (cleanup + 600 + wait) + 40 * 60 + 60 * 60  # the attempt's second wait (80m) is capped at 1h
    evaluate = 1800
    deploy = 4 * 300 + 20 + 40 + 80
    expected = 3600 + prepare + sft + evaluate + deploy + cleanup  # the exit handler cleans up too
    assert _template(overrides=overrides)["spec"]["activeDeadlineSeconds"] == expected
    explicit = _template(overrides=(*overrides, "workflow.active_deadline_seconds=7200"))
    assert explicit["spec"]["activeDeadlineSeconds"] == 7200


def test_the_default_deadline_covers_every_shipped_pipeline() -> None:
    for name in ("korean-llm", "qwen3-30b-a3b", "llama3-dolly"):
        spec = load_pipeline(name).spec
        deadline = _template(name)["spec"]["activeDeadlineSeconds"]
        longest_job = max(spec.stage(s).run_policy.active_deadline_seconds for s in spec.stages.enabled())
        assert deadline > longest_job, name


@pytest.mark.parametrize(
    ("value", "seconds"), [("120", 120), ("90s", 90), ("2m", 120), ("1h30m", 5400), ("1.5h", 5400)]
)
def test_backoffs_are_read_as_argo_reads_them(value: str, seconds: float) -> None:
    assert duration_seconds(value) == seconds


def test_langfuse_keys_reach_every_stage_pod_only_through_secret_refs() -> None:
    doc = _template(
        overrides=(
            "tracking.langfuse_host=https://langfuse.example.com",
            "cluster.secrets.langfuse_public_key={name: langfuse, key: public-key}",
            "cluster.secrets.langfuse_secret_key={name: langfuse, key: secret-key}",
        )
    )
    templates = {t["name"]: t for t in doc["spec"]["templates"]}
    pods = [templates[n]["container"] for n in ("prepare", "evaluate", "deploy")]
    for stage in ("cpt", "sft", "rlhf"):
        job = yaml.safe_load(templates[f"{stage}-create"]["resource"]["manifest"])
        pods += [r["template"]["spec"]["containers"][0] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    assert len(pods) == 7  # prepare, evaluate, deploy; cpt's master and worker; sft's and rlhf's masters
    for container in pods:
        env = {e["name"]: e for e in container["env"]}
        for var, key in (("LANGFUSE_PUBLIC_KEY", "public-key"), ("LANGFUSE_SECRET_KEY", "secret-key")):
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("langfuse", key) and "value" not in env[var]


def test_job_kind_trainjob_changes_only_the_training_job_templates() -> None:
    """cluster.job_kind trainjob swaps each training stage's created object and wait conditions, and tells cleanup
    the kind; every other template, and the attempt/retry structure, is the PyTorchJob pipeline's."""
    from workflows import trainjob

    default = load_pipeline("korean-llm").spec
    switched = default.model_copy(deep=True)
    switched.cluster.job_kind = "trainjob"

    def templates(spec) -> dict:
        doc = compile_pipeline(spec).documents()["workflowtemplate.yaml"]
        return {t["name"]: t for t in doc["spec"]["templates"]}

    before, after = templates(default), templates(switched)
    assert before.keys() == after.keys()
    changed = {name for name in before if before[name] != after[name]}
    stages = [s for s in ("cpt", "sft", "rlhf") if default.stage(s).enabled]
    cleanups = {"cleanup", *(f"{s}-cleanup" for s in stages)}
    expected = {*(f"{s}-create" for s in stages), *(f"{s}-wait" for s in stages), *cleanups}
    assert changed == expected | {"prepare"}  # prepare carries the resolved spec, job_kind included
    for stage in stages:
        created = yaml.safe_load(after[f"{stage}-create"]["resource"]["manifest"])
        assert (created["apiVersion"], created["kind"]) == (trainjob.API_VERSION, "TrainJob")
        assert created["metadata"]["generateName"] == f"{{{{workflow.name}}}}-{stage}-"  # a retry: a new TrainJob
        assert created["metadata"]["labels"]["workflows.argoproj.io/workflow"] == "{{workflow.name}}"
        wait = after[f"{stage}-wait"]["resource"]
        assert yaml.safe_load(wait["manifest"])["kind"] == "TrainJob"
        assert (wait["successCondition"], wait["failureCondition"]) == (
            trainjob.SUCCESS_CONDITION,
            trainjob.FAILURE_CONDITION,
        )
    for name in cleanups:
        assert after[name]["container"]["command"] == [*before[name]["container"]["command"], "--kind", "trainjob"]


def test_the_longest_durations_the_spec_allows_render_as_go_durations() -> None:
    """Argo reads deadlines and timeouts into Go durations (int64 nanoseconds): the worst cases the compiler adds
    up from the longest deadlines and the most retries stay below that."""
    longest = [
        f"stages.{stage}.run_policy.{field}={value}"
        for stage in ("prepare", "cpt", "sft", "rlhf", "evaluate", "deploy")
        for field, value in (("active_deadline_seconds", MAX_DURATION_SECONDS), ("retries", 20))
    ]
    longest.append(f"stages.deploy.serving.smoke_check.ready_timeout_seconds={MAX_DURATION_SECONDS}")
    doc = _template(overrides=tuple(longest))
    go_duration_seconds = (2**63 - 1) // 10**9
    assert 0 < doc["spec"]["activeDeadlineSeconds"] <= go_duration_seconds
    for template in doc["spec"]["templates"]:
        assert int(template.get("activeDeadlineSeconds", 0)) <= go_duration_seconds
        assert int(str(template.get("timeout", "0s")).removesuffix("s")) <= go_duration_seconds


def test_every_job_kind_of_the_spec_is_a_job_kind_module() -> None:
    """Each value cluster.job_kind accepts selects a module with what the compiler, cleanup and preflight use of it
    (workflows/job_kinds.py), and workflows.cleanup accepts it as --kind."""
    import typing

    from spec.cluster import ClusterSpec
    from workflows import job_kinds
    from workflows.cleanup import JOB_RESOURCES

    accepted = set(typing.get_args(ClusterSpec.model_fields["job_kind"].annotation))
    assert accepted == set(job_kinds.KINDS) == set(JOB_RESOURCES)
    assert ClusterSpec.model_fields["job_kind"].default == job_kinds.DEFAULT_JOB_KIND
    for name, kind in job_kinds.KINDS.items():
        for attribute in ("API_VERSION", "KIND", "PLURAL", "SUCCESS_CONDITION", "FAILURE_CONDITION"):
            assert isinstance(getattr(kind, attribute), str), (name, attribute)
        manifest = kind.job_manifest(load_pipeline("korean-llm").spec, "sft")
        assert (manifest["apiVersion"], manifest["kind"]) == (kind.API_VERSION, kind.KIND), name
