"""Run by tests/test_ddp.py under torchrun (two CPU processes, gloo): a tiny Qwen3 prepared by accelerate's FSDP2 in
bf16 mixed precision with the plugin transformers' Trainer builds from the arguments korean-llm's cpt stage builds
(`fsdp_settings` through `stages.training.build_config`), as the Trainer hands it over (accelerate's state then sets
the mixed precision, keeping a policy the plugin has). Rank 0 writes `OUT`: the policy's dtypes, the dtype of the
loss the prepared model returns, and of the gradients FSDP2 reduced.

accelerate turns FSDP on for GPU jobs only (a CPU job gets DDP), so its state is set to FSDP here.

    torchrun --standalone --nproc-per-node 2 tests/fsdp_precision_check.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainingArguments

from spec.loading import load_pipeline
from stages.distributed import fsdp_settings
from stages.training import build_config


def main(out: Path) -> None:
    section = load_pipeline("korean-llm").spec.stages.cpt  # FSDP2
    settings = fsdp_settings(section.distributed, ["Qwen3DecoderLayer"])
    arguments = {"output_dir": str(out.parent / "args"), "use_cpu": True, "bf16": True, "report_to": "none"}
    args = build_config(SimpleNamespace(stage="cpt", section=section), TrainingArguments, {**arguments, **settings})
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)  # as the Trainer does
    plugin.set_mixed_precision("bf16")  # as accelerate's state does with the Trainer's plugin
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # FSDP2 prepares the two together
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own rows: the reduction sums different gradients
    ids = torch.randint(0, 256, (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    if dist.get_rank() == 0:
        record = {
            "param_dtype": str(plugin.mixed_precision_policy.param_dtype),
            "reduce_dtype": str(plugin.mixed_precision_policy.reduce_dtype),
            "output_dtype": str(plugin.mixed_precision_policy.output_dtype),
            "loss_dtype": str(loss.dtype),
            "grad_dtypes": sorted(grads),
        }
        out.write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    dist.destroy_process_group()
