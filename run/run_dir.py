"""One run directory on disk: the resolved spec, each stage's record (`stage.json`), atomic writes, stage locks.

    <run-dir>/spec.json
    <run-dir>/<stage>/stage.json        written last, atomically: the stage's record
    <run-dir>/<stage>/.lock             held by the process running the stage

Every record is written to a temporary file and renamed (`write_json_atomic`), so a reader sees the old file or
the new one. One process at a time runs a stage: it holds `<stage>/.lock` (`hold_stage_lock`, an flock the kernel
releases however the process ends); a run directory deleted or replaced under it stops it at its next write
(`check_still_ours`). The rules a stage follows with them are in stages/contract.py.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from run.masking import mask_secrets_in
from spec.fields import STAGE_ORDER
from spec.loading import spec_from_json
from spec.pipeline import PipelineSpec

SPEC_JSON = "spec.json"
STAGE_JSON = "stage.json"

StageStatus = Literal["running", "succeeded", "failed", "interrupted", "skipped"]


class StageRefused(Exception):
    """The stage must not run as asked (e.g. a completed stage with another config). Exit code 2."""


class StageBusy(Exception):
    """Another live process holds the stage's lock: it is running the stage. Exit EXIT_RETRYABLE, nothing written."""


class RunDirGone(BaseException):
    """The run directory (or the stage's folder) this process holds a stage lock in was deleted or replaced while
    the stage ran. A BaseException, so that no stage's `except Exception` records it or writes a traceback: whatever
    it wrote would land in a folder made again under the old name. Exit EXIT_FAILED, nothing more written."""


class InputRef(BaseModel):
    """An input of a stage: where it came from and its content fingerprint."""

    model_config = ConfigDict(extra="forbid")

    uri: str = Field(description="Path or URI the input was read from.")
    fingerprint: str = Field(description="Content fingerprint (sha256 over the bytes or upstream stage.json).")


class StageResult(BaseModel):
    """The record a stage leaves in `<run-dir>/<stage>/stage.json`."""

    model_config = ConfigDict(extra="forbid")

    stage: str = Field(description="Stage name.")
    status: StageStatus = Field(description="running, succeeded, failed, interrupted (retryable) or skipped.")
    config_hash: str = Field(description="Hash of the spec parts that determine this stage's outputs.")
    inputs: dict[str, InputRef] = Field(default_factory=dict, description="Inputs with fingerprints.")
    outputs: dict[str, str] = Field(default_factory=dict, description="Outputs, as paths relative to the run dir.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Final metrics.")
    mlflow_run_id: str | None = Field(None, description="MLflow run of this stage (nested under the run's parent).")
    wandb_run_path: str | None = Field(None, description="W&B run path entity/project/id, or the offline dir.")
    started_at: str = Field(description="UTC ISO time the (first) attempt started.")
    ended_at: str | None = Field(None, description="UTC ISO time it ended.")
    attempts: int = Field(1, description="How many times the stage was started for this config.")
    message: str = Field("", description="Human-readable outcome, e.g. the error or why it was skipped.")
    host: str = Field(default_factory=socket.gethostname, description="Host that wrote the record.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Stage-specific details (e.g. gate decision).")


def now() -> str:
    """UTC now, ISO 8601."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` so readers see the old file or the new one, never a torn one (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so readers see the old file or the new one, never a torn or empty one: the other
    ranks of a torchrun job read what rank 0 writes. RunDirGone, before anything is made, when `path` lies in a run
    directory whose stage lock this process holds and that was deleted or replaced (`check_still_ours`)."""
    check_still_ours(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunDir:
    """A run directory: the resolved spec plus one folder per stage."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    @property
    def spec_path(self) -> Path:
        return self.root / SPEC_JSON

    def write_spec(self, spec: PipelineSpec) -> None:
        """Store the resolved spec (profiles dropped: they were already applied)."""
        write_json_atomic(self.spec_path, spec.model_dump(mode="json", exclude={"profiles"}))

    def load_spec(self) -> PipelineSpec:
        """The resolved spec; StageRefused when missing (run prepare first)."""
        if not self.spec_path.is_file():
            raise StageRefused(
                f"{self.spec_path} is missing: run the prepare stage first (`python -m workflows.submit <pipeline> "
                f"--local --run-dir {self.root}` writes spec.json and runs it)"
            )
        return spec_from_json(self.spec_path.read_text(encoding="utf-8"), str(self.spec_path))

    def stage_dir(self, stage: str) -> Path:
        """`<run>/<stage>`; only the DAG's stage names are folders of a run (nothing else makes a path here)."""
        if stage not in STAGE_ORDER:
            raise ValueError(f"{stage!r} is not a stage ({', '.join(STAGE_ORDER)})")
        return self.root / stage

    def result_path(self, stage: str) -> Path:
        return self.stage_dir(stage) / STAGE_JSON

    def read_result(self, stage: str) -> StageResult | None:
        """The stage's record, or None when it never started."""
        path = self.result_path(stage)
        if not path.is_file():
            return None
        return StageResult.model_validate_json(path.read_text(encoding="utf-8"))

    def write_result(self, result: StageResult) -> None:
        """Write the record atomically, secret values and credential shapes masked in every string of it."""
        write_json_atomic(self.result_path(result.stage), mask_secrets_in(result.model_dump(mode="json")))

    def relative(self, path: Path) -> str:
        return str(Path(path).absolute().relative_to(self.root))


LOCK_FILE = ".lock"
"""`<run>/<stage>/.lock`: locked by the process running the stage; it names that process (pid, host, start)."""


@dataclass(frozen=True)
class _HeldLock:
    """A stage lock this process holds: the open handle (closing it would release the lock), the run directory as
    given and as resolved, and the run directory's (st_dev, st_ino) when the lock was taken."""

    handle: IO[str]
    roots: tuple[Path, ...]
    root_id: tuple[int, int]

    @property
    def path(self) -> Path:
        return Path(self.handle.name)

    def problem(self) -> str | None:
        """None while the run directory and the lock file are the ones locked; else what was deleted or replaced."""
        root = self.roots[-1]
        try:
            same_root = _identity(os.stat(root)) == self.root_id
        except OSError:
            same_root = False
        if not same_root:
            return f"run directory {root}"
        if not still_locked(self.handle, self.path):
            return f"stage folder {self.path.parent}"
        return None


_HELD_LOCKS: dict[Path, _HeldLock] = {}
"""The stage locks this process holds, open until it exits."""


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


def still_locked(handle: IO[str], path: Path) -> bool:
    """Whether `path` still names the file `handle` holds open (and locked): False once it was deleted, or replaced
    by another file (its folder, or a folder above, deleted or renamed away and made again)."""
    try:
        return _identity(os.stat(path)) == _identity(os.fstat(handle.fileno()))
    except OSError:
        return False


def check_still_ours(path: str | os.PathLike[str] | None = None) -> None:
    """RunDirGone when a run directory this process holds a stage lock in (the one `path` lies in; every one when
    `path` is None) was deleted or replaced, or the stage's folder in it, since the lock was taken. Called before
    the stage writes (records, checkpoint markers, the model, the tracker's files) and at each training step, so a
    stage never writes into a folder made again under the old name and never records success there. A process
    that holds no stage lock (a rank other than 0, the local runner) has nothing to check."""
    target = Path(path).absolute() if path is not None else None
    for lock_path, held in _HELD_LOCKS.items():
        if target is not None and not any(target == root or root in target.parents for root in held.roots):
            continue
        if (what := held.problem()) is not None:
            stage = lock_path.parent.name
            raise RunDirGone(
                f"[{stage}] the {what} was deleted or replaced while {stage} was running; the stage stopped and "
                "wrote nothing more (what it wrote before went with the old folder)"
            )


def try_lock(path: Path, holder: str) -> tuple[IO[str] | None, str]:
    """Try an exclusive, non-blocking `flock` on `path`: (the open handle, "") once taken, `holder` written into the
    file for whoever is refused next; (None, what the holder wrote) while another process holds it. The lock lasts
    as long as the handle stays open, and the kernel releases it when the process ends, however it ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 -- the caller keeps it open to hold the lock
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.seek(0)
        held_by = handle.read().strip()
        handle.close()
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return None, held_by
    handle.seek(0)
    handle.truncate()
    handle.write(holder + "\n")
    handle.flush()
    return handle, ""


def hold_stage_lock(run_dir: RunDir, stage: str) -> Path:
    """Lock `<run>/<stage>/.lock` for this process, for the rest of its life; StageBusy when another process holds
    it. Returns the lock file's path. Taking it again in the same process is a no-op.

    An exclusive, non-blocking `flock`: the kernel releases it when the process ends, however it ends (SIGKILL,
    the OOM killer), so a lock is never left behind and a `running` record under a free lock is a dead attempt.
    On an NFS volume (the RWX checkpoints volume) Linux emulates flock with a POSIX lock on the server (NFSv4 lock
    state, kept alive by the client's lease), so the lock also holds between pods on different nodes; a node that
    disappears loses it when its lease expires (about 90 s). POSIX locks belong to the process and go when it
    closes any descriptor of the file, which is why the holder never opens the lock file a second time."""
    path = (run_dir.stage_dir(stage) / LOCK_FILE).resolve()
    if path in _HELD_LOCKS:
        if _HELD_LOCKS[path].problem() is None:
            return path
        _HELD_LOCKS.pop(path).handle.close()  # a folder made again under the old name: a new lock, of a new file
    handle, holder = try_lock(path, f"pid {os.getpid()} on {socket.gethostname()} since {now()}")
    if handle is None:
        raise StageBusy(
            f"[{stage}] is being run by another process ({holder or 'holder unknown'}; lock {path}). This attempt "
            "stops without writing anything. Wait for that process to end (or stop it: a stopped or killed process "
            "releases the lock at once), then run the stage again: it resumes from what that process left."
        )
    root = path.parent.parent
    _HELD_LOCKS[path] = _HeldLock(handle, (run_dir.root, root), _identity(os.stat(root)))
    return path


def holds_stage_lock(run_dir: RunDir, stage: str) -> bool:
    """Whether this process holds the stage's lock."""
    return (run_dir.stage_dir(stage) / LOCK_FILE).resolve() in _HELD_LOCKS
