"""`workflows.register`: create-or-update of the WorkflowTemplate and the CronWorkflow, against the fake server."""

from __future__ import annotations

import pytest
from fake_argo import FakeArgo

from workflows import register
from workflows.submit import run_cli

NS = "llm-training"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        run_cli(register.main, list(argv))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def test_first_registration_creates_template_and_schedule(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "korean-llm")
    assert code == 0
    assert out.splitlines() == [
        f"created WorkflowTemplate {NS}/korean-llm",
        f"created CronWorkflow {NS}/korean-llm",
        "schedule: 0 2 * * 1 in Asia/Seoul",
    ]
    cron = fake.objects("cronworkflows")[(NS, "korean-llm")]
    assert cron["spec"]["workflowSpec"]["workflowTemplateRef"] == {"name": "korean-llm"}
    assert fake.objects("workflows") == {}  # registering submits no run


def test_registering_again_updates_both(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm")
    code, out, _ = _run(capsys, "korean-llm", "--set", "schedule.suspend=true")
    assert code == 0
    assert f"updated WorkflowTemplate {NS}/korean-llm" in out
    assert f"updated CronWorkflow {NS}/korean-llm" in out
    assert "(suspended)" in out
    assert fake.objects("cronworkflows")[(NS, "korean-llm")]["spec"]["suspend"] is True


def test_unscheduled_spec_registers_only_the_template(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "korean-llm", "--set", "schedule.cron=[]")
    assert code == 0
    assert fake.objects("cronworkflows") == {}
    assert "no schedule in the spec: no CronWorkflow" in out


def test_unscheduled_spec_points_out_a_leftover_cronworkflow(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(capsys, "korean-llm")
    code, out, _ = _run(capsys, "korean-llm", "--set", "schedule.cron=[]")
    assert code == 0
    assert f"CronWorkflow {NS}/korean-llm exists and still starts runs" in out
    assert f"argo cron delete -n {NS} korean-llm" in out


def test_forbidden_cronworkflows_names_the_verb(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    fake.forbidden = {("create", "cronworkflows")}
    code, out, err = _run(capsys, "korean-llm")
    assert code == 1
    assert f"created WorkflowTemplate {NS}/korean-llm" in out
    assert "RBAC verb 'create' on resource 'cronworkflows'" in err


def test_overrides_reach_the_template(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = _run(capsys, "korean-llm", "--set", "data_version=2027-02")
    assert code == 0
    template = fake.objects("workflowtemplates")[(NS, "korean-llm")]
    parameters = {p["name"]: p.get("value") for p in template["spec"]["arguments"]["parameters"]}
    assert parameters["data-version"] == "2027-02"


def test_invalid_spec_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "korean-llm", "--set", "schedule.timezone=Mars/Olympus")
    assert code == 2
    assert "schedule.timezone" in err and "unknown timezone" in err
