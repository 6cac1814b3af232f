"""The Argo conditions that watch a training stage reach the operator's verdict on every PyTorchJob status shape.

Documents come from tests/pytorchjob_status.py (a replay of the Training Operator's status code); the verdict is
computed with tests/argo_model.py (Argo's condition evaluation). Conditions are taken both from
workflows/pytorchjob.py and from the resource templates of every compiled pipeline.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import katib_status
import pytest
import trainjob_status
from argo_model import evaluate, parse_selector
from conftest import PIPELINE_VARIANTS, fresh_spec
from hypothesis import given, settings
from hypothesis import strategies as st
from pytorchjob_status import (
    FAILED,
    MASTER,
    PERMANENT_EXIT_CODE,
    RETRYABLE_EXIT_CODE,
    SCENARIOS,
    WORKER,
    Scenario,
    TrainingOperatorSim,
    minimal_manifest,
    scenario,
)
from schema_validation import validate_custom_resource, validate_pytorchjob

from workflows import katib, trainjob
from workflows.compile import compile_pipeline
from workflows.pytorchjob import FAILURE_CONDITION, SUCCESS_CONDITION

NAIVE_SUCCESS = "status.conditions.0.type == Succeeded"
NAIVE_FAILURE = "status.conditions.0.type == Failed"


@cache
def compiled_conditions() -> tuple[tuple[str, str, str], ...]:
    """(where, successCondition, failureCondition) of every PyTorchJob step of every compiled pipeline."""
    found = []
    for name, profile in PIPELINE_VARIANTS:
        docs = compile_pipeline(fresh_spec(name, profile)).documents()
        for template in docs["workflowtemplate.yaml"]["spec"]["templates"]:
            # The step that waits on a job (the create step only creates it: workflows/training_steps.py).
            if "resource" in template and "kind: PyTorchJob" in template["resource"]["manifest"]:
                resource = template["resource"]
                if resource["action"] == "create":
                    assert "successCondition" not in resource and "failureCondition" not in resource
                    continue
                assert resource["action"] == "get", template["name"]
                where = f"{name}@{profile or 'default'}:{template['name']}"
                found.append((where, resource.get("successCondition", ""), resource.get("failureCondition", "")))
    return tuple(found)


@pytest.mark.parametrize("case", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_is_what_the_operator_decided(case: Scenario) -> None:
    """The fixture's expected verdict is the simulated operator's own (guards the fixtures themselves)."""
    assert case.build().verdict() == case.expected


@pytest.mark.parametrize("case", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_rendered_conditions_reach_the_operator_verdict(case: Scenario) -> None:
    document = case.build().document()
    assert evaluate(document, SUCCESS_CONDITION, FAILURE_CONDITION) == case.expected, case.why


@pytest.mark.parametrize("case", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_compiled_template_conditions_reach_the_operator_verdict(case: Scenario) -> None:
    document = case.build().document()
    conditions = compiled_conditions()
    assert conditions, "no resource template in any compiled pipeline"
    for where, success, failure in conditions:
        assert evaluate(document, success, failure) == case.expected, f"{where}: {case.why}"


def test_compiled_templates_use_the_designed_conditions() -> None:
    for where, success, failure in compiled_conditions():
        assert (success, failure) == (SUCCESS_CONDITION, FAILURE_CONDITION), where


def test_conditions_parse_as_argo_parses_them() -> None:
    assert len(parse_selector(SUCCESS_CONDITION)) == 1
    failure = parse_selector(FAILURE_CONDITION)
    assert {r.key for r in failure} >= {f"status.conditions.{i}.type" for i in range(1, 5)}


def test_failed_never_sits_at_index_zero_and_always_within_the_watched_indices() -> None:
    watched = {int(r.key.split(".")[2]) for r in parse_selector(FAILURE_CONDITION)}
    for case in SCENARIOS:
        conditions = case.build().document().get("status", {}).get("conditions", [])
        positions = [i for i, c in enumerate(conditions) if c["type"] == FAILED]
        assert all(i in watched for i in positions), (case.name, positions, watched)
        assert not conditions or conditions[0]["type"] == "Created", case.name


@pytest.mark.parametrize("case", [s for s in SCENARIOS if s.expected == "succeeded"], ids=lambda s: s.name)
def test_naive_first_condition_misses_success(case: Scenario) -> None:
    """Why the design exists: `Created` is always conditions[0], so checking index 0 waits forever."""
    document = case.build().document()
    assert evaluate(document, NAIVE_SUCCESS, NAIVE_FAILURE) == "running"


@pytest.mark.parametrize("case", [s for s in SCENARIOS if s.expected == "failed"], ids=lambda s: s.name)
def test_naive_first_condition_misses_failure(case: Scenario) -> None:
    document = case.build().document()
    assert evaluate(document, NAIVE_SUCCESS, NAIVE_FAILURE) == "running"


@pytest.mark.parametrize("name", ["restarting-master", "restarting-worker"])
def test_failed_counters_alone_would_fail_restarting_jobs(name: str) -> None:
    """Why counters never decide failure: a restarting job has failed > 0 and must keep running."""
    document = scenario(name).build().document()
    counters = "status.replicaStatuses.Master.failed > 0,status.replicaStatuses.Worker.failed > 0"
    assert evaluate(document, SUCCESS_CONDITION, counters) == "failed"
    assert evaluate(document, SUCCESS_CONDITION, FAILURE_CONDITION) == "running"


@pytest.mark.parametrize("name", ["deadline-exceeded-running", "deadline-exceeded-pending", "backoff-limit-exceeded"])
def test_limit_failures_bump_no_counter(name: str) -> None:
    """Deadline and backoff failures carry only the Failed condition: counters would miss them."""
    document = scenario(name).build().document()
    status = document["status"]
    assert status["conditions"][-1]["reason"] == "PyTorchJobFailed"
    assert all(rs.get("failed", 0) == 0 for rs in status["replicaStatuses"].values())
    assert evaluate(document, SUCCESS_CONDITION, FAILURE_CONDITION) == "failed"


@pytest.mark.parametrize("case", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_status_documents_fit_the_crd(case: Scenario, schemas_dir: Any) -> None:
    validate_pytorchjob(case.build().document())


# --------------------------------------------------------------------------- any history of events

EVENTS = st.sampled_from(
    [
        "pending",
        "running",
        "master-ok",
        "worker-ok",
        "master-killed",
        "worker-killed",
        "master-error",
        "worker-error",
        "suspend",
        "resume",
        "deadline",
        "backoff",
    ]
)


def _apply(sim: TrainingOperatorSim, event: str) -> None:
    rtype = WORKER if event.startswith("worker") and WORKER in sim.replica_specs else MASTER
    pods = sim.pods.get(rtype) or []
    if event == "pending":
        sim.sync()
    elif event == "running":
        sim.pods_running()
    elif event.endswith(("-ok", "-killed", "-error")) and pods:
        code = {"ok": 0, "killed": RETRYABLE_EXIT_CODE, "error": PERMANENT_EXIT_CODE}[event.rsplit("-", 1)[1]]
        if pods[0].phase == "Running":
            sim.pod_exits(rtype, code)
    elif event == "suspend":
        sim.suspend()
    elif event == "resume":
        sim.resume()
    elif event == "deadline":
        sim.deadline_passes()
    elif event == "backoff":
        sim.backoff_limit_exceeded()


@settings(max_examples=300)
@given(
    workers=st.integers(min_value=0, max_value=3),
    policy=st.sampled_from(["Never", "ExitCode", "OnFailure"]),
    master_first=st.booleans(),
    events=st.lists(EVENTS, max_size=14),
)
def test_any_event_history_reaches_the_operator_verdict(
    workers: int, policy: str, master_first: bool, events: list[str]
) -> None:
    """After every status write, Argo's verdict equals the operator's, for any order of events."""
    order = (MASTER, WORKER) if master_first else (WORKER, MASTER)
    sim = TrainingOperatorSim(manifest=minimal_manifest(workers, policy), replica_order=order)
    assert evaluate(sim.document(), SUCCESS_CONDITION, FAILURE_CONDITION) == "running"
    sim.create()
    for event in events:
        _apply(sim, event)
        assert evaluate(sim.document(), SUCCESS_CONDITION, FAILURE_CONDITION) == sim.verdict(), events


# --------------------------------------------------------------------------- TrainJob (cluster.job_kind trainjob)

TRAINJOB_NODE_FIRST = [s for s in trainjob_status.SCENARIOS if not s.name.startswith("initializers-")]


@cache
def compiled_trainjob_conditions() -> tuple[tuple[str, str, str], ...]:
    """(where, successCondition, failureCondition) of every TrainJob wait step of every compiled pipeline, each
    compiled with job_kind trainjob."""
    found = []
    for name, profile in PIPELINE_VARIANTS:
        spec = fresh_spec(name, profile)
        spec.cluster.job_kind = "trainjob"
        for template in compile_pipeline(spec).documents()["workflowtemplate.yaml"]["spec"]["templates"]:
            resource = template.get("resource")
            if resource and "kind: TrainJob" in resource["manifest"] and resource["action"] == "get":
                where = f"{name}@{profile or 'default'}:{template['name']}"
                found.append((where, resource.get("successCondition", ""), resource.get("failureCondition", "")))
    return tuple(found)


def test_trainjob_scenarios_cover_every_condition_shape() -> None:
    """The shapes the Trainer writes: none, Suspended True/False, Complete and Failed alone or after Suspended,
    Failed before Suspended."""
    shapes = {
        tuple((c["type"], c["status"]) for c in s.doc.get("status", {}).get("conditions", []))
        for s in trainjob_status.SCENARIOS
    }
    assert shapes >= {
        (),
        (("Suspended", "True"),),
        (("Suspended", "False"),),
        (("Complete", "True"),),
        (("Failed", "True"),),
        (("Suspended", "False"), ("Complete", "True")),
        (("Suspended", "False"), ("Failed", "True")),
        (("Suspended", "True"), ("Failed", "True")),
        (("Failed", "True"), ("Suspended", "True")),
    }
    assert "status" not in trainjob_status.scenario("created-no-status").doc


@pytest.mark.parametrize("case", TRAINJOB_NODE_FIRST, ids=lambda s: s.name)
def test_trainjob_conditions_reach_the_trainer_verdict(case: trainjob_status.Scenario) -> None:
    assert evaluate(case.doc, trainjob.SUCCESS_CONDITION, trainjob.FAILURE_CONDITION) == case.expected


@pytest.mark.parametrize("case", TRAINJOB_NODE_FIRST, ids=lambda s: s.name)
def test_compiled_trainjob_conditions_reach_the_trainer_verdict(case: trainjob_status.Scenario) -> None:
    conditions = compiled_trainjob_conditions()
    assert conditions, "no TrainJob wait step in any pipeline compiled with job_kind trainjob"
    for where, success, failure in conditions:
        assert (success, failure) == (trainjob.SUCCESS_CONDITION, trainjob.FAILURE_CONDITION), where
        assert evaluate(case.doc, success, failure) == case.expected, where


def test_trainjob_conditions_parse_as_argo_parses_them() -> None:
    assert [r.key for r in parse_selector(trainjob.SUCCESS_CONDITION)] == [
        "status.jobsStatus.0.name",
        "status.jobsStatus.0.succeeded",
    ]
    failure = parse_selector(trainjob.FAILURE_CONDITION)
    assert {r.key for r in failure} == {f"status.conditions.{i}.type" for i in range(3)}


def test_trainjob_failed_always_within_the_watched_indices() -> None:
    watched = {int(r.key.split(".")[2]) for r in parse_selector(trainjob.FAILURE_CONDITION)}
    seen = set()
    for case in trainjob_status.SCENARIOS:
        conditions = case.doc.get("status", {}).get("conditions", [])
        positions = {i for i, c in enumerate(conditions) if c["type"] == "Failed"}
        assert positions <= watched, (case.name, positions)
        seen |= positions
    assert seen == {0, 1}  # Failed alone or first, and after Suspended


@pytest.mark.parametrize("name", ["complete", "kueue-complete"])
def test_complete_moves_with_kueue_so_no_single_index_decides_success(name: str) -> None:
    """Why success reads the node job's counter: `Complete` is conditions[0] without Kueue and [1] with it."""
    doc = trainjob_status.scenario(name).doc
    by_index = [f"status.conditions.{i}.type == Complete" for i in (0, 1)]
    outcomes = {evaluate(doc, success, trainjob.FAILURE_CONDITION) for success in by_index}
    assert outcomes == {"succeeded", "running"}
    assert evaluate(doc, trainjob.SUCCESS_CONDITION, trainjob.FAILURE_CONDITION) == "succeeded"


def test_a_restarting_node_is_not_a_failure() -> None:
    """The JobSet restarts a failed node (failurePolicy): failed > 0 without a Failed condition keeps waiting."""
    doc = trainjob_status.scenario("node-failed-restarting").doc
    assert doc["status"]["jobsStatus"][0]["failed"] == 1
    assert evaluate(doc, trainjob.SUCCESS_CONDITION, trainjob.FAILURE_CONDITION) == "running"


@pytest.mark.parametrize("name", ["initializers-running", "initializers-complete"])
def test_a_runtime_without_node_first_never_succeeds_by_mistake(name: str) -> None:
    """An initializer's succeeded counter sits at index 0: the name pin keeps it from passing for the node's
    (preflight refuses such a runtime; Argo's timeout ends the wait)."""
    doc = trainjob_status.scenario(name).doc
    assert doc["status"]["jobsStatus"][0]["succeeded"] == 1
    assert evaluate(doc, trainjob.SUCCESS_CONDITION, trainjob.FAILURE_CONDITION) == "running"
    unpinned = "status.jobsStatus.0.succeeded > 0"
    assert evaluate(doc, unpinned, trainjob.FAILURE_CONDITION) == "succeeded"


@pytest.mark.parametrize("case", trainjob_status.SCENARIOS, ids=lambda s: s.name)
def test_trainjob_status_documents_fit_the_crd(case: trainjob_status.Scenario) -> None:
    validate_custom_resource(case.doc)


@settings(max_examples=300)
@given(st.lists(st.sampled_from(trainjob_status.EVENTS), max_size=12), st.booleans())
def test_any_trainjob_history_reaches_the_trainer_verdict(events: list[str], kueue: bool) -> None:
    sim = trainjob_status.TrainerSim()
    sim.run(*(["kueue-suspend"] if kueue else []), *events)
    doc = sim.document()
    assert evaluate(doc, trainjob.SUCCESS_CONDITION, trainjob.FAILURE_CONDITION) == sim.verdict(), doc.get("status")


# --------------------------------------------------------------------------- Katib Experiment (a stage's hpo)


@pytest.mark.parametrize("case", katib_status.SCENARIOS, ids=lambda s: s.name)
def test_katib_conditions_reach_the_pipelines_verdict(case: katib_status.Scenario) -> None:
    assert case.sim.argo_verdict() == case.expected, case.why
    assert evaluate(case.doc, katib.SUCCESS_CONDITION, katib.FAILURE_CONDITION) == case.expected, case.why


@pytest.mark.parametrize("case", katib_status.SCENARIOS, ids=lambda s: s.name)
def test_katib_status_documents_fit_the_schema(case: katib_status.Scenario) -> None:
    validate_custom_resource(case.doc)


def test_katib_scenarios_cover_every_condition_shape() -> None:
    """Succeeded and Failed right after Created (no Running yet) and after Running; a restart's shapes."""
    shapes = {
        tuple((c["type"], c["status"]) for c in s.doc.get("status", {}).get("conditions", []))
        for s in katib_status.SCENARIOS
    }
    created, running = ("Created", "True"), ("Running", "True")
    stopped = ("Running", "False")
    assert shapes >= {
        (),
        (created,),
        (created, running),
        (created, ("Succeeded", "True")),
        (created, ("Failed", "True")),
        (created, stopped, ("Succeeded", "True")),
        (created, stopped, ("Failed", "True")),
        (created, ("Restarting", "True"), running),
        (created, ("Restarting", "True"), stopped, ("Succeeded", "True")),
    }
    assert "status" not in katib_status.scenario("created-no-status").doc
    assert katib_status.scenario("created").doc["status"]["completionTime"] is None


def test_katib_conditions_parse_as_argo_parses_them() -> None:
    assert [str(r) for r in parse_selector(katib.SUCCESS_CONDITION)] == [
        "status.completionTime",
        "status.completionTime!=",
    ]
    failure = parse_selector(katib.FAILURE_CONDITION)
    assert {r.key for r in failure} == {f"status.conditions.{i}.type" for i in (1, 2, 3)}


def test_katib_compiled_wait_uses_the_designed_conditions() -> None:
    from test_katib import with_hpo

    beta = {"path": "beta", "type": "uniform", "min": 0.05, "max": 0.5}
    spec = with_hpo(fresh_spec("korean-llm"), "rlhf", parameters=[beta])
    templates = compile_pipeline(spec).documents()["workflowtemplate.yaml"]["spec"]["templates"]
    (wait,) = [t for t in templates if t["name"] == "rlhf-hpo-wait"]
    assert (wait["resource"]["successCondition"], wait["resource"]["failureCondition"]) == (
        katib.SUCCESS_CONDITION,
        katib.FAILURE_CONDITION,
    )


def test_katib_null_completion_time_is_not_a_verdict() -> None:
    """Why success reads completionTime and not a condition index: Succeeded is at index 1, 2 or 3, and Katib writes
    completionTime as null from creation on, which exists for gjson: existence alone would pass a new search."""
    created = katib_status.scenario("created").doc
    assert evaluate(created, "status.completionTime", "") == "succeeded"
    assert evaluate(created, katib.SUCCESS_CONDITION, katib.FAILURE_CONDITION) == "running"
    by_index = [f"status.conditions.{i}.type == Succeeded" for i in (1, 2, 3)]
    for name in ("goal-reached-at-first-look", "max-trials-reached"):
        doc = katib_status.scenario(name).doc
        assert {evaluate(doc, success, katib.FAILURE_CONDITION) for success in by_index} == {"succeeded", "running"}


def test_katib_failed_always_within_the_watched_indices() -> None:
    watched = {int(r.key.split(".")[2]) for r in parse_selector(katib.FAILURE_CONDITION) if "Failed" in str(r)}
    seen = set()
    for case in katib_status.SCENARIOS:
        conditions = case.doc.get("status", {}).get("conditions", [])
        positions = {i for i, c in enumerate(conditions) if c["type"] in ("Failed", "Restarting")}
        assert positions <= watched, (case.name, positions)
        seen |= positions
    assert seen >= {1, 2}


def test_a_search_that_never_resumes_cannot_be_restarted() -> None:
    """The compiler renders resumePolicy Never: Katib's webhook refuses raising maxTrialCount once it is done."""
    sim = katib_status.KatibSim(resume_policy="Never").run(
        "reconcile", "reconcile", *["trial-running", "trial-succeeded"] * 4
    )
    assert sim.verdict() == "succeeded"
    assert not sim.raise_max_trials(8)


@settings(max_examples=300)
@given(
    st.lists(st.sampled_from(katib_status.EVENTS), max_size=16),
    st.sampled_from(["Never", "LongRunning"]),
    st.sampled_from([None, 1.0]),
    st.integers(min_value=0, max_value=3),
)
def test_any_katib_history_reaches_the_pipelines_verdict(
    events: list[str], resume_policy: str, goal: float | None, max_failed: int
) -> None:
    sim = katib_status.KatibSim(resume_policy=resume_policy, goal=goal, max_failed=max_failed)  # type: ignore[arg-type]
    sim.run("reconcile", *events)
    doc = sim.document()
    assert evaluate(doc, katib.SUCCESS_CONDITION, katib.FAILURE_CONDITION) == sim.argo_verdict(), doc.get("status")
