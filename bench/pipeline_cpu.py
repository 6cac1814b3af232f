"""Probe (not a test): pipeline parallelism for the stages' models, on this project's CPU machine: a transformers
causal LM cut into pipeline stages and trained one step by torch's own pipeline runtime
(`torch.distributed.pipelining`: PipelineStage and its GPipe / 1F1B schedules) over gloo, against the whole model.

    torchrun --nproc-per-node 2 bench/pipeline_cpu.py --out OUT [--schedule gpipe|1f1b]    # or 4 stages

Each process builds the same random tiny model of each family (Qwen3, Llama, Mistral, Gemma 3, EXAONE 4, Qwen2;
4 layers, rows of two packed documents whose position ids restart) and keeps only its stage: the layers outside its
range replaced by transformers' own `PipelineIdentityLayer` (what `transformers.distributed.pipeline_parallel` does
for inference), the embedding on the first stage only, the final norm and the head on the last. A stage's forward is
the model's own: `input_ids` on the first, the hidden states received as `inputs_embeds` on the others, the position
ids passed along beside them so every stage builds the same document masks and rotary embeddings. torch's schedule
runs the microbatches' forwards and backwards and the sends between stages. Where the head is tied to the embedding
(Gemma 3), the last stage holds the same weight as its head and the two stages' gradients of it are summed (what
Megatron does for tied embeddings) before they are compared.

Rank 0 writes `<out>/pipeline-<schedule>-<stages>.json`: per family, the microbatches' losses on the last stage
against the whole model's on the same rows, and the largest difference between any stage parameter's gradient and
the whole model's (the whole model's loss is averaged over the microbatches, as the schedule scales it). As many
microbatches as stages (at least 2): the schedules need one per stage.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FAMILIES = ("qwen3", "llama", "mistral", "gemma3", "exaone4", "qwen2")


class PipelinePart(nn.Module):
    """Stage `rank` of `size` of a causal LM: its own decoder layers (an even split, the last stage taking the rest),
    the embedding on the first stage, the norm and the head on the last."""

    def __init__(self, model: Any, rank: int, size: int) -> None:
        from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

        super().__init__()
        base = model.model
        layers = len(base.layers)
        start, end = rank * (layers // size), layers if rank == size - 1 else (rank + 1) * (layers // size)
        self.first, self.last = rank == 0, rank == size - 1
        for index in range(layers):
            if not start <= index < end:
                base.layers[index] = PipelineIdentityLayer()
        if not self.first:
            base.embed_tokens = None  # a tied head keeps the weight itself (model.lm_head.weight)
        if not self.last:
            base.norm = PipelineIdentityLayer()
            model.lm_head = None
        self.model = model

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        # position ids travel between stages as float32 (what the runtime sends); they are whole numbers
        inputs = {"position_ids": position_ids.long(), "use_cache": False}
        inputs["input_ids" if self.first else "inputs_embeds"] = x
        if self.last:
            return self.model(**inputs).logits
        return self.model.model(**inputs).last_hidden_state, position_ids


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def tiny(family: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
    shape |= {"num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    if family == "gemma3":
        family = "gemma3_text"
    config = AutoConfig.for_model(family, **shape)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def probe(family: str, schedule_name: str, microbatches: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, size = dist.get_rank(), dist.get_world_size()
    whole = tiny(family)
    part = PipelinePart(copy.deepcopy(whole), rank, size)
    tied = bool(whole.config.get_text_config().tie_word_embeddings)
    torch.manual_seed(1)
    ids = torch.randint(3, whole.config.vocab_size, (2 * microbatches, 24))
    positions = torch.cat([torch.arange(16), torch.arange(8)]).repeat(2 * microbatches, 1)  # two documents a row
    stage = PipelineStage(part, rank, size, torch.device("cpu"))
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    run = schedule(stage, n_microbatches=microbatches, loss_fn=next_token_loss)
    losses: list[torch.Tensor] = []
    if part.first:
        run.step(ids, positions.float())
    else:
        run.step(target=ids, losses=losses)
    ends = dist.new_group([0, size - 1])  # every rank takes part in making a group
    if tied and (part.first or part.last):  # first and last stage hold the tied weight: sum its two gradients
        weight = part.model.model.embed_tokens.weight if part.first else part.model.lm_head.weight
        dist.all_reduce(weight.grad, group=ends)
    reference = []
    for index in range(microbatches):
        rows = slice(2 * index, 2 * index + 2)
        loss = next_token_loss(
            whole(input_ids=ids[rows], position_ids=positions[rows], use_cache=False).logits, ids[rows]
        )
        (loss / microbatches).backward()
        reference.append(loss.item())
    expected = dict(whole.named_parameters(remove_duplicate=False))
    differences = [
        (p.grad - expected[name.removeprefix("model.")].grad).abs().max().item() for name, p in part.named_parameters()
    ]
    report = {
        "stage_losses": [float(x) for x in losses],
        "whole_losses": reference,
        "tied": tied,
        "stage_parameters": len(differences),
        "largest_gradient_difference": max(differences),
    }
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, report)
    last = gathered[-1]
    return {
        "losses": last["stage_losses"],
        "whole_losses": last["whole_losses"],
        "tied": tied,
        "parameters_per_stage": [r["stage_parameters"] for r in gathered],
        "largest_gradient_difference": max(r["largest_gradient_difference"] for r in gathered),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a directory: pipeline-<schedule>-<stages>.json")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    microbatches = max(2, dist.get_world_size())  # the schedules need at least one per stage
    results = {family: probe(family, args.schedule, microbatches) for family in FAMILIES}
    if dist.get_rank() == 0:
        record = {"torch": torch.__version__, "stages": dist.get_world_size(), "schedule": args.schedule}
        record |= {"microbatches": microbatches, **results}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"pipeline-{args.schedule}-{dist.get_world_size()}.json").write_text(
            json.dumps(record, indent=1)
        )
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
