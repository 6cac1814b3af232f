"""Preference optimisation over pipeline stages: rlhf's ORPO trained by torch's pipeline schedule, its micro-batches
holding each pair's chosen and rejected rows.

ORPO (`trl.experimental.orpo.ORPOTrainer`) runs the policy once over a batch's chosen rows followed by its rejected
rows and takes, from the logits, the chosen rows' causal-LM loss and each pair's odds ratio. Under pipeline stages
(`distributed.pipeline_parallel`, `stages.pipeline_parallel`) the last stage alone holds the logits, one micro-batch
at a time, so the loss is computed there, micro-batch by micro-batch, with TRL's own pieces (`get_batch_logps`,
`odds_ratio_loss`):

- `PairedRows` lays out TRL's tokenized pairs (`tokenize_row`: the prompt's labels masked, truncated to max_length)
  as the schedule's batch: micro-batch k holds the chosen rows of its `per_device_batch_size` pairs, then their
  rejected rows, each padded to `max_seq_length` (pairs a short batch lacks are rows without labels). The labels the
  last stage needs travel as the schedule's target: the chosen rows' tokens (ORPO's NLL counts the prompt too), the
  completion's labels and the attention mask.
- `OddsRatioLoss` is each micro-batch's ORPO loss, the NLL over its chosen rows' tokens minus the mean of its pairs'
  weighted log-sigmoid odds ratios, divided by the step's micro-batches that hold pairs: what the Trainer computes for
  one process's accumulation steps (TRL's loss is a mean per micro-batch; the Trainer divides by their count), so one
  pipeline trains as one process does over the same micro-batches, and FSDP2's average over pipelines is DDP's.
  It keeps each micro-batch's metrics (TRL's `rewards/*`, `logps/*`, `nll_loss`, `log_odds_*`, `logits/*`), summed
  over the pipelines once a step as TRL gathers them over processes, for the Trainer's log.

The logits metrics are means over the batch's width as TRL pads it; the positions past a row's end are attended
as the stages attend them (no padding mask: each row's own tokens are unchanged, the padding's logits differ).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from spec.training import TrainingStage
from stages.packing import IGNORE_INDEX
from stages.pipeline_parallel import PipelineLayout, pipeline_trainer

NLL_LABELS, LABELS, ATTENTION = 0, 1, 2
"""The target's channels: the chosen rows' tokens for the NLL, the completions' labels, the attention mask."""

STATS = (
    "pairs",
    "chosen_logps",
    "rejected_logps",
    "accurate",
    "loss",
    "pipelines",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
    "logits_chosen",
    "logits_rejected",
)
"""What a micro-batch records: sums over its pairs (pairs, their log-probabilities, the pairs the policy prefers
rightly, the loss times the pairs) and, once per pipeline, TRL's means over a process's micro-batch."""


class PairedRows:
    """TRL's tokenized preference pairs as one step's batch: `microbatches` micro-batches of `pairs` pairs, each the
    chosen rows then the rejected rows, `width` tokens wide (see the module docstring)."""

    def __init__(self, pairs: int, microbatches: int, width: int, pad_token_id: int) -> None:
        self.pairs, self.microbatches, self.width, self.pad_token_id = pairs, microbatches, width, pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = 2 * self.pairs * self.microbatches
        input_ids = torch.full((rows, self.width), self.pad_token_id)
        target = torch.full((rows, 3, self.width), IGNORE_INDEX)
        target[:, ATTENTION] = 0
        for index, feature in enumerate(features):
            microbatch, pair = divmod(index, self.pairs)
            for half, offset in (("chosen", 0), ("rejected", self.pairs)):
                row = 2 * self.pairs * microbatch + offset + pair
                ids = torch.tensor(feature[f"{half}_input_ids"])
                mask = torch.tensor(feature[f"{half}_attention_mask"])
                length = len(ids)
                if length > self.width:
                    raise ValueError(f"a tokenized {half} row of {length} tokens is longer than max_length")
                input_ids[row, :length] = ids
                target[row, LABELS, :length] = torch.tensor(feature[f"{half}_labels"])
                target[row, ATTENTION, :length] = mask
                if half == "chosen":
                    target[row, NLL_LABELS, :length] = torch.where(mask == 1, ids, IGNORE_INDEX)
        position_ids = torch.arange(self.width).repeat(rows, 1)
        return {"input_ids": input_ids, "labels": target, "position_ids": position_ids}


class OddsRatioLoss:
    """ORPO's loss of each micro-batch on the last stage, and its metrics (see the module docstring).
    `odds_ratio_loss`: the trainer's own (`ORPOTrainer.odds_ratio_loss`, weighted by its beta)."""

    def __init__(self, odds_ratio_loss: Any, beta: float, pairs: int, microbatches: int) -> None:
        self.odds_ratio_loss, self.beta, self.pairs, self.microbatches = odds_ratio_loss, beta, pairs, microbatches
        self.records: list[torch.Tensor] = []
        """One row of `STATS` per call; a step's micro-batches are the last `microbatches` (torch's schedule also
        calls the loss once to infer the gradients' shapes, on its first step and on each return from evaluation)."""
        self.divisor = 1
        self.device = torch.device("cpu")

    def begin(self, target: torch.Tensor, train: bool) -> None:
        """Before a step (or an eval batch) over `target`, the batch's labels: the loss's divisor in training, the
        micro-batches that hold pairs (as the Trainer divides by the accumulation steps of a short last step)."""
        labels = target[:, LABELS].reshape(self.microbatches, 2 * self.pairs, -1)[:, : self.pairs]
        held = int((labels != IGNORE_INDEX).any(-1).any(-1).sum())
        self.divisor = max(1, held) if train else 1
        self.records, self.device = [], target.device

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from trl.experimental.orpo import ORPOTrainer

        pairs = int((target[: self.pairs, LABELS] != IGNORE_INDEX).any(-1).sum())
        if pairs == 0:
            self.records.append(torch.zeros(len(STATS), dtype=torch.float64, device=logits.device))
            return logits.sum() * 0  # rows without labels: no loss, and the backward still runs through the stages
        logits = logits.float()  # as the Trainer's forward returns them under mixed precision
        chosen, rejected = logits[:pairs], logits[self.pairs : self.pairs + pairs]
        labels = target[:, LABELS]
        nll_labels = target[:pairs, NLL_LABELS, 1:]
        # ORPO's NLL: the chosen rows' every attended token, prompt included (ORPOTrainer.concatenated_forward)
        nll = torch.nn.functional.cross_entropy(chosen[:, :-1].reshape(-1, chosen.shape[-1]), nll_labels.reshape(-1))
        chosen_logps = ORPOTrainer.get_batch_logps(chosen, labels[:pairs], average_log_prob=True)
        rejected_logps = ORPOTrainer.get_batch_logps(rejected, labels[self.pairs : self.pairs + pairs], True)
        losses, _, _, log_odds_ratio, log_odds_chosen = self.odds_ratio_loss(chosen_logps, rejected_logps)
        loss = nll - losses.mean()
        with torch.no_grad():
            attended = target[:, ATTENTION]
            width = int(torch.cat([attended[:pairs], attended[self.pairs : self.pairs + pairs]]).sum(-1).max())
            recorded = [
                torch.tensor(pairs),
                chosen_logps.sum(),
                rejected_logps.sum(),
                (chosen_logps > rejected_logps).sum(),
                loss * pairs,
                torch.tensor(1),
                nll,
                log_odds_ratio,
                log_odds_chosen,
                chosen[:, : width - 1].mean(),
                rejected[:, : width - 1].mean(),
            ]
            self.records.append(torch.stack([value.to(torch.float64).to(logits.device) for value in recorded]))
        return loss / self.divisor

    def gathered(self, layout: PipelineLayout, prefix: str = "") -> list[tuple[int, float, dict[str, float]]]:
        """Every rank, after a step or an eval batch: for each micro-batch that held pairs in any pipeline, its
        pairs, its loss summed over them, and TRL's metrics over every pipeline's pairs (`prefix`ed)."""
        if layout.last:
            stats = torch.stack(self.records[-self.microbatches :])
        else:
            stats = torch.zeros(self.microbatches, len(STATS), dtype=torch.float64, device=self.device)
        dist.all_reduce(stats)  # the last stages' records (each tensor-parallel rank of one holds the same)
        stats = (stats / layout.tensor).tolist()
        gathered = []
        for row in stats:
            value = dict(zip(STATS, row, strict=True))
            pairs, pipelines = value["pairs"], value["pipelines"]
            if pairs == 0:
                continue
            chosen, rejected = value["chosen_logps"] / pairs, value["rejected_logps"] / pairs
            metrics = {
                "rewards/chosen": self.beta * chosen,
                "rewards/rejected": self.beta * rejected,
                "rewards/accuracies": value["accurate"] / pairs,
                "rewards/margins": self.beta * (chosen - rejected),
                "logps/rejected": rejected,
                "logps/chosen": chosen,
                "logits/rejected": value["logits_rejected"] / pipelines,
                "logits/chosen": value["logits_chosen"] / pipelines,
                "nll_loss": value["nll_loss"] / pipelines,
                "log_odds_ratio": value["log_odds_ratio"] / pipelines,
                "log_odds_chosen": value["log_odds_chosen"] / pipelines,
            }
            gathered.append((round(pairs), value["loss"], {prefix + key: v for key, v in metrics.items()}))
        return gathered


def preference_pipeline_trainer(base: type, stage: str, section: TrainingStage) -> type:
    """`base` (TRL's ORPOTrainer) training the stage's model as a pipeline (`stages.pipeline_parallel`), its loss and
    metrics `OddsRatioLoss`'s; `base` itself where the run has one stage."""
    pipelined = pipeline_trainer(base, stage, section)
    if pipelined is base:
        return base
    training = section.training
    pairs, microbatches = training.per_device_batch_size, training.gradient_accumulation_steps

    class PreferencePipelineTrainer(pipelined):  # type: ignore[misc, valid-type]
        """The pipeline's Trainer with ORPO's paired micro-batches, loss and metrics."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.objective = OddsRatioLoss(self.odds_ratio_loss, self.beta, pairs, microbatches)
            self.pipeline.objective = self.objective

        def fixed_shape_collator(self, data_collator: Any, pad_token_id: int) -> Any:
            return PairedRows(pairs, microbatches, training.max_seq_length, pad_token_id)

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
            self.pipeline.part.train()
            inputs = self._prepare_inputs(inputs)
            self.objective.begin(inputs["labels"], train=True)
            loss = self.pipeline.run(inputs, train=True)
            self.pipeline.sum_tied_gradients()
            for _, _, metrics in self.objective.gathered(self.pipeline.layout):
                self.store_metrics(metrics, train_eval="train")  # averaged into the next logged step, as TRL does
            return loss

        def evaluate(
            self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
        ) -> dict[str, float]:
            """The held-out pairs' loss (the mean over pairs, as the Trainer's over a process's batches) and TRL's
            metrics (the mean over micro-batches, as TRL's over batches)."""
            began = time.time()
            loader = self.get_eval_dataloader(eval_dataset)
            self.pipeline.part.eval()
            # Every pipeline runs as many batches as the longest one (FSDP2 gathers a stage's weights with its
            # replicas in every forward); a pipeline out of pairs runs one without any.
            batches, count = iter(loader), torch.tensor(len(loader), device=self.args.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            empty = self.data_collator([])
            total, held = 0.0, 0
            with torch.no_grad():
                for _ in range(int(count.item())):
                    batch = self._prepare_inputs(next(batches, empty))
                    self.objective.begin(batch["labels"], train=False)
                    self.pipeline.run(batch, train=False)
                    for pairs, loss, metrics in self.objective.gathered(self.pipeline.layout, f"{metric_key_prefix}_"):
                        total, held = total + loss, held + pairs
                        self.store_metrics(metrics, train_eval="eval")
            self.pipeline.part.train()
            metrics = {
                f"{metric_key_prefix}_loss": total / max(held, 1),
                f"{metric_key_prefix}_runtime": round(time.time() - began, 4),
            }
            self.log(metrics)  # ORPOTrainer.log adds the stored metrics' means to it
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    PreferencePipelineTrainer.__name__ = PreferencePipelineTrainer.__qualname__ = f"Pipeline{base.__name__}"
    return PreferencePipelineTrainer
