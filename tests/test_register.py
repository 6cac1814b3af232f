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
    assert f"updated WorkflowTemplate {NS}/korean-llm" in out  # the schedule is part of the compiled spec
    assert f"updated CronWorkflow {NS}/korean-llm" in out
    assert "(suspended)" in out
    assert fake.objects("cronworkflows")[(NS, "korean-llm")]["spec"]["suspend"] is True


def test_registering_updates_only_what_changed(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm")
    code, out, _ = _run(capsys, "korean-llm", "--set", "stages.sft.training.learning_rate=2e-4")
    assert code == 0
    assert f"updated WorkflowTemplate {NS}/korean-llm" in out
    assert f"CronWorkflow {NS}/korean-llm is up to date" in out


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


def test_overrides_reach_the_template_with_a_warning(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "korean-llm", "--set", "data_version=2027-02")
    assert code == 0
    template = fake.objects("workflowtemplates")[(NS, "korean-llm")]
    parameters = {p["name"]: p.get("value") for p in template["spec"]["arguments"]["parameters"]}
    assert parameters["data-version"] == "2027-02"
    assert err == (
        "warning: --set values are compiled into the shared WorkflowTemplate korean-llm: every run from it uses "
        "them, scheduled ones included, until it is registered or submitted again without them; for a single run, "
        "pass them to `python -m workflows.submit` instead\n"
    )
    assert out.splitlines()[0] == f"created WorkflowTemplate {NS}/korean-llm"


def test_registering_without_set_warns_about_nothing(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "korean-llm")
    assert (code, err) == (0, "")


def test_a_profile_registers_its_own_template_and_schedule(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm")
    plain = (fake.objects("workflowtemplates"), fake.objects("cronworkflows"))
    code, out, _ = _run(capsys, "korean-llm", "--profile", "local")
    assert code == 0
    assert out.splitlines()[:2] == [
        f"created WorkflowTemplate {NS}/korean-llm-local",
        f"created CronWorkflow {NS}/korean-llm-local",
    ]
    cron = fake.objects("cronworkflows")[(NS, "korean-llm-local")]
    assert cron["spec"]["workflowSpec"]["workflowTemplateRef"] == {"name": "korean-llm-local"}
    assert {k: v for k, v in fake.objects("workflowtemplates").items() if k[1] == "korean-llm"} == plain[0]
    assert {k: v for k, v in fake.objects("cronworkflows").items() if k[1] == "korean-llm"} == plain[1]


def test_an_unscheduled_profile_looks_for_its_own_leftover_schedule(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(capsys, "korean-llm")  # the plain schedule is not the profile's
    code, out, _ = _run(capsys, "korean-llm", "--profile", "local", "--set", "schedule.cron=[]")
    assert code == 0
    assert "no schedule in the spec: no CronWorkflow" in out


def test_invalid_spec_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "korean-llm", "--set", "schedule.timezone=Mars/Olympus")
    assert code == 2
    assert "schedule.timezone" in err and "unknown timezone" in err
