"""The stage contract: the rules a stage follows with its run directory, and the context it runs in.

The run directory itself (`spec.json`, `stage.json`, locks) is `run/run_dir.py`, config hashes `run/config_hash.py`,
exit codes and interrupts `run/exits.py`: the local runner reads them too. A stage's folder holds:

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
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from run.config_hash import config_hash, has_outputs, outputs_config, record_outputs_config, stale_outputs
from run.exits import EXIT_FAILED, EXIT_OK, EXIT_RETRYABLE, interrupt_signal
from run.masking import mask_secrets
from run.run_dir import (
    LOCK_FILE,
    STAGE_JSON,
    InputRef,
    RunDir,
    StageRefused,
    StageResult,
    StageStatus,
    check_still_ours,
    hold_stage_lock,
    holds_stage_lock,
    now,
)
from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class ExplainedFailure(Exception):
    """A failure whose message says all a user needs (what happened, what to change), recorded without a
    traceback: a prepare worker killed by the OOM killer, say (stages.workers.WorkerDied)."""


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


class NotSupportedHere(RuntimeError):
    """The spec asks for something this machine cannot do (e.g. QLoRA without a CUDA GPU, DeepSpeed without GPUs)."""


def rank() -> int:
    """Global rank under torchrun (0 when not distributed)."""
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """True on the process that logs and writes records."""
    return rank() == 0


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
        if training and not self.force and stale_outputs(self.dir, previous, self.config_hash):
            made_with = outputs_config(self.dir, previous)
            raise StageRefused(
                f"[{self.stage}] {self.checkpoints_dir} holds checkpoints of another config "
                f"({made_with[:12] if made_with else 'unknown'} there, {self.config_hash[:12]} now): resuming "
                "from them would continue what that config trained. Use a new run directory, or --force to "
                "start this stage over (they are moved aside)."
            )
        if training and self.force and has_outputs(self.dir):
            self.supersede(outputs_config(self.dir, previous))
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
            # The checkpoints about to be written belong to this config (read back by the next attempt)
            record_outputs_config(self.dir, self.config_hash)
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
