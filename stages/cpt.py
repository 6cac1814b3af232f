"""Continued pre-training: next-token loss on raw text, documents packed into full rows.

    python -m stages cpt --run-dir DIR              one process
    torchrun --nproc-per-node N -m stages cpt ...    N processes (DDP, FSDP2 or DeepSpeed, from the spec)

Starts from the base model (or an earlier stage's output), trains with the transformers Trainer on the token
cache prepare built, checkpoints into `cpt/checkpoints/`, resumes from the newest valid checkpoint after a
preemption (never past the plan: from the last checkpoint it trains no step), and writes the model (safetensors)
and tokenizer into `cpt/model/`, its content fingerprint into stage.json.
"""

from __future__ import annotations

from transformers import Trainer, TrainingArguments

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
    """Train the cpt stage; returns the process exit code. Refused when an upstream model changed: nothing
    trained, one error line, exit 2."""
    sigterm = SigtermCheckpoint()
    return run_stage(ctx, lambda: train(ctx, sigterm), (NotSupportedHere,), labelled=False, sigterm=sigterm)


def train(ctx: StageContext, sigterm: SigtermCheckpoint) -> int:
    run_dir, spec = ctx.run_dir, ctx.spec

    # 1. The tokenizer and the model this stage starts from.
    tokenizer = load_tokenizer(run_dir, spec.model)
    start = load_starting_model(run_dir, spec, ctx.stage, tokenizer, ModelInputs(ctx))
    args = build_config(ctx, TrainingArguments, trainer_arguments(ctx, start.model))

    # 2. The packed token rows (built by prepare; built here when missing). Rank 0 builds, the others wait.
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
                **ctx.section.training.model_dump(),
                **describe(start.model),
                "train_rows": cache.meta["train"]["rows"],
                "train_tokens": cache.meta["train"]["tokens"],
            }
        )
        progress = ProgressLog(ctx.stage, start.model)
        gauges = StageMetrics.for_stage(ctx, progress)  # served by rank 0 on POSTTRAIN_METRICS_PORT, if set
        recompute = RecomputeLayers(ctx.stage, ctx.section.training.recompute_layers)
        callbacks = [tracker.hf_callback(), progress, gauges, CheckpointMarker(), sigterm, recompute]
        with mesh_over_gloo(ctx.section):
            trainer = pipeline_trainer(Trainer, ctx.stage, ctx.section)(  # Trainer itself unless pipelined
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

        # 5. Held-out loss, the model, the record.
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
