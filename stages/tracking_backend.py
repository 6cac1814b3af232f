"""The contract of a tracking backend: the `TrackingBackend` interface, whose failures a `Breaker` spaces out."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from run.masking import mask_secrets

log = logging.getLogger("posttrain.tracking")

RETRY_SECONDS = 30.0
"""After a failed call, a backend is left alone this long before the next try."""


class TrackingBackend(ABC):
    """One place a stage's metrics go (MLflow, W&B, TensorBoard). A backend never raises into the stage: it warns
    through its breaker (or the tracker's warn) and goes on."""

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record finite metrics at an optimizer step (the tracker sends each (metric, step) once)."""

    @abstractmethod
    def close(self, status: str, parent_tags: dict[str, str] | None) -> None:
        """End the stage's run with MLflow's run status (FINISHED, FAILED, KILLED); `parent_tags`, when this stage
        ends the pipeline run, say why (a backend with a pipeline-level run closes it with them)."""


def first_line(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its text."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


class Breaker:
    """Warn once per backend, then leave it alone for RETRY_SECONDS after each failure."""

    def __init__(self, name: str, warn: Callable[[str], None], kept: bool = True) -> None:
        self.name = mask_secrets(name)
        self.warn = warn
        self.kept = kept  # whether what failed is journaled and sent again (MLflow), or dropped (Langfuse events)
        self.retry_at = 0.0
        self.failures = 0
        self.warned = False

    def ready(self, force: bool = False) -> bool:
        return force or time.monotonic() >= self.retry_at

    def failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        self.retry_at = time.monotonic() + RETRY_SECONDS
        if not self.warned:
            self.warned = True
            # The error's text can hold the whole URI, password included (MLflow names the URL it called).
            then = "data is kept and sent again later" if self.kept else f"events are skipped for {RETRY_SECONDS:.0f} s"
            self.warn(mask_secrets(f"{self.name}: {what} failed ({first_line(exc)}); the stage goes on, {then}"))

    def succeeded(self) -> None:
        if self.failures:
            log.info("%s reachable again", self.name)
        self.failures = 0
        self.warned = False
