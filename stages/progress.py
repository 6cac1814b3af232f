"""What a training stage prints as it trains: one progress line at each logging interval.

    [sft] step 1200/5000 · loss 1.83 · 41.2k tok/s · MFU 45% · ETA 2h13m

The same line reaches pod logs, CI logs and the local runner's live view (its "last log line"); the Trainer's
tqdm bar stays off (`disable_tqdm`), so nothing else scrolls. Rank 0 prints.

- tok/s: the tokens every rank took in (the Trainer's `num_input_tokens_seen`, gathered over the ranks) over the
  wall time since the line before (since training began, for the first);
- MFU: 6 × the matmul parameters a token goes through (`matmul_parameters`) × tok/s over the dense bf16 peak of the
  job's GPUs: the "6N" convention of docs/performance.md (a LoRA step does less than 6N; the figure compares runs).
  Only on a GPU whose peak is known (`PEAK_BF16_FLOPS`); never on CPU;
- ETA: the steps left at this attempt's mean step time so far (a resumed attempt counts from where it resumed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from run.durations import format_duration

PEAK_BF16_FLOPS = {"B200": 2250e12, "H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peaks from the datasheets, by the name in the device's name (e.g. 'NVIDIA H100 80GB')."""


def matmul_parameters(model: Any) -> int:
    """Parameters of the Linear layers (the output head included, LoRA's small matrices too), plus a mixture of
    experts' active share of its expert weights (top-k of the experts: the matmuls a token goes through)."""
    import torch

    from stages.modeling import expert_parameters
    from stages.sharded_loading import full_numel

    dense = sum(full_numel(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = expert_parameters(model)
    if not experts:
        return dense
    config = model.config.get_text_config()
    share = config.num_experts_per_tok / config.num_experts
    return dense + int(sum(full_numel(p) for p in experts.values()) * share)


def gpu_peak_flops() -> float | None:
    """The dense bf16 peak of this process's GPU, or None (CPU, or a GPU not in PEAK_BF16_FLOPS)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def short_count(value: float) -> str:
    """41234.5 -> '41.2k', 2.1e6 -> '2.1M', 812 -> '812'."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.1f}{suffix}"
    return f"{value:.0f}"


class ProgressLog(TrainerCallback):
    """Prints the progress line on every training log (the dicts with a `loss`) and keeps its latest figures in
    `latest` (step, max_steps, loss, tokens_per_second, mfu, eta_seconds) for whoever reports them elsewhere."""

    def __init__(self, stage: str, model: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.stage = stage
        self.clock = clock
        self.flops_per_token = 6 * matmul_parameters(model)
        self.peak = gpu_peak_flops()
        self.begin = self.last_time = clock()
        self.begin_step = 0
        self.last_tokens = 0
        self.latest: dict[str, float] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin = self.last_time = self.clock()
        self.begin_step = state.global_step
        self.last_tokens = state.num_input_tokens_seen

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        now = self.clock()
        figures: dict[str, float] = {"step": state.global_step, "max_steps": state.max_steps}
        parts = [f"step {state.global_step}/{state.max_steps}"]
        loss = logs["loss"]
        if isinstance(loss, int | float) and math.isfinite(loss):
            figures["loss"] = float(loss)
            parts.append(f"loss {loss:.4g}")
        tokens = state.num_input_tokens_seen - self.last_tokens
        if now > self.last_time and tokens > 0:
            rate = tokens / (now - self.last_time)
            figures["tokens_per_second"] = rate
            parts.append(f"{short_count(rate)} tok/s")
            if self.peak is not None:
                mfu = self.flops_per_token * rate / (self.peak * max(1, args.world_size))
                figures["mfu"] = mfu
                parts.append(f"MFU {mfu:.0%}")
        done = state.global_step - self.begin_step
        if done > 0 and state.max_steps > 0:
            eta = (now - self.begin) / done * max(0, state.max_steps - state.global_step)
            figures["eta_seconds"] = eta
            parts.append(f"ETA {format_duration(eta, to_the_minute_past_an_hour=True)}")
        self.last_time, self.last_tokens = now, state.num_input_tokens_seen
        self.latest = figures
        print(f"[{self.stage}] " + " · ".join(parts), flush=True)
