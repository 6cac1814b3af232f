"""Ecosystem conventions: the `posttrain` command, --help, the pipeline JSON Schema, "did you mean" on unknown
fields, training.extra_args and the user's own DeepSpeed / accelerate configs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from spec.document import SpecError, load_yaml
from spec.loading import known_pipelines, load_pipeline
from spec.reference import render_json_schema

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "docs" / "pipeline.schema.json"
SFT = """\
name: my-sft
model: {name_or_path: Qwen/Qwen3-0.6B}
stages:
  sft:
    method: lora
    data: {uri: /data/train.jsonl, format: messages}
    training:
      learning_rate: 1.0e-4
"""


def _posttrain(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "posttrain"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "workflows.cli"]
    proc = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_posttrain_help_lists_commands_pipelines_environment_and_exit_codes() -> None:
    proc = _posttrain("--help")
    assert proc.returncode == 0
    for text in ("submit", "register", "runs", "preflight", "local", "import", "ARGO_SERVER", "ARGO_TOKEN", "130/143"):
        assert text in proc.stdout
    for name in known_pipelines():
        assert name in proc.stdout


def test_posttrain_subcommand_delegates(tmp_path: Path) -> None:
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(SFT, encoding="utf-8")
    proc = _posttrain("submit", str(pipeline), "--render", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "workflowtemplate.yaml").is_file()
    bad = _posttrain("submit", str(pipeline), "--set", "stages.sft.training.learnig_rate=1e-4", "--dry-run")
    assert bad.returncode == 2
    assert "did you mean 'learning_rate'?" in bad.stderr
    assert _posttrain("nonsense").returncode == 2


def test_posttrain_version_names_the_package_version_and_commit() -> None:
    from run.version import git_sha, package_version

    assert package_version() == metadata.version("posttrain") != "unknown"
    sha = git_sha()
    expected = f"posttrain {package_version()}" + (f" (commit {sha[:12]})" if sha else "")
    for flag in ("--version", "-V"):
        proc = _posttrain(flag)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, expected + "\n", "")
    for module in (
        "workflows.submit",
        "workflows.register",
        "workflows.runs",
        "workflows.preflight",
        "workflows.import",
    ):
        proc = subprocess.run(
            [sys.executable, "-m", module, "--version"], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert (proc.returncode, proc.stdout) == (0, expected + "\n"), module


def test_posttrain_version_commit_comes_from_the_image_variable() -> None:
    env = {**os.environ, "POSTTRAIN_GIT_SHA": "0123456789abcdef0123"}
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.cli", "-V"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.endswith(" (commit 0123456789ab)\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sumbit", "korean-llm"], "error: unknown command 'sumbit'; did you mean 'submit'?"),
        (["regster"], "error: unknown command 'regster'; did you mean 'register'?"),
        (["runs", "lst"], "error: unknown command 'lst'; did you mean 'list'?"),
        (["runs", "wacth", "korean-llm-x7k2p"], "error: unknown command 'wacth'; did you mean 'watch'?"),
        (["xyzzy"], "error: unknown command 'xyzzy'; commands: submit, local, register, runs, preflight, import"),
    ],
)
def test_unknown_command_says_which_was_meant(args: list[str], message: str) -> None:
    proc = _posttrain(*args)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", message + "\n")


def test_unknown_pipeline_says_which_was_meant() -> None:
    proc = _posttrain("submit", "korean-lm", "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown pipeline 'korean-lm'; did you mean 'korean-llm'? known pipelines: ")
    far = _posttrain("submit", "zzz", "--dry-run")
    assert far.returncode == 2 and "did you mean" not in far.stderr and "known pipelines: korean-llm" in far.stderr


def test_submit_help_has_examples_and_exit_codes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.submit", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    assert "examples:" in proc.stdout and "exit codes:" in proc.stdout and "korean-llm" in proc.stdout


# --------------------------------------------------------------------------- JSON Schema


def test_json_schema_is_current() -> None:
    assert SCHEMA.read_text(encoding="utf-8") == render_json_schema(), (
        "regenerate: python -m spec.reference --json-schema > docs/pipeline.schema.json"
    )


@pytest.mark.parametrize("name", known_pipelines())
def test_shipped_pipelines_validate_against_the_schema(name: str) -> None:
    path = REPO / "workflows" / "pipelines" / f"{name}.yaml"
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# yaml-language-server: $schema=../../docs/pipeline.schema.json")
    jsonschema.validate(load_yaml(text, str(path)), json.loads(SCHEMA.read_text(encoding="utf-8")))


def test_schema_refuses_a_typo() -> None:
    doc = load_yaml(SFT.replace("learning_rate", "learnig_rate"), "p.yaml")
    with pytest.raises(jsonschema.ValidationError, match="learnig_rate"):
        jsonschema.validate(doc, json.loads(SCHEMA.read_text(encoding="utf-8")))


# --------------------------------------------------------------------------- did you mean


def test_unknown_field_in_a_file_suggests_the_closest(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(SFT.replace("    method: lora", "    metod: lora"), encoding="utf-8")
    with pytest.raises(SpecError) as exc:
        load_pipeline(str(path))
    assert f"{path}:5: stages.sft.metod: unknown field; did you mean 'method'?" in str(exc.value)


def test_unknown_field_far_from_any_gets_no_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(SFT, encoding="utf-8")
    with pytest.raises(SpecError) as exc:
        load_pipeline(str(path), overrides=["stages.sft.lora.zzzz=1"])
    assert "did you mean" not in str(exc.value) and "unknown field" in str(exc.value)


# --------------------------------------------------------------------------- training.extra_args


def test_extra_args_refuses_a_setting_the_spec_owns(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(SFT, encoding="utf-8")
    with pytest.raises(SpecError, match=r"extra_args.learning_rate is set by the spec: use training.learning_rate"):
        load_pipeline(str(path), overrides=["stages.sft.training.extra_args={learning_rate: 0.1}"])
    with pytest.raises(SpecError, match="extra_args"):
        load_pipeline(str(path), overrides=["stages.sft.training.extra_args={optim: [a, b]}"])  # scalars only


def test_extra_args_reach_the_trainer_config_and_unknown_names_are_refused(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from run.run_dir import StageRefused
    from stages.training import build_config

    path = tmp_path / "p.yaml"
    path.write_text(SFT, encoding="utf-8")
    spec = load_pipeline(str(path), overrides=["stages.sft.training.extra_args={adam_beta2: 0.95}"]).spec
    ctx = SimpleNamespace(stage="sft", section=spec.stages.sft)
    args = build_config(ctx, TrainingArguments, {"output_dir": str(tmp_path / "out"), "use_cpu": True})
    assert args.adam_beta2 == 0.95

    spec = load_pipeline(str(path), overrides=["stages.sft.training.extra_args={adam_beta3: 0.9}"]).spec
    ctx = SimpleNamespace(stage="sft", section=spec.stages.sft)
    with pytest.raises(StageRefused, match=r"stages.sft.training.extra_args.adam_beta3: .*did you mean 'adam_beta2'"):
        build_config(ctx, TrainingArguments, {"output_dir": str(tmp_path / "out"), "use_cpu": True})


# --------------------------------------------------------------------------- DeepSpeed / accelerate configs

DEEPSPEED = {"zero_optimization": {"stage": 3, "overlap_comm": False}, "bf16": {"enabled": "auto"}}


def _ds_pipeline(tmp_path: Path, config: str, strategy: str = "deepspeed_zero3") -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(SFT + f"    distributed: {{strategy: {strategy}, deepspeed_config: {config}}}\n", encoding="utf-8")
    return path


def test_deepspeed_config_file_is_embedded_and_used(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds.json").write_text(json.dumps(DEEPSPEED), encoding="utf-8")
    spec = load_pipeline(str(_ds_pipeline(tmp_path, "configs/ds.json"))).spec
    assert spec.stages.sft.distributed.deepspeed_config == DEEPSPEED

    from stages import distributed

    section = spec.stages.sft
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "check_strategy", lambda *_: None)  # no GPU here
        deepspeed = distributed.strategy_arguments("sft", section, None)["deepspeed"]
    # the user's config, and ZeRO-3 gathers the weights on save (DeepSpeed's default would leave model/ without them)
    assert deepspeed == {
        **DEEPSPEED,
        "zero_optimization": {**DEEPSPEED["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True},
    }


def test_deepspeed_config_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 3,}}', encoding="utf-8")
    with pytest.raises(SpecError, match=r"p.yaml:9: stages.sft.distributed.deepspeed_config: .*bad.json:1: not valid"):
        load_pipeline(str(_ds_pipeline(tmp_path, "bad.json")))
    (tmp_path / "twice.json").write_text('{"zero_optimization": {"stage": 2, "stage": 3}}', encoding="utf-8")
    with pytest.raises(SpecError, match=r"twice.json: key 'stage' is given twice in one object"):
        load_pipeline(str(_ds_pipeline(tmp_path, "twice.json")))
    with pytest.raises(SpecError, match=r"missing.json does not exist"):
        load_pipeline(str(_ds_pipeline(tmp_path, "missing.json")))
    (tmp_path / "ds.json").write_text(json.dumps(DEEPSPEED), encoding="utf-8")
    with pytest.raises(SpecError, match=r"zero_optimization.stage is 3 but strategy is 'deepspeed_zero2'"):
        load_pipeline(str(_ds_pipeline(tmp_path, "ds.json", "deepspeed_zero2")))


def test_accelerate_config_is_applied(tmp_path: Path) -> None:
    (tmp_path / "accelerate.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
        "deepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: cpu\n  gradient_clipping: 0.5\n",
        encoding="utf-8",
    )
    path = tmp_path / "p.yaml"
    path.write_text(
        SFT + "    distributed: {strategy: deepspeed_zero2, accelerate_config: accelerate.yaml}\n", encoding="utf-8"
    )
    spec = load_pipeline(str(path)).spec
    betas = load_pipeline(str(path), overrides=["stages.sft.training.extra_args={adam_beta2: 0.95}"]).spec
    from stages import distributed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "check_strategy", lambda *_: None)
        args = distributed.strategy_arguments("sft", spec.stages.sft, None)
        own_optimizer = distributed.strategy_arguments("sft", betas.stages.sft, None)["deepspeed"]
    deepspeed = args["deepspeed"]
    assert args["max_grad_norm"] == 0.5  # transformers refuses a gradient_clipping that differs from it
    assert deepspeed["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert deepspeed["gradient_clipping"] == 0.5
    # Offloaded: DeepSpeed's CPU Adam replaces the Trainer's optimizer, unless extra_args configure that optimizer
    # (accelerate's swap would drop their betas): then it runs on the CPU as configured.
    assert "zero_force_ds_cpu_optimizer" not in deepspeed
    assert own_optimizer["zero_force_ds_cpu_optimizer"] is False
    with pytest.raises(SpecError, match="distributed_type DEEPSPEED needs strategy 'deepspeed_zero2', not 'fsdp'"):
        load_pipeline(str(path), overrides=["stages.sft.distributed.strategy=fsdp"])


def test_accelerate_config_defaults_still_save_the_whole_model(tmp_path: Path) -> None:
    """`accelerate config`'s defaults (FSDP2: SHARDED_STATE_DICT; ZeRO-3: zero3_save_16bit_model false) would leave
    the stage's model folder without weights: the stage keeps full state dicts and gathers ZeRO-3's weights.
    Its fsdp_offload_params reaches the Trainer as cpu_offload."""
    (tmp_path / "fsdp.yaml").write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
        "  fsdp_offload_params: true\n  fsdp_reshard_after_forward: false\n",
        encoding="utf-8",
    )
    (tmp_path / "zero3.yaml").write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  zero3_save_16bit_model: false\n",
        encoding="utf-8",
    )
    path = tmp_path / "p.yaml"
    path.write_text(SFT + "    distributed: {strategy: fsdp, accelerate_config: fsdp.yaml}\n", encoding="utf-8")
    fsdp = load_pipeline(str(path)).spec.stages.sft
    zero3 = load_pipeline(
        str(path),
        overrides=[
            "stages.sft.distributed.strategy=deepspeed_zero3",
            f"stages.sft.distributed.accelerate_config={tmp_path / 'zero3.yaml'}",
        ],
    ).spec.stages.sft
    from stages import distributed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "check_strategy", lambda *_: None)
        fsdp_args = distributed.strategy_arguments(
            "sft", fsdp, SimpleNamespace(_no_split_modules=["Qwen3DecoderLayer"])
        )
        deepspeed = distributed.strategy_arguments("sft", zero3, None)["deepspeed"]
    assert fsdp_args["fsdp_config"]["state_dict_type"] == "FULL_STATE_DICT"
    assert fsdp_args["fsdp_config"]["cpu_offload"] is True and "offload_params" not in fsdp_args["fsdp_config"]
    assert fsdp_args["fsdp_config"]["reshard_after_forward"] is False
    assert deepspeed["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_import_subcommand_is_wired(tmp_path: Path) -> None:
    assert shutil.which("true")  # the subcommand's own tests are in test_import_recipes.py
    proc = _posttrain("import", "--help")
    assert proc.returncode == 0 and "llamafactory" in proc.stdout
