"""Several models from one submission: a pipeline's `variants`, resolved, refused, compiled, put in the form,
submitted and run locally (the shipped qwen-multi: Qwen2.5-7B- and 72B-class variants)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from worse_candidate import assert_the_gate_stopped_it, untrained_overrides

from run.tracking import local_store_uri
from spec import form as spec_form
from spec.document import SpecError
from spec.loading import PIPELINES_DIR, load_pipeline
from spec.pipeline import MAX_PIPELINE_NAME_LENGTH
from spec.variants import variant_specs
from workflows import parameters as params
from workflows.compile import compile_pipeline
from workflows.deadline import workflow_deadline

REPO = Path(__file__).resolve().parent.parent
SHIPPED = (PIPELINES_DIR / "qwen-multi.yaml").read_text(encoding="utf-8")


def _with_variants(tmp_path: Path, block: str) -> Path:
    """qwen-multi with its `variants:` section replaced by `block` (YAML text, lines at column 0)."""
    head, rest = SHIPPED.split("\nvariants:\n", 1)
    tail = rest[rest.index("\nprofiles:\n") :]
    path = tmp_path / "multi.yaml"
    path.write_text(f"{head}\nvariants:\n{block}{tail}", encoding="utf-8")
    return path


def _line(path: Path, text: str) -> int:
    """The 1-based line of `path` that holds `text` (the one an error must name)."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), start=1) if text in line)


def _templates(documents: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in documents["workflowtemplate.yaml"]["spec"]["templates"]}


# --------------------------------------------------------------------------- resolution


def test_each_variant_is_the_pipeline_with_its_overrides_named_after_it() -> None:
    loaded = load_pipeline("qwen-multi")
    specs = variant_specs(loaded.spec)
    assert list(specs) == ["qwen-7b", "qwen-72b"]
    small, large = specs["qwen-7b"], specs["qwen-72b"]
    assert (small.name, large.name) == ("qwen-multi-qwen-7b", "qwen-multi-qwen-72b")
    assert (small.variant, large.variant, small.variants) == ("qwen-7b", "qwen-72b", [])
    assert (small.model.name_or_path, large.model.name_or_path) == ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-72B")
    # Own GPUs: one node of 8 against two; LoRA with ZeRO-3 for the 72B; vLLM over 4 GPUs.
    assert [small.stages.cpt.resources.nodes, large.stages.cpt.resources.nodes] == [1, 2]
    assert large.stages.cpt.resources.gpus_per_node == 8 and large.stages.cpt.method == "lora"
    assert large.stages.sft.distributed.strategy == "deepspeed_zero3"
    assert (small.stages.deploy.serving.gpus, large.stages.deploy.serving.gpus) == (1, 4)
    # Shared: data, tracking server and experiment; own: the registered model (so its own champion).
    assert small.stages.sft.data.uri == large.stages.sft.data.uri == loaded.spec.stages.sft.data.uri
    assert small.tracking.mlflow_experiment == large.tracking.mlflow_experiment == "qwen-multi"
    assert small.stages.deploy.registered_model == "qwen2.5-qwen-7b"
    assert large.stages.deploy.registered_model == "qwen2.5-qwen-72b"


def test_the_local_profile_gives_each_variant_its_own_tiny_stand_in_of_the_family() -> None:
    specs = variant_specs(load_pipeline("qwen-multi", "local").spec)
    small, large = (specs[n].model.from_config for n in ("qwen-7b", "qwen-72b"))
    assert small is not None and large is not None
    assert small.architecture == large.architecture == "qwen2"
    assert large.num_hidden_layers > small.num_hidden_layers
    assert specs["qwen-72b"].stages.sft.training.max_steps == specs["qwen-7b"].stages.sft.training.max_steps == 6


def test_a_variant_without_a_registered_model_of_the_pipeline_promotes_its_own_name(tmp_path: Path) -> None:
    path = _with_variants(tmp_path, "  - name: a\n  - name: b\n")
    path.write_text(path.read_text().replace("    registered_model: qwen2.5", "    registered_model: null"))
    specs = variant_specs(load_pipeline(str(path)).spec)
    assert [s.stages.deploy.registered_model or s.name for s in specs.values()] == ["qwen-multi-a", "qwen-multi-b"]


@pytest.mark.parametrize(
    ("block", "marker", "field", "message"),
    [
        ("  - name: a\n  - name: a\n", "  - name: a", "variants[1].name", "named twice"),
        (
            "  - name: a\n    overrides:\n      cluster: { namespace: other }\n",
            "cluster: { namespace",
            "variants[0].overrides.cluster",
            "shared by all its variants",
        ),
        (
            "  - name: a\n    overrides:\n      schedule: { cron: ['0 1 * * *'] }\n",
            "schedule:",
            "variants[0].overrides.schedule",
            "shared by all its variants",
        ),
        (
            "  - name: a\n    overrides:\n      tracking: { mlflow_experiment: mine }\n",
            "mlflow_experiment: mine",
            "variants[0].overrides.tracking.mlflow_experiment",
            "one experiment",
        ),
        (
            "  - name: a\n    overrides:\n      stages:\n        sft:\n          trainig: { max_steps: 3 }\n",
            "trainig:",
            "variants[0].overrides.stages.sft.trainig",
            "unknown field",
        ),
        (
            "  - name: a\n    overrides:\n      stages:\n        sft:\n          training: { learning_rate: -1 }\n",
            "learning_rate: -1",
            "variants[0].overrides.stages.sft.training.learning_rate",
            "greater than 0",
        ),
        ("  - name: sft\n", "name: sft", "variants[0].name", "named after the stage"),
        ("  - name: Big\n", "name: Big", "variants[0].name", "DNS-1123 label"),
        ("  - name: switches\n", "name: switches", "variants[0].name", "names a step of the workflow"),
        (f"  - name: {'x' * 20}\n", "name: xxx", "variants[0].name", f"over the {MAX_PIPELINE_NAME_LENGTH}"),
    ],
    ids=[
        "name-clash",
        "cluster",
        "schedule",
        "tracking-experiment",
        "unknown-field",
        "bad-value",
        "stage-name",
        "not-dns",
        "reserved",
        "too-long",
    ],
)
def test_bad_variants_are_refused_at_their_line(
    tmp_path: Path, block: str, marker: str, field: str, message: str
) -> None:
    path = _with_variants(tmp_path, block)
    with pytest.raises(SpecError) as caught:
        load_pipeline(str(path))
    error = str(caught.value)
    line = max(n for n, text in enumerate(path.read_text().splitlines(), start=1) if marker in text)
    assert f"{path}:{line}: {field}: " in error, error
    assert message in error, error


def test_a_variant_profiles_bad_field_is_named_at_the_profiles_line(tmp_path: Path) -> None:
    block = "  - name: a\n    profiles:\n      local:\n        model: { from_config: { hidden_sise: 8 } }\n"
    path = _with_variants(tmp_path, block)
    load_pipeline(str(path))  # the profile is not applied: nothing to refuse
    with pytest.raises(SpecError) as caught:
        load_pipeline(str(path), "local")
    line = _line(path, "hidden_sise")
    assert f"{path}:{line}: variants[0].overrides.model.from_config.hidden_sise: unknown field" in str(caught.value)


def test_two_variants_promoting_one_registered_model_are_refused(tmp_path: Path) -> None:
    block = (
        "  - name: a\n    overrides: { stages: { deploy: { registered_model: same } } }\n"
        "  - name: b\n    overrides: { stages: { deploy: { registered_model: same } } }\n"
    )
    with pytest.raises(SpecError, match=r"variants\[1\]: variants a and b would both promote the registered model"):
        load_pipeline(str(_with_variants(tmp_path, block)))


def test_a_search_is_not_combined_with_variants(tmp_path: Path) -> None:
    block = (
        "  - name: a\n    overrides:\n      stages:\n        sft:\n          hpo:\n"
        "            objective: { metric: train_loss_last }\n"
        "            parameters: [{ path: training.learning_rate, type: log_uniform, min: 1.0e-6, max: 1.0e-4 }]\n"
    )
    path = _with_variants(tmp_path, block)
    with pytest.raises(SpecError) as caught:
        load_pipeline(str(path))
    assert f"{path}:{_line(path, 'hpo:')}: variants[0].overrides.stages.sft.hpo: " in str(caught.value)


# --------------------------------------------------------------------------- compile


def test_one_template_runs_each_variants_chain_in_parallel() -> None:
    spec = load_pipeline("qwen-multi").spec
    documents = compile_pipeline(spec).documents()
    template = documents["workflowtemplate.yaml"]
    assert template["metadata"]["name"] == "qwen-multi"
    templates = _templates(documents)
    entry = templates["pipeline"]
    assert entry["parallelism"] == 2
    assert entry["dag"]["tasks"] == [
        {"name": "switches", "template": "switches"},
        *(
            {
                "name": v,
                "template": v,
                "depends": "switches",
                "when": f"{{{{tasks.switches.outputs.parameters.run-{v}}}}} == true",
            }
            for v in ("qwen-7b", "qwen-72b")
        ),
    ]
    switches = templates["switches"]["container"]
    assert switches["command"][:3] == ["python", "-m", "workflows.switches"]
    assert switches["command"][-2:] == ["qwen-7b", "qwen-72b"]
    for variant in ("qwen-7b", "qwen-72b"):
        chain = templates[variant]["dag"]["tasks"]
        assert [t["name"] for t in chain] == [
            "prepare",
            "cpt",
            "sft",
            "rlhf",
            "evaluate",
            "deploy",
            "serve",
            "retention",
        ]
        assert all(t["template"] == f"{variant}-{t['name']}" for t in chain)
        run = f"/mnt/checkpoints/runs/{{{{workflow.name}}}}-{variant}"
        assert templates[f"{variant}-prepare"]["container"]["command"][5] == run
        assert templates[f"{variant}-evaluate"]["container"]["command"][5] == run
        job = yaml.safe_load(templates[f"{variant}-sft-create"]["resource"]["manifest"])
        assert job["metadata"]["generateName"] == f"{{{{workflow.name}}}}-{variant}-sft-"
        assert job["metadata"]["labels"]["workflows.argoproj.io/workflow"] == "{{workflow.name}}"
        assert job["metadata"]["labels"]["posttrain.dev/pipeline"] == f"qwen-multi-{variant}"
        command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
        assert command[-1] == run
        reap = templates[f"{variant}-sft-cleanup"]["container"]["command"]
        assert reap[-3:] == ["sft", "--pipeline", f"qwen-multi-{variant}"]
        retention = templates[f"{variant}-retention"]["container"]["command"]
        assert retention[retention.index("--pipeline") + 1] == f"qwen-multi-{variant}"
        assert retention[-2:] == ["--current", f"{{{{workflow.name}}}}-{variant}"]
        mutex = templates[f"{variant}-serve"]["synchronization"]["mutexes"][0]["name"]
        assert mutex == f"posttrain-serve-qwen-multi-{variant}"  # its own InferenceService
    workers = yaml.safe_load(templates["qwen-72b-cpt-create"]["resource"]["manifest"])["spec"]["pytorchReplicaSpecs"]
    assert workers["Worker"]["replicas"] == 1  # two nodes
    assert (
        "Worker"
        not in yaml.safe_load(templates["qwen-7b-cpt-create"]["resource"]["manifest"])["spec"]["pytorchReplicaSpecs"]
    )
    # One exit handler for the workflow: it deletes every variant's unfinished jobs by the workflow label.
    assert "--stage" not in templates["cleanup"]["container"]["command"]


def test_each_prepare_embeds_its_variants_spec() -> None:
    spec = load_pipeline("qwen-multi").spec
    templates = _templates(compile_pipeline(spec).documents())
    for variant, vspec in variant_specs(spec).items():
        artifacts = {a["name"]: a["raw"]["data"] for a in templates[f"{variant}-prepare"]["inputs"]["artifacts"]}
        embedded = json.loads(base64.b64decode(artifacts["pipeline-spec"]))
        assert embedded == params.embedded_document(vspec)
        assert embedded["name"] == f"qwen-multi-{variant}" and "variants" in embedded and not embedded["variants"]


def test_the_deadline_allows_for_the_longest_chain_or_all_in_turn() -> None:
    spec = load_pipeline("qwen-multi").spec
    chains = [workflow_deadline(v) for v in variant_specs(spec).values()]
    switches = 3 * 300 + 10 + 20  # three attempts of 5 minutes, and the waits between them
    assert workflow_deadline(spec) == switches + max(chains)
    spec.workflow.parallelism = 1  # fewer slots than chains: Argo may interleave them, only the sum bounds that
    assert workflow_deadline(spec) == switches + sum(chains)


# --------------------------------------------------------------------------- the form


def test_the_form_switches_variants_and_splits_what_they_disagree_on() -> None:
    spec = load_pipeline("qwen-multi").spec
    form = {p.name: p for p in params.ui_parameters(spec)}
    assert list(form)[:4] == ["run-qwen-7b", "run-qwen-72b", "qwen-7b-base-model", "qwen-72b-base-model"]
    assert form["qwen-72b-base-model"].default == "Qwen/Qwen2.5-72B"
    assert "base-model" not in form  # the variants disagree on it
    assert form["sft-data"].default == spec.stages.sft.data.uri and form["overrides"].default == ""
    assert form["run-qwen-72b"].enum == ("true", "false")


def test_a_variants_prepare_resolves_its_own_form_values(tmp_path: Path) -> None:
    """What prepare does in the pod: Argo writes each input artifact as a file (the form's values substituted),
    and the variant's spec comes out with its own base model and the shared overrides."""
    spec = load_pipeline("qwen-multi").spec
    values = {p.name: p.default for p in params.ui_parameters(spec)}
    values.update({"qwen-72b-base-model": "/mnt/datasets/models/qwen2.5-72b", "overrides": "data_version=2026-12"})
    prepare = _templates(compile_pipeline(spec).documents())["qwen-72b-prepare"]
    params_dir = tmp_path / "params"
    params_dir.mkdir()
    for artifact in prepare["inputs"]["artifacts"]:
        data = artifact["raw"]["data"]
        if data.startswith("{{workflow.parameters."):
            data = values[data.removeprefix("{{workflow.parameters.").removesuffix("}}")]
        (params_dir / Path(artifact["path"]).name).write_text(data, encoding="utf-8")
    resolved = spec_form.resolve_params_dir(params_dir)
    assert resolved.name == "qwen-multi-qwen-72b" and resolved.variant == "qwen-72b"
    assert resolved.model.name_or_path == "/mnt/datasets/models/qwen2.5-72b"
    assert resolved.data_version == "2026-12" and resolved.stages.cpt.resources.nodes == 2


# --------------------------------------------------------------------------- submit and --local


def _submit(*argv: str, cwd: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE")}
    command = [sys.executable, "-m", "workflows.submit", *argv]
    return subprocess.run(command, env=env, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def test_dry_run_of_one_variant_switches_the_others_off() -> None:
    done = _submit("qwen-multi", "--dry-run", "--variant", "qwen-72b")
    assert done.returncode == 0, done.stderr
    arguments = {p["name"]: p["value"] for p in yaml.safe_load(done.stdout)["spec"]["arguments"]["parameters"]}
    assert (arguments["run-qwen-7b"], arguments["run-qwen-72b"]) == ("false", "true")


def test_an_unknown_variant_and_a_shared_run_dir_are_usage_errors(tmp_path: Path) -> None:
    unknown = _submit("qwen-multi", "--dry-run", "--variant", "qwen-8b")
    assert unknown.returncode == 2 and "no variant 'qwen-8b' (variants: qwen-7b, qwen-72b)" in unknown.stderr
    shared = _submit("qwen-multi", "--local", "--run-dir", str(tmp_path / "run"))
    assert shared.returncode == 2 and "--run-dir holds one run: pick one variant" in shared.stderr
    assert not (tmp_path / "run").exists()
    plain = _submit("korean-llm", "--dry-run", "--variant", "a")
    assert plain.returncode == 2 and "has no variants" in plain.stderr


@pytest.mark.slow
def test_local_runs_both_variants_one_after_the_other(tmp_path: Path, real_vllm: Path) -> None:
    """The shipped pipeline's --local: each variant's tiny Qwen2 trains CPT → SFT → DPO, is evaluated,
    registered as its own model and served by vLLM, each in its own run directory, with a summary of both."""
    from mlflow.tracking import MlflowClient

    done = _submit("qwen-multi", "--local", cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    runs = sorted(r for r in (tmp_path / "runs").iterdir() if (r / "spec.json").is_file())
    assert [r.name.rsplit("-", 2)[0] for r in runs] == ["qwen-multi-qwen-72b", "qwen-multi-qwen-7b"]
    for run in runs:
        spec = json.loads((run / "spec.json").read_text())
        for stage in ("prepare", "cpt", "sft", "rlhf", "evaluate", "deploy"):
            record = run / stage / "stage.json"
            assert record.is_file() and json.loads(record.read_text())["status"] == "succeeded", done.stdout[-3000:]
        config = json.loads((run / "deploy" / "model" / "config.json").read_text())  # the merged, served model
        assert config["architectures"] == ["Qwen2ForCausalLM"]
        assert config["num_hidden_layers"] == spec["model"]["from_config"]["num_hidden_layers"]
        deploy = json.loads((run / "deploy" / "stage.json").read_text())
        assert deploy["extra"]["registered_model"] == f"qwen2.5-{spec['variant']}", deploy["extra"]
        served = deploy["extra"]["served"]
        assert served["engine_version"] == "0.32.0" and all(a["answer"].strip() for a in served["answers"])
        # One local store for both variants (runs/mlflow.db).
        assert local_store_uri(run) == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    # One experiment, a parent run per variant, tagged with it.
    tracking = MlflowClient(tracking_uri=local_store_uri(runs[0]))
    experiment = tracking.get_experiment_by_name("qwen-multi")
    parents = tracking.search_runs([experiment.experiment_id], "tags.`posttrain.kind` = 'pipeline'")
    assert sorted(p.data.tags["posttrain.variant"] for p in parents) == ["qwen-72b", "qwen-7b"]
    summary = done.stdout[done.stdout.rindex("\nvariants\n") :]  # the plain summary (no terminal here)
    assert "qwen-7b" in summary and "qwen-72b" in summary and summary.count("done") == 2

    # Each variant's gate stops a candidate that learned nothing (one step a stage at its learning rate / 10,000)
    # against the champion that variant's run promoted: --fail-on-gate exits 3 and nothing is deployed.
    for name in ("qwen-7b", "qwen-72b"):
        first = next(run for run in runs if run.name.startswith(f"qwen-multi-{name}-"))
        untrained = untrained_overrides(json.loads((first / "spec.json").read_text()))
        worse = tmp_path / "runs" / f"worse-{name}"
        variant = ("--variant", name, "--run-dir", str(worse), "--fail-on-gate")
        done = _submit("qwen-multi", "--local", *variant, *untrained, cwd=tmp_path, timeout=900)
        assert done.returncode == 3, done.stdout[-4000:] + done.stderr[-4000:]
        assert_the_gate_stopped_it(worse)


def test_the_switches_step_checks_each_value_and_outputs_it(tmp_path: Path) -> None:
    """The form's run-<variant> values reach the DAG's conditions only through this step's outputs."""
    from workflows.switches import main

    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "run-qwen-7b").write_text("true")
    (tmp_path / "params" / "run-qwen-72b").write_text("false\n")
    assert (
        main(["--params-dir", str(tmp_path / "params"), "--outputs-dir", str(tmp_path / "out"), "qwen-7b", "qwen-72b"])
        == 0
    )
    assert (tmp_path / "out" / "run-qwen-7b").read_text() == "true"
    assert (tmp_path / "out" / "run-qwen-72b").read_text() == "false"
    (tmp_path / "params" / "run-qwen-72b").write_text("true || true")
    outputs = tmp_path / "refused"
    assert main(["--params-dir", str(tmp_path / "params"), "--outputs-dir", str(outputs), "qwen-7b", "qwen-72b"]) == 2
    assert not outputs.exists()
