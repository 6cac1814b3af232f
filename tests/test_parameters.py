"""UI parameters: resolved in the cluster by prepare, validated by the same model, inert as data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workflows import parameters as params
from workflows.compile import compile_pipeline
from workflows.loading import SpecError, load_pipeline

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


def test_defaults_resolve_to_the_compiled_spec(tmp_path: Path) -> None:
    spec = params.resolve_params_dir(_params_dir(tmp_path, {}))
    assert spec == load_pipeline("korean-llm").spec.model_copy(update={"profiles": {}})


def test_form_values_reach_the_spec(tmp_path: Path) -> None:
    values = {
        "base-model": "Qwen/Qwen3-4B-Base",
        "data-version": "2026-12",
        "sft-data": "/mnt/datasets/other/train.jsonl",
        "run-cpt": "false",
        "overrides": "# tuned\nstages.sft.training.learning_rate=5e-5\n\nstages.sft.lora.r=8\n",
    }
    spec = params.resolve_params_dir(_params_dir(tmp_path, values))
    assert spec.model.name_or_path == "Qwen/Qwen3-4B-Base"
    assert spec.data_version == "2026-12"
    assert spec.stages.sft.data.uri == "/mnt/datasets/other/train.jsonl"
    assert spec.stages.cpt.enabled is False and spec.stages.sft.enabled is True
    assert spec.stages.sft.training.learning_rate == 5e-5 and spec.stages.sft.lora.r == 8
    assert params.stage_switches(spec)["run-cpt"] == "false"


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
        ({"overrides": "stages.cpt.enabled=false"}, "use the run-<stage> parameter"),
        ({"run-evaluate": "false"}, "stages.deploy needs stages.evaluate"),
        ({"data-version": "v1; rm -rf /"}, "parameter data-version: data_version"),
    ],
)
def test_bad_form_values_name_the_parameter(tmp_path: Path, values: dict[str, str], message: str) -> None:
    with pytest.raises(SpecError) as err:
        params.resolve_params_dir(_params_dir(tmp_path, values))
    assert message in str(err.value)


def test_shell_and_template_syntax_stays_data(tmp_path: Path) -> None:
    nasty = "$(touch /tmp/pwned); `id` && echo '{{workflow.name}}'\n\"quoted\""
    spec = params.resolve_params_dir(_params_dir(tmp_path, {"base-model": nasty}))
    assert spec.model.name_or_path == nasty.strip()


def test_prepare_step_resolves_parameters_and_outputs_switches(tmp_path: Path) -> None:
    """`python -m stages prepare --params-dir` as the pod runs it, up to the point the spec is resolved.
    A bad value fails the step with the parameter named and no traceback."""
    run = tmp_path / "run"
    bad = _params_dir(tmp_path, {"run-sft": "maybe"})
    proc = subprocess.run(
        [sys.executable, "-m", "stages", "prepare", "--run-dir", str(run), "--params-dir", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "parameter run-sft: expected true or false" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "spec.json").exists()

    good = tmp_path / "good"
    good.mkdir()
    _params_dir(good, {"run-rlhf": "false"})
    from workflows.parameters import resolve_params_dir, stage_switches

    spec = resolve_params_dir(good / "params")
    switches = stage_switches(spec)
    assert switches["run-rlhf"] == "false" and switches["run-sft"] == "true"
    assert json.loads(json.dumps(switches)) == switches
