"""The command line end to end, as a user runs it: `python -m workflows.submit ...` in a subprocess.

Every expected failure must print a message that says what to fix, exit non-zero and never show a traceback;
ARGO_TOKEN's value must never appear in the output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fake_argo import SUBMITTER_RBAC, FakeArgo, running

REPO = Path(__file__).resolve().parent.parent
NS = "llm-training"


def _cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ARGO_")}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def submit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _cli("workflows.submit", *args, env=env)


@pytest.fixture
def fake() -> Iterator[FakeArgo]:
    with running() as server:
        yield server


def test_render_writes_yaml_that_parses(tmp_path: Path) -> None:
    proc = submit("korean-llm", "--render", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    kinds = {p.name: yaml.safe_load(p.read_text(encoding="utf-8"))["kind"] for p in tmp_path.iterdir()}
    assert kinds == {
        "workflowtemplate.yaml": "WorkflowTemplate",
        "workflow.yaml": "Workflow",
        "cronworkflow.yaml": "CronWorkflow",
    }
    assert f"wrote {tmp_path / 'workflow.yaml'}" in proc.stdout


def test_dry_run_prints_only_the_workflow() -> None:
    proc = submit("korean-llm", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["spec"]["workflowTemplateRef"] == {"name": "korean-llm"}


def test_unknown_pipeline_lists_the_known_ones() -> None:
    proc = submit("no-such-pipeline", "--render", "unused")
    assert proc.returncode == 2
    assert "unknown pipeline 'no-such-pipeline'" in proc.stderr
    assert "korean-llm" in proc.stderr
    assert not Path(REPO / "unused").exists()


def test_invalid_set_names_the_field_path() -> None:
    proc = submit("korean-llm", "--dry-run", "--set", "stages.sft.training.learning_rate=fast")
    assert proc.returncode == 2
    assert "stages.sft.training.learning_rate" in proc.stderr
    assert proc.stdout == ""


def test_misspelt_set_field_is_reported_at_its_path() -> None:
    proc = submit("korean-llm", "--dry-run", "--set", "stages.sft.trainig.learning_rate=1e-4")
    assert proc.returncode == 2
    assert "stages.sft.trainig" in proc.stderr and "unknown field" in proc.stderr


def test_malformed_set_says_the_expected_form() -> None:
    proc = submit("korean-llm", "--dry-run", "--set", "no-equals-sign")
    assert proc.returncode == 2
    assert "expected path.to.field=value" in proc.stderr


def test_missing_argo_server_says_what_to_set() -> None:
    proc = submit("korean-llm")
    assert proc.returncode == 2
    assert "ARGO_SERVER is not set" in proc.stderr


def test_connection_refused_gives_the_helpful_message() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = submit(
        "korean-llm", "--skip-preflight", env={"ARGO_SERVER": f"http://127.0.0.1:{port}", "ARGO_TOKEN": "t0k3n-value"}
    )
    assert proc.returncode == 1
    assert f"cannot reach the Argo server at http://127.0.0.1:{port}/" in proc.stderr
    assert "set ARGO_SERVER" in proc.stderr and "ARGO_INSECURE_SKIP_VERIFY=true" in proc.stderr
    assert "t0k3n-value" not in proc.stdout + proc.stderr


def test_wrong_token_gives_401_help_and_never_shows_the_token(fake: FakeArgo) -> None:
    proc = submit("korean-llm", "--skip-preflight", env=fake.env(ARGO_TOKEN="Bearer wrong-t0k3n-value"))
    assert proc.returncode == 1
    assert "401 Unauthorized" in proc.stderr and "ARGO_TOKEN" in proc.stderr and "argo auth token" in proc.stderr
    assert "wrong-t0k3n-value" not in proc.stdout + proc.stderr


def test_forbidden_names_the_rbac_verb(fake: FakeArgo) -> None:
    fake.forbidden = {("create", "workflows")}
    proc = submit("korean-llm", "--skip-preflight", env=fake.env())
    assert proc.returncode == 1
    assert "RBAC verb 'create' on resource 'workflows'" in proc.stderr


def test_submit_prints_name_and_url_and_never_the_token(fake: FakeArgo) -> None:
    proc = submit("korean-llm", "--skip-preflight", env=fake.env())
    assert proc.returncode == 0, proc.stderr
    [(_, name)] = fake.objects("workflows")
    assert f"submitted Workflow {NS}/{name}" in proc.stdout
    assert f"{fake.url}/workflows/{NS}/{name}" in proc.stdout
    assert fake.token not in proc.stdout + proc.stderr


def test_register_twice_then_update(fake: FakeArgo) -> None:
    first = _cli("workflows.register", "korean-llm", env=fake.env())
    second = _cli("workflows.register", "korean-llm", env=fake.env())
    third = _cli("workflows.register", "korean-llm", "--set", "schedule.suspend=true", env=fake.env())
    assert (first.returncode, second.returncode, third.returncode) == (0, 0, 0), first.stderr + second.stderr
    assert "created CronWorkflow" in first.stdout
    assert f"CronWorkflow {NS}/korean-llm is up to date" in second.stdout
    assert "updated CronWorkflow" in third.stdout
    assert fake.token not in first.stdout + first.stderr + second.stdout + second.stderr


def test_a_submitter_submits_a_run_with_set(fake: FakeArgo) -> None:
    assert _cli("workflows.register", "korean-llm", env=fake.env()).returncode == 0
    template = fake.objects("workflowtemplates")
    fake.allowed = SUBMITTER_RBAC
    proc = submit("korean-llm", "--skip-preflight", "--set", "data_version=2027-01", env=fake.env())
    assert (proc.returncode, proc.stderr) == (0, "")
    [(_, name)] = fake.objects("workflows")
    assert f"submitted Workflow {NS}/{name}" in proc.stdout
    workflow = fake.objects("workflows")[(NS, name)]
    assert {"name": "overrides", "value": "data_version=2027-01"} in workflow["spec"]["arguments"]["parameters"]
    assert fake.objects("workflowtemplates") == template


def test_a_submitter_with_an_out_of_date_template_is_sent_to_the_registrar(fake: FakeArgo) -> None:
    registered = _cli("workflows.register", "korean-llm", "--set", "description=older", env=fake.env())
    assert registered.returncode == 0
    assert registered.stderr.startswith(
        "warning: --set values are compiled into the shared WorkflowTemplate korean-llm: every run from it uses them"
    )
    fake.allowed = SUBMITTER_RBAC
    proc = submit("korean-llm", "--skip-preflight", "--set", "data_version=2027-01", env=fake.env())
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: WorkflowTemplate {NS}/korean-llm on the Argo server is out of date")
    assert proc.stderr.endswith("should run `python -m workflows.register korean-llm`, then submit again\n")
    assert len(proc.stderr.splitlines()) == 1


def test_set_on_a_template_field_is_refused_before_any_request(fake: FakeArgo) -> None:
    proc = submit("korean-llm", "--skip-preflight", "--set", "stages.sft.resources.gpus_per_node=1", env=fake.env())
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "error: --set stages.sft.resources.gpus_per_node: stages.sft.resources is part of the shared WorkflowTemplate "
        "korean-llm"
    )
    assert "`python -m workflows.register korean-llm`" in proc.stderr and "--render DIR" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert fake.requests == []


def test_invalid_set_on_submit_is_refused_before_any_request(fake: FakeArgo) -> None:
    proc = submit("korean-llm", "--skip-preflight", "--set", "stages.sft.training.learning_rate=fast", env=fake.env())
    assert proc.returncode == 2
    assert "--set stages.sft.training.learning_rate=fast: stages.sft.training.learning_rate:" in proc.stderr
    assert fake.requests == []


def test_argo_namespace_that_disagrees_with_the_spec_is_a_usage_error(fake: FakeArgo) -> None:
    proc = submit("korean-llm", "--skip-preflight", env=fake.env(ARGO_NAMESPACE="posttrain"))
    assert proc.returncode == 2
    assert "set cluster.namespace to 'posttrain'" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert fake.requests == []


def test_register_with_an_unknown_pipeline_exits_2() -> None:
    proc = _cli("workflows.register", "no-such-pipeline")
    assert proc.returncode == 2
    assert "known pipelines" in proc.stderr
