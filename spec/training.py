"""The training stages' sections: LoRA, trainer settings, distribution, and the cpt, sft and rlhf stages."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from spec.data import StageData, check_mixture, dataset_loc, datasets
from spec.fields import FieldError, Int64, Seed, StrictModel
from spec.search import HpoSpec
from spec.stage import RunPolicy, StageBase

# A module's name (or the dotted tail of its path) as PEFT matches it: `lm_head`, `model.embed_tokens`.
ModuleName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")]


class LoraSpec(StrictModel):
    """LoRA adapter settings (used when method is lora or qlora)."""

    r: Int64 = Field(16, gt=0, description="Adapter rank.")
    alpha: Int64 = Field(32, gt=0, description="Scaling numerator (lora_alpha).")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter input. 0 by default (PEFT's, LLaMA-Factory's and Unsloth's default too): "
        "dropout keeps a mask of every LoRA layer's input for the backward pass, which cost 19 GiB and 4% of the "
        "speed of a LoRA step of an 8B model at 2 rows of 4096 (docs/performance.md, B2 on an H100).",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules that get adapters: 'all-linear' or a list of module names."
    )
    target_experts: bool = Field(
        True,
        description="On a mixture-of-experts model, also put adapters on the experts' weights (one rank-r adapter "
        "per expert on each stacked expert matrix, e.g. qwen3_moe's mlp.experts.gate_up_proj and down_proj, "
        "through PEFT target_parameters): transformers keeps them as 3-D parameters, which target_modules never "
        "reaches. PEFT applies no dropout to such adapters, so dropout is then 0 for the whole adapter. Off: "
        "adapters on target_modules only (the attention projections, and any dense MLP layers). The router "
        "(mlp.gate) stays frozen either way: it keeps the base model's routing. Ignored on dense models.",
    )
    modules_to_save: list[ModuleName] = Field(
        [],
        description="Modules trained whole beside the adapter and saved with it (PEFT's modules_to_save; "
        "LLaMA-Factory's additional_target, Axolotl's lora_modules_to_save), e.g. [embed_tokens, lm_head] for "
        "continued pretraining on a language or domain whose tokens the base model barely knows. Each costs a "
        "trainable copy of the module's weights with its optimizer state (the embedding and the head of a 150k "
        "vocabulary at width 8192 are 2.5B parameters). Refused on a model whose embeddings are tied to its head "
        "(the trained copy would be lost when the model is loaded tied again): train that stage with method full.",
    )
    merge_after: bool = Field(
        False,
        description="Merge the adapter into the base weights when the stage ends, so the next stage "
        "starts from a full model; otherwise the next stage continues the same adapter.",
    )


TRAINER_ARGS_OWNED: dict[str, str] = {
    "output_dir": "the run directory (the stage's checkpoints folder)",
    "per_device_train_batch_size": "training.per_device_batch_size",
    "per_device_eval_batch_size": "training.per_device_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "learning_rate": "training.learning_rate",
    "num_train_epochs": "training.epochs",
    "max_steps": "training.max_steps",
    "warmup_steps": "training.warmup_ratio",
    "warmup_ratio": "training.warmup_ratio",
    "lr_scheduler_type": "training.lr_scheduler",
    "weight_decay": "training.weight_decay",
    "max_grad_norm": "training.max_grad_norm",
    "seed": "training.seed",
    "data_seed": "training.seed",
    "logging_steps": "training.logging_steps",
    "save_strategy": "training.save_steps",
    "save_steps": "training.save_steps",
    "save_total_limit": "training.save_total_limit",
    "eval_strategy": "training.eval_steps",
    "eval_steps": "training.eval_steps",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "activation_checkpointing": "training.gradient_checkpointing or distributed.activation_checkpointing",
    "max_length": "training.max_seq_length",
    "max_seq_length": "training.max_seq_length",
    "max_completion_length": "training.max_seq_length",
    "packing": "training.packing",
    "bf16": "model.dtype (mixed precision follows the weights' dtype)",
    "fp16": "model.dtype (mixed precision follows the weights' dtype)",
    "use_cpu": "the stage's resources (it trains on CPU only where there is no GPU)",
    "fsdp": "distributed.strategy",
    "fsdp_config": "distributed.strategy",
    "deepspeed": "distributed.strategy or distributed.deepspeed_config",
    "ddp_backend": "distributed.strategy",
    "report_to": "tracking (the stage's tracker reports to MLflow, W&B and TensorBoard)",
    "resume_from_checkpoint": "nothing: the stage resumes from its newest valid checkpoint itself",
    "trust_remote_code": "model.trust_remote_code",
    "beta": "stages.rlhf.beta",
    "num_generations": "stages.rlhf.num_generations",
    "precompute_ref_log_probs": "stages.rlhf.precompute_ref_log_probs",
    "reward_weights": "stages.rlhf.reward_functions",
    "assistant_only_loss": "stages.sft.assistant_only_loss",
    "logging_dir": "the run directory (the stage's logs folder)",
    "accelerator_config": "distributed.accelerate_config (embedded in the spec, not a path read in the pod)",
    "chat_template_path": "model.chat_template",
}


"""Trainer config fields that a spec field sets (training.extra_args may not): the field → the spec field to use."""


_HUB_UPLOAD = (
    "the trainer would upload the model to the Hugging Face Hub with the pods' token at every save, before "
    "evaluate's gate: a run publishes only through the deploy stage, after the gate"
)


TRAINER_ARGS_REFUSED: dict[str, str] = {
    "push_to_hub": _HUB_UPLOAD,
    "push_to_hub_": _HUB_UPLOAD,
    "hub_": _HUB_UPLOAD,
    "trackio_": "the trainer would send metrics to a Trackio Space with the pods' token: the tracking section "
    "decides where runs are tracked",
    "log_completions_hub_repo": "GRPO would upload its completions to that Hugging Face Hub dataset with the pods' "
    "token",
    "vllm_server_base_url": "GRPO would send its prompts and the policy's weights to that server",
    "vllm_server_host": "GRPO would send its prompts and the policy's weights to that server",
    "model_init_kwargs": "they reach from_pretrained (remote code, another revision or repository): the model "
    "section decides how the model loads",
}


"""Trainer config fields that send data out of the cluster or run code: training.extra_args may not set them,
in the pipeline file either. An entry ending in `_` is a prefix (every `hub_*` field); any other also covers the
names ending in `_<entry>` (`ref_model_init_kwargs`, `teacher_model_init_kwargs`)."""


FORM_EXTRA_ARGS: tuple[str, ...] = (
    # the optimizer and the schedule's shape
    "optim", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_kwargs",
    # regularisation
    "label_smoothing_factor", "neftune_noise_alpha", "average_tokens_across_devices",
    # memory and speed
    "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "activation_offloading",
    "torch_empty_cache_steps", "torch_compile", "torch_compile_mode", "ddp_timeout",
    # TRL's preference losses (DPO, KTO, ORPO)
    "loss_type", "label_smoothing", "use_weighting", "ld_alpha", "discopop_tau", "f_divergence_type",
    "f_alpha_divergence_coef", "ref_model_mixup_alpha", "ref_model_sync_steps", "sync_ref_model", "disable_dropout",
    "desirable_weight", "undesirable_weight",
    # GRPO's sampling and clipping
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "epsilon", "epsilon_high", "delta",
    "scale_rewards", "num_iterations", "steps_per_generation", "mask_truncated_completions",
    "importance_sampling_level", "top_entropy_quantile",
)  # fmt: skip


"""The training.extra_args a run's form (`submit --set`, the Argo UI's overrides) may add, change or remove:
hyperparameters of the optimizer and the losses. Every other key is the pipeline file's (spec/form.py)."""


def refused_trainer_arg(key: str) -> str | None:
    """Why training.extra_args may not set `key` anywhere (TRAINER_ARGS_REFUSED); None when it may."""
    for name, why in TRAINER_ARGS_REFUSED.items():
        if key.startswith(name) if name.endswith("_") else key == name or key.endswith(f"_{name}"):
            return why
    return None


class TrainingSpec(StrictModel):
    """Hyperparameters of a training stage."""

    learning_rate: float = Field(2e-5, gt=0, lt=1, description="Peak learning rate.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: Int64 | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    per_device_batch_size: Int64 = Field(1, gt=0, description="Micro-batch size per GPU (rows of max_seq_length).")
    gradient_accumulation_steps: Int64 = Field(1, gt=0, description="Micro-batches per optimizer step.")
    max_seq_length: Int64 = Field(4096, ge=16, description="Tokens per packed row / truncation length.")
    packing: bool = Field(True, description="Pack documents into full rows, with attention kept inside documents.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps spent warming up.")
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(True, description="Recompute activations to save memory (GPU only).")
    recompute_layers: Int64 | None = Field(
        None,
        ge=0,
        description="With gradient_checkpointing (or FSDP's activation_checkpointing): how many decoder layers "
        "recompute their activations in the backward pass, the first ones of the model (under pipeline_parallel, "
        "of each process's stage); the rest keep theirs, which spares their recomputation for about one layer's "
        "activations of GPU memory each. Megatron-LM's recompute_num_layers with the block method. Measured on one "
        "H100 (Qwen3-30B-A3B, LoRA on attention, 4 rows of 4096): about 1 GiB and 0.7% faster per layer kept; 5 rows "
        "with recompute_layers 40 reached 13,173 tok/s at 76.4 GiB against 12,200 at 63.7 GiB with all 48 "
        "recomputing (docs/performance.md B5). None: every layer recomputes.",
    )
    pure_bf16: bool = Field(
        False,
        description="Full fine-tuning on GPU with DDP or one process: keep the weights and optimizer state in "
        "model.dtype instead of float32 master weights with bf16 compute. Faster and about half the memory, but an "
        "update smaller than half a bf16 step of its weight (about 0.4% of it) is lost, which at fine-tuning "
        "learning rates is most of them. FSDP and DeepSpeed always keep float32 master weights.",
    )
    fp8: bool = Field(
        False,
        description="Full fine-tuning: the linear layers' matmuls in float8 (torchao's float8 training: inputs and "
        "weights scaled per tensor to e4m3, gradients to e5m2, the result in bf16; the weights, optimizer state and "
        "saved model stay as they are). Left in model.dtype: the output layer (lm_head), the embeddings, the norms, "
        "a mixture's router and experts, and any layer whose sizes are not multiples of 16. Needs GPUs of compute "
        "capability 8.9 or newer (H100, H200, L40S); on CPU the same float8 matmuls run, slowly (--local). On a GPU "
        "the layers are compiled (torch.compile), so the first steps are slower: in cpt and sft with strategy ddp "
        "or fsdp each whole decoder layer, its gradient checkpointing inside the compiled region (1.35-1.46x the "
        "bf16 step on one H100 under ddp, 12 layers of an 8B model at 2 and 4 rows of 4096; 1.17x under fsdp, 8 "
        "layers); elsewhere each converted layer alone (1.14-1.24x on one H200). The loss stayed within 0.03% of "
        "bf16's over 50 steps on random tokens; from random weights on Korean text it learned more slowly at first "
        "(15% higher loss at step 50, within 1% by step 300): compare a short run with and without fp8 on your own "
        "data first (docs/performance.md B8). With strategy ddp or fsdp (tensor_parallel and pipeline_parallel "
        "too); not DeepSpeed, expert_parallel, LoRA, QLoRA or grpo.",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Mixture-of-experts models: weight of the router's load-balancing loss added to the training "
        "loss (the model returns its router logits for it). None: the model config's own coefficient (Qwen3-MoE: "
        "0.001); 0: no auxiliary loss. Ignored, with a log line, on dense models.",
    )
    seed: Seed = Field(42, description="Seed for data order and initialisation.")
    logging_steps: Int64 = Field(10, gt=0, description="Log metrics every this many steps.")
    save_steps: Int64 = Field(200, gt=0, description="Write a checkpoint every this many steps.")
    save_total_limit: Int64 = Field(3, ge=2, description="Checkpoints kept; at least 2 so a torn one has a fallback.")
    eval_steps: Int64 | None = Field(None, gt=0, description="Evaluate held-out loss every this many steps.")
    extra_args: dict[str, str | Int64 | float | bool | None] = Field(
        default_factory=dict,
        description="More settings for the trainer's config, passed through as they are: fields of transformers' "
        "TrainingArguments, or of TRL's SFTConfig / DPOConfig / GRPOConfig... for the stage's trainer, e.g. "
        "{optim: adamw_torch_fused, adam_beta2: 0.95, neftune_noise_alpha: 5}. Scalars only; the stage refuses a "
        "name its config class does not have. Settings the spec owns (learning_rate, bf16, deepspeed...) are "
        "refused here: set their spec field. So are settings that send data out of the cluster or run code: the "
        "Hugging Face Hub upload (push_to_hub, hub_*: the deploy stage publishes, after the gate), trackio_*, "
        "log_completions_hub_repo, vllm_server_base_url, vllm_server_host and *model_init_kwargs. With DeepSpeed "
        "offloading the optimizer (and no 'optimizer' section in its config), optimizer settings here (optim, "
        "optim_args, adam_beta1, adam_beta2, adam_epsilon) make the trainer's own optimizer run on the CPU; without "
        "them DeepSpeed's faster CPU Adam runs, with the learning rate and weight decay only. A run's form (submit "
        "--set, the Argo UI) may add, change or remove only these keys, every other one is the pipeline file's: "
        f"{', '.join(FORM_EXTRA_ARGS)}.",
    )

    @field_validator("extra_args")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        # FieldError names the key, so the error points at its own line (a file's, or the form's override).
        for key in value:
            if key in TRAINER_ARGS_OWNED:
                raise FieldError((key,), f"extra_args.{key} is set by the spec: use {TRAINER_ARGS_OWNED[key]} instead")
            if (why := refused_trainer_arg(key)) is not None:
                raise FieldError((key,), f"extra_args.{key} is refused: {why}")
        return value


class DistributedSpec(StrictModel):
    """How the stage spreads over GPUs under torchrun."""

    strategy: Literal["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"] = Field(
        "ddp", description="Data-parallel engine: DDP, FSDP2, or DeepSpeed ZeRO stage 2/3."
    )
    cpu_offload: bool = Field(False, description="Offload optimizer state (and parameters for ZeRO-3/FSDP) to CPU.")
    activation_checkpointing: bool = Field(
        False, description="FSDP activation checkpointing (in addition to gradient_checkpointing)."
    )
    expert_parallel: Int64 = Field(
        1,
        ge=1,
        le=16,
        description="Expert parallelism for a mixture-of-experts model: each layer's experts are split over this "
        "many ranks of a node, which exchange the routed tokens (all-to-all), while FSDP2 shards everything else "
        "over all ranks; transformers' own expert-parallel plan, applied as the model loads. 1: every rank holds "
        "every expert. For cpt and sft, full or LoRA (the experts' adapters are whole on every rank, each rank "
        "training its experts' rows), and rlhf's orpo, dpo and kto (dpo and kto with precompute_ref_log_probs "
        "false: full training's reference a second model spread the same way) and grpo (the same reference); "
        "needs "
        "strategy 'fsdp'; must divide resources.gpus_per_node and the model's expert count. With "
        "pipeline_parallel each stage spreads its own layers' experts over its GPUs (must divide them; full "
        "fine-tuning, or LoRA). A run of one process trains unsharded.",
    )
    tensor_parallel: Int64 = Field(
        1,
        ge=1,
        le=16,
        description="Tensor parallelism: each layer's attention and MLP weights split over this many ranks of a node "
        "(attention by heads, the MLP by its inner width), which compute each layer together, on the same "
        "rows; FSDP2 shards the result over the groups (tensor_parallel x FSDP, the world size divided by "
        "this). For a model whose layers are too big for FSDP alone, or too slow to gather, at long "
        "sequences. transformers' own tensor-parallel plan for the model family, applied as the model loads. "
        "1: none. For cpt and sft (and rlhf's orpo, and dpo and kto with precompute_ref_log_probs false: the "
        "reference is the split policy without its adapter, or in full training a second split model, and grpo: a "
        "group's ranks sample the same completions), full "
        "fine-tuning or LoRA (each adapter split with its layer; not lora.modules_to_save); needs strategy 'fsdp'; "
        "must divide resources.gpus_per_node (the group stays on one node's NVLink), the model's attention and "
        "key/value heads, and expert_parallel where that is set; a mixture of experts needs expert_parallel (this or a "
        "multiple: its experts spread whole, as split ones do not checkpoint). With pipeline_parallel each "
        "stage splits its own layers (a dense model: full fine-tuning, fp8 too, or LoRA). A run of one "
        "process trains unsplit.",
    )
    pipeline_parallel: Int64 = Field(
        1,
        ge=1,
        le=64,
        description="Pipeline parallelism: the model's layers cut into this many consecutive stages, one per rank "
        "(the embedding with the first, the final norm and the head with the last), which pass each micro-batch's "
        "hidden states on; torch's own 1F1B schedule (torch.distributed.pipelining) runs "
        "training.gradient_accumulation_steps micro-batches per optimizer step (at least this many: the bubble is "
        "(stages - 1) / (micro-batches + stages - 1) of the time). FSDP2 shards each stage over the pipelines (the "
        "world size divided by this). For a dense model whose layers do not fit one GPU's memory "
        "together with its optimizer, across nodes where the network is slower than NVLink. 1: none. For cpt, "
        "sft and rlhf's orpo, dpo and kto (their losses taken on the last stage; dpo's and kto's reference "
        "log-probabilities computed through the stages, before training or, precompute_ref_log_probs false, at each "
        "step, full training's reference then a frozen copy of each stage) and grpo (its completions sampled "
        "through the stages, full "
        "training's reference a frozen copy of each stage; not with expert_parallel), full "
        "fine-tuning or "
        "LoRA (each stage trains its layers' adapters; the adapter is saved as one) of a "
        "dense model, or of a mixture of experts with training.router_aux_loss_coef 0 (the balance loss is taken "
        "over every layer's routers at once: refused on, by the spec where it knows the model); needs strategy "
        "'fsdp'; must divide resources.nodes x gpus_per_node and leave each stage a layer. With tensor_parallel, "
        "each stage's layers are split too (a mesh of stages x pipelines x tensor_parallel; a dense model: full "
        "fine-tuning, fp8 too, or LoRA; a mixture of experts with expert_parallel), and this times tensor_parallel "
        "must divide the GPUs. With expert_parallel, each stage's experts spread over its GPUs. A run of one "
        "process trains uncut.",
    )
    deepspeed_config: dict[str, Any] | str | None = Field(
        None,
        description="Your own DeepSpeed config instead of the generated one (strategy deepspeed_zero2/3, the same "
        "ZeRO stage): a path to its JSON file, relative to the pipeline file (to the current directory in --set), "
        "read when the pipeline is loaded and embedded into the spec, so the pods get it with the spec. 'auto' "
        "values are filled in from the trainer's arguments as usual. The stage saves its model whole: ZeRO-3 always "
        "gathers the 16-bit weights on save (stage3_gather_16bit_weights_on_model_save).",
    )

    accelerate_config: dict[str, Any] | str | None = Field(
        None,
        description="Your own accelerate config (the YAML `accelerate config` writes): a path, read and embedded "
        "as deepspeed_config is. Its distributed_type must agree with strategy (DEEPSPEED: deepspeed_zero<zero_stage>, "
        "FSDP: fsdp, MULTI_GPU or NO: ddp); its deepspeed_config (zero_stage, offload_*_device, gradient_clipping, "
        "which also sets the trainer's max_grad_norm) or fsdp_config (fsdp_* keys) settings are passed to the "
        "trainer, except what would leave the stage's model folder without weights: fsdp_state_dict_type (the stage "
        "saves full state dicts) and zero3_save_16bit_model (ZeRO-3 always gathers the weights on save). The process "
        "counts (num_processes, num_machines, ...) come from the stage's resources and are ignored.",
    )

    @property
    def sharded_at_load(self) -> bool:
        """Whether transformers shards the model as it loads (tensor or expert parallelism) instead of accelerate."""
        return self.tensor_parallel > 1 or self.expert_parallel > 1

    @field_validator("deepspeed_config", "accelerate_config")
    @classmethod
    def _embedded(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if isinstance(value, str):
            raise ValueError(
                "a config file is read when the pipeline file is loaded (python -m workflows.submit); "
                "here it must be the config itself, a mapping"
            )
        return value

    @model_validator(mode="after")
    def _accelerate_matches(self) -> DistributedSpec:
        if self.accelerate_config is None:
            return self
        if self.deepspeed_config is not None:
            raise FieldError(("accelerate_config",), "give deepspeed_config or accelerate_config, not both")
        kind = str(self.accelerate_config.get("distributed_type", "NO"))
        deepspeed = self.accelerate_config.get("deepspeed_config") or {}
        expected = {
            "DEEPSPEED": f"deepspeed_zero{deepspeed.get('zero_stage', 2) if isinstance(deepspeed, dict) else 2}",
            "FSDP": "fsdp",
            "MULTI_GPU": "ddp",
            "NO": "ddp",
        }.get(kind)
        if expected is None:
            raise FieldError(
                ("accelerate_config",),
                f"distributed_type {kind!r} is not supported here (DEEPSPEED, FSDP, MULTI_GPU or NO)",
            )
        if isinstance(deepspeed, dict) and deepspeed.get("deepspeed_config_file"):
            raise FieldError(
                ("accelerate_config",),
                "its deepspeed_config.deepspeed_config_file is not read from here: give that file as "
                "distributed.deepspeed_config instead",
            )
        if self.strategy != expected:
            raise FieldError(
                ("strategy",),
                f"the accelerate config's distributed_type {kind} needs strategy {expected!r}, not {self.strategy!r}",
            )
        return self

    @model_validator(mode="after")
    def _deepspeed_matches(self) -> DistributedSpec:
        if self.deepspeed_config is None:
            return self
        if not self.strategy.startswith("deepspeed"):
            raise FieldError(
                ("deepspeed_config",),
                f"a DeepSpeed config goes with strategy deepspeed_zero2 or deepspeed_zero3, not {self.strategy!r}",
            )
        zero = self.deepspeed_config.get("zero_optimization") or {}
        stage = zero.get("stage") if isinstance(zero, dict) else None
        expected = 3 if self.strategy == "deepspeed_zero3" else 2
        if stage is not None and stage != expected:
            raise FieldError(
                ("deepspeed_config",),
                f"the DeepSpeed config's zero_optimization.stage is {stage!r} but strategy is {self.strategy!r}: "
                f"make them agree (strategy deepspeed_zero{stage} or stage {expected})",
            )
        return self


class TrainingStage(StageBase):
    """A stage that trains (cpt, sft, rlhf): a PyTorchJob."""

    method: Literal["full", "lora", "qlora"] = Field("full", description="Full fine-tuning, LoRA, or QLoRA (4-bit).")
    data: StageData | None = Field(
        None, description="Training data: one dataset, or a list of datasets (a mixture, each with its weight)."
    )
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Hyperparameters.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="Adapter settings for lora/qlora.")
    distributed: DistributedSpec = Field(default_factory=DistributedSpec, description="Distributed strategy.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Job deadlines, cleanup and retries.")
    hpo: HpoSpec | None = Field(
        None,
        description="Search hyperparameters with short trials of this stage first (a Katib Experiment in the "
        "cluster, Optuna under --local); the stage then trains with the best trial's values.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> TrainingStage:
        if self.enabled and self.data is None:
            raise ValueError("an enabled training stage needs 'data'")
        if self.method == "qlora" and self.distributed.strategy == "deepspeed_zero3":
            raise ValueError("qlora cannot be sharded with deepspeed_zero3; use ddp or fsdp")
        self._expert_parallel_fits()
        self._tensor_parallel_fits()
        self._pipeline_parallel_fits()
        self._float8_fits()
        if self.training.recompute_layers is not None and not self.recomputes_activations:
            raise FieldError(
                ("training", "recompute_layers"),
                "training.recompute_layers chooses which layers recompute their activations, and none do: set "
                "training.gradient_checkpointing: true, or remove recompute_layers",
            )
        check_mixture(self.data)
        held_out = any(d.eval_fraction > 0 for d in datasets(self.data))
        if self.training.eval_steps is not None and self.data is not None and not held_out:
            raise FieldError(
                ("training", "eval_steps"),
                "training.eval_steps evaluates held-out rows, and data.eval_fraction is 0: hold rows out "
                "(data.eval_fraction: 0.02) or drop eval_steps",
            )
        return self

    @property
    def recomputes_activations(self) -> bool:
        """Whether the decoder layers recompute their activations in the backward pass (on a GPU): the trainer's
        gradient checkpointing, or FSDP's (`distributed.activation_checkpointing`)."""
        fsdp_recomputes = self.distributed.strategy == "fsdp" and self.distributed.activation_checkpointing
        return self.training.gradient_checkpointing or fsdp_recomputes

    def _sharded_by_transformers(self, field: str) -> None:
        """What tensor and expert parallelism (`field`) need: FSDP2 for the rest of the model, no accelerate setting
        (transformers shards the model as it loads), and groups of ranks inside one node (their all-to-all and
        all-reduces stay on NVLink)."""
        size = getattr(self.distributed, field)
        if self.distributed.strategy != "fsdp":
            raise FieldError(
                ("distributed", field),
                f"{field} {size} shards the rest of the model with FSDP2: set distributed.strategy to 'fsdp' "
                f"(it is {self.distributed.strategy!r}), or {field} to 1",
            )
        if self.distributed.cpu_offload or self.distributed.accelerate_config is not None:
            what = "cpu_offload" if self.distributed.cpu_offload else "accelerate_config"
            raise FieldError(
                ("distributed", what),
                f"with {field} the model is sharded by transformers as it loads, not by accelerate: "
                f"distributed.{what} does not apply; remove it or set {field} to 1",
            )
        gpus = self.resources.gpus_per_node
        if gpus and gpus % size:
            raise FieldError(
                ("distributed", field),
                f"{field} {size} must divide resources.gpus_per_node ({gpus}): its groups of ranks stay inside "
                "one node",
            )

    def _expert_parallel_fits(self) -> None:
        """Expert parallelism goes with FSDP2 (transformers shards the dense part itself), bf16 experts, and
        groups of ranks inside one node (the all-to-all stays on NVLink)."""
        ep = self.distributed.expert_parallel
        if ep == 1:
            return
        at = ("distributed", "expert_parallel")
        self._sharded_by_transformers("expert_parallel")
        if self.method == "qlora":
            raise FieldError(at, "expert_parallel shards bf16 experts; qlora's are 4-bit: use method 'lora' or 1")
        if self.method == "lora" and self.lora.target_experts and self.lora.r % 8:
            # the split experts' adapters run only as grouped low-rank products, whose rows CUDA aligns to 16 bytes
            raise FieldError(
                ("lora", "r"),
                f"is {self.lora.r}; with expert_parallel {ep} the experts' adapters need a multiple of 8 (their "
                "rank rows are grouped GEMM operands). Choose such an r, or lora.target_experts: false",
            )

    def _tensor_parallel_fits(self) -> None:
        """Tensor parallelism goes with FSDP2 over its groups (transformers shards the model itself), full
        fine-tuning or LoRA (adapters split with their layers), and groups of ranks inside one node (each layer's
        all-reduces stay on NVLink)."""
        tp = self.distributed.tensor_parallel
        if tp == 1:
            return
        at = ("distributed", "tensor_parallel")
        self._sharded_by_transformers("tensor_parallel")
        if self.method == "qlora":
            raise FieldError(
                at,
                "tensor_parallel splits each layer's weights, which 4-bit weights are not split by: use method "
                "'lora' or 'full', or tensor_parallel 1",
            )
        if self.method == "lora" and self.lora.modules_to_save:
            # PEFT copies each such module whole, and the copy of a split one fails (measured, PEFT 0.21)
            raise FieldError(
                ("lora", "modules_to_save"),
                f"{self.lora.modules_to_save} train whole beside the adapter, which tensor_parallel does not split: "
                "remove them, or set distributed.tensor_parallel to 1",
            )
        ep = self.distributed.expert_parallel
        if ep > 1 and ep % tp:
            raise FieldError(
                at,
                f"with expert_parallel {ep}, tensor_parallel {tp} must divide it: each group of experts spans whole "
                "tensor-parallel groups (transformers' plan)",
            )

    def _pipeline_parallel_fits(self) -> None:
        """Pipeline parallelism cuts a dense model's layers (with their LoRA adapters) over ranks, FSDP2 over the
        pipelines, with a micro-batch for each stage in every step."""
        pp = self.distributed.pipeline_parallel
        if pp == 1:
            return
        at = ("distributed", "pipeline_parallel")
        if self.distributed.strategy != "fsdp":
            raise FieldError(
                at,
                f"pipeline_parallel {pp} shards each stage over the pipelines with FSDP2: set distributed.strategy "
                f"to 'fsdp' (it is {self.distributed.strategy!r}), or pipeline_parallel 1",
            )
        tp, ep = self.distributed.tensor_parallel, self.distributed.expert_parallel
        if self.distributed.cpu_offload or self.distributed.accelerate_config is not None:
            what = "cpu_offload" if self.distributed.cpu_offload else "accelerate_config"
            raise FieldError(
                ("distributed", what),
                f"with pipeline_parallel each rank trains its own stage of the model: distributed.{what} does not "
                "apply; remove it or set pipeline_parallel to 1",
            )
        if self.method == "qlora":
            raise FieldError(
                at,
                "pipeline_parallel shards each stage's weights over the pipelines with FSDP2, which does not shard "
                "4-bit weights: use method 'lora' or 'full', or pipeline_parallel 1",
            )
        if self.training.gradient_accumulation_steps < pp:
            raise FieldError(
                ("training", "gradient_accumulation_steps"),
                f"{self.training.gradient_accumulation_steps} micro-batches a step for pipeline_parallel {pp}: the "
                f"schedule needs one per stage at least (set it to {pp} or more; more shrink the bubble)",
            )
        gpus = self.resources.nodes * (self.resources.gpus_per_node or 0)
        if gpus and gpus % (pp * tp):
            split = f" times tensor_parallel {tp}" if tp > 1 else ""
            raise FieldError(
                at,
                f"{pp}{split} must divide the stage's {gpus} GPUs (resources.nodes x gpus_per_node): each pipeline "
                f"takes {pp * tp} of them",
            )
        if gpus and (gpus // pp) % ep:
            raise FieldError(
                ("distributed", "expert_parallel"),
                f"{ep} must divide the {gpus // pp} GPUs of each of the {pp} pipeline stages (resources.nodes x "
                "gpus_per_node / pipeline_parallel): a stage's experts spread over its own GPUs",
            )

    def _float8_fits(self) -> None:
        """Float8 training converts the full model's linear layers (torchao), which DDP and FSDP2 train as they
        are; DeepSpeed partitions the weights into its own flat buffers, and adapters freeze the layers it
        converts."""
        if not self.training.fp8:
            return
        at = ("training", "fp8")
        if self.method != "full":
            raise FieldError(
                at,
                f"fp8 trains the full model's linear layers in float8; method {self.method!r} trains adapters on "
                "frozen ones: use method 'full', or fp8: false",
            )
        if self.distributed.strategy.startswith("deepspeed"):
            raise FieldError(
                at,
                f"fp8 runs with strategy 'ddp' or 'fsdp' (FSDP2 shards float8 layers as they are); DeepSpeed "
                f"({self.distributed.strategy}) flattens the weights it partitions: use 'fsdp', or fp8: false",
            )
        if self.distributed.expert_parallel > 1:
            raise FieldError(
                at,
                "fp8 with expert_parallel is not supported: the experts are grouped matmuls, not linear layers, "
                "and only attention would run in float8; set one of them back",
            )


class CptStage(TrainingStage):
    """Continued pre-training on raw text."""

    @model_validator(mode="after")
    def _text_data(self) -> CptStage:
        for i, data in enumerate(datasets(self.data)):
            if data.format != "text":
                raise FieldError(
                    (*dataset_loc(self.data, i), "format"),
                    f"cpt trains on raw text: the format must be 'text', got {data.format!r}",
                )
        return self


class SftStage(TrainingStage):
    """Supervised fine-tuning on conversations or instructions."""

    assistant_only_loss: bool = Field(True, description="Only assistant tokens carry loss.")
    enable_thinking: bool = Field(
        False, description="Render Qwen3 thinking tags in the chat template (empty when the data has none)."
    )

    @model_validator(mode="after")
    def _chat_data(self) -> SftStage:
        for i, data in enumerate(datasets(self.data)):
            if data.format not in ("messages", "alpaca", "sharegpt"):
                raise FieldError(
                    (*dataset_loc(self.data, i), "format"),
                    f"sft reads messages, alpaca or sharegpt: {data.format!r} is not one of them",
                )
        return self


BUILTIN_REWARDS: dict[str, tuple[str, ...]] = {
    "hangul_ratio": (),
    "length": ("min", "max"),
    "format": ("require_end", "closed_think", "end_token_ids", "end_texts"),
}


"""The built-in GRPO rewards (stages/rewards.py) and the arguments each takes."""


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RewardFunction(StrictModel):
    """A GRPO reward: a built-in, or a function of a module the pipeline file allows (`module:function`)."""

    name: str = Field(
        description=f"Built-in reward ({', '.join(repr(n) for n in BUILTIN_REWARDS)}) or 'module:function', a "
        "function defined in a module listed in stages.rlhf.reward_modules."
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the reward (for a built-in: the ones it takes)."
    )

    @model_validator(mode="after")
    def _known_args(self) -> RewardFunction:
        if self.name in BUILTIN_REWARDS:
            unknown = sorted(set(self.args) - set(BUILTIN_REWARDS[self.name]))
            if unknown:
                takes = ", ".join(BUILTIN_REWARDS[self.name]) or "none"
                raise FieldError(("args",), f"{unknown} are not arguments of the {self.name} reward (it takes {takes})")
        return self


class RlhfStage(TrainingStage):
    """Preference optimisation after SFT."""

    algorithm: Literal["dpo", "orpo", "kto", "grpo"] = Field("dpo", description="Preference algorithm.")
    beta: float = Field(
        0.1,
        ge=0,
        description="Strength of the KL/preference term; greater than 0, except for grpo, where 0 (TRL's default) "
        "drops the KL term and the reference model.",
    )
    precompute_ref_log_probs: bool = Field(
        True, description="Compute the reference model's log-probabilities once, before training."
    )
    reward_functions: list[RewardFunction] = Field(
        default_factory=list, description="GRPO rewards (ignored by the other algorithms)."
    )
    reward_modules: list[str] = Field(
        default_factory=list,
        description="Python modules (installed in the trainer image) whose functions reward_functions may name as "
        "'module:function', e.g. ['acme_rewards.korean']. Only these modules are ever imported for a reward. "
        "Pipeline file only: the form may choose among the built-ins and these modules' functions, nothing else.",
    )
    num_generations: Int64 = Field(4, ge=2, description="GRPO completions per prompt.")

    @model_validator(mode="after")
    def _preference_data(self) -> RlhfStage:
        # DPO and KTO scale the preference margin by beta (no gradient at 0), ORPO weighs its odds-ratio term by it.
        if self.algorithm != "grpo" and self.beta == 0:
            raise ValueError(f"beta must be greater than 0 for {self.algorithm} (only grpo accepts 0)")
        for module in self.reward_modules:
            if not _MODULE_NAME.match(module):
                raise FieldError(("reward_modules",), f"{module!r} is not a Python module name (package.module)")
        for i, reward in enumerate(self.reward_functions):
            if reward.name in BUILTIN_REWARDS:
                continue
            module, colon, function = reward.name.partition(":")
            if not colon or not _MODULE_NAME.match(module) or not _IDENTIFIER.match(function):
                raise FieldError(
                    ("reward_functions", i, "name"),
                    f"{reward.name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor "
                    "'module:function' (a function name, no dots)",
                )
            if module not in self.reward_modules:
                raise FieldError(
                    ("reward_functions", i, "name"),
                    f"{reward.name!r}: module {module!r} is not in stages.rlhf.reward_modules; a reward runs code, "
                    "so its module must be listed there, in the pipeline file",
                )
        self._expert_parallel_reference()
        if self.training.fp8 and self.algorithm == "grpo":
            raise FieldError(
                ("training", "fp8"),
                "fp8 is for cpt, sft and rlhf's dpo, orpo and kto; grpo generates with the policy it trains, which "
                "float8 training has not been measured on: set fp8: false",
            )
        if self.algorithm == "grpo":
            if self.enabled and not self.reward_functions:
                raise ValueError("grpo needs at least one entry in reward_functions")
        else:
            for i, data in enumerate(datasets(self.data)):
                if data.format != "preference":
                    raise FieldError(
                        (*dataset_loc(self.data, i), "format"),
                        f"{self.algorithm} reads preference data: the format must be 'preference'",
                    )
        return self

    def _expert_parallel_reference(self) -> None:
        """rlhf under tensor or expert parallelism (a model sharded as it loads), and ORPO, DPO and KTO under
        pipeline stages (their losses taken on the last stage, micro-batch by micro-batch, DPO's and KTO's reference
        log-probabilities computed through the stages, before training or at each step, full training's reference
        then each stage's frozen copy of its starting weights: `stages.pipeline_preference`), and GRPO there (its
        completions sampled through the stages, its loss on the last, full training's reference a frozen copy of each
        stage: `stages.pipeline_grpo`). Sharded, nothing may copy or hash the whole policy
        (seen with TRL 1.16: DPOTrainer's hash_module, precomputing the reference's log-probabilities, reads every
        weight with .numpy(), which a DTensor refuses): ORPO has no reference; DPO and KTO run with the
        log-probabilities not precomputed, GRPO as it is. With LoRA the reference is the sharded policy with its
        adapter off; in full training a second model loaded and sharded as the policy was
        (`stages.rlhf.sharded_reference`). GRPO's data-parallel ranks sample their own completions as under DDP (a
        tensor-parallel group's ranks the same ones, seeded alike: `stages.rlhf.seed_groups_alike`), the experts'
        exchange joined at every forward of the generation (transformers generates with synced_gpus under FSDP2).
        Two gloo processes (and two groups of two) train each as one process, or DDP, does."""
        for field in ("expert_parallel", "tensor_parallel", "pipeline_parallel"):
            if getattr(self.distributed, field) == 1:
                continue
            sharded = field in ("tensor_parallel", "expert_parallel")  # by transformers, as the model loads
            if self.algorithm == "orpo":
                continue  # no reference: its loss is the policy's alone, over a sharded model or pipeline stages
            if not sharded and self.algorithm in ("dpo", "kto"):
                # the reference's log-probabilities through the stages: once before training, or at each step (LoRA:
                # the adapter switched; full training: each stage's frozen copy of its starting weights)
                continue
            if sharded and self.algorithm == "grpo":
                continue  # its reference is the policy without its adapter, or loaded sharded
            if self.algorithm == "grpo":  # sampled through the stages, its loss on the last one
                if self.distributed.expert_parallel != 1:
                    raise FieldError(
                        ("distributed", "expert_parallel"),
                        f"is {self.distributed.expert_parallel}; rlhf's grpo samples through pipeline stages whose "
                        "experts are whole on each rank: set expert_parallel to 1, or pipeline_parallel to 1",
                    )
                continue
            if sharded and self.algorithm in ("dpo", "kto"):
                if not self.precompute_ref_log_probs:
                    continue
                raise FieldError(
                    ("precompute_ref_log_probs",),
                    f"is true; with distributed.{field} {self.algorithm} computes the reference's "
                    "log-probabilities as it trains (TRL hashes the whole policy to precompute them, which a sharded "
                    f"one refuses): set it to false, or {field} to 1",
                )
