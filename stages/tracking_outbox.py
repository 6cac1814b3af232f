"""Unsent MLflow records: each stage's journal (`tracking-unsent.jsonl`), from the write that keeps them to delivery."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from run.masking import MaskingStream, mask_secrets, mask_secrets_in, secret_values
from run.run_dir import LOCK_FILE, RunDir, StageRefused, StageResult, check_still_ours, holds_stage_lock, try_lock
from spec.document import SpecError
from spec.fields import STAGE_ORDER
from stages.contract import StageContext, is_main_process
from stages.tracking_backend import first_line
from stages.tracking_mlflow_server import BATCH, PARAM_BATCH, MlflowServer, now_ms, redact_uri, run_tags

JOURNAL = "tracking-unsent.jsonl"
"""`<stage>/logs/tracking-unsent.jsonl`: what the MLflow server has not taken yet (see `Journal`)."""


def _read_record(run_dir: RunDir, stage: str) -> StageResult | None:
    """A stage's record, None when it is missing or unreadable."""
    try:
        return run_dir.read_result(stage)
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


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
    server: MlflowServer,
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


def replay(
    server: MlflowServer, run_dir: RunDir, stage: str, journal: Journal, own: StageContext | None = None
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
                    stamp = int(record.get("timestamp") or now_ms())
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


def sync_tracking(run_dir: RunDir) -> SyncReport:
    """Send every stage journal of `run_dir` to its MLflow server (see `Journal`), and end the runs of attempts
    that died (a record still `running` while no process runs the stage, its MLflow run RUNNING): they end
    KILLED, and the pipeline's parent with them. A stage that a process runs is left alone: it sends its journal
    itself. Raises SpecError (or StageRefused) when `run_dir` has no readable spec."""
    spec = run_dir.load_spec()
    server = MlflowServer(spec, run_dir.root)
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
                        sent = replay(server, run_dir, stage, journal)
                        done.sent, done.already = sent.sent, sent.already
                        if sent.missing:
                            done.notes.append(f"{sent.missing} artifact files were gone")
                        if sent.torn:
                            done.notes.append(f"{sent.torn} lines cut short were skipped")
                        done.notes += [f"run {run_id} ended {status}" for run_id, status in sent.ended.items()]
                    if note := _end_dead_attempt(server, run_dir, stage):
                        done.notes.append(note)
                except Exception as exc:
                    report.unreachable = mask_secrets(first_line(exc), secrets)
            done.pending = journal.count()
    return report


def _end_dead_attempt(server: MlflowServer, run_dir: RunDir, stage: str) -> str | None:
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


def main(argv: list[str]) -> int:
    """`python -m stages sync-tracking --run-dir DIR` (what `posttrain runs sync-tracking DIR` runs): send the
    journals, print per stage what was sent and what is pending; exit 0 when everything got through, 1 when records
    are still pending, 2 when DIR is not a run directory."""
    parser = argparse.ArgumentParser(prog="python -m stages sync-tracking", description=main.__doc__)
    parser.add_argument("--run-dir", required=True, type=Path, help="A run directory (the one holding spec.json).")
    run_dir = parser.parse_args(argv).run_dir
    # What MLflow prints (its run links name the tracking URI, credentials and all) is masked, as in a stage.
    streams = sys.stdout, sys.stderr
    secrets = secret_values()
    sys.stdout, sys.stderr = MaskingStream(sys.stdout, secrets), MaskingStream(sys.stderr, secrets)
    try:
        return _sync_and_report(run_dir)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


def _sync_and_report(run_dir: Path) -> int:
    """Send the journals, print per stage what was sent and what is pending; returns the exit status."""
    try:
        report = sync_tracking(RunDir(run_dir))
    except (SpecError, StageRefused) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {run_dir}/spec.json is not a readable run spec ({first})", file=sys.stderr)
        return 2
    print(f"MLflow at {report.uri}")
    if not report.stages:
        print("  nothing to send: no stage left unsent records or a run open")
    for stage in report.stages:
        parts = []
        if stage.sent or stage.already:
            parts.append(
                f"sent {stage.sent} records" + (f" ({stage.already} were there already)" if stage.already else "")
            )
        if stage.pending:
            parts.append(f"{stage.pending} still pending")
        parts += stage.notes
        print(f"  {stage.stage}: {'; '.join(parts) or 'nothing to send'}")
    if report.unreachable is not None:
        print(
            f"error: MLflow at {report.uri} could not be reached ({report.unreachable}): {report.pending} records "
            f"are still pending; run `python -m workflows.runs sync-tracking {run_dir}` again once it is back",
            file=sys.stderr,
        )
        return 1
    if report.pending:
        print(f"{report.pending} records are still pending (see above)", file=sys.stderr)
        return 1
    print("everything got through")
    return 0
