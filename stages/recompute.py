"""Which decoder layers recompute their activations in the backward pass (`training.recompute_layers`).

Gradient checkpointing recomputes every decoder layer's forward in the backward pass: about a third of a LoRA step's
compute, and a quarter of a full fine-tune's. Where the GPU has memory left over after checkpointing every layer,
the layers that need not recompute are pure gain. `training.recompute_layers: N` keeps recomputation in the first N
decoder layers that have it and turns it off in the rest, which keep their activations (about one layer's
activations of memory each). That is Megatron-LM's `--recompute-method block --recompute-num-layers N`; transformers'
own `every_n_layers` recomputes one layer in n, too coarse for a model that can spare a few layers of 48.

The layers are found as training starts (`RecomputeLayers`, a Trainer callback: `on_train_begin` runs after the
Trainer turned checkpointing on and accelerate prepared the model), in the model's order, whichever wrapper
recomputes them: transformers' checkpointed layers (the Trainer's gradient checkpointing: one process, DDP,
DeepSpeed; under pipeline parallelism a process's own stage of layers) or FSDP2's checkpoint wrappers (accelerate's
`activation_checkpointing`). Decoder layers compiled whole take the count as they are compiled
(`stages.float8.compile_decoder_layers`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers import TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer


def recomputing_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of `model` that recompute their activations, in the model's order: FSDP2's checkpoint
    wrappers, and transformers' layers with gradient checkpointing on (a layer inside a wrapper has it off)."""
    return [
        module
        for module in model.modules()
        if isinstance(module, CheckpointWrapper)
        or (isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing)
    ]


def keep_activations(model: torch.nn.Module, recompute_layers: int) -> tuple[int, int]:
    """Recomputation off in every recomputing decoder layer of `model` after the first `recompute_layers`; returns
    (layers that still recompute, layers that recomputed before)."""
    layers = recomputing_layers(model)
    for layer in layers[recompute_layers:]:
        if isinstance(layer, CheckpointWrapper):
            layer.checkpoint_fn = _forward  # the wrapped layer's own call: its activations kept for the backward
        else:
            layer.gradient_checkpointing = False
    return min(recompute_layers, len(layers)), len(layers)


def _forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


class RecomputeLayers(TrainerCallback):
    """`training.recompute_layers` applied as training starts (None: every layer keeps its recomputation)."""

    def __init__(self, stage: str, recompute_layers: int | None) -> None:
        self.stage, self.recompute_layers = stage, recompute_layers

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.recompute_layers is None or model is None:
            return
        recomputing, before = keep_activations(model, self.recompute_layers)
        if not state.is_world_process_zero:
            return
        if before:
            print(
                f"[{self.stage}] activation recomputation in {recomputing} of {before} decoder layers "
                f"(training.recompute_layers); the other {before - recomputing} keep their activations",
                flush=True,
            )
        elif not torch.cuda.is_available():  # (on a GPU, layers compiled whole took the count as they compiled)
            print(f"[{self.stage}] training.recompute_layers: no decoder layer recomputes on a CPU", flush=True)
