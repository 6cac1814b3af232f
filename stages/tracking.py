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
run's id is stored in stage.json through `ctx.set_tracking`, so a resumed attempt continues the SAME run.
The tracking URI is spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else the local store: SQLite in
`mlflow.db` beside the run directory (`runs/mlflow.db`, shared by the runs there; artifacts next to the database,
in `mlartifacts/`), see `local_store_uri`. tracking.json records the store a run used (`mlflow.tracking_uri`).

One value per step: every backend gets at most one value per (metric, step), also across resumed attempts
(`<stage>/logs/tracking-steps.json` remembers the last step logged per metric; the MLflow run's history counts
too). The first value wins (see `StageTracker.log_metrics`).

Outages: tracking never fails a stage. A backend that errors costs one warning and is left alone for
RETRY_SECONDS. What the MLflow server cannot take is appended at once to the stage's journal,
`<stage>/logs/tracking-unsent.jsonl` (params, metrics, artifacts, and the end of the stage's run and of the
pipeline's parent), synced to disk, so a stage killed during an outage loses at most the line being written. The
journal is sent, before anything new, by the stage's next attempt; by any stage's tracker when it starts (the
journals of the run directory's other stages); and by `python -m workflows.runs sync-tracking DIR`
(`sync_tracking`). Sending is idempotent (a metric at a step the run already has, a param it already has, is not
sent again), and the journal is removed once the server took all of it, so a send cut short is simply done again.
Only a process holding the stage's lock (`<stage>/.lock`, `stages.contract.hold_stage_lock`) touches a stage's
journal: the stage's own attempt, or a sender while no process runs the stage (`stage_idle`).

W&B (when a project is named: $WANDB_PROJECT, else spec.tracking.wandb_project; $WANDB_ENTITY likewise beats
spec.tracking.wandb_entity): group = run name, job_type = stage, one run per stage with a stable id (resumed
attempts continue it). $WANDB_MODE decides as in W&B (`disabled`: no W&B; `offline`: under `<run>/wandb/`, for
`wandb sync`; `online`); unset, online when an API key is known (WANDB_API_KEY, or `wandb login`'s ~/.netrc),
else offline. W&B gets WANDB_INIT_TIMEOUT_SECONDS to start a run, not its own 90 s. MLflow's system metrics
(`system/cpu_utilization_percentage`, ...) are logged on the runs of the training stages. TensorBoard
(spec.tracking.tensorboard): event files under `<run>/<stage>/logs/tensorboard`, tagged as the Trainer's own
TensorBoard callback tags them (`train/loss`, `eval/loss`: `tensorboard_tags`). Langfuse
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
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.contract import (
    EXIT_RETRYABLE,
    LOCK_FILE,
    RunDir,
    StageContext,
    StageInterrupted,
    StageResult,
    check_still_ours,
    holds_stage_lock,
    is_main_process,
    mask_secrets,
    mask_secrets_in,
    secret_values,
    try_lock,
    write_json_atomic,
)
from stages.langfuse_events import LangfuseEvents
from workflows.credentials import looks_secret_name
from workflows.spec import STAGE_ORDER, TRAINING_STAGES, PipelineSpec

log = logging.getLogger("posttrain.tracking")

TRIAL_TAG = "posttrain.trial"
"""Tag of a search trial's MLflow run: the trial's name (its stage is in posttrain.stage)."""

TRACKING_FILE = "tracking.json"
"""`<run>/tracking.json`: the MLflow experiment and parent run ids shared by the stages of a run."""

JOURNAL = "tracking-unsent.jsonl"
"""`<stage>/logs/tracking-unsent.jsonl`: what the MLflow server has not taken yet (see `Journal`)."""

STEPS_FILE = "tracking-steps.json"
"""`<stage>/logs/tracking-steps.json`: the last step logged per metric by the attempts of a stage."""

RETRY_SECONDS = 30.0
"""After a failed call, a backend is left alone this long before the next try."""

MAX_BUFFERED_METRICS = 200_000
"""Metrics kept in memory when the journal cannot be written either (a full disk); the oldest go first."""

BATCH = 1000  # MLflow log_batch limit for metrics
PARAM_BATCH = 100
MAX_PARAM_VALUE = 6000

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


LOCAL_STORE = "mlflow.db"
"""The local tracking store's database, beside the run directories (`runs/mlflow.db`, artifacts in
`runs/mlartifacts/`), shared by the local runs there so that the gate compares with the last local champion."""


def local_store_uri(run_root: Path) -> str:
    """The SQLite store a run without a tracking server uses: the one its tracking.json names (a run keeps its
    store when resumed), else `<run>/mlflow.db` when the run has one (made before the store was shared), else the
    shared `mlflow.db` in the folder that holds the run directory."""
    root = Path(run_root).absolute()
    recorded = str(read_tracking_file(root).get("mlflow", {}).get("tracking_uri") or "")
    if recorded.startswith("sqlite:///"):
        return recorded
    if (root / LOCAL_STORE).is_file():
        return f"sqlite:///{root / LOCAL_STORE}"
    return f"sqlite:///{root.parent / LOCAL_STORE}"


def resolve_tracking_uri(spec: PipelineSpec, run_root: Path) -> str:
    """spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else the local SQLite store
    (`local_store_uri`)."""
    return spec.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store_uri(run_root)


def redact_uri(uri: str) -> str:
    """A URI fit for logs: its userinfo (user:password@) and any other credential in it masked."""
    return mask_secrets(uri)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened to dotted keys (lists stay values)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return out


def clean_params(params: dict[str, Any], secrets: set[str] | None = None) -> dict[str, str]:
    """Params as MLflow accepts them (flat, string values, legal keys), without anything secret: a secret-looking
    name or a value holding a secret of the environment is left out, a credential-shaped part of a value (a URI's
    user:password@, a known key format) is masked."""
    secrets = secret_values() if secrets is None else secrets
    out = {}
    for key, value in flatten(params).items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        if looks_secret_name(key) or any(s in text for s in secrets):
            continue
        safe_key = mask_secrets(re.sub(r"[^A-Za-z0-9_\-. /:]", "_", key)[:250], secrets)
        out[safe_key] = mask_secrets(text, secrets)[:MAX_PARAM_VALUE]
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
    """Tags on every MLflow run of a pipeline run: pipeline, run dir, Argo workflow, git commit, image (masked)."""
    tags = {
        "posttrain.pipeline": spec.name,
        "posttrain.run": run_root.name,
        "posttrain.run_dir": str(run_root),
        "posttrain.data_version": spec.data_version,
        "posttrain.model": spec.model.name_or_path,
    }
    if spec.variant is not None:  # the variants of a pipeline share its experiment
        tags["posttrain.variant"] = spec.variant
    env = {
        "argo.workflow.name": "ARGO_WORKFLOW_NAME",
        "argo.workflow.uid": "ARGO_WORKFLOW_UID",
        "posttrain.image": "POSTTRAIN_IMAGE",
    }
    tags.update({tag: os.environ[var] for tag, var in env.items() if os.environ.get(var)})
    if sha := git_sha():
        tags["mlflow.source.git.commit"] = sha
    secrets = secret_values()
    return {key: mask_secrets(value, secrets)[:MAX_PARAM_VALUE] for key, value in tags.items()}


def read_tracking_file(run_root: Path) -> dict[str, Any]:
    path = run_root / TRACKING_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _read_record(run_dir: RunDir, stage: str) -> StageResult | None:
    """A stage's record, None when it is missing or unreadable."""
    try:
        return run_dir.read_result(stage)
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


@contextmanager
def stage_idle(run_dir: RunDir, stage: str) -> Iterator[bool]:
    """Whether no other process runs `stage` (its lock, `<stage>/.lock`, is free), holding the lock for the block
    when it is, so that the stage cannot start meanwhile (it would stop with StageBusy, nothing written). This
    process's own hold counts as idle: the holder never opens the lock file a second time (on NFS, closing that
    second descriptor would release the lock)."""
    if holds_stage_lock(run_dir, stage):
        yield True
        return
    holder = f"pid {os.getpid()} on {socket.gethostname()}: sending the stage's unsent tracking records"
    try:
        handle, _ = try_lock(run_dir.stage_dir(stage) / LOCK_FILE, holder)
    except OSError:
        yield False
        return
    if handle is None:
        yield False
        return
    try:
        yield True
    finally:
        handle.close()  # releases the lock


class _Breaker:
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
            self.warn(mask_secrets(f"{self.name}: {what} failed ({_first_line(exc)}); the stage goes on, {then}"))

    def succeeded(self) -> None:
        if self.failures:
            log.info("%s reachable again", self.name)
        self.failures = 0
        self.warned = False


# --------------------------------------------------------------------------- the journal


class Journal:
    """A stage's `logs/tracking-unsent.jsonl`: what the MLflow server has not taken yet, one JSON object a line,
    appended and synced to disk as soon as the server cannot take it (so a killed writer loses at most the line it
    was writing; a line cut short is skipped when read).

    Each writer (a stage attempt) starts its part with a header naming what its records belong to:

        {"journal": 1, "stage": s, "config_hash": h, "started_at": t, "run_id": id|null, "parent_run_id": id|null,
         "tags": {...}}

    then records, in the order they were logged:

        {"param": key, "value": text}
        {"metric": key, "value": x, "step": n, "timestamp": ms}
        {"artifact": path relative to the run directory, "artifact_path": folder|null}
        {"end": "FINISHED"|"FAILED"|"KILLED", "time": ms}                  the stage's run ended
        {"end_pipeline": status, "tags": {...}, "time": ms}               ... and with it the pipeline's parent

    Every string is masked (`mask_secrets`) before it is written. The file is removed, in one unlink, once the
    server took everything in it. Only the holder of the stage's lock reads or writes it (see `stage_idle`)."""

    def __init__(self, logs_dir: Path, secrets: set[str] | None = None) -> None:
        self.path = Path(logs_dir) / JOURNAL
        self.secrets = secret_values() if secrets is None else secrets
        self._header_written = False

    # -- the file

    def exists(self) -> bool:
        try:
            return self.path.stat().st_size > 0
        except OSError:
            return False

    def append(self, records: list[dict[str, Any]], header: dict[str, Any]) -> None:
        """Append `records` (after `header` when this writer has not started a part of the current file yet),
        flushed and synced before returning."""
        if not records:
            return
        check_still_ours(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            size = os.fstat(f.fileno()).st_size
            lines: list[dict[str, Any]] = []
            if not self._header_written or size == 0:
                lines.append({"journal": 1, **header})
            lines += records
            data = b"".join(
                json.dumps(mask_secrets_in(line, self.secrets), ensure_ascii=False).encode() + b"\n" for line in lines
            )
            if size and os.pread(f.fileno(), 1, size - 1) != b"\n":
                data = b"\n" + data  # a line cut short by a killed writer stays a line of its own
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._header_written = True

    def read(self) -> tuple[list[tuple[dict[str, Any], list[dict[str, Any]]]], int]:
        """The parts of the journal, each (header, records), in order, and how many lines could not be read.
        Records before any header (journals of earlier versions) get an empty header."""
        parts: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        torn = 0
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return parts, 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            if not isinstance(item, dict):
                torn += 1
            elif "journal" in item:
                parts.append((item, []))
            else:
                if not parts:
                    parts.append(({}, []))
                parts[-1][1].append(item)
        return parts, torn

    def count(self) -> int:
        """How many records the journal holds."""
        return sum(len(records) for _, records in self.read()[0])

    def remove(self) -> None:
        """Everything in it was sent: remove the file (one unlink; the next append starts a new one)."""
        self.path.unlink(missing_ok=True)
        self._header_written = False


# --------------------------------------------------------------------------- MLflow


class _Server:
    """The run directory's MLflow server: the client, the experiment, the pipeline's parent run and stage runs."""

    def __init__(self, spec: PipelineSpec, root: Path) -> None:
        for name, value in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.spec = spec
        self.root = Path(root)
        self.uri = resolve_tracking_uri(spec, self.root)
        self.experiment_name = spec.tracking.mlflow_experiment or spec.name
        self.client: Any = None
        self.experiment_id: str | None = None

    def _artifact_location(self) -> str | None:
        if self.uri.startswith("sqlite:///"):
            return (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").absolute().as_uri()
        return None

    def connect(self) -> Any:
        """The client, with the experiment looked up or created."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        if self.client is None:
            self.client = MlflowClient(tracking_uri=self.uri)
        if self.experiment_id is None:
            experiment = self.client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                try:
                    self.experiment_id = self.client.create_experiment(
                        self.experiment_name, artifact_location=self._artifact_location()
                    )
                except MlflowException:  # created by someone else in between
                    self.experiment_id = self.client.get_experiment_by_name(self.experiment_name).experiment_id
            else:
                self.experiment_id = experiment.experiment_id
        return self.client

    def exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return True

    def parent(self, tags: dict[str, str], reopen: bool) -> str:
        """The pipeline run's parent run: the one `tracking.json` names when it is on this server (set RUNNING
        again with `reopen`: a stage starts), else a new one, written to `tracking.json`."""
        client = self.connect()
        shared = read_tracking_file(self.root).get("mlflow", {})
        parent = shared.get("parent_run_id")
        if parent and shared.get("experiment_id") == self.experiment_id and self.exists(parent):
            if reopen:
                client.update_run(parent, status="RUNNING")
            return parent
        pipeline_tags = {key: value for key, value in tags.items() if key != TRIAL_TAG}  # opened by a trial
        parent = client.create_run(
            self.experiment_id, run_name=self.root.name, tags={**pipeline_tags, "posttrain.kind": "pipeline"}
        ).info.run_id
        shared = {"experiment_id": self.experiment_id, "parent_run_id": parent, "tracking_uri": redact_uri(self.uri)}
        write_json_atomic(self.root / TRACKING_FILE, {**read_tracking_file(self.root), "mlflow": shared})
        return parent

    def create_stage_run(self, stage: str, config_hash: str, parent: str, tags: dict[str, str]) -> str:
        stage_tags = {
            **tags,
            "mlflow.parentRunId": parent,
            "posttrain.stage": stage,
            "posttrain.config_hash": config_hash,
        }
        name = f"{stage} trial {tags[TRIAL_TAG]}" if TRIAL_TAG in tags else stage
        return self.connect().create_run(self.experiment_id, run_name=name, tags=stage_tags).info.run_id

    def end_parent(self, parent: str, status: str, tags: dict[str, str], end_time: int | None = None) -> None:
        """Close the pipeline's parent run, tagged with why it ended."""
        for key, value in tags.items():
            self.client.set_tag(parent, key, mask_secrets(value)[:MAX_PARAM_VALUE])
        self.client.set_terminated(parent, status, end_time=end_time)


@dataclass
class _Replayed:
    """What sending a journal did."""

    sent: int = 0
    already: int = 0  # records the server had already (a send cut short before, or a step logged twice)
    missing: int = 0  # artifacts whose file is gone
    torn: int = 0  # lines cut short by a killed writer
    ended: dict[str, str] = field(default_factory=dict)  # run id → the status it ended with
    run_id: str | None = None  # the stage's run the last part went to


def _journal_target(
    server: _Server,
    run_dir: RunDir,
    stage: str,
    header: dict[str, Any],
    own: StageContext | None,
    runs: dict[tuple[Any, ...], str],
) -> str:
    """The MLflow run a journal part belongs to: the run its header names, else the run the stage's record names
    when the record is of the same attempts (same config hash, same start), else a new run under the parent, which
    the record then names (so the next attempt continues it)."""
    record = own.result if own is not None else _read_record(run_dir, stage)
    config = header.get("config_hash") or (record.config_hash if record else "")
    started = header.get("started_at") or (record.started_at if record else "")
    key = (header.get("run_id"), config, started)
    if key in runs:
        return runs[key]
    same = record is not None and record.config_hash == config and record.started_at == started
    for candidate in (header.get("run_id"), record.mlflow_run_id if same and record else None):
        if candidate and server.exists(candidate):
            runs[key] = candidate
            return candidate
    tags = header.get("tags") or run_tags(server.spec, run_dir.root)
    parent = header.get("parent_run_id")
    if not (parent and server.exists(parent)):
        parent = server.parent(tags, reopen=False)
    run_id = server.create_stage_run(stage, config, parent, tags)
    if same and record is not None:
        if own is not None:
            own.set_tracking(mlflow_run_id=run_id)
        elif is_main_process():
            record.mlflow_run_id = run_id
            run_dir.write_result(record)
    runs[key] = run_id
    return run_id


def _replay(
    server: _Server, run_dir: RunDir, stage: str, journal: Journal, own: StageContext | None = None
) -> _Replayed:
    """Send a stage's journal (the caller holds its lock), then remove it. Idempotent: what the runs already have
    (a metric at that step, a param) is not sent again, so a send cut short by a crash is simply done again; within
    the journal too the first value of a (metric, step) wins. The end of a run (and of the pipeline's parent)
    is applied after everything else, with the time it ended; a later part's end replaces an earlier one's."""
    from mlflow.entities import Metric, Param

    parts, torn = journal.read()
    done = _Replayed(torn=torn)
    if not parts:
        journal.remove()
        return done
    client = server.connect()
    runs: dict[tuple[Any, ...], str] = {}
    have_params: dict[str, dict[str, str]] = {}
    have_steps: dict[tuple[str, str], set[int]] = {}
    ends: dict[str, tuple[str, int | None]] = {}
    pipeline_end: tuple[str, str, dict[str, str], int | None] | None = None
    for header, records in parts:
        run_id = _journal_target(server, run_dir, stage, header, own, runs)
        done.run_id = run_id
        if run_id not in have_params:
            have_params[run_id] = dict(client.get_run(run_id).data.params)
        params: list[Param] = []
        metrics: list[Metric] = []
        for record in records:
            try:
                if "param" in record:
                    key, value = str(record["param"]), str(record.get("value", ""))
                    if key in have_params[run_id]:
                        done.already += 1
                    else:
                        have_params[run_id][key] = value
                        params.append(Param(key, value))
                elif "metric" in record:
                    key, step, value = str(record["metric"]), int(record["step"]), float(record["value"])
                    stamp = int(record.get("timestamp") or _now_ms())
                    if (run_id, key) not in have_steps:
                        have_steps[run_id, key] = {m.step for m in client.get_metric_history(run_id, key)}
                    if step in have_steps[run_id, key]:
                        done.already += 1
                    else:
                        have_steps[run_id, key].add(step)
                        metrics.append(Metric(key, value, stamp, step))
            except (KeyError, TypeError, ValueError):  # a record this version cannot read
                done.torn += 1
        for i in range(0, len(params), PARAM_BATCH):
            client.log_batch(run_id, params=params[i : i + PARAM_BATCH])
        for i in range(0, len(metrics), BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + BATCH])
        done.sent += len(params) + len(metrics)
        for record in records:
            if "artifact" in record:
                path = run_dir.root / str(record["artifact"])
                if path.exists():
                    client.log_artifact(run_id, str(path), record.get("artifact_path"))
                    done.sent += 1
                else:
                    done.missing += 1
            elif "end" in record:
                ends[run_id] = (str(record["end"]), record.get("time"))
            elif "end_pipeline" in record:
                parent = header.get("parent_run_id")
                if not (parent and server.exists(parent)):
                    parent = server.parent(header.get("tags") or run_tags(server.spec, run_dir.root), reopen=False)
                pipeline_end = (parent, str(record["end_pipeline"]), dict(record.get("tags") or {}), record.get("time"))
    for run_id, (status, end_time) in ends.items():
        client.set_terminated(run_id, status, end_time=end_time)
        done.ended[run_id] = status
        done.sent += 1
    if pipeline_end is not None:
        parent, status, tags, end_time = pipeline_end
        server.end_parent(parent, status, tags, end_time)
        done.ended[parent] = status
        done.sent += 1
    journal.remove()
    return done


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Mlflow:
    """A stage's nested MLflow run under the pipeline run's parent; what the server cannot take goes to the
    stage's journal, which is sent before anything new once the server is back."""

    def __init__(self, ctx: StageContext, warn: Callable[[str], None], secrets: set[str]) -> None:
        self.ctx = ctx
        self.warn = warn
        # A trial's run goes to the pipeline run's server, under its parent (same tracking.json, same database).
        self.server = _Server(ctx.spec, ctx.pipeline_root)
        self.uri = self.server.uri
        self.breaker = _Breaker(f"MLflow at {redact_uri(self.uri)}", warn)
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

    # -- buffering

    def add_params(self, params: dict[str, str]) -> None:
        for key, value in params.items():
            known = self.sent_params.get(key, self.params.get(key))
            if known is None:
                self.params[key] = value
            elif known != value:
                log.warning("MLflow param %r was logged before with another value; keeping the first", key)

    def add_metrics(self, metrics: dict[str, float], step: int) -> None:
        stamp = _now_ms()
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
                    f"MLflow: writing {self.journal.path} failed ({_first_line(exc)}); unsent data is kept "
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
        done = _replay(self.server, self.ctx.run_dir, self.ctx.stage, self.journal, own=self.ctx)
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
                    done = _replay(self.server, run_dir, stage, journal)
                except Exception as exc:  # that journal stays for the next try; this stage's own logging goes on
                    if stage not in self.others_failed:
                        self.others_failed.add(stage)
                        self.warn(f"MLflow: sending the unsent records of {stage} failed ({_first_line(exc)})")
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
        self.ends.append({"end": status, "time": _now_ms()})
        if parent_tags is not None:
            self.ends.append({"end_pipeline": status, "tags": parent_tags, "time": _now_ms()})
        if self.breaker.failures:
            self._to_journal()  # on disk before the last try, which a blackholed server can make last long
        self.flush(force=True)

    def unsent(self) -> int:
        """Records still waiting for the server (in the journal, or in memory when it could not be written)."""
        return self.journal.count() + len(self._pending())


# --------------------------------------------------------------------------- W&B, TensorBoard


def _wandb_init_timeout() -> float:
    """$WANDB_INIT_TIMEOUT when it is a positive number, else WANDB_INIT_TIMEOUT_SECONDS."""
    try:
        value = float(os.environ.get("WANDB_INIT_TIMEOUT", ""))
    except ValueError:
        return WANDB_INIT_TIMEOUT_SECONDS
    return value if value > 0 else WANDB_INIT_TIMEOUT_SECONDS


def wandb_logged_in() -> bool:
    """Whether W&B has an API key: $WANDB_API_KEY, or the entry `wandb login` wrote in ~/.netrc ($NETRC) for the
    server ($WANDB_BASE_URL, else api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return bool(read_netrc_auth(host=os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"))
    except Exception:  # no readable netrc, or a W&B without this reader: no key known
        return False


def wandb_mode() -> str:
    """W&B's mode as its users set it: $WANDB_MODE (`disabled`, `offline`, `online`; W&B's old `dryrun` is offline,
    `run` online), else online when logged in (`wandb_logged_in`), else offline."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)
    if mode in ("disabled", "offline", "online"):
        return mode
    return "online" if wandb_logged_in() else "offline"


def wandb_target(spec: PipelineSpec) -> tuple[str | None, str | None]:
    """(project, entity): $WANDB_PROJECT and $WANDB_ENTITY override spec.tracking.wandb_project and wandb_entity, as
    environment variables override settings everywhere in W&B. No project: W&B is off."""
    tracking = spec.tracking
    return (
        os.environ.get("WANDB_PROJECT") or tracking.wandb_project,
        os.environ.get("WANDB_ENTITY") or tracking.wandb_entity,
    )


class _Wandb:
    """A W&B run per stage, grouped by pipeline run, in `wandb_mode()`."""

    def __init__(self, ctx: StageContext, warn: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.warn = warn
        self.breaker = _Breaker("W&B", warn)
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> str | None:
        project, entity = wandb_target(self.ctx.spec)
        root = self.ctx.run_dir.root
        os.environ.setdefault("WANDB_SILENT", "true")
        mode = wandb_mode()
        if mode == "online" and not wandb_logged_in():
            self.warn("W&B: WANDB_MODE=online but no API key (WANDB_API_KEY or `wandb login`): logging offline")
            mode = "offline"
        run_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{root}#{self.ctx.stage}").hex[:16]
        try:
            import wandb

            self.run = wandb.init(
                project=project,
                entity=entity,
                group=root.name,
                job_type=self.ctx.stage,
                name=f"{root.name}/{self.ctx.stage}",
                id=run_id,
                resume="allow",
                dir=str(root),
                mode=mode,
                config=config,
                reinit="create_new",
                settings=wandb.Settings(
                    init_timeout=_wandb_init_timeout(),
                    # No console capture: "wrap" (W&B's default) patches the write method of the sys.stdout it
                    # finds, which in a stage is the masking stream, so it would see text before it is masked;
                    # "redirect" reads the file descriptors, which native code and child processes write to
                    # without masking. The stage's output is in its log (<stage>/logs/stage.log, the pod's log).
                    console="off",
                    # No git metadata: W&B keeps a remote's user name (a token in `https://<token>:x@host/...`)
                    # and can save a diff of uncommitted files. The commit is in the config (git_commit).
                    disable_git=True,
                    save_code=False,
                ),
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
        values = [Summary.Value(tag=k, simple_value=v) for k, v in tensorboard_tags(metrics).items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# --------------------------------------------------------------------------- the tracker


class StageTracker:
    """Tracking for one stage attempt; a no-op on every rank but 0. Use it as a context manager."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.enabled = is_main_process()
        self.warnings: list[str] = []
        self.secrets: set[str] = set()
        self.mlflow: _Mlflow | None = None
        self.wandb: _Wandb | None = None
        self.tensorboard: _TensorBoard | None = None
        self.langfuse: LangfuseEvents | None = None
        self.system_metrics: Any = None  # mlflow's SystemMetricsMonitor, for a training stage
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
        self.mlflow = _Mlflow(ctx, self._warn, self.secrets)
        langfuse_host = ctx.spec.tracking.langfuse_host or os.environ.get("LANGFUSE_HOST", "")
        langfuse = LangfuseEvents(
            str(ctx.run_dir.root),
            ctx.spec.name,
            ctx.stage,
            {"stage": ctx.stage, "config_hash": ctx.config_hash},
            langfuse_host,
            lambda data: mask_secrets_in(data, self.secrets),
            _Breaker(f"Langfuse at {redact_uri(langfuse_host)}", self._warn, kept=False),
        )
        # A trial is tracked in MLflow only: W&B and Langfuse follow the pipeline run's stages, not its search.
        self.langfuse = langfuse if ctx.trial is None else None
        if ctx.spec.tracking.tensorboard:
            self.tensorboard = _TensorBoard(ctx.logs_dir / "tensorboard")
        params = clean_params(self.base_params(), self.secrets)
        self.mlflow.add_params(params)
        self.mlflow.flush(force=True)
        if ctx.stage in TRAINING_STAGES and self.mlflow.connected:
            self._start_system_metrics()
        if wandb_target(ctx.spec)[0] and ctx.trial is None and wandb_mode() != "disabled":
            self.wandb = _Wandb(ctx, self._warn)
            sha = git_sha()
            path = self.wandb.start({**params, **({"git_commit": sha} if sha else {})})
            if path:
                ctx.set_tracking(wandb_run_path=path)
        if self.langfuse is not None:
            self.langfuse.event("start", metadata={"attempt": ctx.result.attempts if ctx.result else 1})

    def _start_system_metrics(self) -> None:
        """MLflow's system metrics (CPU, memory, disk, network, GPU: `system/...`) on the stage's run, sampled
        every 10 s ($MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL) by mlflow's own monitor; a resumed attempt goes on
        from the steps the run has."""
        assert self.mlflow is not None
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(
                self.mlflow.run_id, resume_logging=self.ctx.resumed, tracking_uri=self.mlflow.uri
            )
            monitor.start()
        except Exception as exc:
            self._warn(f"MLflow: system metrics are not logged ({_first_line(exc)})")
            return
        self.system_metrics = monitor

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
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.system_metrics is not None:
            try:
                self.system_metrics.finish()  # logs what it sampled last
            except Exception as exc:
                self._warn(f"MLflow: stopping the system metrics failed ({_first_line(exc)})")
            self.system_metrics = None
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
        if self.mlflow is not None:
            result = ctx.run_dir.result_path(ctx.stage)
            if result.is_file():
                self.mlflow.add_artifact(result)
            self.mlflow.end(mlflow_status, parent_tags)
            self._report_unsent()
        if self.wandb is not None:
            self.wandb.end(failed=mlflow_status != "FINISHED")
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
        if self.wandb is not None and self.wandb.run is not None:
            try:
                self.wandb.run.config.update(cleaned, allow_val_change=True)
            except Exception as exc:
                self.wandb.breaker.failed("updating the config", exc)

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
        if self.mlflow is not None:
            self.mlflow.add_metrics(fresh, step)
            self.mlflow.flush()
        if self.wandb is not None:
            self.wandb.log(fresh, step)
        if self.tensorboard is not None:
            try:
                self.tensorboard.log(fresh, step)
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

    def _report_unsent(self) -> None:
        assert self.mlflow is not None
        unsent = self.mlflow.unsent()
        if not unsent and not self.mlflow.dropped:
            return
        where = (
            self.mlflow.journal.path if self.mlflow.journal.exists() else "memory (the journal could not be written)"
        )
        self._warn(
            f"MLflow: {unsent} records could not be sent"
            + (f" ({self.mlflow.dropped} oldest metrics dropped from a full buffer)" if self.mlflow.dropped else "")
            + f"; kept in {where}. The stage's next attempt, the next stage, or `python -m workflows.runs "
            f"sync-tracking {self.ctx.run_dir.root}` sends them once the server is back"
        )


# --------------------------------------------------------------------------- sync-tracking


@dataclass
class StageSync:
    """What `sync_tracking` did for one stage."""

    stage: str
    sent: int = 0
    already: int = 0
    pending: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class SyncReport:
    """What `sync_tracking` did for a run directory."""

    uri: str
    stages: list[StageSync] = field(default_factory=list)
    unreachable: str | None = None  # the error, when the server could not be reached

    @property
    def pending(self) -> int:
        return sum(s.pending for s in self.stages)

    @property
    def ok(self) -> bool:
        return self.unreachable is None and self.pending == 0


def log_to_pipeline_run(
    spec: PipelineSpec, run_root: Path, params: dict[str, Any], metrics: dict[str, float], tags: dict[str, str]
) -> str:
    """Log params, metrics (at step 0) and tags on the pipeline run's MLflow parent (opened when there is none yet);
    returns its id. Params the parent already has with the same value are not sent again; raises what MLflow
    raises (the caller decides whether tracking may fail it)."""
    from mlflow.entities import Metric, Param, RunTag

    server = _Server(spec, run_root)
    client = server.connect()
    secrets = secret_values()
    parent = server.parent(run_tags(spec, run_root), reopen=False)
    have = client.get_run(parent).data.params
    fresh = {k: v for k, v in clean_params(params, secrets).items() if have.get(k) != v}
    stamp = _now_ms()
    client.log_batch(
        parent,
        params=[Param(k, v) for k, v in fresh.items()],
        metrics=[Metric(k, float(v), stamp, 0) for k, v in metrics.items()],
        tags=[RunTag(k, mask_secrets(v, secrets)[:MAX_PARAM_VALUE]) for k, v in tags.items()],
    )
    return parent


def sync_tracking(run_dir: RunDir) -> SyncReport:
    """Send every stage journal of `run_dir` to its MLflow server (see `Journal`), and end the runs of attempts
    that died (a record still `running` while no process runs the stage, its MLflow run RUNNING): they end
    KILLED, and the pipeline's parent with them. A stage that a process runs is left alone: it sends its journal
    itself. Raises SpecError (or StageRefused) when `run_dir` has no readable spec."""
    spec = run_dir.load_spec()
    server = _Server(spec, run_dir.root)
    report = SyncReport(uri=redact_uri(server.uri))
    secrets = secret_values()
    for stage in STAGE_ORDER:
        journal = Journal(run_dir.stage_dir(stage) / "logs", secrets)
        record = _read_record(run_dir, stage)
        if not journal.exists() and (record is None or record.status != "running"):
            continue
        done = StageSync(stage)
        report.stages.append(done)
        with stage_idle(run_dir, stage) as idle:
            if not idle:
                done.pending = journal.count()
                done.notes.append("a process runs the stage: it sends its records itself")
                continue
            if report.unreachable is None:
                try:
                    if journal.exists():
                        sent = _replay(server, run_dir, stage, journal)
                        done.sent, done.already = sent.sent, sent.already
                        if sent.missing:
                            done.notes.append(f"{sent.missing} artifact files were gone")
                        if sent.torn:
                            done.notes.append(f"{sent.torn} lines cut short were skipped")
                        done.notes += [f"run {run_id} ended {status}" for run_id, status in sent.ended.items()]
                    if note := _end_dead_attempt(server, run_dir, stage):
                        done.notes.append(note)
                except Exception as exc:
                    report.unreachable = mask_secrets(_first_line(exc), secrets)
            done.pending = journal.count()
    return report


def _end_dead_attempt(server: _Server, run_dir: RunDir, stage: str) -> str | None:
    """End the MLflow run of a stage attempt that died without ending it (its record says `running`; the caller
    holds the stage's lock): KILLED, and the pipeline's parent with it, as the stage's own `finish` would have."""
    record = _read_record(run_dir, stage)
    if record is None or record.status != "running" or not record.mlflow_run_id:
        return None
    client = server.connect()
    if not server.exists(record.mlflow_run_id) or client.get_run(record.mlflow_run_id).info.status != "RUNNING":
        return None
    client.set_terminated(record.mlflow_run_id, "KILLED")
    note = f"run {record.mlflow_run_id} of an attempt that died ended KILLED"
    parent = client.get_run(record.mlflow_run_id).data.tags.get("mlflow.parentRunId")
    if parent and server.exists(parent) and client.get_run(parent).info.status == "RUNNING":
        message = f"{stage} stopped without ending its run (its process died); closed by sync-tracking"
        server.end_parent(parent, "KILLED", {"posttrain.end_reason": "interrupted", "posttrain.end_message": message})
        note += ", and the pipeline's parent run with it"
    return note
