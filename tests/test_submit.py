"""`workflows.submit` in-process: render, dry run, submit, watch and --local, against the fake server."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_argo import FakeArgo, node, workflow_status

from workflows import submit
from workflows.compile import compile_pipeline
from workflows.loading import LoadedPipeline, load_pipeline

NS = "llm-training"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        submit.run_cli(submit.main, list(argv))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


# --------------------------------------------------------------------------- render and dry run


def test_render_writes_the_compiled_documents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "korean-llm", "--render", str(tmp_path / "out"))
    assert code == 0
    expected = compile_pipeline(load_pipeline("korean-llm").spec).documents()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(expected)
    for file_name, document in expected.items():
        assert yaml.safe_load((tmp_path / "out" / file_name).read_text(encoding="utf-8")) == document
        assert f"wrote {tmp_path / 'out' / file_name}" in out
    assert "kubectl apply" in out and "argo submit" in out


def test_render_keeps_unicode_readable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm", "--render", str(tmp_path), "--set", "description=한국어 모델")
    assert "한국어 모델" in (tmp_path / "workflowtemplate.yaml").read_text(encoding="utf-8")


def test_render_without_schedule_removes_a_stale_cronworkflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(capsys, "korean-llm", "--render", str(tmp_path))
    assert (tmp_path / "cronworkflow.yaml").is_file()
    code, out, _ = _run(capsys, "korean-llm", "--render", str(tmp_path), "--set", "schedule.cron=[]")
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["workflow.yaml", "workflowtemplate.yaml"]
    assert "removed" in out


def test_render_into_an_unwritable_place_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = _run(capsys, "korean-llm", "--render", str(blocker / "out"))
    assert code == 1
    assert f"cannot write to --render {blocker / 'out'}" in err


def test_dry_run_prints_the_workflow_and_calls_nothing(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "korean-llm", "--dry-run", "--set", "data_version=2027-01")
    assert code == 0
    doc = yaml.safe_load(out)
    assert doc["kind"] == "Workflow"
    assert doc["metadata"]["generateName"] == "korean-llm-"
    assert {"name": "data-version", "value": "2027-01"} in doc["spec"]["arguments"]["parameters"]
    assert fake.requests == []


# --------------------------------------------------------------------------- submit and watch


def test_submit_ensures_the_template_and_prints_name_and_url(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 0
    [(ns, name)] = fake.objects("workflows")
    assert ns == NS and name.startswith("korean-llm-")
    assert set(fake.objects("workflowtemplates")) == {(NS, "korean-llm")}
    assert fake.objects("cronworkflows") == {}  # submitting does not register the schedule
    assert f"created WorkflowTemplate {NS}/korean-llm" in out
    assert f"submitted Workflow {NS}/{name}" in out
    assert f"{fake.url}/workflows/{NS}/{name}" in out


def test_a_second_submit_updates_the_template(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm", "--skip-preflight")
    code, out, _ = _run(capsys, "korean-llm", "--skip-preflight", "--set", "stages.sft.training.learning_rate=1e-4")
    assert code == 0
    assert f"updated WorkflowTemplate {NS}/korean-llm" in out
    assert len(fake.objects("workflows")) == 2


@pytest.mark.parametrize(("final", "code"), [("Succeeded", 0), ("Failed", 1)])
def test_watch_exit_code_follows_the_workflow(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], final: str, code: int
) -> None:
    fake.statuses = [
        workflow_status("Running", [node("prepare", "Running")]),
        workflow_status(final, [node("prepare", final, finished="2026-11-02T02:03:00Z")]),
    ]
    result, out, _ = _run(capsys, "korean-llm", "--skip-preflight", "--watch", "--watch-interval", "0")
    assert result == code
    assert f" {final}: {fake.url}/workflows/{NS}/" in out


def test_server_errors_exit_1_with_the_message(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    fake.forbidden = {("create", "workflowtemplates")}
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 1
    assert err.startswith("error: the Argo server refused to create WorkflowTemplate")
    assert fake.token not in err


def test_argo_namespace_is_used_for_submission(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARGO_NAMESPACE", "posttrain")
    code, out, _ = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 0
    assert {ns for ns, _ in fake.objects("workflows")} == {"posttrain"}
    assert "/workflows/posttrain/korean-llm-" in out


# --------------------------------------------------------------------------- --local


@pytest.fixture
def local_runner(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    def run_local(loaded: LoadedPipeline, run_dir: Path | None, force: bool = False) -> int:
        calls.append((loaded, run_dir, force))
        return 3

    module = types.ModuleType("workflows.local")
    module.run_local = run_local  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "workflows.local", module)
    return calls


def test_local_runs_the_local_profile_and_returns_its_code(
    local_runner: list[tuple[Any, ...]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, _ = _run(capsys, "korean-llm", "--local", "--run-dir", str(tmp_path), "--force")
    assert code == 3
    [(loaded, run_dir, force)] = local_runner
    assert loaded.spec.model.from_config is not None  # the 'local' profile was applied
    assert (run_dir, force) == (tmp_path, True)


def test_local_with_overrides_and_an_explicit_profile(
    local_runner: list[tuple[Any, ...]], capsys: pytest.CaptureFixture[str]
) -> None:
    _run(capsys, "korean-llm", "--local", "--set", "stages.cpt.training.max_steps=5")
    [(loaded, run_dir, force)] = local_runner
    assert loaded.spec.stages.cpt.training.max_steps == 5
    assert loaded.spec.model.from_config is not None
    assert (run_dir, force) == (None, False)


def test_local_does_not_import_the_argo_client(
    local_runner: list[tuple[Any, ...]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "workflows.argo", raising=False)
    monkeypatch.delitem(sys.modules, "workflows.compile", raising=False)
    _run(capsys, "korean-llm", "--local")
    assert "workflows.argo" not in sys.modules
    assert "workflows.compile" not in sys.modules


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "argv",
    [
        ["korean-llm", "--watch", "--render", "out"],
        ["korean-llm", "--render", "out", "--dry-run"],
        ["korean-llm", "--run-dir", "x"],
        ["korean-llm", "--force"],
        ["korean-llm", "--local", "--dry-run"],
    ],
)
def test_conflicting_options_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert "usage:" in err


def test_missing_argo_server_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ARGO_SERVER", raising=False)
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 2
    assert "ARGO_SERVER is not set" in err and "--render" in err


# --------------------------------------------------------------------------- preflight


def test_a_failed_preflight_blocks_the_submission(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code, _, err = _run(capsys, "korean-llm")
    assert code == 1
    assert "preflight: not ready" in err and "--skip-preflight" in err and "cluster access" in err
    assert "Traceback" not in err
    assert fake.objects("workflowtemplates") == {} and fake.objects("workflows") == {}


def test_a_passing_preflight_lets_the_submission_through(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from workflows import preflight

    class Ready:
        ok = True

        def verdict(self) -> str:
            return "ready"

    seen: list[str] = []
    monkeypatch.setattr(preflight, "run_preflight", lambda spec: seen.append(spec.name) or Ready())
    code, out, _ = _run(capsys, "korean-llm")
    assert code == 0 and seen == ["korean-llm"]
    assert "preflight: ready" in out and len(fake.objects("workflows")) == 1
