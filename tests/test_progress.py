"""The training stages' progress line: step, loss, tokens/s, MFU on a GPU of known peak, ETA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from run.durations import format_duration
from stages import progress
from stages.progress import ProgressLog, short_count


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5, bias=False))


def test_the_line_reports_step_loss_throughput_and_eta(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    log = ProgressLog("sft", tiny_model(), clock=clock)
    assert log.flops_per_token == 6 * (10 * 20 + 20 * 5)
    args = SimpleNamespace(world_size=2)
    state = SimpleNamespace(global_step=1000, max_steps=5000, num_input_tokens_seen=4_000_000)
    state.is_world_process_zero = True
    log.on_train_begin(args, state, None)  # resumed at step 1000

    clock.now += 600.0
    state.global_step, state.num_input_tokens_seen = 1200, 4_000_000 + 24_720_000
    log.on_log(args, state, None, logs={"loss": 1.8312, "learning_rate": 1e-5})
    assert capsys.readouterr().out == "[sft] step 1200/5000 · loss 1.831 · 41.2k tok/s · ETA 3h10m\n"
    assert log.latest["eta_seconds"] == pytest.approx(600 / 200 * 3800)

    log.on_log(args, state, None, logs={"eval_loss": 2.0})  # an evaluation's log: no line
    state.is_world_process_zero = False
    log.on_log(args, state, None, logs={"loss": 1.7})  # another rank: no line
    assert capsys.readouterr().out == ""


def test_mfu_is_shown_on_a_gpu_of_known_peak(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert progress.gpu_peak_flops() == 989e12
    clock = Clock()
    log = ProgressLog("cpt", tiny_model(), clock=clock)
    log.flops_per_token = 6 * 1.7e9  # a 1.7B model's matmuls
    args = SimpleNamespace(world_size=1)
    state = SimpleNamespace(global_step=0, max_steps=100, num_input_tokens_seen=0, is_world_process_zero=True)
    log.on_train_begin(args, state, None)
    clock.now += 10.0
    state.global_step, state.num_input_tokens_seen = 10, 436_000
    log.on_log(args, state, None, logs={"loss": 2.5})
    assert capsys.readouterr().out == "[cpt] step 10/100 · loss 2.5 · 43.6k tok/s · MFU 45% · ETA 1m30s\n"
    assert log.latest["mfu"] == pytest.approx(6 * 1.7e9 * 43_600 / 989e12)

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Future GPU")
    assert progress.gpu_peak_flops() is None  # unknown peak: no MFU rather than a wrong one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert progress.gpu_peak_flops() is None


def test_short_numbers() -> None:
    assert [short_count(v) for v in (812, 41_234.5, 2.1e6, 3.2e9)] == ["812", "41.2k", "2.1M", "3.2G"]
    assert [format_duration(v, to_the_minute_past_an_hour=True) for v in (12.4, 245, 8000, -3)] == [
        "12s",
        "4m05s",
        "2h13m",
        "0s",
    ]
