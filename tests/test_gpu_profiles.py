"""Every shipped pipeline has a `gpu` profile (`--local --profile gpu`): its base model's architecture with the real
model's layers (widths, heads, experts as the published config.json has them; the depth may be cut to fit a machine
of a few GPUs), offline data, a short plan, and each training stage under the strategy the pipeline trains with on
the cluster, launched as its pod launches it. The profile that runs on GPUs is checked here on CPU: what it builds,
not how fast (docs/performance.md has the GPU runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spec.fields import TRAINING_STAGES
from spec.loading import known_pipelines, load_pipeline
from spec.pipeline import PipelineSpec
from spec.sizing import model_parameters
from spec.variants import variant_specs
from workflows.launch import LOCAL_TORCHRUN, local_launch

# The layers of the base models the shipped pipelines name, from each model's published config.json.
REAL_SHAPES: dict[str, dict[str, int | str]] = {
    "qwen3-8b": dict(architecture="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(architecture="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "llama-3-8b": dict(architecture="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen2.5-7b": dict(architecture="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128),
    "qwen2.5-72b": dict(architecture="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128),
    "qwen3-30b-a3b": dict(architecture="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768),
}  # fmt: skip
BASES = {
    "Qwen/Qwen3-8B-Base": "qwen3-8b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "Qwen/Qwen2.5-72B": "qwen2.5-72b",
    "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b",
}
GPUS, GPU_BYTES = 4, 80 * 10**9
"""The largest machine the profiles are sized for (users' nodes have 8), and its GPUs' memory."""


def _runs(pipeline: str, profile: str | None) -> dict[str, PipelineSpec]:
    """Variant (or the pipeline's name) → its resolved spec."""
    spec = load_pipeline(pipeline, profile).spec
    return variant_specs(spec) or {pipeline: spec}


def _training_state_bytes(spec: PipelineSpec, stage: str) -> float:
    """A training stage's weights, gradients and Adam state on each of GPUS GPUs: full training keeps float32
    masters with their gradients and two moments (16 bytes a weight), LoRA the frozen bf16 weights (2 bytes);
    FSDP and ZeRO-3 divide them over the GPUs; full DPO holds a frozen reference model besides."""
    section = spec.stage(stage)
    weights = model_parameters(spec)
    per_weight = 16 if section.method == "full" else 2
    if stage == "rlhf" and section.method == "full":
        per_weight += 2
    sharded = section.distributed.strategy in ("fsdp", "deepspeed_zero3")
    return weights * per_weight / (GPUS if sharded else 1)


@pytest.mark.parametrize("pipeline", known_pipelines())
def test_the_gpu_profile_builds_the_real_layers(pipeline: str) -> None:
    cluster, gpu = _runs(pipeline, None), _runs(pipeline, "gpu")
    assert cluster.keys() == gpu.keys()
    for run, spec in gpu.items():
        base = BASES.get(cluster[run].model.name_or_path)
        assert base is not None, f"{run}: add {cluster[run].model.name_or_path}'s layers to REAL_SHAPES and BASES"
        config = spec.model.from_config
        assert config is not None and spec.model.name_or_path.endswith("-shape"), run
        shape = REAL_SHAPES[spec.model.name_or_path.removesuffix("-shape")]
        assert shape["architecture"] == REAL_SHAPES[base]["architecture"], f"{run}: not the base model's family"
        built = config.model_dump()
        for field, value in shape.items():
            if field == "num_hidden_layers":
                assert 8 <= built[field] <= value, f"{run}: {built[field]} layers"
            else:
                assert built[field] == value, f"{run}: {field} {built[field]}, the real model's {value}"


@pytest.mark.parametrize("pipeline", known_pipelines())
def test_the_gpu_profile_trains_as_the_cluster_does(pipeline: str, tmp_path: Path) -> None:
    cluster, gpu = _runs(pipeline, None), _runs(pipeline, "gpu")
    for run, spec in gpu.items():
        assert spec.tracking.mlflow_tracking_uri is None, run  # this machine's store
        stages = [s for s in spec.stages.enabled() if s in TRAINING_STAGES]
        assert stages == [s for s in cluster[run].stages.enabled() if s in TRAINING_STAGES]
        for stage in [*stages, "evaluate"]:
            data = spec.stage(stage).data
            assert data is not None and data.uri.startswith("builtin:"), f"{run} {stage}: {data}"
        for stage in stages:
            section, on_cluster = spec.stage(stage), cluster[run].stage(stage)
            assert section.method == on_cluster.method, f"{run} {stage}"
            assert section.distributed.strategy == on_cluster.distributed.strategy, f"{run} {stage}"
            assert section.training.max_steps is not None and section.training.max_steps <= 10, f"{run} {stage}"
            state = _training_state_bytes(spec, stage)
            assert state <= 0.6 * GPU_BYTES, f"{run} {stage}: {state / 1e9:.0f} GB of state on each of {GPUS} GPUs"
            command, env = local_launch(spec, stage, tmp_path, gpus=GPUS)
            assert command[: len(LOCAL_TORCHRUN)] == list(LOCAL_TORCHRUN), command
            assert env["PET_NPROC_PER_NODE"] == str(GPUS)


def test_the_state_estimate_refuses_what_does_not_fit() -> None:
    """The estimate above can fail: Qwen3-30B-A3B at its whole depth, fully fine-tuned, is 120 GB of state on each
    of 4 GPUs (it takes a node of 8 with ZeRO-3, or two)."""
    spec = _runs("qwen3-30b-a3b", "gpu")["qwen3-30b-a3b"]
    deep = spec.model_copy(deep=True)
    assert deep.model.from_config is not None
    deep.model.from_config.num_hidden_layers = 48
    assert _training_state_bytes(deep, "sft") > GPU_BYTES
    assert _training_state_bytes(spec, "sft") <= 0.6 * GPU_BYTES
