"""The GPU suite's cases: the model shapes and what each case trains, with its baseline."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 tensor-core peak (datasheet)


VOCAB = 151936  # Qwen3's vocabulary


SHAPES: dict[str, dict[str, Any]] = {  # the Qwen3 configs' shapes (untied output embedding)
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "qwen3-30b-a3b": dict(  # 128 experts, 8 active: 30.5B parameters, 3.3B active per token
        architecture="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "qwen3-14b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    name: str
    group: str  # B1..B5
    shape: str
    kind: str = "stage_sft"  # stage_sft | plain_peft | plain_trainer | stage_dpo | trl_dpo | matmul_ceiling
    method: str = "full"  # full | lora | qlora
    packing: bool = True
    per_device_batch_size: int = 4
    gradient_checkpointing: bool = False
    recompute_layers: int | None = None  # training.recompute_layers: the first N layers recompute (None: all)
    attn: str | None = None  # None: the stage's default for the device
    liger: bool | None = None  # None: the stage's default for the device
    strategy: str = "ddp"
    reshard_after_forward: bool | None = None  # FSDP2: None keeps the stage's setting
    pure_bf16: bool = False  # full fine-tuning: bf16 weights and optimizer state instead of float32 master weights
    lora_experts: bool = False  # LoRA on the experts too (lora.target_experts), not only attention and dense MLPs
    low_rank_experts: bool = True  # experts' adapters as low-rank grouped products (stages/expert_lora.py), else PEFT's
    lora_dropout: float | None = None  # None: the spec's default (lora.dropout)
    peft_input_casts: bool = False  # keep PEFT's cast of each LoRA input to float32 (before adapter_inputs_uncast)
    stock_experts: bool = False  # transformers' own grouped_mm experts forward, not the stages' (plain kinds: always)
    fp8: bool = False  # training.fp8: the linear layers' matmuls in float8 (torchao)
    fp8_compile: bool | None = None  # fp8: compile each float8 layer (None: the stage's choice)
    fp8_recipe: str | None = None  # fp8: torchao's scaling recipe (None: the stage's)
    compile_blocks: bool | None = (
        None  # each decoder layer compiled whole, its checkpointing inside (None: the stage's choice)
    )
    expert_parallel: int = 1  # distributed.expert_parallel: experts split over this many ranks (B7 cases: all)
    tensor_parallel: int = 1  # distributed.tensor_parallel: each layer split over this many ranks
    pipeline_parallel: int = 1  # distributed.pipeline_parallel: layers cut into this many stages (0: every process)
    gradient_accumulation_steps: int = 1  # micro-batches a step (under pipeline_parallel: the schedule's)
    router_aux_loss_coef: float | None = None  # training.router_aux_loss_coef (None: the model's; 0: the loss off)
    layers: int | None = None  # decoder layers, when fewer than the shape's
    text: bool = False  # real Korean text (bench/gpu_suite.py text_examples, BENCH_TEXT_TOKENS), not random tokens
    warmup: int = 4
    steps: int = 20
    max_seq_length: int = 2048
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # more trainer arguments (torch_compile, logging_steps)


# The base cases of the B2-at-4096, B5 and B6 groups; their variants below differ in the fields they name.
B2_4K = Case(
    "b2_stage_4k",
    "B2",
    "qwen3-8b",
    method="lora",
    per_device_batch_size=2,
    gradient_checkpointing=True,
    max_seq_length=4096,
    warmup=3,
    steps=10,
    note="sft stage, LoRA, packed rows of 4096, flex + Liger, gradient checkpointing",
)


B5 = Case(
    "b5_stage",
    "B5",
    "qwen3-30b-a3b",
    method="lora",
    per_device_batch_size=1,
    max_seq_length=4096,
    warmup=3,
    steps=10,
    note="sft stage, LoRA on attention, packed rows of 4096 (document-masked), grouped_mm experts, stage GPU "
    "defaults (attention kernel, Liger), no checkpointing",
)


B5_B4 = replace(
    B5,
    name="b5_stage_b4_ckpt",
    per_device_batch_size=4,
    gradient_checkpointing=True,
    steps=8,
    note="as b5_stage with 4 rows per step and gradient checkpointing",
)
"""B5 at 4 rows of 4096 a step with checkpointing: what fits one 80 GB H100 (63.7 GiB)."""


B5_FULL = replace(
    B5,
    name="b5_full_8l",
    method="full",
    layers=8,
    per_device_batch_size=2,
    gradient_checkpointing=True,
    steps=8,
    note="sft stage, full fine-tuning (float32 masters, the router trained) of 8 of the 48 layers, 2 rows, "
    "checkpointing, the stages' experts forward",
)


B6 = Case(
    "b6_fsdp_8b",
    "B6",
    "qwen3-8b",
    strategy="fsdp",
    per_device_batch_size=2,
    gradient_checkpointing=True,
    max_seq_length=4096,
    warmup=3,
    steps=8,
    note="cpt/sft stage, full, FSDP2 as the stage configures it, packed rows of 4096 with documents kept apart "
    "(flex + Liger), activation checkpointing, 2 rows per GPU",
)

CASES: list[Case] = [
    # B1: full fine-tuning, Qwen3-1.7B shape, one GPU.
    Case(
        "b1_padded",
        "B1",
        "qwen3-1.7b",
        packing=False,
        per_device_batch_size=4,
        attn="sdpa",
        liger=False,
        warmup=4,
        steps=25,
        note="sft stage, packing off: one example per row, rows padded to the longest; spec defaults before this "
        "suite (sdpa, no Liger), same batch of 4 rows",
    ),
    Case(
        "b1_packed_sdpa",
        "B1",
        "qwen3-1.7b",
        attn="sdpa",
        liger=False,
        note="packed rows, sdpa with the dense block-diagonal mask built from position ids",
    ),
    Case("b1_packed_flex", "B1", "qwen3-1.7b", attn="flex_attention", liger=False, note="packed, flex block mask"),
    Case("b1_packed", "B1", "qwen3-1.7b", note="packed, stage GPU defaults: flex attention + Liger"),
    Case(
        "b1_packed_b8",
        "B1",
        "qwen3-1.7b",
        per_device_batch_size=8,
        note="packed, stage GPU defaults, 8 rows per step",
    ),
    Case(
        "b1_packed_b16",
        "B1",
        "qwen3-1.7b",
        per_device_batch_size=16,
        warmup=3,
        steps=12,
        note="packed, stage GPU defaults, 16 rows per step",
    ),
    Case(
        "b1_packed_b24",
        "B1",
        "qwen3-1.7b",
        per_device_batch_size=24,
        warmup=3,
        steps=10,
        note="packed, stage GPU defaults, 24 rows per step",
    ),
    Case(
        "b1_packed_b16_pure",
        "B1",
        "qwen3-1.7b",
        per_device_batch_size=16,
        pure_bf16=True,
        warmup=3,
        steps=12,
        note="as b1_packed_b16 with training.pure_bf16: bf16 weights and optimizer state, no float32 master",
    ),
    Case(
        "b1_padded_pure",
        "B1",
        "qwen3-1.7b",
        packing=False,
        per_device_batch_size=4,
        attn="sdpa",
        liger=False,
        pure_bf16=True,
        warmup=4,
        steps=25,
        note="as b1_padded with training.pure_bf16",
    ),
    Case(
        "b1_matmul_ceiling",
        "B1",
        "qwen3-1.7b",
        kind="matmul_ceiling",
        per_device_batch_size=16,
        warmup=3,
        steps=10,
        note="forward and backward of the model's Linear layers alone (bf16, 16 rows of 2048 tokens): the "
        "ceiling of any stage's MFU at this shape",
    ),
    # B2: LoRA SFT, Qwen3-8B shape, one GPU.
    Case(
        "b2_plain_peft",
        "B2",
        "qwen3-8b",
        kind="plain_peft",
        method="lora",
        packing=False,
        attn="sdpa",
        per_device_batch_size=8,
        warmup=3,
        steps=10,
        note="transformers Trainer + PEFT defaults: padded batches with attention_mask, sdpa, batch 8 (Trainer "
        "default), no checkpointing, LoRA r16/alpha32 all-linear (the stage's adapter)",
    ),
    Case(
        "b2_plain_peft_b4",
        "B2",
        "qwen3-8b",
        kind="plain_peft",
        method="lora",
        packing=False,
        attn="sdpa",
        per_device_batch_size=4,
        warmup=3,
        steps=10,
        note="as b2_plain_peft with batch 4: the Trainer's default batch of 8 runs out of memory on 141 GB",
    ),
    Case(
        "b3_fsdp_b8",
        "B3",
        "qwen3-1.7b",
        strategy="fsdp",
        per_device_batch_size=8,
        note="torchrun, FSDP2 as the stage configures it, 8 rows per GPU (the B1 winner)",
    ),
    Case(
        "b3_fsdp_b8_noreshard",
        "B3",
        "qwen3-1.7b",
        strategy="fsdp",
        per_device_batch_size=8,
        reshard_after_forward=False,
        note="torchrun, FSDP2 keeping the gathered parameters from forward to backward, 8 rows per GPU",
    ),
    Case(
        "b3_fsdp_b16",
        "B3",
        "qwen3-1.7b",
        strategy="fsdp",
        per_device_batch_size=16,
        warmup=3,
        steps=12,
        note="torchrun, FSDP2 as the stage configures it, 16 rows per GPU",
    ),
    Case(
        "b3_fsdp_b16_noreshard",
        "B3",
        "qwen3-1.7b",
        strategy="fsdp",
        per_device_batch_size=16,
        reshard_after_forward=False,
        warmup=3,
        steps=12,
        note="torchrun, FSDP2 keeping the gathered parameters from forward to backward, 16 rows per GPU",
    ),
    Case(
        "b3_fsdp_b24",
        "B3",
        "qwen3-1.7b",
        strategy="fsdp",
        per_device_batch_size=24,
        warmup=3,
        steps=10,
        note="torchrun, FSDP2 as the stage configures it, 24 rows per GPU",
    ),
    Case(
        "b3_fsdp_b24_noreshard",
        "B3",
        "qwen3-1.7b",
        strategy="fsdp",
        per_device_batch_size=24,
        reshard_after_forward=False,
        warmup=3,
        steps=10,
        note="torchrun, FSDP2 keeping the gathered parameters from forward to backward, 24 rows per GPU",
    ),
    Case(
        "b2_stage",
        "B2",
        "qwen3-8b",
        method="lora",
        per_device_batch_size=4,
        gradient_checkpointing=True,
        warmup=3,
        steps=10,
        note="sft stage, LoRA, packed, flex + Liger, gradient checkpointing",
    ),
    Case(
        "b2_stage_nockpt",
        "B2",
        "qwen3-8b",
        method="lora",
        per_device_batch_size=2,
        warmup=3,
        steps=12,
        note="sft stage, LoRA, packed, flex + Liger, no checkpointing",
    ),
    Case(
        "b2_qlora",
        "B2",
        "qwen3-8b",
        method="qlora",
        per_device_batch_size=4,
        gradient_checkpointing=True,
        warmup=2,
        steps=6,
        note="sft stage, QLoRA (bitsandbytes NF4), packed, stage GPU defaults (sdpa, Liger), checkpointing",
    ),
    Case(
        "b2_qlora_flex",
        "B2",
        "qwen3-8b",
        method="qlora",
        attn="flex_attention",
        per_device_batch_size=4,
        gradient_checkpointing=True,
        warmup=2,
        steps=6,
        note="as b2_qlora with flex attention (not the stage default for QLoRA: boundary check)",
    ),
    Case(
        "b2_qlora_flex_noliger",
        "B2",
        "qwen3-8b",
        method="qlora",
        attn="flex_attention",
        liger=False,
        per_device_batch_size=4,
        gradient_checkpointing=True,
        warmup=2,
        steps=6,
        note="as b2_qlora_flex without Liger kernels",
    ),
    # B3: the B1 workload on all GPUs through torchrun, FSDP2 (run by the suite with torchrun).
    Case("b3_fsdp", "B3", "qwen3-1.7b", strategy="fsdp", note="torchrun, FSDP2 as the stage configures it"),
    Case(
        "b3_fsdp_noreshard",
        "B3",
        "qwen3-1.7b",
        strategy="fsdp",
        reshard_after_forward=False,
        note="torchrun, FSDP2 keeping the gathered parameters from forward to backward",
    ),
    Case(
        "b3_zero2",
        "B3",
        "qwen3-1.7b",
        strategy="deepspeed_zero2",
        per_device_batch_size=8,
        warmup=3,
        steps=10,
        note="torchrun, DeepSpeed ZeRO-2 as the stage configures it, 8 rows per GPU",
    ),
    Case(
        "b3_zero3",
        "B3",
        "qwen3-1.7b",
        strategy="deepspeed_zero3",
        per_device_batch_size=8,
        warmup=3,
        steps=10,
        note="torchrun, DeepSpeed ZeRO-3 as the stage configures it, 8 rows per GPU",
    ),
    # B4: DPO with LoRA, Qwen3-1.7B shape.
    Case(
        "b4_trl_default",
        "B4",
        "qwen3-1.7b",
        kind="trl_dpo",
        method="lora",
        attn="sdpa",
        per_device_batch_size=8,
        warmup=3,
        steps=10,
        note="TRL DPOTrainer + DPOConfig defaults (batch 8), PEFT LoRA r16, reference = adapter disabled",
    ),
    Case(
        "b4_stage",
        "B4",
        "qwen3-1.7b",
        kind="stage_dpo",
        method="lora",
        per_device_batch_size=8,
        warmup=3,
        steps=10,
        note="rlhf stage (dpo): precomputed reference log-probs, stage GPU defaults",
    ),
    # B2 at rows of 4096, the sequence length of NeMo AutoModel's published LoRA Llama-3-8B figure (one H100).
    B2_4K,
    replace(
        B2_4K,
        name="b2_stage_4k_nockpt",
        gradient_checkpointing=False,
        note="as b2_stage_4k without gradient checkpointing",
    ),
    replace(
        B2_4K,
        name="b2_stage_4k_nockpt_casts",
        gradient_checkpointing=False,
        peft_input_casts=True,
        note="as b2_stage_4k_nockpt with PEFT's cast of every LoRA input to the adapter's float32 (the stage before "
        "adapter_inputs_uncast)",
    ),
    replace(
        B2_4K,
        name="b2_stage_4k_nockpt_nodrop",
        gradient_checkpointing=False,
        lora_dropout=0.0,
        note="as b2_stage_4k_nockpt with lora.dropout 0",
    ),
    replace(
        B2_4K,
        name="b2_stage_4k_nockpt_b3",
        gradient_checkpointing=False,
        lora_dropout=0.0,
        per_device_batch_size=3,
        steps=8,
        note="as b2_stage_4k_nockpt_nodrop with 3 rows per step",
    ),
    replace(
        B2_4K,
        name="b2_stage_4k_nodrop",
        lora_dropout=0.0,
        note="as b2_stage_4k (gradient checkpointing) with lora.dropout 0",
    ),
    replace(
        B2_4K,
        name="b2_plain_peft_4k",
        kind="plain_peft",
        attn="sdpa",
        gradient_checkpointing=False,
        per_device_batch_size=1,
        note="transformers Trainer + PEFT (LoRA r16/alpha32 all-linear, dropout 0.05): the same packed rows of 4096 "
        "without position ids, sdpa, 1 row (2 run out of memory without the fused loss), no checkpointing",
    ),
    replace(
        B2_4K,
        name="b2_stage_4k_nockpt_b1",
        gradient_checkpointing=False,
        per_device_batch_size=1,
        steps=12,
        note="as b2_stage_4k_nockpt with one row per step",
    ),
    # B5: LoRA SFT on a mixture of experts of Qwen3-30B-A3B's shape (all 48 layers), one GPU, rows of 4096.
    B5,
    replace(
        B5,
        name="b5_plain_peft",
        kind="plain_peft",
        attn="sdpa",
        note="transformers Trainer + PEFT: the same packed rows (no position ids, so attention crosses documents), "
        "grouped_mm experts, sdpa, LoRA r16/alpha32 on attention, no checkpointing",
    ),
    replace(B5, name="b5_stage_b2", per_device_batch_size=2, note="as b5_stage with 2 rows per step"),
    B5_B4,
    replace(
        B5_B4,
        name="b5_stage_b4_blocks",
        compile_blocks=True,
        note="as b5_stage_b4_ckpt with each decoder layer compiled, its checkpointing inside the compiled region",
    ),
    # training.recompute_layers: the last `kept` of the 48 layers keep their activations, at 4 and 5 rows a step
    *(
        replace(
            B5_B4,
            name=f"b5_stage_b{rows}_keep{kept}",
            per_device_batch_size=rows,
            recompute_layers=48 - kept,
            steps=12,
            note=f"{rows} rows of 4096 a step, the last {kept} of the 48 layers keeping their activations "
            f"(recompute_layers {48 - kept})",
        )
        for rows, kept in ((4, 4), (4, 6), (4, 10), (4, 12), (5, 6), (5, 8))
    ),
    replace(B5_B4, name="b5_stage_b4_ckpt_12", steps=12, note="b5_stage_b4_ckpt timed over 12 steps (baseline)"),
    replace(B5_B4, name="b5_stage_b5_ckpt", per_device_batch_size=5, steps=12, note="as b5_stage_b4_ckpt, 5 rows"),
    replace(
        B5,
        name="b5_stage_sdpa",
        attn="sdpa",
        note="as b5_stage with sdpa (a dense block-diagonal mask from the position ids) instead of flex attention",
    ),
    replace(
        B5_B4,
        name="b5_stage_b4_ckpt_stock",
        stock_experts=True,
        note="baseline of b5_stage_b4_ckpt: transformers' own grouped_mm experts forward (the routing weight on "
        "the hidden-wide output in float32, indexing's scatter-add backward)",
    ),
    B5_FULL,
    replace(
        B5_FULL,
        name="b5_full_8l_stock",
        stock_experts=True,
        note="baseline of b5_full_8l: transformers' own grouped_mm experts forward",
    ),
    replace(
        B5,
        name="b5_stage_experts",
        lora_experts=True,
        gradient_checkpointing=True,
        note="as b5_stage with LoRA on the experts too (lora.target_experts) and gradient checkpointing, the "
        "experts' adapters applied as low-rank grouped products beside the base grouped GEMM",
    ),
    replace(
        B5,
        name="b5_stage_experts_merged",
        lora_experts=True,
        low_rank_experts=False,
        gradient_checkpointing=True,
        note="baseline of b5_stage_experts: PEFT's path, the adapter merged into the whole expert stack on every "
        "forward (without checkpointing it ran out of memory on 141 GB)",
    ),
    # Both experts cases trained on NaN gradients on 2 x H200 (2026-11-28): these take away one suspect each.
    replace(
        B5,
        name="b5_stage_experts_sdpa",
        lora_experts=True,
        gradient_checkpointing=True,
        attn="sdpa",
        note="as b5_stage_experts with sdpa instead of flex attention",
    ),
    replace(
        B5,
        name="b5_stage_experts_noliger",
        lora_experts=True,
        gradient_checkpointing=True,
        liger=False,
        note="as b5_stage_experts without Liger's kernels",
    ),
    replace(
        B5,
        name="b5_stage_experts_nockpt",
        lora_experts=True,
        gradient_checkpointing=False,
        note="as b5_stage_experts without gradient checkpointing (the low-rank path builds no merged weights)",
    ),
    replace(
        B5,
        name="b5_stage_experts_b4",
        lora_experts=True,
        gradient_checkpointing=True,
        per_device_batch_size=4,
        note="as b5_stage_experts with 4 rows per step (where b5_stage_b4_ckpt reached 11,253 tok/s)",
    ),
    replace(
        B5,
        name="b5_stage_experts_merged_b4",
        lora_experts=True,
        low_rank_experts=False,
        gradient_checkpointing=True,
        per_device_batch_size=4,
        note="baseline of b5_stage_experts_b4",
    ),
    # B6: full fine-tuning of the 8B shape under FSDP2 on every GPU of the node (torchrun), rows of 4096.
    B6,
    replace(B6, name="b6_fsdp_8b_b4", per_device_batch_size=4, note="as b6_fsdp_8b with 4 rows per GPU"),
    replace(
        B6,
        name="b6_plain_fsdp_8b",
        kind="plain_trainer",
        packing=False,
        attn="sdpa",
        per_device_batch_size=8,
        note="baseline: transformers Trainer + accelerate FSDP2 with their defaults (padded batches of 8, sdpa, no "
        "Liger), each decoder layer a shard unit, activation checkpointing",
    ),
]

# B7: expert parallelism (issue 35, item 3) over every GPU of the node (torchrun), Qwen3-30B-A3B's shape, rows of
# 4096; in-run baselines: b5_plain_peft and b5_stage on one GPU of the same machine.
B7 = Case(
    "b7_ep_lora",
    "B7",
    "qwen3-30b-a3b",
    method="lora",
    strategy="fsdp",
    expert_parallel=0,  # 0: every process of the run
    per_device_batch_size=2,
    gradient_checkpointing=True,
    max_seq_length=4096,
    warmup=3,
    steps=8,
    note="sft stage, LoRA on attention, all 48 layers, experts split over every GPU (distributed.expert_parallel), "
    "FSDP2 for the rest (transformers' own plan), 2 packed rows of 4096 per GPU, gradient checkpointing",
)
B7_FULL = replace(
    B7,
    name="b7_ep_full",
    method="full",
    layers=20,
    per_device_batch_size=1,
    note="full fine-tuning (float32 masters, bf16 compute) of 20 of the 48 layers, experts split over every "
    "GPU, 1 row of 4096 per GPU, gradient checkpointing",
)
CASES += [
    B7,
    replace(B7, name="b7_ep_lora_b4", per_device_batch_size=4, note="as b7_ep_lora with 4 rows per GPU"),
    replace(
        B7,
        name="b7_ep_experts",
        lora_experts=True,
        note="as b7_ep_lora with LoRA on the experts too (lora.target_experts: each rank's experts' rows, as "
        "low-rank grouped products); in-run baseline b5_stage_experts on one GPU",
    ),
    B7_FULL,
]

# B8: float8 matmuls (training.fp8, issue 38) against bf16, full fine-tuning of 12 of the 8B shape's 36 layers on one
# GPU, rows of 4096, 50 steps with the loss of every step (the loss target: within 1% of bf16's).
B8_CURVE = {"logging_steps": 1, "learning_rate": 3e-4, "warmup_steps": 30, "lr_scheduler_type": "cosine"}
"""Trainer arguments of B8's learning curve: a learning rate at which a model from random weights learns."""

B8 = Case(
    "b8_bf16",
    "B8",
    "qwen3-8b",
    layers=12,
    per_device_batch_size=2,
    gradient_checkpointing=True,
    max_seq_length=4096,
    warmup=5,
    steps=45,
    extra={"logging_steps": 1},
    note="baseline: sft stage, full fine-tuning (float32 masters, bf16 autocast), 12 layers of the 8B shape, 2 packed "
    "rows of 4096, flex + Liger, gradient checkpointing",
)
B8_B4 = replace(B8, per_device_batch_size=4, warmup=3, steps=12, extra={})
"""B8 at 4 rows a step, 15 steps (12 timed)."""
CASES += [
    B8,
    replace(
        B8, name="b8_fp8", fp8=True, note="as b8_bf16 with training.fp8 (the stage's: each decoder layer compiled)"
    ),
    replace(B8, name="b8_fp8_layers", fp8=True, compile_blocks=False, note="as b8_fp8, each float8 layer compiled"),
    replace(
        B8, name="b8_fp8_rowwise", fp8=True, fp8_recipe="rowwise", compile_blocks=False, note="b8_fp8_layers, rowwise"
    ),
    replace(
        B8, name="b8_fp8_eager", fp8=True, fp8_compile=False, compile_blocks=False, note="b8_fp8, nothing compiled"
    ),
    replace(B8_B4, name="b8_bf16_b4", note="as b8_bf16, 4 rows"),
    replace(B8_B4, name="b8_fp8_b4", fp8=True, note="fp8, 4 rows"),
    replace(B8_B4, name="b8_fp8_layers_b4", fp8=True, compile_blocks=False, note="b8_fp8_layers, 4 rows"),
    # A learning curve on real text: random tokens bound float8's drift but teach nothing. From random weights, at a
    # learning rate that moves them, every token trained (documents packed into rows of 4096).
    replace(B8, name="b8_bf16_text", text=True, steps=295, extra=B8_CURVE, note="as b8_bf16, Korean text, 300 steps"),
    replace(B8, name="b8_fp8_text", text=True, steps=295, extra=B8_CURVE, fp8=True, note="as b8_fp8, Korean text"),
    replace(B8, name="b8_bf16_24l", layers=24, note="as b8_bf16 with 24 of the 36 layers"),
    replace(B8, name="b8_fp8_24l", layers=24, fp8=True, note="as b8_fp8 with 24 of the 36 layers"),
    # bf16 with each decoder layer compiled whole, its activation checkpointing inside the compiled region, as the
    # stage does it for fp8 (stages.float8.compile_decoder_layers); Liger's layer kernels off (Inductor fuses the
    # norms, RoPE and SwiGLU inside a layer), the loss fused by TRL's LM head.
    replace(B8, name="b8_bf16_blocks", compile_blocks=True, note="as b8_bf16, each decoder layer compiled"),
    replace(B8_B4, name="b8_bf16_blocks_b4", compile_blocks=True, note="as b8_bf16_b4, each decoder layer compiled"),
    replace(
        B8,
        name="b8_fp8_model_compile",
        fp8=True,
        fp8_compile=False,
        compile_blocks=False,
        extra={**B8.extra, "torch_compile": True},
        note="as b8_fp8 with the whole model compiled (the trainer's torch_compile) instead of each layer",
    ),
    replace(
        B8,
        name="b8_bf16_model_compile",
        extra={**B8.extra, "torch_compile": True},
        note="as b8_bf16 with the whole model compiled (the trainer's torch_compile)",
    ),
]

# B8 over every GPU of the node (issue 38's float8 row: the 8B full fine-tune on 4 x H100): all 36 layers of the 8B
# shape, FSDP2 as the stage configures it (float32 masters, each decoder layer a shard unit), 2 packed rows of 4096 per
# GPU, checkpointing. The stage compiles each decoder layer whole in float8, its checkpointing inside, before FSDP2
# shards it (torchtitan's order), FSDP2's own recomputation off; _layers compiles each float8 layer alone, and
# bf16_blocks compiles bf16's decoder layers as the stage does float8's.
B8_FSDP = replace(
    B8,
    name="b8_fsdp_bf16",
    group="B8-N",
    layers=None,
    strategy="fsdp",
    warmup=3,
    steps=15,
    extra={"logging_steps": 1},
    note="B8 over every GPU: the 8B shape's 36 layers, full fine-tuning under FSDP2, 2 rows of 4096 per GPU, "
    "checkpointing, bf16 (baseline)",
)
CASES += [
    B8_FSDP,
    replace(B8_FSDP, name="b8_fsdp_fp8", fp8=True, note="as b8_fsdp_bf16 with training.fp8 (the stage's)"),
    replace(B8_FSDP, name="b8_fsdp_fp8_layers", fp8=True, compile_blocks=False, note="b8_fsdp_fp8, per float8 layer"),
    replace(B8_FSDP, name="b8_fsdp_bf16_blocks", compile_blocks=True, note="b8_fsdp_bf16, each layer compiled"),
]
# The same four with 8 of the 36 layers: they fit one GPU, where FSDP2 shards over a single rank (its hooks, float8's
# and the compiled layers under them run; nothing is gathered), a check of the path before 4 GPUs are lent:
#   python -m torch.distributed.run --standalone --nproc-per-node=1 bench/gpu_suite.py case b8_fsdp_fp8_8l --out OUT
CASES += [
    replace(case, name=f"{case.name}_8l", layers=8, note=f"{case.note}; 8 layers")
    for case in CASES
    if case.name.startswith("b8_fsdp_")
]

# B9: pipeline and tensor parallelism (issue 38) over every GPU of the node (torchrun); B9-1: their one-GPU baseline.
# Pipeline: 12 layers of the 8B shape cut into as many stages as GPUs, one pipeline, 8 micro-batches of one row of
# 4096 a step, learning Korean text (BENCH_TEXT_TOKENS) from random weights, 50 steps with every step's loss; the
# baseline trains the same 8 rows a step (one row, 8 accumulation steps) on one GPU. The bubble: (P - 1) / (8 + P - 1)
# of a step by the schedule; measured, 1 - tok/s / (P x the baseline's tok/s).
B9 = Case(
    "b9_pp",
    "B9",
    "qwen3-8b",
    layers=12,
    strategy="fsdp",
    pipeline_parallel=0,
    per_device_batch_size=1,
    gradient_accumulation_steps=8,
    gradient_checkpointing=True,
    max_seq_length=4096,
    text=True,
    warmup=5,
    steps=45,
    extra=B8_CURVE,
    note="cpt-like full fine-tuning (float32 masters) of 12 layers of the 8B shape cut into one stage per GPU "
    "(distributed.pipeline_parallel), one pipeline, 8 micro-batches of 1 row of 4096, checkpointing, Korean text",
)
# Tensor parallelism: 24 of the 14B shape's 40 layers, rows of 4096, no checkpointing, pairs of GPUs splitting each
# layer (FSDP2 over the pairs), 2 rows per pair; the baseline shards over every GPU with FSDP2 alone, with
# checkpointing, 1 row per GPU: the same rows a step.
B9_TP = Case(
    "b9_tp2",
    "B9",
    "qwen3-14b",
    layers=24,
    strategy="fsdp",
    tensor_parallel=2,
    per_device_batch_size=2,
    max_seq_length=4096,
    warmup=3,
    steps=10,
    note="full fine-tuning (float32 masters) of 24 layers of the 14B shape, each layer split over 2 GPUs "
    "(distributed.tensor_parallel), FSDP2 over the pairs, 2 packed rows of 4096 per pair, no checkpointing",
)
CASES += [
    B9,
    replace(
        B9,
        name="b9_pp_one_gpu",
        group="B9-1",
        strategy="ddp",
        pipeline_parallel=1,
        note="baseline of b9_pp: the same model, rows and steps on one GPU (1 row, 8 accumulation steps)",
    ),
    B9_TP,
    replace(
        B9_TP,
        name="b9_tp2_fsdp_ckpt",
        tensor_parallel=1,
        per_device_batch_size=1,
        gradient_checkpointing=True,
        note="baseline of b9_tp2: FSDP2 alone over every GPU, 1 row of 4096 per GPU (the same rows a step), "
        "checkpointing",
    ),
    replace(
        B9_TP,
        name="b9_fsdp_nockpt",
        tensor_parallel=1,
        per_device_batch_size=1,
        note="as b9_tp2_fsdp_ckpt without checkpointing: whether the shape fits FSDP2 alone",
    ),
    replace(
        B9_TP,
        name="b9_pp2_tp2",
        pipeline_parallel=2,
        per_device_batch_size=1,
        gradient_accumulation_steps=4,
        note="on 4 GPUs: b9_tp2's layers cut into 2 stages, each split over a pair (pipeline_parallel 2 x "
        "tensor_parallel 2, one pipeline), 4 micro-batches of 1 row of 4096 a step (b9_tp2's rows), no checkpointing",
    ),
    replace(
        B7_FULL,
        name="b9_pp2_ep2",
        group="B9",
        pipeline_parallel=2,
        expert_parallel=2,
        gradient_accumulation_steps=4,
        router_aux_loss_coef=0,  # pipeline stages train a mixture with its balance loss off
        note="on 4 GPUs: b7_ep_full's 20 layers of Qwen3-30B-A3B's shape cut into 2 stages (2 pipelines), each "
        "stage's experts spread over its 2 ranks (pipeline_parallel 2 x expert_parallel 2), FSDP2 over the "
        "pipelines, 4 micro-batches of 1 row of 4096 a step, checkpointing; in-run baseline b7_ep_full",
    ),
]

MULTI_GPU_GROUPS = ("B3", "B6", "B7", "B8-N", "B9")
"""Groups whose cases run under torchrun over every GPU of the node."""


BY_NAME = {case.name: case for case in CASES}
