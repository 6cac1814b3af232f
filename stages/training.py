"""What the training stages (cpt, sft, rlhf) share: the Trainer arguments from the spec, resuming (never past the
plan), saving the model, and the summary.

Each stage module reads as the recipe; the pieces here keep it short:

    start = load_starting_model(..., ModelInputs(ctx))  stages/modeling.py (upstream models checked by content)
    cache = load_token_cache(...)                    stages/packing.py
    record_inputs(ctx, cache)                         lineage in stage.json
    args = build_config(ctx, SFTConfig, {**trainer_arguments(ctx, start.model), ...})
                                                      hyperparameters + distributed strategy + precision,
                                                      and the spec's training.extra_args
    write_distributed_config(ctx, args)               what the Trainer (and accelerate) got, in logs/
    resume = resume_checkpoint(ctx)                   newest valid checkpoint (torn ones set aside)
    trained = train_to_plan(trainer, resume, stage)   never a step past the plan (0 when resume ends it), and
                                                      never on after a NaN or infinite loss or gradient norm
    model_info = save_stage_model(trainer, ...)       the model folder (rank 0 writes; FSDP/ZeRO-3 gather)
    metrics = summary_metrics(trainer)
    extra = {**resume_details(resume, trained), **output_fingerprint(ctx)}
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from run.config_hash import canonical_hash
from run.run_dir import RunDir, StageRefused, check_still_ours, write_json_atomic
from spec.pipeline import PipelineSpec
from spec.training import TrainingStage
from stages.checkpoints import checkpoint_step, newest_valid_checkpoint, set_aside_torn
from stages.contract import ExplainedFailure, StageContext, is_main_process
from stages.distributed import fsdp_mixed_precision, precision_arguments, strategy_arguments
from stages.float8 import compiles_decoder_layers
from stages.model_parallel import (
    checkpoint_sharded,
    expert_parallel_size,
    is_sharded_at_load,
    tensor_parallel_size,
)
from stages.modeling import (
    FINGERPRINT,
    ModelKind,
    StartingModel,
    expert_parameters,
    load_adapter,
    load_base,
    model_fingerprint,
    on_gpu,
    weights_dtype,
)
from stages.pipeline_parallel import pipeline_parallel_size


def trainer_arguments(ctx: StageContext, model: Any) -> dict[str, Any]:
    """Keyword arguments for TrainingArguments / SFTConfig from the stage's spec."""
    section: TrainingStage = ctx.section
    t = section.training
    # Recomputation only pays off on a GPU; decoder layers compiled whole checkpoint themselves, inside the compiled
    # region (transformers' checkpointing would call their uncompiled forward).
    whole_layers = compiles_decoder_layers(ctx.stage, section)
    checkpointing = t.gradient_checkpointing and on_gpu() and not whole_layers
    return {
        "output_dir": str(ctx.checkpoints_dir),
        "per_device_train_batch_size": t.per_device_batch_size,
        "per_device_eval_batch_size": t.per_device_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "learning_rate": t.learning_rate,
        "num_train_epochs": t.epochs,
        "max_steps": t.max_steps or -1,
        "warmup_steps": t.warmup_ratio,  # a float below 1 is a fraction of the total steps
        "lr_scheduler_type": t.lr_scheduler,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "seed": t.seed,
        "data_seed": t.seed,
        "logging_steps": t.logging_steps,
        "logging_first_step": True,
        "save_strategy": "steps",
        "save_steps": t.save_steps,
        "save_total_limit": t.save_total_limit,
        "eval_strategy": "steps" if t.eval_steps else "no",
        "eval_steps": t.eval_steps,
        "prediction_loss_only": True,  # eval needs the loss only; never gather the logits
        "activation_checkpointing": checkpointing,
        "gradient_checkpointing": checkpointing,
        "include_num_input_tokens_seen": "all",
        "remove_unused_columns": False,  # keep position_ids: they carry the packed-document boundaries
        "dataloader_num_workers": 0,
        "report_to": "none",  # the stage tracker's callback reports instead
        "disable_tqdm": True,
        **precision_arguments(weights_dtype(ctx.spec.model)),
        **kernel_arguments(model, ctx.stage, whole_layers),
        **strategy_arguments(ctx.stage, section, model),  # last: FSDP replaces the checkpointing settings
    }


def build_config(ctx: StageContext, config_class: type[TrainingArguments], arguments: dict[str, Any]) -> Any:
    """`config_class(**arguments)` with the spec's `training.extra_args` added, FSDP2's gradients reduced in float32
    (`fsdp_mixed_precision`). A name the class does not have, or one the stage already sets, is refused
    (StageRefused: one error line naming the field path, exit 2)."""
    extra = ctx.section.training.extra_args
    where = f"stages.{ctx.stage}.training.extra_args"
    known = {f.name for f in dataclasses.fields(config_class) if f.init}
    for key in extra:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise StageRefused(f"{where}.{key}: {config_class.__name__} has no field {key!r}{hint}")
        if key in arguments:
            raise StageRefused(f"{where}.{key}: the {ctx.stage} stage sets {key} itself; remove it from extra_args")
    try:
        config = config_class(**arguments, **extra)
    except (ValueError, TypeError) as exc:
        if not extra:
            raise
        raise StageRefused(f"{where}: {config_class.__name__} refused these settings: {exc}") from None
    return fsdp_mixed_precision(config)


def kernel_arguments(model: Any, stage: str = "", whole_layers: bool = False) -> dict[str, Any]:
    """Fused Triton kernels on a GPU where liger-kernel is installed: RMSNorm, SwiGLU, RoPE and the fused linear
    cross-entropy, which never materialises the logits (see docs/performance.md). Nothing on CPU.

    A mixture of experts keeps its own experts: Liger's SwiGLU replaces transformers' experts module with a loop
    over the experts (slower than the grouped_mm experts, `stages.modeling.experts_implementation`), and breaks
    on the experts' LoRA wrapper (`lora.target_experts`: "'ParamWrapper' object has no attribute 'hidden_dim'",
    measured on an H200, B5 in docs/performance.md). A model split by tensor parallelism keeps transformers' own
    layers: Liger's fused cross-entropy and SwiGLU take the whole weight matrices, which no rank holds.

    Decoder layers compiled whole (`whole_layers`, `stages.float8.compiles_decoder_layers`) keep only the fused
    cross-entropy, in cpt: inside a compiled layer Inductor fuses what Liger's layer kernels do, and sft's
    SFTTrainer has a fused LM head of its own (TRL's, which refuses Liger's)."""
    if not on_gpu() or importlib.util.find_spec("liger_kernel") is None:
        return {}
    if whole_layers:
        if stage != "cpt":
            return {}
        layer_kernels = ("rope", "rms_norm", "swiglu", "geglu")  # Liger takes those the model's patch function has
        only_the_loss = {**dict.fromkeys(layer_kernels, False), "fused_linear_cross_entropy": True}
        return {"use_liger_kernel": True, "liger_kernel_config": only_the_loss}
    if (getattr(model, "tp_size", None) or 1) > 1:
        return {}  # split layers (tensor_parallel): Liger's kernels read whole weights, the model holds shards
    if expert_parameters(model):
        return {"use_liger_kernel": True, "liger_kernel_config": {"swiglu": False}}
    return {"use_liger_kernel": True}


def record_inputs(ctx: StageContext, cache: Any) -> None:
    """Lineage in stage.json: the token cache. (The upstream models are recorded, by content, as they load:
    `stages.modeling.ModelInputs`.)"""
    ctx.add_input("token_cache", ctx.run_dir.relative(cache.path), canonical_hash(cache.meta["settings"]))


def write_distributed_config(ctx: StageContext, args: Any) -> Path:
    """Rank 0: `<stage>/logs/distributed.json`, the distributed settings generated from
    `stages.<stage>.distributed` as the Trainer received them (`fsdp`/`fsdp_config`, `deepspeed`, the DDP
    backend, precision; the tensor-parallel and expert group sizes, where transformers shards the model; whether
    the decoder layers are compiled whole, `stages.float8.compile_decoder_layers`): the configuration accelerate runs
    with, there for the user to read."""
    path = ctx.logs_dir / "distributed.json"
    if is_main_process():
        settings = {
            "strategy": ctx.section.distributed.strategy,
            "expert_parallel": expert_parallel_size(ctx.section),
            "tensor_parallel": tensor_parallel_size(ctx.section),
            "pipeline_parallel": pipeline_parallel_size(ctx.section),
            "world_size": args.world_size,
            "parallel_mode": getattr(args.parallel_mode, "value", str(args.parallel_mode)),
            "ddp_backend": args.ddp_backend,
            "ddp_find_unused_parameters": args.ddp_find_unused_parameters,
            "fsdp": args.fsdp or None,
            "fsdp_config": args.fsdp_config if args.fsdp else None,
            "deepspeed": args.deepspeed,
            "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "no",
            # FSDP2's compute, gradient-reduction and output dtypes (stages.distributed.fsdp_mixed_precision)
            "fsdp_mixed_precision": fsdp_policy_record(args),
            "gradient_checkpointing": args.gradient_checkpointing,
            # float8's whole decoder layers checkpoint themselves, with the trainer's checkpointing off
            "compiled_decoder_layers": compiles_decoder_layers(ctx.stage, ctx.section),
        }
        write_json_atomic(path, json.loads(json.dumps(settings, default=str)))  # enums and options as text
    return path


def fsdp_policy_record(args: Any) -> dict[str, str | None] | None:
    """FSDP2's mixed-precision policy as the stage gave it to accelerate, by dtype name; None without one."""
    policy = (getattr(args, "fsdp_plugin_args", None) or {}).get("mixed_precision_policy")
    if policy is None:
        return None
    names = ("param_dtype", "reduce_dtype", "output_dtype")
    return {name: None if getattr(policy, name) is None else str(getattr(policy, name)) for name in names}


def resume_checkpoint(ctx: StageContext) -> Path | None:
    """The newest valid checkpoint of an earlier attempt, or None to start fresh. Every checkpoint there was made
    with this config (`StageContext.begin` refuses or moves aside those of another). Newer torn checkpoints are
    set aside (rank 0) so the trainer does not rotate or overwrite into them. A forced stage starts over: rank 0
    moved the old checkpoints aside, and the other ranks must not pick one up before it did."""
    if ctx.force:
        return None
    checkpoint = newest_valid_checkpoint(ctx.checkpoints_dir)
    set_aside_torn(ctx.checkpoints_dir, checkpoint)
    return checkpoint


def loss_curve(log_history: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(steps, losses) of the logged training loss."""
    points = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    return [step for step, _ in points], [loss for _, loss in points]


def summary_metrics(trainer: Any, eval_metrics: dict[str, float] | None) -> dict[str, float]:
    """Final metrics for stage.json: training loss first and last, eval loss and perplexity, tokens, steps."""
    _, losses = loss_curve(trainer.state.log_history)
    metrics: dict[str, float] = {
        "steps": trainer.state.global_step,
        "tokens": trainer.state.num_input_tokens_seen,
    }
    if losses:
        metrics.update({"train_loss_first": losses[0], "train_loss_last": losses[-1]})
    if eval_metrics and "eval_loss" in eval_metrics:
        metrics["eval_loss"] = eval_metrics["eval_loss"]
        metrics["perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
    return metrics


def write_log_history(ctx: StageContext, trainer: Any) -> Path:
    """The trainer's log (loss, learning rate, eval) as `<stage>/logs/log_history.json`."""
    path = ctx.logs_dir / "log_history.json"
    if is_main_process():
        write_json_atomic(path, trainer.state.log_history)
    return path


def read_log_history(path: Path) -> list[dict[str, Any]]:
    """The log a stage wrote (tests and reports)."""
    return json.loads(path.read_text(encoding="utf-8"))


def resume_details(checkpoint: Path | None, trained_steps: int) -> dict[str, Any]:
    """What stage.json's extra says about resuming: the checkpoint, its step, and the optimizer steps this
    attempt trained after it (0 when the checkpoint already ended the plan)."""
    if checkpoint is None:
        return {"resumed_from_step": 0, "trained_steps": trained_steps}
    step = checkpoint_step(checkpoint) or 0
    return {"resumed_from": checkpoint.name, "resumed_from_step": step, "trained_steps": trained_steps}


def output_fingerprint(ctx: StageContext) -> dict[str, str]:
    """`{"model_fingerprint": ...}` of the model folder the stage wrote, for stage.json's extra: what every stage
    that loads it holds it to (`stages.modeling.ModelInputs`). Rank 0 only: it writes the record, and the other
    ranks must not read the whole model once more each."""
    return {FINGERPRINT: model_fingerprint(ctx.model_dir)} if is_main_process() else {}


# --------------------------------------------------------------------------- never past the plan


class PlanComplete(Exception):
    """The checkpoint the Trainer resumed from already ends the plan: there is no step left to train."""


class StopAtPlannedEnd(TrainerCallback):
    """Ends `Trainer.train` before its first step when the state it resumed (global_step) already reached the
    plan (max_steps, also computed from the epochs): raises PlanComplete from `on_train_begin`.

    Why it is needed: the Trainer checks the end of the plan only after a step (DefaultFlowCallback.on_step_end
    sets should_training_stop once global_step >= max_steps), and its resumed loop starts with a step whenever
    the plan ends inside an epoch (max_steps set and not a multiple of the steps per epoch, or fractional
    epochs): resumed from checkpoint-40 of 40 it trains step 41. `on_train_begin` runs after the Trainer loaded
    the checkpoint (weights, optimizer, scheduler, trainer state; the DeepSpeed engine's or FSDP's own state
    under those strategies) and before any batch, on every rank alike (they all resumed the same state)."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise PlanComplete(f"step {state.global_step} of {state.max_steps}")
        return control


class TrainingDiverged(ExplainedFailure):
    """The loss or the gradient norm the Trainer logged is NaN or infinite."""


class StopOnNonFinite(TrainerCallback):
    """Fails the stage at the first logged loss or gradient norm that is NaN or infinite, as Megatron's
    `check_for_nan_in_loss_and_grad` does: the Trainer itself trains on (and its default `logging_nan_inf_filter`
    even hides a NaN loss), so a diverged run would end "succeeded" with NaN weights that evaluate then scores.
    Every rank logs the same reduced values, so every rank stops together. Under fp16 an infinite gradient norm is
    the loss scaler's overflow, a step it skips itself, so only the loss counts there."""

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:
        keys = ("loss",) if args.fp16 else ("loss", "grad_norm")
        for key in keys:
            value = (logs or {}).get(key)
            if isinstance(value, int | float) and not math.isfinite(value):
                raise TrainingDiverged(
                    f"{key} is {value} at step {state.global_step}: training diverged (a learning rate too high for "
                    "the model, or a numerical fault in the precision or a kernel); lower training.learning_rate, "
                    "or look at the first steps' losses in the stage's log"
                )
        return control


def train_to_plan(trainer: Any, checkpoint: Path | None, stage: str) -> int:
    """`trainer.train`, resumed from `checkpoint`, never past the planned end; returns the optimizer steps this
    attempt trained. A checkpoint already at the planned end (the attempt before was stopped after its last
    checkpoint, during the final evaluation, save or merge) trains 0 steps: the Trainer loads it the way it loads
    any checkpoint it resumes, whatever the strategy (DDP, FSDP2, DeepSpeed ZeRO-2/3, full or LoRA), and stops
    before the first batch; the stage then evaluates, saves and records the checkpoint's weights as they are.
    (Loading the weights without `train()` is not enough: under FSDP2 and ZeRO-2, `evaluate()` and the save need
    the model accelerate prepared together with its optimizer, which only `train()` does.)"""
    if is_sharded_at_load(trainer.model):  # expert parallelism: checkpoints with the optimizer's shards
        checkpoint_sharded(trainer)
    guards = [StopAtPlannedEnd(), StopOnNonFinite()]
    for guard in guards:
        trainer.add_callback(guard)
    start = (checkpoint_step(checkpoint) or 0) if checkpoint is not None else 0
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    except PlanComplete as done:
        trainer.is_in_train = False  # as train() leaves it
        print(
            f"[{stage}] {checkpoint.name if checkpoint else 'the checkpoint'} is at the planned end "
            f"({done}): no step left to train; evaluating, saving and recording it",
            flush=True,
        )
        return 0
    finally:
        for guard in guards:
            trainer.remove_callback(guard)
    return trainer.state.global_step - start


ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
"""What a LoRA stage's model folder holds besides the tokenizer; replaced by the merged model with merge_after."""


def save_stage_model(
    trainer: Any, tokenizer: Any, run_dir: RunDir, spec: PipelineSpec, stage: str, start: StartingModel
) -> dict[str, str]:
    """Write the trained model into `<run>/<stage>/model/` (safetensors + tokenizer) and return what it is, for
    stage.json's extra. Every rank calls this (FSDP and ZeRO-3 gather the weights); rank 0 writes."""
    section: TrainingStage = spec.stage(stage)  # type: ignore[assignment]
    out = run_dir.stage_dir(stage) / "model"
    check_still_ours(out)  # rank 0: never into a run directory made again under the old name
    if is_main_process() and out.exists():
        shutil.rmtree(out)
    trainer.accelerator.wait_for_everyone()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    unwrapped.config.use_cache = True
    for key, value in start.loaded_config.items():  # training settings (router aux loss) are not the model's
        setattr(unwrapped.config.get_text_config(), key, value)
    if start.save_dtype is not None and hasattr(trainer, "pipeline"):
        trainer.pipeline.save_dtype = start.save_dtype  # a pipeline stage casts the weights it gathers to save
    elif start.save_dtype is not None:  # trained on float32 masters: the model is served in the dtype it came in
        unwrapped.to(start.save_dtype)
    trainer.save_model(str(out))
    kind: ModelKind = start.kind
    if is_main_process():
        (out / "training_args.bin").unlink(missing_ok=True)  # a pickle, not part of the model
        tokenizer.save_pretrained(out)
        if start.kind == "adapter":
            stable_adapter_config(out / "adapter_config.json")
        if start.kind == "adapter" and section.lora.merge_after:
            merged = _merge_adapter(run_dir, spec, start, out, tokenizer)
            for name in ADAPTER_FILES:
                (out / name).unlink(missing_ok=True)
            merged.save_pretrained(out)
            kind = "full"
    trainer.accelerator.wait_for_everyone()
    return {"model_kind": kind, "base": start.base.name, "base_kind": start.base.kind}


def stable_adapter_config(path: Path) -> None:
    """Rewrite PEFT's adapter_config.json with its sets (target_modules and the like, kept as Python sets and
    written in their iteration order, which string hashing makes differ from one process to the next) sorted, so
    that the same run writes the same bytes and its model folder the same fingerprint."""
    config = json.loads(path.read_text())
    for key in ("target_modules", "exclude_modules", "modules_to_save", "target_parameters", "layers_to_transform"):
        if isinstance(config.get(key), list) and all(isinstance(v, str | int) for v in config[key]):
            config[key] = sorted(config[key], key=str)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@contextmanager
def without_zero3_loading() -> Iterator[None]:
    """Load whole weights in one process while the Trainer's ZeRO-3 config is alive: transformers would otherwise
    create the model under `zero.Init`, a collective that the other ranks (done, waiting) never join. transformers
    keeps that config behind a module-level weak reference; it is put back afterwards."""
    from transformers.integrations import deepspeed as hf_deepspeed

    alive = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = alive


def _merge_adapter(run_dir: RunDir, spec: PipelineSpec, start: StartingModel, adapter_dir: Path, tokenizer: Any) -> Any:
    """The adapter in `adapter_dir` merged into a fresh, unquantized copy of its base. A base that is a stage's
    model folder is read again from disk, hours after training started from it: it must still be what it was."""
    if start.inputs is not None and start.base.kind == "stage":
        start.inputs.check("model", run_dir.root / start.base.name)
    with without_zero3_loading():
        model = load_base(run_dir, spec, start.base, tokenizer)
    merged = load_adapter(model, adapter_dir).merge_and_unload()
    merged.config.use_cache = True
    return merged
