"""Preference optimisation over pipeline stages: rlhf's ORPO and DPO trained by torch's pipeline schedule, their
micro-batches holding each pair's chosen and rejected rows.

TRL's ORPOTrainer and DPOTrainer run the policy once over a batch's chosen rows followed by its rejected rows and
take their losses from the logits. Under pipeline stages (`distributed.pipeline_parallel`, `stages.pipeline_parallel`)
the last stage alone holds the logits, one micro-batch at a time, so the loss is computed there, micro-batch by
micro-batch:

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
  `mean_token_accuracy`), summed over the pipelines once a step as TRL gathers them over processes, for the
  trainer's own log.
- DPO's reference is the starting model, its log-probabilities computed once before training through the same
  schedule, forward only (`precompute_ref_log_probs: true`, TRL's default; with LoRA the adapter switched as TRL
  switches it: to its frozen copy `ref`, or off), each pipeline its share of the rows, gathered into every rank's
  rows as TRL's `ref_chosen_logps` and `ref_rejected_logps` columns.

ORPO's logits metrics are means over the batch's width as TRL pads it; the positions past a row's end are attended
as the stages attend them (no padding mask: each row's own tokens are unchanged, the padding's logits differ).
"""

from __future__ import annotations

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

    def empty(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's token ids (all padding) and its target (no labels, nothing attended)."""
        rows = 2 * self.pairs * self.microbatches
        target = torch.full((rows, 3, self.width), IGNORE_INDEX, dtype=dtype)
        target[:, ATTENTION] = 0
        return torch.full((rows, self.width), self.pad_token_id), target

    def row(self, index: int, half: str) -> int:
        """The batch row of the `index`th pair's chosen or rejected half."""
        microbatch, pair = divmod(index, self.pairs)
        return 2 * self.pairs * microbatch + (self.pairs if half == "rejected" else 0) + pair

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


class PairLoss:
    """A preference loss on the last stage, micro-batch by micro-batch, and its metrics: `record` keeps one row of
    `stats` per call (a step's micro-batches are the last `microbatches` ones: torch's schedule also calls the loss
    once to infer the gradients' shapes, on its first step and on each return from evaluation)."""

    stats: tuple[str, ...] = ()

    def __init__(self, beta: float, pairs: int, microbatches: int) -> None:
        self.beta, self.pairs, self.microbatches = beta, pairs, microbatches
        self.records: list[torch.Tensor] = []
        self.divisor = 1
        self.device = torch.device("cpu")

    def begin(self, target: torch.Tensor, train: bool) -> None:
        """Before a step (or an eval batch) over `target`, the batch's: the loss's divisor in training, the
        micro-batches that hold pairs (as the Trainer divides by the accumulation steps of a short last step)."""
        labels = target[:, LABELS].reshape(self.microbatches, 2 * self.pairs, -1)[:, : self.pairs]
        held = int((labels != IGNORE_INDEX).any(-1).any(-1).sum())
        self.divisor = max(1, held) if train else 1
        self.records, self.device = [], target.device

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
        """Every rank, after a step or an eval batch: for each micro-batch that held pairs in any pipeline, its
        pairs, its loss summed over them, and TRL's metrics over every pipeline's pairs (`prefix`ed)."""
        if layout.last:
            stats = torch.stack(self.records[-self.microbatches :])
        else:
            stats = torch.zeros(self.microbatches, len(self.stats), dtype=torch.float64, device=self.device)
        dist.all_reduce(stats)  # the last stages' records (each tensor-parallel rank of one holds the same)
        gathered = []
        for row in (stats / layout.tensor).tolist():
            value = dict(zip(self.stats, row, strict=True))
            if value["pairs"] == 0:
                continue
            metrics = {prefix + key: v for key, v in self.metrics(value).items()}
            gathered.append((round(value["pairs"]), value["loss"], metrics))
        return gathered

    def metrics(self, value: dict[str, float]) -> dict[str, float]:
        """TRL's metrics of a micro-batch from its `stats` summed over the pipelines."""
        raise NotImplementedError


class OddsRatioLoss(PairLoss):
    """ORPO's loss of each micro-batch on the last stage, and its metrics (see the module docstring).
    `odds_ratio_loss`: the trainer's own (`ORPOTrainer.odds_ratio_loss`, weighted by its beta)."""

    stats = (
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
    """Sums over a micro-batch's pairs (the pairs, their log-probabilities, the pairs the policy prefers rightly, the
    loss times the pairs) and, once per pipeline, TRL's means over a process's micro-batch."""

    def __init__(self, odds_ratio_loss: Any, beta: float, pairs: int, microbatches: int) -> None:
        super().__init__(beta, pairs, microbatches)
        self.odds_ratio_loss = odds_ratio_loss

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from trl.experimental.orpo import ORPOTrainer

        pairs = self.held(target)
        if pairs == 0:
            self.record(None)
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
            self.record(
                [
                    pairs,
                    chosen_logps.sum(),
                    rejected_logps.sum(),
                    (chosen_logps > rejected_logps).sum(),
                    loss * pairs,
                    1,
                    nll,
                    log_odds_ratio,
                    log_odds_chosen,
                    chosen[:, : width - 1].mean(),
                    rejected[:, : width - 1].mean(),
                ]
            )
        return loss / self.divisor

    def metrics(self, value: dict[str, float]) -> dict[str, float]:
        pairs, pipelines = value["pairs"], value["pipelines"]
        chosen, rejected = value["chosen_logps"] / pairs, value["rejected_logps"] / pairs
        return {
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

    def __init__(self, beta: float, pairs: int, microbatches: int) -> None:
        super().__init__(beta, pairs, microbatches)
        self.reference = False
        self.logps: list[torch.Tensor] = []
        """In a reference pass, each call's (pairs x 2) chosen and rejected log-probabilities, zero-padded."""

    def begin(self, target: torch.Tensor, train: bool) -> None:
        super().begin(target, train)
        self.logps = []

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from trl.trainer.utils import selective_log_softmax

        pairs = self.held(target)
        if pairs == 0:
            self.record(None)
            self.logps.append(torch.zeros(self.pairs, 2, dtype=torch.float64, device=logits.device))
            return logits.sum() * 0  # rows without labels: no loss, and the backward still runs through the stages
        rows = torch.cat([torch.arange(pairs), torch.arange(self.pairs, self.pairs + pairs)]).to(logits.device)
        logits = logits.float()[rows, :-1]  # as the Trainer's forward returns them under mixed precision; shifted
        labels = target[rows, LABELS, 1:].long()
        completion = labels != IGNORE_INDEX
        per_token = selective_log_softmax(logits, labels.clamp(min=0)) * completion
        logps = per_token.sum(-1)  # each row's log-probability of its completion (DPOTrainer._compute_loss)
        chosen_logps, rejected_logps = logps[:pairs], logps[pairs:]
        if self.reference:
            both = torch.zeros(self.pairs, 2, dtype=torch.float64, device=logits.device)
            both[:pairs] = torch.stack([chosen_logps, rejected_logps], dim=1).detach().double()
            self.logps.append(both)
            return logits.sum() * 0
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

    def reference_logps(self, layout: PipelineLayout) -> torch.Tensor:
        """Every rank, after a reference pass over one batch per pipeline: each pipeline's rows' (chosen, rejected)
        log-probabilities, (pipelines x pairs a step x 2), summed over the world from the last stages."""
        rows = self.pairs * self.microbatches
        every = torch.zeros(layout.pipelines, rows, 2, dtype=torch.float64, device=self.device)
        if layout.last and layout.tensor_rank == 0:
            every[layout.pipeline] = torch.cat(self.logps[-self.microbatches :])
        dist.all_reduce(every)
        return every


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's next-token distribution."""
    log_probs = logits.log_softmax(-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def preference_pipeline_trainer(base: type, stage: str, section: TrainingStage) -> type:
    """`base` (TRL's ORPOTrainer or DPOTrainer) training the stage's model as a pipeline (`stages.pipeline_parallel`),
    its loss and metrics `OddsRatioLoss`'s or `SigmoidLoss`'s; `base` itself where the run has one stage."""
    pipelined = pipeline_trainer(base, stage, section)
    if pipelined is base:
        return base
    training = section.training
    pairs, microbatches = training.per_device_batch_size, training.gradient_accumulation_steps
    dpo = base.__name__ == "DPOTrainer"

    class PreferencePipelineTrainer(pipelined):  # type: ignore[misc, valid-type]
        """The pipeline's Trainer with paired micro-batches, the algorithm's loss on the last stage, and its
        metrics."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if dpo:
                refuse_unsupported_dpo(stage, kwargs["args"])
            with ExitStack() as patched:
                if dpo:
                    patched.enter_context(_no_policy_hash())
                    if hasattr(kwargs["model"], "peft_config"):
                        patched.enter_context(_reference_adapter_made_before_the_cut(kwargs["model"]))
                super().__init__(*args, **kwargs)
            self.preference_loss()

        def preference_loss(self) -> PairLoss:
            """The algorithm's loss (made once: DPO's reference pass, inside TRL's __init__, asks for it first)."""
            if getattr(self, "_preference_loss", None) is None:
                if dpo:
                    self._preference_loss: PairLoss = SigmoidLoss(self.beta, pairs, microbatches)
                else:
                    self._preference_loss = OddsRatioLoss(self.odds_ratio_loss, self.beta, pairs, microbatches)
                self.pipeline.objective = self._preference_loss
            return self._preference_loss

        def fixed_shape_collator(self, data_collator: Any, pad_token_id: int) -> Any:
            layout = ReferencedPairs if dpo else PairedRows
            return layout(pairs, microbatches, training.max_seq_length, pad_token_id)

        def store(self, metrics: dict[str, float], mode: str) -> None:
            """Keep a micro-batch's metrics where the trainer's `log` averages them."""
            if dpo:
                for key, value in metrics.items():
                    self._metrics[mode][key].append(value)
            else:
                self.store_metrics(metrics, train_eval=mode)

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
            self.pipeline.part.train()
            inputs = self._prepare_inputs(inputs)
            loss_function = self.preference_loss()
            loss_function.begin(inputs["labels"], train=True)
            loss = self.pipeline.run(inputs, train=True)
            self.pipeline.sum_tied_gradients()
            for _, _, metrics in loss_function.gathered(self.pipeline.layout):
                self.store(metrics, "train")  # averaged into the next logged step, as TRL does
            if dpo:
                attended = torch.tensor(int(inputs["labels"][:, ATTENTION].sum()), device=self.args.device)
                dist.all_reduce(attended, group=self.pipeline.layout.replica_group)
                self._total_train_tokens += int(attended.item())
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return loss

        def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
            """DPO's reference log-probabilities of every row of `dataset`, through the stages, forward only, with
            the starting weights (LoRA: the adapter switched as TRL switches it), added as TRL's columns. Each
            pipeline runs every `pipelines`th batch (all as many, the last ones without pairs where rows run out)."""
            from trl.trainer.utils import use_adapter

            layout, loss_function = self.pipeline.layout, self.preference_loss()
            per_batch = pairs * microbatches
            batches = -(-len(dataset) // per_batch)
            rounds = -(-batches // layout.pipelines)
            found = torch.zeros(rounds * layout.pipelines * per_batch, 2, dtype=torch.float64)
            model = self.model
            adapter = nullcontext()
            if self.pipeline.adapter:
                adapter = use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)
            self.pipeline.part.eval()
            loss_function.reference = True
            try:
                with torch.no_grad(), adapter:
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
            finally:
                loss_function.reference = False
                self.pipeline.part.train()
            found = found[: len(dataset)]
            if dist.get_rank() == 0:
                print(f"[{stage}] reference log-probabilities of {len(dataset)} {name} pairs, through the stages")
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
            loss_function, prefix = self.preference_loss(), "" if dpo else f"{metric_key_prefix}_"
            total, held = 0.0, 0
            with torch.no_grad():
                for batch in self.evaluation_batches(eval_dataset, self.data_collator([])):  # no pairs past the end
                    loss_function.begin(batch["labels"], train=False)
                    self.pipeline.run(batch, train=False)
                    for pairs_held, loss, metrics in loss_function.gathered(self.pipeline.layout, prefix):
                        total, held = total + loss, held + pairs_held
                        self.store(metrics, "eval")
            if dpo:
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
def _reference_adapter_made_before_the_cut(model: Any) -> Iterator[None]:
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


def _no_policy_hash() -> Any:
    """While DPOTrainer is made over pipeline stages: TRL hashes the whole policy to name its cache of precomputed
    reference log-probabilities (`hash_module`, reading every weight with .numpy(), which FSDP2's sharded weights
    refuse); the stages compute them without that cache (`_precompute_ref_logps`), so no hash is taken."""
    from unittest import mock

    return mock.patch("trl.trainer.dpo_trainer.hash_module", lambda module: "")
