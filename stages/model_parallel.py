"""Tensor and expert parallelism: a model sharded by transformers as it loads, and its checkpoints.

`stages.<stage>.distributed.tensor_parallel: T` splits each layer's attention (by heads) and MLP (by its inner width)
over groups of T ranks, which compute every layer together on the same rows; `expert_parallel: E` splits a mixture
of experts' experts over groups of E ranks, which exchange the routed tokens (all-to-all). FSDP2 shards the rest
over the remaining dimension (the world size divided by T). Both are transformers' own plans for the model family
(`DistributedConfig(tp_size=T, fsdp_size=world // T, ep_size=E)`, the model class's `base_model_tp_plan` and
`base_model_ep_plan`), applied by `from_pretrained` as the weights load: each rank reads only its shards. Routing
is the model's own (no forced balance). The Trainer sees a model sharded at load time and leaves it to transformers
(no accelerate FSDP wrapping); it gives each tensor-parallel group the same rows (its data-parallel size is the
world divided by T). A LoRA adapter added to an expert-parallel model is replicated, broadcast from rank 0 and its
gradients averaged by the Trainer.

Where the weights are not one checkpoint folder as they must train (a model built from `model.from_config`, a
vocabulary grown for the chat template's tokens, an upstream adapter merged for full training) the whole model is
made in each process first and handed to `from_pretrained` as a state dict: memory for a whole copy per rank, as
plain DDP needs.

Checkpoints: transformers cannot checkpoint such a model's optimizer (the Trainer refuses unless it saves the
model only). The stage's checkpoints hold the whole weights as safetensors, as every strategy's do, plus the
model's and optimizer's shards in torch's distributed checkpoint format (`sharded/`, each rank writes its own)
with the scheduler and every rank's RNG state; resuming loads the shards into the freshly sharded model and its
optimizer (`resume_sharded`), so a run that was stopped goes on from exactly where it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from spec.training import TrainingStage
from stages.contract import NotSupportedHere
from stages.sharded_loading import world_size

SHARDED_DIR = "sharded"
"""A checkpoint's folder of the model's and the optimizer's shards (torch.distributed.checkpoint)."""

SCHEDULER_FILE = "scheduler.pt"


def expert_parallel_size(section: TrainingStage) -> int:
    """Ranks per expert group in this run: the spec's expert_parallel under torchrun with several processes, 1
    (every expert on the one process) otherwise."""
    return section.distributed.expert_parallel if world_size() > 1 else 1


def tensor_parallel_size(section: TrainingStage) -> int:
    """Ranks per tensor-parallel group in this run: the spec's tensor_parallel under torchrun with several
    processes, 1 (whole layers) otherwise."""
    return section.distributed.tensor_parallel if world_size() > 1 else 1


def shards_at_load(section: TrainingStage) -> bool:
    """Whether transformers shards the stage's model as it loads (tensor or expert parallelism, several processes).
    Not with pipeline stages: each stage splits its own layers after the cut (`stages.pipeline_parallel`)."""
    if section.distributed.pipeline_parallel > 1 and world_size() > 1:
        return False
    return expert_parallel_size(section) > 1 or tensor_parallel_size(section) > 1


def expert_count(config: Any) -> int | None:
    """The routed experts per layer a model config names (num_experts, num_local_experts or n_routed_experts,
    as the families call it); None for a dense model."""
    text = config.get_text_config()
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        count = getattr(text, name, None)
        if isinstance(count, int) and count > 0:
            return count
    return None


def check_fits(stage: str, section: TrainingStage, config: Any) -> None:
    """Refuse, naming the spec field, what the model's plans cannot shard: tensor parallelism over heads or a world
    size it does not divide, or a model without one, or a mixture of experts without expert parallelism (its split
    experts do not checkpoint); expert parallelism on a dense model, or over an expert count or world size the group
    size does not divide."""
    tp = tensor_parallel_size(section)
    ep = expert_parallel_size(section)
    if tp > 1:
        _tensor_parallel_fits(stage, tp, config)
        if ep == 1 and expert_count(config) is not None:
            # transformers' plan splits each expert's packed gate and up projections in interleaved halves, which
            # torch's checkpoint planner refuses as overlapping ("Failed to validate global plan", two gloo
            # processes, a tiny Qwen3-MoE, at the first checkpoint)
            raise NotSupportedHere(
                f"stages.{stage}.distributed.tensor_parallel is {tp}, which would split {config.model_type}'s "
                f"experts too, and their checkpoint fails: set distributed.expert_parallel to {tp} or a multiple of "
                "it (the experts spread whole), or tensor_parallel to 1"
            )
    if ep == 1:
        return
    where = f"stages.{stage}.distributed.expert_parallel"
    experts = expert_count(config)
    if experts is None or not getattr(type(config.get_text_config()), "base_model_ep_plan", None):
        raise NotSupportedHere(
            f"{where} is {ep}, but {config.model_type} has no experts transformers can shard (no expert-parallel "
            "plan): set it to 1"
        )
    if experts % ep:
        raise NotSupportedHere(f"{where} is {ep}, which does not divide the model's {experts} experts per layer")
    if world_size() % ep:
        raise NotSupportedHere(
            f"{where} is {ep}, which does not divide this run's {world_size()} processes (one per GPU)"
        )


def _tensor_parallel_fits(stage: str, tp: int, config: Any) -> None:
    where = f"stages.{stage}.distributed.tensor_parallel"
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise NotSupportedHere(f"{where} is {tp}, but {config.model_type} has no tensor-parallel plan: set it to 1")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    sizes = ((heads, "attention heads"), (kv_heads, "key/value heads"), (text.intermediate_size, "MLP width"))
    for count, what in sizes:
        if count % tp:
            raise NotSupportedHere(f"{where} is {tp}, which does not divide the model's {count} {what}")
    if world_size() % tp:
        raise NotSupportedHere(
            f"{where} is {tp}, which does not divide this run's {world_size()} processes (one per GPU)"
        )


def trains_float32_masters(section: TrainingStage) -> bool:
    """Whether the stage keeps float32 master weights when sharded at load: full fine-tuning on a GPU, unless
    `training.pure_bf16`. The weights then load in float32 and FSDP2 casts each layer to bf16 as it gathers it,
    reducing gradients in float32 (its mixed-precision policy): what accelerate's FSDP2 does for the other
    strategies' full fine-tuning (`stages.modeling.float32_masters`)."""
    return torch.cuda.is_available() and section.method == "full" and not section.training.pure_bf16


def distributed_config(section: TrainingStage) -> Any:
    """transformers' DistributedConfig for the stage: layers split over groups of tensor_parallel, FSDP2 over the
    rest of the world, experts over groups of expert_parallel, computing in bf16 over float32 masters where
    `trains_float32_masters`."""
    from transformers.distributed import DistributedConfig

    tp = tensor_parallel_size(section)
    return DistributedConfig(
        tp_size=tp,
        fsdp_size=world_size() // tp,
        ep_size=expert_parallel_size(section),
        fsdp_mixed_precision=trains_float32_masters(section),
    )


PARTIAL_GRADIENT_STYLE = "replicated_with_grad_allreduce"
"""transformers' tensor-parallel style for a weight every rank holds whole but whose gradient each rank has only a
part of (Qwen3's and Gemma 3's per-head q_norm and k_norm see only the rank's heads)."""


def sum_partial_gradients_per_backward() -> None:
    """Make transformers' partial-gradient style (`PARTIAL_GRADIENT_STYLE`) sum each backward's gradient over the
    tensor-parallel ranks, not the accumulated one.

    transformers 5.23 all-reduces the weight's `.grad` after every accumulation into it
    (`register_post_accumulate_grad_hook`), which is right for one backward a step but sums the earlier micro-batches
    again at every later one: with gradient_accumulation_steps 2 (or the pipeline schedule's micro-batches) the
    q_norm and k_norm weights of a split Qwen3 ended 7e-3 away from one process's after 3 steps, every other weight
    within 1e-4 (two gloo processes). Here each backward's contribution is summed as it arrives (a hook on the
    gradient before it is accumulated), which gives the whole gradient for any number of micro-batches, under FSDP2
    too (the hook is on the weight the forward uses, its gathered one). Registered over transformers' own style
    before a model is split; the weights are a head's width, so the extra all-reduces are tiny."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce

    class SummedPerBackward(ReplicatedWithGradAllReduce):
        def install_forward(self, module: Any, mesh: Any) -> Any:
            original_forward = module.forward
            hooked: dict[str, Any] = {}

            def summed(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                torch.distributed.all_reduce(grad, group=mesh.get_group())
                return grad

            def forward(*args: Any, **kwargs: Any) -> Any:
                # hooked at the first forward that takes gradients: the weight the forward uses (FSDP2's gathered
                # one) exists only then
                if torch.is_grad_enabled():
                    for name, param in module.named_parameters(recurse=False):
                        if param.requires_grad and hooked.get(name) is not param:
                            param.register_hook(summed)
                            hooked[name] = param
                return original_forward(*args, **kwargs)

            module.forward = forward
            return module

    ALL_PARALLEL_STYLES.register(PARTIAL_GRADIENT_STYLE, SummedPerBackward())  # again on a later call: the same


def load_sharded(source: str | Path, revision: str | None, section: TrainingStage, **kwargs: Any) -> Any:
    """The model in the checkpoint folder or hub id `source`, each rank reading only its shards. `kwargs` are
    `from_pretrained`'s (dtype, attention). The loading draws nothing from the seeded random streams (the adapter
    drawn after it is the one a single process draws)."""
    from transformers import AutoModelForCausalLM

    sum_partial_gradients_per_backward()
    with torch.random.fork_rng(devices=rng_devices()):
        return AutoModelForCausalLM.from_pretrained(
            str(source),
            revision=revision,
            use_safetensors=True,  # never a pickled checkpoint
            distributed_config=distributed_config(section),
            **kwargs,
        )


def shard_whole(model: Any, section: TrainingStage, **kwargs: Any) -> Any:
    """`model` (whole, in this process's memory) sharded as `load_sharded` shards a checkpoint. `kwargs` are
    `from_pretrained`'s (dtype, attention)."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    kwargs.pop("trust_remote_code", None)  # the class is the model's own, remote code or not
    sum_partial_gradients_per_backward()
    with torch.random.fork_rng(devices=rng_devices()):
        sharded = type(model).from_pretrained(
            None, config=model.config, state_dict=state, distributed_config=distributed_config(section), **kwargs
        )
    # saved in the layout the whole model would be saved in (a checkpoint's own; a built model's the family's
    # original, per-expert), not the stacked one the state dict holds
    sharded._weight_conversions = getattr(model, "_weight_conversions", None)
    return sharded


def rng_devices() -> list[int]:
    """The devices whose random streams `torch.random.fork_rng` keeps (this rank's GPU, none on CPU)."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


@contextmanager
def mesh_over_gloo(section: TrainingStage) -> Iterator[None]:
    """While the Trainer is made: let accelerate take a tensor-parallel mesh on CPU processes (gloo). accelerate
    accepts a ParallelismConfig (which the Trainer makes for a tensor-parallel model) only on accelerator devices,
    and refuses multi-CPU by that check alone: the mesh, the DTensors and their collectives run over gloo, and the
    split model trains as one process does (tests/test_tensor_parallel.py). Nothing changes on GPUs."""
    if torch.cuda.is_available() or tensor_parallel_size(section) == 1:
        yield
        return
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator_only = Accelerator.multi_device

    def multi_device(self: Any) -> bool:
        return accelerator_only.fget(self) or (
            self.use_distributed and self.distributed_type == DistributedType.MULTI_CPU
        )

    Accelerator.multi_device = property(multi_device)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Accelerator.multi_device = accelerator_only  # type: ignore[method-assign]


@contextmanager
def whole_layer_adapters() -> Iterator[None]:
    """While PEFT adds LoRA adapters to a tensor-parallel model: size each adapter by its whole layer, as one process
    does. PEFT 0.21 sizes them by the rank's slice of the layer (`_get_in_out_features`, written for the older
    tensor parallelism that computed on local tensors), then wraps the slice as the layer's DTensor but keeps the
    slice's width as the adapter's `in_features`/`out_features`, which transformers 5.23's DTensor plans read to
    rebuild their inputs: a row-wise layer's adapter then fails ("shape [16, 32] is invalid for input of size 1024",
    measured with transformers + PEFT alone). Sized whole, the adapter is drawn as one process draws it and PEFT
    shards it by the layer's plan (its own `add_lora_tp_hooks_dtensor`)."""
    from peft.tuners.lora.layer import LoraLayer

    sliced = LoraLayer._get_in_out_features

    def whole(self: Any, module: torch.nn.Module) -> tuple[int, int] | tuple[None, None]:
        if isinstance(module, torch.nn.Linear):
            return module.in_features, module.out_features
        return sliced(self, module)

    LoraLayer._get_in_out_features = whole  # type: ignore[method-assign]
    try:
        yield
    finally:
        LoraLayer._get_in_out_features = sliced  # type: ignore[method-assign]


def average_split_adapters(model: Any) -> None:
    """Average the gradient of each adapter weight split over a tensor-parallel group across the groups (the FSDP2
    dimension), as FSDP2 averages the weights it shards.

    PEFT splits an adapter on a split layer as a DTensor over the group's ranks alone, after FSDP2 wrapped the model,
    so FSDP2 does not reduce it, and transformers 5.23's Trainer averages only the plain (replicated) adapter weights
    (`_sync_replicated_trainable_parameters`): each group trained its own copy of the split ones on its own rows (with
    two groups of two gloo processes, a quarter of the column-split layers' lora_B weights took the other sign after
    one step). Averaged once per optimizer step, when the accumulated gradient is complete, before it is clipped."""
    from accelerate.state import GradientState
    from torch.distributed.tensor import DTensor

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    mesh = getattr(base, "_device_mesh", None)
    if mesh is None or "fsdp" not in (mesh.mesh_dim_names or ()) or mesh["fsdp"].size() == 1:
        return
    groups, group = mesh["fsdp"].size(), mesh["fsdp"].get_group()

    def average(param: torch.Tensor) -> None:
        # accelerate's shared state, the Trainer's by then: it says there which backward ends a step
        if GradientState().sync_gradients:
            local = param.grad.to_local()  # type: ignore[union-attr]
            torch.distributed.all_reduce(local, group=group)
            local.div_(groups)

    for param in model.parameters():
        if not (param.requires_grad and isinstance(param, DTensor)):
            continue
        if "fsdp" not in (param.device_mesh.mesh_dim_names or ()):  # not FSDP2's to reduce
            param.register_post_accumulate_grad_hook(average)


def is_sharded_at_load(model: Any) -> bool:
    """Whether transformers sharded `model` (or the model a PEFT wrapper holds) as it loaded."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_distributed_loading_by_transformers", False))


def sharded_arguments(section: TrainingStage) -> dict[str, Any]:
    """Trainer arguments for a model sharded at load time: the Trainer's own checkpoints hold the model only (it
    cannot save such a model's optimizer; `checkpoint_sharded` adds it). FSDP's activation checkpointing
    (`distributed.activation_checkpointing`) is the Trainer's gradient checkpointing here, on a GPU."""
    args: dict[str, Any] = {"save_only_model": True}
    if section.distributed.activation_checkpointing and torch.cuda.is_available():
        args["gradient_checkpointing"] = True
    return args


def checkpoint_sharded(trainer: Any) -> None:
    """Make `trainer` (whose model transformers sharded) write and resume whole checkpoints: after the Trainer's
    own save (the whole weights, the trainer state), every rank writes its shards of the model and the optimizer
    (`sharded/`), rank 0 the scheduler, each rank its RNG state; the checkpoint's completeness marker comes after
    all of them (`stages.checkpoints.CheckpointMarker`, on_save). Resuming loads those instead of the whole
    weights. The Trainer's methods are replaced on this instance only."""
    save_model_only = trainer._save_checkpoint

    def save_checkpoint(model: Any, trial: Any = None) -> None:
        save_model_only(model, trial)
        folder = Path(trainer._get_output_dir(trial=trial)) / f"checkpoint-{trainer.state.global_step}"
        save_shards(trainer, folder)

    trainer._save_checkpoint = save_checkpoint
    trainer._load_from_checkpoint = lambda checkpoint, model=None: None  # the shards load with the optimizer
    trainer._load_optimizer_and_scheduler = lambda checkpoint: resume_sharded(trainer, checkpoint)


def save_shards(trainer: Any, folder: Path) -> None:
    """Every rank: the model's and optimizer's shards into `folder/sharded`, the scheduler (rank 0), the RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(trainer.model, _optimizer(trainer))
    state = _keyed(trainer, {"model": model_state, "optimizer": optimizer_state})
    dcp.save(state, checkpoint_id=str(folder / SHARDED_DIR))
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
    trainer._save_rng_state(str(folder))


def resume_sharded(trainer: Any, checkpoint: str | None) -> None:
    """Load a checkpoint's shards into the sharded model and its optimizer, and its scheduler (every rank)."""
    if checkpoint is None:
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(checkpoint)
    if not (folder / SHARDED_DIR).is_dir():
        raise NotSupportedHere(
            f"{folder} has no {SHARDED_DIR}/ (the model's and optimizer's shards): it was not written by a run "
            "with tensor_parallel, expert_parallel or pipeline_parallel; rerun the stage with --force to start over"
        )
    optimizer = _optimizer(trainer)
    model_state, optimizer_state = get_state_dict(trainer.model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(_keyed(trainer, state), checkpoint_id=str(folder / SHARDED_DIR))
    set_state_dict(trainer.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    trainer.lr_scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))


def _keyed(trainer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """`state` under the trainer's `sharded_state_key` where it has one: a pipeline stage's parameters and optimizer
    groups are its own (their names would collide with the other stages' in one checkpoint's keys)."""
    key = getattr(trainer, "sharded_state_key", None)
    return {key: state} if key else state


def _optimizer(trainer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's wrapper."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)
