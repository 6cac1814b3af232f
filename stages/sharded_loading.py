"""Loading a model once per job under FSDP2 and DeepSpeed ZeRO-3, not once per process.

FSDP2: rank 0 reads the weights, every other rank builds the model on the meta device.

Under FSDP2 each rank ends up holding 1/N of the weights, but transformers' `from_pretrained` (5.23) reads the whole
checkpoint in every process first: N copies of the model in a node's memory before the first shard exists
(4 × 16 GB for an 8B model on 4 GPUs; 8 × 144 GB for a 72B one on a node of 8). Here only the job's rank 0 loads,
onto its own GPU when the model and its float32 upcast fit there (`first_rank_placement`), else into host memory;
every other rank builds the same model with its parameters on the meta device and its buffers real (the rotary
frequencies are computed, not stored, so rank 0 has nothing to send for them). accelerate's FSDP2 preparation then
shards rank 0's weights out to the others by broadcast (`cpu_ram_efficient_loading` in the Trainer's fsdp_config,
`stages.distributed.fsdp_settings`): accelerate's own path, not one of ours.

ZeRO-3: transformers creates the model partitioned (DeepSpeed's `zero.Init`: each rank allocates its 1/N of every
parameter as the module is built) and loads the checkpoint into the partitions, module by module, from rank 0's
copy (the other ranks read only the keys and shapes), when it sees a live DeepSpeed config. The Trainer makes that
config, but only after the stage has loaded its model, so `stages.distributed.zero3_loading` makes it first, from
the stage's own DeepSpeed config (`stages.distributed.zero_init_config`). A partitioned parameter holds an empty
tensor; its full size is in `ds_numel` and `ds_shape` (`full_numel`, `full_shape`).

QLoRA is left out: its 4-bit weights are quantized as each rank loads them onto its GPU (accelerate keeps
bitsandbytes parameters off the meta device too; the spec refuses QLoRA under ZeRO-3). DDP replicates the whole
model on every rank anyway.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from spec.training import TrainingStage

UPCAST_BYTES_PER_PARAMETER = 6
"""GPU memory rank 0 needs per parameter to load there: the 16-bit weights, then accelerate's float32 master copy
(FSDP2 trains float32 masters under bf16 autocast) before the 16-bit ones are freed."""

GPU_HEADROOM = 0.85
"""The share of rank 0's free GPU memory the load may take (the CUDA context, the caching allocator's slack)."""


def world_size() -> int:
    """Processes in the job (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def loads_once(section: TrainingStage) -> bool:
    """Whether this stage's model loads on rank 0 only: FSDP2 over more than one process (pipeline stages included:
    rank 0 broadcasts each rank its stage, `stages.pipeline_parallel.receive_stage`), not QLoRA."""
    return section.distributed.strategy == "fsdp" and world_size() > 1 and section.method != "qlora"


def partitions_at_load(section: TrainingStage) -> bool:
    """Whether this stage's model is created partitioned by DeepSpeed ZeRO-3 as it loads
    (`stages.distributed.zero3_loading`): ZeRO-3 over more than one process, not QLoRA."""
    return section.distributed.strategy == "deepspeed_zero3" and world_size() > 1 and section.method != "qlora"


def full_numel(param: Any) -> int:
    """A parameter's element count, the whole of it when ZeRO-3 partitioned it (its own tensor is empty)."""
    return int(getattr(param, "ds_numel", param.numel()))


def full_shape(param: Any) -> tuple[int, ...]:
    """A parameter's shape, the whole of it when ZeRO-3 partitioned it."""
    return tuple(getattr(param, "ds_shape", param.shape))


def skeleton(build: Callable[[], Any]) -> Any:
    """The model `build` makes, with its parameters on the meta device (no memory) and its buffers real. Its tied
    weights are tied again afterwards: accelerate's `init_empty_weights` makes a new meta parameter whenever one is
    assigned, the LM head's tie to the input embeddings included."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    model.tie_weights()
    tell_apart(model)
    return model


def parameter_count(model: Any) -> int:
    """Parameters of a model, built for real or as a skeleton."""
    return sum(p.numel() for p in model.parameters())


def first_rank_placement(parameters: int) -> dict[str, Any]:
    """Where rank 0 loads a model of `parameters` parameters: `device_map` onto its own GPU when the weights and their
    float32 upcast fit in GPU_HEADROOM of its free memory (the node's host memory then holds no copy at all), else
    nothing: host memory, one copy for the whole job."""
    if not torch.cuda.is_available():
        return {}
    device = int(os.environ.get("LOCAL_RANK", "0"))
    free, _total = torch.cuda.mem_get_info(device)
    if parameters * UPCAST_BYTES_PER_PARAMETER > GPU_HEADROOM * free:
        return {}
    return {"device_map": {"": device}}


def on_meta(model: Any) -> bool:
    """Whether `model`'s parameters are a skeleton's (on the meta device)."""
    return any(p.is_meta for p in model.parameters())


def tell_apart(model: Any) -> None:
    """Give each of a skeleton's parameters its own `data_ptr()`. The Trainer creates the optimizer before
    accelerate shards the model under FSDP2, and accelerate then swaps the optimizer's parameters for the sharded
    ones by matching `data_ptr()`; on the meta device every parameter's is 0, so every one of them would be swapped
    for the same sharded parameter: that rank's optimizer would step one tensor over and over, silently (measured
    on 2 × H100: the checkpoint's optimizer state then fails to save with a KeyError). The id of the parameter
    object is as unique as an address, for as long as the skeleton lives."""
    for param in model.parameters():
        if param.is_meta:
            param.data_ptr = lambda address=id(param): address
