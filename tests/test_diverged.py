"""A training run whose loss or gradient norm turns NaN or infinite stops at that logged step with one message
(`stages.training.StopOnNonFinite`, installed by `train_to_plan`), instead of training on to a "succeeded" model of
NaN weights. Seen on GPUs: a LoRA-on-experts benchmark trained all its steps with `grad_norm: nan`."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_plan_end import make_trainer
from transformers import TrainerCallback, TrainerControl, TrainerState

from stages.contract import ExplainedFailure
from stages.training import StopOnNonFinite, TrainingDiverged, train_to_plan


class PoisonAfter(TrainerCallback):
    """Sets one weight to NaN at the end of optimizer step `step` (a numerical fault, as a kernel's would be)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step == self.step:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))


def test_a_diverged_run_stops_at_the_first_non_finite_step(tmp_path: Path) -> None:
    trainer, counter = make_trainer(tmp_path, {"max_steps": 8}, lora=False)
    trainer.add_callback(PoisonAfter(3))
    with pytest.raises(TrainingDiverged, match="grad_norm is nan at step 4: training diverged"):
        train_to_plan(trainer, None, "test")
    assert counter.steps == 4 and trainer.state.global_step == 4  # not one step more
    # the Trainer's own log hid the NaN loss (logging_nan_inf_filter); the gradient norm did not
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
    assert isinstance(TrainingDiverged("x"), ExplainedFailure)  # recorded with its message, no traceback


def test_a_healthy_run_trains_to_its_plan(tmp_path: Path) -> None:
    trainer, counter = make_trainer(tmp_path, {"max_steps": 4}, lora=True)
    assert train_to_plan(trainer, None, "test") == 4 and counter.steps == 4


@pytest.mark.parametrize(
    ("fp16", "logs", "diverged"),
    [
        (False, {"loss": 2.0, "grad_norm": math.inf}, True),
        (False, {"loss": math.nan, "grad_norm": 1.0}, True),
        (False, {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 0.0}, False),
        (False, {"eval_loss": math.nan}, False),  # evaluation is the gate's to judge
        (True, {"loss": 2.0, "grad_norm": math.inf}, False),  # fp16's loss scaler skips an overflowing step
        (True, {"loss": math.inf, "grad_norm": 1.0}, True),
    ],
)
def test_which_logged_values_count(fp16: bool, logs: dict[str, float], diverged: bool) -> None:
    guard, args, state = StopOnNonFinite(), SimpleNamespace(fp16=fp16), TrainerState(global_step=7)
    if diverged:
        with pytest.raises(TrainingDiverged, match="at step 7"):
            guard.on_log(args, state, TrainerControl(), logs=logs)  # type: ignore[arg-type]
    else:
        guard.on_log(args, state, TrainerControl(), logs=logs)  # type: ignore[arg-type]
