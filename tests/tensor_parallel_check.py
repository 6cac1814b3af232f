"""Run by tests/test_tensor_parallel.py under torchrun (two CPU processes, gloo): each run directory's cpt stage
loads its starting model as the stage does with `distributed.tensor_parallel: 2` (`stages.modeling.
load_starting_model`: each rank reads its shards of the checkpoint, split by the family's tensor-parallel plan),
and the same checkpoint is loaded whole. Both take one forward and backward pass on the same two packed rows (two
documents a row, positions restarting); rank 0 writes `<out>/<family>.json`: the loss of each, the cosine of their
logits, how many parameters are split (DTensors sharded over the group), and the largest difference between a split
parameter's gathered gradient and the whole model's.

    torchrun --standalone --nproc-per-node 2 tests/tensor_parallel_check.py OUT FAMILY=RUN_DIR [FAMILY=RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM

from run.run_dir import RunDir
from stages.modeling import load_starting_model, load_tokenizer


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check(run_root: Path) -> dict[str, object]:
    run_dir = RunDir(run_root)
    spec = run_dir.load_spec()
    tokenizer = load_tokenizer(run_dir, spec.model)
    split = load_starting_model(run_dir, spec, "cpt", tokenizer).model
    whole = AutoModelForCausalLM.from_pretrained(  # as the stage loads it: its dtype, its (document-masking) attention
        spec.model.name_or_path,
        dtype=next(split.parameters()).dtype,
        attn_implementation=split.config._attn_implementation,
    )
    torch.manual_seed(0)
    ids = torch.randint(3, whole.config.vocab_size, (2, 24))
    positions = torch.cat([torch.arange(16), torch.arange(8)]).repeat(2, 1)  # two documents a row
    losses, logits = {}, {}
    for name, model in (("split", split), ("whole", whole)):
        out = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)  # as training runs
        out.loss.backward()
        losses[name] = float(full(out.loss))
        logits[name] = full(out.logits).detach().flatten()
    gradients = dict(whole.named_parameters())
    differences = [(full(p.grad) - gradients[name].grad).abs().max().item() for name, p in split.named_parameters()]
    sharded = [
        p for p in split.parameters() if isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements)
    ]
    return {
        "dtype": str(next(split.parameters()).dtype),
        "attention": split.config._attn_implementation,
        "loss_split": losses["split"],
        "loss_whole": losses["whole"],
        "parameters": len(differences),
        "split_parameters": len(sharded),
        "logits_cosine": torch.nn.functional.cosine_similarity(logits["split"], logits["whole"], 0).item(),
        "largest_gradient_difference": max(differences),
        "largest_gradient": max(p.grad.abs().max().item() for p in whole.parameters()),
    }


def main() -> None:
    out, checks = Path(sys.argv[1]), [arg.split("=", 1) for arg in sys.argv[2:]]
    dist.init_process_group("gloo")
    for family, root in checks:
        report = check(Path(root))
        if dist.get_rank() == 0:
            (out / f"{family}.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
