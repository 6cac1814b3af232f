"""Benchmark (not a test): GPU memory of QLoRA on a mixture-of-experts model of Qwen3-30B-A3B's shape, random weights.

    python bench/moe_qlora_memory.py --layers 4,8,48 --out DIR  # on a CUDA GPU with bitsandbytes: DIR/results.json
    python bench/moe_qlora_memory.py --tiny --out DIR           # a smoke run of the script itself, on CPU

The shape is Qwen3-30B-A3B's (hidden 2048, 32 heads, 4 key/value heads, head_dim 128, 128 experts, 8 active,
moe_intermediate 768, vocabulary 151936), with the layers asked for: 48 is the model's own. The model is built once
with `model.from_config` (build_from_config, on the GPU) at the most layers and saved in bf16 (61 GB at 48 layers:
the save goes to the first of --work and /dev/shm with room for it); bitsandbytes quantizes it as it loads. Each
case loads it in a process of its own as the qlora stage does (load_pretrained with a 4-bit NF4 config,
router_aux_loss, prepare_for_kbit_training, lora_config → get_peft_model inside shaped_experts, low_rank_experts;
r 16, alpha 32, or --rank) and trains two steps on one packed row of 4096 tokens (or --rows of --tokens; documents
of 512, position ids restarting at each, no attention mask: what PackedCollator gives for a full row), in bf16
autocast with gradient checkpointing, AdamW on the adapter. Reported: peak GPU memory (torch.cuda.max_memory_allocated)
up to the end of loading (adapter included) and over the two steps, what stays allocated, and the step times.

Cases: the stage's config (stages/experts_quantizer.py: the stacked experts 4-bit too), with LoRA on the attention
projections or on attention + experts (`lora.target_experts`); and the in-run baseline, transformers' own
BitsAndBytesConfig with the same settings (nn.Linear layers only: the experts stay bf16), the same two ways. A fit
of fixed + per layer × layers through the two smallest layer counts gives 48 layers where they were not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_cases import SHAPES, VOCAB  # noqa: E402  (bench/, this script's folder, is on sys.path)
from gpu_suite import EOS_ID, PAD_ID  # noqa: E402

FULL_LAYERS = SHAPES["qwen3-30b-a3b"]["num_hidden_layers"]
SHAPE = {k: v for k, v in SHAPES["qwen3-30b-a3b"].items() if k != "num_hidden_layers"}  # each case sets its layers
SHAPE["max_position_embeddings"] = 40960  # Qwen3-30B-A3B's config.json
TINY = dict(SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip

# name → (quantization config, LoRA targets)
CASES: dict[str, tuple[str, str]] = {
    "attention": ("stage", "attention"),
    "attention_experts": ("stage", "attention+experts"),
    "bnb_attention": ("bitsandbytes", "attention"),
    "bnb_attention_experts": ("bitsandbytes", "attention+experts"),
}
BF16_BYTES_PER_LAYER = 1.16 * 2**30  # a layer's weights in bf16, 128 experts included (the save's size per layer)
BF16_BYTES_FIXED = 1.2 * 2**30  # embeddings and head


class Tokenizer:
    """What build_from_config reads of a tokenizer (no tokenizer is downloaded): size and special token ids."""

    bos_token_id = None

    def __init__(self, size: int) -> None:
        self.size = size
        self.pad_token_id, self.eos_token_id = (PAD_ID, EOS_ID) if size == VOCAB else (size - 2, size - 1)

    def __len__(self) -> int:
        return self.size


def specs(layers: int, tiny: bool, target_experts: bool, rank: int = 16) -> tuple[Any, Any]:
    """The ModelSpec of the shape with `layers` layers, and an sft stage with method qlora (lora without a GPU)."""
    from spec.model import ModelSpec
    from spec.training import SftStage

    shape = dict(TINY if tiny else SHAPE, num_hidden_layers=layers)
    model = ModelSpec(name_or_path="qwen3-30b-a3b-shape", from_config=shape)
    section = SftStage.model_validate(
        {
            "enabled": False,
            "method": "lora" if tiny else "qlora",
            "lora": {"r": rank, "alpha": 2 * rank, "target_experts": target_experts},
            "training": {"max_seq_length": 4096, "gradient_checkpointing": True},
        }
    )
    return model, section


def gib(n: int) -> float:
    return round(n / 2**30, 3)


def memory() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {"allocated_gib": 0.0, "peak_gib": 0.0}
    return {"allocated_gib": gib(torch.cuda.memory_allocated()), "peak_gib": gib(torch.cuda.max_memory_allocated())}


def save_model(layers: int, tiny: bool, path: Path) -> None:
    """Build the shape with `layers` layers as the stage builds a from_config model (on the GPU) and save it."""
    import torch

    from stages.modeling import build_from_config

    model_spec, _ = specs(layers, tiny, True)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with device:
        model = build_from_config(model_spec, Tokenizer(VOCAB if not tiny else 512))
    model.save_pretrained(path)


def packed_rows(rows: int, tokens: int, vocab: int, document: int = 512) -> dict[str, Any]:
    """`rows` full packed rows of `tokens`: documents of `document` tokens, positions restarting at each, no label on
    a document's first token, no attention mask."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, PAD_ID), (rows, tokens), generator=generator)  # text, no special tokens
    positions = torch.arange(tokens) % document
    labels = ids.clone()
    labels[0, positions == 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions[None]}


def run_case(name: str, model_dir: Path, layers: int, tiny: bool, tokens: int, rows: int = 1, rank: int = 16) -> Any:
    """Load the saved model as the qlora stage does, add the adapter, train two steps; the memory along the way."""
    import torch
    from peft import get_peft_model

    from stages import modeling
    from stages.quantized_experts import quantized_experts, shaped_experts

    config, targets = CASES[name]
    model_spec, section = specs(layers, tiny, targets == "attention+experts", rank)
    gpu = torch.cuda.is_available()
    result: dict[str, Any] = {"case": name, "layers": layers, "rows": rows, "tokens": tokens, "r": rank}
    result.update(quantization=config, lora=targets)
    started = time.perf_counter()
    quantization = modeling._quantization_config(section, model_spec)  # on CPU (--tiny): bitsandbytes' CPU backend
    if config == "bitsandbytes":  # the baseline: transformers' own config, the same settings
        from transformers import BitsAndBytesConfig

        settings = quantization.to_dict()
        settings.pop("quant_method")
        quantization = BitsAndBytesConfig(**settings)
    extra = {"quantization_config": quantization, "device_map": {"": 0 if gpu else "cpu"}}
    model = modeling.load_pretrained(model_dir, model_spec, num_hidden_layers=layers, **extra)
    result["experts_note"] = modeling.experts_note(model)
    result["experts_4bit"] = len(quantized_experts(model))
    result["experts_implementation"] = model.config._experts_implementation
    result["attention"] = model.config._attn_implementation
    result["loaded"] = memory()
    modeling.router_aux_loss(model, "sft", section)
    model = modeling.prepare_for_kbit_training(model, True)
    with shaped_experts(model):  # as load_starting_model
        model = get_peft_model(model, modeling.lora_config(section, model))
    modeling.low_rank_experts(model, "sft")
    model.config.use_cache = False
    result["load_s"] = round(time.perf_counter() - started, 1)
    result["after_load"] = memory()
    result["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts_now = modeling.expert_parameters(model.base_model.model)
    result["expert_dtypes"] = sorted({str(p.dtype) for p in experts_now.values()})

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    batch = {key: value.to(device) for key, value in packed_rows(rows, tokens, model.config.vocab_size).items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    losses, seconds = [], []
    for _ in range(2):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - start, 2))
        losses.append(round(loss.item(), 4))
    result.update(step=memory(), losses=losses, step_s=seconds)
    return result


def fit(results: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """fixed + per layer × layers through the two smallest layer counts of one case; the 48-layer figure."""
    points = sorted((r["layers"], r[key]["peak_gib"]) for r in results if key in r)
    if len(points) < 2:
        return None
    (l0, m0), (l1, m1) = points[0], points[1]
    per_layer = (m1 - m0) / (l1 - l0)
    fixed = m0 - per_layer * l0
    return {
        "fitted_on_layers": [l0, l1],
        "per_layer_gib": round(per_layer, 3),
        "fixed_gib": round(fixed, 3),
        f"layers_{FULL_LAYERS}_gib": round(fixed + per_layer * FULL_LAYERS, 1),
        "measured": {layers: peak for layers, peak in points},
    }


def suite(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    layer_counts = [int(n) for n in args.layers.split(",")]
    names = args.cases.split(",") if args.cases else list(CASES)
    results: list[dict[str, Any]] = []
    environment = {"argv": sys.argv, **versions()}
    work = work_dir(args, max(layer_counts))
    environment["saved_to"] = str(work)
    print(json.dumps(environment), flush=True)
    saved = work / f"model-{max(layer_counts)}"
    if not (saved / "config.json").is_file():  # one model of the most layers; fewer load from it (from_pretrained
        started = time.perf_counter()  # reads the layers its config has and leaves the rest on disk)
        child(["save", "--layers", str(max(layer_counts)), "--model-dir", str(saved)], args)
        print(f"saved {saved} in {time.perf_counter() - started:.0f} s", flush=True)
    for name in names:  # the cases in order, each at every layer count: the budget cuts the last cases first
        for layers in layer_counts:
            if time.monotonic() > deadline:
                results.append({"case": name, "layers": layers, "skipped": "budget"})
                continue
            record = out / f"{name}-{layers}.json"
            command = ["case", name, "--layers", str(layers), "--model-dir", str(saved), "--record", str(record)]
            code = child(command, args)
            result = json.loads(record.read_text()) if record.is_file() else {"case": name, "layers": layers}
            result.setdefault("exit_code", code)
            results.append(result)
            print(json.dumps(result), flush=True)
    summary = {
        name: {key: fit([r for r in results if r["case"] == name], key) for key in ("after_load", "step")}
        for name in names
    }
    (out / "results.json").write_text(json.dumps({"environment": environment, "results": results,
                                                  "fits": summary}, indent=2))  # fmt: skip
    print(json.dumps(summary, indent=2), flush=True)
    return 0


def work_dir(args: argparse.Namespace, layers: int) -> Path:
    """Where the bf16 model of `layers` layers is saved: --work, else /dev/shm, whichever has room for it."""
    needed = BF16_BYTES_FIXED + layers * BF16_BYTES_PER_LAYER
    for candidate in (Path(args.work), Path("/dev/shm") / "moe-qlora-bench"):
        existing = next((p for p in (candidate, *candidate.parents) if p.exists()), Path("/"))
        if args.tiny or shutil.disk_usage(existing).free > needed * 1.05:
            return candidate
    raise SystemExit(f"no room for {needed / 2**30:.0f} GiB of bf16 weights in {args.work} or /dev/shm")


def child(command: list[str], args: argparse.Namespace) -> int:
    """Run this script's `command` in a process of its own (a clean GPU and a clean peak)."""
    extra = ["--tiny"] if args.tiny else []
    sizes = ["--tokens", str(args.tokens), "--rows", str(args.rows), "--rank", str(args.rank)]
    argv = [sys.executable, str(Path(__file__).resolve()), *command, *sizes, *extra]
    return subprocess.run(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False).returncode


def versions() -> dict[str, Any]:
    import peft
    import torch
    import transformers

    found = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    try:
        import bitsandbytes

        found["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        found["bitsandbytes"] = None
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["gpu_memory_gib"] = gib(torch.cuda.get_device_properties(0).total_memory)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="suite", choices=["suite", "case", "save"])
    parser.add_argument("name", nargs="?", help="the case, for the 'case' command")
    parser.add_argument("--out", default="bench-results", help="where results.json goes")
    parser.add_argument("--work", default="/tmp/moe-qlora-bench", help="where the random model is saved")
    parser.add_argument("--layers", default="4,8,48", help="comma-separated layer counts")
    parser.add_argument("--cases", default="", help=f"comma-separated cases (default: all of {', '.join(CASES)})")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in a packed row")
    parser.add_argument("--rows", type=int, default=1, help="packed rows per step")
    parser.add_argument("--rank", type=int, default=16, help="LoRA r (alpha is 2r)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip cases that would start after this")
    parser.add_argument("--model-dir", help="the saved model ('case', 'save')")
    parser.add_argument("--record", help="where 'case' writes its result")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: a smoke run of the script itself")
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens = min(args.tokens, 256)
    if args.command == "save":
        save_model(int(args.layers), args.tiny, Path(args.model_dir))
        return 0
    if args.command == "case":
        try:
            sizes = (args.tokens, args.rows, args.rank)
            result = run_case(args.name, Path(args.model_dir), int(args.layers), args.tiny, *sizes)
        except Exception as exc:  # recorded, so the suite goes on with the next case
            traceback.print_exc()
            result = {"case": args.name, "layers": int(args.layers), "error": f"{type(exc).__name__}: {exc}"[:2000]}
        Path(args.record).write_text(json.dumps(result))
        return 0 if "error" not in result else 1
    return suite(args)


if __name__ == "__main__":
    sys.exit(main())
