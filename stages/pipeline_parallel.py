"""Pipeline parallelism: a model's layers cut into consecutive stages, one per rank, trained by torch's pipeline
schedule inside the transformers Trainer.

`stages.<stage>.distributed.pipeline_parallel: P` cuts the decoder layers into P consecutive runs (as even as they
divide; the first stages take one more where they do not), the embedding with the first, the final norm and the head
with the last. Each rank keeps only its stage: the layers outside it are transformers' own `PipelineIdentityLayer`
(what `transformers.distributed.pipeline_parallel` does for inference), so a stage's forward is the model's own:
`input_ids` on the first, the hidden states it receives as `inputs_embeds` on the others, the position ids passed on
beside them so that every stage builds the same document masks and rotary embeddings. torch's runtime
(`torch.distributed.pipelining`: `PipelineStage` and the 1F1B schedule) runs the micro-batches' forwards and
backwards and the sends between stages; this module writes no schedule of its own.

The world is a mesh of P stages by R = world / P pipelines (torch's DeviceMesh, the stage dimension outermost as in
torchtitan: on several nodes a pipeline crosses them and the sharding stays on each node's NVLink). FSDP2 (torch's
`fully_shard`, over the ranks holding the same stage) shards each stage over the pipelines and averages their
gradients, once a step (the pipeline stage defers the reduction to its last micro-batch). torchtitan pairs
pipelines with FSDP2 too: torch's DDP under the pipeline stage failed here on its second step ("rebuilt parameter
indices size is not same as original model parameters size", torch 2.13, two stages by two pipelines on gloo).

Inside the Trainer (`pipeline_trainer`): one optimizer step is one `schedule.step` over
`training.gradient_accumulation_steps` micro-batches of `per_device_batch_size` rows (the Trainer's batch is all
of them; its own accumulation is 1). Every stage of a pipeline reads the same rows (the Trainer's sampler sharded
over the R pipelines, not the world), padded to `max_seq_length` and to whole micro-batches with rows that have
no labels, so every micro-batch has the shape the schedule planned for. The loss is transformers' causal-LM loss
for the model, summed over the step's tokens and divided by their count over all pipelines, as the Trainer divides
without pipelines, so the gradients are the unparallelised run's. Gradient clipping takes the norm over all stages;
where the head is tied to the embedding (Gemma), the first and last stage each hold the weight and their two
gradients are summed before the optimizer steps (what Megatron does), so the copies stay equal. Evaluation runs the
schedule forward only and averages the loss over every held-out token. rlhf's ORPO, DPO and KTO train the same way
with a loss of their own on the last stage (`Pipeline.objective`; `stages.pipeline_preference`), and GRPO, which
samples its completions through the stages first (`stages.pipeline_grpo`).

With `distributed.tensor_parallel: T` each stage's layers are split over T ranks too (`split_layers`): the world is
then P stages x R = world / (P T) pipelines x T, the tensor-parallel ranks innermost (one node's NVLink). Each of a
stage's T ranks runs the same micro-batches and sends its copy of the hidden states to the same rank of the next
stage; FSDP2 shards the split weights over the pipelines; the gradient norm is taken over each mesh's weights and
summed over the stages. transformers' own plan for the family does the split, applied after the cut (its loader with
`pp_size` fails, looking for the layers the cut removed). A dense model, or a mixture of experts whose experts
`expert_parallel` spreads (`_split_stages_fit`; below): full fine-tuning,
in float8 too (`training.fp8`: the layers converted before the split, each scale taken over the whole weight), or LoRA
(the adapters, drawn whole before the cut, split with their layers as PEFT splits them: `split_adapters`).

With `distributed.expert_parallel: E` (a mixture of experts, its router balance loss off) each stage's experts are
spread whole over E of its ranks, consecutive ones across the pipelines (`spread_experts`: transformers' own
expert-parallel plan for the family, applied after the cut as `split_layers` applies the tensor-parallel one), which
exchange the routed tokens (all-to-all); FSDP2 shards each expert over the stage's copies of its group and the rest
over the pipelines (`shard_experts`, as transformers shards an expert-parallel model). Full fine-tuning, or LoRA, on
the experts too (`adapters_on_spread_experts`: each rank applies its experts' rows of the whole adapter as low-rank
grouped products; FSDP2's average over the pipelines of those rows' gradients, the loss counted once per pipeline,
is the sum over the ranks holding each expert). With tensor_parallel too (E a multiple of T), the
experts take no tensor-parallel rule (`split_layers`), and each rank of a tensor-parallel group sends its own share of
the group's rows to the experts, as transformers does.

A LoRA model (PEFT's wrapper) is cut the same way, the adapters inside the layers going with them: each stage trains
its own, and the adapter is saved as one PEFT folder (`save_adapter`), as one process saves it.

Checkpoints are those of tensor and expert parallelism (`stages.model_parallel.checkpoint_sharded`): each rank's model
and optimizer state in torch's distributed checkpoint format (each stage's under a key of its own: its optimizer groups
name its own parameters), with the scheduler and RNG, beside the whole weights; resuming loads the shards. The whole
weights are one Hugging Face folder: each stage's first replica saves its part with transformers' `save_pretrained` (one
file per stage), rank 0 writes the index and the config, so the next stage, evaluate and vLLM load it as any checkpoint.

The model is read once per job (`stages.sharded_loading.loads_once`): rank 0 loads it (onto its GPU where it fits,
else into host memory) and every other rank builds it on the meta device; each rank cuts its stage out, and rank 0
broadcasts the weights one tensor at a time, each rank keeping those of its own stage (`receive_stage`). A node's
memory then holds one copy of the model, on rank 0, until its stage is cut out, not one per process. Full
fine-tuning on a GPU keeps float32 masters (`stages.modeling.float32_masters`), gathered and computed
in bf16 and saved in the dtype the model came in. A mixture of experts is cut as a dense model is (each stage's
experts whole on its ranks, or spread by expert_parallel) when its router balance loss is off, and refused when it is
on: that loss is taken over every layer's routers at once, which no stage holds.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spec.training import TrainingStage
from stages.contract import NotSupportedHere
from stages.model_parallel import check_fits as check_split
from stages.model_parallel import (
    expert_count,
    expert_parallel_size,
    rng_devices,
    sum_partial_gradients_per_backward,
    tensor_parallel_size,
)
from stages.packing import IGNORE_INDEX
from stages.sharded_loading import loads_once, world_size


def pipeline_parallel_size(section: TrainingStage) -> int:
    """Stages per pipeline in this run: the spec's pipeline_parallel under torchrun with several processes, 1 (the
    whole model on each process) otherwise."""
    return section.distributed.pipeline_parallel if world_size() > 1 else 1


def check_fits(stage: str, section: TrainingStage, config: Any) -> None:
    """Refuse, naming the spec field, a cut the model or the world cannot take: a mixture of experts with its
    router balance loss on, fewer layers than stages, a world size the stages (times the tensor-parallel ranks) do
    not divide, a split of the layers the model's plan cannot make."""
    pp = pipeline_parallel_size(section)
    if pp == 1:
        return
    where = f"stages.{stage}.distributed.pipeline_parallel"
    text = config.get_text_config()
    if expert_count(config) is not None and getattr(text, "output_router_logits", False):
        raise NotSupportedHere(
            f"{where} is {pp}, but {config.model_type} is a mixture of experts whose router balance loss is on (it "
            f"is taken over every layer's routers at once, which no stage holds): set stages.{stage}.training."
            "router_aux_loss_coef to 0 to cut it, or pipeline_parallel to 1 and expert_parallel to shard the experts"
        )
    if text.num_hidden_layers < pp:
        raise NotSupportedHere(f"{where} is {pp}, more than the model's {text.num_hidden_layers} layers")
    tp, ep = tensor_parallel_size(section), expert_parallel_size(section)
    if tp > 1 and ep == 1:
        _split_stages_fit(stage, section, config)
    if world_size() % (pp * tp):
        split = f" times tensor_parallel {tp}" if tp > 1 else ""
        raise NotSupportedHere(f"{where} is {pp}{split}, which does not divide this run's {world_size()} processes")
    if ep > 1 and (world_size() // pp) % ep:
        raise NotSupportedHere(
            f"stages.{stage}.distributed.expert_parallel is {ep}, which does not divide the {world_size() // pp} "
            f"processes of each of the {pp} pipeline stages (a stage's experts spread over its own ranks)"
        )
    check_split(stage, section, config)  # the split of each stage's layers (tensor_parallel) or experts


def _split_stages_fit(stage: str, section: TrainingStage, config: Any) -> None:
    """What stages whose layers are split (tensor_parallel) do not train without expert_parallel, tried on four gloo
    processes: a mixture of experts (the experts' split shards overlap in the checkpoint: torch's checkpoint planner
    refuses them)."""
    where = f"stages.{stage}.distributed.tensor_parallel"
    if expert_count(config) is not None:
        raise NotSupportedHere(
            f"{where} with pipeline_parallel splits a mixture of experts ({config.model_type}) only with "
            "expert_parallel (a multiple of it: the experts spread whole): set it, or tensor_parallel to 1"
        )


def layer_ranges(layers: int, stages: int) -> list[range]:
    """The decoder layers of each stage: consecutive runs as even as `layers` divides, the first stages one longer
    where it does not."""
    size, extra = divmod(layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        end = start + size + (stage < extra)
        ranges.append(range(start, end))
        start = end
    return ranges


@dataclass
class PipelineLayout:
    """Where this rank is in the mesh of stages x pipelines (x tensor-parallel ranks), and its process groups."""

    stages: int
    pipelines: int
    stage: int
    """This rank's stage (its rank in `stage_group`)."""
    pipeline: int
    """This rank's pipeline (its rank in `replica_group`)."""
    stage_group: Any
    """The ranks of this rank's pipeline, stage 0 first."""
    replica_group: Any
    """The ranks holding this rank's stage (its part of it, under tensor parallelism), one per pipeline (FSDP2's
    group)."""
    replica_mesh: Any
    """The same ranks as a DeviceMesh."""
    mesh: Any
    """The whole mesh: stages x pipelines, x tensor-parallel ranks where they split the layers."""
    tensor: int = 1
    """Ranks splitting each layer of a stage (tensor parallelism), innermost in the mesh."""
    tensor_rank: int = 0
    """This rank's place among them."""
    tensor_mesh: Any = None
    """Those ranks as a DeviceMesh (None without tensor parallelism)."""
    expert: int = 1
    """Ranks a stage's experts are spread over (expert parallelism), consecutive ranks of the stage."""
    expert_mesh: Any = None
    """The stage's ranks as copies x expert groups (`efsdp` x `ep`, transformers' names; None without expert
    parallelism): each group holds every expert once, FSDP2 shards each expert over the copies."""

    @classmethod
    def build(cls, stages: int, tensor: int = 1, expert: int = 1) -> PipelineLayout:
        """The mesh over the world: stages outermost (on several nodes a pipeline crosses them), tensor-parallel
        ranks innermost (each layer's all-reduces on one node's NVLink), the pipelines between; expert groups over
        the pipelines' consecutive ranks (one node's where they fit), as transformers lays them out."""
        from torch.distributed.device_mesh import init_device_mesh

        pipelines = dist.get_world_size() // (stages * tensor)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if tensor > 1 or expert > 1:  # the expert dispatch asks for the ranks sharing rows (one rank without TP)
            mesh = init_device_mesh(device, (stages, pipelines, tensor), mesh_dim_names=("pp", "dp", "tp"))
        else:
            mesh = init_device_mesh(device, (stages, pipelines), mesh_dim_names=("pp", "dp"))
        expert_mesh = None
        if expert > 1:
            copies = pipelines * tensor // expert
            expert_mesh = init_device_mesh(device, (stages, copies, expert), mesh_dim_names=("pp", "efsdp", "ep"))
        return cls(
            stages=stages,
            pipelines=pipelines,
            stage=mesh.get_local_rank("pp"),
            pipeline=mesh.get_local_rank("dp"),
            stage_group=mesh.get_group("pp"),
            replica_group=mesh.get_group("dp"),
            replica_mesh=mesh["dp"],
            mesh=mesh,
            tensor=tensor,
            tensor_rank=mesh.get_local_rank("tp") if tensor > 1 else 0,
            tensor_mesh=mesh["tp"] if tensor > 1 else None,
            expert=expert,
            expert_mesh=expert_mesh,
        )

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def writes(self) -> bool:
        """Whether this rank writes its stage's part of a saved model: the stage's first replica's first
        tensor-parallel rank."""
        return self.pipeline == 0 and self.tensor_rank == 0

    def ends_group(self) -> Any:
        """The first and last stage of this rank's pipeline, at its tensor-parallel rank (made on every rank, as
        torch needs; None elsewhere)."""
        ranks = self.mesh.mesh.reshape(self.stages, -1)  # each column: one pipeline at one tensor-parallel rank
        me, mine = dist.get_rank(), None
        for column in range(ranks.shape[1]):
            ends = [int(ranks[0, column]), int(ranks[-1, column])]
            group = dist.new_group(ends)
            if me in ends:
                mine = group
        return mine


class PipelinePart(nn.Module):
    """One stage of a causal LM: `model` (a transformers model, changed in place) keeps its own decoder layers,
    the embedding on the first stage, the norm and the head on the last; the other layers become transformers'
    `PipelineIdentityLayer`. With `bf16` its forward runs under bf16 autocast (the Trainer's mixed precision,
    which patches only the whole model's forward, not the inner model's the other stages call)."""

    def __init__(self, model: Any, layers: range, first: bool, last: bool, bf16: bool = False) -> None:
        from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

        super().__init__()
        base = model.model
        for index in range(len(base.layers)):
            if index not in layers:
                base.layers[index] = PipelineIdentityLayer()
        if not first:
            base.embed_tokens = None  # a tied head keeps the weight itself (model.lm_head.weight)
        if not last:
            base.norm = PipelineIdentityLayer()
            model.lm_head = None
        self.first, self.last, self.bf16 = first, last, bf16
        self.model = model

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        # the position ids travel between stages in float32 (received tensors must take gradients); whole numbers
        inputs = {"position_ids": position_ids.long(), "use_cache": False}
        inputs["input_ids" if self.first else "inputs_embeds"] = x
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if self.last:
                return self.model(**inputs).logits
            return self.model.model(**inputs).last_hidden_state, position_ids


class Pipeline:
    """This rank's stage of the model and torch's schedule over it."""

    def __init__(
        self,
        model: Any,
        stages: int,
        microbatches: int,
        device: torch.device,
        bf16: bool,
        loaded_once: bool,
        tensor: int = 1,
        expert: int = 1,
        reference: bool = False,
    ) -> None:
        """`loaded_once`: only rank 0 holds the weights (the others a skeleton on the meta device). `tensor`: ranks
        splitting each layer of a stage (`split_layers`); `expert`: ranks spreading each stage's experts
        (`spread_experts`). `reference`: keep a frozen copy of the stage's starting weights, run forward only by a
        schedule of its own (`run(..., reference=True)`: a full policy's reference model, cut and split as the policy
        is)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.layout = layout = PipelineLayout.build(stages, tensor, expert)
        # a LoRA model is PEFT's wrapper around the transformers model, its adapters inside that model's layers
        self.adapter = hasattr(model, "get_base_model")
        self.causal = causal = model.get_base_model() if self.adapter else model
        """The transformers model (inside PEFT's wrapper under LoRA), cut to this rank's stage."""
        text = causal.config.get_text_config()
        self.tied = bool(getattr(text, "tie_word_embeddings", False))
        self.ends = layout.ends_group() if self.tied else None
        layers = layer_ranges(text.num_hidden_layers, stages)[layout.stage]
        whole = [param for _name, param in causal.named_parameters()]  # the same order on every rank
        self.part = PipelinePart(causal, layers, layout.first, layout.last, bf16)
        if loaded_once:
            received = receive_stage(whole, self.part, device)
            if received:
                print(f"pipeline stage {layout.stage + 1}/{stages}: {received} weights from rank 0", flush=True)
        del whole  # rank 0's copy of the other stages goes with it
        self.part.to(device)
        self.reference_part: PipelinePart | None = None
        """The frozen copy of the stage's starting weights, where kept."""
        if reference:
            if layout.expert > 1:
                raise ValueError("a reference copy of the stage is kept for experts not spread only")
            self.reference_part = copy.deepcopy(self.part).requires_grad_(False)
        if layout.tensor > 1:
            split_layers(causal, layout.tensor_mesh, experts_spread=layout.expert > 1)
            if self.reference_part is not None:
                split_layers(self.reference_part.model, layout.tensor_mesh)
        experts: list[nn.Module] = []
        if layout.expert > 1:
            experts = spread_experts(causal, layout.expert_mesh["ep"], layout.mesh["tp"])
            if self.adapter:
                adapters_on_spread_experts(model, layout.expert_mesh["ep"].get_local_rank())
        # each stage's first replica writes its own part (`save_whole`); transformers lets only global rank 0 write
        causal.should_save_on_this_rank = lambda is_main_process: is_main_process
        if experts:
            shard_experts(experts, layout, bf16)
        if layout.pipelines > 1:
            shard_over_pipelines(self.part, layout.replica_mesh, bf16)
            if self.reference_part is not None:
                shard_over_pipelines(self.reference_part, layout.replica_mesh, bf16)
        if layout.writes:
            print(
                f"pipeline stage {layout.stage + 1}/{stages}: layers {layers.start}-{layers.stop - 1} of "
                f"{text.num_hidden_layers}, {microbatches} micro-batches a step, {layout.pipelines} pipeline(s)"
                + (f", each layer split over {layout.tensor} ranks" if layout.tensor > 1 else "")
                + (f", its experts spread over {layout.expert} ranks" if layout.expert > 1 else ""),
                flush=True,
            )
        self.vocab_size = text.vocab_size
        self.loss_function = causal.loss_function
        self.microbatches = microbatches
        self.tokens: torch.Tensor | int = 1
        """Tokens the step's loss is divided by (over all pipelines); set before each step."""
        self.save_dtype: torch.dtype | None = None
        """The dtype the whole weights are saved in, where not the training one (float32 masters)."""
        self.objective: Any = None
        """The loss of a micro-batch where not the causal-LM one, called as (logits, target) on the last stage (rlhf's
        ORPO: `stages.pipeline_preference.OddsRatioLoss`)."""
        self.stage = PipelineStage(self.part, layout.stage, stages, device, group=layout.stage_group)
        # the loss is a sum over tokens divided by their count: no further scaling by the micro-batch count
        self.schedule = Schedule1F1B(self.stage, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        self.reference_schedule: Any = None
        if self.reference_part is not None:
            self.reference_part.eval()
            reference_stage = PipelineStage(self.reference_part, layout.stage, stages, device, group=layout.stage_group)
            self.reference_schedule = Schedule1F1B(reference_stage, microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.objective is not None:
            return self.objective(logits, labels)
        loss = self.loss_function(logits, labels, self.vocab_size, num_items_in_batch=self.tokens)
        return loss * self.layout.pipelines  # FSDP2 averages over the pipelines: their sum is wanted

    def run(self, batch: dict[str, torch.Tensor], train: bool, reference: bool = False) -> torch.Tensor:
        """One step over `batch` (every micro-batch of it), on every rank of the pipeline: the loss summed over
        the batch's tokens, divided by `tokens`, times the pipelines (their mean over the world is the step's
        loss, as the Trainer logs it). `reference`: forward only, through the reference's stages."""
        run = self.schedule.step if train else self.schedule.eval
        if reference:
            run = self.reference_schedule.eval
        losses: list[torch.Tensor] = []
        target = {"target": batch["labels"], "losses": losses} if self.layout.last else {}
        if self.layout.first:
            run(batch["input_ids"], batch["position_ids"].float(), return_outputs=False, **target)
        else:
            run(return_outputs=False, **target)
        device = batch["labels"].device
        loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=device)
        dist.broadcast(loss, group=self.layout.stage_group, group_src=self.layout.stages - 1)
        return loss

    def sum_tied_gradients(self) -> None:
        """First and last stage: the sum of their gradients of the tied embedding, on both."""
        if self.ends is None:
            return
        weight = self.part.model.model.embed_tokens.weight if self.layout.first else self.part.model.lm_head.weight
        # None under LoRA (a tied head stays frozen). Both ends shard it alike over the pipelines: the shards add up
        if weight.grad is not None:
            dist.all_reduce(_local(weight.grad), group=self.ends)

    def gradient_norm(self, max_norm: float | None) -> torch.Tensor:
        """The norm of the whole model's gradient (every stage's, the tied weight once); clipped to `max_norm`
        where given."""
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        params = [p for p in self.part.parameters() if p.grad is not None]
        counted = [p.grad for p in params if not (self.tied and self.layout.last and p is self._head_weight())]
        device = params[0].grad.device if params else torch.device("cpu")
        squares = torch.zeros((), device=device)
        for grads in _by_mesh(counted):  # a norm over DTensors takes one mesh
            squares += _full(get_total_norm(grads)).float().square()
        dist.all_reduce(squares, group=self.layout.stage_group)
        total = squares.sqrt()
        if max_norm is not None:
            for group in _by_mesh(params):  # each scaled on its own mesh
                clip_grads_with_norm_(group, max_norm, total)
        return total

    def _head_weight(self) -> Any:
        return self.part.model.lm_head.weight if self.part.model.lm_head is not None else None

    def tokens_in(self, labels: torch.Tensor) -> torch.Tensor:
        """The tokens a batch's loss counts (its shifted labels that are not ignored), over every pipeline."""
        count = (labels[..., 1:] != IGNORE_INDEX).sum()
        dist.all_reduce(count, group=self.layout.replica_group)
        return count


def receive_stage(whole: list[nn.Parameter], part: PipelinePart, device: torch.device) -> int:
    """Fill this rank's stage from rank 0's weights. `whole` is the model's parameters before the cut, in the same
    order on every rank (real on rank 0, on the meta device elsewhere); `part` holds those of this rank's stage.
    Rank 0 broadcasts each parameter in turn (from its GPU under NCCL); each rank keeps the ones its stage holds
    (by identity, so a head tied to the embedding is filled once) and drops the others as they arrive. Returns how
    many this rank received (0 on rank 0)."""
    kept = {id(param) for param in part.parameters()}
    through = device if dist.get_backend() == "nccl" else torch.device("cpu")
    sender = dist.get_rank() == 0
    for param in whole:
        tensor = param.detach().to(through) if sender else torch.empty(param.shape, dtype=param.dtype, device=through)
        dist.broadcast(tensor, src=0)
        if not sender and id(param) in kept:
            # the same parameter object made real (a meta tensor's data cannot be set), its ties kept; the
            # skeleton's stand-in address (`stages.sharded_loading.tell_apart`) goes with the meta tensor
            torch.utils.swap_tensors(param, nn.Parameter(tensor.to(device), requires_grad=param.requires_grad))
    return 0 if sender else len(kept)


def split_layers(causal: Any, mesh: Any, experts_spread: bool = False) -> None:
    """Tensor parallelism inside a stage: the stage's modules split over `mesh` by the model family's own plan
    (transformers' `tp_plan` and `apply_tensor_parallelism`, what `from_pretrained` applies to a whole model), each
    rank keeping its slice of the whole weights it holds. The plan is expanded over the modules the stage kept, so the
    layers cut away are not looked for (transformers' own loader with `pp_size` and `tp_size` looks for them and fails
    with a KeyError, transformers 5.23). With `experts_spread` the experts are left whole for `spread_experts` (the
    expert plan's modules take no tensor-parallel rule, as transformers resolves the two plans)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    sum_partial_gradients_per_backward()  # the schedule's micro-batches each run a backward
    plan = dict(causal.tp_plan)
    if experts_spread:
        is_expert = re.compile(rf"(?:{'|'.join(map(re.escape, causal.ep_plan))})(?:\..+)?").fullmatch
        plan = {name: style for name, style in plan.items() if not is_expert(name)}
    plan = causal._expand_parallel_plan(plan)
    adapted = _adapted_layers(causal, plan)
    with torch.random.fork_rng(devices=rng_devices()):
        apply_tensor_parallelism(causal, mesh, plan)
        split_adapters(causal, adapted, mesh)


def _adapted_layers(causal: Any, plan: dict[str, str]) -> dict[str, str]:
    """The LoRA layers (PEFT's wrappers) among the modules `plan` splits, with their styles; `plan` changed in place to
    split each one's base layer instead (the wrapper holds no weight of its own)."""
    modules = dict(causal.named_modules())
    adapted = {}
    for name, style in list(plan.items()):
        module = modules.get(name)
        if module is None or not hasattr(module, "lora_A"):
            continue
        del plan[name]
        for param, _ in module.base_layer.named_parameters(recurse=False):
            plan[f"{name}.base_layer.{param}"] = style
        plan[f"{name}.base_layer"] = style
        adapted[name] = style
    return adapted


def split_adapters(causal: Any, adapted: dict[str, str], mesh: Any) -> None:
    """Each LoRA layer's adapters split with its base layer, as PEFT splits them where transformers split the model
    as it loaded (`add_lora_tp_hooks_dtensor`): a column-wise layer's B by its output rows, a row-wise layer's A by its
    input columns, the other factor whole on every rank. The adapters were drawn whole, before the cut."""
    from peft.tuners.lora.model import add_lora_tp_hooks_dtensor

    for name, style in adapted.items():
        layer = causal.get_submodule(name)
        if style not in ("colwise", "rowwise"):
            raise NotSupportedHere(f"LoRA on {name}, which tensor parallelism splits as {style!r}: not offered yet")
        factors = layer.lora_B if style == "colwise" else layer.lora_A
        for adapter, factor in factors.items():
            factor_name = f"{name}.{'lora_B' if style == 'colwise' else 'lora_A'}.{adapter}"
            add_lora_tp_hooks_dtensor(factor, style, mesh, base_layer=layer.base_layer, module_name=factor_name)


def spread_experts(causal: Any, ep_mesh: Any, tp_mesh: Any) -> list[nn.Module]:
    """Expert parallelism inside a stage: the experts of the stage's layers spread whole over `ep_mesh` by the model
    family's own plan (transformers' `ep_plan` and `apply_expert_parallelism`, what `from_pretrained` applies to a
    whole model), each rank keeping its experts of the whole stack it holds and exchanging the routed tokens with the
    group (all-to-all). `tp_mesh`: the ranks sharing rows (one without tensor parallelism). Returns the experts
    modules, for FSDP2 (`shard_experts`). The plan is expanded over the modules the stage kept, as `split_layers`
    does."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = _through_adapters(causal, causal._expand_parallel_plan(dict(causal.ep_plan)))
    with torch.random.fork_rng(devices=rng_devices()):
        apply_expert_parallelism(causal, ep_mesh, tp_mesh, plan)
    return [causal.get_submodule(name) for name, style in plan.items() if style == "ep_dispatch_experts"]


def _through_adapters(causal: Any, plan: dict[str, str]) -> dict[str, str]:
    """`plan` (expanded) pointed at the experts inside PEFT's wrappers: with adapters on the experts
    (lora.target_experts) each stacked parameter's ParamWrapper wraps the experts module (`<experts>.base_layer`,
    once per parameter), so the plan's experts module is the innermost base layer and its parameters that module's
    (listed before it, as transformers lists them)."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    styles = dict(causal.ep_plan)
    spread: dict[str, str] = {}
    for name, style in plan.items():
        if style != "ep_dispatch_experts":
            spread[name] = style
            continue
        inner, module = name, causal.get_submodule(name)
        while hasattr(module, "base_layer") and hasattr(module, "parameter_name"):  # PEFT's ParamWrapper
            inner, module = f"{inner}.base_layer", module.base_layer
        if inner == name:
            return plan  # no adapters on the experts: the plan as transformers expands it
        pattern = replace_layer_number_by_wildcard(name)
        for param, _ in module.named_parameters(recurse=False):
            if (param_style := styles.get(f"{pattern}.{param}")) is not None:
                spread[f"{inner}.{param}"] = param_style
        spread[inner] = style
    return spread


def adapters_on_spread_experts(model: Any, group_rank: int) -> None:
    """A LoRA model's adapters on spread experts applied as low-rank grouped products of this rank's experts' rows
    (`stages.expert_lora`: PEFT's own path would add the whole adapter to the rank's slice of the experts), as where
    transformers spreads them as the model loads; refused where that path cannot take them."""
    from stages.expert_lora import unfit_adapters, use_low_rank_experts

    use_low_rank_experts(model, group_rank)
    if unfit := unfit_adapters(model):
        raise NotSupportedHere(
            f"LoRA on spread experts ({', '.join(unfit)}) runs only as low-rank grouped products: lora.r must be a "
            "multiple of 8"
        )


def shard_experts(experts: list[nn.Module], layout: PipelineLayout, bf16: bool) -> None:
    """FSDP2 over the copies of each expert group (`efsdp`), before the layers around them are sharded over the
    pipelines, as transformers shards an expert-parallel model. An expert's gradient holds the tokens routed to it from
    every pipeline of its group (times the pipelines: the loss's factor, `Pipeline._loss`), summed over the copies, so
    it is divided by the pipelines, not the copies (FSDP2's default)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    mesh = layout.expert_mesh["efsdp"]
    for module in experts:
        fully_shard(module, mesh=mesh, reshard_after_forward=False, **({"mp_policy": policy} if policy else {}))
        module.set_gradient_divide_factor(float(layout.pipelines))
        # FSDP2 divides by a factor other than the group's size through PREMUL_SUM, which gloo refuses (and NCCL gets
        # wrong in bf16, transformers says): sum, then divide. Over one copy FSDP2 divides with no reduction to do.
        if mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)


def shard_over_pipelines(part: PipelinePart, mesh: Any, bf16: bool) -> None:
    """FSDP2 (torch's `fully_shard`) over the ranks holding the same stage: each of its decoder layers a unit, the
    rest (embedding, norm, head) the root's. Kept gathered from the forward to the backward, as torchtitan does under
    pipelining: every micro-batch would gather them again. With `bf16`, gathered and computed in bf16 over float32
    masters, the gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    settings: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": False}
    if policy is not None:
        settings["mp_policy"] = policy
    for layer in part.model.model.layers:
        if not isinstance(layer, PipelineIdentityLayer):
            fully_shard(layer, **settings)
    fully_shard(part, **settings)


def _by_mesh(tensors: list[Any]) -> list[list[Any]]:
    """`tensors` grouped by the mesh they are DTensors on (plain tensors together): under tensor parallelism a
    stage's split weights are on the pipelines x tensor-parallel mesh, the rest on the pipelines' alone."""
    groups: dict[Any, list[Any]] = {}
    for tensor in tensors:
        mesh = getattr(tensor, "device_mesh", None)
        groups.setdefault(None if mesh is None else mesh.mesh_dim_names, []).append(tensor)
    return list(groups.values())


def _local(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: Any) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh); a plain tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def pad_rows(batch: dict[str, torch.Tensor], rows: int, width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """`batch` with `rows` rows of `width` tokens: the rows right-padded (the padding without labels, its
    positions running on), then rows without labels added (pad tokens at positions 0, 1, ...). Every micro-batch
    then has the shape the schedule planned for; the added tokens change no loss and no gradient."""
    have, wide = batch["input_ids"].shape
    if wide < width:
        extra = width - wide
        last = batch["position_ids"][:, -1:] + 1
        batch = {
            **batch,
            "input_ids": nn.functional.pad(batch["input_ids"], (0, extra), value=pad_token_id),
            "labels": nn.functional.pad(batch["labels"], (0, extra), value=IGNORE_INDEX),
            "position_ids": torch.cat([batch["position_ids"], last + torch.arange(extra)], dim=1),
        }
    if have < rows:
        missing = rows - have
        batch = {
            **batch,
            "input_ids": torch.cat([batch["input_ids"], torch.full((missing, width), pad_token_id)]),
            "labels": torch.cat([batch["labels"], torch.full((missing, width), IGNORE_INDEX)]),
            "position_ids": torch.cat([batch["position_ids"], torch.arange(width).repeat(missing, 1)]),
        }
    return {key: batch[key] for key in ("input_ids", "labels", "position_ids")}


class FixedShapeCollator:
    """A collator's batches padded to `rows` rows of `width` tokens (`pad_rows`)."""

    def __init__(self, collator: Any, rows: int, width: int, pad_token_id: int) -> None:
        self.collator, self.rows, self.width, self.pad_token_id = collator, rows, width, pad_token_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return pad_rows(self.collator(examples), self.rows, self.width, self.pad_token_id)


def pipeline_arguments(section: TrainingStage) -> dict[str, Any]:
    """Trainer arguments for a pipeline: its batch is every micro-batch of a step (the schedule splits it), the
    checkpoints hold the model only (`checkpoint_sharded` adds the shards)."""
    t = section.training
    rows = t.per_device_batch_size * t.gradient_accumulation_steps
    return {
        "per_device_train_batch_size": rows,
        "per_device_eval_batch_size": rows,
        "gradient_accumulation_steps": 1,
        "save_only_model": True,
        "gradient_checkpointing": bool(t.gradient_checkpointing and torch.cuda.is_available()),
        # Liger patches the whole model's norm, embedding and head in place; a stage holds identities there
        "use_liger_kernel": False,
    }


def pipeline_trainer(base: type, stage: str, section: TrainingStage) -> type:
    """`base` (the transformers Trainer or TRL's SFTTrainer) training the stage's model as a pipeline; `base`
    itself where the run has one stage. Making one refuses (NotSupportedHere) a model the stages cannot cut."""
    stages = pipeline_parallel_size(section)
    if stages == 1:
        return base
    training = section.training

    class PipelineTrainer(base):  # type: ignore[misc, valid-type]
        """The Trainer with its step, clipping, rows, evaluation and saving over the pipeline's stages."""

        def __init__(
            self, *args: Any, model: Any, processing_class: Any, data_collator: Any = None, **kwargs: Any
        ) -> None:
            trainer_args = kwargs["args"]
            check_fits(stage, section, model.config)
            if trainer_args.fp16:
                raise NotSupportedHere(
                    f"stages.{stage}.distributed.pipeline_parallel trains in bf16 or float32; this model's weights "
                    "are float16 (set model.dtype: bfloat16), or set pipeline_parallel to 1"
                )
            self.pipeline = Pipeline(
                model,
                stages,
                training.gradient_accumulation_steps,
                trainer_args.device,
                trainer_args.bf16,
                loaded_once=loads_once(section),
                tensor=tensor_parallel_size(section),
                expert=expert_parallel_size(section),
                reference=self.keeps_reference(model, trainer_args),
            )
            if self.pipeline.reference_part is not None and "ref_model" in kwargs:
                kwargs["ref_model"] = self.pipeline.reference_part.model  # the reference TRL runs: the stage's copy
            # The stage owns its placement and gradient reduction: the Trainer neither wraps nor moves it, as
            # for a model transformers sharded as it loaded (its flag; `checkpoint_sharded` then keeps the shards)
            self.pipeline.causal._is_distributed_loading_by_transformers = True
            collator = self.fixed_shape_collator(data_collator, processing_class.pad_token_id)
            if collator is not None:  # (GRPOTrainer takes none: it lays its rows out once generated)
                kwargs["data_collator"] = collator
            super().__init__(*args, model=model, processing_class=processing_class, **kwargs)
            # a stage's checkpoint shards under its own key: each stage's optimizer groups name its own parameters
            self.sharded_state_key = f"stage-{self.pipeline.layout.stage}"

        def keeps_reference(self, model: Any, args: Any) -> bool:
            """Whether the stage keeps a frozen copy of its starting weights (`Pipeline`'s `reference`)."""
            return False

        def fixed_shape_collator(self, data_collator: Any, pad_token_id: int) -> Any:
            """The collator of the step's batches, each of the shape the schedule planned: `data_collator`'s rows
            padded (`FixedShapeCollator`)."""
            rows = training.per_device_batch_size * training.gradient_accumulation_steps
            return FixedShapeCollator(data_collator, rows, training.max_seq_length, pad_token_id)

        def _sync_replicated_trainable_parameters(self, model: Any) -> None:
            pass  # each stage holds its own parameters; FSDP2 keeps a stage's replicas equal

        def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
            # every stage of a pipeline reads the same rows: shard over the pipelines, not the world
            from accelerate.data_loader import BatchSamplerShard

            loader = super()._get_dataloader(*args, **kwargs)
            shard = getattr(loader, "batch_sampler", None)
            if isinstance(shard, BatchSamplerShard):
                shard.num_processes = self.pipeline.layout.pipelines
                shard.process_index = self.pipeline.layout.pipeline
                if not kwargs.get("is_training", False):
                    shard.even_batches = False  # no row evaluated twice
            return loader

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
            self.pipeline.part.train()
            inputs = self._prepare_inputs(inputs)
            self.pipeline.tokens = self.pipeline.tokens_in(inputs["labels"])
            loss = self.pipeline.run(inputs, train=True)
            self.pipeline.sum_tied_gradients()
            return loss

        def _clip_grad_norm(self, model: Any) -> torch.Tensor:
            return self.pipeline.gradient_norm(self.args.max_grad_norm)

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            return self.pipeline.gradient_norm(None) if grad_norm is None else grad_norm

        def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
            tokens = torch.as_tensor(inputs["input_ids"].numel(), device=self.args.device)
            dist.all_reduce(tokens, group=self.pipeline.layout.replica_group)
            self.state.num_input_tokens_seen += int(tokens.item())

        def evaluate(
            self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
        ) -> dict[str, float]:
            import time

            began = time.time()
            self.pipeline.part.eval()
            device = self.args.device
            total, tokens = torch.zeros((), device=device), torch.zeros((), device=device, dtype=torch.long)
            self.pipeline.tokens = 1  # the micro-batches' losses are their sums
            rows, width = training.per_device_batch_size * training.gradient_accumulation_steps, training.max_seq_length
            unlabelled = pad_rows(
                {key: torch.zeros((0, width), dtype=torch.long) for key in ("input_ids", "labels", "position_ids")},
                rows,
                width,
                self.processing_class.pad_token_id,
            )
            with torch.no_grad():
                for batch in self.evaluation_batches(eval_dataset, unlabelled):
                    summed = self.pipeline.run(batch, train=False) / self.pipeline.layout.pipelines
                    if self.pipeline.layout.last:
                        total += summed
                        tokens += (batch["labels"][..., 1:] != IGNORE_INDEX).sum()
            dist.all_reduce(total)
            dist.all_reduce(tokens)
            self.pipeline.part.train()
            metrics = {
                f"{metric_key_prefix}_loss": (total / tokens.clamp(min=1)).item(),
                f"{metric_key_prefix}_runtime": round(time.time() - began, 4),
            }
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

        def evaluation_batches(self, eval_dataset: Any, empty: dict[str, torch.Tensor]) -> Iterator[dict[str, Any]]:
            """The held-out batches on the device, as many on every pipeline as on the longest one (a stage's FSDP2
            gathers its weights with its replicas in every forward): a pipeline out of rows gets `empty`, a batch
            without labels (no loss, no tokens)."""
            loader = self.get_eval_dataloader(eval_dataset)
            batches, count = iter(loader), torch.tensor(len(loader), device=self.args.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            for _ in range(int(count.item())):
                yield self._prepare_inputs(next(batches, empty))

        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            out = Path(output_dir if output_dir is not None else self.args.output_dir)
            (save_adapter if self.pipeline.adapter else save_whole)(self.pipeline, self.model, out)
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(out)
                torch.save(self.args, out / "training_args.bin")

    PipelineTrainer.__name__ = PipelineTrainer.__qualname__ = f"Pipeline{base.__name__}"
    return PipelineTrainer


INDEX_FILE = "model.safetensors.index.json"


def save_whole(pipeline: Pipeline, model: Any, out: Path) -> None:
    """Every rank: the whole model into `out` as one Hugging Face folder. Each stage's first replica saves its part
    with `save_pretrained` into `out/.stage-<k>/`; rank 0 moves the parts' files in as
    `model-<k+1>-of-<P>.safetensors` (a stage too big for one file keeps its own shards, renamed), writes the index
    over all of them and stage 0's config files, and removes the parts' folders."""
    layout = pipeline.layout
    part_dir = out / f".stage-{layout.stage}"
    # the stage's weights whole: gathered over its replicas (every one takes part), in the dtype it is saved in
    state = {name: _full(tensor) for name, tensor in model.state_dict().items()}
    if pipeline.tied and not layout.first:  # the tied head is the first stage's embedding, saved there once
        tied = getattr(model, "_tied_weights_keys", None) or {}
        state = {name: t for name, t in state.items() if name not in tied}
    if pipeline.save_dtype is not None:
        state = {name: t.to(pipeline.save_dtype) if t.is_floating_point() else t for name, t in state.items()}
    if layout.writes:
        if part_dir.exists():
            shutil.rmtree(part_dir)
        model.save_pretrained(part_dir, state_dict=state, is_main_process=True, max_shard_size="1000GB")
    del state
    dist.barrier()
    if dist.get_rank() == 0:
        weight_map: dict[str, str] = {}
        total = 0
        for stage in range(layout.stages):
            folder = out / f".stage-{stage}"
            index = folder / INDEX_FILE
            if index.is_file():
                files = json.loads(index.read_text())["weight_map"]
            else:
                files = {name: "model.safetensors" for name in _tensor_names(folder / "model.safetensors")}
            names = sorted(set(files.values()))
            renamed = {
                name: f"model-{stage + 1:05d}-of-{layout.stages:05d}.safetensors"
                if len(names) == 1
                else f"model-{stage + 1:05d}-of-{layout.stages:05d}-{i + 1:03d}.safetensors"
                for i, name in enumerate(names)
            }
            for name, new in renamed.items():
                total += (folder / name).stat().st_size
                (folder / name).replace(out / new)
            weight_map |= {key: renamed[file] for key, file in files.items()}
            if stage == 0:
                for extra in folder.iterdir():
                    if extra.suffix == ".json" and extra.name != INDEX_FILE:
                        extra.replace(out / extra.name)
            shutil.rmtree(folder)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    dist.barrier()


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def save_adapter(pipeline: Pipeline, model: Any, out: Path) -> None:
    """Every rank: a LoRA model's adapter into `out` as one PEFT folder, as a one-process run writes it. Each stage
    takes its part of the adapter as PEFT saves it (`get_peft_model_state_dict`: its layers' LoRA factors, and on
    the ends the embedding's trained token rows and the trained head), gathered over its replicas; each stage's
    first replica writes it to `out/.stage-<k>/`; rank 0 writes every part into one `adapter_model.safetensors`,
    the adapter's config beside it, and removes the parts' folders."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    layout = pipeline.layout
    part_dir = out / f".stage-{layout.stage}"
    # PEFT picks the adapter's tensors by name and passes them through; each is then gathered (every replica)
    picked = get_peft_model_state_dict(model, state_dict=model.state_dict())
    state = {name: _full(tensor).detach().cpu().contiguous() for name, tensor in picked.items()}
    if layout.writes:
        part_dir.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.clone() for name, tensor in state.items()}, part_dir / ADAPTER_WEIGHTS)
    del state
    dist.barrier()
    if dist.get_rank() == 0:
        adapter: dict[str, torch.Tensor] = {}
        for stage in range(layout.stages):
            folder = out / f".stage-{stage}"
            adapter |= load_file(folder / ADAPTER_WEIGHTS)
            shutil.rmtree(folder)
        save_file(dict(sorted(adapter.items())), out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        config = model.peft_config["default"]
        inference_mode = config.inference_mode
        if config.base_model_name_or_path is None:  # as PEFT's save_pretrained fills it
            config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path") or None
        config.inference_mode = True
        config.save_pretrained(str(out))
        config.inference_mode = inference_mode
        model.create_or_update_model_card(str(out))
    dist.barrier()


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())
