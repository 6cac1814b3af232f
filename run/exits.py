"""How a stage and the local runner end: exit codes, and the interrupts (SIGTERM, SIGINT) that stop them.

A stage exits EXIT_OK, EXIT_FAILED, EXIT_USAGE (bad input: nothing was started or written) or EXIT_RETRYABLE
(interrupted or preempted: Argo's retry, or a rerun, resumes from the checkpoint). SIGTERM and SIGINT raise
StageInterrupted inside `interrupts_raise()`, in a stage and in the local runner alike.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_GATE_FAILED = 3
"""`--local --fail-on-gate`: every stage ran, but the gate failed and deploy was skipped (the runner's only)."""
EXIT_RETRYABLE = 75  # EX_TEMPFAIL: preempted; Argo's retry (or a rerun) resumes from the checkpoint


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


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_runner() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the stage process get SIGTERM when the runner dies, however it dies (Linux
    `prctl(PR_SET_PDEATHSIG)`; None elsewhere). The signal comes when the thread that started the stage ends, which
    is the runner's main thread. A runner that died before the call leaves the stage to exit at once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: after fork, only the call runs
    except (OSError, AttributeError):
        return None
    runner = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != runner:  # the runner is already gone
            os._exit(EXIT_RETRYABLE)

    return preexec
