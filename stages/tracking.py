"""The stage-facing tracker: what a stage logs (`StageTracker`), fanned out to every enabled tracking backend.

Every stage wraps its work in a tracker:

    with StageTracker(ctx) as tracker:
        tracker.log_params({...})
        trainer = Trainer(..., callbacks=[tracker.hf_callback()])
        ...
        return ctx.finish(...)      # inside the block: the tracker then uploads the final stage.json

The backends (MLflow, W&B, TensorBoard) each implement `TrackingBackend` (stages/tracking_backend.py: `log`,
`close`); the tracker sends each metric to all of them, and ends them in turn. Langfuse gets lifecycle events, not
metrics.

MLflow (stages/tracking_mlflow.py; the server, the experiment and the parent run in
stages/tracking_mlflow_server.py): one parent run per pipeline run (named after the run directory; opened by
prepare, or by the first stage that tracks) and one nested run per stage. The parent is closed by the stage that
ends the pipeline run, with the tag `posttrain.end_reason`: the last enabled stage (`completed`, or the failed
stage's status), prepare when it ends the run early (`skipped`, skip_if_unchanged) and evaluate when the gate does
not pass (`gate-fail`: deploy does not run); `posttrain.end_message` says why. The parent's id lives in
`<run>/tracking.json`; the stage run's id is stored in stage.json through `ctx.set_tracking`, so a resumed attempt
continues the SAME run. The tracking URI is spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else the
local store: SQLite in `mlflow.db` beside the run directory (`runs/mlflow.db`, shared by the runs there; artifacts
next to the database, in `mlartifacts/`), see `local_store_uri`. tracking.json records the store a run used
(`mlflow.tracking_uri`).

One value per step: every backend gets at most one value per (metric, step), also across resumed attempts
(`<stage>/logs/tracking-steps.json` remembers the last step logged per metric; the MLflow run's history counts
too). The first value wins (see `StageTracker.log_metrics`).

Outages (the journal, its sending and sync-tracking: stages/tracking_outbox.py): tracking never fails a stage. A
backend that errors costs one warning and is left alone for RETRY_SECONDS. What the MLflow server cannot take is
appended at once to the stage's journal, `<stage>/logs/tracking-unsent.jsonl` (params, metrics, artifacts, and the
end of the stage's run and of the pipeline's parent), synced to disk, so a stage killed during an outage loses at
most the line being written. The journal is sent, before anything new, by the stage's next attempt; by any stage's
tracker when it starts (the journals of the run directory's other stages); and by `python -m workflows.runs
sync-tracking DIR` (`sync_tracking`). Sending is idempotent (a metric at a step the run already has, a param it
already has, is not sent again), and the journal is removed once the server took all of it, so a send cut short is
simply done again. Only a process holding the stage's lock (`<stage>/.lock`, `run.run_dir.hold_stage_lock`)
touches a stage's journal: the stage's own attempt, or a sender while no process runs the stage (`stage_idle`).

W&B (stages/tracking_wandb.py; when a project is named: $WANDB_PROJECT, else spec.tracking.wandb_project;
$WANDB_ENTITY likewise beats spec.tracking.wandb_entity): group = run name, job_type = stage, one run per stage with
a stable id (resumed attempts continue it). $WANDB_MODE decides as in W&B (`disabled`: no W&B; `offline`: under
`<run>/wandb/`, for `wandb sync`; `online`); unset, online when an API key is known (WANDB_API_KEY, or `wandb
login`'s ~/.netrc), else offline. W&B gets WANDB_INIT_TIMEOUT_SECONDS to start a run, not its own 90 s. MLflow's
system metrics (`system/cpu_utilization_percentage`, ...) are logged on the runs of the training stages. TensorBoard
(stages/tracking_tensorboard.py; spec.tracking.tensorboard): event files under `<run>/<stage>/logs/tensorboard`,
tagged as the Trainer's own TensorBoard callback tags them (`train/loss`, `eval/loss`: `tensorboard_tags`). Langfuse
(stages/langfuse_events.py): start, checkpoint, end and error events of each stage in one trace per run, with the
Langfuse SDK, when a server (spec.tracking.langfuse_host or $LANGFUSE_HOST) and both keys are known. Only rank 0
tracks.

Credentials come only from the environment and never reach a backend: parameter names that look like secrets,
and values holding a secret of the environment, are not sent; every string tracking writes or sends (params,
tags, warnings, the journal, Langfuse events, W&B's config) goes through `mask_secrets`; W&B captures no console
output and no git remote.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from run.exits import EXIT_RETRYABLE, StageInterrupted
from run.masking import mask_secrets, mask_secrets_in, secret_values
from run.run_dir import check_still_ours
from run.tracking import read_tracking_file
from run.version import git_sha
from spec.fields import TRAINING_STAGES
from stages.contract import StageContext, is_main_process
from stages.langfuse_events import LangfuseEvents
from stages.tracking_backend import Breaker, TrackingBackend
from stages.tracking_mlflow import MlflowBackend
from stages.tracking_mlflow_server import clean_params, redact_uri
from stages.tracking_tensorboard import TensorBoardBackend
from stages.tracking_wandb import WandbBackend, wandb_mode, wandb_target

log = logging.getLogger("posttrain.tracking")

STEPS_FILE = "tracking-steps.json"
"""`<stage>/logs/tracking-steps.json`: the last step logged per metric by the attempts of a stage."""

_STATUS = {"succeeded": "FINISHED", "skipped": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class StageTracker:
    """Tracking for one stage attempt; a no-op on every rank but 0. Use it as a context manager."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.enabled = is_main_process()
        self.warnings: list[str] = []
        self.secrets: set[str] = set()
        self.mlflow: MlflowBackend | None = None
        self.wandb: WandbBackend | None = None
        self.tensorboard: TensorBoardBackend | None = None
        self.langfuse: LangfuseEvents | None = None
        self.finished = False
        self.loss_curve: Path | None = None
        self.last_step = -1
        self.logged: dict[str, int] = {}  # metric → last step logged, by this attempt or an earlier one
        self.run_ended: tuple[str, str] | None = None  # (reason, message) when this stage ends the pipeline run

    # -- lifecycle

    def __enter__(self) -> StageTracker:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None and not self.finished:
            if self.langfuse is not None:
                self.langfuse.event("error", "ERROR", f"{exc_type.__name__}: {exc}")
            # SIGTERM/SIGINT (StageInterrupted, KeyboardInterrupt) and a retryable exit are interruptions.
            retryable = issubclass(exc_type, KeyboardInterrupt | StageInterrupted) or (
                issubclass(exc_type, SystemExit) and getattr(exc, "code", 1) == EXIT_RETRYABLE
            )
            self.finish("interrupted" if retryable else "failed")
        else:
            self.finish()

    def start(self) -> None:
        """Open the runs (parent and stage in MLflow, W&B) and log the stage's settings as params. MLflow first
        sends what earlier attempts of this stage (and other stages) could not send."""
        if not self.enabled:
            return
        ctx = self.ctx
        self.secrets = secret_values()
        self.logged = self._read_steps()
        self.mlflow = MlflowBackend(ctx, self._warn, self.secrets)
        langfuse_host = ctx.spec.tracking.langfuse_host or os.environ.get("LANGFUSE_HOST", "")
        langfuse = LangfuseEvents(
            str(ctx.run_dir.root),
            ctx.spec.name,
            ctx.stage,
            {"stage": ctx.stage, "config_hash": ctx.config_hash},
            langfuse_host,
            lambda data: mask_secrets_in(data, self.secrets),
            Breaker(f"Langfuse at {redact_uri(langfuse_host)}", self._warn, kept=False),
        )
        # A trial is tracked in MLflow only: W&B and Langfuse follow the pipeline run's stages, not its search.
        self.langfuse = langfuse if ctx.trial is None else None
        if ctx.spec.tracking.tensorboard:
            self.tensorboard = TensorBoardBackend(ctx.logs_dir / "tensorboard", self._warn)
        params = clean_params(self.base_params(), self.secrets)
        self.mlflow.add_params(params)
        self.mlflow.flush(force=True)
        if ctx.stage in TRAINING_STAGES and self.mlflow.connected:
            self.mlflow.start_system_metrics()
        if wandb_target(ctx.spec)[0] and ctx.trial is None and wandb_mode() != "disabled":
            self.wandb = WandbBackend(ctx, self._warn)
            sha = git_sha()
            path = self.wandb.start({**params, **({"git_commit": sha} if sha else {})})
            if path:
                ctx.set_tracking(wandb_run_path=path)
        if self.langfuse is not None:
            self.langfuse.event("start", metadata={"attempt": ctx.result.attempts if ctx.result else 1})

    def base_params(self) -> dict[str, Any]:
        """What every stage run records: the model, the data version and the stage's own settings."""
        spec = self.ctx.spec
        section = self.ctx.section.model_dump(mode="json", exclude={"resources", "run_policy", "env"})
        return {
            "pipeline": spec.name,
            "stage": self.ctx.stage,
            "config_hash": self.ctx.config_hash,
            "data_version": spec.data_version,
            "model": spec.model.model_dump(mode="json"),
            self.ctx.stage: section,
        }

    @property
    def parent_run_id(self) -> str | None:
        """The MLflow run of the whole pipeline run (None while the server could not be reached)."""
        if self.mlflow is not None and self.mlflow.parent_run_id:
            return self.mlflow.parent_run_id
        return read_tracking_file(self.ctx.pipeline_root).get("mlflow", {}).get("parent_run_id")

    @property
    def run_id(self) -> str | None:
        """This stage's MLflow run."""
        return self.mlflow.run_id if self.mlflow is not None else None

    def end_pipeline_run(self, reason: str, message: str = "") -> None:
        """Say that no stage runs after this one (prepare: `skipped`; evaluate: `gate-fail`): `finish` then
        closes the pipeline run's parent as FINISHED, tagged with the reason, instead of leaving it RUNNING."""
        self.run_ended = (reason, message)

    def finish(self, status: str | None = None) -> None:
        """End the runs: status is a stage status (succeeded, failed, interrupted, skipped); default: the
        stage's recorded status, or succeeded. Uploads stage.json; the parent run ends with the last stage, a
        failed one, or one that ended the pipeline run (`end_pipeline_run`). During an MLflow outage the ends are
        journaled with the rest, and sent later."""
        if not self.enabled or self.finished:
            return
        self.finished = True
        ctx = self.ctx
        if status is None:
            recorded = ctx.result.status if ctx.result is not None else "running"
            status = "succeeded" if recorded == "running" else recorded
        mlflow_status = _STATUS.get(status, status)
        last = ctx.spec.stages.enabled()[-1] == ctx.stage
        parent_tags: dict[str, str] | None = None
        if ctx.trial is not None:
            pass  # a trial never ends the pipeline run: a failed trial is one failure of the search
        elif mlflow_status != "FINISHED":
            parent_tags = {"posttrain.end_reason": status, "posttrain.end_message": f"{ctx.stage} {status}"}
        elif self.run_ended is not None:
            reason, message = self.run_ended
            parent_tags = {"posttrain.end_reason": reason, "posttrain.end_message": message or f"ended by {ctx.stage}"}
        elif last:
            parent_tags = {
                "posttrain.end_reason": "completed",
                "posttrain.end_message": f"{ctx.stage} was the last stage",
            }
        if parent_tags is not None:
            parent_tags = {key: mask_secrets(value, self.secrets) for key, value in parent_tags.items()}
        # TensorBoard's files first: MLflow's end can wait on a server that does not answer.
        for backend in (self.tensorboard, self.mlflow, self.wandb):
            if backend is not None:
                backend.close(mlflow_status, parent_tags)
        if self.langfuse is not None:
            level = "DEFAULT" if mlflow_status == "FINISHED" else "ERROR"
            self.langfuse.event("end", level, status, {"status": status})

    # -- logging

    def log_params(self, params: dict[str, Any]) -> None:
        """Record settings (flattened, stringified; secret-looking names and values are left out, credential
        shapes masked)."""
        if not self.enabled or self.mlflow is None:
            return
        cleaned = clean_params(params, self.secrets)
        self.mlflow.add_params(cleaned)
        self.mlflow.flush()
        if self.wandb is not None:
            self.wandb.update_config(cleaned)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record numeric metrics at an optimizer step (non-numbers and NaN/inf are left out); without a
        step, one past the last step logged.

        At most one value per (metric, step) reaches each backend, in this attempt and across attempts: a value
        at a step at or below the last one logged for that metric is dropped, so the FIRST value wins. The
        Trainer repeats `epoch` and `num_input_tokens_seen` in every log dict of a step and `eval_loss` comes
        again from the final evaluate() and the stage's summary; those repeats carry the same value. First-wins
        is the only rule every backend can keep: MLflow, W&B and TensorBoard append and cannot replace a value
        once sent (W&B even drops steps below its current one), and the first value may already be on the
        server, sent by this attempt or by a killed one before its checkpoint was resumed."""
        if not self.enabled:
            return
        step = self.last_step + 1 if step is None else step
        self.last_step = max(self.last_step, step)
        fresh = {
            str(k): float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(float(v))
            and step > self._last_logged(str(k))
        }
        if not fresh:
            return
        self.logged.update(dict.fromkeys(fresh, step))
        self._save_steps()
        for backend in self._backends():
            backend.log(fresh, step)

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Upload a file or directory to the stage's MLflow run."""
        if not self.enabled or self.mlflow is None:
            return
        self.mlflow.add_artifact(Path(path), artifact_path)
        self.mlflow.flush()

    def log_figure_loss_curve(
        self, steps: Iterable[int], losses: Iterable[float], name: str = "loss_curve"
    ) -> Path | None:
        """Plot loss against step into `<stage>/logs/<name>.png` and log it as an artifact."""
        if not self.enabled:
            return None
        steps, losses = list(steps), list(losses)
        if not steps:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        ax.plot(steps, losses, marker="o", markersize=2)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{self.ctx.run_dir.root.name} / {self.ctx.stage}")
        ax.grid(True, alpha=0.3)
        path = self.ctx.logs_dir / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        self.loss_curve = path
        self.log_artifact(path)
        if self.wandb is not None:
            self.wandb.image(name, path)
        return path

    def checkpoint_saved(self, step: int, path: Path) -> None:
        """Say that a checkpoint was written (a Langfuse `checkpoint` event with its step and folder)."""
        if self.enabled and self.langfuse is not None:
            self.langfuse.event("checkpoint", metadata={"step": step, "checkpoint": str(path)})

    def hf_callback(self) -> Any:
        """A transformers TrainerCallback that forwards the Trainer's logs as metrics (at the global step), says
        when a checkpoint is saved, and plots the loss curve when training ends."""
        from transformers import TrainerCallback

        tracker = self

        class TrackerCallback(TrainerCallback):
            """Forwards Trainer logs to the stage's StageTracker."""

            def __init__(self) -> None:
                self.steps: list[int] = []
                self.losses: list[float] = []

            def on_log(
                self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
            ) -> None:
                if not logs or not state.is_world_process_zero:
                    return
                tracker.log_metrics(logs, step=state.global_step)
                loss = logs.get("loss")
                if isinstance(loss, int | float) and math.isfinite(loss):
                    self.steps.append(state.global_step)
                    self.losses.append(float(loss))

            def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.is_world_process_zero:
                    step = state.global_step
                    tracker.checkpoint_saved(step, Path(args.output_dir) / f"checkpoint-{step}")

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.is_world_process_zero and self.steps:
                    tracker.log_figure_loss_curve(self.steps, self.losses)

        return TrackerCallback()

    # -- internals

    def _backends(self) -> list[TrackingBackend]:
        """The backends this attempt logs to, in the order metrics reach them."""
        return [backend for backend in (self.mlflow, self.wandb, self.tensorboard) if backend is not None]

    def _last_logged(self, key: str) -> int:
        earlier = self.mlflow.logged_steps.get(key, -1) if self.mlflow is not None else -1
        return max(self.logged.get(key, -1), earlier)

    def _steps_identity(self) -> dict[str, str]:
        """What makes attempts the same series: the config and the first attempt's start."""
        result = self.ctx.result
        return {"config_hash": self.ctx.config_hash, "started_at": result.started_at if result is not None else ""}

    def _read_steps(self) -> dict[str, int]:
        """The last steps logged by earlier attempts of this stage (none for a fresh start)."""
        path = self.ctx.logs_dir / STEPS_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or any(data.get(k) != v for k, v in self._steps_identity().items()):
            return {}
        steps = data.get("steps")
        return {str(k): int(v) for k, v in steps.items() if isinstance(v, int)} if isinstance(steps, dict) else {}

    def _save_steps(self) -> None:
        """Remember the last step per metric (renamed into place: a killed process leaves the old file or the
        new one). Not synced: the MLflow run's history covers a lost node."""
        path = self.ctx.logs_dir / STEPS_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        check_still_ours(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({**self._steps_identity(), "steps": self.logged}), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass  # tracking never fails a stage; the MLflow history is the fallback

    def _warn(self, message: str) -> None:
        text = mask_secrets(f"[{self.ctx.stage}] tracking warning: {message}", self.secrets or None)
        self.warnings.append(text)
        log.warning(text)
