"""How a training stage spreads over processes: the Trainer settings for DDP, FSDP2 or DeepSpeed ZeRO-2/3.

The same stage code runs as one process or under torchrun with N processes (the PyTorchJob sets the
rendezvous); `stages.<stage>.distributed.strategy` picks the engine:
- ddp: plain data parallel; NCCL on GPUs, gloo on CPU;
- fsdp: FSDP2, parameters, gradients and optimizer state sharded per decoder layer; with
  `distributed.tensor_parallel` each layer is split over groups of ranks too, and with `distributed.expert_parallel`
  a mixture of experts' experts, both by transformers as the model loads (`stages.model_parallel`), which then runs
  over gloo on CPU too; with `distributed.pipeline_parallel` the model's layers are cut into stages, one per rank,
  each stage sharded over the pipelines (`stages.pipeline_parallel`), on gloo too;
- deepspeed_zero2 / deepspeed_zero3: DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded) or 3 (and
  parameters), configured by a dict built here, or by the user's own (`distributed.deepspeed_config`).
FSDP (without tensor or expert parallelism) and DeepSpeed need GPUs: on CPU the stage stops with an error that names the
spec field.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import torch

from spec.training import DistributedSpec, TrainingStage
from stages.contract import NotSupportedHere
from stages.float8 import compiles_decoder_layers
from stages.model_parallel import sharded_arguments, shards_at_load
from stages.pipeline_parallel import pipeline_arguments, pipeline_parallel_size
from stages.sharded_loading import loads_once, world_size


def check_strategy(stage: str, distributed: DistributedSpec) -> None:
    """Refuse a strategy this machine cannot run, naming the spec field to change."""
    strategy = distributed.strategy
    if strategy == "ddp" or (world_size() > 1 and (distributed.sharded_at_load or distributed.pipeline_parallel > 1)):
        return  # tensor, expert or pipeline parallelism: FSDP2 on the stage's own terms, which runs over gloo too
    if not torch.cuda.is_available():
        raise NotSupportedHere(
            f"stages.{stage}.distributed.strategy is '{strategy}', which needs GPUs; this machine has none. "
            "Use 'ddp' on CPU (it trains over gloo)."
        )
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        raise NotSupportedHere(
            f"stages.{stage}.distributed.strategy is '{strategy}' but the deepspeed package is not installed "
            "in the trainer image."
        )


def fsdp_settings(
    distributed: DistributedSpec, layer_classes: list[str], recompute: bool = False, once: bool = False
) -> dict[str, Any]:
    """Trainer arguments for FSDP2: each decoder layer is a shard unit; full state dicts on save, so
    checkpoints and the final model are ordinary safetensors. Activation recomputation (`recompute`, from
    gradient_checkpointing, or distributed.activation_checkpointing) is FSDP's own, not the Trainer's, which
    would all-gather the parameters once more in the backward pass. `once`: the model was loaded on rank 0 only
    (`stages.sharded_loading`), and accelerate broadcasts its weights into the other ranks' shards."""
    return {
        "fsdp": True,
        "activation_checkpointing": False,
        "gradient_checkpointing": False,
        "fsdp_config": {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": layer_classes,
            "reshard_after_forward": True,
            "cpu_offload": distributed.cpu_offload,
            "activation_checkpointing": distributed.activation_checkpointing or recompute,
            "state_dict_type": "FULL_STATE_DICT",
            "cpu_ram_efficient_loading": once,
        },
    }


def deepspeed_config(distributed: DistributedSpec) -> dict[str, Any]:
    """A DeepSpeed config for ZeRO-2 or ZeRO-3; "auto" values are filled in from the Trainer's arguments."""
    stage = 3 if distributed.strategy == "deepspeed_zero3" else 2
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    }
    if distributed.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_gather_16bit_weights_on_model_save": True,  # the saved model is whole safetensors
            }
        )
        if distributed.cpu_offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }


def accelerate_overrides(distributed: DistributedSpec, args: dict[str, Any]) -> dict[str, Any]:
    """`args` with the user's accelerate config applied (`distributed.accelerate_config`, whose distributed_type
    the spec already matched with the strategy): its DeepSpeed plugin settings onto the DeepSpeed config (its
    gradient clipping onto the Trainer's max_grad_norm too; not zero3_save_16bit_model, see `stage_deepspeed`), its
    fsdp_* settings onto the FSDP config, except the state dict type."""
    config = distributed.accelerate_config or {}
    plugin = config.get("deepspeed_config") or {}
    if "deepspeed" in args and plugin:
        deepspeed = {**args["deepspeed"], "zero_optimization": dict(args["deepspeed"]["zero_optimization"])}
        zero = deepspeed["zero_optimization"]
        for key, target in (
            ("offload_optimizer_device", "offload_optimizer"),
            ("offload_param_device", "offload_param"),
        ):
            device = plugin.get(key)
            if device in ("cpu", "nvme"):
                zero[target] = {"device": device, "pin_memory": True}
            elif device == "none":
                zero.pop(target, None)
        if "gradient_clipping" in plugin:
            # Both: transformers refuses a DeepSpeed gradient_clipping that differs from max_grad_norm ("mismatch
            # TrainingArguments values") when the engine starts.
            deepspeed["gradient_clipping"] = plugin["gradient_clipping"]
            args = {**args, "max_grad_norm": float(plugin["gradient_clipping"])}
        args = {**args, "deepspeed": deepspeed}
    fsdp = config.get("fsdp_config") or {}
    if args.get("fsdp") and fsdp:
        # accelerate writes fsdp_-prefixed keys; the Trainer's fsdp_config takes them without the prefix, and
        # reads offloading as cpu_offload (it would ignore accelerate's offload_params).
        user = {key.removeprefix("fsdp_"): value for key, value in fsdp.items()}
        if "offload_params" in user:
            user["cpu_offload"] = user.pop("offload_params")
        # The stage's model folder is whole safetensors, which Trainer.save_model writes under FSDP only with full
        # state dicts: with SHARDED_STATE_DICT (`accelerate config`'s default for FSDP2) it writes no weights.
        user.pop("state_dict_type", None)
        args = {**args, "fsdp_config": {**args["fsdp_config"], **user}}
    return args


OPTIMIZER_EXTRA_ARGS = ("optim", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon")
"""training.extra_args that configure the Trainer's optimizer."""


def stage_deepspeed(config: dict[str, Any], own_optimizer: bool) -> dict[str, Any]:
    """The DeepSpeed config (the user's, the generated one, after the accelerate config) with what the stage needs
    from it, whatever it says:
    - ZeRO-3 gathers the 16-bit weights when the model is saved: without stage3_gather_16bit_weights_on_model_save
      (false by default in DeepSpeed, and in `accelerate config`'s zero3_save_16bit_model) Trainer.save_model
      writes a DeepSpeed checkpoint instead of safetensors, and the stage's model folder has no weights;
    - `own_optimizer` (training.extra_args configure the optimizer) with the optimizer offloaded and no DeepSpeed
      "optimizer" section: the Trainer's optimizer runs on the CPU as configured (zero_force_ds_cpu_optimizer
      false, unless set). Otherwise accelerate swaps it for DeepSpeed's CPU Adam with only its learning rate and
      weight decay, dropping the optim, betas and eps that extra_args set (seen on 2 GPUs: adam_beta2 0.95 ran
      as 0.999); without extra_args that CPU Adam stays, the faster one."""
    zero = dict(config.get("zero_optimization") or {})
    config = {**config, "zero_optimization": zero}
    if zero.get("stage") == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    offload = zero.get("offload_optimizer") or {}
    if own_optimizer and "optimizer" not in config and offload.get("device", "none") != "none":
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    return config


def strategy_arguments(stage: str, section: TrainingStage, model: Any) -> dict[str, Any]:
    """Trainer arguments for the stage's distributed strategy (also right for a single process)."""
    distributed = section.distributed
    check_strategy(stage, distributed)
    gpu = torch.cuda.is_available()
    args: dict[str, Any] = {"ddp_find_unused_parameters": False}
    if world_size() > 1:
        args["ddp_backend"] = "nccl" if gpu else "gloo"
    if shards_at_load(section):
        args.update(sharded_arguments(section))  # transformers sharded the model as it loaded
    elif pipeline_parallel_size(section) > 1:
        args.update(pipeline_arguments(section))  # each rank trains its stage of the model, DDP over pipelines
    elif distributed.strategy == "fsdp":
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        recompute = section.training.gradient_checkpointing and gpu
        layers = list(base._no_split_modules or [])
        args.update(fsdp_settings(distributed, layers, recompute, once=loads_once(section)))
        if compiles_decoder_layers(stage, section):  # the compiled layers checkpoint themselves
            args["fsdp_config"]["activation_checkpointing"] = False
    elif distributed.strategy.startswith("deepspeed"):
        # The user's own config (embedded into the spec when the pipeline was loaded), else the generated one.
        args["deepspeed"] = distributed.deepspeed_config or deepspeed_config(distributed)
    if distributed.accelerate_config:
        args = accelerate_overrides(distributed, args)
    if "deepspeed" in args:
        own_optimizer = any(key in OPTIMIZER_EXTRA_ARGS for key in section.training.extra_args)
        args["deepspeed"] = stage_deepspeed(args["deepspeed"], own_optimizer)
    return args


def zero_init_config(stage: str, section: TrainingStage, model_dtype: torch.dtype | str) -> dict[str, Any]:
    """The stage's DeepSpeed config (`strategy_arguments`: the user's or the generated one, after the accelerate
    config) as DeepSpeed's zero.Init reads it while the model loads, before the Trainer exists to fill its "auto"
    values (`zero3_loading`). zero.Init parses the whole config: the batch sizes must agree
    with the world size, and bf16/fp16 decide the dtype the partitions are made in. Those, and the gradient
    clipping, are filled as transformers' `HfTrainerDeepSpeedConfig.trainer_config_process` will fill them from
    the stage's Trainer arguments; any other "auto" (the bucket sizes the Trainer derives from the model's hidden
    size, the optimizer's and scheduler's settings) is left out: DeepSpeed's defaults, which zero.Init does not
    use. The Trainer builds its own config from the stage's later on."""
    args = strategy_arguments(stage, section, model=None)
    training = section.training
    precision = precision_arguments(model_dtype)
    micro, accumulation = training.per_device_batch_size, training.gradient_accumulation_steps
    trainer_values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": world_size() * micro * accumulation,
        "gradient_clipping": args.get("max_grad_norm", training.max_grad_norm),
        "bf16.enabled": precision["bf16"],
        "fp16.enabled": precision["fp16"],
    }
    config = copy.deepcopy(args["deepspeed"])
    for key, value in trainer_values.items():
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == "auto":
            node[leaf] = value
    return _without_auto(config)


def zero3_loading(stage: str, section: TrainingStage, model_dtype: torch.dtype | str) -> Any:
    """Make transformers load the stage's model partitioned under ZeRO-3: DeepSpeed's process group (the one the
    Trainer's accelerate then finds in place), and transformers' `HfDeepSpeedConfig` of the stage's DeepSpeed
    config with the values zero.Init reads resolved as the Trainer will (`stages.distributed.zero_init_config`).
    transformers keeps only a weak reference to it (`is_deepspeed_zero3_enabled`): the caller holds the returned
    object until the Trainer's arguments have made their own, which replaces it."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    config = zero_init_config(stage, section, model_dtype)
    deepspeed.init_distributed()  # zero.Init reads the world size from it to check the batch sizes
    return HfDeepSpeedConfig(config)


def _without_auto(config: dict[str, Any]) -> dict[str, Any]:
    """`config` without its "auto" values, at any depth."""
    return {
        key: _without_auto(value) if isinstance(value, dict) else value
        for key, value in config.items()
        if value != "auto"
    }


def precision_arguments(model_dtype: torch.dtype | str) -> dict[str, Any]:
    """Mixed precision: bf16/fp16 on GPU following the weights' dtype; plain float32 on CPU."""
    if not torch.cuda.is_available():
        return {"bf16": False, "fp16": False, "use_cpu": True}
    half = model_dtype == torch.float16
    return {"bf16": not half, "fp16": half}


def fsdp_mixed_precision(args: Any) -> Any:
    """FSDP2 through accelerate, in place on the built Trainer arguments: compute in bf16 (fp16) over the float32
    masters, reduce gradients in float32 and leave the model's outputs as computed. accelerate's own policy for
    `bf16` is bf16 for all three: each step's gradients summed over the ranks in bf16, and the loss rounded to bf16
    on its way out of the model (measured on an H100 under FSDP2: the logged losses of a bf16 and a float8 model
    equal at 16 of 18 steps, both at bf16's 0.06 spacing near 12.8; under DDP, in float32, they differ at every
    step). This is the policy of transformers' own FSDP2 plan (`stages.model_parallel`) and of the pipeline stages
    (`stages.pipeline_parallel`), and torchtitan's default. accelerate keeps a policy its plugin is given (its
    `set_mixed_precision` does not override one), and transformers hands it `fsdp_plugin_args` as they are."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if not plugin_args or not (args.bf16 or args.fp16):
        return args
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = torch.bfloat16 if args.bf16 else torch.float16
    plugin_args["mixed_precision_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    return args
