"""Float8 training (`training.fp8`): which of a model's linear layers run their matmuls in float8, through torchao.

torchao's float8 training (the float8 recipe torchtitan uses) swaps each chosen `nn.Linear` for its `Float8Linear`:
the same weight parameter in the same dtype, so the optimizer, FSDP2's sharding, checkpoints and the saved model
see an ordinary linear layer; only the forward and backward matmuls change. Inputs and weights are scaled per
tensor to float8 e4m3 and the output gradients to e5m2 (dynamic scaling, from each tensor's own maximum), and
every product accumulates and returns in the autocast dtype.

Kept out of float8, as every float8 recipe keeps them (torchtitan, accelerate's torchao path):
- the output layer: its logits feed the loss directly, and with a vocabulary of 150k it is where float8's error
  shows first;
- a mixture's router (its choice of experts is discrete; a small error flips it) and its experts, which are
  grouped matmuls over 3-D weights, not linear layers;
- any layer whose sizes are not multiples of 16, which float8 GEMMs require.

Under tensor parallelism a converted layer gets its plan's forward back (`split_again`) and multiplies its DTensor
shard in float8, each scale taken over the whole weight; under pipeline parallelism each stage's layers are converted
as they are in a whole model.

On a GPU the float8 layers are compiled: eager, the scaling is several small kernels per tensor around each GEMM,
and the step ran at 0.56× bf16's. In cpt and sft under strategy ddp or fsdp (`compiles_decoder_layers`) each whole
decoder layer is compiled with its activation checkpointing inside the compiled region (`compile_decoder_layers`,
before FSDP2 shards each layer: torchtitan's order), so Inductor fuses the norms, RoPE, SwiGLU and the scaling around
the matmuls. Under DDP: 1.35× bf16's step at 2 rows of 4096 and 1.46× at 4 (one H100, 12 layers of the 8B shape,
docs/performance.md B8), against 1.17× and 1.21× with each converted layer compiled alone; under FSDP2 (one H100, 8
layers; several GPUs not measured yet) 1.17-1.19×, against 0.92-0.98× alone. Tensor, expert and pipeline
parallelism and rlhf keep each converted layer compiled alone: the model-parallel plans rebuild the layers, and rlhf
generates through its policy (a new shape per token). transformers' own gradient checkpointing and FSDP's call each
layer's uncompiled forward, so where whole layers compile both are off and the layers checkpoint themselves.
torchao's rowwise recipe measured 0.97× bf16's.

A scale per tensor is taken over every token of the batch, so a packed document's float8 rounding depends on the
rows beside it: attention still never crosses documents, but the logits of a document packed with others differ
from its logits alone by more than bf16's rounding (0.30-0.42 against 0.018-0.025 at most, B8's boundary check).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from typing import Any

import torch

from stages.contract import NotSupportedHere

RECIPE = "tensorwise"

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (L40S, RTX 4090), Hopper (H100, H200) and newer

WHOLE_LAYER_STAGES = ("cpt", "sft")  # the stages whose trainer only trains: rlhf's also generates


class _ImportNoise(logging.Filter):
    """Warnings that say nothing about a run. torchao is imported by transformers' Trainer wherever it is
    installed, fp8 or not: it tries its optional C++ kernels (MX formats, CUTLASS) and logs a warning for each that
    does not load for this torch (float8 training uses none of them: its GEMM is torch's `_scaled_mm`), and
    registering its enums makes torch's pytree log a deprecation."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") or "is an Enum subclass and is now natively" in message)


def quiet_torchao_import() -> None:
    """Drop torchao's import-time warnings from the stage's log: call before transformers' Trainer is imported."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(_ImportNoise())


def check_float8(stage: str) -> None:
    """Refuse (one error line) where float8 training cannot run: torchao missing, or a GPU without float8 tensor
    cores. On CPU it runs (torch's CPU float8 GEMM), for --local and the tests."""
    where = f"stages.{stage}.training.fp8"
    if importlib.util.find_spec("torchao") is None:
        raise NotSupportedHere(f"{where}: float8 training needs torchao, which is not installed in this image")
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name()
            raise NotSupportedHere(
                f"{where}: float8 matmuls need a GPU of compute capability 8.9 or newer (H100, H200, L40S); this "
                f"{name} is {capability[0]}.{capability[1]}: set fp8: false"
            )


def float8_layers(model: Any) -> list[str]:
    """The names of the linear layers float8 training converts (see the module's docstring for what it keeps)."""
    output = model.get_output_embeddings()
    chosen = []
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or module is output:
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if hasattr(parent, "experts"):  # a mixture's router or shared-expert gate
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        chosen.append(name)
    return chosen


def train_in_float8(model: Any, stage: str, compile_layers: bool | None = None, recipe: str = RECIPE) -> int:
    """Convert `model`'s chosen linear layers to torchao's Float8Linear in place and return how many.
    `compile_layers` (default: on a GPU) compiles each converted layer's forward; `recipe` is torchao's scaling
    recipe ("tensorwise", "rowwise")."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(float8_layers(model))
    if not chosen:
        raise NotSupportedHere(
            f"stages.{stage}.training.fp8: the model has no linear layer float8 can run (sizes multiples of 16, "
            "not the output layer): set fp8: false"
        )
    config = Float8LinearConfig.from_recipe_name(recipe)
    if not torch.cuda.is_available():
        # A CPU has no float8 GEMM: torch._scaled_mm's CPU kernel took 140 ms for a 512 x 64 x 128 product (one
        # core) against 0.25 ms for torchao's emulation (the same float8 values and scales, multiplied in float32;
        # the same result there), so a local run's float8 stage emulates, as torchao's own CPU tests do.
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, name: name in chosen)
    split_again(model, chosen)
    if compile_layers if compile_layers is not None else torch.cuda.is_available():
        for name in chosen:
            model.get_submodule(name).compile()
    kept = sum(type(m) is torch.nn.Linear for m in model.modules())
    print(f"[{stage}] fp8: {len(chosen)} linear layers in float8, {kept} not", flush=True)
    return len(chosen)


def compiles_decoder_layers(stage: str, section: Any) -> bool:
    """Whether this stage compiles each whole decoder layer, its checkpointing inside (`compile_decoder_layers`),
    instead of each float8 layer alone: float8 on a GPU, in cpt or sft, under strategy ddp or fsdp (FSDP2 then shards
    the compiled layers), with whole layers on each process (see the module's docstring for why not elsewhere)."""
    distributed = section.distributed
    return (
        section.training.fp8
        and torch.cuda.is_available()
        and stage in WHOLE_LAYER_STAGES
        and distributed.strategy in ("ddp", "fsdp")
        and not distributed.sharded_at_load
        and distributed.pipeline_parallel == 1
    )


def compile_decoder_layers(model: Any, checkpointing: bool, recompute_layers: int | None = None) -> int:
    """Compile each decoder layer of `model` as one region (`nn.Module.compile`), with its activation checkpointing
    inside the region where `checkpointing` (in the first `recompute_layers` only, where set:
    `stages.recompute`), and return how many. The layer's class becomes a subclass whose forward
    checkpoints the original one: the module tree, parameter names and saved weights stay as they are (torch's
    checkpoint_wrapper would rename every parameter). The layers share their compiled graphs (the same code, the
    parameters as inputs). The trainer's own gradient checkpointing must be off (`stages.training`)."""
    # The RNG state is kept for the recomputation only where the model drops out (where it does not, as in the
    # measured runs, keeping it is work for nothing).
    config = model.config.get_text_config()
    dropout = any(getattr(config, name, 0) or 0 for name in ("attention_dropout", "hidden_dropout", "dropout"))
    layers = model.get_decoder().layers
    recomputing = (len(layers) if recompute_layers is None else recompute_layers) if checkpointing else 0
    for index, layer in enumerate(layers):
        if index < recomputing:
            layer.__class__ = _checkpointed(type(layer), dropout)
        layer.compile()
    return len(layers)


@functools.cache
def _checkpointed(layer_class: type, preserve_rng_state: bool) -> type:
    """`layer_class` with its forward under torch's (non-reentrant) activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(layer_class):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(
                super().forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
            )

    Checkpointed.__name__ = Checkpointed.__qualname__ = layer_class.__name__  # FSDP and logs match layers by name
    return Checkpointed


def split_again(model: Any, converted: set[str]) -> None:
    """Give each converted layer of a tensor-parallel model its plan's forward back. transformers' tensor-parallel
    plan is a wrapper around each layer's forward (`install_forward`), which converting the layer to a new module
    drops: its input would reach the float8 matmul as a plain tensor beside the layer's DTensor weight."""
    plan, mesh = getattr(model, "tp_plan", None), getattr(model, "_device_mesh", None)
    if not plan or mesh is None:
        return
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
    for name in converted:
        style = plan.get(replace_layer_number_by_wildcard(name))
        if style is not None:
            ALL_PARALLEL_STYLES[style].install_forward(model.get_submodule(name), tp_mesh)
