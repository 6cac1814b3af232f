"""The MLflow backend: a stage's nested run under the pipeline run's parent, journaled while the server is away."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spec.fields import STAGE_ORDER
from stages.contract import StageContext
from stages.tracking_backend import Breaker, TrackingBackend, first_line
from stages.tracking_mlflow_server import (
    BATCH,
    PARAM_BATCH,
    TRIAL_TAG,
    MlflowServer,
    now_ms,
    redact_uri,
    run_tags,
)
from stages.tracking_outbox import Journal, replay, stage_idle

log = logging.getLogger("posttrain.tracking")

MAX_BUFFERED_METRICS = 200_000
"""Metrics kept in memory when the journal cannot be written either (a full disk); the oldest go first."""


class MlflowBackend(TrackingBackend):
    """A stage's nested MLflow run under the pipeline run's parent; what the server cannot take goes to the
    stage's journal, which is sent before anything new once the server is back."""

    def __init__(self, ctx: StageContext, warn: Callable[[str], None], secrets: set[str]) -> None:
        self.ctx = ctx
        self.warn = warn
        # A trial's run goes to the pipeline run's server, under its parent (same tracking.json, same database).
        self.server = MlflowServer(ctx.spec, ctx.pipeline_root)
        self.uri = self.server.uri
        self.breaker = Breaker(f"MLflow at {redact_uri(self.uri)}", warn)
        self.journal = Journal(ctx.logs_dir, secrets)
        self.tags = run_tags(ctx.spec, ctx.pipeline_root)
        if ctx.trial is not None:
            self.tags[TRIAL_TAG] = ctx.trial.name
        self.parent_run_id: str | None = None
        self.run_id: str | None = ctx.result.mlflow_run_id if ctx.result is not None else None
        self.connected = False
        self.ended = False
        self.sent_params: dict[str, str] = {}
        self.logged_steps: dict[str, int] = {}  # metric → last step the run has (earlier attempts, the journal)
        # Not sent yet and not in the journal yet: what the current call logged.
        self.params: dict[str, str] = {}
        self.metrics: list[dict[str, Any]] = []
        self.artifacts: list[dict[str, Any]] = []
        self.ends: list[dict[str, Any]] = []
        self.dropped = 0
        self.journal_failed = False
        self.others_failed: set[str] = set()
        self.system_metrics: Any = None  # mlflow's SystemMetricsMonitor, for a training stage

    # -- the backend

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.add_metrics(metrics, step)
        self.flush()

    def close(self, status: str, parent_tags: dict[str, str] | None) -> None:
        """Stop the system metrics, upload the stage's stage.json, end the runs (`end`), then warn about what is
        still unsent."""
        if self.system_metrics is not None:
            try:
                self.system_metrics.finish()  # logs what it sampled last
            except Exception as exc:
                self.warn(f"MLflow: stopping the system metrics failed ({first_line(exc)})")
            self.system_metrics = None
        result = self.ctx.run_dir.result_path(self.ctx.stage)
        if result.is_file():
            self.add_artifact(result)
        self.end(status, parent_tags)
        self._report_unsent()

    def start_system_metrics(self) -> None:
        """MLflow's system metrics (CPU, memory, disk, network, GPU: `system/...`) on the stage's run, sampled
        every 10 s ($MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL) by mlflow's own monitor; a resumed attempt goes on
        from the steps the run has."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(self.run_id, resume_logging=self.ctx.resumed, tracking_uri=self.uri)
            monitor.start()
        except Exception as exc:
            self.warn(f"MLflow: system metrics are not logged ({first_line(exc)})")
            return
        self.system_metrics = monitor

    # -- buffering

    def add_params(self, params: dict[str, str]) -> None:
        for key, value in params.items():
            known = self.sent_params.get(key, self.params.get(key))
            if known is None:
                self.params[key] = value
            elif known != value:
                log.warning("MLflow param %r was logged before with another value; keeping the first", key)

    def add_metrics(self, metrics: dict[str, float], step: int) -> None:
        stamp = now_ms()
        self.metrics += [{"metric": k, "value": v, "step": step, "timestamp": stamp} for k, v in metrics.items()]

    def add_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path).absolute()
        try:
            where = str(path.relative_to(self.ctx.run_dir.root))
        except ValueError:
            where = str(path)
        self.artifacts.append({"artifact": where, "artifact_path": artifact_path})

    def _pending(self) -> list[dict[str, Any]]:
        params = [{"param": k, "value": v} for k, v in self.params.items()]
        return [*params, *self.metrics, *self.artifacts, *self.ends]

    def _clear(self) -> None:
        self.params, self.metrics, self.artifacts, self.ends = {}, [], [], []

    def _header(self) -> dict[str, Any]:
        result = self.ctx.result
        return {
            "stage": self.ctx.stage,
            "config_hash": self.ctx.config_hash,
            "started_at": result.started_at if result is not None else "",
            "run_id": self.run_id,
            "parent_run_id": self.parent_run_id,
            "tags": self.tags,
        }

    def _to_journal(self) -> None:
        """Append what is pending to the journal; when the journal cannot be written (a full disk), keep it in
        memory instead (the newest MAX_BUFFERED_METRICS metrics)."""
        records = self._pending()
        if not records:
            return
        try:
            self.journal.append(records, self._header())
        except OSError as exc:
            if not self.journal_failed:
                self.journal_failed = True
                self.warn(
                    f"MLflow: writing {self.journal.path} failed ({first_line(exc)}); unsent data is kept "
                    "in memory only"
                )
            if len(self.metrics) > MAX_BUFFERED_METRICS:
                self.dropped += len(self.metrics) - MAX_BUFFERED_METRICS
                del self.metrics[: len(self.metrics) - MAX_BUFFERED_METRICS]
            return
        self._clear()

    # -- sending

    def flush(self, force: bool = False) -> bool:
        """Send what is pending, after the journal when there is one; False (kept in the journal) when the server
        cannot be reached."""
        if not self.breaker.ready(force):
            self._to_journal()
            return False
        try:
            self._connect()
            if self.journal.exists():
                self._to_journal()
                self._replay_own()
            self._send()
        except Exception as exc:
            self._to_journal()
            self.breaker.failed("logging", exc)
            return False
        self.breaker.succeeded()
        return True

    def _connect(self) -> None:
        """On the first call that reaches the server: send this stage's journal (before anything new), then the
        other stages' journals; open the parent and this stage's run (continuing the recorded one: its params and
        the steps it has are not sent again)."""
        client = self.server.connect()
        if self.connected:
            return
        if self.journal.exists():
            self._replay_own()
        self._replay_others()
        self.parent_run_id = self.server.parent(self.tags, reopen=True)
        self.run_id = self.ctx.result.mlflow_run_id if self.ctx.result is not None else self.run_id
        if self.run_id is not None and self.server.exists(self.run_id):
            client.update_run(self.run_id, status="RUNNING")
            data = client.get_run(self.run_id).data
            self.sent_params = dict(data.params)
            for key in data.metrics:
                steps = [m.step for m in client.get_metric_history(self.run_id, key)]
                self.logged_steps[key] = max([*steps, self.logged_steps.get(key, -1)])
        else:
            self.run_id = self.server.create_stage_run(
                self.ctx.stage, self.ctx.config_hash, self.parent_run_id, self.tags
            )
            self.ctx.set_tracking(mlflow_run_id=self.run_id)
        self.connected = True

    def _replay_own(self) -> None:
        done = replay(self.server, self.ctx.run_dir, self.ctx.stage, self.journal, own=self.ctx)
        log.info(
            "MLflow: sent %d unsent records of %s (%d were there already)", done.sent, self.ctx.stage, done.already
        )
        self.run_id = self.ctx.result.mlflow_run_id if self.ctx.result is not None else done.run_id
        if self.connected and not self.ended:
            # An earlier attempt's end was in the journal: this attempt is still running.
            self.server.client.update_run(self.run_id, status="RUNNING")
            if self.parent_run_id is not None:
                self.server.client.update_run(self.parent_run_id, status="RUNNING")

    def _replay_others(self) -> None:
        """Send the journals other stages of the run directory left, while no process runs them (not from a trial:
        its run directory's other stages are the pipeline run's, whose own stages send them)."""
        run_dir = self.ctx.run_dir
        if self.ctx.trial is not None:
            return
        for stage in STAGE_ORDER:
            if stage == self.ctx.stage:
                continue
            journal = Journal(run_dir.stage_dir(stage) / "logs", self.journal.secrets)
            if not journal.exists():
                continue
            with stage_idle(run_dir, stage) as idle:
                if not idle:
                    continue
                try:
                    done = replay(self.server, run_dir, stage, journal)
                except Exception as exc:  # that journal stays for the next try; this stage's own logging goes on
                    if stage not in self.others_failed:
                        self.others_failed.add(stage)
                        self.warn(f"MLflow: sending the unsent records of {stage} failed ({first_line(exc)})")
                    continue
            log.info("MLflow: sent %d unsent records of %s", done.sent, stage)

    def _send(self) -> None:
        """Send what is pending, dropping each part from memory once the server took it (an error leaves only
        what was not sent)."""
        from mlflow.entities import Metric, Param

        client = self.server.client
        items = list(self.params.items())
        for i in range(0, len(items), PARAM_BATCH):
            chunk = items[i : i + PARAM_BATCH]
            client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
            self.sent_params.update(chunk)
            for key, _ in chunk:
                del self.params[key]
        while self.metrics:
            chunk = self.metrics[:BATCH]
            metrics = [Metric(m["metric"], m["value"], m["timestamp"], m["step"]) for m in chunk]
            client.log_batch(self.run_id, metrics=metrics)
            del self.metrics[:BATCH]
        while self.artifacts:
            artifact = self.artifacts[0]
            path = self.ctx.run_dir.root / artifact["artifact"]
            if path.exists():
                client.log_artifact(self.run_id, str(path), artifact["artifact_path"])
            self.artifacts.pop(0)
        while self.ends:
            end = self.ends[0]
            if "end" in end:
                client.set_terminated(self.run_id, end["end"], end_time=end["time"])
            elif self.parent_run_id:
                self.server.end_parent(self.parent_run_id, end["end_pipeline"], end["tags"], end["time"])
            self.ends.pop(0)

    def end(self, status: str, parent_tags: dict[str, str] | None) -> None:
        """End the stage's run; with `parent_tags`, also the pipeline run's parent (tagged with why it ended).
        During an outage the ends go to the journal with the rest."""
        self.ended = True
        self.ends.append({"end": status, "time": now_ms()})
        if parent_tags is not None:
            self.ends.append({"end_pipeline": status, "tags": parent_tags, "time": now_ms()})
        if self.breaker.failures:
            self._to_journal()  # on disk before the last try, which a blackholed server can make last long
        self.flush(force=True)

    def unsent(self) -> int:
        """Records still waiting for the server (in the journal, or in memory when it could not be written)."""
        return self.journal.count() + len(self._pending())

    def _report_unsent(self) -> None:
        unsent = self.unsent()
        if not unsent and not self.dropped:
            return
        where = self.journal.path if self.journal.exists() else "memory (the journal could not be written)"
        self.warn(
            f"MLflow: {unsent} records could not be sent"
            + (f" ({self.dropped} oldest metrics dropped from a full buffer)" if self.dropped else "")
            + f"; kept in {where}. The stage's next attempt, the next stage, or `python -m workflows.runs "
            f"sync-tracking {self.ctx.run_dir.root}` sends them once the server is back"
        )
