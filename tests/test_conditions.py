"""The Argo conditions that watch a training stage reach the operator's verdict on every PyTorchJob status shape.

Documents come from tests/pytorchjob_status.py (a replay of the Training Operator's status code); the verdict is
computed with tests/argo_model.py (Argo's condition evaluation). Conditions are taken both from
workflows/pytorchjob.py and from the resource templates of every compiled pipeline.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
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
from schema_validation import validate_pytorchjob

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
            # The step that waits on a job (the create step only creates it: workflows/compile.py).
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
