"""Preference optimisation after SFT: DPO by default; ORPO, KTO or GRPO by `stages.rlhf.algorithm`.

    python -m stages rlhf --run-dir DIR              one process
    torchrun --nproc-per-node N -m stages rlhf ...    N processes (DDP, FSDP2 or DeepSpeed, from the spec)

Starts from the output of the newest enabled stage before it (sft, else cpt, else the base model), full or with a
LoRA adapter: sft's adapter is continued, or after `lora.merge_after` the merged model gets a fresh one. Trains with
TRL on the preference rows prepare wrote (`prepare/data/rlhf/{train,eval}.jsonl`):

- dpo:  DPOTrainer on the (prompt, chosen, rejected) rows, against a reference model;
- orpo: ORPOTrainer on the same rows, no reference model (the odds-ratio term is added to the SFT loss);
- kto:  KTOTrainer on unpaired rows derived from them: chosen → desirable, rejected → undesirable;
- grpo: GRPOTrainer on the prompts alone: the policy samples `num_generations` completions per prompt, scored by
  the reward functions of `stages.rlhf.reward_functions` (stages/rewards.py).

The reference model (dpo, kto, grpo) is the starting model, kept frozen: with LoRA, TRL keeps a frozen copy of the
starting adapter next to the trained one (a fresh adapter's copy is zero, i.e. the adapter disabled); with full
training, a frozen copy of the starting weights, or none at all when `precompute_ref_log_probs` computes the
reference log-probabilities once, with the starting weights, before the first step (see docs/rlhf.md).

Checkpoints go to `rlhf/checkpoints/`, a rerun resumes from the newest valid one (never past the plan), SIGTERM
saves one and exits 75; the adapter or (merged) model and the tokenizer go to `rlhf/model/`, its content fingerprint
to stage.json. The upstream models are held to the fingerprints their stages recorded.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset
from transformers import TrainingArguments, set_seed

from spec.training import RlhfStage
from stages.checkpoints import CheckpointMarker, SigtermCheckpoint
from stages.contract import StageContext, is_main_process
from stages.entry import run_stage
from stages.float8 import train_in_float8
from stages.metrics import StageMetrics
from stages.model_parallel import is_sharded_at_load, mesh_over_gloo, tensor_parallel_size
from stages.modeling import (
    ModelInputs,
    NotSupportedHere,
    StartingModel,
    describe,
    load_base,
    load_model_parallel,
    load_starting_model,
    load_tokenizer,
    stage_output,
)
from stages.pipeline_grpo import grpo_pipeline_trainer
from stages.pipeline_parallel import pipeline_parallel_size
from stages.pipeline_preference import preference_pipeline_trainer
from stages.progress import ProgressLog
from stages.recompute import RecomputeLayers
from stages.rewards import RewardError, build_reward_functions
from stages.tracking import StageTracker
from stages.training import (
    build_config,
    loss_curve,
    output_fingerprint,
    resume_checkpoint,
    resume_details,
    save_stage_model,
    train_to_plan,
    trainer_arguments,
    write_distributed_config,
    write_log_history,
)

REFERENCE_ADAPTER = "ref"
"""The frozen copy of the starting adapter that TRL adds to a PEFT model passed without a reference model."""

LOGGED_METRICS = {
    "train_loss": "loss",
    "rewards_margin": "rewards/margins",
    "rewards_accuracy": "rewards/accuracies",
    "reward": "reward",
    "kl": "kl",
}
"""stage.json metric name → the key TRL logs it under (first and last training value; `eval_` + key for eval)."""


def run(ctx: StageContext) -> int:
    """Train the rlhf stage; returns the process exit code. Refused when an upstream model changed: nothing
    trained, one error line, exit 2."""
    sigterm = SigtermCheckpoint()
    expected = (NotSupportedHere, RewardError)  # what the spec asks cannot be done: one error line, no traceback
    return run_stage(ctx, lambda: train(ctx, sigterm), expected, labelled=False, sigterm=sigterm)


def train(ctx: StageContext, sigterm: SigtermCheckpoint) -> int:
    """Load, train, save and record; returns the exit code (EXIT_RETRYABLE after SIGTERM)."""
    run_dir, spec = ctx.run_dir, ctx.spec
    section: RlhfStage = ctx.section

    # 1. The tokenizer, the model this stage starts from (sft's output, when sft ran) and the trainer's settings.
    tokenizer = load_tokenizer(run_dir, spec.model)
    start = load_starting_model(ctx.run_dir, ctx.spec, ctx.stage, tokenizer, ModelInputs(ctx))
    config = trainer_config(ctx, start)

    # 2. The preference rows, in the shape the algorithm reads. Rank 0 reads them first, the others from its cache.
    with config.main_process_first(desc="preference data", local=False):
        files = preference_files(ctx)
        train_rows, eval_rows = load_rows(ctx, files)
    record_inputs(ctx, files)
    write_distributed_config(ctx, config)

    # 3. Resume from the newest valid checkpoint of an earlier attempt, if any.
    checkpoint = resume_checkpoint(ctx)

    with StageTracker(ctx) as tracker:
        tracker.log_params(
            {
                "stage": ctx.stage,
                **section.model_dump(include={"algorithm", "beta", "precompute_ref_log_probs", "method"}),
                "strategy": section.distributed.strategy,
                "continued_adapter": start.continued_adapter,
                **(
                    section.model_dump(include={"num_generations", "reward_functions"})
                    if section.algorithm == "grpo"
                    else {}
                ),
                **section.training.model_dump(),
                **section.lora.model_dump(),
                **describe(start.model),
                "train_rows": len(train_rows),
                "eval_rows": len(eval_rows) if eval_rows is not None else 0,
            }
        )
        progress = ProgressLog(ctx.stage, start.model)
        gauges = StageMetrics.for_stage(ctx, progress)  # served by rank 0 on POSTTRAIN_METRICS_PORT, if set
        recompute = RecomputeLayers(ctx.stage, ctx.section.training.recompute_layers)
        callbacks = [tracker.hf_callback(), progress, gauges, CheckpointMarker(), sigterm, recompute]
        with mesh_over_gloo(ctx.section):
            trainer = make_trainer(ctx, start, config, tokenizer, train_rows, eval_rows, callbacks)

        # 4. Train, up to the planned end and never past it (none left when the checkpoint is at it).
        trained = train_to_plan(trainer, checkpoint, ctx.stage)
        if sigterm.stopped:
            tracker.finish("interrupted")
            step = trainer.state.global_step
            return ctx.fail(f"{sigterm.signal_name}: saved checkpoint-{step}; a rerun resumes from it", retryable=True)

        # 5. Held-out preference metrics (not for GRPO: its eval would generate), the model, the record.
        eval_metrics = trainer.evaluate() if eval_rows is not None and section.algorithm != "grpo" else {}
        model_info = save_stage_model(trainer, tokenizer, run_dir, spec, ctx.stage, start)
        drop_reference_adapter(ctx)  # the model handed on is the trained adapter alone
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
                **output_fingerprint(ctx),  # after the reference adapter was dropped: the folder as handed on
                **resume_details(checkpoint, trained),
                "upstream": start.upstream or "",
                "algorithm": section.algorithm,
                "reference": reference_description(section, start),
            },
        )
        tracker.finish("succeeded")
    return code


# --------------------------------------------------------------------------- settings


def trainer_config(ctx: StageContext, start: StartingModel) -> TrainingArguments:
    """The TRL config of the stage's algorithm: the shared trainer arguments plus the algorithm's own."""
    section: RlhfStage = ctx.section
    t = section.training
    common = {
        **trainer_arguments(ctx, start.model),
        "beta": section.beta,
        "trust_remote_code": ctx.spec.model.trust_remote_code,
    }
    if section.algorithm == "dpo":
        from trl import DPOConfig

        return build_config(
            ctx,
            DPOConfig,
            {**common, "max_length": t.max_seq_length, "precompute_ref_log_probs": section.precompute_ref_log_probs},
        )
    if section.algorithm == "orpo":
        from trl.experimental.orpo import ORPOConfig

        return build_config(ctx, ORPOConfig, {**common, "max_length": t.max_seq_length})
    if section.algorithm == "kto":
        from trl import KTOConfig

        if t.per_device_batch_size < 2:
            raise NotSupportedHere(
                "stages.rlhf.algorithm 'kto' estimates its KL term from the other rows of a batch: "
                f"stages.rlhf.training.per_device_batch_size must be at least 2 (it is {t.per_device_batch_size})"
            )
        return build_config(
            ctx,
            KTOConfig,
            {**common, "max_length": t.max_seq_length, "precompute_ref_log_probs": section.precompute_ref_log_probs},
        )
    from trl import GRPOConfig

    groups = t.per_device_batch_size * t.gradient_accumulation_steps
    if groups % section.num_generations:
        raise NotSupportedHere(
            f"stages.rlhf.num_generations ({section.num_generations}) must divide per_device_batch_size × "
            f"gradient_accumulation_steps ({groups}): each batch holds whole groups of completions of one prompt"
        )
    # Fails early on a bad reward function; imports only the modules the pipeline file allows.
    _, weights = build_reward_functions(section.reward_functions, modules=section.reward_modules)
    grpo = {
        **common,
        "num_generations": section.num_generations,
        "max_completion_length": t.max_seq_length // 2,  # prompt and completion share max_seq_length
        "reward_weights": weights,
        "generation_kwargs": {"use_cache": True},  # training turns the model's cache off; generation wants it
    }
    config = build_config(ctx, GRPOConfig, grpo)
    # TRL counts a generation batch over every process; a tensor-parallel group's ranks share their rows, as do a
    # pipeline's stages, so the prompts drawn per step are the data-parallel ranks' (accelerate gives each group one
    # share; the stages read their pipeline's): without this the sampler's repeats fall out of step with the steps
    # that generate, and some prompts are never drawn.
    config.generation_batch_size //= tensor_parallel_size(section) * pipeline_parallel_size(section)
    return config


# --------------------------------------------------------------------------- data


def preference_files(ctx: StageContext) -> dict[str, Path]:
    """The preference rows prepare wrote: train (required) and eval (when it has rows)."""
    data_dir = ctx.run_dir.stage_dir("prepare") / "data" / "rlhf"
    files = {split: data_dir / f"{split}.jsonl" for split in ("train", "eval")}
    files = {split: path for split, path in files.items() if path.is_file() and path.stat().st_size > 0}
    if "train" not in files:
        raise RuntimeError(f"{data_dir}/train.jsonl is missing or empty: prepare writes it when stages.rlhf is enabled")
    return files


def load_rows(ctx: StageContext, files: dict[str, Path]) -> tuple[Dataset, Dataset | None]:
    """(train, eval) in the algorithm's format. The datasets cache (and TRL's precomputed reference log-probs next
    to it) lives in `rlhf/cache/`, shared by the ranks and reused by a resumed attempt."""
    section: RlhfStage = ctx.section
    loaded = load_dataset("json", data_files={k: str(v) for k, v in files.items()}, cache_dir=str(ctx.dir / "cache"))
    train_rows, eval_rows = loaded["train"], loaded.get("eval")
    if section.algorithm == "kto":
        seed = section.training.seed
        return unpaired(train_rows, seed), unpaired(eval_rows, seed) if eval_rows is not None else None
    if section.algorithm == "grpo":
        return train_rows.select_columns(["prompt"]), None
    return train_rows, eval_rows  # dpo, orpo: the (prompt, chosen, rejected) rows as they are


def unpaired(rows: Dataset, seed: int) -> Dataset:
    """KTO's unpaired rows: every preference row gives a desirable example (its chosen answer) and an undesirable
    one (its rejected answer). Shuffled, so that a batch mixes both kinds and KTO's KL term (estimated from
    mismatched prompt/completion pairs within a batch) rarely pairs the two halves of one row."""

    def split(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        n = len(batch["prompt"])
        return {
            "prompt": batch["prompt"] * 2,
            "completion": batch["chosen"] + batch["rejected"],
            "label": [True] * n + [False] * n,
        }

    return rows.map(split, batched=True, remove_columns=rows.column_names).shuffle(seed=seed).flatten_indices()


def record_inputs(ctx: StageContext, files: dict[str, Path]) -> None:
    """Lineage in stage.json: the preference files. (The upstream models are recorded, by content, as they load:
    `stages.modeling.ModelInputs`.)"""
    for split, path in files.items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        ctx.add_input(f"preference_{split}", ctx.run_dir.relative(path), f"sha256:{digest}")


# --------------------------------------------------------------------------- the trainer


def make_trainer(
    ctx: StageContext,
    start: StartingModel,
    config: TrainingArguments,
    tokenizer: Any,
    train_rows: Dataset,
    eval_rows: Dataset | None,
    callbacks: list[Any],
) -> Any:
    """The TRL trainer of the stage's algorithm, with its reference model (see `frozen_reference`)."""
    section: RlhfStage = ctx.section
    common = {
        "model": start.model,
        "args": config,
        "train_dataset": train_rows,
        "processing_class": tokenizer,
        "callbacks": callbacks,
    }
    if section.algorithm == "dpo":
        from trl import DPOTrainer

        reference = frozen_reference(ctx, start, tokenizer)
        # DPOTrainer itself unless the model is cut into pipeline stages
        return preference_pipeline_trainer(DPOTrainer, ctx.stage, section)(
            **common, eval_dataset=eval_rows, ref_model=reference
        )
    if section.algorithm == "orpo":
        from trl.experimental.orpo import ORPOTrainer

        # ORPOTrainer itself unless the model is cut into pipeline stages
        return preference_pipeline_trainer(ORPOTrainer, ctx.stage, section)(**common, eval_dataset=eval_rows)
    if section.algorithm == "kto":
        from trl import KTOTrainer

        reference = frozen_reference(ctx, start, tokenizer)
        # KTOTrainer itself unless the model is cut into pipeline stages
        return preference_pipeline_trainer(KTOTrainer, ctx.stage, section)(
            **common, eval_dataset=eval_rows, ref_model=reference
        )
    from trl import GRPOTrainer

    from stages.chat import stop_token_ids

    # Where a turn ends in this template (Gemma's <end_of_turn>, Llama-3's <|eot_id|>), besides the eos ids.
    end_ids = {*stop_token_ids(tokenizer), *_as_list(start.model.generation_config.eos_token_id)} - {None}
    rewards, _ = build_reward_functions(
        section.reward_functions, end_token_ids=sorted(end_ids), modules=section.reward_modules
    )
    point_grpo_at_reference(ctx, start, config)
    with grpo_reference_sharded(ctx, start, tokenizer):
        # GRPOTrainer itself unless the model is cut into pipeline stages
        trainer = grpo_pipeline_trainer(GRPOTrainer, ctx.stage, section)(**common, reward_funcs=rewards)
    seed_groups_alike(ctx, trainer)
    return trainer


@contextmanager
def grpo_reference_sharded(ctx: StageContext, start: StartingModel, tokenizer: Any) -> Iterator[None]:
    """While GRPOTrainer is made: where it would load its reference whole in every process (full training, beta >
    0) and the policy was sharded as it loaded (tensor or expert parallelism), hand it `sharded_reference` instead:
    the same starting weights, sharded as the policy is (TRL 1.16 takes no reference model for GRPO; it reads one
    from the policy's path with `create_model_from_path`, which this replaces for the one call)."""
    if not grpo_loads_reference(ctx, start) or not is_sharded_at_load(start.model):
        yield
        return
    import trl.trainer.grpo_trainer as grpo_module

    loads = grpo_module.create_model_from_path

    def reference(*args: Any, **kwargs: Any) -> Any:
        return sharded_reference(ctx, start, tokenizer)

    grpo_module.create_model_from_path = reference
    try:
        yield
    finally:
        grpo_module.create_model_from_path = loads


def seed_groups_alike(ctx: StageContext, trainer: Any) -> None:
    """Seed the sampling of a tensor-parallel group's ranks alike, the groups apart. TRL seeds every process apart
    (`set_seed(seed, device_specific=True)`: the seed plus the process's index) so that DDP's processes sample
    different completions; under tensor parallelism a group's ranks compute the same rows together and must sample
    the same tokens, or they would add up parts of different rows. Each group takes the seed of the DDP process it
    stands for (the seed plus its data-parallel index), so a group trains as that process would. Under pipeline
    stages the group is a pipeline (its stages, and their tensor-parallel ranks), its index the pipeline's."""
    seed = ctx.section.training.seed
    pipeline = getattr(trainer, "pipeline", None)
    if pipeline is not None:
        set_seed(seed + pipeline.layout.pipeline)
    elif (tp := tensor_parallel_size(ctx.section)) > 1:
        set_seed(seed + trainer.accelerator.process_index // tp)


def frozen_reference(ctx: StageContext, start: StartingModel, tokenizer: Any) -> Any | None:
    """DPO/KTO's reference model for full training: a frozen copy of the starting model. None when TRL needs none:
    with an adapter (TRL keeps a frozen copy of the starting adapter), or when the reference log-probabilities are
    precomputed (TRL computes them with the policy itself before the first step, i.e. with the starting weights).

    Under ZeRO-3 over several processes the policy was created partitioned (`stages.sharded_loading`): a copy of it
    would be a copy of the partitions, and a whole copy would put the model in every process' memory twice. The
    reference is then loaded a second time the way the policy was, partitioned too (the same weights: the same
    checkpoint, or a model built from config from the same seed), and TRL wraps it in its own inference engine. A
    policy that transformers sharded as it loaded (tensor or expert parallelism) gets a reference sharded the same
    way (`sharded_reference`)."""
    section: RlhfStage = ctx.section
    if start.kind == "adapter" or section.precompute_ref_log_probs:
        return None
    if pipeline_parallel_size(section) > 1:
        return None  # each stage's frozen copy of its starting weights (`stages.pipeline_parallel.Pipeline`)
    if start.zero3_config is not None:
        set_seed(section.training.seed)  # a model built from config draws the policy's weights again
        reference = load_base(ctx.run_dir, ctx.spec, start.base, tokenizer)
    elif is_sharded_at_load(start.model):
        reference = sharded_reference(ctx, start, tokenizer)
    else:
        reference = copy.deepcopy(start.model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def sharded_reference(ctx: StageContext, start: StartingModel, tokenizer: Any) -> Any:
    """The frozen reference of a policy that transformers sharded as it loaded (its layers split over
    tensor-parallel ranks, or its experts spread over expert-parallel ones): loaded again the way the policy was (the
    same weights, merged with the upstream adapter where the policy was, sharded the same way, in float8 where it
    trains in float8). A copy of the sharded policy would share its process groups and FSDP2's hooks; one loaded
    whole would put the model in every process' memory."""
    section: RlhfStage = ctx.section
    set_seed(section.training.seed)  # a model built from config draws the policy's weights again
    reference, _ = load_model_parallel(ctx.run_dir, ctx.spec, "rlhf", start.base, tokenizer, start.merged_adapter)
    if section.training.fp8:
        train_in_float8(reference, "rlhf reference")
    return reference


def grpo_loads_reference(ctx: StageContext, start: StartingModel) -> bool:
    """Whether GRPOTrainer loads a reference model of its own, from the policy's path: full training with beta > 0
    (with LoRA the reference is the policy with its adapter off; with beta 0 there is none)."""
    return start.kind == "full" and ctx.section.beta != 0


def point_grpo_at_reference(ctx: StageContext, start: StartingModel, config: TrainingArguments) -> None:
    """GRPOTrainer takes no reference model: with full training and beta > 0 it loads one from the path in the
    policy's config. Make that path hold the starting weights: the upstream stage's model directory when the policy
    is that model unchanged, else a copy saved to `rlhf/reference/` (safetensors)."""
    if not grpo_loads_reference(ctx, start) or is_sharded_at_load(start.model):
        return  # no reference, or one loaded sharded (`grpo_reference_sharded`)
    if pipeline_parallel_size(ctx.section) > 1:
        return  # each stage's frozen copy of its starting weights (`stages.pipeline_grpo`)
    if start.upstream is not None and stage_output(ctx.run_dir, start.upstream).kind == "full":
        return  # loaded from <upstream>/model/, which the config already names
    reference_dir = ctx.dir / "reference"
    with config.main_process_first(desc="GRPO reference model", local=False):
        if is_main_process():
            start.model.save_pretrained(reference_dir)
    start.model.config._name_or_path = str(reference_dir)


def drop_reference_adapter(ctx: StageContext) -> None:
    """Remove TRL's frozen reference adapter, which PEFT saves next to the trained one (`model/ref/`)."""
    if is_main_process():
        shutil.rmtree(ctx.model_dir / REFERENCE_ADAPTER, ignore_errors=True)


def reference_description(section: RlhfStage, start: StartingModel) -> str:
    """What the reference model was, for stage.json."""
    if section.algorithm == "orpo" or (section.algorithm == "grpo" and section.beta == 0):
        return "none"
    if start.kind == "adapter":
        kind = "continued" if start.continued_adapter else "fresh"
        return f"starting model: base + frozen copy of the {kind} adapter"
    if section.precompute_ref_log_probs and section.algorithm != "grpo":
        return "starting model: log-probabilities precomputed before training"
    return "starting model: frozen copy"


# --------------------------------------------------------------------------- the record


def summary_metrics(trainer: Any, eval_metrics: dict[str, float]) -> dict[str, float]:
    """Final metrics for stage.json: steps; first and last logged training value of the loss, reward margin and
    accuracy (dpo, orpo, kto), reward and KL (grpo); and the same on the eval rows after training."""
    history = trainer.state.log_history
    metrics: dict[str, float] = {"steps": trainer.state.global_step}
    for name, key in LOGGED_METRICS.items():
        values = [entry[key] for entry in history if key in entry]
        if values:
            metrics.update({f"{name}_first": values[0], f"{name}_last": values[-1]})
        if f"eval_{key}" in eval_metrics:
            metrics["eval_loss" if key == "loss" else f"eval_{name}"] = eval_metrics[f"eval_{key}"]
    return metrics


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]
