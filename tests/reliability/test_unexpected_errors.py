"""Errors a stage did not expect: the log ends with one `error:` line that names the stage and the error, the
traceback is kept for a bug report (printed above it and in `<stage>/logs/traceback.txt`), and `stage.json` says
failed. A GPU out of memory is not a bug: it is explained with the spec fields to change, without a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_fixtures import make_run_dir

from run.exits import EXIT_FAILED
from stages.contract import StageContext


def _crash_with(tmp_path: Path, exc: Exception, stage: str = "cpt") -> tuple[int, StageContext]:
    run_dir = make_run_dir(tmp_path / "run", n_text=8, n_chat=8)
    ctx = StageContext(run_dir, stage, run_dir.load_spec())
    assert ctx.begin()
    try:
        raise exc
    except Exception as raised:
        return ctx.crash(raised), ctx


def test_an_unexpected_error_keeps_its_traceback_and_ends_with_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, ctx = _crash_with(tmp_path, KeyError("lm_head.weight"))
    err = capsys.readouterr().err
    trace_file = ctx.logs_dir / "traceback.txt"
    assert code == EXIT_FAILED
    assert "Traceback" in err and "_crash_with" in err  # the frames are there for a bug report
    assert (
        err.strip().splitlines()[-1] == f"[cpt] error: unexpected KeyError: 'lm_head.weight'; traceback in {trace_file}"
    )
    assert "_crash_with" in trace_file.read_text(encoding="utf-8")
    record = json.loads((ctx.dir / "stage.json").read_text())
    assert record["status"] == "failed" and record["message"].startswith("unexpected KeyError")


def test_a_traceback_file_never_holds_a_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue123456")
    _, ctx = _crash_with(tmp_path, RuntimeError("401 for token hf_secretvalue123456"))
    capsys.readouterr()
    assert "hf_secretvalue123456" not in (ctx.logs_dir / "traceback.txt").read_text(encoding="utf-8")


def test_gpu_out_of_memory_names_the_fields_to_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore details")
    code, ctx = _crash_with(tmp_path, oom, stage="sft")
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert "Traceback" not in err and not (ctx.logs_dir / "traceback.txt").exists()
    assert err.startswith("[sft] error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.)")
    section = ctx.section.training
    assert f"stages.sft.training.per_device_batch_size (now {section.per_device_batch_size}" in err
    assert f"stages.sft.training.max_seq_length (now {section.max_seq_length})" in err
    assert "stages.sft.distributed.strategy" in err
    assert json.loads((ctx.dir / "stage.json").read_text())["message"].startswith("the GPU ran out of memory")


def test_out_of_memory_outside_training_points_at_resources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _crash_with(tmp_path, torch.OutOfMemoryError("CUDA out of memory."), stage="evaluate")
    err = capsys.readouterr().err
    assert "stages.evaluate.resources" in err and "per_device_batch_size" not in err
