"""Experiment tracking for a stage: MLflow runs, W&B, TensorBoard event files and Langfuse lifecycle events.

Every stage wraps its work in a tracker:

    with StageTracker(ctx) as tracker:
        tracker.log_params({...})
        trainer = Trainer(..., callbacks=[tracker.hf_callback()])
        ...
        return ctx.finish(...)      # inside the block: the tracker then uploads the final stage.json

MLflow: one parent run per pipeline run (named after the run directory; opened by prepare, or by the first
stage that tracks) and one nested run per stage. The parent is closed by the stage that ends the pipeline run,
with the tag `posttrain.end_reason`: the last enabled stage (`completed`, or the failed stage's status), prepare
when it ends the run early (`skipped`, skip_if_unchanged) and evaluate when the gate does not pass (`gate-fail`:
deploy does not run); `posttrain.end_message` says why. The parent's id lives in `<run>/tracking.json`; the stage
run's id is stored in stage.json through `ctx.set_tracking`, so a resumed attempt continues the SAME run; the
steps it trains again (those after its checkpoint that the killed attempt had already logged) are not logged a
second time, so every metric has one value per step.
The tracking URI is spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else
`sqlite:///<run>/mlflow.db` (artifacts then go next to the database, in `mlartifacts/`).

W&B (only when spec.tracking.wandb_project is set): group = run name, job_type = stage, one run per stage with
a stable id (resumed attempts continue it); offline under `<run>/wandb/` unless WANDB_API_KEY is set.
TensorBoard (spec.tracking.tensorboard): event files under `<run>/<stage>/logs/tensorboard`. Langfuse: start,
end and error events of each stage in one trace per run, only when LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY
and LANGFUSE_HOST are set (plain HTTP to its ingestion API).

Tracking never fails a stage: a backend that errors costs one warning, its metrics are buffered and sent on
a later call (after RETRY_SECONDS), and whatever is still unsent at the end is written to
`<run>/<stage>/logs/tracking-unsent.jsonl`. W&B gets WANDB_INIT_TIMEOUT_SECONDS to start a run, not its own
90 s. Only rank 0 tracks. Credentials come only from the environment
and are never logged: parameter names that look like secrets, and values equal to a secret in the
environment, are not sent.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from stages.contract import SECRET_NAME, StageContext, is_main_process, now, secret_values, write_json_atomic
from workflows.spec import PipelineSpec

log = logging.getLogger("posttrain.tracking")

TRACKING_FILE = "tracking.json"
"""`<run>/tracking.json`: the MLflow experiment and parent run ids shared by the stages of a run."""

RETRY_SECONDS = 30.0
"""After a failed call, a backend is left alone this long before the next try."""

MAX_BUFFERED_METRICS = 200_000
BATCH = 1000  # MLflow log_batch limit for metrics
PARAM_BATCH = 100
MAX_PARAM_VALUE = 6000

_SECRET_NAME = SECRET_NAME

WANDB_INIT_TIMEOUT_SECONDS = 20
"""How long W&B may take to start a run (its own default is 90 s); $WANDB_INIT_TIMEOUT overrides it. An
unreachable W&B server then costs one warning and this many seconds, not minutes."""

# Short HTTP retries: a dead tracking server must cost seconds, not the minutes of MLflow's defaults.
_MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}

_STATUS = {"succeeded": "FINISHED", "skipped": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


# --------------------------------------------------------------------------- helpers


def resolve_tracking_uri(spec: PipelineSpec, run_root: Path) -> str:
    """spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else SQLite in the run directory."""
    return (
        spec.tracking.mlflow_tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or f"sqlite:///{Path(run_root).absolute() / 'mlflow.db'}"
    )


def redact_uri(uri: str) -> str:
    """A URI fit for logs: user:password@ removed."""
    return re.sub(r"//[^/@]*@", "//***@", uri)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened to dotted keys (lists stay values)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return out


def clean_params(params: dict[str, Any]) -> dict[str, str]:
    """Params as MLflow accepts them (flat, string values, legal keys), without anything secret."""
    secrets = secret_values()
    out = {}
    for key, value in flatten(params).items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        if _SECRET_NAME.search(key) or any(s in text for s in secrets):
            continue
        safe_key = re.sub(r"[^A-Za-z0-9_\-. /:]", "_", key)[:250]
        out[safe_key] = text[:MAX_PARAM_VALUE]
    return out


def git_sha() -> str | None:
    """The source commit: $POSTTRAIN_GIT_SHA or $GIT_SHA, else `git rev-parse HEAD` when in a checkout."""
    for name in ("POSTTRAIN_GIT_SHA", "GIT_SHA"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def run_tags(spec: PipelineSpec, run_root: Path) -> dict[str, str]:
    """Tags on every MLflow run of a pipeline run: pipeline, run dir, Argo workflow, git commit, image."""
    tags = {
        "posttrain.pipeline": spec.name,
        "posttrain.run": run_root.name,
        "posttrain.run_dir": str(run_root),
        "posttrain.data_version": spec.data_version,
        "posttrain.model": spec.model.name_or_path,
    }
    env = {
        "argo.workflow.name": "ARGO_WORKFLOW_NAME",
        "argo.workflow.uid": "ARGO_WORKFLOW_UID",
        "posttrain.image": "POSTTRAIN_IMAGE",
    }
    tags.update({tag: os.environ[var] for tag, var in env.items() if os.environ.get(var)})
    if sha := git_sha():
        tags["mlflow.source.git.commit"] = sha
    return tags


def read_tracking_file(run_root: Path) -> dict[str, Any]:
    path = run_root / TRACKING_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


class _Breaker:
    """Warn once per backend, then leave it alone for RETRY_SECONDS after each failure."""

    def __init__(self, name: str, warn: Callable[[str], None]) -> None:
        self.name = name
        self.warn = warn
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
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            self.warn(
                f"{self.name}: {what} failed ({type(exc).__name__}: {first_line}); "
                "the stage goes on, data is kept and sent again later"
            )

    def succeeded(self) -> None:
        if self.failures:
            log.info("%s reachable again", self.name)
        self.failures = 0
        self.warned = False


# --------------------------------------------------------------------------- MLflow


class _Mlflow:
    """A stage's nested MLflow run under the pipeline run's parent, with buffering across outages."""

    def __init__(self, ctx: StageContext, warn: Callable[[str], None]) -> None:
        for name, value in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.ctx = ctx
        self.root = ctx.run_dir.root
        self.uri = resolve_tracking_uri(ctx.spec, self.root)
        self.experiment_name = ctx.spec.tracking.mlflow_experiment or ctx.spec.name
        self.breaker = _Breaker(f"MLflow at {redact_uri(self.uri)}", warn)
        self.client: Any = None
        self.experiment_id: str | None = None
        self.parent_run_id: str | None = None
        self.run_id: str | None = ctx.result.mlflow_run_id if ctx.result is not None else None
        self.resuming = self.run_id is not None
        self.sent_params: dict[str, str] = {}
        self.logged_steps: dict[str, int] = {}  # metric → last step an earlier attempt logged (resumed runs)
        self.params: dict[str, str] = {}
        self.metrics: list[Any] = []
        self.artifacts: list[tuple[str, str | None]] = []
        self.dropped = 0

    # -- connection

    def _artifact_location(self) -> str | None:
        if self.uri.startswith("sqlite:///"):
            return (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").absolute().as_uri()
        return None

    def _connect(self) -> None:
        """Create client, experiment, parent run and this stage's run as far as they do not exist yet."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        if self.client is None:
            self.client = MlflowClient(tracking_uri=self.uri)
        client = self.client
        if self.experiment_id is None:
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                try:
                    self.experiment_id = client.create_experiment(
                        self.experiment_name, artifact_location=self._artifact_location()
                    )
                except MlflowException:  # created by someone else in between
                    self.experiment_id = client.get_experiment_by_name(self.experiment_name).experiment_id
            else:
                self.experiment_id = experiment.experiment_id
        tags = run_tags(self.ctx.spec, self.root)
        if self.parent_run_id is None:
            shared = read_tracking_file(self.root).get("mlflow", {})
            parent = shared.get("parent_run_id")
            if parent and shared.get("experiment_id") == self.experiment_id and self._exists(parent):
                client.update_run(parent, status="RUNNING")
            else:
                parent = client.create_run(
                    self.experiment_id, run_name=self.root.name, tags={**tags, "posttrain.kind": "pipeline"}
                ).info.run_id
                write_json_atomic(
                    self.root / TRACKING_FILE,
                    {
                        **read_tracking_file(self.root),
                        "mlflow": {"experiment_id": self.experiment_id, "parent_run_id": parent},
                    },
                )
            self.parent_run_id = parent
        if self.run_id is not None and self.client is not None and self.resuming:
            if self._exists(self.run_id):
                client.update_run(self.run_id, status="RUNNING")
                data = client.get_run(self.run_id).data
                self.sent_params = dict(data.params)
                self.logged_steps = {
                    key: max(m.step for m in client.get_metric_history(self.run_id, key)) for key in data.metrics
                }
            else:
                self.run_id = None
            self.resuming = False
        if self.run_id is None:
            stage_tags = {
                **tags,
                "mlflow.parentRunId": self.parent_run_id,
                "posttrain.stage": self.ctx.stage,
                "posttrain.config_hash": self.ctx.config_hash,
            }
            self.run_id = client.create_run(self.experiment_id, run_name=self.ctx.stage, tags=stage_tags).info.run_id
            self.ctx.set_tracking(mlflow_run_id=self.run_id)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return True

    # -- buffering

    def add_params(self, params: dict[str, str]) -> None:
        self.params.update(params)

    def add_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        for key, value in metrics.items():
            if len(self.metrics) >= MAX_BUFFERED_METRICS:
                self.metrics.pop(0)
                self.dropped += 1
            self.metrics.append(Metric(key, value, stamp, step))

    def add_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.artifacts.append((str(path), artifact_path))

    def flush(self, force: bool = False) -> bool:
        """Send what is buffered; False (buffer kept) when the server cannot be reached."""
        if not self.breaker.ready(force):
            return False
        from mlflow.entities import Param

        try:
            self._connect()
            pending = {}
            for key, value in self.params.items():
                if key in self.sent_params and self.sent_params[key] != value:
                    log.warning("MLflow param %r was logged before with another value; keeping the first", key)
                elif key not in self.sent_params:
                    pending[key] = value
            items = list(pending.items())
            for i in range(0, len(items), PARAM_BATCH):
                chunk = items[i : i + PARAM_BATCH]
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
                self.sent_params.update(chunk)
            self.params = {}
            self.metrics = [m for m in self.metrics if m.step > self.logged_steps.get(m.key, -1)]
            while self.metrics:
                self.client.log_batch(self.run_id, metrics=self.metrics[:BATCH])
                del self.metrics[:BATCH]
            while self.artifacts:
                path, artifact_path = self.artifacts[0]
                if Path(path).exists():
                    self.client.log_artifact(self.run_id, path, artifact_path)
                self.artifacts.pop(0)
        except Exception as exc:
            self.breaker.failed("logging", exc)
            return False
        self.breaker.succeeded()
        return True

    def end(self, status: str, parent_tags: dict[str, str] | None) -> None:
        """End the stage's run; with `parent_tags`, also the pipeline run's parent (tagged with why it ended)."""
        if not self.flush(force=True) or self.run_id is None:
            return
        try:
            self.client.set_terminated(self.run_id, status)
            if parent_tags is not None and self.parent_run_id:
                for key, value in parent_tags.items():
                    self.client.set_tag(self.parent_run_id, key, value[:MAX_PARAM_VALUE])
                self.client.set_terminated(self.parent_run_id, status)
        except Exception as exc:
            self.breaker.failed("ending the run", exc)

    def unsent(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = [
            {"metric": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp} for m in self.metrics
        ]
        rows += [{"param": k, "value": v} for k, v in self.params.items()]
        rows += [{"artifact": p, "artifact_path": a} for p, a in self.artifacts]
        return rows


# --------------------------------------------------------------------------- W&B, TensorBoard, Langfuse


def _wandb_init_timeout() -> float:
    """$WANDB_INIT_TIMEOUT when it is a positive number, else WANDB_INIT_TIMEOUT_SECONDS."""
    try:
        value = float(os.environ.get("WANDB_INIT_TIMEOUT", ""))
    except ValueError:
        return WANDB_INIT_TIMEOUT_SECONDS
    return value if value > 0 else WANDB_INIT_TIMEOUT_SECONDS


class _Wandb:
    """A W&B run per stage, grouped by pipeline run; offline unless WANDB_API_KEY is set."""

    def __init__(self, ctx: StageContext, warn: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.breaker = _Breaker("W&B", warn)
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> str | None:
        tracking = self.ctx.spec.tracking
        root = self.ctx.run_dir.root
        os.environ.setdefault("WANDB_SILENT", "true")
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            mode = "offline"
        run_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{root}#{self.ctx.stage}").hex[:16]
        try:
            import wandb

            self.run = wandb.init(
                project=tracking.wandb_project,
                entity=tracking.wandb_entity,
                group=root.name,
                job_type=self.ctx.stage,
                name=f"{root.name}/{self.ctx.stage}",
                id=run_id,
                resume="allow",
                dir=str(root),
                mode=mode,
                config=config,
                reinit="create_new",
                settings=wandb.Settings(init_timeout=_wandb_init_timeout()),
            )
        except Exception as exc:
            self.breaker.failed("starting the run", exc)
            return None
        if mode == "online":
            return self.run.path if isinstance(self.run.path, str) else "/".join(self.run.path)
        return str(Path(self.run.dir).parent)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None or not self.breaker.ready():
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as exc:
            self.breaker.failed("logging", exc)

    def image(self, key: str, path: Path) -> None:
        if self.run is None:
            return
        try:
            import wandb

            self.run.log({key: wandb.Image(str(path))})
        except Exception as exc:
            self.breaker.failed("logging an image", exc)

    def end(self, failed: bool) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=1 if failed else 0)
        except Exception as exc:
            self.breaker.failed("finishing the run", exc)
        self.run = None


class _TensorBoard:
    """Scalar event files under `<stage>/logs/tensorboard`, written with tensorboard's own writer (no torch)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.writer: Any = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self.writer is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self.writer = EventFileWriter(str(self.logdir))
        values = [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class _Langfuse:
    """Stage lifecycle events in one Langfuse trace per pipeline run, through the public ingestion API."""

    def __init__(self, ctx: StageContext, warn: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.host = os.environ.get("LANGFUSE_HOST", "").rstrip("/")
        self.public = os.environ.get("LANGFUSE_PUBLIC_KEY", "")
        self.secret = os.environ.get("LANGFUSE_SECRET_KEY", "")
        self.enabled = bool(self.host and self.public and self.secret)
        self.trace_id = str(uuid.uuid5(uuid.NAMESPACE_URL, str(ctx.run_dir.root)))
        self.breaker = _Breaker(f"Langfuse at {redact_uri(self.host)}", warn)

    def event(
        self, name: str, level: str = "DEFAULT", message: str = "", metadata: dict[str, Any] | None = None
    ) -> None:
        if not self.enabled or not self.breaker.ready():
            return
        root = self.ctx.run_dir.root
        stamp = now()
        trace = {"id": self.trace_id, "name": root.name, "metadata": {"pipeline": self.ctx.spec.name}}
        body = {
            "id": str(uuid.uuid4()),
            "traceId": self.trace_id,
            "name": f"{self.ctx.stage}.{name}",
            "startTime": stamp,
            "level": level,
            "statusMessage": message[:1000],
            "metadata": {"stage": self.ctx.stage, "config_hash": self.ctx.config_hash, **(metadata or {})},
        }
        batch = [
            {"id": str(uuid.uuid4()), "timestamp": stamp, "type": "trace-create", "body": trace},
            {"id": str(uuid.uuid4()), "timestamp": stamp, "type": "event-create", "body": body},
        ]
        auth = base64.b64encode(f"{self.public}:{self.secret}".encode()).decode()
        request = urllib.request.Request(
            f"{self.host}/api/public/ingestion",
            data=json.dumps({"batch": batch}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Basic {auth}"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                response.read()
        except Exception as exc:
            self.breaker.failed(f"sending the {name} event", exc)


# --------------------------------------------------------------------------- the tracker


class StageTracker:
    """Tracking for one stage attempt; a no-op on every rank but 0. Use it as a context manager."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.enabled = is_main_process()
        self.warnings: list[str] = []
        self.mlflow: _Mlflow | None = None
        self.wandb: _Wandb | None = None
        self.tensorboard: _TensorBoard | None = None
        self.langfuse: _Langfuse | None = None
        self.finished = False
        self.loss_curve: Path | None = None
        self.last_step = -1
        self.run_ended: tuple[str, str] | None = None  # (reason, message) when this stage ends the pipeline run

    # -- lifecycle

    def __enter__(self) -> StageTracker:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None and not self.finished:
            if self.langfuse is not None:
                self.langfuse.event("error", "ERROR", f"{exc_type.__name__}: {exc}")
            retryable = exc_type is KeyboardInterrupt or (exc_type is SystemExit and getattr(exc, "code", 1) == 75)
            self.finish("interrupted" if retryable else "failed")
        else:
            self.finish()

    def start(self) -> None:
        """Open the runs (parent and stage in MLflow, W&B) and log the stage's settings as params."""
        if not self.enabled:
            return
        ctx = self.ctx
        self.mlflow = _Mlflow(ctx, self._warn)
        self.langfuse = _Langfuse(ctx, self._warn)
        if ctx.spec.tracking.tensorboard:
            self.tensorboard = _TensorBoard(ctx.logs_dir / "tensorboard")
        params = clean_params(self.base_params())
        self.mlflow.add_params(params)
        self.mlflow.flush(force=True)
        if ctx.spec.tracking.wandb_project:
            self.wandb = _Wandb(ctx, self._warn)
            path = self.wandb.start(params)
            if path:
                ctx.set_tracking(wandb_run_path=path)
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
        return read_tracking_file(self.ctx.run_dir.root).get("mlflow", {}).get("parent_run_id")

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
        failed one, or one that ended the pipeline run (`end_pipeline_run`)."""
        if not self.enabled or self.finished:
            return
        self.finished = True
        ctx = self.ctx
        if status is None:
            recorded = ctx.result.status if ctx.result is not None else "running"
            status = "succeeded" if recorded == "running" else recorded
        mlflow_status = _STATUS.get(status, status)
        if self.tensorboard is not None:
            self.tensorboard.close()
        last = ctx.spec.stages.enabled()[-1] == ctx.stage
        parent_tags: dict[str, str] | None = None
        if mlflow_status != "FINISHED":
            parent_tags = {"posttrain.end_reason": status, "posttrain.end_message": f"{ctx.stage} {status}"}
        elif self.run_ended is not None:
            reason, message = self.run_ended
            parent_tags = {"posttrain.end_reason": reason, "posttrain.end_message": message or f"ended by {ctx.stage}"}
        elif last:
            parent_tags = {
                "posttrain.end_reason": "completed",
                "posttrain.end_message": f"{ctx.stage} was the last stage",
            }
        if self.mlflow is not None:
            result = ctx.run_dir.result_path(ctx.stage)
            if result.is_file():
                self.mlflow.add_artifact(result)
            self.mlflow.end(mlflow_status, parent_tags)
            self._save_unsent()
        if self.wandb is not None:
            self.wandb.end(failed=mlflow_status != "FINISHED")
        if self.langfuse is not None:
            level = "DEFAULT" if mlflow_status == "FINISHED" else "ERROR"
            self.langfuse.event("end", level, status, {"status": status})

    # -- logging

    def log_params(self, params: dict[str, Any]) -> None:
        """Record settings (flattened, stringified; secret-looking names and values are left out)."""
        if not self.enabled or self.mlflow is None:
            return
        cleaned = clean_params(params)
        self.mlflow.add_params(cleaned)
        self.mlflow.flush()
        if self.wandb is not None and self.wandb.run is not None:
            try:
                self.wandb.run.config.update(cleaned, allow_val_change=True)
            except Exception as exc:
                self.wandb.breaker.failed("updating the config", exc)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record numeric metrics at an optimizer step (non-numbers and NaN/inf are left out); without a
        step, one past the last step logged."""
        if not self.enabled:
            return
        step = self.last_step + 1 if step is None else step
        self.last_step = max(self.last_step, step)
        values = {
            str(k): float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
        }
        if not values:
            return
        if self.mlflow is not None:
            self.mlflow.add_metrics(values, step)
            self.mlflow.flush()
        if self.wandb is not None:
            self.wandb.log(values, step)
        if self.tensorboard is not None:
            try:
                self.tensorboard.log(values, step)
            except Exception as exc:
                self._warn(f"TensorBoard: writing events failed ({exc}); TensorBoard logging stops")
                self.tensorboard = None

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

    def hf_callback(self) -> Any:
        """A transformers TrainerCallback that forwards the Trainer's logs as metrics (at the global step)
        and plots the loss curve when training ends."""
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

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.is_world_process_zero and self.steps:
                    tracker.log_figure_loss_curve(self.steps, self.losses)

        return TrackerCallback()

    # -- internals

    def _warn(self, message: str) -> None:
        text = f"[{self.ctx.stage}] tracking warning: {message}"
        self.warnings.append(text)
        log.warning(text)

    def _save_unsent(self) -> None:
        assert self.mlflow is not None
        rows = self.mlflow.unsent()
        if not rows and not self.mlflow.dropped:
            return
        path = self.ctx.logs_dir / "tracking-unsent.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._warn(
            f"MLflow: {len(rows)} records could not be sent"
            + (f" ({self.mlflow.dropped} oldest metrics dropped from a full buffer)" if self.mlflow.dropped else "")
            + f"; saved to {path}"
        )
