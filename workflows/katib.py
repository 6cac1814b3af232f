"""The Katib Experiment (kubeflow.org/v1beta1) that searches a training stage's hyperparameters in the cluster.

A stage with `hpo:` runs its search before it trains: an Experiment whose trials are PyTorchJobs of the stage's own
shape, each running the stage's entry point in trial mode (`--trial NAME --trial-set path=value ...`, a short run
into `<run>/hpo/<stage>/trials/<trial>/`), reporting its metrics to Katib's File metrics collector.

How Katib (v0.18–v0.19) writes the Experiment's `status.conditions`, which the Argo conditions below rely on
(pkg/apis/controller/experiments/v1beta1/util.go `setCondition`, pkg/controller.v1beta1/experiment):
- `setCondition` removes a condition of the same type and appends the new one at the end (nothing when its status
  and reason are unchanged). `Created` comes first, then `Running` True once trials exist.
- The verdict (util/status_util.go `UpdateExperimentStatusCondition`, in this order): goal reached → Succeeded;
  failed plus metrics-unavailable trials reaching maxFailedTrialCount → Failed; completed trials reaching
  maxTrialCount → Succeeded; the algorithm out of suggestions with no trial active → Succeeded. Each first sets
  `Running` False (moved to the end) and appends Succeeded or Failed, and sets `status.completionTime`, which is
  `null` until then. So Failed sits at index 1 or 2 (3 after a restart), never at a fixed one.
- A restart (only of an Experiment that succeeded by max trials with resumePolicy LongRunning or FromVolume, whose
  maxTrialCount was raised) removes Succeeded, appends `Restarting` True, which then stays, and `Running` follows.
  The compiler renders resumePolicy Never, so Katib's webhook refuses any restart; were one forced, the Experiment
  would carry the old completionTime while running again, so a Restarting condition fails the wait instead of
  letting a moving search pass for a finished one.

Argo parses each condition as a label selector over gjson paths (workflows/pytorchjob.py's docstring): failure
requirements are OR-ed and checked first, success requirements AND-ed, no array queries.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from run.names import katib_parameter_name
from spec.data import datasets
from spec.pipeline import PipelineSpec
from spec.search import SearchParameter, recorded_metrics
from spec.training import TrainingStage
from workflows.pytorchjob import CONTAINER_NAME, job_manifest, job_metadata, run_dir

API_VERSION = "kubeflow.org/v1beta1"
KIND = "Experiment"
PLURAL = "experiments"

MAX_EXPERIMENT_NAME_LENGTH = 40
"""Katib's webhook refuses a longer Experiment name (its Suggestion's Service is `<experiment>-<algorithm>`)."""
GENERATED_SUFFIX_LENGTH = 5
"""The random characters the API server appends to a generateName."""
TRIAL_SUFFIX = "-xxxxxxxx"
"""Katib names a trial `<experiment>-<8 random>`, and the trial's PyTorchJob after it."""

METRICS_FILE = "/var/log/katib/metrics.log"
"""Where a trial's rank 0 appends `<metric>=<value>` lines (Katib's File collector, TEXT format)."""
METRICS_FILE_ENV = "POSTTRAIN_KATIB_METRICS_FILE"
TRIAL_NAME_PARAMETER = "trialName"
"""The trial parameter that carries the trial's name (camelCase: no search parameter's Katib name can be it)."""
PRIMARY_POD_LABELS = {"training.kubeflow.org/job-role": "master"}
"""The pod Katib injects its metrics collector into: the Master, whose rank 0 writes the metrics."""

# Katib evaluates these itself, with gjson (array queries allowed): the trial job's operator verdict.
TRIAL_SUCCESS_CONDITION = 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
TRIAL_FAILURE_CONDITION = 'status.conditions.#(type=="Failed")#|#(status=="True")#'

ALGORITHMS_WITH_RANDOM_STATE = ("random", "tpe", "bayesianoptimization")
"""Katib's suggestion services that take a `random_state` setting (hyperopt, skopt; grid walks a fixed order)."""

# Created is always at index 0; Failed follows Running (False) or Created, and a Restarting after a restart.
_MAX_CONDITIONS = 4
SUCCESS_CONDITION = "status.completionTime,status.completionTime!="
"""Katib has given its verdict: completionTime is `null` until then (Failed is caught first)."""
FAILURE_CONDITION = ",".join(
    [f"status.conditions.{i}.type == Failed" for i in range(1, _MAX_CONDITIONS)]
    + [f"status.conditions.{i}.type == Restarting" for i in range(1, _MAX_CONDITIONS - 1)]
)


def experiment_generate_name(spec: PipelineSpec, stage_name: str) -> str:
    """`<pipeline>-<stage>-`: with the API server's five characters it fits Katib's 40 for the longest pipeline
    name, and its trials' Services `<experiment>-<8>-worker-<N>` fit a DNS label (the workflow's name, the jobs'
    prefix, is up to 17 characters longer than the pipeline's and would not)."""
    return f"{spec.name}-{stage_name}-"


def _number(value: float) -> str:
    """A bound as Katib reads it (a string), without a float's trailing '.0' for whole numbers."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _choice(value: int | float | str | bool) -> str:
    """A categorical choice as the text the trial's --trial-set parses (true/false as YAML writes them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def katib_parameter(parameter: SearchParameter) -> dict[str, Any]:
    """One entry of spec.parameters: double (uniform, log_uniform), int, or categorical."""
    name = katib_parameter_name(parameter.path)
    if parameter.type == "categorical":
        values = [_choice(v) for v in parameter.values or []]
        return {"name": name, "parameterType": "categorical", "feasibleSpace": {"list": values}}
    space: dict[str, Any] = {"min": _number(parameter.min), "max": _number(parameter.max)}  # type: ignore[arg-type]
    if parameter.step is not None:
        space["step"] = _number(parameter.step)
    if parameter.type == "int":
        return {"name": name, "parameterType": "int", "feasibleSpace": space}
    space["distribution"] = "logUniform" if parameter.type == "log_uniform" else "uniform"
    return {"name": name, "parameterType": "double", "feasibleSpace": space}


def additional_metrics(spec: PipelineSpec, stage_name: str) -> list[str]:
    """The metrics besides the objective a trial records: held-out ones only when the stage holds rows out."""
    stage: TrainingStage = spec.stage(stage_name)  # type: ignore[assignment]
    assert stage.hpo is not None
    held_out = any(d.eval_fraction > 0 for d in datasets(stage.data))
    metrics = recorded_metrics(stage_name, getattr(stage, "algorithm", None))
    return [
        m
        for m in metrics
        if m != stage.hpo.objective.metric and (held_out or not (m.startswith("eval_") or m == "perplexity"))
    ]


def trial_command(spec: PipelineSpec, stage_name: str, run_name: str = "{{workflow.name}}") -> list[str]:
    """The trial's argv: the stage's torchrun command plus `--trial` and one `--trial-set path=value` per search
    parameter, each value a placeholder Katib fills in (plain text in one argv element: no shell)."""
    stage: TrainingStage = spec.stage(stage_name)  # type: ignore[assignment]
    assert stage.hpo is not None
    command = ["torchrun", "--module", "stages", stage_name, "--run-dir", run_dir(spec, run_name)]
    command += ["--trial", f"${{trialParameters.{TRIAL_NAME_PARAMETER}}}"]
    for parameter in stage.hpo.parameters:
        command += ["--trial-set", f"{parameter.path}=${{trialParameters.{katib_parameter_name(parameter.path)}}}"]
    return command


def trial_spec(spec: PipelineSpec, stage_name: str, run_name: str = "{{workflow.name}}") -> dict[str, Any]:
    """The stage's PyTorchJob as a trial template: no name or namespace (Katib sets both), the trial command, and
    the metrics file's path in every replica's environment (rank 0 writes it)."""
    job = copy.deepcopy(job_manifest(spec, stage_name, run_name))
    job["metadata"] = {"labels": job["metadata"]["labels"]}
    command = trial_command(spec, stage_name, run_name)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        container["command"] = list(command)
        container["env"] = [*container["env"], {"name": METRICS_FILE_ENV, "value": METRICS_FILE}]
    return job


def experiment_manifest(spec: PipelineSpec, stage_name: str, run_name: str = "{{workflow.name}}") -> dict[str, Any]:
    """The Katib Experiment that searches `stage_name`'s hyperparameters for one run."""
    stage: TrainingStage = spec.stage(stage_name)  # type: ignore[assignment]
    hpo = stage.hpo
    if hpo is None:
        raise ValueError(f"stage {stage_name} has no hpo section")
    metadata = job_metadata(spec, stage_name, run_name)
    metadata["generateName"] = experiment_generate_name(spec, stage_name)
    metadata["labels"].pop("kueue.x-k8s.io/queue-name", None)  # Kueue admits the trials' jobs, not the search
    objective: dict[str, Any] = {
        "type": hpo.objective.goal,
        "objectiveMetricName": hpo.objective.metric,
        "additionalMetricNames": additional_metrics(spec, stage_name),
    }
    if hpo.objective.target is not None:
        objective["goal"] = hpo.objective.target
    algorithm: dict[str, Any] = {"algorithmName": hpo.algorithm}
    if hpo.seed is not None and hpo.algorithm in ALGORITHMS_WITH_RANDOM_STATE:
        algorithm["algorithmSettings"] = [{"name": "random_state", "value": str(hpo.seed)}]
    trial_parameters = [
        {"name": TRIAL_NAME_PARAMETER, "description": "The trial's name", "reference": "${trialSpec.Name}"}
    ]
    trial_parameters += [
        {
            "name": katib_parameter_name(p.path),
            "description": f"stages.{stage_name}.{p.path}",
            "reference": katib_parameter_name(p.path),
        }
        for p in hpo.parameters
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "objective": objective,
            "algorithm": algorithm,
            "parameters": [katib_parameter(p) for p in hpo.parameters],
            "parallelTrialCount": hpo.parallel_trials,
            "maxTrialCount": hpo.max_trials,
            # Katib refuses more than maxTrialCount; at most that many can fail, and all failing fails the search.
            "maxFailedTrialCount": min(hpo.max_failed_trials, hpo.max_trials),
            # Never: the search ends with its verdict, and Katib's webhook then refuses any restart.
            "resumePolicy": "Never",
            # File, not StdOut: the StdOut collector wraps the container's command in a shell pipeline into tee,
            # which needs a shell in the image and puts the shell between the kubelet's SIGTERM and torchrun (a
            # preempted trial would be killed without its checkpoint-and-exit path).
            "metricsCollectorSpec": {
                "collector": {"kind": "File"},
                "source": {"fileSystemPath": {"path": METRICS_FILE, "kind": "File", "format": "TEXT"}},
            },
            "trialTemplate": {
                "primaryContainerName": CONTAINER_NAME,
                "primaryPodLabels": dict(PRIMARY_POD_LABELS),
                "successCondition": TRIAL_SUCCESS_CONDITION,
                "failureCondition": TRIAL_FAILURE_CONDITION,
                "retain": False,
                "trialParameters": trial_parameters,
                "trialSpec": trial_spec(spec, stage_name, run_name),
            },
        },
    }


def longest_trial_service_name(spec: PipelineSpec, stage_name: str) -> str:
    """The longest Service name a trial's PyTorchJob can get: `<experiment>-<8>-worker-<last index>`."""
    stage = spec.stage(stage_name)
    experiment = experiment_generate_name(spec, stage_name) + "x" * GENERATED_SUFFIX_LENGTH
    return f"{experiment}{TRIAL_SUFFIX}-worker-{max(stage.resources.nodes - 2, 0)}"


def search_waves(stage: TrainingStage) -> int:
    """How many rounds of parallel trials the search takes at most (failed trials count towards maxTrialCount)."""
    assert stage.hpo is not None
    return math.ceil(stage.hpo.max_trials / stage.hpo.parallel_trials)
