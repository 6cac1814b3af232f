"""The Prometheus metrics a training stage serves: its progress figures, GPU memory, start and deadline.

The compiled PyTorchJob sets POSTTRAIN_METRICS_PORT (cluster.metrics_port) on the Master's container, whose port
named `metrics` manifests/components/monitoring's PodMonitor scrapes; without the variable (the local runner, unless
it is exported) nothing is served. Global rank 0 serves, with prometheus_client's own HTTP server: it alone has the
progress figures (loss, tokens/s over all ranks, MFU, ETA; stages.progress), so each stage of a run is one series
and needs no rank label, and the GPUs of every pod, the Workers' included, come from the DCGM exporter. A port
already taken costs one warning, never the stage.

Every series carries the labels pipeline, run (the run directory's name: the workflow's name in the cluster) and
stage:

- posttrain_step, posttrain_max_steps: the optimizer step, and the plan's last one;
- posttrain_loss, posttrain_tokens_per_second, posttrain_mfu, posttrain_eta_seconds: the progress line's figures at
  the latest logging interval (MFU on a GPU of known peak only);
- posttrain_gpu_memory_bytes{kind="max_allocated"|"reserved"}: rank 0's GPU (torch.cuda), on a GPU only;
- posttrain_last_step_timestamp_seconds: when the latest step ended (Unix time; training's begin before the first),
  for the no-progress alert;
- posttrain_stage_start_timestamp_seconds: when this attempt's process started;
- posttrain_deadline_timestamp_seconds: that start plus run_policy.active_deadline_seconds. The operator counts the
  deadline from the job's start, a little earlier, so a stage still running past this time outlived its deadline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from transformers import TrainerCallback

from run.names import METRICS_PORT_ENV
from stages.contract import StageContext, is_main_process
from stages.progress import ProgressLog

PROCESS_STARTED = time.time()
"""When the stage's process started: this module is imported with the stage's, before the model loads."""

LABELS = ("pipeline", "run", "stage")

PROGRESS_GAUGES = {
    "loss": ("posttrain_loss", "Training loss at the latest logging interval."),
    "tokens_per_second": ("posttrain_tokens_per_second", "Input tokens per second over all ranks."),
    "mfu": ("posttrain_mfu", "Model FLOPs utilisation (0-1) against the GPUs' dense bf16 peak."),
    "eta_seconds": ("posttrain_eta_seconds", "Seconds left to the plan's last step at this attempt's pace."),
}
"""ProgressLog.latest's figures, by key: the gauge each one sets."""


class StageMetrics(TrainerCallback):
    """Sets the stage's gauges from the trainer's steps and from the progress line's figures (`progress.latest`,
    so it comes after `progress` in the callbacks), and serves them once `serve` is called."""

    def __init__(
        self,
        progress: ProgressLog,
        pipeline: str,
        run: str,
        stage: str,
        deadline_seconds: float,
        started: float = PROCESS_STARTED,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.progress = progress
        self.stage = stage
        self.clock = clock
        self.labels = {"pipeline": pipeline, "run": run, "stage": stage}
        self.registry = CollectorRegistry()  # only the stage's series: no process or platform collectors
        self.server: Any = None

        def gauge(name: str, documentation: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, documentation, LABELS + extra, registry=self.registry)

        self.step = gauge("posttrain_step", "The optimizer step the stage reached.")
        self.max_steps = gauge("posttrain_max_steps", "The plan's last optimizer step.")
        self.figures = {key: gauge(name, doc) for key, (name, doc) in PROGRESS_GAUGES.items()}
        self.gpu_memory = gauge(
            "posttrain_gpu_memory_bytes",
            "Rank 0's GPU memory: the most allocated so far (max_allocated) and the caching allocator's (reserved).",
            ("kind",),
        )
        self.last_step = gauge("posttrain_last_step_timestamp_seconds", "Unix time the latest step ended.")
        start = gauge("posttrain_stage_start_timestamp_seconds", "Unix time this attempt's process started.")
        deadline = gauge(
            "posttrain_deadline_timestamp_seconds", "Stage start plus run_policy.active_deadline_seconds (Unix time)."
        )
        start.labels(**self.labels).set(started)
        deadline.labels(**self.labels).set(started + deadline_seconds)

    @classmethod
    def for_stage(cls, ctx: StageContext, progress: ProgressLog) -> StageMetrics:
        """The stage's metrics, served on POSTTRAIN_METRICS_PORT by rank 0 when the variable is set."""
        metrics = cls(
            progress,
            pipeline=ctx.spec.name,
            run=ctx.run_dir.root.name,
            stage=ctx.stage,
            deadline_seconds=ctx.section.run_policy.active_deadline_seconds,
        )
        port = os.environ.get(METRICS_PORT_ENV, "").strip()
        if port and is_main_process():
            if port.isdigit():
                metrics.serve(int(port))
            else:
                print(f"[{ctx.stage}] warning: {METRICS_PORT_ENV}={port!r} is not a port: metrics not served")
        return metrics

    def serve(self, port: int, addr: str = "0.0.0.0") -> int | None:
        """Serve the metrics on `port` (0: any free one); the port served, or None with a warning when it is taken."""
        try:
            self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            print(f"[{self.stage}] warning: metrics not served on port {port}: {exc.strerror or exc}", flush=True)
            return None
        return int(self.server.server_port)

    def close(self) -> None:
        """Stop serving (the server thread is a daemon: a stage that exits needs no call)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.max_steps.labels(**self.labels).set(state.max_steps)
        self.step.labels(**self.labels).set(state.global_step)
        self.last_step.labels(**self.labels).set(self.clock())  # the no-progress clock starts with training

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step.labels(**self.labels).set(state.global_step)
        self.last_step.labels(**self.labels).set(self.clock())

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        for key, value in self.progress.latest.items():
            if key in self.figures:
                self.figures[key].labels(**self.labels).set(value)
        self.max_steps.labels(**self.labels).set(state.max_steps)
        self.record_gpu_memory()

    def record_gpu_memory(self) -> None:
        import torch

        if torch.cuda.is_available():
            memory = {"max_allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved()}
            for kind, value in memory.items():
                self.gpu_memory.labels(**self.labels, kind=kind).set(value)
