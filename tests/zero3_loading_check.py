"""Run by tests/test_sharded_loading.py under torchrun (two CPU processes, gloo): a training stage under DeepSpeed
ZeRO-3, through the stage's own code (`python -m stages STAGE --run-dir DIR`), with its model load watched.

Three things keep DeepSpeed off a CPU job, and only those are changed here:
- the stage refuses DeepSpeed without GPUs (`stages.distributed.check_strategy`): not checked;
- on CPU the Trainer runs plain float32 on the CPU (`precision_arguments` says use_cpu), and accelerate then never
  starts DeepSpeed: the precision is float32 without use_cpu;
- accelerate picks a backend only for accelerators (none on a CPU, so it sees one process): gloo, and DeepSpeed's
  CPU accelerator does the rest. DeepSpeed's shared-memory all-reduce (a C++ op it would compile first, a minute
  or more) is left out: gloo reduces.

Each rank writes `<out>/rank-<r>.json`: whether transformers saw ZeRO-3 when `from_pretrained` (or `from_config`)
ran, whether every parameter of the starting model is partitioned, the elements this rank holds against the whole
model's, the base weights that, gathered, differ from the checkpoint, and whether DeepSpeed's backend holds its
shared-memory all-reduce. The stage then trains and saves as usual.

    torchrun --standalone --nproc-per-node 2 tests/zero3_loading_check.py OUT STAGE --run-dir RUN_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm.torch
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from transformers.integrations import is_deepspeed_zero3_enabled

import stages.distributed
import stages.modeling
import stages.rlhf
import stages.training

OUT = Path(sys.argv[1])
report: dict[str, Any] = {}

# `deepspeed.comm.torch` reads as torch itself (deepspeed.comm re-exports it), so the module is patched by its name.
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
stages.distributed.check_strategy = lambda stage, distributed: None
stages.training.precision_arguments = lambda dtype: {"bf16": False, "fp16": False}
prepare_backend = PartialState._prepare_backend


def gloo_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
    chosen = prepare_backend(self, cpu, sagemaker_dp, backend)
    return chosen if chosen[0] is not None else ("gloo", DistributedType.MULTI_CPU)


PartialState._prepare_backend = gloo_backend

load_pretrained, build_from_config = stages.modeling.load_pretrained, stages.modeling.build_from_config


def watched(load: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        report.setdefault("zero3_at_load", []).append(is_deepspeed_zero3_enabled())
        return load(*args, **kwargs)

    return wrapper


stages.modeling.load_pretrained = watched(load_pretrained)
stages.modeling.build_from_config = watched(build_from_config)
load_starting_model = stages.modeling.load_starting_model


def checkpoint_name(name: str) -> str:
    """A parameter's name in the base checkpoint (PEFT's wrapper and LoRA layers add to it)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def describe_load(model: Any, spec: Any) -> dict[str, Any]:
    """Which parameters of `model` are partitioned, the elements this rank holds, and, gathered, which differ from
    the base checkpoint."""
    params = dict(model.named_parameters())
    out: dict[str, Any] = {
        "partitioned": sorted(name for name, p in params.items() if hasattr(p, "ds_numel")),
        "whole": sorted(name for name, p in params.items() if not hasattr(p, "ds_numel")),
        "held_elements": sum(p.ds_tensor.numel() for p in params.values() if hasattr(p, "ds_numel")),
        "model_elements": sum(p.ds_numel for p in params.values() if hasattr(p, "ds_numel")),
    }
    source = Path(spec.model.name_or_path) / "model.safetensors"
    if source.is_file():
        saved = load_file(source)
        differing = []
        for name, param in params.items():
            key = checkpoint_name(name)
            if key in saved and hasattr(param, "ds_numel"):
                with deepspeed.zero.GatheredParameters([param]):
                    if not torch.equal(param.data.float(), saved[key].float()):
                        differing.append(name)
        out["checked_weights"] = sum(checkpoint_name(name) in saved for name in params)
        out["differing_weights"] = differing
    return out


def watched_start(run_dir: Any, spec: Any, stage: str, *args: Any, **kwargs: Any) -> Any:
    start = load_starting_model(run_dir, spec, stage, *args, **kwargs)
    report.update(describe_load(start.model, spec))
    backend = sys.modules["deepspeed.comm.comm"].cdb  # DeepSpeed's communication backend, started by the load
    report["shm_all_reduce"] = getattr(backend, "shm_comm_op", None) is not None
    return start


frozen_reference = stages.rlhf.frozen_reference


def watched_reference(ctx: Any, start: Any, tokenizer: Any) -> Any:
    """rlhf's reference model, described as the starting model is (`reference` in the report)."""
    reference = frozen_reference(ctx, start, tokenizer)
    if reference is not None:
        report["reference"] = describe_load(reference, ctx.spec)
    return reference


for module in ("stages.cpt", "stages.sft", "stages.rlhf"):
    __import__(module)
    sys.modules[module].load_starting_model = watched_start  # type: ignore[attr-defined]
stages.rlhf.frozen_reference = watched_reference

from stages.__main__ import main  # noqa: E402  (after the patches)

code = main(sys.argv[2:])
OUT.mkdir(parents=True, exist_ok=True)
(OUT / f"rank-{os.environ['RANK']}.json").write_text(json.dumps({**report, "exit": code}, indent=1), encoding="utf-8")
sys.exit(code)
