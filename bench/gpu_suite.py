"""Benchmark (not a test): the training stages' own code on GPUs, with synthetic data and random weights.

    bash bench/run_gpu.sh OUT_DIR                     # the whole suite (B1-B4), results in OUT_DIR/results.json
    python bench/gpu_suite.py case b1_packed --out DIR # one case, one process
    python bench/gpu_suite.py --tiny --cases b1_padded,b1_packed_sdpa --out DIR   # a smoke run on CPU
    python bench/gpu_suite.py text-tokens --out .whl/text.npz     # the text of the `text` cases (BENCH_TEXT_TOKENS)

Every case builds the pieces exactly as the stage does (stages/sft.py, stages/rlhf.py): the model from
`model.from_config` (build_from_config), the adapter from `lora_config`, the Trainer arguments from
`trainer_arguments` (precision, strategy, GPU kernels), rows from `pack_best_fit` with `PackedCollator`, and
TRL's SFTTrainer / DPOTrainer through `stages.rlhf.trainer_config` and `make_trainer`. Only the token cache is
made here instead of by prepare: synthetic token ids whose lengths follow an instruction-data distribution
(log-normal, mean about 600 tokens, clipped to [32, 2048]), so no tokenizer or weights are downloaded.

The baselines are measured in the same run: the same stage unpacked (padded rows), plain transformers + PEFT
with their defaults (padded batches), and TRL's DPO with its defaults.

Figures: real (non-pad) tokens per second over the timed steps (after warm-up steps that include compilation),
model FLOPs utilisation (6 × matmul parameters × tokens, plus causal attention inside each document, over the
GPU's dense bf16 peak), and peak GPU memory of the whole run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gpu_cases import BY_NAME, CASES, MULTI_GPU_GROUPS, PEAK_BF16_FLOPS, SHAPES, VOCAB, Case

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PAD_ID, EOS_ID = 151643, 151645  # <|endoftext|>, <|im_end|>

SHAPES["tiny-moe"] = dict(  # the tiny shape as a mixture of experts
    SHAPES["tiny"], architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
)


# --------------------------------------------------------------------------- synthetic data


def instruction_lengths(n: int, seed: int, mean: float = 600.0, lo: int = 32, hi: int = 2048) -> list[int]:
    """Example lengths: log-normal (sigma 0.9), its location chosen so the clipped mean is `mean`."""
    rng = random.Random(seed)
    normals = [rng.gauss(0.0, 1.0) for _ in range(n)]
    mu = math.log(mean) - 0.9**2 / 2
    for _ in range(20):  # the clipping moves the mean: correct the location until it lands
        lengths = [min(hi, max(lo, round(math.exp(mu + 0.9 * z)))) for z in normals]
        mu += math.log(mean / (sum(lengths) / n))
    return lengths


def sft_examples(n: int, seed: int, vocab: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """(ids, labels): random tokens; the first 40% of each example is the prompt (no loss)."""
    rng = random.Random(seed + 1)
    examples = []
    for length in instruction_lengths(n, seed, hi=max_len):
        ids = [rng.randrange(vocab - 1000) for _ in range(length - 1)] + [EOS_ID % vocab]
        prompt = int(length * 0.4)
        examples.append((ids, [-100] * prompt + ids[prompt:]))
    return examples


def write_text_tokens(out: Path, n_tokens: int, vocab_size: int = 8192) -> None:
    """Korean documents as token ids for the learning-curve cases (`Case.text`): bench/prepare_corpus.py's synthetic
    Korean text (konlpy's law and bill sentences recombined, read from the installed wheel), encoded with a byte-level
    BPE of `vocab_size` trained on other documents of it; `tokens` (uint16) and each document's length, in `out`
    (.npz). Made on the CPU machine and carried to the GPU one (no text is committed)."""
    import numpy as np
    from prepare_corpus import KoreanCorpus, build_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(out.parent / "tokenizer", vocab_size, seed=0))
    corpus = KoreanCorpus(seed=0)
    documents: list[list[int]] = []
    total = 0
    while total < n_tokens:
        texts = [corpus.text(i)["text"] for i in range(len(documents), len(documents) + 500)]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            documents.append([*ids, tokenizer.eos_token_id])
            total += len(documents[-1])
    lengths = np.asarray([len(d) for d in documents], dtype=np.int32)
    tokens = np.asarray([t for d in documents for t in d], dtype=np.uint16)
    np.savez(out, tokens=tokens, lengths=lengths, vocab_size=np.int64(len(tokenizer)))


def text_examples(path: str, max_len: int) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of the documents of a `write_text_tokens` file, each cut at `max_len`, every token trained."""
    import numpy as np

    data = np.load(path)
    ends = np.cumsum(data["lengths"])
    examples = []
    for start, end in zip(ends - data["lengths"], ends, strict=True):
        ids = data["tokens"][start : min(end, start + max_len)].astype(np.int64).tolist()
        examples.append((ids, list(ids)))
    return examples


def fake_tokenizer(vocab: int) -> Any:
    """A fast tokenizer over the words t0 … t{vocab-1} (whitespace-split), with Qwen3's pad and eos ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    pad, eos = PAD_ID % vocab, EOS_ID % vocab
    words = {**{k: v for k, v in words.items() if v not in (pad, eos)}, "<|endoftext|>": pad, "<|im_end|>": eos}
    tok = Tokenizer(WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def preference_rows(n: int, seed: int, vocab: int) -> list[dict[str, str]]:
    """DPO rows as text over the fake tokenizer's words: prompt and answers each log-normal, mean about 250."""
    rng = random.Random(seed)
    prompts = instruction_lengths(n, seed, mean=250, lo=16, hi=500)
    chosen = instruction_lengths(n, seed + 1, mean=250, lo=16, hi=500)
    rejected = instruction_lengths(n, seed + 2, mean=250, lo=16, hi=500)

    def text(k: int) -> str:
        return " ".join(f"t{rng.randrange(vocab - 1000)}" for _ in range(k))

    lengths = zip(prompts, chosen, rejected, strict=True)
    return [{"prompt": text(p), "chosen": " " + text(c), "rejected": " " + text(r)} for p, c, r in lengths]


# --------------------------------------------------------------------------- measuring


class CountingCollator:
    """Wraps a collator and records, per batch, the real tokens and Σ n² over its documents (attention FLOPs)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batches: list[tuple[int, int]] = []

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        batch = self.inner(rows)
        tokens = squares = 0
        for row in rows:
            if "position_ids" in row:
                starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
                docs = [b - a for a, b in itertools.pairwise(starts)]
            elif "input_ids" in row:
                docs = [len(row["input_ids"])]
            else:  # a DPO row: prompt + chosen and prompt + rejected
                docs = [len(row["prompt_ids"]) + len(row[k]) for k in ("chosen_ids", "rejected_ids")]
            tokens += sum(docs)
            squares += sum(d * d for d in docs)
        self.batches.append((tokens, squares))
        return batch


def step_timer(warmup: int) -> Any:
    """A TrainerCallback that takes a synchronised clock after the warm-up steps and after the last step."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.start: float | None = None
            self.end: float | None = None
            self.steps = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.start = time.perf_counter()
            elif state.global_step == state.max_steps:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.end = time.perf_counter()
                self.steps = state.global_step - warmup

    return StepTimer()


def step_profiler(warmup: int, steps: int = 2) -> Any:
    """A TrainerCallback that runs torch.profiler over `steps` steps after the warm-up (BENCH_PROFILE=1): where a
    step's time goes, by CUDA kernel and by CPU operator, in the case's result under "profile"."""
    import torch
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        def __init__(self) -> None:
            self.profiler: Any = None
            self.tables: dict[str, str] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.profiler is not None and state.global_step == warmup + steps:
                torch.cuda.synchronize()
                self.profiler.__exit__(None, None, None)
                averages = self.profiler.key_averages()
                self.tables = {
                    "cuda": averages.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60),
                    "cpu": averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60),
                }
                self.profiler = None

    return StepProfiler()


def nonfinite_probe() -> Any:
    """A TrainerCallback that watches the first step's gradients as the backward pass accumulates them (before
    clipping, which spreads one NaN to every gradient): the parameters whose gradient first holds NaN or inf, in
    the order the backward reached them, where a case's grad_norm is not finite."""
    import torch
    from transformers import TrainerCallback

    class NonFiniteProbe(TrainerCallback):
        def __init__(self) -> None:
            self.found: dict[str, Any] | None = None
            self.order: list[dict[str, Any]] = []
            self.seen = 0
            self.handles: list[Any] = []

            self.experts: dict[str, dict[str, Any]] = {}  # per MoE layer: its forward output, its gradients

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            for name, parameter in model.named_parameters() if model is not None else []:
                if parameter.requires_grad:
                    self.handles.append(parameter.register_post_accumulate_grad_hook(self._hook(name)))
            for name, module in model.named_modules() if model is not None else []:
                if name.endswith("mlp.experts"):
                    self.handles.append(module.register_forward_hook(self._experts_hook(name.split(".layers.")[-1])))

        def _experts_hook(self, layer: str) -> Any:
            """The experts' output and, once the backward reaches them, the gradient of their output, of the tokens
            they got and of the routing weights: finite or not, and the largest finite magnitude."""

            def stats(tensor: Any) -> dict[str, Any]:
                values = tensor.detach().float()
                finite = torch.isfinite(values)
                largest = values[finite].abs().max().item() if finite.any() else None
                return {"non_finite": int((~finite).sum()), "max_abs": largest}

            def grad_hook(key: str) -> Any:
                return lambda grad: self.experts.setdefault(layer, {}).__setitem__(key, stats(grad))

            def forward(module: Any, inputs: tuple[Any, ...], output: Any) -> None:
                if self.found is not None:
                    return
                self.experts.setdefault(layer, {})["output"] = stats(output)
                for key, tensor in (("grad_output", output), ("grad_tokens", inputs[0]), ("grad_weights", inputs[2])):
                    if torch.is_tensor(tensor) and tensor.requires_grad:
                        tensor.register_hook(grad_hook(key))

            return forward

        def _hook(self, name: str) -> Any:
            def check(parameter: Any) -> None:
                self.seen += 1
                grad = parameter.grad.detach()
                nans, infs = int(torch.isnan(grad).sum()), int(torch.isinf(grad).sum())
                if (nans or infs) and len(self.order) < 24:
                    entry = {"name": name, "nan": nans, "inf": infs, "numel": grad.numel(), "reached": self.seen}
                    self.order.append(entry)

            return check

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.found is None:
                self.found = {"reached": self.seen, "first": list(self.order), "experts": dict(self.experts)}
                for handle in self.handles:
                    handle.remove()

    return NonFiniteProbe()


def gpu_peak() -> float:
    import torch

    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), 989e12)


# --------------------------------------------------------------------------- building the pieces as the stage does


def shape_of(case: Case, tiny: bool) -> str:
    """The case's shape, or the tiny one of its kind (dense or mixture of experts) for a smoke run."""
    if not tiny:
        return case.shape
    return "tiny-moe" if SHAPES[case.shape].get("architecture") == "qwen3_moe" else "tiny"


def layers_of(case: Case, shape: dict[str, Any]) -> dict[str, Any]:
    """The shape with the case's layer count, where it sets one below the shape's."""
    if case.layers is None or case.layers >= shape["num_hidden_layers"]:
        return shape
    return {**shape, "num_hidden_layers": case.layers}


def stage_context(case: Case, tmp: Path, tiny: bool) -> SimpleNamespace:
    """What trainer_arguments / trainer_config read from a StageContext: the stage's section and the model spec."""
    from spec.model import ModelSpec, TinyModelConfig
    from spec.training import DistributedSpec, LoraSpec, RlhfStage, SftStage, TrainingSpec

    training = TrainingSpec(
        per_device_batch_size=case.per_device_batch_size,
        max_seq_length=case.max_seq_length,
        packing=case.packing,
        gradient_checkpointing=case.gradient_checkpointing,
        recompute_layers=case.recompute_layers,
        max_steps=case.warmup + case.steps,
        logging_steps=1000,
        save_steps=100000,
        warmup_ratio=0.0,
        pure_bf16=case.pure_bf16,
        fp8=case.fp8,
        gradient_accumulation_steps=case.gradient_accumulation_steps,
        router_aux_loss_coef=case.router_aux_loss_coef,
    )
    cls = RlhfStage if case.kind == "stage_dpo" else SftStage
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = DistributedSpec(
        strategy=case.strategy,
        expert_parallel=case.expert_parallel or world,
        tensor_parallel=case.tensor_parallel,
        pipeline_parallel=case.pipeline_parallel or world,
    )
    lora = LoraSpec(target_experts=case.lora_experts)
    section = cls(enabled=False, method=case.method, training=training, distributed=distributed, lora=lora)
    if case.lora_dropout is not None:
        section.lora.dropout = case.lora_dropout
    model = ModelSpec(
        name_or_path=f"Qwen/{case.shape}",
        attn_implementation=case.attn,
        from_config=TinyModelConfig(**layers_of(case, SHAPES[shape_of(case, tiny)]), max_position_embeddings=4096),
    )
    return SimpleNamespace(
        section=section,
        spec=SimpleNamespace(model=model),
        stage="rlhf" if case.kind == "stage_dpo" else "sft",
        checkpoints_dir=tmp / "checkpoints",
    )


def build_model(ctx: SimpleNamespace, tokenizer: Any, case: Case, tmp: Path) -> Any:
    """The starting model as load_starting_model builds it for a first stage: from config, then the adapter."""
    import torch
    from peft import get_peft_model

    from stages.model_parallel import shards_at_load
    from stages.modeling import (
        _quantization_config,
        adapter_inputs_uncast,
        build_from_config,
        expert_parameters,
        float32_masters,
        load_pretrained,
        lora_config,
        low_rank_experts,
        on_gpu,
        packed_attention,
        prepare_for_kbit_training,
        router_aux_loss,
        shard_built,
        use_attention,
    )

    blocks = whole_layers(ctx, case)  # each decoder layer compiled whole (the stage's choice unless the case sets it)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")
    with device:
        model = build_from_config(ctx.spec.model, tokenizer)
    if (case.stock_experts or case.kind not in ("stage_sft", "stage_dpo")) and on_gpu() and expert_parameters(model):
        model.set_experts_implementation("grouped_mm")  # transformers' own experts forward: the baselines'
    if shards_at_load(ctx.section):  # as load_model_parallel shards a model built from config
        model = shard_built(model, ctx.spec, ctx.section)
        if on_gpu():
            torch.cuda.empty_cache()
    if case.method == "qlora":  # QLoRA quantizes saved weights: save the random model, load it back in 4 bits
        model.save_pretrained(tmp / "base")
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = load_pretrained(
            tmp / "base",
            ctx.spec.model,
            quantization_config=_quantization_config(ctx.section, ctx.spec.model),
            device_map={"": torch.cuda.current_device()},
        )
        model = prepare_for_kbit_training(model, case.gradient_checkpointing)
    router_aux_loss(model, ctx.stage, ctx.section)
    switch = packed_attention(ctx.spec.model, ctx.stage, ctx.section)
    if switch is not None and case.kind == "stage_sft":
        use_attention(model, switch)
    if case.method != "full":
        model = get_peft_model(model, lora_config(ctx.section, model))
        if case.low_rank_experts:
            low_rank_experts(model, ctx.stage)
        if case.kind == "stage_sft" and not case.peft_input_casts:
            adapter_inputs_uncast(model, ctx.stage)
    else:
        float32_masters(model, ctx.section)
        if case.fp8:
            from stages.float8 import train_in_float8

            recipe = {"recipe": case.fp8_recipe} if case.fp8_recipe else {}
            compile_layers = False if blocks else case.fp8_compile
            train_in_float8(model, ctx.stage, compile_layers=compile_layers, **recipe)
    if blocks:
        from stages.float8 import compile_decoder_layers

        compile_decoder_layers(model, case.gradient_checkpointing, case.recompute_layers)
    model.config.use_cache = False
    return model


def whole_layers(ctx: SimpleNamespace, case: Case) -> bool:
    """Whether the case compiles each decoder layer whole, its checkpointing inside: the stage's choice
    (`stages.float8.compiles_decoder_layers`) unless the case sets `compile_blocks`."""
    from stages.float8 import compiles_decoder_layers

    return compiles_decoder_layers(ctx.stage, ctx.section) if case.compile_blocks is None else case.compile_blocks


def trainer_args(ctx: SimpleNamespace, model: Any, case: Case) -> dict[str, Any]:
    """trainer_arguments as the stage computes them, with the case's overrides of the GPU defaults."""
    from stages.float8 import compiles_decoder_layers
    from stages.training import kernel_arguments, trainer_arguments

    args = trainer_arguments(ctx, model)
    blocks = whole_layers(ctx, case)
    if blocks != compiles_decoder_layers(ctx.stage, ctx.section):  # the case overrides the stage's choice
        checkpointing = case.gradient_checkpointing and not blocks  # compiled whole layers checkpoint themselves
        if args.get("fsdp_config"):  # FSDP2 recomputes with its own wrapper, applied after the compile: off too
            args["fsdp_config"] = {**args["fsdp_config"], "activation_checkpointing": checkpointing}
        else:
            args["gradient_checkpointing"] = args["activation_checkpointing"] = checkpointing
        args.pop("use_liger_kernel", None)
        args.pop("liger_kernel_config", None)
        args.update(kernel_arguments(model, ctx.stage, blocks))
    # No checkpoint: with save_strategy "steps" the Trainer saves at the planned end, which for an 8B model under
    # FSDP2 (weights and Adam's state gathered) takes longer than the timed steps; nothing here is resumed.
    args["save_strategy"] = "no"
    if case.liger is not None:
        args["use_liger_kernel"] = case.liger
    if case.reshard_after_forward is not None and args.get("fsdp_config"):
        args["fsdp_config"] = {**args["fsdp_config"], "reshard_after_forward": case.reshard_after_forward}
    return {**args, **case.extra}


def boundary_check(model: Any, row: dict[str, list[int]], device: Any) -> dict[str, float] | None:
    """Whether attention stays inside documents: the last document's logits inside a packed row against the
    same document alone (relative L2 error; bf16 noise is about 1e-2, attention across documents about 1)."""
    import torch

    pos = row["position_ids"]
    starts = [i for i, p in enumerate(pos) if p == 0]
    if len(starts) < 2:
        return None
    last = starts[-1]
    ids = torch.tensor([row["input_ids"]], device=device)
    try:  # other lengths than training's: a compiled kernel recompiles here, and may fail where training did not
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=torch.tensor([pos], device=device)).logits[0, last:].float()
            alone = model(input_ids=ids[:, last:], position_ids=torch.tensor([pos[last:]], device=device))
            alone = alone.logits[0].float()
            leaky = model(input_ids=ids, position_ids=torch.arange(len(pos), device=device)[None])
            leaky = leaky.logits[0, last:].float()
    except Exception as exc:  # recorded: the training figures stand
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    rel = ((packed - alone).norm() / alone.norm()).item()
    rel_leaky = ((leaky - alone).norm() / alone.norm()).item()
    finite = all(bool(torch.isfinite(t).all()) for t in (packed, alone, leaky))
    return {"packed_vs_alone": rel, "no_reset_vs_alone": rel_leaky, "documents_in_row": len(starts), "finite": finite}


def plain_strategy(case: Case, model: Any) -> dict[str, Any]:
    """A plain Trainer's distributed settings: FSDP2 as transformers documents it (each decoder layer a shard unit,
    accelerate's defaults otherwise), activation checkpointing when the case asks for it."""
    if case.strategy != "fsdp":
        return {"gradient_checkpointing": case.gradient_checkpointing}
    return {
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {
            "version": 2,
            "transformer_layer_cls_to_wrap": list(model._no_split_modules),
            "activation_checkpointing": case.gradient_checkpointing,
        },
    }


def plain_collator(pad_id: int) -> Any:
    """What a transformers + PEFT script does by default: right-pad, attention_mask, labels -100 on padding."""
    import torch

    def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = [r["input_ids"] + [pad_id] * (width - len(r["input_ids"])) for r in rows]
        mask = [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows]
        labels = [r["labels"] + [-100] * (width - len(r["labels"])) for r in rows]
        return {k: torch.tensor(v) for k, v in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}

    return collate


# --------------------------------------------------------------------------- running one case


def matmul_ceiling(case: Case, tiny: bool) -> dict[str, Any]:
    """Forward and backward of the shape's Linear layers alone, in bf16, over the tokens of one packed step:
    attention, norms, activations, the loss and the optimizer left out. MFU here bounds any stage's MFU."""
    import torch

    c = SimpleNamespace(**SHAPES["tiny" if tiny else case.shape])
    vocab = 4096 if tiny else VOCAB
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    tokens = case.per_device_batch_size * case.max_seq_length
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def weight(n_in: int, n_out: int) -> Any:
        return (torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in**-0.5).requires_grad_()

    layers = [
        {
            "q": weight(c.hidden_size, q_out),
            "k": weight(c.hidden_size, kv_out),
            "v": weight(c.hidden_size, kv_out),
            "o": weight(q_out, c.hidden_size),
            "gate": weight(c.hidden_size, c.intermediate_size),
            "up": weight(c.hidden_size, c.intermediate_size),
            "down": weight(c.intermediate_size, c.hidden_size),
        }
        for _ in range(c.num_hidden_layers)
    ]
    head = weight(c.hidden_size, vocab)
    n_mm = sum(w.numel() for layer in layers for w in layer.values()) + head.numel()
    x0 = torch.randn(tokens, c.hidden_size, device=device, dtype=dtype, requires_grad=True)
    F = torch.nn.functional

    def step() -> None:
        x = x0
        for w in layers:
            kv = F.linear(x, w["k"]) + F.linear(x, w["v"])
            attn = F.linear(x, w["q"])
            mlp = F.linear(F.linear(x, w["gate"]) * F.linear(x, w["up"]), w["down"])
            x = F.linear(attn, w["o"]) + mlp + kv.mean()  # the mean keeps k and v in the backward pass
        F.linear(x, head).sum().backward()

    times = []
    for i in range(case.warmup + case.steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= case.warmup:
            times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    result: dict[str, Any] = {
        "case": asdict(case),
        "matmul_parameters": n_mm,
        "tokens": tokens,
        "step_s_median": seconds,
        "tokens_per_s": tokens / seconds,
    }
    if device == "cuda":
        result["mfu"] = 6 * n_mm * tokens / seconds / gpu_peak()
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["device"] = torch.cuda.get_device_name()
    return result


def update_probe(model: Any) -> tuple[Any, Any] | None:
    """One weight of a middle decoder layer and a copy of it, to count afterwards how much of it training moved
    (bf16 weights drop updates smaller than half their spacing)."""
    import torch

    layers = [m for name, m in model.named_modules() if name.endswith("mlp.down_proj") and hasattr(m, "weight")]
    if not layers or not layers[len(layers) // 2].weight.requires_grad:
        return None
    weight = layers[len(layers) // 2].weight
    return weight, weight.detach().to(torch.float32).clone()


def run_case(case: Case, tiny: bool, tmp: Path) -> dict[str, Any]:
    """Build, train `warmup + steps` steps, and measure one case in this process (scratch files under `tmp`)."""
    import torch
    import torch.distributed as dist

    if case.kind == "matmul_ceiling":
        return matmul_ceiling(case, tiny)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(local_rank)
        torch.cuda.reset_peak_memory_stats()
    vocab = 4096 if tiny else VOCAB
    if case.text:  # the text's ids must fit (a tiny smoke run)
        import numpy as np

        vocab = max(vocab, int(np.load(os.environ["BENCH_TEXT_TOKENS"])["vocab_size"]))
    ctx = stage_context(case, tmp, tiny)
    from stages.model_parallel import mesh_over_gloo, tensor_parallel_size
    from stages.pipeline_parallel import pipeline_parallel_size, pipeline_trainer

    # ranks that train on the same rows: a tensor-parallel group, a pipeline's stages
    sharing = tensor_parallel_size(ctx.section) * pipeline_parallel_size(ctx.section)
    tokenizer = fake_tokenizer(vocab)
    model = build_model(ctx, tokenizer, case, tmp)
    timer = step_timer(case.warmup)
    profiler = step_profiler(case.warmup) if os.environ.get("BENCH_PROFILE") == "1" and gpu else None
    callbacks = [timer] if profiler is None else [timer, profiler]
    probe_grads = nonfinite_probe()
    callbacks.append(probe_grads)
    if case.kind.startswith("stage_"):  # the stages' own callback: training.recompute_layers
        from stages.recompute import RecomputeLayers

        callbacks.append(RecomputeLayers("bench", case.recompute_layers))
    started = time.perf_counter()
    result: dict[str, Any] = {"case": asdict(case), "world_size": world}

    if case.kind in ("stage_sft", "plain_peft", "plain_trainer"):
        from datasets import Dataset

        from stages.packing import PackedCollator, batch_width_multiple, example_row, pack_best_fit
        from stages.router_loss import mask_router_loss

        if case.text:  # real text: the same documents on every rank (one GPU here), in order
            examples = text_examples(os.environ["BENCH_TEXT_TOKENS"], case.max_seq_length)
        else:
            seed = rank if sharing == 1 else 0  # the same rows where ranks share them (the sampler deals them out)
            examples = sft_examples(4000 if not tiny else 400, seed=seed, vocab=vocab, max_len=case.max_seq_length)
        if case.packing:
            rows = pack_best_fit(examples, case.max_seq_length)
        else:
            rows = [example_row(ids, labels) for ids, labels in examples]
        columns = {k: [r[k] for r in rows] for k in ("input_ids", "labels", "position_ids")}
        if case.kind in ("plain_peft", "plain_trainer"):
            from transformers import Trainer, TrainingArguments

            dataset = Dataset.from_dict({k: columns[k] for k in ("input_ids", "labels")})
            args = TrainingArguments(
                **plain_strategy(case, model),
                output_dir=str(tmp / "out"),
                per_device_train_batch_size=case.per_device_batch_size,
                max_steps=case.warmup + case.steps,
                bf16=gpu,
                use_cpu=not gpu,
                save_strategy="no",
                logging_steps=1000,
                report_to="none",
                disable_tqdm=True,
                remove_unused_columns=False,
            )
            collator = CountingCollator(plain_collator(tokenizer.pad_token_id))
            trainer = Trainer(
                model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks
            )
        else:
            from trl import SFTConfig, SFTTrainer

            from stages.distributed import fsdp_mixed_precision

            dataset = Dataset.from_dict(columns)
            args = SFTConfig(
                **trainer_args(ctx, model, case),
                max_length=case.max_seq_length,
                dataset_kwargs={"skip_prepare_dataset": True},
            )
            fsdp_mixed_precision(args)  # as the stages' build_config: FSDP2 reduces in float32
            multiple = batch_width_multiple(ctx.section.training)
            collator = CountingCollator(
                PackedCollator(
                    pad_token_id=tokenizer.pad_token_id,
                    pad_to_multiple_of=multiple,
                    mark_padding=mask_router_loss(model),
                )
            )
            trainer_class = SFTTrainer
            if pipeline_parallel_size(ctx.section) > 1:  # as the stages make it (stages/sft.py)
                trainer_class = pipeline_trainer(SFTTrainer, ctx.stage, ctx.section)
            with mesh_over_gloo(ctx.section):
                trainer = trainer_class(
                    model=model,
                    args=args,
                    data_collator=collator,
                    train_dataset=dataset,
                    processing_class=tokenizer,
                    callbacks=callbacks,
                )
        result["packing"] = {
            "examples": len(examples),
            "mean_example_tokens": sum(len(e[0]) for e in examples) / len(examples),
            "rows": len(rows),
            "mean_row_tokens": sum(len(r["input_ids"]) for r in rows) / len(rows),
        }
    else:  # DPO
        from datasets import Dataset

        dataset = Dataset.from_list(preference_rows(600 if not tiny else 200, seed=rank, vocab=vocab))
        if case.kind == "trl_dpo":
            from peft import LoraConfig
            from trl import DPOConfig, DPOTrainer

            if case.method != "full":
                from peft import PeftModel

                model = model.get_base_model() if isinstance(model, PeftModel) else model
            args = DPOConfig(
                output_dir=str(tmp / "out"),
                per_device_train_batch_size=case.per_device_batch_size,
                max_steps=case.warmup + case.steps,
                bf16=gpu,
                use_cpu=not gpu,
                save_strategy="no",
                logging_steps=1000,
                report_to="none",
                disable_tqdm=True,
            )
            lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
            built = time.perf_counter()
            trainer = DPOTrainer(
                model=model,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=lora,
                callbacks=[timer],
            )
        else:
            from stages.modeling import StartingModel
            from stages.rlhf import make_trainer, trainer_config

            start = StartingModel(model=model, kind="adapter", base=None, upstream=None)  # type: ignore[arg-type]
            config = trainer_config(ctx, start)
            if case.liger is not None:
                config.use_liger_kernel = case.liger
            built = time.perf_counter()
            trainer = make_trainer(ctx, start, config, tokenizer, dataset, None, [timer])
        result["trainer_init_s"] = time.perf_counter() - built  # tokenisation and precomputed reference included
        collator = CountingCollator(trainer.data_collator)
        trainer.data_collator = collator

    result["attn_implementation"] = getattr(trainer.model.config, "_attn_implementation", None)
    result["experts_implementation"] = getattr(trainer.model.config, "_experts_implementation", None)
    result["use_liger_kernel"] = bool(getattr(trainer.args, "use_liger_kernel", False))
    result["gradient_checkpointing"] = bool(trainer.args.gradient_checkpointing)
    result["optim"] = str(trainer.args.optim)
    # FSDP2 (even over one rank) trains parameters it makes when training starts: the probe's would never move
    probe = update_probe(trainer.model) if world == 1 and case.method == "full" and case.strategy == "ddp" else None
    result["weights_dtype"] = str(next(trainer.model.parameters()).dtype)
    trainer.train()
    if probe is not None:
        weight, before = probe
        result["updated_fraction"] = (weight.detach().to(torch.float32) != before).float().mean().item()
    result["train_s"] = time.perf_counter() - started
    # a figure of a run that trained on NaN gradients is no figure: say so beside it (the stages stop there)
    history = trainer.state.log_history
    result["losses"] = [e["loss"] for e in history if "loss" in e]
    result["grad_norms"] = [e["grad_norm"] for e in history if "grad_norm" in e]
    keys = ("loss", "grad_norm", "train_loss")
    bad = [e["step"] for e in history if any(not math.isfinite(e.get(k, 0.0)) for k in keys)]
    result["non_finite_from_step"] = bad[0] if bad else None
    result["first_step_grads"] = probe_grads.found
    if profiler is not None:
        result["profile"] = profiler.tables
    if case.fp8 or case.compile_blocks or case.extra.get("torch_compile"):
        # what was compiled, and whether a limit sent frames back to eager
        from torch._dynamo.utils import counters

        result["dynamo_counters"] = {kind: dict(values) for kind, values in counters.items() if values}

    # the collator's calls a step: one per micro-batch, or one for all of them under pipeline parallelism
    per_step = 1 if pipeline_parallel_size(ctx.section) > 1 else case.gradient_accumulation_steps
    timed = collator.batches[case.warmup * per_step : (case.warmup + case.steps) * per_step]
    tokens = sum(t for t, _ in timed)
    squares = sum(s for _, s in timed)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    config = unwrapped.config
    from stages.progress import matmul_parameters

    n_mm = matmul_parameters(unwrapped)
    if world > 1:  # FSDP shards the Linear weights: count the full model's from its config
        c = config
        per_layer = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        experts = getattr(c, "num_experts", None)
        if experts:  # a mixture of experts: the active experts' matmuls and the router's
            per_layer += c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size + c.hidden_size * experts
        else:
            per_layer += 3 * c.hidden_size * c.intermediate_size
        n_mm = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * squares
    flops = 6 * n_mm * tokens + attention
    if world > 1:
        totals = torch.tensor([tokens, flops], dtype=torch.float64, device="cuda" if gpu else "cpu")
        dist.all_reduce(totals)
        tokens, flops = int(totals[0].item()) // sharing, float(totals[1].item()) / sharing
    seconds = (timer.end or 0.0) - (timer.start or 0.0)
    result.update(
        {
            "timed_steps": timer.steps,
            "timed_s": seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else None,
            "tokens_per_s_per_gpu": tokens / seconds / world if seconds else None,
            "matmul_parameters": n_mm,
            "parameters": sum(p.numel() for p in unwrapped.parameters()),
            "model_flops": flops,
        }
    )
    if (stages := pipeline_parallel_size(ctx.section)) > 1:  # the schedule's idle share of a step (1F1B)
        micro = case.gradient_accumulation_steps
        result["pipeline"] = {"stages": stages, "micro_batches": micro, "bubble": (stages - 1) / (micro + stages - 1)}
    if gpu:
        result["mfu"] = flops / seconds / world / gpu_peak() if seconds and case.method == "full" else None
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        result["device"] = torch.cuda.get_device_name()
    if case.packing and case.kind == "stage_sft" and world == 1:
        packed_rows = [r for r in rows if r["position_ids"].count(0) >= 2]
        if packed_rows:
            unwrapped.eval()
            device = next(unwrapped.parameters()).device
            result["boundary_check"] = boundary_check(unwrapped, packed_rows[0], device)
    return result


def case_main(name: str, out: Path, tiny: bool) -> int:
    """Run one case and write `<out>/<name>.json` (rank 0); an error is recorded, not raised."""
    case = BY_NAME[name]
    rank = int(os.environ.get("RANK", "0"))
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{case.name}-"))
    try:
        result = run_case(case, tiny, tmp)
    except Exception as exc:  # recorded in the results: the suite goes on with the next case
        traceback.print_exc()
        oom = "out of memory" in str(exc).lower()
        result = {"case": asdict(case), "error": f"{type(exc).__name__}: {str(exc)[:2000]}", "oom": oom}
    finally:  # checkpoints and the saved 8B base of the QLoRA cases would fill the disk over a suite
        shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
        summary = {k: result.get(k) for k in ("tokens_per_s", "mfu", "peak_allocated_gib", "error")}
        print(f"RESULT {name}: {json.dumps(summary, default=str)}", flush=True)
    return 0


# --------------------------------------------------------------------------- the suite


def environment() -> dict[str, Any]:
    """Device and software versions, for the record."""
    import importlib.metadata as md

    import torch

    versions = {}
    packages = (
        "torch",
        "transformers",
        "trl",
        "peft",
        "accelerate",
        "datasets",
        "liger-kernel",
        "bitsandbytes",
        "deepspeed",
        "pydantic",
    )
    for pkg in packages:
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"python": platform.python_version(), "gpus": gpus, "cuda": torch.version.cuda, "versions": versions}


def _spawn(names: list[str], out: Path, cases_dir: Path, gpus: str, log: Path, tiny: bool, deadline: float) -> None:
    """Run cases one after another in fresh processes on the given GPUs (torchrun for B3 cases)."""
    with log.open("a") as f:
        for name in names:
            left = deadline - time.time()
            if left < 30:
                f.write(f"SKIPPED {name}: out of time\n")
                continue
            case = BY_NAME[name]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONUNBUFFERED": "1"}
            cmd = [sys.executable, str(Path(__file__)), "case", name, "--out", str(cases_dir)]
            if tiny:
                cmd.append("--tiny")
            if case.group in MULTI_GPU_GROUPS:
                n = len(gpus.split(","))
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *cmd[1:]]
            f.write(f"=== {name} on GPU {gpus}: {' '.join(cmd)}\n")
            f.flush()
            t0 = time.time()
            try:
                subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=left, check=False)
            except subprocess.TimeoutExpired:
                f.write(f"TIMEOUT {name}\n")
            f.write(f"=== {name} took {time.time() - t0:.0f}s\n")
            f.flush()


def suite(args: argparse.Namespace) -> int:
    """Phase 1: the B3 cases on all GPUs. Phase 2: the one-GPU cases, dealt over the GPUs in the given order."""
    import threading

    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases_dir = Path(tempfile.mkdtemp(prefix="bench-cases-"))
    deadline = time.time() + args.budget_s
    chosen = [c for c in (args.cases.split(",") if args.cases else [c.name for c in CASES])]
    count = max(torch.cuda.device_count(), 1)
    (out / "env.json").write_text(json.dumps(environment(), indent=2))
    multi = [n for n in chosen if BY_NAME[n].group in MULTI_GPU_GROUPS]
    if multi and count > 1:
        _spawn(multi, out, cases_dir, ",".join(map(str, range(count))), out / "log_b3.txt", args.tiny, deadline)
    single = [n for n in chosen if BY_NAME[n].group not in MULTI_GPU_GROUPS]
    lanes = [single[i::count] for i in range(count)]  # one-GPU cases dealt over the GPUs, in the given order
    threads = [
        threading.Thread(
            target=_spawn, args=(lane, out, cases_dir, str(i), out / f"log_gpu{i}.txt", args.tiny, deadline)
        )
        for i, lane in enumerate(lanes)
        if lane
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = {p.stem: json.loads(p.read_text()) for p in sorted(cases_dir.glob("*.json"))}
    (out / "results.json").write_text(json.dumps({"env": environment(), "results": results}, indent=2, default=str))
    print_table(results)
    return 0


def print_table(results: dict[str, Any]) -> None:
    """A short table: tokens/s, MFU, peak memory, or the error."""
    for name, r in results.items():
        if "error" in r:
            print(f"{name:22s} ERROR {r['error'][:300]}")
            continue
        if r.get("non_finite_from_step") is not None:
            print(f"{name:22s} NOT FINITE: loss or grad_norm NaN/inf from step {r['non_finite_from_step']}")
        mfu = f"{r['mfu'] * 100:5.1f}%" if r.get("mfu") else "   -  "
        print(
            f"{name:22s} {r.get('tokens_per_s') or 0:10.0f} tok/s  mfu {mfu}  "
            f"peak {r.get('peak_allocated_gib') or 0:6.1f} GiB  attn={r.get('attn_implementation')} "
            f"liger={r.get('use_liger_kernel')} bc={r.get('boundary_check')} "
            f"weights={r.get('weights_dtype')} updated={r.get('updated_fraction')}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="suite", choices=["suite", "case", "text-tokens"])
    parser.add_argument("name", nargs="?", help="the case, for the 'case' command")
    parser.add_argument("--tokens", type=int, default=3_000_000, help="text-tokens: how many tokens to write")
    parser.add_argument("--out", default="bench-results", help="where results.json and the logs go")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="skip cases that would start after this")
    parser.add_argument("--tiny", action="store_true", help="tiny model shapes: a smoke run of the suite itself")
    args = parser.parse_args(argv)
    if args.command == "case":
        return case_main(args.name, Path(args.out), args.tiny)
    if args.command == "text-tokens":  # the learning-curve cases' text: --out FILE.npz, then BENCH_TEXT_TOKENS=FILE
        write_text_tokens(Path(args.out), args.tokens)
        return 0
    return suite(args)


if __name__ == "__main__":
    raise SystemExit(main())
