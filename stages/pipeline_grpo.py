"""GRPO over pipeline stages: rlhf's GRPO trained by torch's pipeline schedule, its completions sampled through the
stages.

TRL's GRPOTrainer samples each prompt's completions with the policy (`generate`), scores them, and takes its loss from
the policy's per-token log-probabilities of the completions (with beta > 0, against the reference's). Under pipeline
stages (`distributed.pipeline_parallel`, `stages.pipeline_parallel`) no rank holds the whole model:

- Sampling runs through the stages with transformers' own pipeline forward (`transformers.distributed.
  pipeline_parallel.pipeline_parallel_naive_forward`: each stage receives the previous one's hidden states and sends
  its own on; the last stage's logits are broadcast over the pipeline), every stage of a pipeline calling `generate`
  on the same prompts. Each stage keeps the key/value cache of its own layers; the cache's entries of the layers it
  does not hold are one of its own (`stage_cache`: transformers reads the cached length from layer 0, which only the
  first stage holds). The stages of a pipeline (and a stage's tensor-parallel ranks, which split its layers) sample
  the same tokens from the same logits because they are seeded alike: the seed plus the pipeline's index, as TRL
  seeds the one DDP process a pipeline stands for.
- TRL's data-parallel steps (the sampler's share, the gathers of rewards and token counts, the slice of the
  advantages, the metrics' reductions) span the pipelines, not the world: inside them the trainer sees one process per
  pipeline (`PipelinesAsProcesses`). Every stage of a pipeline scores the same completions.
- The loss: a step's rows (each prompt without its left padding, then its completion: `CompletionRows`) run through
  the schedule; on the last stage each micro-batch's log-probabilities and entropies of its completion tokens (the
  logits divided by the sampling temperature, as TRL's fused head divides them) go to TRL's own `_compute_loss`
  (every loss type, the clipping, the KL term, its metrics) in place of its forward, the accumulation it divides by
  being the step's micro-batches. The rows start at position 0 where TRL pads prompts on the left: rotary positions
  count only distances and the padding is masked, so the log-probabilities are TRL's. The reference's
  log-probabilities go through the stages forward only: with LoRA the policy's, the adapter switched as TRL switches
  it; in full training each stage's frozen copy of its starting weights (`Pipeline`'s `reference`), which TRL takes
  in place of the whole model it would read in every process.
  The metrics the last stage logs are sent to the pipeline's other stages, rank 0 (a first stage) among them.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import wraps
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from spec.training import TrainingStage
from stages.contract import NotSupportedHere
from stages.pipeline_parallel import Pipeline, PipelineLayout, layer_ranges, pipeline_trainer
from stages.pipeline_preference import reference_adapter_made_before_the_cut

ROW, START = 0, 1
"""The target's columns: each schedule row's row of TRL's batch (-1: a padding row), where its completion starts."""


class CompletionRows:
    """TRL's generated rows (`input_ids`: prompts padded on the left, then completions padded on the right) as the
    schedule's batch of `rows` rows of `width` tokens: each prompt's own tokens from position 0, its completion
    after them, the rest padding; the target names each row and where its completion starts."""

    def __init__(self, stage: str, rows: int, width: int, pad_token_id: int) -> None:
        self.stage, self.rows, self.width, self.pad_token_id = stage, rows, width, pad_token_id

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion: int) -> dict[str, Any]:
        wide = input_ids.shape[1]
        prompt = wide - completion
        lengths = attention_mask[:, :prompt].sum(dim=1).tolist()
        ids = torch.full((self.rows, self.width), self.pad_token_id, dtype=input_ids.dtype)
        target = torch.full((self.rows, 2), -1, dtype=torch.long)
        target[:, START] = 0
        for row, length in enumerate(lengths):
            if length + completion > self.width:
                raise NotSupportedHere(
                    f"stages.{self.stage}.training.max_seq_length ({self.width}) is shorter than a prompt of {length} "
                    f"tokens and its completion of up to {completion}: under distributed.pipeline_parallel every row "
                    "has that width; raise max_seq_length or shorten the prompts"
                )
            ids[row, :length] = input_ids[row, prompt - length : prompt]
            ids[row, length : length + completion] = input_ids[row, prompt:]
            target[row] = torch.tensor([row, length])
        position_ids = torch.arange(self.width).repeat(self.rows, 1)
        device = input_ids.device
        return {"input_ids": ids.to(device), "labels": target.to(device), "position_ids": position_ids.to(device)}


class CompletionLoss:
    """The last stage's loss of each micro-batch: its completion tokens' log-probabilities and entropies from the
    logits, then TRL's `_compute_loss` over its rows of the step's batch (`begin`), the metrics it logs kept per call
    (`logged`: torch's schedule also calls the loss once to infer the gradients' shapes, on its first step and on each
    return from a forward-only run, so a step's micro-batches are its last calls). Forward only (`recording`), the
    log-probabilities are kept instead (`found`)."""

    def __init__(self, trainer: Any, temperature: float, microbatches: int) -> None:
        self.trainer, self.temperature, self.microbatches = trainer, temperature, microbatches
        self.batch: dict[str, Any] = {}
        self.completion = 0
        self.recording = False
        self.found: torch.Tensor | None = None
        """Forward only: each row's completion log-probabilities (rows x completion width)."""
        self.logged: list[dict[str, list[float]]] = []
        """In training, each call's metrics as TRL's loss logged them."""

    def begin(self, batch: dict[str, Any], completion_ids: torch.Tensor, mask: torch.Tensor, recording: bool) -> None:
        """Before a run of the schedule: TRL's rows it computes (`batch`, training), their completion tokens and
        which of those count (TRL's fused head scores the others 0)."""
        self.batch, self.completion_ids, self.mask, self.recording = batch, completion_ids, mask, recording
        self.completion = completion_ids.shape[1]
        self.logged = []
        if recording:
            self.found = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)

    def scores(self, logits: torch.Tensor, target: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, Any]:
        """The log-probability of each row's completion tokens, and their entropy (where asked), under the sampling
        temperature."""
        rows = target[:, ROW].clamp(min=0)
        # the logits at a completion token's position - 1 predict it
        positions = (target[:, START, None] - 1 + torch.arange(self.completion, device=logits.device)).clamp(min=0)
        picked = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1])).float() / self.temperature
        log_probs = picked.log_softmax(dim=-1)
        counted = self.mask[rows]
        logps = log_probs.gather(-1, self.completion_ids[rows][..., None]).squeeze(-1) * counted
        entropies = -(log_probs.exp() * log_probs).sum(dim=-1) * counted if entropy else None
        return logps, entropies

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        held = target[:, ROW] >= 0
        if not bool(held.any()):
            self.logged.append({})
            return logits.sum() * 0.0  # a padding micro-batch: no rows, no gradient
        target = target[held]
        logits = logits[held]
        if self.recording:
            with torch.no_grad():
                logps, _ = self.scores(logits, target, entropy=False)
            self.found[target[:, ROW]] = logps
            return logits.sum().detach() * 0.0
        logps, entropies = self.scores(logits, target, entropy=True)
        rows = target[:, ROW]
        inputs = {key: _rows(value, rows) for key, value in self.batch.items()}
        trainer = self.trainer
        metrics = trainer._metrics["train"]
        before = {key: len(values) for key, values in metrics.items()}
        trainer._scored = (logps, entropies, None)
        try:
            # TRL divides each accumulation step's loss by their count (dapo: by the step's share of the generation
            # batch): the step's micro-batches are those accumulation steps
            with (
                mock.patch.object(trainer, "current_gradient_accumulation_steps", self.microbatches),
                mock.patch.object(trainer.args, "steps_per_generation", self.microbatches),
            ):
                loss = trainer._compute_loss(None, inputs)
        finally:
            trainer._scored = None
        self.logged.append({key: values[before.get(key, 0) :] for key, values in metrics.items()})
        for key, count in before.items():
            del metrics[key][count:]
        return loss


def _rows(value: Any, rows: torch.Tensor) -> Any:
    """`value`'s `rows` where it has one entry per row of the step's batch; as it is otherwise."""
    return value[rows] if isinstance(value, torch.Tensor) and value.dim() > 0 else value


class PipelinesAsProcesses:
    """The trainer's accelerator as TRL's data-parallel code sees it under pipeline stages: one process per pipeline
    (the ranks holding this rank's stage), its gathers and reductions over them; everything else the accelerator's."""

    def __init__(self, accelerator: Any, layout: PipelineLayout) -> None:
        self.accelerator, self.layout = accelerator, layout
        self.num_processes, self.process_index = layout.pipelines, layout.pipeline

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous() if tensor.dim() else tensor[None]
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor, group=self.layout.replica_group)
        return torch.cat(parts)

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.layout.replica_group)
        return tensor / self.num_processes if reduction == "mean" else tensor

    def gather_object(self, values: list[Any]) -> list[Any]:
        parts: list[Any] = [None] * self.num_processes
        dist.all_gather_object(parts, values, group=self.layout.replica_group)
        return [value for part in parts for value in part]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.accelerator, name)


def stage_cache(causal: Any, layers: range) -> Any:
    """A key/value cache for generating on a stage that holds `layers`: transformers' own, each layer the stage does
    not hold sharing the entry of one it does (of the same kind: sliding or full), which transformers reads the
    cached length from (layer 0 otherwise, empty but on the first stage)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=causal.config)
    own = [cache.layers[index] for index in layers]
    for index in range(len(cache.layers)):
        if index not in layers:
            kind = type(cache.layers[index])
            cache.layers[index] = next((layer for layer in own if type(layer) is kind), own[0])
    return cache


@contextmanager
def generation_through_stages(pipeline: Pipeline) -> Iterator[None]:
    """While the policy generates: its forward is transformers' pipeline forward over this rank's pipeline, its
    `generate` given a cache of this stage's layers (`stage_cache`) and, over several pipelines (FSDP2 gathers a
    stage's weights with its copies at each forward), run for as many tokens as the longest pipeline's."""
    from transformers.distributed.pipeline_parallel import PipelineStage, pipeline_parallel_naive_forward

    causal, layout = pipeline.causal, pipeline.layout
    layers = layer_ranges(causal.config.get_text_config().num_hidden_layers, layout.stages)[layout.stage]
    forward, generate = causal.forward, causal.generate
    signature = inspect.signature(forward)

    @wraps(forward)
    def through_stages(*args: Any, **kwargs: Any) -> Any:
        return pipeline_parallel_naive_forward(causal, forward, signature, *args, **kwargs)

    @wraps(generate)
    def generate_on_stage(*args: Any, **kwargs: Any) -> Any:
        kwargs["past_key_values"] = stage_cache(causal, layers)
        kwargs["synced_gpus"] = layout.pipelines > 1
        return generate(*args, **kwargs)

    if layout.pipelines > 1:
        gather_stage_weights(pipeline)
    own = {name: causal.__dict__[name] for name in ("forward", "generate") if name in causal.__dict__}
    causal._pp_stage = PipelineStage(layout.mesh["pp"])
    causal.forward, causal.generate = through_stages, generate_on_stage
    try:
        with torch.autocast(next(causal.parameters()).device.type, dtype=torch.bfloat16, enabled=pipeline.part.bf16):
            yield
    finally:
        del causal.forward, causal.generate
        for name, value in own.items():  # an instance's own (TRL's fused head), as it was
            setattr(causal, name, value)


def gather_stage_weights(pipeline: Pipeline) -> None:
    """Over several pipelines, before sampling: FSDP2 gathers a stage's own weights outside its layers (the
    embedding, the final norm, the head) in the stage's forward only, which sampling does not call (it calls the
    model's), so one forward of the stage over a row of one token gathers them (and, the first time, makes the stage
    FSDP2's root, as training does); its layers gather theirs as sampling calls them. They stay gathered until the
    next backward (`reshard_after_forward` off)."""
    part = pipeline.part
    parameter = next(part.parameters())
    device = parameter.device
    if part.first:
        x = torch.zeros((1, 1), dtype=torch.long, device=device)
    else:
        hidden = part.model.config.get_text_config().hidden_size
        x = torch.zeros((1, 1, hidden), dtype=parameter.dtype, device=device)
    with torch.no_grad():
        part(x, torch.zeros((1, 1), device=device))


def grpo_pipeline_trainer(base: type, stage: str, section: TrainingStage) -> type:
    """`base` (TRL's GRPOTrainer) training the stage's model as a pipeline, sampling through the stages; `base` itself
    where the run has one stage."""
    pipelined = pipeline_trainer(base, stage, section)
    if pipelined is base:
        return base
    training = section.training
    microbatches = training.gradient_accumulation_steps
    rows = training.per_device_batch_size * microbatches

    class GRPOPipelineTrainer(pipelined):  # type: ignore[misc, valid-type]
        """The pipeline's Trainer sampling through the stages, TRL's loss on the last stage."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._scored: tuple[torch.Tensor, Any, Any] | None = None
            with ExitStack() as patched:
                if hasattr(kwargs["model"], "peft_config") and kwargs["args"].beta != 0:
                    # TRL's frozen copy of a starting adapter, the reference: made before the cut, as DPO's
                    patched.enter_context(reference_adapter_made_before_the_cut(kwargs["model"]))
                if self.keeps_reference(kwargs["model"], kwargs["args"]):
                    # TRL reads a full policy's reference whole from the policy's path: the stage's frozen copy
                    # instead (`Pipeline`'s `reference`), made as the policy was cut
                    import trl.trainer.grpo_trainer as grpo_module

                    copied = lambda *_args, **_kwargs: self.pipeline.reference_part.model  # noqa: E731
                    patched.enter_context(mock.patch.object(grpo_module, "create_model_from_path", copied))
                super().__init__(*args, **kwargs)
            self.rows = CompletionRows(stage, rows, training.max_seq_length, self.processing_class.pad_token_id)
            self.completion_loss = CompletionLoss(self, self.temperature, microbatches)
            self.pipeline.objective = self.completion_loss

        def keeps_reference(self, model: Any, args: Any) -> bool:
            return args.beta != 0 and not hasattr(model, "peft_config")  # full training's reference

        def fixed_shape_collator(self, data_collator: Any, pad_token_id: int) -> Any:
            return None  # TRL's own (the prompts as it reads them); the rows are laid out once generated

        def _track_num_input_tokens(self, inputs: Any) -> None:
            pass  # the Trainer's batch is prompts; TRL counts the tokens it generates (`num_tokens`)

        @contextmanager
        def pipelines_as_processes(self) -> Iterator[None]:
            """TRL's data-parallel code over the pipelines (`PipelinesAsProcesses`)."""
            import trl.trainer.grpo_trainer as grpo_module

            view = PipelinesAsProcesses(self.accelerator, self.pipeline.layout)
            with (
                mock.patch.object(self, "accelerator", view),
                mock.patch.object(grpo_module, "gather", view.gather),
                mock.patch.object(grpo_module, "gather_object", view.gather_object),
            ):
                yield

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            with self.pipelines_as_processes():
                return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts: list) -> Any:
            with generation_through_stages(self.pipeline):
                return super()._generate(prompts)

        def _get_per_token_logps_and_entropies(
            self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **kwargs: Any
        ) -> tuple[torch.Tensor, Any, Any]:
            """Inside the last stage's loss: the micro-batch's scores, taken from its logits. Otherwise (the
            reference's, or the policy's before a step): through the stages, forward only, on every stage (full
            training's reference: through its frozen copy of them)."""
            if self._scored is not None:
                return self._scored
            pipeline, loss = self.pipeline, self.completion_loss
            reference = model is not None and model is self.ref_model
            found = []
            training = pipeline.part.training
            pipeline.part.eval()
            try:
                with torch.no_grad():
                    for start in range(0, input_ids.shape[0], rows):
                        chunk = slice(start, start + rows)
                        batch = self.rows(input_ids[chunk], attention_mask[chunk], logits_to_keep)
                        completion = (input_ids[chunk, -logits_to_keep:], attention_mask[chunk, -logits_to_keep:])
                        loss.begin({}, *completion, recording=True)
                        pipeline.run(batch, train=False, reference=reference)
                        assert loss.found is not None
                        logps = loss.found
                        dist.broadcast(logps, group=pipeline.layout.stage_group, group_src=pipeline.layout.stages - 1)
                        found.append(logps)
            finally:
                pipeline.part.train(training)
            return torch.cat(found), None, None

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            began = time.perf_counter()
            pipeline = self.pipeline
            pipeline.part.train()
            inputs = self._prepare_inputs(inputs)  # TRL's: generated and scored every steps_per_generation steps
            completion_ids = inputs["completion_ids"]
            ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            batch = self.rows(ids, mask, completion_ids.shape[1])
            self.completion_loss.begin(inputs, completion_ids, inputs["completion_mask"], recording=False)
            with self.pipelines_as_processes():
                loss = pipeline.run(batch, train=True)
            pipeline.sum_tied_gradients()
            self.share_metrics(self.completion_loss.logged[-microbatches:] if pipeline.layout.last else [])
            self._step += 1
            self._metrics["train"]["step_time"].append(time.perf_counter() - began)
            return loss

        def share_metrics(self, logged: list[dict[str, list[float]]]) -> None:
            """The metrics TRL's loss logged for the step's micro-batches on the last stage (`logged`), on every
            stage of the pipeline (rank 0, which writes the log, is a first stage)."""
            layout = self.pipeline.layout
            shared = [logged]
            dist.broadcast_object_list(shared, group=layout.stage_group, group_src=layout.stages - 1)
            for call in shared[0]:
                for key, values in call.items():
                    self._metrics["train"][key].extend(values)

    GRPOPipelineTrainer.__name__ = GRPOPipelineTrainer.__qualname__ = f"Pipeline{base.__name__}"
    return GRPOPipelineTrainer
