"""Run by tests/test_sharded_loading.py under torchrun (two CPU processes, gloo): each run directory's training
stage loads its starting model as the stage does under FSDP2 (`stages.modeling.load_starting_model`), creates its
optimizer, and has accelerate prepare both, as transformers' Trainer does for FSDP2 (optimizer first, then
`accelerator.prepare(model, optimizer)`), with the FSDP plugin the Trainer builds from the stage's settings.

accelerate turns FSDP on for GPU jobs only (a CPU job gets DDP), so its state is set to FSDP here; the preparation
that runs is accelerate's own (meta-device move, sharding, broadcast from rank 0, the optimizer's parameters swapped
for the sharded ones). Each rank writes `<out>/rank-<r>.json`: whether its model was a skeleton before, the bytes its
parameters held then, and after the preparation whether every weight and buffer matches what rank 0 loaded, whether
the optimizer holds each sharded parameter exactly once, the loss of one step, and the optimizer state's entries
after it (what a checkpoint saves).

    torchrun --standalone --nproc-per-node 2 tests/sharded_loading_check.py OUT STAGE=RUN_DIR [STAGE=RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from transformers import TrainingArguments

from run.run_dir import RunDir
from stages.distributed import fsdp_settings
from stages.modeling import load_starting_model, load_tokenizer
from stages.sharded_loading import loads_once, on_meta


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float()


def check(run_root: Path, stage: str, out: Path) -> dict[str, object]:
    run_dir = RunDir(run_root)
    spec = run_dir.load_spec()
    section = spec.stage(stage)
    tokenizer = load_tokenizer(run_dir, spec.model)
    model = load_starting_model(run_dir, spec, stage, tokenizer).model
    rank = dist.get_rank()
    report: dict[str, object] = {
        "loads_once": loads_once(section),
        "skeleton": on_meta(model),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta),
    }
    loaded = {name: full(value).clone() for name, value in model.state_dict().items()} if rank == 0 else {}

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    settings = fsdp_settings(section.distributed, list(base._no_split_modules), once=loads_once(section))
    args = TrainingArguments(output_dir=str(out / "args"), use_cpu=True, report_to="none", **settings)
    accelerator = Accelerator(cpu=True)
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)  # as the Trainer does
    accelerator.state.distributed_type = DistributedType.FSDP
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    weights = {name: full(value) for name, value in model.state_dict().items()}
    expected = [loaded if rank == 0 else None]
    dist.broadcast_object_list(expected, src=0)
    report["weights"] = len(weights)
    report["differing_weights"] = sorted(
        name for name, value in weights.items() if not torch.equal(value, expected[0].get(name, torch.empty(0)))
    )
    buffers = {name: full(value) for name, value in model.named_buffers()}
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, buffers)
    report["differing_buffers"] = sorted(
        name
        for name, value in buffers.items()
        if not torch.equal(value, gathered[0][name])  # type: ignore[index]
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    held = [p for group in optimizer.param_groups for p in group["params"]]
    report["trained_parameters"] = len(trained)
    report["optimizer_parameters"] = len(held)
    report["optimizer_holds_each_once"] = {id(p) for p in held} == {id(p) for p in trained} == set(map(id, held))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    loss = model(input_ids=ids, labels=ids).loss
    report["loss"] = float(loss)
    loss.backward()
    optimizer.step()
    report["optimizer_state_entries"] = len(get_optimizer_state_dict(model, optimizer)["state"])
    return report


def main() -> None:
    out, checks = Path(sys.argv[1]), [arg.split("=", 1) for arg in sys.argv[2:]]
    dist.init_process_group("gloo")
    PartialState(cpu=True)  # accelerate's logging needs its state
    reports = {root: check(Path(root), stage, out) for stage, root in checks}
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(reports, indent=1), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
