"""Supervised fine-tuning: conversations through the chat template, loss on the assistant's tokens only.

    python -m stages sft --run-dir DIR              one process
    torchrun --nproc-per-node N -m stages sft ...    N processes (DDP, FSDP2 or DeepSpeed, from the spec)

Starts from cpt's output when cpt ran (else the base model), full or with a LoRA adapter (a new one, or cpt's
adapter continued), trains with TRL's SFTTrainer on the packed token cache (labels -100 outside the assistant
turns, documents kept apart through position ids), checkpoints into `sft/checkpoints/`, resumes after a
preemption (never past the plan), and writes the adapter or the (merged) model with the tokenizer into
`sft/model/`, its content fingerprint into stage.json. cpt's model is held to the fingerprint cpt recorded.
"""

from __future__ import annotations

from trl import SFTConfig, SFTTrainer

from stages.checkpoints import CheckpointMarker, SigtermCheckpoint
from stages.contract import StageContext
from stages.entry import run_stage
from stages.metrics import StageMetrics
from stages.model_parallel import mesh_over_gloo
from stages.modeling import (
    ModelInputs,
    NotSupportedHere,
    describe,
    load_starting_model,
    load_tokenizer,
)
from stages.packing import PackedCollator, batch_width_multiple, load_token_cache
from stages.pipeline_parallel import pipeline_trainer
from stages.progress import ProgressLog
from stages.recompute import RecomputeLayers
from stages.router_loss import mask_router_loss
from stages.tracking import StageTracker
from stages.training import (
    build_config,
    loss_curve,
    output_fingerprint,
    record_inputs,
    resume_checkpoint,
    resume_details,
    save_stage_model,
    summary_metrics,
    train_to_plan,
    trainer_arguments,
    write_distributed_config,
    write_log_history,
)


def run(ctx: StageContext) -> int:
    """Train the sft stage; returns the process exit code. Refused when an upstream model changed: nothing
    trained, one error line, exit 2."""
    sigterm = SigtermCheckpoint()
    return run_stage(ctx, lambda: train(ctx, sigterm), (NotSupportedHere,), labelled=False, sigterm=sigterm)


def train(ctx: StageContext, sigterm: SigtermCheckpoint) -> int:
    run_dir, spec = ctx.run_dir, ctx.spec

    # 1. The tokenizer and the model this stage starts from (cpt's output, when cpt ran).
    tokenizer = load_tokenizer(run_dir, spec.model)
    start = load_starting_model(run_dir, spec, ctx.stage, tokenizer, ModelInputs(ctx))
    arguments = {
        **trainer_arguments(ctx, start.model),
        "max_length": ctx.section.training.max_seq_length,
        "dataset_kwargs": {"skip_prepare_dataset": True},  # the token cache is already templated, masked, packed
    }
    args = build_config(ctx, SFTConfig, arguments)

    # 2. The packed, assistant-masked token rows. Rank 0 builds them when missing, the others wait.
    with args.main_process_first(desc="token cache"):
        cache = load_token_cache(run_dir, spec, ctx.stage)
    record_inputs(ctx, cache)
    write_distributed_config(ctx, args)

    # 3. Resume from the newest valid checkpoint of an earlier attempt, if any.
    checkpoint = resume_checkpoint(ctx)

    with StageTracker(ctx) as tracker:
        tracker.log_params(
            {
                "stage": ctx.stage,
                "method": ctx.section.method,
                "strategy": ctx.section.distributed.strategy,
                "continued_adapter": start.continued_adapter,
                **ctx.section.training.model_dump(),
                **ctx.section.lora.model_dump(),
                **describe(start.model),
                "train_rows": cache.meta["train"]["rows"],
                "train_label_tokens": cache.meta["train"]["label_tokens"],
            }
        )
        progress = ProgressLog(ctx.stage, start.model)
        gauges = StageMetrics.for_stage(ctx, progress)  # served by rank 0 on POSTTRAIN_METRICS_PORT, if set
        recompute = RecomputeLayers(ctx.stage, ctx.section.training.recompute_layers)
        callbacks = [tracker.hf_callback(), progress, gauges, CheckpointMarker(), sigterm, recompute]
        with mesh_over_gloo(ctx.section):
            trainer = pipeline_trainer(SFTTrainer, ctx.stage, ctx.section)(  # SFTTrainer itself unless pipelined
                model=start.model,
                args=args,
                data_collator=PackedCollator(
                    pad_token_id=tokenizer.pad_token_id,
                    pad_to_multiple_of=batch_width_multiple(ctx.section.training),
                    mark_padding=mask_router_loss(start.model),  # the router's balance counts no padding
                ),
                train_dataset=cache.train,
                eval_dataset=cache.eval,
                processing_class=tokenizer,
                callbacks=callbacks,
            )

        # 4. Train, up to the planned end and never past it (none left when the checkpoint is at it).
        trained = train_to_plan(trainer, checkpoint, ctx.stage)
        if sigterm.stopped:
            tracker.finish("interrupted")
            step = trainer.state.global_step
            return ctx.fail(f"{sigterm.signal_name}: saved checkpoint-{step}; a rerun resumes from it", retryable=True)

        # 5. Held-out loss on the assistant tokens, the model, the record.
        eval_metrics = trainer.evaluate() if cache.eval is not None else None
        model_info = save_stage_model(trainer, tokenizer, run_dir, spec, ctx.stage, start)
        metrics = summary_metrics(trainer, eval_metrics)
        tracker.log_metrics(metrics, step=trainer.state.global_step)
        tracker.log_figure_loss_curve(*loss_curve(trainer.state.log_history))
        tracker.log_artifact(write_log_history(ctx, trainer))
        # The record first: MLflow says FINISHED only once stage.json says succeeded.
        code = ctx.finish(
            outputs={"model": ctx.model_dir},
            metrics=metrics,
            extra={
                **model_info,
                **output_fingerprint(ctx),
                **resume_details(checkpoint, trained),
                "upstream": start.upstream or "",
            },
        )
        tracker.finish("succeeded")
    return code
