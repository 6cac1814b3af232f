"""Benchmark check (not a test): every shape a packing stage meets runs through flex attention on a GPU.

    python bench/flex_shapes.py --out DIR                       # dense (Qwen3-1.7B attention) and MoE (30B-A3B)
    python bench/flex_shapes.py --out DIR --variants library    # only transformers' own compile

A packing stage (cpt, sft with packing) switches to flex attention on a GPU (`stages.modeling.packed_attention`)
and trains at one shape. A run meets others: the last partial batch, the eval passes (no gradient), shorter rows,
a single document alone. On an H100 on 2026-11-27 the bench's document-boundary check (a no-grad forward of one
short document) failed with Inductor's `NoValidChoicesError ... target: flex_attention`. Each variant runs in a
process of its own (compiled kernels are per process), over the same sequence of shapes, and records per shape
whether it ran, how long it took (the first variant's compiles fill the kernel caches the others reuse) and the
error:

- `library`: flex attention as transformers switches to it (`set_attn_implementation`);
- `stage`: as the stage switches to it (`stages.modeling.use_attention`: FLEX_KERNEL_OPTIONS on every forward).

Attention's shapes are per layer, so two decoder layers of each model stand for all of them. The last check is
the document boundary: the last document's logits inside the packed row against the same document alone (relative
L2 error: bf16 noise is about 1e-2, attention across documents about 1). Results: DIR/flex_shapes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpu_cases import SHAPES

REPO = Path(__file__).resolve().parent.parent

MODELS = {"dense": "qwen3-1.7b", "moe": "qwen3-30b-a3b"}
"""The benchmark's shapes (bench/gpu_cases.py SHAPES) whose attention (and experts) the check runs."""

LENGTH = 4096
BATCH = 4
STEPS: list[tuple[str, str, int, int]] = [  # (name, mode, batch, length)
    ("train", "train", BATCH, LENGTH),
    ("train again", "train", BATCH, LENGTH),
    ("last partial batch", "train", BATCH - 1, LENGTH),
    ("eval batch", "eval", BATCH, LENGTH),
    ("eval one row", "eval", 1, LENGTH),
    ("eval shorter row", "eval", 1, 1536),
    ("train shorter rows", "train", BATCH, LENGTH // 2),
]


def packed_positions(batch: int, length: int, seed: int) -> list[list[int]]:
    """Position ids of rows packed with documents of 200 to 1,800 tokens (the last one cut at the row's end)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < length:
            row += list(range(min(rng.randint(200, 1800), length - len(row))))
        rows.append(row)
    return rows


def build(kind: str, device: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {**SHAPES[MODELS[kind]], "num_hidden_layers": 2}
    config = AutoConfig.for_model(
        shape.pop("architecture", "qwen3"), vocab_size=32000, max_position_embeddings=LENGTH, **shape
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="flex_attention")
    if hasattr(model, "set_experts_implementation") and kind == "moe":
        model.set_experts_implementation("grouped_mm")
    model.config.use_cache = False
    return model


def run_variant(kind: str, variant: str) -> dict[str, Any]:
    """The sequence of shapes in this process, under `variant`."""
    import torch

    device = torch.device("cuda")
    model = build(kind, device)
    if variant == "stage":
        sys.path.insert(0, str(REPO))
        from stages.modeling import use_attention

        use_attention(model, "flex_attention")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    results: list[dict[str, Any]] = []
    for index, (name, mode, batch, length) in enumerate(STEPS):
        ids = torch.randint(0, 32000, (batch, length), device=device, generator=None)
        positions = torch.tensor(packed_positions(batch, length, index), device=device)
        started = time.monotonic()
        try:
            if mode == "train":
                model.train()
                loss = model(input_ids=ids, position_ids=positions, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                model.eval()
                with torch.no_grad():
                    model(input_ids=ids, position_ids=positions)
            torch.cuda.synchronize()
            results.append({"step": name, "batch": batch, "length": length, "ok": True})
        except Exception as exc:  # recorded: the next shapes still run
            results.append({"step": name, "batch": batch, "length": length, "ok": False, "error": _short(exc)})
        results[-1]["seconds"] = round(time.monotonic() - started, 2)
    results.append(boundary(model, device))
    return {"model": kind, "variant": variant, "steps": results, "device": torch.cuda.get_device_name()}


def boundary(model: Any, device: Any) -> dict[str, Any]:
    """The last document of a packed row against the same document alone."""
    import torch

    (row,) = packed_positions(1, LENGTH, 99)
    last = max(i for i, p in enumerate(row) if p == 0)
    ids = torch.randint(0, 32000, (1, LENGTH), device=device)
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=torch.tensor([row], device=device)).logits[0, last:].float()
            alone = model(input_ids=ids[:, last:], position_ids=torch.tensor([row[last:]], device=device)).logits[0]
    except Exception as exc:
        return {"step": "document boundary", "ok": False, "error": _short(exc)}
    error = ((packed - alone.float()).norm() / alone.float().norm()).item()
    return {"step": "document boundary", "ok": error < 0.05, "packed_vs_alone": error, "alone_length": LENGTH - last}


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc!s}"
    return " ".join(text.split())[:400]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--variants", default="library,stage")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        try:
            print(json.dumps(run_variant(*args.one)))
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for kind in args.models.split(","):
        for variant in args.variants.split(","):
            command = [sys.executable, __file__, "--one", kind, variant]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ, timeout=1200, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            result = (
                json.loads(lines[-1]) if lines else {"model": kind, "variant": variant, "failed": done.stderr[-2000:]}
            )
            results.append(result)
            ok = [s["step"] for s in result.get("steps", []) if s.get("ok")]
            bad = [f"{s['step']}: {s.get('error', '')[:160]}" for s in result.get("steps", []) if not s.get("ok")]
            print(f"{kind} {variant}: {len(ok)} ok; failed: {bad or result.get('failed', 'none')}", flush=True)
    (out / "flex_shapes.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
