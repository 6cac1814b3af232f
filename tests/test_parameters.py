"""UI parameters: resolved in the cluster by prepare, validated by the same model, inert as data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spec import form as spec_form
from spec.document import SpecError
from spec.loading import load_pipeline
from workflows import parameters as params
from workflows.compile import compile_pipeline

REPO = Path(__file__).resolve().parents[1]


def _params_dir(tmp_path: Path, values: dict[str, str], pipeline: str = "korean-llm") -> Path:
    """What Argo lays out for prepare: the raw artifacts of the compiled template, with `values` substituted."""
    spec = load_pipeline(pipeline).spec
    template = compile_pipeline(spec).documents()["workflowtemplate.yaml"]
    prepare = next(t for t in template["spec"]["templates"] if t["name"] == "prepare")
    defaults = {p["name"]: p["value"] for p in template["spec"]["arguments"]["parameters"]}
    out = tmp_path / "params"
    out.mkdir()
    for artifact in prepare["inputs"]["artifacts"]:
        data = artifact["raw"]["data"]
        if data.startswith("{{workflow.parameters."):
            name = data.removeprefix("{{workflow.parameters.").removesuffix("}}")
            data = values.get(name, defaults[name])
        Path(out / Path(artifact["path"]).name).write_text(data, encoding="utf-8")
    return out


def prepare_step(run: Path, params_dir: Path) -> subprocess.CompletedProcess[str]:
    """`python -m stages prepare --params-dir` as the cluster's prepare pod runs it."""
    return subprocess.run(
        [sys.executable, "-m", "stages", "prepare", "--run-dir", str(run), "--params-dir", str(params_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard: a loaded 2-core machine took over 120 s
    )


def test_defaults_resolve_to_the_compiled_spec(tmp_path: Path) -> None:
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path, {}))
    assert spec == load_pipeline("korean-llm").spec.model_copy(update={"profiles": {}})


def test_form_values_reach_the_spec(tmp_path: Path) -> None:
    values = {
        "base-model": "Qwen/Qwen3-4B-Base",
        "data-version": "2026-12",
        "sft-data": "/mnt/datasets/other/train.jsonl",
        "run-cpt": "false",
        "overrides": "# tuned\nstages.sft.training.learning_rate=5e-5\n\nstages.sft.lora.r=8\n",
    }
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path, values))
    assert spec.model.name_or_path == "Qwen/Qwen3-4B-Base"
    assert spec.data_version == "2026-12"
    assert spec.stages.sft.data.uri == "/mnt/datasets/other/train.jsonl"
    assert spec.stages.cpt.enabled is False and spec.stages.sft.enabled is True
    assert spec.stages.sft.training.learning_rate == 5e-5 and spec.stages.sft.lora.r == 8
    assert spec_form.stage_switches(spec)["run-cpt"] == "false"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"run-cpt": "yes"}, "parameter run-cpt: expected true or false, got 'yes'"),
        ({"base-model": "  "}, "parameter base-model: must not be empty"),
        ({"overrides": "stages.sft.training.learning_rate=-1"}, "parameter overrides, line 1: stages.sft.training"),
        ({"overrides": "\nstages.sft.trainig.lr=1"}, "parameter overrides, line 2: stages.sft.trainig: unknown field"),
        ({"overrides": "no-equals-sign"}, "parameter overrides, line 1"),
        ({"overrides": "stages.cpt.resources.nodes=64"}, "fixed when the template is compiled"),
        ({"overrides": "cluster.namespace=other"}, "fixed when the template is compiled"),
        (
            {"overrides": "stages.deploy.serving.gpus=4"},
            "stages.deploy.serving.gpus is fixed when the template is compiled",
        ),
        ({"overrides": "stages.cpt.enabled=false"}, "use the run-<stage> parameter"),
        ({"run-evaluate": "false"}, "stages.deploy needs stages.evaluate"),
        ({"data-version": "v1; rm -rf /"}, "parameter data-version: data_version"),
    ],
)
def test_bad_form_values_name_the_parameter(tmp_path: Path, values: dict[str, str], message: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_form.resolve_params_dir(_params_dir(tmp_path, values))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("model.trust_remote_code=true", "code from the model's repository run in the pods"),
        ("tracking.mlflow_tracking_uri=http://elsewhere.example:5000", "send their MLflow credentials"),
        ("stages.evaluate.lm_eval_include_path=/anywhere", "can import and run Python code"),
        ("stages.deploy.storage_uri=gs://someone-elses-bucket/models", "with the pods' cloud credentials"),
        ("stages.deploy.storage_uri=pvc://checkpoints-rwx/elsewhere", "with the pods' cloud credentials"),
    ],
)
def test_what_decides_code_or_credentials_is_set_in_the_pipeline_file_only(
    tmp_path: Path, override: str, reason: str
) -> None:
    with pytest.raises(SpecError) as err:
        spec_form.resolve_params_dir(_params_dir(tmp_path, {"overrides": f"# ok\n{override}"}))
    field = override.split("=", 1)[0]
    assert str(err.value).startswith(f"parameter overrides, line 2: {field} cannot be set from the form: ")
    assert reason in str(err.value)
    assert str(err.value).endswith("; set it in the pipeline file and register it again")


@pytest.mark.parametrize(
    ("override", "fixed"),
    [
        ("tracking={mlflow_tracking_uri: http://elsewhere.example}", "tracking.mlflow_tracking_uri"),
        ("model={name_or_path: x, trust_remote_code: true}", "model.trust_remote_code"),
        ("stages.evaluate={lm_eval_include_path: /anywhere}", "stages.evaluate.enabled"),
        ("stages.sft={resources: {gpus_per_node: 1}}", "stages.sft.enabled"),
        ("stages={}", "stages.prepare.enabled"),
    ],
)
def test_a_section_holding_a_fixed_field_cannot_be_replaced(tmp_path: Path, override: str, fixed: str) -> None:
    """A mapping value replaces the whole section: it would change the fixed field without naming it."""
    with pytest.raises(SpecError) as err:
        spec_form.resolve_params_dir(_params_dir(tmp_path, {"overrides": override}))
    section = override.split("=", 1)[0]
    assert f"{section} would replace the whole section, {fixed} included" in str(err.value)
    assert f"set the fields below {section} one per line instead" in str(err.value)


def test_the_form_names_the_fields_it_cannot_set() -> None:
    [overrides] = [p for p in params.ui_parameters(load_pipeline("korean-llm").spec) if p.name == spec_form.OVERRIDES]
    for path in spec_form.PIPELINE_FILE_ONLY:
        assert ".".join(path) in overrides.description


def test_stages_deploy_cannot_be_replaced_whole(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"stages\.deploy would replace the whole section"):
        spec_form.resolve_params_dir(_params_dir(tmp_path, {"overrides": "stages.deploy={storage_uri: gs://x/y}"}))


def test_submit_names_its_own_lines(tmp_path: Path) -> None:
    """`workflows.submit` checks its --set with the same function; errors name the --set, not the form's line."""
    document = params.embedded_document(load_pipeline("korean-llm").spec)
    values = {spec_form.OVERRIDES: "stages.sft.lora.r=8\nstages.sft.lora.r=many"}
    with pytest.raises(SpecError, match=r"^--set 2: stages\.sft\.lora\.r: "):
        spec_form.resolve_parameters(document, values, lambda number: f"--set {number}")
    spec = spec_form.resolve_parameters(document, {spec_form.OVERRIDES: "stages.sft.lora.r=8"})
    assert spec.stages.sft.lora.r == 8


def test_sections_without_fixed_fields_may_be_set_whole(tmp_path: Path) -> None:
    overrides = "stages.sft.training={learning_rate: 5.0e-5}\ntracking.wandb_project=other"
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path, {"overrides": overrides}))
    assert spec.stages.sft.training.learning_rate == 5e-5 and spec.tracking.wandb_project == "other"


def test_shell_and_template_syntax_stays_data(tmp_path: Path) -> None:
    nasty = "$(touch /tmp/pwned); `id` && echo '{{workflow.name}}' \"quoted\""
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path, {"base-model": nasty}))
    assert spec.model.name_or_path == nasty.strip()
    # a name is one line: a newline in it could forge a line of the pod's log
    (tmp_path / "newline").mkdir()
    with pytest.raises(SpecError, match=r"^parameter base-model: model.name_or_path: holds the control character"):
        spec_form.resolve_params_dir(_params_dir(tmp_path / "newline", {"base-model": "org/model\nerror: forged"}))


def test_prepare_step_resolves_parameters_and_outputs_switches(tmp_path: Path) -> None:
    """`python -m stages prepare --params-dir` as the pod runs it, up to the point the spec is resolved.
    A bad value fails the step with the parameter named and no traceback."""
    run = tmp_path / "run"
    proc = prepare_step(run, _params_dir(tmp_path, {"run-sft": "maybe"}))
    assert proc.returncode == 2
    assert "parameter run-sft: expected true or false" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "spec.json").exists()

    good = tmp_path / "good"
    good.mkdir()
    _params_dir(good, {"run-rlhf": "false"})
    from spec.form import resolve_params_dir, stage_switches

    spec = resolve_params_dir(good / "params")
    switches = stage_switches(spec)
    assert switches["run-rlhf"] == "false" and switches["run-sft"] == "true"
    assert json.loads(json.dumps(switches)) == switches
