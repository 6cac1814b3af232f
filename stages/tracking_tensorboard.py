"""The TensorBoard backend: scalar event files under `<stage>/logs/tensorboard`, tagged as the Trainer tags them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.tracking_backend import TrackingBackend


def tensorboard_tags(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics under the tags the Trainer's own TensorBoard callback writes (`eval_loss` → `eval/loss`, `test_x` →
    `test/x`, `loss` → `train/loss`: transformers' `rewrite_logs`); a name that already has a section
    (`candidate/perplexity`) keeps it.

    The rule is written out rather than imported: `transformers.integrations.integration_utils` loads the modeling
    stack (measured 3.6 s of prepare's run, which needs none of it). tests/test_mlflow_wandb.py holds the two equal."""
    tags: dict[str, float] = {}
    for name, value in metrics.items():
        if "/" in name:
            tags[name] = value
        elif name.startswith(("eval_", "test_")):
            section, _, rest = name.partition("_")
            tags[f"{section}/{rest}"] = value
        else:
            tags[f"train/{name}"] = value
    return tags


class TensorBoardBackend(TrackingBackend):
    """Scalar event files under `<stage>/logs/tensorboard`, written with tensorboard's own writer (no torch)."""

    def __init__(self, logdir: Path, warn: Callable[[str], None]) -> None:
        self.logdir = logdir
        self.warn = warn
        self.writer: Any = None
        self.stopped = False  # a write failed: no more events from this attempt

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.stopped:
            return
        try:
            self._write(metrics, step)
        except Exception as exc:
            self.warn(f"TensorBoard: writing events failed ({exc}); TensorBoard logging stops")
            self.stopped = True
            self.writer = None  # dropped, not closed, as a failed writer always was

    def _write(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self.writer is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self.writer = EventFileWriter(str(self.logdir))
        values = [Summary.Value(tag=k, simple_value=v) for k, v in tensorboard_tags(metrics).items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self, status: str, parent_tags: dict[str, str] | None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
