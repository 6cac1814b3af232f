"""Pod sizes: the CPU, memory and ephemeral storage each stage's container asks for.

A stage's `resources.cpu`, `resources.memory` and `resources.ephemeral_storage` are used as written; where one is
unset it is derived here from the stage and the size of the model (its weights in `model.dtype`), so no container
the compiler renders runs without requests and limits (a pod without them is the first the kubelet evicts, and one
that merges a 72B model would otherwise be scheduled on any node with room for nothing). The size comes from the
pipeline file's model: a base model changed in the form at submit time keeps the template's sizes.

The parameter count is the model's own for `model.from_config`, else the `<N>B` in a hub name or path
(`Qwen2.5-72B-Instruct`, `Meta-Llama-3-8B`, `Qwen3-30B-A3B`), else DEFAULT_PARAMETERS.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

from spec.fields import TRAINING_STAGES
from spec.model import TinyModelConfig
from spec.pipeline import PipelineSpec
from spec.stage import Resources, StageBase
from spec.training import TrainingStage

GIB = 1024**3

DEFAULT_PARAMETERS = 8 * 10**9
"""The parameter count assumed for a model whose size the name does not tell (a local path named otherwise)."""

BYTES_PER_PARAMETER = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
"""The weights' size per parameter in each `model.dtype` ('auto' loads checkpoints as saved: 16-bit nowadays)."""

CONTROL_CPU, CONTROL_MEMORY = "4", "16Gi"
"""prepare (it parses and tokenizes data, loads no weights) and a stage without a model to hold."""

RUNTIME_OVERHEAD_GIB = {"training": 16, "evaluate": 8, "deploy": 8}
"""Memory beyond the weights: Python, CUDA context, tokenizer, data loaders, NCCL buffers."""

CPU_PER_GPU = {"training": 8, "evaluate": 4, "deploy": 4}
"""CPUs per GPU of the pod (data loader workers, tokenization, NCCL's proxy threads); a pod without GPUs gets 4."""

SCRATCH_GIB = 10
"""Ephemeral storage beyond the staged model (caches in /tmp: Triton, TorchInductor, pip)."""

_SIZE_IN_NAME = re.compile(r"(?<![a-z0-9.])([0-9]+(?:\.[0-9]+)?)b(?![a-z0-9])")
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$")
_FACTORS = {
    None: Decimal(1),
    "m": Decimal("0.001"),
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
}


@dataclass(frozen=True)
class PodSize:
    """What one container asks for: CPU and memory (request = limit), ephemeral storage (request = limit) or
    None."""

    cpu: str
    memory: str
    ephemeral_storage: str | None = None


def quantity(value: str) -> Decimal:
    """A Kubernetes quantity as a number ('2Gi' → 2147483648, '500m' → 0.5)."""
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return Decimal(match[1]) * _FACTORS[match[2]]


def _config_parameters(config: TinyModelConfig) -> int:
    """Parameters of a model built from a config: embeddings (tied or not, counted twice) and the layers."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    attention = hidden * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    experts, _, expert_size = config.moe_sizes() or (1, 1, config.intermediate_size)
    mlp = 3 * hidden * expert_size * experts
    return 2 * config.vocab_size * hidden + layers * (attention + mlp)


def model_parameters(spec: PipelineSpec) -> int:
    """The model's parameter count, as well as the spec can tell before anything is downloaded."""
    if spec.model.from_config is not None:
        return _config_parameters(spec.model.from_config)
    name = spec.model.name_or_path.rstrip("/").rsplit("/", 1)[-1].lower()
    match = _SIZE_IN_NAME.search(name)
    return int(float(match[1]) * 10**9) if match else DEFAULT_PARAMETERS


def weights_bytes(spec: PipelineSpec) -> int:
    """The model's weights in memory in `model.dtype`."""
    return model_parameters(spec) * BYTES_PER_PARAMETER[spec.model.dtype]


def _gib(amount: float) -> str:
    return f"{max(1, math.ceil(amount / GIB))}Gi"


def _role(stage_name: str) -> str:
    if stage_name in ("cpt", "sft", "rlhf"):
        return "training"
    return stage_name if stage_name in ("evaluate", "deploy") else "control"


def derived_size(spec: PipelineSpec, stage_name: str, res: Resources) -> PodSize:
    """The size of a stage's pods when the spec leaves it unset.

    - training (cpt, sft, rlhf): under DDP and DeepSpeed ZeRO-2 each of the pod's processes loads the weights into
      host memory before they go to its GPU, so the weights once per GPU. Under FSDP2 over several processes (not
      QLoRA; with `distributed.pipeline_parallel` too, rank 0 then broadcasting each rank its stage) rank 0 alone
      loads them (stages/sharded_loading.py), onto its GPU where they fit, else into host memory, where the trained
      ones are upcast to float32 (by accelerate, or the stage's float32 masters) before sharding: twice the weights
      for full training, once for LoRA. Under ZeRO-3 over several processes the model is created partitioned (zero.Init)
      and rank 0 alone reads the checkpoint into host memory, from where each module's weights go to the
      partitions: the weights once (rlhf's full DPO and KTO load their reference that way too, one after the
      other; not for full training that merges an upstream stage's adapter, nor for GRPO's full training, whose
      reference is read from a saved copy of the starting weights: those load whole weights in every process).
      With tensor or expert parallelism (`distributed.tensor_parallel`, `expert_parallel`) each rank reads only its
      own shards, onto its GPU: the weights once at most, or once per GPU where an upstream adapter must be merged
      into whole weights first.
      Plus optimizer state offloaded to the host (16 bytes a parameter: fp32 master weights, two Adam moments,
      gradients; shared by the nodes) with `distributed.cpu_offload`.
    - evaluate: the model being measured, once and a half (loading, then the generation cache on a CPU pod).
    - deploy: an adapter merged into its base and the merged model loaded again to register it, about 2.5 times
      the weights; MLflow stages the logged model in /tmp first, so ephemeral storage for one copy of it.
    - prepare and other steps without a model: CONTROL_CPU and CONTROL_MEMORY.

    Memory also covers the memory-backed /dev/shm (`shm_size`), which counts against the container's limit."""
    role = _role(stage_name)
    shm = float(quantity(res.shm_size)) if res.shm_size else 0.0
    if role == "control":
        return PodSize(CONTROL_CPU, _gib(float(quantity(CONTROL_MEMORY)) + shm))
    weights = weights_bytes(spec)
    cpu = str(max(4, CPU_PER_GPU[role] * res.gpus_per_node))
    overhead = RUNTIME_OVERHEAD_GIB[role] * GIB + shm
    if role == "training":
        section = spec.stage(stage_name)
        grpo_full = stage_name == "rlhf" and section.method == "full" and getattr(section, "algorithm", "") == "grpo"
        whole = _merges_an_adapter(spec, stage_name) or grpo_full
        memory = weights * _host_copies(spec.stage(stage_name), res, whole)
        if getattr(getattr(spec.stage(stage_name), "distributed", None), "cpu_offload", False):
            memory += 16 * model_parameters(spec) / res.nodes
        return PodSize(cpu, _gib(memory + overhead))
    if role == "evaluate":
        return PodSize(cpu, _gib(1.5 * weights + overhead))
    return PodSize(cpu, _gib(2.5 * weights + overhead), _gib(weights + SCRATCH_GIB * GIB))


def _merges_an_adapter(spec: PipelineSpec, stage_name: str) -> bool:
    """Whether a training stage trains in full from the adapter the enabled training stage before it leaves."""
    before = [s for s in TRAINING_STAGES[: TRAINING_STAGES.index(stage_name)] if spec.stage(s).enabled]
    if not before or spec.stage(stage_name).method != "full":
        return False
    upstream = spec.stage(before[-1])
    return upstream.method != "full" and not upstream.lora.merge_after


def _host_copies(section: StageBase, res: Resources, whole: bool = False) -> int:
    """How many times a training pod holds the weights in host memory while its processes load them. `whole`: the
    stage needs whole weights in every process even under ZeRO-3 (`stages.modeling.load_starting_model`)."""
    if isinstance(section, TrainingStage) and res.nodes * res.gpus_per_node > 1 and section.method != "qlora":
        if section.distributed.sharded_at_load:  # each rank reads its own shards, unless it must merge first
            return max(1, res.gpus_per_node) if whole else 1
        if section.distributed.strategy == "fsdp":
            return 2 if section.method == "full" else 1
        if section.distributed.strategy == "deepspeed_zero3" and not whole:
            return 1
    return max(1, res.gpus_per_node)


def pod_size(spec: PipelineSpec, stage_name: str, res: Resources | None = None) -> PodSize:
    """A stage's pod size: the spec's `resources.cpu`, `memory` and `ephemeral_storage` where set, the derived
    size (derived_size) where not. `res` defaults to the stage's own resources."""
    res = res if res is not None else spec.stage(stage_name).resources
    derived = derived_size(spec, stage_name, res)
    return PodSize(
        cpu=res.cpu or derived.cpu,
        memory=res.memory or derived.memory,
        ephemeral_storage=res.ephemeral_storage or derived.ephemeral_storage,
    )
