"""The user trainer configs the two-GPU bench trains with, and what each case expects to read back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GPU_SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "vocab_size": 2048}


TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 2048}


ZERO2_JSON: dict[str, Any] = {  # transformers' documented ds_config_zero2.json, without its optimizer/scheduler
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
        "round_robin_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


ZERO3_JSON: dict[str, Any] = {  # stage 3 as DeepSpeed's docs write it: no stage3_gather_16bit_weights_on_model_save
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


_ACCELERATE_TAIL = """\
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


# `accelerate config` (accelerate 1.15) answers: FSDP, version 2, the defaults except "resharding after forward: no".
# Its defaults include fsdp_state_dict_type SHARDED_STATE_DICT and fsdp_cpu_ram_efficient_loading true.
FSDP_YAML = (
    """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer
  fsdp_version: 2
"""
    + _ACCELERATE_TAIL
)


# `accelerate config`: DeepSpeed, no DeepSpeed config file, ZeRO-2, optimizer offloaded to CPU, gradient clipping 0.7.
ZERO2_OFFLOAD_YAML = (
    """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 0.7
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
"""
    + _ACCELERATE_TAIL
)


# `accelerate config`: DeepSpeed, ZeRO-3, every default (zero3_save_16bit_model: false is the default answer).
ZERO3_YAML = (
    """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero3_save_16bit_model: false
  zero_stage: 3
distributed_type: DEEPSPEED
"""
    + _ACCELERATE_TAIL
)


@dataclass(frozen=True)
class Case:
    """One sft stage run with a user's settings, and the readings that show they took effect."""

    name: str
    strategy: str
    note: str
    training: dict[str, Any]  # spec training fields (besides COMMON_TRAINING)
    extra_args: dict[str, Any]
    distributed: dict[str, Any] = field(default_factory=dict)  # spec distributed fields besides the strategy
    deepspeed_json: dict[str, Any] | None = None
    accelerate_yaml: str | None = None
    expect: dict[str, Any] = field(default_factory=dict)  # probe path (dotted) → expected reading
    gpu: bool = True


COMMON_TRAINING: dict[str, Any] = {
    "learning_rate": 2e-3,
    "per_device_batch_size": 4,
    "max_seq_length": 256,
    "logging_steps": 2,
    "save_steps": 10,
}


CASES: list[Case] = [
    Case(
        "zero2_json",
        "deepspeed_zero2",
        "distributed.deepspeed_config: the user's ZeRO-2 JSON ('auto' values, allgather_bucket_size 2e8); "
        "extra_args: fused torch AdamW with betas (0.85, 0.95), eps 1e-6, ddp_timeout; the spec's linear schedule, "
        "warmup 0.1, weight decay 0.01, clipping 0.5, 2 accumulation steps",
        {
            "lr_scheduler": "linear",
            "warmup_ratio": 0.1,
            "weight_decay": 0.01,
            "max_grad_norm": 0.5,
            "gradient_accumulation_steps": 2,
        },
        {
            "optim": "adamw_torch_fused",
            "adam_beta1": 0.85,
            "adam_beta2": 0.95,
            "adam_epsilon": 1e-6,
            "ddp_timeout": 900,
        },
        deepspeed_json=ZERO2_JSON,
        expect={
            "args.optim": "adamw_torch_fused",
            "args.ddp_timeout": 900,
            "optimizer.base.class": "AdamW",
            "optimizer.base.betas": [0.85, 0.95],
            "optimizer.base.eps": 1e-6,
            "optimizer.base.fused": True,
            "optimizer.base.weight_decays": [0.0, 0.01],
            "scheduler.lambda": "_get_linear_schedule_with_warmup_lr_lambda",
            "accelerator.distributed_type": "DEEPSPEED",
            "deepspeed.zero_stage": 2,
            "deepspeed.gradient_clipping": 0.5,
            "deepspeed.gradient_accumulation_steps": 2,
            "deepspeed.train_micro_batch_size_per_gpu": 4,
            "deepspeed.bf16": True,
            "deepspeed.allgather_bucket_size": 200000000,
            "deepspeed.reduce_bucket_size": 256 * 256,
            "deepspeed.auto_left": [],
            "deepspeed.optimizer_wrapper": "DeepSpeedZeroOptimizer",
            "deepspeed.optimizer_state_fraction_here": 0.5,
        },
    ),
    Case(
        "zero3_json",
        "deepspeed_zero3",
        "distributed.deepspeed_config: the user's ZeRO-3 JSON with stage3 options and 'auto' buckets, without "
        "stage3_gather_16bit_weights_on_model_save (DeepSpeed's default: false); extra_args: torch AdamW with "
        "beta2 0.98, eps 1e-7; the spec's cosine schedule, warmup 0.2, weight decay 0.1, clipping 0.3",
        {"lr_scheduler": "cosine", "warmup_ratio": 0.2, "weight_decay": 0.1, "max_grad_norm": 0.3},
        {"optim": "adamw_torch", "adam_beta2": 0.98, "adam_epsilon": 1e-7},
        deepspeed_json=ZERO3_JSON,
        expect={
            "args.optim": "adamw_torch",
            "optimizer.base.class": "AdamW",
            "optimizer.base.betas": [0.9, 0.98],
            "optimizer.base.eps": 1e-7,
            "optimizer.base.weight_decays": [0.0, 0.1],
            "scheduler.lambda": "_get_cosine_schedule_with_warmup_lr_lambda",
            "accelerator.distributed_type": "DEEPSPEED",
            "deepspeed.zero_stage": 3,
            "deepspeed.gradient_clipping": 0.3,
            "deepspeed.max_live_parameters": 1000000000,
            "deepspeed.prefetch_bucket_size": int(0.9 * 256 * 256),
            "deepspeed.param_persistence_threshold": 10 * 256,
            "deepspeed.gather_16bit_weights_on_model_save": True,
            "deepspeed.auto_left": [],
            "deepspeed.optimizer_wrapper": "DeepSpeedZeroOptimizer_Stage3",
            "deepspeed.parameter_fraction_here": 0.5,
        },
    ),
    Case(
        "fsdp_accelerate",
        "fsdp",
        "distributed.accelerate_config: FSDP2 as `accelerate config` writes it (its defaults: SHARDED_STATE_DICT, "
        "cpu_ram_efficient_loading; and no resharding after forward); extra_args: torch AdamW with beta2 0.99; "
        "the spec's constant_with_warmup schedule",
        {"lr_scheduler": "constant_with_warmup", "warmup_ratio": 0.1},
        {"optim": "adamw_torch", "adam_beta2": 0.99},
        accelerate_yaml=FSDP_YAML,
        expect={
            "optimizer.base.class": "AdamW",
            "optimizer.base.betas": [0.9, 0.99],
            "scheduler.lambda": "_get_constant_schedule_with_warmup_lr_lambda",
            "accelerator.distributed_type": "FSDP",
            "fsdp.version": 2,
            "fsdp.reshard_after_forward": False,
            "fsdp.cpu_ram_efficient_loading": True,
            "fsdp.activation_checkpointing": False,
            "fsdp.state_dict_type": "FULL_STATE_DICT",  # the stage's model folder needs full state dicts
            "fsdp.wrapped_layers": 4,
            "fsdp.parameter_fraction_here": 0.5,
        },
    ),
    Case(
        "zero2_offload_accelerate",
        "deepspeed_zero2",
        "distributed.accelerate_config: DeepSpeed ZeRO-2 as `accelerate config` writes it, optimizer offloaded to "
        "CPU, gradient clipping 0.7 (the spec's max_grad_norm stays at its default 1.0); extra_args: beta1 0.8",
        {"lr_scheduler": "linear", "warmup_ratio": 0.1},
        {"optim": "adamw_torch", "adam_beta1": 0.8},
        accelerate_yaml=ZERO2_OFFLOAD_YAML,
        expect={
            "optimizer.base.class": "AdamW",
            "optimizer.base.betas": [0.8, 0.999],
            "accelerator.distributed_type": "DEEPSPEED",
            "deepspeed.zero_stage": 2,
            "deepspeed.gradient_clipping": 0.7,
            "deepspeed.offload_optimizer": "cpu",
            "deepspeed.optimizer_state_device": "cpu",
            "deepspeed.auto_left": [],
        },
    ),
    Case(
        "zero3_accelerate",
        "deepspeed_zero3",
        "distributed.accelerate_config: DeepSpeed ZeRO-3 as `accelerate config` writes it with every default "
        "(zero3_save_16bit_model: false); extra_args: torch AdamW, eps 1e-7",
        {"lr_scheduler": "cosine", "warmup_ratio": 0.1},
        {"optim": "adamw_torch", "adam_epsilon": 1e-7},
        accelerate_yaml=ZERO3_YAML,
        expect={
            "optimizer.base.eps": 1e-7,
            "accelerator.distributed_type": "DEEPSPEED",
            "deepspeed.zero_stage": 3,
            "deepspeed.gather_16bit_weights_on_model_save": True,
            "deepspeed.auto_left": [],
            "deepspeed.parameter_fraction_here": 0.5,
        },
    ),
    Case(
        "zero2_cpu_offload",
        "deepspeed_zero2",
        "distributed.cpu_offload: true with the stage's generated ZeRO-2 config (no user file): optimizer state on "
        "the CPU, stepped by the Trainer's torch AdamW; extra_args: beta2 0.95",
        {"lr_scheduler": "linear", "warmup_ratio": 0.1},
        {"optim": "adamw_torch", "adam_beta2": 0.95},
        distributed={"cpu_offload": True},
        expect={
            "optimizer.base.class": "AdamW",
            "optimizer.base.betas": [0.9, 0.95],
            "accelerator.distributed_type": "DEEPSPEED",
            "deepspeed.zero_stage": 2,
            "deepspeed.offload_optimizer": "cpu",
            "deepspeed.optimizer_state_device": "cpu",
            "deepspeed.auto_left": [],
        },
    ),
    Case(
        "zero2_cpu_offload_ds_adam",
        "deepspeed_zero2",
        "distributed.cpu_offload: true, no optimizer settings in extra_args: accelerate swaps the Trainer's AdamW for "
        "DeepSpeed's CPU Adam (compiled at the start: nvcc and ninja needed), learning rate and weight decay kept",
        {"lr_scheduler": "linear", "warmup_ratio": 0.1, "weight_decay": 0.01},
        {"ddp_timeout": 900},
        distributed={"cpu_offload": True},
        expect={
            "optimizer.base.class": "DeepSpeedCPUAdam",
            "optimizer.base.weight_decays": [0.0, 0.01],
            "deepspeed.zero_stage": 2,
            "deepspeed.offload_optimizer": "cpu",
            "deepspeed.optimizer_state_device": "cpu",
        },
    ),
    Case(
        "ddp_extra_args",
        "ddp",
        "DDP (NCCL on GPUs, gloo on CPU): extra_args torch AdamW with betas (0.85, 0.95), eps 1e-6, ddp_timeout; "
        "the spec's linear schedule, warmup 0.1, weight decay 0.01, clipping 0.5",
        {"lr_scheduler": "linear", "warmup_ratio": 0.1, "weight_decay": 0.01, "max_grad_norm": 0.5},
        {"optim": "adamw_torch", "adam_beta1": 0.85, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "ddp_timeout": 900},
        expect={
            "args.optim": "adamw_torch",
            "args.ddp_timeout": 900,
            "args.max_grad_norm": 0.5,
            "optimizer.base.class": "AdamW",
            "optimizer.base.betas": [0.85, 0.95],
            "optimizer.base.eps": 1e-6,
            "optimizer.base.weight_decays": [0.0, 0.01],
            "scheduler.lambda": "_get_linear_schedule_with_warmup_lr_lambda",
            "accelerator.distributed_type": "MULTI_GPU",  # MULTI_CPU on CPU (see expectations)
        },
        gpu=False,
    ),
]


BY_NAME = {case.name: case for case in CASES}


REFUSED_EXTRA_ARGS = {  # extra_args the spec owns: refused when the pipeline loads, naming the field to use
    "lr_scheduler_type": "cosine_with_restarts",
    "warmup_ratio": 0.1,
    "warmup_steps": 5,
    "weight_decay": 0.1,
    "max_grad_norm": 0.3,
    "deepspeed": "ds.json",
}
