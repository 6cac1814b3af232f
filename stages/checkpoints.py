"""Checkpoints of a training stage: layout, the completeness marker, newest-valid selection, and SIGTERM.

Layout: `<run>/<stage>/checkpoints/checkpoint-<step>/`, as the Trainer writes them (weights as safetensors,
optimizer, scheduler, RNG and trainer state). When every rank has finished writing one, rank 0 adds the
marker file `COMPLETE`, last. A checkpoint without the marker, or whose files cannot be read, is torn (the pod
was killed while saving): resuming warns, moves it aside as `torn-checkpoint-<step>` and takes the one before.

SIGTERM (preemption, node drain) and SIGINT (Ctrl-C) set a flag; at the end of the step in progress the trainer saves
a checkpoint and stops, and the stage exits with EXIT_RETRYABLE so that Argo's retry (or a rerun) resumes from it.
"""

from __future__ import annotations

import json
import re
import signal
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from run.exits import INTERRUPTS, StageInterrupted
from run.run_dir import check_still_ours, write_json_atomic
from stages.contract import is_main_process

MARKER = "COMPLETE"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_WEIGHTS = ("model.safetensors", "adapter_model.safetensors", "model.safetensors.index.json")


def checkpoint_step(path: Path) -> int | None:
    """The step of a `checkpoint-<step>` directory, None for anything else."""
    match = _CHECKPOINT.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """`checkpoint-<step>` directories, newest (highest step) first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0, reverse=True)


def mark_complete(checkpoint: Path, step: int) -> None:
    """Write the completeness marker (last, after every file of the checkpoint)."""
    write_json_atomic(checkpoint / MARKER, {"step": step, "time": time.time()})


def why_invalid(checkpoint: Path) -> str | None:
    """None for a complete, readable checkpoint; otherwise what is wrong with it."""
    if not (checkpoint / MARKER).is_file():
        return f"no {MARKER} marker (interrupted while saving)"
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        if state.get("global_step") != checkpoint_step(checkpoint):
            return "trainer_state.json is for another step"
    except (OSError, ValueError) as exc:
        return f"trainer_state.json is unreadable ({exc})"
    weights = [checkpoint / name for name in _WEIGHTS if (checkpoint / name).is_file()]
    if not weights and not any(checkpoint.glob("pytorch_model_fsdp*")) and not any(checkpoint.glob("global_step*")):
        return "no model weights"
    for path in weights:
        try:
            if path.suffix == ".json":
                index = json.loads(path.read_text(encoding="utf-8"))
                shards = {checkpoint / name for name in index["weight_map"].values()}
                missing = [s.name for s in shards if not s.is_file()]
                if missing:
                    return f"missing weight shards {missing}"
                for shard in shards:
                    _read_safetensors_header(shard)
            else:
                _read_safetensors_header(path)
        except (OSError, ValueError, KeyError) as exc:
            return f"{path.name} is unreadable ({exc})"
    return None


def check_safetensors(path: Path) -> None:
    """Raise ValueError (or OSError) unless the safetensors file is whole."""
    _read_safetensors_header(path)


def _read_safetensors_header(path: Path) -> None:
    """Check that a safetensors file is whole: its header parses and its data reaches the end the header
    names (cheap: reads the header only). Raises ValueError for a torn file."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if path.stat().st_size != 8 + size + end:
        raise ValueError(f"{path.stat().st_size} bytes, the header says {8 + size + end}")


def newest_valid_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest checkpoint that is complete and readable, warning about each newer one that is torn."""
    for checkpoint in list_checkpoints(checkpoints_dir):
        problem = why_invalid(checkpoint)
        if problem is None:
            return checkpoint
        warnings.warn(f"checkpoint {checkpoint} is torn: {problem}; falling back to an earlier one", stacklevel=2)
    return None


def set_aside_torn(checkpoints_dir: Path, keep: Path | None) -> list[Path]:
    """Rank 0: move checkpoints newer than `keep` (the one resumed from) to `torn-checkpoint-<step>`, so the
    trainer neither rotates them nor mixes their files into the checkpoint it writes at the same step."""
    if not is_main_process():
        return []
    keep_step = checkpoint_step(keep) if keep is not None else None
    moved = []
    for checkpoint in list_checkpoints(checkpoints_dir):
        if keep_step is None or (checkpoint_step(checkpoint) or 0) > keep_step:
            target = checkpoint.with_name(f"torn-{checkpoint.name}-{int(time.time())}")
            checkpoint.rename(target)
            moved.append(target)
    return moved


class CheckpointMarker(TrainerCallback):
    """Writes the completeness marker once every rank has finished saving a checkpoint.

    It also stops training (RunDirGone) at the end of the first step after the run directory was deleted or
    replaced (`check_still_ours`): before the Trainer would save a checkpoint, or log, into a folder made again
    under the old name. A checkpoint saved while it went away gets no marker."""

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        check_still_ours(args.output_dir)
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if is_main_process():
            check_still_ours(args.output_dir)
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                mark_complete(checkpoint, state.global_step)
        return control


class SigtermCheckpoint(TrainerCallback):
    """On SIGTERM (preemption) or SIGINT (Ctrl-C): save a checkpoint at the end of the current step and stop
    training; a second SIGINT interrupts at once (StageInterrupted: the stage is recorded as interrupted and
    resumes from its newest complete checkpoint).

    The signal handler only sets a flag. Under torchrun the ranks agree on it (an all-reduce each step), so
    they all save at the same step. `stopped` tells the stage to exit with EXIT_RETRYABLE; `signal_name` names
    the signal for its record. Uninstalling brings back the handlers from before (the entry point's, which raise
    StageInterrupted).
    """

    def __init__(self) -> None:
        self.requested = False
        self.stopped = False
        self.signum: int | None = None
        self.sigints = 0
        self._previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str:
        """SIGTERM or SIGINT: the signal that stopped training (SIGTERM when none did)."""
        return signal.Signals(self.signum or signal.SIGTERM).name

    def install(self) -> SigtermCheckpoint:
        """Route SIGTERM and SIGINT to this callback (main thread only)."""
        self._previous = {signum: signal.signal(signum, self._handle) for signum in INTERRUPTS}
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self.sigints += 1
            if self.sigints > 1:  # Ctrl-C twice: the user does not want to wait for the step to end
                print(f"{name} again: stopping now, without a checkpoint of this step", flush=True)
                raise StageInterrupted(signum)
        print(f"{name} received: saving a checkpoint at the end of this step, then exiting", flush=True)
        if signum == signal.SIGINT:
            print("(press Ctrl-C again to stop at once)", flush=True)
        self.requested = True
        self.signum = self.signum or signum

    def _agreed(self, args: TrainingArguments) -> bool:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self.requested
        flag = torch.tensor([int(self.requested)], device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self._agreed(args):
            control.should_save = True
            control.should_training_stop = True
            self.stopped = state.global_step < state.max_steps
        return control
