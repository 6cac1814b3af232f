"""`workflows.submit` in-process: render, dry run, submit, watch and --local, against the fake server."""

from __future__ import annotations

import base64
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_argo import SUBMITTER_RBAC, FakeArgo, node, workflow_status

from spec import form as spec_form
from spec.document import LoadedPipeline
from spec.loading import PIPELINES_DIR, load_pipeline
from spec.pipeline import PipelineSpec
from workflows import submit
from workflows.compile import compile_pipeline

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
    # Server-side: a client-side apply copies the object into an annotation, which fails over 256 KiB.
    assert f"next: kubectl apply --server-side -f {tmp_path / 'out' / 'workflowtemplate.yaml'}" in out
    assert "argo submit" in out


def test_render_keeps_unicode_readable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm", "--render", str(tmp_path), "--set", "description=한국어 모델")
    assert "한국어 모델" in (tmp_path / "workflowtemplate.yaml").read_text(encoding="utf-8")


def test_render_compiles_every_set_into_standalone_documents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--render accepts fields of the template too; the three files agree with each other."""
    overrides = ["stages.sft.training.learning_rate=2e-4", "stages.sft.resources.nodes=2", "schedule.suspend=true"]
    code, _, _ = _run(capsys, "korean-llm", "--render", str(tmp_path), *(f"--set={o}" for o in overrides))
    assert code == 0
    expected = compile_pipeline(load_pipeline("korean-llm", overrides=overrides).spec).documents()
    for file_name, document in expected.items():
        assert yaml.safe_load((tmp_path / file_name).read_text(encoding="utf-8")) == document
    workflow = expected["workflow.yaml"]
    assert _arguments(workflow)["overrides"] == ""
    resolved = _resolved_in_the_cluster(expected["workflowtemplate.yaml"], workflow)
    assert resolved.stages.sft.training.learning_rate == 2e-4 and resolved.stages.sft.resources.nodes == 2


def test_render_with_a_profile_names_the_template_after_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = _run(capsys, "korean-llm", "--profile", "local", "--render", str(tmp_path))
    assert code == 0
    docs = {p.name: yaml.safe_load(p.read_text(encoding="utf-8")) for p in tmp_path.iterdir()}
    assert docs["workflowtemplate.yaml"]["metadata"]["name"] == "korean-llm-local"
    assert docs["cronworkflow.yaml"]["metadata"]["name"] == "korean-llm-local"
    assert docs["cronworkflow.yaml"]["spec"]["workflowSpec"]["workflowTemplateRef"] == {"name": "korean-llm-local"}
    assert docs["workflow.yaml"]["spec"]["workflowTemplateRef"] == {"name": "korean-llm-local"}
    assert docs["workflow.yaml"]["metadata"]["generateName"] == "korean-llm-"


def test_a_profile_name_that_cannot_name_a_template_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], local_runner: list[tuple[Any, ...]]
) -> None:
    pipeline = tmp_path / "korean-llm.yaml"
    text = (PIPELINES_DIR / "korean-llm.yaml").read_text(encoding="utf-8")
    pipeline.write_text(text.replace("\n  local:\n", "\n  Local_Tiny:\n", 1), encoding="utf-8")
    code, _, err = _run(capsys, str(pipeline), "--profile", "Local_Tiny", "--render", str(tmp_path / "out"))
    assert code == 2
    assert f"error: cannot compile {pipeline}: profile 'Local_Tiny' names the WorkflowTemplate" in err
    assert not (tmp_path / "out").exists()
    code, _, _ = _run(capsys, str(pipeline), "--profile", "Local_Tiny", "--local")  # no template, no name
    assert code == 3 and len(local_runner) == 1


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


def test_submit_and_dry_run_warn_of_the_plan_as_local_does(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight", "--set", "stages.sft.training.max_steps=100")
    assert code == 0 and "warning: sft: max_steps 100 (--set) overrides epochs 2" in err
    code, out, err = _run(capsys, "korean-llm", "--dry-run", "--set", "stages.sft.training.max_steps=100")
    assert code == 0 and "warning: sft: max_steps 100" in err and "warning" not in out
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 0 and "warning" not in err


def _arguments(workflow: dict[str, Any]) -> dict[str, str]:
    return {p["name"]: p["value"] for p in workflow["spec"]["arguments"]["parameters"]}


def _resolved_in_the_cluster(template: dict[str, Any], workflow: dict[str, Any]) -> PipelineSpec:
    """What prepare resolves for `workflow`: the template's embedded spec with the run's argument values."""
    prepare = next(t for t in template["spec"]["templates"] if t["name"] == "prepare")
    embedded = next(a["raw"]["data"] for a in prepare["inputs"]["artifacts"] if a["name"] == "pipeline-spec")
    return spec_form.resolve_parameters(json.loads(base64.b64decode(embedded)), _arguments(workflow))


def test_set_values_travel_with_the_run_and_leave_the_template_alone(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    """The weekly schedule runs the shared template: an ad-hoc --set must not end up in it."""
    _run(capsys, "korean-llm", "--skip-preflight")
    before = fake.objects("workflowtemplates")[(NS, "korean-llm")]
    fake.requests.clear()
    lr, version = "stages.sft.training.learning_rate=2e-4", "data_version=2026-12"
    code, out, err = _run(capsys, "korean-llm", "--skip-preflight", "--set", lr, "--set", version)
    assert (code, err) == (0, "")
    assert f"WorkflowTemplate {NS}/korean-llm is up to date" in out
    assert [r.method for r in fake.requests] == ["GET", "POST"]
    template = fake.objects("workflowtemplates")[(NS, "korean-llm")]
    assert template == before

    [created] = [r.body["workflow"] for r in fake.requests if r.method == "POST"]
    arguments = _arguments(created)
    assert arguments["overrides"] == f"{lr}\n{version}"
    assert arguments["data-version"] == "2026-11"  # the form's default: the override line wins in prepare
    assert created["spec"]["workflowTemplateRef"] == {"name": "korean-llm"}
    resolved = _resolved_in_the_cluster(template, created)
    assert resolved.stages.sft.training.learning_rate == 2e-4 and resolved.data_version == "2026-12"


def test_a_submitter_submits_with_set(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm", "--skip-preflight")  # registered by someone allowed to
    fake.allowed = SUBMITTER_RBAC
    code, out, err = _run(capsys, "korean-llm", "--skip-preflight", "--set", "stages.sft.lora.r=8")
    assert (code, err) == (0, "")
    assert f"WorkflowTemplate {NS}/korean-llm is up to date" in out
    runs = [o for (_, name), o in fake.objects("workflows").items() if f"submitted Workflow {NS}/{name}" in out]
    assert [_arguments(run)["overrides"] for run in runs] == ["stages.sft.lora.r=8"]


def test_stage_switches_become_run_parameters(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    """`stages.<stage>.enabled` is the form's run-<stage> switch, not an override line."""
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight", "--set", "stages.rlhf.enabled=false")
    assert (code, err) == (0, "")
    [run] = fake.objects("workflows").values()
    arguments = _arguments(run)
    assert arguments["run-rlhf"] == "false" and arguments["run-cpt"] == "true" and arguments["overrides"] == ""


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (
            "stages.sft.resources.nodes=1",
            "--set stages.sft.resources.nodes: stages.sft.resources is part of the shared WorkflowTemplate "
            "korean-llm (compiled into its manifests) and cannot change per run: ",
        ),
        ("cluster.namespace=posttrain", "--set cluster.namespace: cluster is part of the shared WorkflowTemplate"),
        ("schedule.suspend=true", "--set schedule.suspend: schedule is part of the shared WorkflowTemplate"),
        (
            "model.trust_remote_code=true",
            "--set model.trust_remote_code: it is part of the shared WorkflowTemplate korean-llm (it lets code from "
            "the model's repository run in the pods)",
        ),
        (
            "stages.deploy.storage_uri=gs://elsewhere/models",
            "--set stages.deploy.storage_uri: it is part of the shared WorkflowTemplate korean-llm (deploy uploads "
            "the model there with the pods' cloud credentials)",
        ),
        (
            "model={name_or_path: x}",
            "--set model: it would replace model.trust_remote_code, which is part of the shared WorkflowTemplate "
            "korean-llm",
        ),
    ],
)
def test_a_template_field_is_refused_before_any_request(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], override: str, says: str
) -> None:
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight", "--set", override)
    assert code == 2
    assert err.startswith(f"error: {says}")
    assert err.endswith(
        "change it in the pipeline file or a profile and run `python -m workflows.register korean-llm`, "
        "or use --render DIR for standalone YAML\n"
    )
    assert len(err.splitlines()) == 1
    assert fake.requests == []


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (
            "stages.sft.training.learning_rate=fast",
            "error: --set stages.sft.training.learning_rate=fast: stages.sft.training.learning_rate: ",
        ),
        ("stages.sft.trainig.learning_rate=1e-4", "--set stages.sft.trainig.learning_rate=1e-4: stages.sft.trainig: "),
        ("stages.evaluate.enabled=false", "stages.deploy needs stages.evaluate"),
        ("stages.cpt.enabled=maybe", "error: --set stages.cpt.enabled=maybe: expected true or false"),
        ("stages.sft.lora.r=8\nstages.sft.resources.nodes=4", "expected one path.to.field=value on a single line"),
        ("# stages.sft.lora.r=8", "expected one path.to.field=value on a single line"),
        ("no-equals-sign", "expected path.to.field=value"),
    ],
)
def test_a_bad_set_is_refused_on_this_machine(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], override: str, says: str
) -> None:
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight", "--set", override)
    assert code == 2
    assert says in err and "Traceback" not in err
    assert fake.requests == []


def test_a_profile_has_its_own_template(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "qwen3-30b-a3b", "--skip-preflight")
    plain = fake.objects("workflowtemplates")[(NS, "qwen3-30b-a3b")]
    code, out, _ = _run(capsys, "qwen3-30b-a3b", "--skip-preflight", "--profile", "qlora")
    assert code == 0
    assert f"created WorkflowTemplate {NS}/qwen3-30b-a3b-qlora" in out
    assert set(fake.objects("workflowtemplates")) == {(NS, "qwen3-30b-a3b"), (NS, "qwen3-30b-a3b-qlora")}
    assert fake.objects("workflowtemplates")[(NS, "qwen3-30b-a3b")] == plain
    runs = fake.objects("workflows").values()
    qlora = [w for w in runs if w["spec"]["workflowTemplateRef"] == {"name": "qwen3-30b-a3b-qlora"}]
    assert [w["metadata"]["generateName"] for w in qlora] == ["qwen3-30b-a3b-"]
    resolved = _resolved_in_the_cluster(fake.objects("workflowtemplates")[(NS, "qwen3-30b-a3b-qlora")], qlora[0])
    assert resolved.stages.sft.method == "qlora"

    code, out, _ = _run(capsys, "qwen3-30b-a3b", "--skip-preflight")  # the plain one is still there, unchanged
    assert code == 0 and f"WorkflowTemplate {NS}/qwen3-30b-a3b is up to date" in out


def test_submitting_an_unchanged_pipeline_does_not_write_the_template(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(capsys, "korean-llm", "--skip-preflight")
    fake.requests.clear()
    code, out, _ = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 0
    assert f"WorkflowTemplate {NS}/korean-llm is up to date" in out
    assert [(r.method, r.path.split("/")[3]) for r in fake.requests] == [
        ("GET", "workflow-templates"),
        ("POST", "workflows"),
    ]


def test_a_submitter_submits_an_unchanged_pipeline(fake: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    _run(capsys, "korean-llm", "--skip-preflight")  # registered by someone allowed to
    fake.allowed = SUBMITTER_RBAC
    code, out, err = _run(capsys, "korean-llm", "--skip-preflight")
    assert (code, err) == (0, "")
    assert f"WorkflowTemplate {NS}/korean-llm is up to date" in out
    assert len(fake.objects("workflows")) == 2


def test_a_submitter_is_told_who_must_register_a_changed_pipeline(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(capsys, "korean-llm", "--skip-preflight", "--profile", "local")
    stale = fake.objects("workflowtemplates")[(NS, "korean-llm-local")]
    stale["metadata"]["annotations"]["workflows.argoproj.io/description"] = "an older version of the pipeline"
    fake.put_object("workflowtemplates", stale)
    fake.allowed = SUBMITTER_RBAC
    lr = "stages.sft.training.learning_rate=1e-4"
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight", "--profile", "local", "--set", lr)
    assert code == 1
    assert err == (
        f"error: WorkflowTemplate {NS}/korean-llm-local on the Argo server is out of date (it differs from the "
        "compiled pipeline), and the identity behind ARGO_TOKEN may not update it (403 Forbidden): someone with the "
        "registrar role should run `python -m workflows.register korean-llm --profile local`, then submit again\n"
    )
    assert len(fake.objects("workflows")) == 1


def test_a_submitter_is_told_who_must_register_a_new_pipeline(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.allowed = SUBMITTER_RBAC
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 1
    assert f"WorkflowTemplate {NS}/korean-llm does not exist on the Argo server" in err
    assert "`python -m workflows.register korean-llm`" in err and len(err.splitlines()) == 1


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
    fake.forbidden = {("create", "workflows")}
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 1
    assert err.startswith(f"error: the Argo server refused to create Workflow in namespace {NS} (403 Forbidden)")
    assert fake.token not in err


def test_argo_namespace_other_than_the_spec_namespace_is_refused(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jobs and the InferenceService are created in cluster.namespace, owned by the workflow: both must agree."""
    monkeypatch.setenv("ARGO_NAMESPACE", "posttrain")
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight")
    assert code == 2
    assert err == (
        "error: ARGO_NAMESPACE is 'posttrain' but the pipeline's cluster.namespace is 'llm-training': "
        "unset ARGO_NAMESPACE, or set cluster.namespace to 'posttrain' in the pipeline file or a profile (the "
        "namespace is part of the shared template)\n"
    )
    assert fake.requests == []


def test_argo_namespace_agreeing_with_the_spec_is_used(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pipeline = tmp_path / "korean-llm.yaml"
    text = (PIPELINES_DIR / "korean-llm.yaml").read_text(encoding="utf-8")
    pipeline.write_text(text.replace("namespace: llm-training", "namespace: posttrain", 1), encoding="utf-8")
    monkeypatch.setenv("ARGO_NAMESPACE", "posttrain")
    code, out, _ = _run(capsys, str(pipeline), "--skip-preflight")
    assert code == 0
    assert {ns for ns, _ in fake.objects("workflows")} == {"posttrain"}
    assert "/workflows/posttrain/korean-llm-" in out


# --------------------------------------------------------------------------- --local


@pytest.fixture
def local_runner(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    def run_local(loaded: LoadedPipeline, run_dir: Path | None, force: bool = False, **options: Any) -> int:
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
