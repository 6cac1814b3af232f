"""The stage contract: the run directory, `stage.json`, config hashes, and the rules for running a stage again.

A run directory holds `spec.json` (the resolved pipeline spec) and one folder per stage:

    <run-dir>/spec.json
    <run-dir>/<stage>/stage.json        written last, atomically: the stage's record
    <run-dir>/<stage>/model/            safetensors: adapter or merged weights (training stages)
    <run-dir>/<stage>/checkpoints/      checkpoint-<step>/ folders, newest last
    <run-dir>/<stage>/logs/             stage log, TensorBoard events

Rules every stage follows (the same in a PyTorchJob pod and under --local):
- a completed stage with the same config hash is a no-op that says so;
- a completed stage with a different config hash is refused unless forced;
- an incomplete stage resumes from its newest valid checkpoint; checkpoints (and a model) made with another config
  hash are refused unless forced, and forcing moves them aside to `<stage>/superseded-<hash8>-<time>/`, so a
  forced or changed stage never continues from what another config trained;
- only rank 0 writes `stage.json`; SIGTERM saves a checkpoint and exits with EXIT_RETRYABLE;
- one process at a time runs a stage: it holds `<stage>/.lock` (see `hold_stage_lock`) from before it reads the
  record until it exits; another process is refused (`StageBusy`, exit EXIT_RETRYABLE) and writes nothing, and a
  record left `running` under a free lock is a dead attempt, which resumes;
- SIGTERM and SIGINT (Ctrl-C) record the stage as interrupted and exit with EXIT_RETRYABLE (`StageContext.
  interrupted`); anything else unexpected records it as failed (`StageContext.crash`); a record is written only
  while it says running, so a stage that already recorded its outcome keeps it;
- a stage starts only when its inputs are there (`check_ready`): otherwise one `error:` line names what is missing
  and the stage that makes it, exit EXIT_USAGE, and nothing is written (no lock, no record);
- a run directory deleted or replaced while a stage runs (the stage's lock file is no longer the file it locked)
  stops the stage at the next write (`check_still_ours`: every record, checkpoint marker and model, and each
  training step): one `error:` line, EXIT_FAILED, and nothing written into a folder made again under that name;
- a full disk (ENOSPC) fails the stage with a message that says so; `stage.json` and the checkpoints written
  before stay as they were (every record is written to a temporary file and renamed);
- values of secret-looking environment variables never reach the stage's output (`mask_secrets`);
- an error the stage did not expect ends the log with one `error:` line; its traceback is kept in
  `<stage>/logs/traceback.txt` and printed above that line (a GPU out of memory is explained instead).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spec import credentials
from spec.fields import STAGE_ORDER, TRAINING_STAGES
from spec.loading import spec_from_json
from spec.pipeline import PipelineSpec

SPEC_JSON = "spec.json"
STAGE_JSON = "stage.json"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RETRYABLE = 75  # EX_TEMPFAIL: preempted; Argo's retry (or a rerun) resumes from the checkpoint

StageStatus = Literal["running", "succeeded", "failed", "interrupted", "skipped"]

# Parts of a stage's spec that change where or how fast it runs, not what it produces.
_NOT_HASHED = {"enabled", "resources", "run_policy", "env"}

CHECKPOINTS_CONFIG = "config_hash"
"""`<stage>/checkpoints/config_hash`: the config hash the checkpoints (and the model next to them) were made with."""

MASK = credentials.MASK
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class StageRefused(Exception):
    """The stage must not run as asked (e.g. a completed stage with another config). Exit code 2."""


class ExplainedFailure(Exception):
    """A failure whose message says all a user needs (what happened, what to change), recorded without a
    traceback: a prepare worker killed by the OOM killer, say (stages.workers.WorkerDied)."""


class StageBusy(Exception):
    """Another live process holds the stage's lock: it is running the stage. Exit EXIT_RETRYABLE, nothing written."""


class RunDirGone(BaseException):
    """The run directory (or the stage's folder) this process holds a stage lock in was deleted or replaced while
    the stage ran. A BaseException, so that no stage's `except Exception` records it or writes a traceback: whatever
    it wrote would land in a folder made again under the old name. Exit EXIT_FAILED, nothing more written."""


class StageInterrupted(BaseException):
    """SIGTERM or SIGINT arrived while a stage was working. A BaseException, like KeyboardInterrupt, so that a
    stage's `except Exception` never records it as a failure: the stage is recorded as interrupted (retryable)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


INTERRUPTS = (signal.SIGTERM, signal.SIGINT)
"""The signals that interrupt a stage (preemption, `timeout`, a CI cancel; Ctrl-C)."""


def interrupt_signal(exc: BaseException) -> int:
    """The signal behind an interruption: StageInterrupted's, or SIGINT for a KeyboardInterrupt."""
    return getattr(exc, "signum", signal.SIGINT)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise StageInterrupted(signum)


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT raise StageInterrupted (main thread only, where handlers can be
    set); the handlers from before come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _interrupt) for signum in INTERRUPTS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


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
    """Write JSON to `path` so readers see the old file or the new one, never a torn one. RunDirGone, before
    anything is made, when `path` lies in a run directory whose stage lock this process holds and that was deleted
    or replaced (`check_still_ours`)."""
    check_still_ours(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def secret_values() -> set[str]:
    """What must never be written out: values of secret-named environment variables (case-insensitive, word by
    word) and credentials found by shape inside any variable (`spec.credentials.secret_values`)."""
    return credentials.secret_values()


def mask_secrets(text: str, secrets: set[str] | None = None) -> str:
    """`text` with every secret value (default: `secret_values()`) and every credential-shaped span (URI userinfo,
    known key formats) replaced by MASK."""
    return credentials.scrub(text, secrets)


def mask_secrets_in(data: Any, secrets: set[str] | None = None) -> Any:
    """`data` (JSON-like: mappings, lists, strings) with `mask_secrets` applied to every string in it."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(data, str):
        return mask_secrets(data, secrets)
    if isinstance(data, dict):
        return {mask_secrets_in(k, secrets): mask_secrets_in(v, secrets) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [mask_secrets_in(v, secrets) for v in data]
    return data


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what it was raised from) is a full disk or an exceeded quota."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_message(exc: BaseException, where: Path) -> str:
    """What to tell when a write failed for lack of space: what failed, what is kept, what to do."""
    filename = getattr(exc, "filename", None)
    return (
        f"no space left on the disk holding {where} ({exc.strerror if isinstance(exc, OSError) else exc}"
        + (f": {filename}" if filename else "")
        + "). What was written before is kept: stage.json as it was and every complete checkpoint (an "
        "interrupted one is set aside on the next attempt). Free space (e.g. lower save_total_limit) and run the "
        "stage again: it resumes from the newest complete checkpoint."
    )


def rank() -> int:
    """Global rank under torchrun (0 when not distributed)."""
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """True on the process that logs and writes records."""
    return rank() == 0


def canonical_hash(data: Any) -> str:
    """sha256 of canonical JSON."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


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


def stage_config(spec: PipelineSpec, stage: str) -> dict[str, Any]:
    """What determines a stage's outputs: the model, the data version, the stage's own settings, and the
    config hashes of the enabled stages before it (a changed upstream changes this stage too)."""
    section = spec.stage(stage).model_dump(mode="json", exclude=_NOT_HASHED)
    upstream = [s for s in STAGE_ORDER[: STAGE_ORDER.index(stage)] if spec.stage(s).enabled]
    config = {
        "stage": stage,
        "model": spec.model.model_dump(mode="json"),
        "data_version": spec.data_version,
        "section": section,
        "upstream": {s: canonical_hash(stage_config(spec, s)) for s in upstream},
    }
    if stage == "prepare":
        # prepare reads and normalizes every enabled stage's data: their data sections shape its outputs.
        config["data"] = {
            s: data.model_dump(mode="json")
            for s in STAGE_ORDER
            if spec.stage(s).enabled and (data := getattr(spec.stage(s), "data", None)) is not None
        }
        include = spec.stages.evaluate.lm_eval_include_path
        if spec.stages.evaluate.enabled and include is not None and include.startswith("builtin:"):
            config["lm_eval_tasks"] = include  # prepare writes this builtin task folder too
    return config


def config_hash(spec: PipelineSpec, stage: str) -> str:
    """Hash of `stage_config`."""
    return canonical_hash(stage_config(spec, stage))


def conflicting_stages(run_dir: RunDir, spec: PipelineSpec) -> list[str]:
    """Stages of `run_dir` that running `spec` there would refuse: completed with another config than `spec`
    gives them, or holding checkpoints of another config. Their spec.json must not replace the one they were
    made from."""
    conflicts = []
    for stage in spec.stages.enabled():
        try:
            previous = run_dir.read_result(stage)
        except ValueError:  # an unreadable record is not a completed stage
            continue
        wanted = config_hash(spec, stage)
        changed = previous is not None and previous.status == "succeeded" and previous.config_hash != wanted
        if changed or (stage in TRAINING_STAGES and _stale_outputs(run_dir.stage_dir(stage), previous, wanted)):
            conflicts.append(stage)
    return conflicts


def _outputs_config(stage_dir: Path, previous: StageResult | None) -> str | None:
    """The config hash a training stage's checkpoints and model were made with: the one recorded next to the
    checkpoints, else the stage record's; None when neither is there."""
    recorded = stage_dir / "checkpoints" / CHECKPOINTS_CONFIG
    try:
        return recorded.read_text(encoding="utf-8").strip() or None
    except OSError:
        return previous.config_hash if previous is not None else None


def _has_outputs(stage_dir: Path) -> bool:
    """Whether a training stage left checkpoints or a model."""
    checkpoints = stage_dir / "checkpoints"
    trained = checkpoints.is_dir() and any(p.name.startswith("checkpoint-") for p in checkpoints.iterdir())
    return trained or (stage_dir / "model").exists()


def _stale_outputs(stage_dir: Path, previous: StageResult | None, wanted: str) -> bool:
    """Whether a training stage holds checkpoints or a model made with another config than `wanted` (or with an
    unknown one): resuming from them would continue what another config trained."""
    return _has_outputs(stage_dir) and _outputs_config(stage_dir, previous) != wanted


def missing_input(stage: str, what: str, maker: str, run_root: Path) -> StageRefused:
    """The refusal of a stage whose input is not there yet: what is missing, and the stage that makes it with the
    command that runs it (main() prints it as one `error:` line, exit 2, before anything is written)."""
    command = f"python -m stages {maker} --run-dir {run_root}"
    return StageRefused(f"[{stage}] {what} in {run_root}: run {maker} first ({command})")


def _not_done(result: StageResult | None, allowed: tuple[str, ...] = ("succeeded",)) -> str | None:
    """How a stage's record falls short ('has not run', 'is failed', ...), or None when its status is allowed."""
    if result is None:
        return "has not run"
    return None if result.status in allowed else f"is {result.status}"


def check_ready(run_dir: RunDir, spec: PipelineSpec, stage: str) -> None:
    """StageRefused, naming what is missing and the stage that makes it, when a stage's inputs are not there:
    a training stage needs prepare's tokenizer and data for it, and the output of the enabled training stage before
    it; evaluate needs prepare's tokenizer and the candidate (the last enabled training stage's output) unless prepare
    ended the run early; deploy needs evaluate's gate decision. prepare needs only spec.json."""
    if not spec.stage(stage).enabled:
        return
    prepare = run_dir.stage_dir("prepare")
    if stage in TRAINING_STAGES:
        needed = [prepare / "tokenizer", prepare / "data" / stage / "train.jsonl"]
        missing = [run_dir.relative(p) for p in needed if not p.exists()]
        if missing:
            raise StageRefused(
                f"[{stage}] {', '.join(missing)} missing in {run_dir.root}: run the prepare stage first "
                f"(python -m stages prepare --run-dir {run_dir.root})"
            )
        before = [s for s in TRAINING_STAGES[: TRAINING_STAGES.index(stage)] if spec.stage(s).enabled]
        if before and (state := _not_done(run_dir.read_result(before[-1]))):
            upstream = before[-1]
            raise StageRefused(
                f"[{stage}] starts from the output of {upstream}, which {state} in {run_dir.root}: "
                f"run {upstream} first (python -m stages {upstream} --run-dir {run_dir.root})"
            )
    elif stage == "evaluate":
        extra = (prepared.extra if (prepared := run_dir.read_result("prepare")) is not None else {}) or {}
        if extra.get("unchanged") == "true":  # prepare ended the run: evaluate records itself skipped
            return
        if not (prepare / "tokenizer").exists():
            raise missing_input(stage, "prepare/tokenizer is missing", "prepare", run_dir.root)
        trained = [s for s in TRAINING_STAGES if spec.stage(s).enabled]
        if trained and (state := _not_done(run_dir.read_result(trained[-1]), ("succeeded", "skipped"))):
            what = f"measures the output of {trained[-1]}, which {state}"
            raise missing_input(stage, what, trained[-1], run_dir.root)
    elif stage == "deploy" and (state := _not_done(run_dir.read_result("evaluate"), ("succeeded", "skipped"))):
        raise missing_input(stage, f"needs evaluate's gate decision, and evaluate {state}", "evaluate", run_dir.root)


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


def writable(text: str) -> str:
    """`text` as UTF-8 can hold it: a lone surrogate (what a `\\ud800` escape in a JSON input decodes to) is kept
    as its backslash escape instead of failing the write."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _memory_hint(stage: str, section: Any) -> str:
    """What to change in the spec when a stage runs out of GPU memory."""
    training = getattr(section, "training", None)
    if training is None:
        return f"Give stages.{stage}.resources more GPU memory (a larger GPU), or evaluate a smaller model."
    prefix = f"stages.{stage}.training"
    steps = [
        f"lower {prefix}.per_device_batch_size (now {training.per_device_batch_size}; raise "
        f"gradient_accumulation_steps to keep the global batch)",
        f"lower {prefix}.max_seq_length (now {training.max_seq_length})",
    ]
    if not training.gradient_checkpointing:
        steps.append(f"set {prefix}.gradient_checkpointing: true")
    steps.append(f"or shard it over more GPUs (stages.{stage}.distributed.strategy: fsdp or deepspeed_zero3)")
    return "To fit: " + ", ".join(steps) + "."


@dataclass(frozen=True)
class Trial:
    """A trial of a hyperparameter search: the stage trained briefly with some values, in a run directory of its own
    (`<run>/hpo/<stage>/trials/<name>/`, see `stages.trials`) that belongs to the pipeline run `run`."""

    name: str
    run: RunDir
    values: dict[str, Any]
    objective: str


class StageContext:
    """What a stage gets: the run directory, the spec, its own folder, and the bookkeeping calls.

    A stage module reads top to bottom as:

        def run(ctx: StageContext) -> int:
            if not ctx.begin():
                return EXIT_OK                    # completed before with the same config
            ...                                    # do the work, checkpointing into ctx.checkpoints_dir
            return ctx.finish(outputs={...}, metrics={...})
    """

    def __init__(
        self,
        run_dir: RunDir,
        stage: str,
        spec: PipelineSpec,
        force: bool = False,
        outputs_dir: Path | None = None,
        trial: Trial | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.stage = stage
        self.spec = spec
        self.force = force
        self.outputs_dir = outputs_dir
        self.trial = trial
        self.config_hash = config_hash(spec, stage)
        self.result: StageResult | None = None
        self.resumed = False

    @property
    def dir(self) -> Path:
        return self.run_dir.stage_dir(self.stage)

    @property
    def pipeline_root(self) -> Path:
        """The pipeline run's directory: the run directory, or for a trial the run it is a trial of (tracking goes
        there)."""
        return self.trial.run.root if self.trial is not None else self.run_dir.root

    @property
    def checkpoints_dir(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def model_dir(self) -> Path:
        return self.dir / "model"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def section(self) -> Any:
        """This stage's part of the spec."""
        return self.spec.stage(self.stage)

    def begin(self) -> bool:
        """Decide whether to run: False for a no-op (done before, same config); raises StageRefused for a
        completed stage whose config changed, or for checkpoints of another config (unless forced). Forced, a
        training stage starts over: its checkpoints and model from before are moved aside. Records the stage
        as running; a resumed attempt keeps the inputs the earlier attempts recorded.

        First of all, the process that writes the record (rank 0; under torchrun every rank runs the stage, the
        others never write it) takes the stage's lock (`hold_stage_lock`): StageBusy, before anything is read or
        written, while another process runs the stage."""
        if is_main_process():
            hold_stage_lock(self.run_dir, self.stage)
        previous = self.run_dir.read_result(self.stage)
        if previous is not None and previous.status == "succeeded" and not self.force:
            if previous.config_hash == self.config_hash:
                print(f"[{self.stage}] already completed with the same config ({self.config_hash[:12]}): nothing to do")
                self.result = previous
                self.emit_outputs(previous)
                return False
            raise StageRefused(
                f"[{self.stage}] already completed in {self.run_dir.root} with another config "
                f"({previous.config_hash[:12]} there, {self.config_hash[:12]} now). Use a new run directory, "
                "or --force to run it again (its checkpoints and model are moved aside)."
            )
        training = self.stage in TRAINING_STAGES
        if training and not self.force and _stale_outputs(self.dir, previous, self.config_hash):
            made_with = _outputs_config(self.dir, previous)
            raise StageRefused(
                f"[{self.stage}] {self.checkpoints_dir} holds checkpoints of another config "
                f"({made_with[:12] if made_with else 'unknown'} there, {self.config_hash[:12]} now): resuming "
                "from them would continue what that config trained. Use a new run directory, or --force to "
                "start this stage over (they are moved aside)."
            )
        if training and self.force and _has_outputs(self.dir):
            self.supersede(_outputs_config(self.dir, previous))
            previous = None  # a fresh start: new attempt count, new tracking runs
        attempts = 1
        started = now()
        if previous is not None and previous.config_hash == self.config_hash and previous.status != "succeeded":
            attempts = previous.attempts + 1
            started = previous.started_at
            self.resumed = True
        self.result = StageResult(
            stage=self.stage,
            status="running",
            config_hash=self.config_hash,
            started_at=started,
            attempts=attempts,
            mlflow_run_id=previous.mlflow_run_id if previous and self.resumed else None,
            wandb_run_path=previous.wandb_run_path if previous and self.resumed else None,
            # What the earlier attempts loaded (models by content) is what this one must load again: their
            # checkpoints were made from it (stages.modeling.ModelInputs). A forced stage starts over.
            inputs=dict(previous.inputs) if previous and self.resumed and not self.force else {},
        )
        for path in (self.dir, self.logs_dir):
            path.mkdir(parents=True, exist_ok=True)
        if training and is_main_process():
            # The checkpoints about to be written belong to this config (read back by the next attempt).
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            (self.checkpoints_dir / CHECKPOINTS_CONFIG).write_text(self.config_hash + "\n", encoding="utf-8")
        self._write()
        return True

    def supersede(self, made_with: str | None) -> Path | None:
        """Rank 0: move the stage's checkpoints, model and record aside to `superseded-<hash8>-<time>/` (kept,
        never deleted), so the forced attempt starts from scratch. Returns where they went."""
        if not is_main_process():
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        base = f"superseded-{(made_with or 'unknown')[:8]}-{stamp}"
        target = self.dir / base
        n = 1
        while target.exists():
            n += 1
            target = self.dir / f"{base}-{n}"
        target.mkdir(parents=True)
        moved = []
        for name in ("checkpoints", "model", STAGE_JSON):
            if (self.dir / name).exists():
                (self.dir / name).rename(target / name)
                moved.append(name)
        print(
            f"[{self.stage}] --force: {', '.join(moved)} of config {(made_with or 'unknown')[:12]} moved aside to "
            f"{self.run_dir.relative(target)}; config {self.config_hash[:12]} starts from scratch",
            flush=True,
        )
        return target

    def add_input(self, name: str, uri: str, fingerprint: str) -> None:
        assert self.result is not None
        self.result.inputs[name] = InputRef(uri=uri, fingerprint=fingerprint)
        self._write()

    def set_tracking(self, mlflow_run_id: str | None = None, wandb_run_path: str | None = None) -> None:
        """Remember tracking runs early, so a resumed attempt continues the same runs."""
        assert self.result is not None
        if mlflow_run_id:
            self.result.mlflow_run_id = mlflow_run_id
        if wandb_run_path:
            self.result.wandb_run_path = wandb_run_path
        self._write()

    def finish(
        self,
        outputs: dict[str, Path] | None = None,
        metrics: dict[str, float] | None = None,
        extra: dict[str, Any] | None = None,
        status: StageStatus = "succeeded",
        message: str = "",
    ) -> int:
        """Record the outcome (succeeded or skipped) and publish step outputs. Returns EXIT_OK."""
        assert self.result is not None
        result = self.result.model_copy(deep=True)  # kept in memory once written: `result` is what the file says
        result.outputs = {k: self.run_dir.relative(v) for k, v in (outputs or {}).items()}
        result.metrics = {k: float(v) for k, v in (metrics or {}).items()}
        result.extra.update(extra or {})
        result.status = status
        result.message = message
        result.ended_at = now()
        self._write(result)
        self.result = result
        self.emit_outputs(self.result)
        return EXIT_OK

    def fail(self, message: str, retryable: bool = False) -> int:
        """Record a failure (interrupted when retryable). Returns the exit code to use.

        Called while handling a full-disk error, the message says so and what to do. RunDirGone instead when the
        run directory went away: an error it caused is not the stage's to record (`check_still_ours`)."""
        check_still_ours(self.dir)
        handling = sys.exc_info()[1]
        if handling is not None and is_disk_full(handling) and "no space left on the disk" not in message:
            explained = disk_full_message(handling, self.dir)
            message = f"{message}\n{explained}"
            print(f"[{self.stage}] error: {explained}", file=sys.stderr, flush=True)
        if self.result is not None and self.result.status == "running":  # an outcome recorded before stays
            result = self.result.model_copy(deep=True)
            result.status = "interrupted" if retryable else "failed"
            result.message = writable(message)
            result.ended_at = now()
            self._write(result)
            self.result = result
        return EXIT_RETRYABLE if retryable else EXIT_FAILED

    def interrupted(self, exc: BaseException) -> int:
        """Record a SIGTERM or SIGINT (StageInterrupted, or KeyboardInterrupt) that stopped the stage: status
        interrupted, a message naming the signal, and EXIT_RETRYABLE: running the stage again resumes it."""
        signum = interrupt_signal(exc)
        resumes = "resumes from its newest complete checkpoint" if self.stage in TRAINING_STAGES else "runs it again"
        message = f"interrupted by {signal.Signals(signum).name}; running the stage again {resumes}"
        print(f"[{self.stage}] {message}", file=sys.stderr, flush=True)
        return self.fail(message, retryable=True)

    def crash(self, exc: Exception) -> int:
        """Record an error the stage did not expect and return the exit code. A full disk, a GPU out of memory
        and a worker process that died (the OOM killer) are explained without a traceback; anything else keeps its
        traceback (what a bug report needs), printed and written to `logs/traceback.txt`, and the log ends with one
        `error:` line that says where. An error that came of the run directory going away (a file not found
        mid-save) is RunDirGone instead."""
        check_still_ours(self.dir)
        summary = writable(f"{type(exc).__name__}: {exc}".strip())
        if is_disk_full(exc):
            return self.fail(summary)
        if isinstance(exc, ExplainedFailure):
            print(f"[{self.stage}] error: {exc}", file=sys.stderr, flush=True)
            return self.fail(str(exc))
        if type(exc).__name__ == "OutOfMemoryError":
            message = f"the GPU ran out of memory ({str(exc).splitlines()[0] if str(exc) else 'no details'}). "
            message += _memory_hint(self.stage, self.section)
            print(f"[{self.stage}] error: {message}", file=sys.stderr, flush=True)
            return self.fail(message)
        trace = writable("".join(traceback.format_exception(exc)))
        print(trace, file=sys.stderr, end="", flush=True)
        where = self.logs_dir / ("traceback.txt" if rank() == 0 else f"traceback-rank{rank()}.txt")
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text(mask_secrets(trace), encoding="utf-8")
            kept = f"; traceback in {where}"
        except OSError:
            kept = ""
        print(f"[{self.stage}] error: unexpected {summary}{kept}", file=sys.stderr, flush=True)
        return self.fail(f"unexpected {summary}{kept}")

    def emit_outputs(self, result: StageResult) -> None:
        """Write Argo output parameters (one file per value) when the step asked for them."""
        if self.outputs_dir is None or not is_main_process():
            return
        self.outputs_dir.mkdir(parents=True, exist_ok=True)
        values = {
            "status": result.status,
            **{k: str(v) for k, v in result.extra.items() if isinstance(v, str)},
        }
        for name, value in values.items():
            (self.outputs_dir / name).write_text(value, encoding="utf-8")

    def _write(self, result: StageResult | None = None) -> None:
        """Rank 0: write `result` (default: the current record); only the holder of the stage's lock may."""
        result = result or self.result
        if result is None or not is_main_process():
            return
        if not holds_stage_lock(self.run_dir, self.stage):
            raise RuntimeError(f"[{self.stage}] the record is written only by the process holding {LOCK_FILE}")
        self.run_dir.write_result(result)
