"""The Katib Experiment a stage's hyperparameter search renders, and the workflow steps around it.

Specs are the shipped pipelines with an `hpo:` section added (none ships one), so every Experiment has the shape of
a real stage's: its nodes, GPUs, volumes, env and labels.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from conftest import fresh_spec
from fake_kube import running
from schema_validation import SchemaViolation, validate_argo, validate_custom_resource, validate_pytorchjob

from run.names import katib_parameter_name
from spec.fields import TRAINING_STAGES
from spec.pipeline import MAX_PIPELINE_NAME_LENGTH, PipelineSpec
from spec.search import HPO_ALGORITHMS
from spec.stage import MAX_NODES
from workflows import katib, preflight
from workflows.cleanup import delete_running_experiments, main
from workflows.compile import compile_pipeline
from workflows.deadline import workflow_deadline
from workflows.search_steps import hpo_attempt_seconds
from workflows.step_templates import DEADLINE_BACKSTOP_SECONDS
from workflows.training_steps import CREATE_TIMEOUT_SECONDS, WAIT_RETRY_EXPRESSION

SEARCH: dict[str, Any] = {
    "objective": {"metric": "eval_loss"},
    "parameters": [
        {"path": "training.learning_rate", "type": "log_uniform", "min": 1.0e-5, "max": 1.0e-3},
        {"path": "lora.r", "type": "categorical", "values": [8, 16, 32]},
        {"path": "training.warmup_ratio", "type": "uniform", "min": 0.0, "max": 0.1, "step": 0.01},
        {"path": "training.gradient_accumulation_steps", "type": "int", "min": 1, "max": 8},
    ],
    "max_trials": 10,
    "parallel_trials": 3,
    "max_failed_trials": 2,
    "seed": 7,
}
KATIB_NAME = re.compile(r"^[a-z0-9-]+$")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def with_hpo(spec: PipelineSpec, stage: str, **changes: Any) -> PipelineSpec:
    """`spec` with a search on `stage` (SEARCH, updated with `changes`), validated as a pipeline file would be."""
    document = spec.model_dump(mode="json", by_alias=True)
    document["stages"][stage]["hpo"] = {**SEARCH, **changes}
    return PipelineSpec.model_validate(document)


@pytest.fixture
def sft_search() -> PipelineSpec:
    return with_hpo(fresh_spec("korean-llm"), "sft")


def _container(job: dict[str, Any], replica: str = "Master") -> dict[str, Any]:
    (container,) = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"]
    return container


def _substitute(experiment: dict[str, Any], values: dict[str, str], trial: str) -> dict[str, Any]:
    """The trial job Katib creates: its webhook's checks on the template, then the placeholders replaced in the
    template's JSON text (manifest/generator.go `applyParameters`), name and namespace set."""
    template = experiment["spec"]["trialTemplate"]
    text = json.dumps(template["trialSpec"])
    searched = {p["name"] for p in experiment["spec"]["parameters"]}
    for parameter in template["trialParameters"]:
        assert "{" not in parameter["name"] and "}" not in parameter["name"]
        placeholder = f"${{trialParameters.{parameter['name']}}}"
        assert placeholder in text, f"{parameter['name']} is not used in the trial template"
        reference = parameter["reference"]
        value = trial if reference == "${trialSpec.Name}" else values[reference]
        assert reference == "${trialSpec.Name}" or reference in searched
        text = text.replace(placeholder, value)
    assert not re.findall(r"\$\{trialParameters\..+?\}", text), "a placeholder without a trial parameter"
    job = json.loads(text)
    assert "name" not in job["metadata"] and "namespace" not in job["metadata"]  # Katib refuses them
    job["metadata"].update(name=trial, namespace=experiment["metadata"]["namespace"])
    return job


# --------------------------------------------------------------------------- names


def test_katib_parameter_names_are_paths_without_dots_or_underscores() -> None:
    assert katib_parameter_name("training.learning_rate") == "training-learning-rate"
    assert katib_parameter_name("lora.r") == "lora-r"
    assert katib_parameter_name("beta") == "beta"


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_names_fit_for_the_longest_pipeline_name(stage: str) -> None:
    """The Experiment (Katib: at most 40), its Suggestion's Service `<experiment>-<algorithm>`, and each trial's
    PyTorchJob Services `<experiment>-<8>-worker-<N>` (a DNS label) fit for the longest pipeline name, the most
    nodes and the longest algorithm name."""
    spec = fresh_spec("korean-llm")
    document = spec.model_dump(mode="json", by_alias=True)
    document["name"] = "p" * MAX_PIPELINE_NAME_LENGTH
    spec = PipelineSpec.model_validate(document)
    spec.stage(stage).resources.nodes = MAX_NODES
    experiment = katib.experiment_generate_name(spec, stage) + "x" * katib.GENERATED_SUFFIX_LENGTH
    assert len(experiment) <= katib.MAX_EXPERIMENT_NAME_LENGTH and DNS_LABEL.match(experiment)
    longest_algorithm = max(HPO_ALGORITHMS, key=len)
    assert len(f"{experiment}-{longest_algorithm}") <= 63
    service = katib.longest_trial_service_name(spec, stage)
    assert service == f"{experiment}-xxxxxxxx-worker-{MAX_NODES - 2}"
    assert len(service) <= 63 and DNS_LABEL.match(service), service


def test_the_workflow_name_would_not_fit_as_the_experiment_name() -> None:
    """Why Experiments are named after the pipeline: a scheduled, resubmitted run's name alone is over Katib's 40."""
    workflow = f"{'p' * MAX_PIPELINE_NAME_LENGTH}-{'9' * 10}-xxxxx"
    assert len(workflow) > katib.MAX_EXPERIMENT_NAME_LENGTH


# --------------------------------------------------------------------------- the Experiment


def test_experiment_validates_strictly_and_its_trial_spec_is_a_pytorchjob(
    sft_search: PipelineSpec, schemas_dir: Any
) -> None:
    experiment = katib.experiment_manifest(sft_search, "sft")
    validate_custom_resource(experiment)
    validate_pytorchjob(experiment["spec"]["trialTemplate"]["trialSpec"])
    misplaced = json.loads(json.dumps(experiment))
    misplaced["spec"]["trialTemplate"]["primaryPodLabel"] = {"a": "b"}
    with pytest.raises(SchemaViolation, match="primaryPodLabel"):
        validate_custom_resource(misplaced)
    misplaced = json.loads(json.dumps(experiment))
    misplaced["spec"]["parameters"][0]["feasibleSpace"]["distrib"] = "logUniform"
    with pytest.raises(SchemaViolation, match="distrib"):
        validate_custom_resource(misplaced)


@pytest.mark.parametrize(
    ("pipeline", "stage"),
    [("korean-llm", "cpt"), ("korean-llm", "sft"), ("korean-llm", "rlhf"), ("qwen3-30b-a3b", "sft")],
)
def test_every_training_stage_renders_a_valid_experiment(pipeline: str, stage: str, schemas_dir: Any) -> None:
    changes: dict[str, Any] = {}
    if stage == "rlhf":
        changes["parameters"] = [{"path": "beta", "type": "log_uniform", "min": 0.01, "max": 0.5}]
        changes["objective"] = {"metric": "eval_rewards_accuracy", "goal": "maximize", "target": 0.9}
    spec = with_hpo(fresh_spec(pipeline), stage, **changes)
    experiment = katib.experiment_manifest(spec, stage)
    validate_custom_resource(experiment)
    trial = _substitute(experiment, {"beta": "0.1", **_values()}, "x-12345678")
    validate_pytorchjob(trial)
    assert trial["spec"] == _with_command(
        katib.trial_spec(spec, stage)["spec"], _container(trial)["command"]
    )  # the stage's job, only the command differs
    assert _container(trial)["command"][:4] == ["torchrun", "--module", "stages", stage]


def _values() -> dict[str, str]:
    return {
        "training-learning-rate": "0.00031",
        "lora-r": "16",
        "training-warmup-ratio": "0.05",
        "training-gradient-accumulation-steps": "4",
    }


def _with_command(job_spec: dict[str, Any], command: list[str]) -> dict[str, Any]:
    job_spec = json.loads(json.dumps(job_spec))
    for replica in job_spec["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        container["command"] = command
    return job_spec


def test_trial_command_is_the_stage_entry_point_with_trial_arguments(sft_search: PipelineSpec) -> None:
    """hpo_shared.md §2: `--trial <name>` and one `--trial-set path=value` per parameter, each one argv element
    (no shell), the run directory the stage's own; Master and Workers run the same command."""
    experiment = katib.experiment_manifest(sft_search, "sft")
    job = _substitute(experiment, _values(), "korean-llm-sft-k2x9q-a1b2c3d4")
    run = f"{sft_search.cluster.checkpoints.mount_path}/runs/{{{{workflow.name}}}}"
    assert _container(job)["command"] == [
        "torchrun", "--module", "stages", "sft", "--run-dir", run,
        "--trial", "korean-llm-sft-k2x9q-a1b2c3d4",
        "--trial-set", "training.learning_rate=0.00031",
        "--trial-set", "lora.r=16",
        "--trial-set", "training.warmup_ratio=0.05",
        "--trial-set", "training.gradient_accumulation_steps=4",
    ]  # fmt: skip
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["command"] == _container(job)["command"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[katib.METRICS_FILE_ENV] == katib.METRICS_FILE
        assert container["name"] == experiment["spec"]["trialTemplate"]["primaryContainerName"]


def test_search_space_in_katib_types(sft_search: PipelineSpec) -> None:
    parameters = {p["name"]: p for p in katib.experiment_manifest(sft_search, "sft")["spec"]["parameters"]}
    assert parameters == {
        "training-learning-rate": {
            "name": "training-learning-rate",
            "parameterType": "double",
            "feasibleSpace": {"min": "1e-05", "max": "0.001", "distribution": "logUniform"},
        },
        "lora-r": {"name": "lora-r", "parameterType": "categorical", "feasibleSpace": {"list": ["8", "16", "32"]}},
        "training-warmup-ratio": {
            "name": "training-warmup-ratio",
            "parameterType": "double",
            "feasibleSpace": {"min": "0", "max": "0.1", "step": "0.01", "distribution": "uniform"},
        },
        "training-gradient-accumulation-steps": {
            "name": "training-gradient-accumulation-steps",
            "parameterType": "int",
            "feasibleSpace": {"min": "1", "max": "8"},
        },
    }
    for name in parameters:
        assert KATIB_NAME.match(name)
    for value in ("1e-05", "0.001", "0.1", "0.01"):
        assert float(value) > 0  # Katib's suggestion services parse the bounds as numbers


def test_objective_algorithm_and_budget(sft_search: PipelineSpec) -> None:
    spec = katib.experiment_manifest(sft_search, "sft")["spec"]
    assert spec["objective"] == {
        "type": "minimize",
        "objectiveMetricName": "eval_loss",
        "additionalMetricNames": ["perplexity", "train_loss_first", "train_loss_last"],
    }
    assert spec["algorithm"] == {"algorithmName": "tpe", "algorithmSettings": [{"name": "random_state", "value": "7"}]}
    assert (spec["parallelTrialCount"], spec["maxTrialCount"], spec["maxFailedTrialCount"]) == (3, 10, 2)
    assert spec["resumePolicy"] == "Never"
    assert spec["metricsCollectorSpec"] == {
        "collector": {"kind": "File"},
        "source": {"fileSystemPath": {"path": "/var/log/katib/metrics.log", "kind": "File", "format": "TEXT"}},
    }
    template = spec["trialTemplate"]
    assert template["primaryPodLabels"] == {"training.kubeflow.org/job-role": "master"}
    assert template["retain"] is False
    assert "Succeeded" in template["successCondition"] and "Failed" in template["failureCondition"]


def test_goal_target_and_held_out_metrics() -> None:
    spec = with_hpo(fresh_spec("korean-llm"), "sft", objective={"metric": "eval_loss", "target": 1.2})
    assert katib.experiment_manifest(spec, "sft")["spec"]["objective"]["goal"] == 1.2
    document = fresh_spec("korean-llm").model_dump(mode="json", by_alias=True)
    document["stages"]["sft"]["data"]["eval_fraction"] = 0
    document["stages"]["sft"]["training"]["eval_steps"] = None
    spec = with_hpo(PipelineSpec.model_validate(document), "sft", objective={"metric": "train_loss_last"})
    objective = katib.experiment_manifest(spec, "sft")["spec"]["objective"]
    assert objective["additionalMetricNames"] == ["train_loss_first"]  # no held-out rows: no eval_* metric
    assert "goal" not in objective


@pytest.mark.parametrize(("algorithm", "seeded"), [("random", True), ("bayesianoptimization", True), ("grid", False)])
def test_random_state_only_where_the_algorithm_takes_it(algorithm: str, seeded: bool) -> None:
    grid = [{"path": "lora.r", "type": "categorical", "values": [8, 16]}]
    spec = with_hpo(
        fresh_spec("korean-llm"), "sft", algorithm=algorithm, parameters=grid, max_trials=2, parallel_trials=1
    )
    settings = katib.experiment_manifest(spec, "sft")["spec"]["algorithm"].get("algorithmSettings")
    assert settings == ([{"name": "random_state", "value": "7"}] if seeded else None)
    spec = with_hpo(
        fresh_spec("korean-llm"),
        "sft",
        algorithm=algorithm,
        parameters=grid,
        max_trials=2,
        parallel_trials=1,
        seed=None,
    )
    assert "algorithmSettings" not in katib.experiment_manifest(spec, "sft")["spec"]["algorithm"]


def test_labels_find_the_search_and_its_trials(sft_search: PipelineSpec) -> None:
    experiment = katib.experiment_manifest(sft_search, "sft")
    labels = experiment["metadata"]["labels"]
    assert labels["workflows.argoproj.io/workflow"] == "{{workflow.name}}"
    assert (labels["posttrain.dev/pipeline"], labels["posttrain.dev/stage"]) == ("korean-llm", "sft")
    assert experiment["metadata"]["generateName"] == "korean-llm-sft-"
    assert experiment["metadata"]["namespace"] == sft_search.cluster.namespace
    assert experiment["spec"]["trialTemplate"]["trialSpec"]["metadata"] == {"labels": labels}


def test_a_stage_without_hpo_has_no_experiment() -> None:
    with pytest.raises(ValueError, match="no hpo"):
        katib.experiment_manifest(fresh_spec("korean-llm"), "sft")


# --------------------------------------------------------------------------- the compiled steps


def _templates(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    document = compile_pipeline(spec).documents()["workflowtemplate.yaml"]
    return {t["name"]: t for t in document["spec"]["templates"]}


def test_search_runs_before_its_stage_with_the_same_switch(sft_search: PipelineSpec) -> None:
    tasks = {t["name"]: t for t in _templates(sft_search)["pipeline"]["dag"]["tasks"]}
    assert tasks["sft-hpo"]["depends"] == "cpt"
    assert tasks["sft"]["depends"] == "sft-hpo"
    assert tasks["sft-hpo"]["when"] == tasks["sft"]["when"]
    assert "cpt-hpo" not in tasks and "rlhf-hpo" not in tasks


def test_search_steps_create_wait_select(sft_search: PipelineSpec, schemas_dir: Any) -> None:
    templates = _templates(sft_search)
    validate_argo(compile_pipeline(sft_search).documents()["workflowtemplate.yaml"])
    steps = [[s["name"], s["template"]] for (s,) in templates["sft-hpo"]["steps"]]
    assert steps == [["create", "sft-hpo-create"], ["wait", "sft-hpo-wait"], ["select", "sft-hpo-select"]]
    create = templates["sft-hpo-create"]
    assert create["resource"]["action"] == "create" and create["resource"]["setOwnerReference"] is True
    assert yaml.safe_load(create["resource"]["manifest"]) == katib.experiment_manifest(sft_search, "sft")
    assert create["serviceAccountName"] == sft_search.cluster.service_account
    wait = templates["sft-hpo-wait"]
    assert wait["resource"]["successCondition"] == katib.SUCCESS_CONDITION
    assert wait["resource"]["failureCondition"] == katib.FAILURE_CONDITION
    assert yaml.safe_load(wait["resource"]["manifest"])["metadata"] == {
        "name": "{{inputs.parameters.experiment-name}}",
        "namespace": sft_search.cluster.namespace,
    }
    assert wait["outputs"]["parameters"] == [
        {"name": "optimal-trial", "valueFrom": {"jsonPath": "{.status.currentOptimalTrial}"}}
    ]
    # A lost wait pod watches on; Katib's failure verdict or a deleted Experiment ("not found") ends the search.
    assert wait["retryStrategy"]["expression"] == WAIT_RETRY_EXPRESSION
    assert '!(lastRetry.message contains "not found")' in WAIT_RETRY_EXPRESSION
    select = templates["sft-hpo-select"]
    run = f"{sft_search.cluster.checkpoints.mount_path}/runs/{{{{workflow.name}}}}"
    assert select["container"]["command"] == [
        "python", "-m", "stages", "hpo-select", "--run-dir", run, "--stage", "sft",
        "--optimal-trial", "/params/optimal-trial.json",
    ]  # fmt: skip
    (artifact,) = select["inputs"]["artifacts"]
    assert artifact == {
        "name": "optimal-trial-file",
        "path": "/params/optimal-trial.json",
        "raw": {"data": "{{inputs.parameters.optimal-trial}}"},
    }
    assert select["automountServiceAccountToken"] is False
    assert "nvidia.com/gpu" not in json.dumps(select["container"]["resources"])
    assert select["container"]["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_optimal_trial_reaches_the_select_step_as_katib_wrote_it(sft_search: PipelineSpec) -> None:
    """The wait's output is the JSON of status.currentOptimalTrial (hpo_shared.md §3)."""
    from katib_status import scenario

    status = scenario("max-trials-reached").doc["status"]
    optimal = status["currentOptimalTrial"]
    assert set(optimal) == {"bestTrialName", "parameterAssignments", "observation"}
    assert optimal["bestTrialName"] in status["succeededTrialList"]
    assert {m["name"] for m in optimal["observation"]["metrics"]} == {"eval_loss"}


def test_exit_handler_deletes_unfinished_searches_only_when_there_is_one(sft_search: PipelineSpec) -> None:
    assert "--experiments" in _templates(sft_search)["cleanup"]["container"]["command"]
    assert "--experiments" not in _templates(sft_search)["sft-cleanup"]["container"]["command"]
    plain = _templates(fresh_spec("korean-llm"))
    assert "--experiments" not in plain["cleanup"]["container"]["command"]
    assert not [name for name in plain if "hpo" in name]


def test_deadline_holds_the_search(sft_search: PipelineSpec) -> None:
    plain = fresh_spec("korean-llm")
    stage = sft_search.stage("sft")
    added = workflow_deadline(sft_search) - workflow_deadline(plain)
    assert abs(added - hpo_attempt_seconds(stage)) <= 1
    rounds = -(-SEARCH["max_trials"] // SEARCH["parallel_trials"])
    assert hpo_attempt_seconds(stage) > CREATE_TIMEOUT_SECONDS + rounds * stage.run_policy.active_deadline_seconds
    wait = _templates(sft_search)["sft-hpo-wait"]
    assert wait["timeout"] == f"{rounds * stage.run_policy.active_deadline_seconds + DEADLINE_BACKSTOP_SECONDS}s"


def test_preflight_checks_the_katib_crd_only_with_a_search(sft_search: PipelineSpec) -> None:
    assert "experiments.kubeflow.org" in preflight._needed_crds(sft_search)
    assert "experiments.kubeflow.org" not in preflight._needed_crds(fresh_spec("korean-llm"))
    version, install = preflight.CRDS["experiments.kubeflow.org"]
    assert version == "v1beta1" and "trial resources" in install


# --------------------------------------------------------------------------- cleanup

NS, WORKFLOW = "llm-training", "korean-llm-x7k2p"


def _experiment(name: str, workflow: str, verdict: str | None) -> dict[str, Any]:
    from katib_status import KatibSim

    sim = KatibSim(name=name).run("reconcile", "reconcile", "trial-running")
    if verdict == "Succeeded":
        sim.run(*["trial-succeeded", "trial-running"] * 4)
    elif verdict == "Failed":
        sim.run("trial-failed")
    document = sim.document()
    document["metadata"]["namespace"] = NS
    document["metadata"]["labels"] = {"workflows.argoproj.io/workflow": workflow, "posttrain.dev/stage": "sft"}
    assert sim.verdict() == (verdict.lower() if verdict else "running")
    return document


def test_cleanup_deletes_the_runs_unfinished_experiments(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running() as fake:
        for name, workflow, verdict in [
            ("korean-llm-sft-aaaaa", WORKFLOW, None),
            ("korean-llm-sft-bbbbb", WORKFLOW, "Succeeded"),
            ("korean-llm-sft-ccccc", WORKFLOW, "Failed"),
            ("korean-llm-sft-ddddd", "korean-llm-zz999", None),
        ]:
            fake.put("kubeflow.org", "v1beta1", "experiments", _experiment(name, workflow, verdict))
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS, "--workflow", WORKFLOW, "--experiments"]) == 0
        left = set(fake.custom("kubeflow.org", "experiments"))
        deletes = [r for r in fake.requests if r.method == "DELETE"]
        listing = fake.requests[0]
    assert left == {(NS, "korean-llm-sft-bbbbb"), (NS, "korean-llm-sft-ccccc"), (NS, "korean-llm-sft-ddddd")}
    assert listing.path == f"/apis/kubeflow.org/v1beta1/namespaces/{NS}/experiments"
    assert listing.query["labelSelector"] == f"workflows.argoproj.io/workflow={WORKFLOW}"
    assert [r.body["propagationPolicy"] for r in deletes] == ["Background"]
    assert f"deleted Experiment {NS}/korean-llm-sft-aaaaa (workflow {WORKFLOW})" in capsys.readouterr().out


def test_cleanup_refused_on_experiments_is_one_error_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running(forbidden={("list", "experiments")}) as fake:
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS, "--workflow", WORKFLOW, "--experiments"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: could not delete the Katib Experiments of workflow {WORKFLOW}") and "403" in line


def test_delete_running_experiments_returns_what_it_deleted() -> None:
    with running() as fake:
        fake.put("kubeflow.org", "v1beta1", "experiments", _experiment("korean-llm-sft-aaaaa", WORKFLOW, None))
        assert delete_running_experiments(NS, WORKFLOW, api_client=fake.api_client()) == ["korean-llm-sft-aaaaa"]
        assert delete_running_experiments(NS, WORKFLOW, api_client=fake.api_client()) == []


def test_max_failed_trials_never_exceeds_max_trials() -> None:
    """Katib's webhook refuses maxFailedTrialCount > maxTrialCount; the default (3) with 2 trials must still pass."""
    spec = with_hpo(fresh_spec("korean-llm"), "sft", max_trials=2, parallel_trials=1, max_failed_trials=3)
    experiment = katib.experiment_manifest(spec, "sft")["spec"]
    assert (experiment["maxTrialCount"], experiment["maxFailedTrialCount"]) == (2, 2)


def test_bayesian_optimization_refuses_a_uniform_parameter() -> None:
    """Katib's skopt service samples every double log-uniformly (a uniform range from 0 would crash it)."""
    with pytest.raises(ValueError, match="log-uniformly"):
        with_hpo(fresh_spec("korean-llm"), "sft", algorithm="bayesianoptimization")
    log_only = [p for p in SEARCH["parameters"] if p["type"] != "uniform"]
    spec = with_hpo(fresh_spec("korean-llm"), "sft", algorithm="bayesianoptimization", parameters=log_only)
    assert katib.experiment_manifest(spec, "sft")["spec"]["algorithm"]["algorithmName"] == "bayesianoptimization"


def test_a_search_without_a_seed_is_seeded_so_a_rerun_tries_the_same_values() -> None:
    search = {k: v for k, v in SEARCH.items() if k != "seed"}
    document = fresh_spec("korean-llm").model_dump(mode="json", by_alias=True)
    document["stages"]["sft"]["hpo"] = search
    spec = PipelineSpec.model_validate(document)
    settings = katib.experiment_manifest(spec, "sft")["spec"]["algorithm"]["algorithmSettings"]
    assert settings == [{"name": "random_state", "value": "0"}]
    import optuna

    from workflows.search import sampler

    def proposals() -> list[float]:
        study = optuna.create_study(sampler=sampler(spec.stages.sft.hpo))  # type: ignore[union-attr]
        return [study.ask().suggest_float("learning_rate", 1e-5, 1e-3, log=True) for _ in range(3)]

    assert proposals() == proposals()
