"""Benchmark (not a test): host memory of a node while an FSDP2 or ZeRO-3 stage loads a checkpoint, one copy per
rank or once.

    python bench/loading_memory.py checkpoint DIR [--shape qwen3-8b]        # random weights in the Hugging Face layout
    torchrun --standalone --nproc-per-node 4 bench/loading_memory.py load DIR --mode once --out OUT
    torchrun --standalone --nproc-per-node 4 bench/loading_memory.py load DIR --strategy zero3 --mode once --out OUT

`checkpoint` writes a model of the shape (bench/gpu_cases.py SHAPES) as `save_pretrained` does: bf16 safetensors
in shards of 5 GB with their index, and config.json. `load` loads it as a training stage does
(`stages.modeling.load_base`), gives it to the transformers Trainer with the stage's FSDP2 settings
(`stages.distributed.fsdp_settings`) and trains one step, while local rank 0 samples, every 50 ms, the resident
memory of every rank (VmRSS, and its anonymous part RssAnon) and the node's used memory (MemTotal - MemAvailable,
which leaves out the page cache the kernel can drop). Modes:
- every-rank: every rank reads the whole checkpoint (the stage before stages/sharded_loading.py);
- once: rank 0 alone reads it, onto its GPU where it fits, the others build a skeleton on the meta device;
- once-host: as once, with rank 0 loading into host memory (as it does for a model too big for its GPU).
With `--strategy zero3` the Trainer gets the stage's generated ZeRO-3 config (`stages.distributed.strategy_arguments`)
instead, and the modes are:
- every-rank: every rank loads the whole model, DeepSpeed partitions it when the Trainer starts (the stage before
  `stages.distributed.zero3_loading`);
- once: the stage's `zero3_loading` first, so transformers creates the model partitioned (zero.Init) and rank 0
  alone reads the checkpoint.
Rank 0 writes OUT/<mode>.json (OUT/zero3-<mode>.json): the peaks, the checkpoint's size, and the peaks as copies of
it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

GIB = 2**30


def memory_of(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of a process in bytes; (0, 0) once it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return 0, 0
    return int(fields.get("VmRSS", "0 kB").split()[0]) * 1024, int(fields.get("RssAnon", "0 kB").split()[0]) * 1024


def node_used() -> int:
    """MemTotal - MemAvailable in bytes."""
    info = {
        k: int(v.split()[0]) * 1024
        for k, v in (ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
    }
    return info["MemTotal"] - info["MemAvailable"]


def siblings() -> list[int]:
    """The processes the torchrun agent started: this one and the other ranks on this node."""
    agent, found = os.getppid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


class Sampler(threading.Thread):
    """Peaks of the ranks' summed memory and of the node's used memory, over its baseline at the start."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids, self.baseline = siblings(), node_used()
        self.peak_rss = self.peak_anon = self.peak_node = 0
        self.first_rss: int | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            rss = anon = 0
            for pid in self.pids:
                r, a = memory_of(pid)
                rss, anon = rss + r, anon + a
            if self.first_rss is None:
                self.first_rss = rss  # the ranks with their imports done, before any weight
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
            self.peak_node = max(self.peak_node, node_used() - self.baseline)
            time.sleep(0.05)


def checkpoint(directory: Path, shape: str) -> None:
    """Random weights of `shape`, saved as a Hugging Face checkpoint (bf16 safetensors shards, index, config)."""
    import torch
    from gpu_cases import SHAPES, VOCAB
    from gpu_suite import fake_tokenizer

    from spec.model import ModelSpec, TinyModelConfig
    from stages.modeling import build_from_config

    spec = ModelSpec(name_or_path=f"Qwen/{shape}", dtype="bfloat16", from_config=TinyModelConfig(**SHAPES[shape]))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    with device:
        model = build_from_config(spec, fake_tokenizer(VOCAB))
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="5GB")
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    print(f"{directory}: {size / GIB:.1f} GiB of safetensors", flush=True)


def zero3_stage() -> Any:
    """A training stage under the generated ZeRO-3 config, one row per GPU per step."""
    from spec.loading import load_pipeline
    from spec.training import DistributedSpec

    cpt = load_pipeline("korean-llm").spec.stage("cpt")
    training = cpt.training.model_copy(update={"per_device_batch_size": 1, "gradient_accumulation_steps": 1})
    return cpt.model_copy(
        update={"method": "full", "distributed": DistributedSpec(strategy="deepspeed_zero3"), "training": training}
    )


def load(directory: Path, mode: str, out: Path, strategy: str = "fsdp") -> None:
    """Load `directory` as an FSDP2 or ZeRO-3 stage does in `mode`, train one step, and record the node's memory."""
    import torch
    from datasets import Dataset
    from gpu_cases import VOCAB
    from gpu_suite import fake_tokenizer
    from transformers import Trainer, TrainingArguments

    from spec.model import ModelSpec
    from spec.training import DistributedSpec
    from stages import modeling
    from stages.distributed import fsdp_settings, precision_arguments, strategy_arguments, zero3_loading
    from stages.modeling import BaseRef, load_base

    local_rank, rank = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    sampler = Sampler() if local_rank == 0 else None
    if sampler is not None:
        sampler.start()
    if mode == "once-host":
        modeling.first_rank_placement = lambda parameters: {}  # type: ignore[assignment]
    once = mode != "every-rank"
    zero3 = strategy == "zero3"
    started = time.perf_counter()
    keep = zero3_loading("cpt", zero3_stage(), torch.bfloat16) if zero3 and once else None  # as load_starting_model
    spec = type("Spec", (), {"model": ModelSpec(name_or_path=str(directory), dtype="bfloat16")})()
    tokenizer = fake_tokenizer(VOCAB)
    model = load_base(None, spec, BaseRef("pretrained", str(directory)), tokenizer, once=once and not zero3)  # type: ignore[arg-type]
    loaded_s = time.perf_counter() - started
    partitioned = sum(hasattr(p, "ds_numel") for p in model.parameters())
    model.config.use_cache = False
    if zero3:
        settings = {"deepspeed": strategy_arguments("cpt", zero3_stage(), model)["deepspeed"]}
    else:
        settings = fsdp_settings(DistributedSpec(strategy="fsdp"), list(model._no_split_modules), True, once=once)
    args = TrainingArguments(
        output_dir=str(out / f"trainer-{mode}"),
        per_device_train_batch_size=1,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **precision_arguments(torch.bfloat16),
        **settings,
    )
    rows = Dataset.from_dict({"input_ids": [list(range(1, 513))] * 8, "labels": [list(range(1, 513))] * 8})
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    del keep  # the Trainer's arguments made their own DeepSpeed config
    trainer.train()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    optimizer_check: dict[str, Any] = {  # every rank's optimizer steps each sharded parameter once; its state saves
        "optimizer_parameters": len(held),
        "optimizer_distinct": len({id(p) for p in held}),
        "partitioned_at_load": partitioned,
    }
    if not zero3:
        optimizer_check["optimizer_state_entries"] = len(
            get_optimizer_state_dict(trainer.model, trainer.optimizer)["state"]
        )
    checks: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(checks, optimizer_check)
    torch.distributed.barrier()
    if sampler is not None:
        sampler.done.set()
        sampler.join()
    if rank == 0 and sampler is not None:
        size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        result: dict[str, Any] = {
            "strategy": strategy,
            "mode": mode,
            "ranks_on_node": len(sampler.pids),
            "checkpoint_gib": size / GIB,
            "peak_rss_sum_gib": sampler.peak_rss / GIB,
            "peak_anon_sum_gib": sampler.peak_anon / GIB,
            "rss_sum_before_load_gib": (sampler.first_rss or 0) / GIB,
            "peak_rss_over_before_load_gib": (sampler.peak_rss - (sampler.first_rss or 0)) / GIB,
            "peak_node_used_gib": sampler.peak_node / GIB,
            "rss_copies": sampler.peak_rss / size,
            "rss_over_before_load_copies": (sampler.peak_rss - (sampler.first_rss or 0)) / size,
            "anon_copies": sampler.peak_anon / size,
            "node_copies": sampler.peak_node / size,
            "load_s": loaded_s,
            "optimizer_by_rank": checks,
            "loss": trainer.state.log_history[-1].get("train_loss"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        }
        out.mkdir(parents=True, exist_ok=True)
        name = f"zero3-{mode}.json" if zero3 else f"{mode}.json"
        (out / name).write_text(json.dumps(result, indent=1), encoding="utf-8")
        print("RESULT", json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["checkpoint", "load"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--mode", default="once", choices=["every-rank", "once", "once-host"])
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "zero3"])
    parser.add_argument("--out", type=Path, default=Path("loading-memory"))
    args = parser.parse_args()
    if args.strategy == "zero3" and args.mode == "once-host":
        parser.error("--mode once-host is FSDP2's: under ZeRO-3 rank 0 always reads the checkpoint into host memory")
    if args.command == "checkpoint":
        checkpoint(args.directory, args.shape)
    else:
        load(args.directory, args.mode, args.out, args.strategy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
