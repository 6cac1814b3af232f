"""Preference optimisation over pipeline stages: rlhf's ORPO, DPO and KTO trained by torch's pipeline schedule,
their micro-batches holding each pair's chosen and rejected rows (KTO: each completion and its mismatched one).

TRL's ORPOTrainer and DPOTrainer run the policy once over a batch's chosen rows followed by its rejected rows and
take their losses from the logits (KTOTrainer over its completions, and once more, without gradients, over the
mismatched completions its KL term is estimated from). Under pipeline stages (`distributed.pipeline_parallel`,
`stages.pipeline_parallel`) the last stage alone holds the logits, one micro-batch at a time, so the loss is
computed there, micro-batch by micro-batch:

- `PairedRows` (ORPO) and `ReferencedPairs` (DPO) lay TRL's tokenized pairs out as the schedule's batch: micro-batch
  k holds the chosen rows of its `per_device_batch_size` pairs, then their rejected rows, each padded to
  `max_seq_length` (pairs a short batch lacks are rows without labels). What the last stage needs travels as the
  schedule's target: the completion's labels, the attention mask, and ORPO's NLL labels (the chosen rows' tokens:
  its NLL counts the prompt) or DPO's reference log-probability of each row.
- `OddsRatioLoss` is each micro-batch's ORPO loss, with TRL's own `get_batch_logps` and `odds_ratio_loss`: the NLL
  over its chosen rows' tokens minus the mean of its pairs' weighted log-sigmoid odds ratios. `SigmoidLoss` is DPO's
  (TRL's default `loss_type: sigmoid`): the mean over its pairs of -log sigmoid(beta x the policy's log-ratio margin
  over the reference's), each row's log-probability summed over its completion. Both are divided by the step's
  micro-batches that hold pairs: what the Trainer computes for one process's accumulation steps (TRL's losses are
  means per micro-batch; the Trainer divides by their count), so one pipeline trains as one process does over the
  same micro-batches, and FSDP2's average over pipelines is DDP's. Each keeps its micro-batches' metrics (TRL's
  `rewards/*`, `logps/*`, `logits/*`, ORPO's `nll_loss` and `log_odds_*`, DPO's `entropy` and
  `mean_token_accuracy`), each pipeline's micro-batch its own entry in the trainer's own log, as one process logs
  its accumulation steps.
- DPO's reference is the starting model, its log-probabilities computed once before training through the same
  schedule, forward only (`precompute_ref_log_probs: true`, the spec's default; with LoRA the adapter switched as
  TRL switches it: to its frozen copy `ref`, or off), each pipeline its share of the rows, gathered into every rank's
  rows as TRL's `ref_chosen_logps` and `ref_rejected_logps` columns. With `precompute_ref_log_probs: false` the
  same pass runs over each step's batch (and each held-out batch) before it, as TRL computes its reference at each
  step (`add_reference`): with LoRA the adapter switched, in full training through each stage's frozen copy of its
  starting weights (`Pipeline`'s `reference`), which TRL takes as its reference model.
- KTO: `UnpairedRows` lays out each micro-batch's completions then their mismatched completions (the KL rows), and
  `UnpairedLoss` takes TRL's KTO loss with the KL term from the micro-batch's KL rows, detached (see the class); the
  reference's log-probabilities of both computed as DPO's (`ref_logps`, `ref_KL_logps`).

ORPO's logits metrics are means over the batch's width as TRL pads it; the positions past a row's end are attended
as the stages attend them (no padding mask: each row's own tokens are unchanged, the padding's logits differ).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from spec.training import TrainingStage
from stages.contract import NotSupportedHere
from stages.packing import IGNORE_INDEX
from stages.pipeline_parallel import PipelineLayout, pipeline_trainer

NLL_LABELS, LABELS, ATTENTION = 0, 1, 2
"""The target's channels: ORPO's NLL labels (DPO: each row's reference log-probability, at position 0), the
completions' labels, the attention mask."""
REFERENCE = NLL_LABELS


class PairedRows:
    """ORPO's tokenized pairs (`ORPOTrainer.tokenize_row`) as one step's batch: `microbatches` micro-batches of
    `pairs` pairs, each the chosen rows then the rejected rows, `width` tokens wide (see the module docstring)."""

    def __init__(self, pairs: int, microbatches: int, width: int, pad_token_id: int) -> None:
        self.pairs, self.microbatches, self.width, self.pad_token_id = pairs, microbatches, width, pad_token_id
        self.span = 2 * pairs
        """The rows of a micro-batch."""

    def empty(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's token ids (all padding) and its target (no labels, nothing attended)."""
        rows = self.span * self.microbatches
        target = torch.full((rows, 3, self.width), IGNORE_INDEX, dtype=dtype)
        target[:, ATTENTION] = 0
        return torch.full((rows, self.width), self.pad_token_id), target

    def row(self, index: int, half: str) -> int:
        """The batch row of the `index`th pair's chosen or rejected half."""
        microbatch, pair = divmod(index, self.pairs)
        return self.span * microbatch + (self.pairs if half in ("rejected", "KL") else 0) + pair

    def batch(self, input_ids: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        position_ids = torch.arange(self.width).repeat(input_ids.shape[0], 1)
        return {"input_ids": input_ids, "labels": target, "position_ids": position_ids}

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids, target = self.empty(torch.long)
        for index, feature in enumerate(features):
            for half in ("chosen", "rejected"):
                row = self.row(index, half)
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
        return self.batch(input_ids, target)


class ReferencedPairs(PairedRows):
    """DPO's tokenized pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`, truncated to the width from the start, as
    TRL's `DataCollatorForPreference` keeps them) laid out as `PairedRows` lays ORPO's, each row's reference
    log-probability (`ref_chosen_logps`, `ref_rejected_logps`, once computed) in the target, which is float64 to hold
    it beside the token ids."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids, target = self.empty(torch.float64)
        for index, feature in enumerate(features):
            prompt = feature["prompt_ids"]
            for half in ("chosen", "rejected"):
                row = self.row(index, half)
                ids = torch.tensor(prompt + feature[f"{half}_ids"])[: self.width]
                completion = torch.tensor([0] * len(prompt) + [1] * len(feature[f"{half}_ids"]))[: self.width]
                length = len(ids)
                input_ids[row, :length] = ids
                target[row, LABELS, :length] = torch.where(completion == 1, ids, IGNORE_INDEX).double()
                target[row, ATTENTION, :length] = 1
                if f"ref_{half}_logps" in feature:
                    target[row, REFERENCE, 0] = feature[f"ref_{half}_logps"]
        return self.batch(input_ids, target)


class UnpairedRows(PairedRows):
    """KTO's tokenized rows (`prompt_ids`, `completion_ids`, `label`, and `KL_completion_ids` where KTO estimates its
    KL term: TRL's `_prepare_dataset`) as one step's batch: micro-batch k holds its `rows` completions, then (with
    `kl`) the same rows' mismatched completions, each prompt followed by another row's completion, truncated to the
    width from the start as TRL's `DataCollatorForUnpairedPreference` truncates. The target carries, at position 0
    of its reference channel, each row's reference log-probability (`ref_logps`, `ref_KL_logps`, once computed) and,
    at position 1 of a completion's row, its label (1: desirable). The mismatched rows attend nothing in the target:
    its attended tokens are the completions' rows', which TRL counts."""

    def __init__(self, rows: int, microbatches: int, width: int, pad_token_id: int, kl: bool) -> None:
        super().__init__(rows, microbatches, width, pad_token_id)
        self.kl = kl
        self.span = rows * (2 if kl else 1)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids, target = self.empty(torch.float64)
        halves = (("completion", ""), ("KL", "KL_")) if self.kl else (("completion", ""),)
        for index, feature in enumerate(features):
            prompt = feature["prompt_ids"]
            for half, prefix in halves:
                row = self.row(index, half)
                answer = feature[f"{prefix}completion_ids"]
                ids = torch.tensor(prompt + answer)[: self.width]
                completion = torch.tensor([0] * len(prompt) + [1] * len(answer))[: self.width]
                length = len(ids)
                input_ids[row, :length] = ids
                target[row, LABELS, :length] = torch.where(completion == 1, ids, IGNORE_INDEX).double()
                if f"ref_{prefix}logps" in feature:
                    target[row, REFERENCE, 0] = feature[f"ref_{prefix}logps"]
                if half == "completion":
                    target[row, ATTENTION, :length] = 1
                    target[row, REFERENCE, 1] = float(feature["label"])
        return self.batch(input_ids, target)


class PairLoss:
    """A preference loss on the last stage, micro-batch by micro-batch, and its metrics: `record` keeps one row of
    `stats` per call (a step's micro-batches are the last `microbatches` ones: torch's schedule also calls the loss
    once to infer the gradients' shapes, on its first step and on each return from evaluation)."""

    stats: tuple[str, ...] = ()

    def __init__(self, beta: float, pairs: int, microbatches: int) -> None:
        self.beta, self.pairs, self.microbatches = beta, pairs, microbatches
        self.span = 2 * pairs
        """The rows of a micro-batch (the layout's `span`)."""
        self.records: list[torch.Tensor] = []
        self.divisor = 1
        self.device = torch.device("cpu")
        self.reference = False
        """A reference pass: each call records its rows' log-probabilities (`logps`) instead of a loss."""
        self.logps: list[torch.Tensor] = []
        """In a reference pass, each call's (pairs x 2) log-probabilities (DPO: chosen and rejected; KTO: the
        completion and its mismatched one), zero-padded."""

    def begin(self, target: torch.Tensor, train: bool) -> None:
        """Before a step (or an eval batch) over `target`, the batch's: the loss's divisor in training, the
        micro-batches that hold pairs (as the Trainer divides by the accumulation steps of a short last step)."""
        labels = target[:, LABELS].reshape(self.microbatches, self.span, -1)[:, : self.pairs]
        held = int((labels != IGNORE_INDEX).any(-1).any(-1).sum())
        self.divisor = max(1, held) if train else 1
        self.records, self.logps, self.device = [], [], target.device

    def nothing_held(self, logits: torch.Tensor) -> torch.Tensor:
        """A micro-batch of rows without labels: nothing recorded (zeros), no loss, and a backward that still runs
        through the stages."""
        self.record(None)
        self.logps.append(torch.zeros(self.pairs, 2, dtype=torch.float64, device=logits.device))
        return logits.sum() * 0

    def record_reference(self, logits: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """A reference pass's micro-batch: its held rows' two log-probabilities (DPO: chosen and rejected; KTO: the
        completion and its mismatched one) kept in `logps`, zero-padded to the micro-batch's pairs; no loss."""
        both = torch.zeros(self.pairs, 2, dtype=torch.float64, device=logits.device)
        both[: len(first)] = torch.stack([first, second], dim=1).detach().double()
        self.logps.append(both)
        return logits.sum() * 0

    def held(self, target: torch.Tensor) -> int:
        """The pairs a micro-batch's `target` holds."""
        return int((target[: self.pairs, LABELS] != IGNORE_INDEX).any(-1).sum())

    def record(self, values: list[Any] | None) -> None:
        """One micro-batch's `stats` (None: it held no pairs)."""
        if values is None:
            self.records.append(torch.zeros(len(self.stats), dtype=torch.float64, device=self.device))
        else:
            self.records.append(torch.stack([torch.as_tensor(v).to(torch.float64).to(self.device) for v in values]))

    def gathered(self, layout: PipelineLayout, prefix: str = "") -> list[tuple[int, float, dict[str, float]]]:
        """Every rank, after a step or an eval batch: for each micro-batch of each pipeline that held pairs, its
        pairs, its loss summed over them, and TRL's metrics of its pairs (`prefix`ed): each its own entry, as one
        process logs each of its accumulation steps (a micro-batch's counts of KTO's desirable and undesirable rows
        differ, so a mean over pipelines would not be the mean of their entries)."""
        stats = torch.zeros(layout.pipelines, self.microbatches, len(self.stats), dtype=torch.float64)
        stats = stats.to(self.device)
        if layout.last:
            stats[layout.pipeline] = torch.stack(self.records[-self.microbatches :])
        dist.all_reduce(stats)  # the last stages' records (each tensor-parallel rank of one holds the same)
        gathered = []
        for row in (stats / layout.tensor).reshape(-1, len(self.stats)).tolist():
            value = dict(zip(self.stats, row, strict=True))
            if value["pairs"] == 0:
                continue
            metrics = {prefix + key: v for key, v in self.metrics(value).items()}
            gathered.append((round(value["pairs"]), value["loss"], metrics))
        return gathered

    def metrics(self, value: dict[str, float]) -> dict[str, float]:
        """TRL's metrics of a micro-batch from its `stats`."""
        raise NotImplementedError

    def reference_logps(self, layout: PipelineLayout) -> torch.Tensor:
        """Every rank, after a reference pass over one batch per pipeline: each pipeline's rows' two
        log-probabilities, (pipelines x pairs a step x 2), summed over the world from the last stages."""
        rows = self.pairs * self.microbatches
        every = torch.zeros(layout.pipelines, rows, 2, dtype=torch.float64, device=self.device)
        if layout.last and layout.tensor_rank == 0:
            every[layout.pipeline] = torch.cat(self.logps[-self.microbatches :])
        dist.all_reduce(every)
        return every


class OddsRatioLoss(PairLoss):
    """ORPO's loss of each micro-batch on the last stage, and its metrics (see the module docstring).
    `odds_ratio_loss`: the trainer's own (`ORPOTrainer.odds_ratio_loss`, weighted by its beta)."""

    stats = (
        "pairs",
        "chosen_logps",
        "rejected_logps",
        "accurate",
        "loss",
        "nll_loss",
        "log_odds_ratio",
        "log_odds_chosen",
        "logits_chosen",
        "logits_rejected",
    )
    """Sums over a micro-batch's pairs (the pairs, their log-probabilities, the pairs the policy prefers rightly, the
    loss times the pairs) and TRL's means over the micro-batch."""

    def __init__(self, odds_ratio_loss: Any, beta: float, pairs: int, microbatches: int) -> None:
        super().__init__(beta, pairs, microbatches)
        self.odds_ratio_loss = odds_ratio_loss

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from trl.experimental.orpo import ORPOTrainer

        pairs = self.held(target)
        if pairs == 0:
            return self.nothing_held(logits)
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
            self.record(
                [
                    pairs,
                    chosen_logps.sum(),
                    rejected_logps.sum(),
                    (chosen_logps > rejected_logps).sum(),
                    loss * pairs,
                    nll,
                    log_odds_ratio,
                    log_odds_chosen,
                    chosen[:, : width - 1].mean(),
                    rejected[:, : width - 1].mean(),
                ]
            )
        return loss / self.divisor

    def metrics(self, value: dict[str, float]) -> dict[str, float]:
        pairs = value["pairs"]
        chosen, rejected = value["chosen_logps"] / pairs, value["rejected_logps"] / pairs
        return {
            "rewards/chosen": self.beta * chosen,
            "rewards/rejected": self.beta * rejected,
            "rewards/accuracies": value["accurate"] / pairs,
            "rewards/margins": self.beta * (chosen - rejected),
            "logps/rejected": rejected,
            "logps/chosen": chosen,
            "logits/rejected": value["logits_rejected"],
            "logits/chosen": value["logits_chosen"],
            "nll_loss": value["nll_loss"],
            "log_odds_ratio": value["log_odds_ratio"],
            "log_odds_chosen": value["log_odds_chosen"],
        }


class SigmoidLoss(PairLoss):
    """DPO's sigmoid loss of each micro-batch on the last stage, and its metrics (see the module docstring); with
    `reference` set, the micro-batch's log-probabilities alone, recorded for the reference columns."""

    stats = (
        "pairs",
        "chosen_rewards",
        "rejected_rewards",
        "accurate",
        "chosen_logps",
        "rejected_logps",
        "loss",
        "entropy",
        "tokens",
        "chosen_logits",
        "chosen_tokens",
        "rejected_logits",
        "rejected_tokens",
        "top1",
        "attended",
    )
    """Sums over a micro-batch's pairs (the pairs, their rewards and log-probabilities, the pairs rewarded rightly, the
    loss times the pairs) and over its completion tokens (entropy, the chosen and rejected ones' mean logits, the chosen
    ones predicted as their most likely token), and the tokens attended."""

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pairs = self.held(target)
        if pairs == 0:
            return self.nothing_held(logits)
        rows = torch.cat([torch.arange(pairs), torch.arange(self.pairs, self.pairs + pairs)]).to(logits.device)
        logits = logits.float()[rows, :-1]  # as the Trainer's forward returns them under mixed precision; shifted
        labels = target[rows, LABELS, 1:].long()
        completion = labels != IGNORE_INDEX
        logps = _completion_logps(logits, labels)  # DPOTrainer._compute_loss's
        chosen_logps, rejected_logps = logps[:pairs], logps[pairs:]
        if self.reference:
            return self.record_reference(logits, chosen_logps, rejected_logps)
        reference = target[rows, REFERENCE, 0].float()
        chosen_ratio = chosen_logps - reference[:pairs]
        rejected_ratio = rejected_logps - reference[pairs:]
        loss = -torch.nn.functional.logsigmoid(self.beta * (chosen_ratio - rejected_ratio)).mean()
        with torch.no_grad():
            chosen_rewards, rejected_rewards = self.beta * chosen_ratio, self.beta * rejected_ratio
            entropy = torch.stack([_entropy(row) for row in logits])  # a row at a time: the logits' size is large
            mean_logits = logits.mean(-1)
            top1 = logits.argmax(-1) == labels
            self.record(
                [
                    pairs,
                    chosen_rewards.sum(),
                    rejected_rewards.sum(),
                    (chosen_rewards > rejected_rewards).sum(),
                    chosen_logps.sum(),
                    rejected_logps.sum(),
                    loss * pairs,
                    (entropy * completion).sum(),
                    completion.sum(),
                    (mean_logits[:pairs] * completion[:pairs]).sum(),
                    completion[:pairs].sum(),
                    (mean_logits[pairs:] * completion[pairs:]).sum(),
                    completion[pairs:].sum(),
                    (top1[:pairs] & completion[:pairs]).sum(),
                    target[rows, ATTENTION].sum(),
                ]
            )
        return loss / self.divisor

    def metrics(self, value: dict[str, float]) -> dict[str, float]:
        pairs = value["pairs"]

        def ratio(part: float, whole: float) -> float:
            return part / whole if whole > 0 else 0.0

        return {
            "entropy": ratio(value["entropy"], value["tokens"]),
            "logits/chosen": ratio(value["chosen_logits"], value["chosen_tokens"]),
            "logits/rejected": ratio(value["rejected_logits"], value["rejected_tokens"]),
            "mean_token_accuracy": ratio(value["top1"], value["chosen_tokens"]),
            "rewards/chosen": value["chosen_rewards"] / pairs,
            "rewards/rejected": value["rejected_rewards"] / pairs,
            "rewards/accuracies": value["accurate"] / pairs,
            "rewards/margins": (value["chosen_rewards"] - value["rejected_rewards"]) / pairs,
            "logps/chosen": value["chosen_logps"] / pairs,
            "logps/rejected": value["rejected_logps"] / pairs,
        }


class UnpairedLoss(PairLoss):
    """KTO's loss of each micro-batch on the last stage (TRL's `loss_type` kto or apo_zero_unpaired), and its metrics;
    with `reference` set, the micro-batch's log-probabilities alone, recorded for the reference columns. `pairs` are
    here the micro-batch's completions (`UnpairedRows`).

    KTO's KL term is the mean over the micro-batch of the policy's log-ratio on the mismatched completions, clamped
    at 0 and held constant (TRL computes it under no_grad): here those rows run through the stages beside the
    completions and their log-probabilities are detached, so they add nothing to the gradient (their backward is
    work TRL's separate forward does not do)."""

    stats = (
        "pairs",
        "loss",
        "kl",
        "entropy",
        "tokens",
        "chosen",
        "rejected",
        "chosen_rewards",
        "rejected_rewards",
        "chosen_logps",
        "rejected_logps",
        "chosen_logits",
        "chosen_tokens",
        "rejected_logits",
        "rejected_tokens",
    )
    """Sums over a micro-batch's completions (their count, the desirable and undesirable ones, their rewards and
    log-probabilities, the loss times the completions) and over their completion tokens (entropy, the desirable and
    undesirable ones' mean logits), and TRL's KL estimate of the micro-batch."""

    def __init__(self, trainer: Any, rows: int, microbatches: int) -> None:
        super().__init__(trainer.beta, rows, microbatches)
        self.loss_type, self.kl = trainer.loss_type, bool(trainer.calculate_KL)
        self.desirable_weight, self.undesirable_weight = trainer.desirable_weight, trainer.undesirable_weight
        self.span = rows * (2 if self.kl else 1)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        held = self.held(target)
        if held == 0:
            return self.nothing_held(logits)

        def summed_logps(rows: slice) -> torch.Tensor:
            # the logits as the Trainer's forward returns them under mixed precision, shifted
            return _completion_logps(logits[rows, :-1].float(), target[rows, LABELS, 1:].long())

        completion_logps = summed_logps(slice(0, held))
        kl_logps = torch.zeros_like(completion_logps)  # without the KL rows, their reference column stays 0
        if self.kl:
            with torch.no_grad():  # held constant, as TRL's separate forward under no_grad
                kl_logps = summed_logps(slice(self.pairs, self.pairs + held))
        if self.reference:
            return self.record_reference(logits, completion_logps, kl_logps)
        reference = target[:, REFERENCE, 0].float()
        desirable = target[:held, REFERENCE, 1] > 0.5
        kl = torch.zeros((), device=logits.device)
        if self.kl:  # KTOTrainer._compute_loss: its one process's micro-batch, gathered over no others
            kl = (kl_logps - reference[self.pairs : self.pairs + held]).mean().clamp(min=0)
        ratios = completion_logps - reference[:held]
        chosen, rejected = ratios[desirable], ratios[~desirable]
        if self.loss_type == "kto":  # Eqn (7) of the KTO paper, as TRL computes it
            chosen_losses = 1 - torch.sigmoid(self.beta * (chosen - kl))
            rejected_losses = 1 - torch.sigmoid(self.beta * (kl - rejected))
        else:  # apo_zero_unpaired
            chosen_losses = 1 - torch.sigmoid(self.beta * chosen)
            rejected_losses = torch.sigmoid(self.beta * rejected)
        losses = torch.cat([self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses])
        loss = losses.nanmean()
        with torch.no_grad():
            ids = target[:held, LABELS, 1:] != IGNORE_INDEX
            shifted = logits[:held, :-1].float()
            entropy = torch.stack([_entropy(row) for row in shifted])  # a row at a time: the logits are large
            mean_logits = shifted.mean(-1)
            self.record(
                [
                    held,
                    loss * held,
                    kl,
                    (entropy * ids).sum(),
                    ids.sum(),
                    desirable.sum(),
                    (~desirable).sum(),
                    self.beta * chosen.sum(),
                    self.beta * rejected.sum(),
                    completion_logps[desirable].sum(),
                    completion_logps[~desirable].sum(),
                    (mean_logits[desirable] * ids[desirable]).sum(),
                    ids[desirable].sum(),
                    (mean_logits[~desirable] * ids[~desirable]).sum(),
                    ids[~desirable].sum(),
                ]
            )
        return loss / self.divisor

    def metrics(self, value: dict[str, float]) -> dict[str, float]:
        chosen, rejected = value["chosen"], value["rejected"]
        metrics = {"kl": value["kl"]}
        metrics["entropy"] = value["entropy"] / value["tokens"] if value["tokens"] > 0 else 0.0
        if value["chosen_tokens"] > 0:
            metrics["logits/chosen"] = value["chosen_logits"] / value["chosen_tokens"]
        if value["rejected_tokens"] > 0:
            metrics["logits/rejected"] = value["rejected_logits"] / value["rejected_tokens"]
        if chosen > 0:
            metrics["rewards/chosen"] = value["chosen_rewards"] / chosen
            metrics["logps/chosen"] = value["chosen_logps"] / chosen
        if rejected > 0:
            metrics["rewards/rejected"] = value["rejected_rewards"] / rejected
            metrics["logps/rejected"] = value["rejected_logps"] / rejected
        if chosen > 0 and rejected > 0:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics


def _completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its completion: the shifted `labels`' log-probabilities under `logits`, summed
    over the tokens that are not ignored."""
    from trl.trainer.utils import selective_log_softmax

    return (selective_log_softmax(logits, labels.clamp(min=0)) * (labels != IGNORE_INDEX)).sum(-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's next-token distribution."""
    log_probs = logits.log_softmax(-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def preference_pipeline_trainer(base: type, stage: str, section: TrainingStage) -> type:
    """`base` (TRL's ORPOTrainer, DPOTrainer or KTOTrainer) training the stage's model as a pipeline
    (`stages.pipeline_parallel`), its loss and metrics `OddsRatioLoss`'s, `SigmoidLoss`'s or `UnpairedLoss`'s; `base`
    itself where the run has one stage."""
    pipelined = pipeline_trainer(base, stage, section)
    if pipelined is base:
        return base
    training = section.training
    pairs, microbatches = training.per_device_batch_size, training.gradient_accumulation_steps
    kto = base.__name__ == "KTOTrainer"
    dpo = base.__name__ == "DPOTrainer"
    referenced = dpo or kto  # a reference model, its log-probabilities precomputed; TRL's `_metrics`

    class PreferencePipelineTrainer(pipelined):  # type: ignore[misc, valid-type]
        """The pipeline's Trainer with paired micro-batches, the algorithm's loss on the last stage, and its
        metrics."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if dpo:
                refuse_unsupported_dpo(stage, kwargs["args"])
            # KTO's default loss estimates its KL term from mismatched rows; its other (apo_zero_unpaired) does not
            self.mismatched_rows = kto and kwargs["args"].loss_type == "kto"
            with ExitStack() as patched:
                if referenced:
                    patched.enter_context(_no_policy_hash("kto_trainer" if kto else "dpo_trainer"))
                    if hasattr(kwargs["model"], "peft_config"):
                        patched.enter_context(reference_adapter_made_before_the_cut(kwargs["model"]))
                super().__init__(*args, **kwargs)
            self.preference_loss()

        def preference_loss(self) -> PairLoss:
            """The algorithm's loss (made once: DPO's reference pass, inside TRL's __init__, asks for it first)."""
            if getattr(self, "_preference_loss", None) is None:
                if kto:
                    self._preference_loss: PairLoss = UnpairedLoss(self, pairs, microbatches)
                elif dpo:
                    self._preference_loss = SigmoidLoss(self.beta, pairs, microbatches)
                else:
                    self._preference_loss = OddsRatioLoss(self.odds_ratio_loss, self.beta, pairs, microbatches)
                self.pipeline.objective = self._preference_loss
            return self._preference_loss

        def keeps_reference(self, model: Any, args: Any) -> bool:
            # full training's reference at each step: each stage's frozen copy of its starting weights
            return referenced and not args.precompute_ref_log_probs and not hasattr(model, "peft_config")

        def fixed_shape_collator(self, data_collator: Any, pad_token_id: int) -> Any:
            width = training.max_seq_length
            if kto:
                return UnpairedRows(pairs, microbatches, width, pad_token_id, self.mismatched_rows)
            return (ReferencedPairs if dpo else PairedRows)(pairs, microbatches, width, pad_token_id)

        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
            """KTO: each row's mismatched completion is its neighbour's within a micro-batch (TRL rotates the
            completions within each `per_device_train_batch_size` rows, here a step's every micro-batch)."""
            if kto:
                args = copy.copy(args)
                args.per_device_train_batch_size = pairs
            return super()._prepare_dataset(dataset, processing_class, args, *rest, **kwargs)

        def store(self, metrics: dict[str, float], mode: str) -> None:
            """Keep a micro-batch's metrics where the trainer's `log` averages them."""
            if referenced:
                for key, value in metrics.items():
                    self._metrics[mode][key].append(value)
            else:
                self.store_metrics(metrics, train_eval=mode)

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
            self.pipeline.part.train()
            inputs = self._prepare_inputs(inputs)
            if referenced and not self.precompute_ref_logps:
                self.add_reference(inputs)
            loss_function = self.preference_loss()
            loss_function.begin(inputs["labels"], train=True)
            loss = self.pipeline.run(inputs, train=True)
            self.pipeline.sum_tied_gradients()
            for _, _, metrics in loss_function.gathered(self.pipeline.layout):
                self.store(metrics, "train")  # averaged into the next logged step, as TRL does
            if referenced:  # the completions' tokens (KTO's mismatched rows attend nothing in the target)
                attended = torch.tensor(int(inputs["labels"][:, ATTENTION].sum()), device=self.args.device)
                dist.all_reduce(attended, group=self.pipeline.layout.replica_group)
                self._total_train_tokens += int(attended.item())
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return loss

        @contextmanager
        def reference_pass(self) -> Iterator[PairLoss]:
            """Forward passes through the stages with the reference's weights (LoRA: the adapter switched as TRL
            switches it: to its frozen copy `ref`, or off), the loss recording log-probabilities."""
            from trl.trainer.utils import use_adapter

            loss_function, model = self.preference_loss(), self.model
            adapter = nullcontext()
            if self.pipeline.adapter:
                adapter = use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)
            training = self.pipeline.part.training
            self.pipeline.part.eval()
            loss_function.reference = True
            try:
                with torch.no_grad(), adapter:
                    yield loss_function
            finally:
                loss_function.reference = False
                self.pipeline.part.train(training)

        def add_reference(self, batch: dict[str, torch.Tensor]) -> None:
            """`precompute_ref_log_probs: false`: the batch's reference log-probabilities through the stages now (LoRA:
            the policy's, its adapter switched; full training: the stages' frozen copies of their starting weights),
            as TRL computes them at each step, into its target."""
            layout = self.pipeline.layout
            with self.reference_pass() as loss_function:
                loss_function.begin(batch["labels"], train=False)
                self.pipeline.run(batch, train=False, reference=self.pipeline.reference_part is not None)
                found = loss_function.reference_logps(layout)[layout.pipeline]  # (pairs a step x 2)
            if kto:
                halves = ("completion", "KL") if self.mismatched_rows else ("completion",)
            else:
                halves = ("chosen", "rejected")
            for column, half in enumerate(halves):
                rows = [self.data_collator.row(index, half) for index in range(len(found))]
                batch["labels"][rows, REFERENCE, 0] = found[:, column].to(batch["labels"].dtype)

        def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
            """DPO's (KTO's) reference log-probabilities of every row of `dataset`, through the stages, forward only,
            with the starting weights, added as TRL's columns. Each pipeline runs every `pipelines`th batch (all as
            many, the last ones without pairs where rows run out)."""
            layout = self.pipeline.layout
            per_batch = pairs * microbatches
            batches = -(-len(dataset) // per_batch)
            rounds = -(-batches // layout.pipelines)
            found = torch.zeros(rounds * layout.pipelines * per_batch, 2, dtype=torch.float64)
            with self.reference_pass() as loss_function:
                for turn in range(rounds):
                    index = turn * layout.pipelines + layout.pipeline
                    rows = range(index * per_batch, min((index + 1) * per_batch, len(dataset)))
                    batch = self._prepare_inputs(self.data_collator([dataset[row] for row in rows]))
                    loss_function.begin(batch["labels"], train=False)
                    self.pipeline.run(batch, train=False)
                    start = turn * layout.pipelines * per_batch
                    found[start : start + layout.pipelines * per_batch] = (
                        loss_function.reference_logps(layout).reshape(-1, 2).cpu()
                    )
            found = found[: len(dataset)]
            if dist.get_rank() == 0:
                rows = "rows" if kto else "pairs"
                print(f"[{stage}] reference log-probabilities of {len(dataset)} {name} {rows}, through the stages")
            if kto:
                dataset = dataset.add_column("ref_logps", found[:, 0].tolist())
                return dataset.add_column("ref_KL_logps", found[:, 1].tolist()) if self.mismatched_rows else dataset
            dataset = dataset.add_column("ref_chosen_logps", found[:, 0].tolist())
            return dataset.add_column("ref_rejected_logps", found[:, 1].tolist())

        def evaluate(
            self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
        ) -> dict[str, float]:
            """The held-out pairs' loss (the mean over pairs, as the Trainer's over a process's batches) and TRL's
            metrics (the mean over micro-batches, as TRL's over batches)."""
            began = time.time()
            self.model.eval()  # DPOTrainer.log reads the mode from it
            self.pipeline.part.eval()
            loss_function, prefix = self.preference_loss(), "" if referenced else f"{metric_key_prefix}_"
            total, held = 0.0, 0
            with torch.no_grad():
                for batch in self.evaluation_batches(eval_dataset, self.data_collator([])):  # no pairs past the end
                    if referenced and not self.precompute_ref_logps:
                        self.add_reference(batch)
                    loss_function.begin(batch["labels"], train=False)
                    self.pipeline.run(batch, train=False)
                    for pairs_held, loss, metrics in loss_function.gathered(self.pipeline.layout, prefix):
                        total, held = total + loss, held + pairs_held
                        self.store(metrics, "eval")
            if referenced:
                self._metrics["eval"]["num_tokens"] = [self._total_train_tokens]
            metrics = {
                f"{metric_key_prefix}_loss": total / max(held, 1),
                f"{metric_key_prefix}_runtime": round(time.time() - began, 4),
            }
            self.log(metrics)  # the trainer's log adds the stored metrics' means to it
            self.model.train()
            self.pipeline.part.train()
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    PreferencePipelineTrainer.__name__ = PreferencePipelineTrainer.__qualname__ = f"Pipeline{base.__name__}"
    return PreferencePipelineTrainer


def refuse_unsupported_dpo(stage: str, args: Any) -> None:
    """Refuse (NotSupportedHere, naming the field) DPO settings the stages do not compute: a loss other than TRL's
    default sigmoid one, length-desensitised or weighted log-probabilities, another f-divergence, truncation from the
    end."""
    unsupported = {
        "loss_type": list(args.loss_type) != ["sigmoid"],
        "ld_alpha": args.ld_alpha is not None,
        "use_weighting": bool(args.use_weighting),
        "f_divergence_type": args.f_divergence_type != "reverse_kl",
        "truncation_mode": args.truncation_mode != "keep_start",
    }
    if chosen := [name for name, differs in unsupported.items() if differs]:
        raise NotSupportedHere(
            f"stages.{stage}.training.extra_args: {', '.join(chosen)} under distributed.pipeline_parallel: the stages "
            "compute DPO's sigmoid loss (TRL's default) on the last stage; remove them, or set pipeline_parallel to 1"
        )


@contextmanager
def reference_adapter_made_before_the_cut(model: Any) -> Iterator[None]:
    """While DPOTrainer is made over pipeline stages with LoRA: its frozen copy of the starting adapter (`ref`, the
    reference) is made here, on the whole model before the cut, so that the stages receive it and FSDP2 shards it with
    the adapter; TRL's own copy, made after the cut, would copy FSDP2's sharded weights into plain ones (refused).
    TRL's `add_adapter("ref")` then finds it made, and its copy of the adapter's weights into it copies equals."""
    from unittest import mock

    model.add_adapter("ref", model.peft_config["default"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".default." in name and param.device.type != "meta":  # the others receive rank 0's at the cut
                model.get_parameter(name.replace(".default.", ".ref.")).copy_(param)
    add_adapter = model.add_adapter

    def add_unless_made(adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        return None if adapter_name == "ref" else add_adapter(adapter_name, *args, **kwargs)

    with mock.patch.object(model, "add_adapter", add_unless_made):
        yield


def _no_policy_hash(module: str) -> Any:
    """While DPOTrainer or KTOTrainer (TRL's `module`) is made over pipeline stages: TRL hashes the whole policy to
    name its cache of precomputed reference log-probabilities (`hash_module`, reading every weight with .numpy(),
    which FSDP2's sharded weights refuse); the stages compute them without that cache (`_precompute_ref_logps`), so
    no hash is taken."""
    from unittest import mock

    return mock.patch(f"trl.trainer.{module}.hash_module", lambda module: "")
