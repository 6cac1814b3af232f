"""Resuming never trains past the plan: `train_to_plan` on a plain transformers Trainer, resumed from the checkpoint
at the planned end (what a stage killed after its last checkpoint, before its record, leaves), trains no step and
keeps the checkpoint's weights, for the plans whose end falls inside an epoch (where the Trainer by itself trains
one step more), with gradient accumulation, full and LoRA; resumed from an earlier checkpoint it trains the rest.

Tiny models from config and a few dozen rows: a few seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments

from stages.training import train_to_plan

ROWS = 40  # batches of 2: 20 batches an epoch


class OptimizerSteps(TrainerCallback):
    """Counts the optimizer steps a Trainer takes."""

    def __init__(self) -> None:
        self.steps = 0

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps += 1


def tiny_model(lora: bool) -> Any:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    return model


def make_trainer(out: Path, plan: dict[str, Any], lora: bool) -> tuple[Trainer, OptimizerSteps]:
    rows = Dataset.from_list([{"input_ids": [i % 60 + 1] * 8, "labels": [i % 60 + 1] * 8} for i in range(ROWS)])
    args = TrainingArguments(
        str(out),
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **plan,
    )
    counter = OptimizerSteps()
    return Trainer(model=tiny_model(lora), args=args, train_dataset=rows, callbacks=[counter]), counter


def trained_weights(model: Any, lora: bool) -> dict[str, torch.Tensor]:
    """The weights a checkpoint of `model` holds (the adapter's, for LoRA), as saved."""
    if lora:
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    return {k: v.detach() for k, v in model.state_dict().items()}


PLANS = {
    # max_steps ends inside the first epoch (20 batches): the Trainer alone resumes into step 5
    "max_steps": ({"max_steps": 4}, 4),
    # 1.5 epochs of 10 steps (gradient accumulation 2): the plan ends inside the second epoch, at step 15
    "fractional epochs, accumulation": ({"num_train_epochs": 1.5, "gradient_accumulation_steps": 2}, 15),
    # whole epochs: the Trainer's own epoch loop already stops there
    "whole epochs": ({"num_train_epochs": 1, "gradient_accumulation_steps": 2}, 10),
}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_a_checkpoint_at_the_planned_end_trains_no_step(tmp_path: Path, plan: str, lora: bool) -> None:
    settings, end = PLANS[plan]
    first, _ = make_trainer(tmp_path, settings, lora)
    assert train_to_plan(first, None, "test") == end
    final = tmp_path / f"checkpoint-{end}"
    assert (final / "trainer_state.json").is_file()

    resumed, counter = make_trainer(tmp_path, settings, lora)
    assert train_to_plan(resumed, final, "test") == 0
    assert counter.steps == 0 and resumed.state.global_step == end == resumed.state.max_steps
    assert not (tmp_path / f"checkpoint-{end + 1}").exists()
    assert max(e["step"] for e in resumed.state.log_history) == end  # the checkpoint's log, nothing after it
    saved = load_file(final / ("adapter_model.safetensors" if lora else "model.safetensors"))
    loaded = trained_weights(resumed.model, lora)
    assert saved.keys() <= loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert not resumed.is_in_train  # as after any train(): evaluate and save work as usual
    assert resumed.evaluate(eval_dataset=resumed.train_dataset)["eval_loss"] > 0


def test_an_earlier_checkpoint_trains_the_rest_of_the_plan(tmp_path: Path) -> None:
    settings, end = PLANS["max_steps"]
    first, _ = make_trainer(tmp_path, settings, lora=False)
    train_to_plan(first, None, "test")
    resumed, counter = make_trainer(tmp_path, settings, lora=False)
    assert train_to_plan(resumed, tmp_path / "checkpoint-2", "test") == 2
    assert counter.steps == 2 and resumed.state.global_step == end
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == list(range(1, end + 1))
