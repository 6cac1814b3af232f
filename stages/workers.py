"""Worker processes of the prepare stage: an ordered parallel map over batches, sized to the pod's CPU request.

Parsing, cleaning and tokenizing are pure per-row work, so prepare sends batches of rows to `num_proc` forked
processes and takes the results back in input order (`multiprocessing.Pool.imap`): the output is the same bytes
whatever the number of workers. Each worker builds its own state once (`initializer`, e.g. loading the tokenizer),
never per batch. With one process everything runs inline, without a pool, and so it does, with a warning, where
the system cannot start the workers.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from workflows.sizing import pod_size
from workflows.spec import PipelineSpec

T = TypeVar("T")
R = TypeVar("R")

IN_FLIGHT_PER_WORKER = 4
"""Batches a worker may have queued or finished ahead of the consumer: enough to keep every worker busy, few
enough that memory stays bounded when the consumer (writing to disk) is the slower side."""


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def cpu_quantity(value: str | None) -> float | None:
    """Cores of a Kubernetes CPU quantity ('8', '7.5', '500m'); None when unset or unreadable."""
    if not value:
        return None
    try:
        return float(value[:-1]) / 1000 if value.endswith("m") else float(value)
    except ValueError:
        return None


def default_num_proc(spec: PipelineSpec, in_cluster: bool) -> int:
    """stages.prepare.num_proc, else the prepare pod's CPU request (rounded down; the spec's or the derived one) in
    the cluster, else the machine's usable CPUs; never more than the CPUs this process may use."""
    section = spec.stages.prepare
    if section.num_proc is not None:
        wanted = section.num_proc
    else:
        cores = cpu_quantity(pod_size(spec, "prepare").cpu) if in_cluster else None
        wanted = math.floor(cores) if cores is not None else usable_cpus()
    return max(1, min(wanted, usable_cpus()))


@contextmanager
def _quiet_tokenizers() -> Iterator[None]:
    """Workers run one tokenizer thread each: TOKENIZERS_PARALLELISM=false, set before the fork (the Rust
    library warns in every child otherwise, when the parent used its thread pool)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def ordered_map(
    fn: Callable[[T], R],
    batches: Iterable[T],
    num_proc: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> Iterator[R]:
    """`fn` over `batches` in `num_proc` processes, results in input order. The batches are read lazily, at most
    IN_FLIGHT_PER_WORKER per worker ahead of the consumer. Stopping the iteration early stops the workers."""
    pool = _start_pool(num_proc, initializer, initargs) if num_proc > 1 else None
    if pool is None:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, batches)
        return
    finished = False
    try:
        pending: deque[Any] = deque()
        source = iter(batches)
        limit = num_proc * IN_FLIGHT_PER_WORKER
        exhausted = False
        while True:
            while not exhausted and len(pending) < limit:
                try:
                    batch = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending.append(pool.apply_async(fn, (batch,)))
            if not pending:
                break
            yield pending.popleft().get()
        finished = True
    finally:
        if finished:
            pool.close()
        else:  # stopped early, or failed: the queued work is not wanted
            pool.terminate()
        pool.join()


def _start_pool(num_proc: int, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> Any:
    """A pool of `num_proc` forked workers; None, with a warning, where the system cannot start them (no writable
    /dev/shm for the pool's semaphores, a process limit, a fork refused)."""
    try:
        with _quiet_tokenizers(), _killable_children():
            return multiprocessing.get_context("fork").Pool(num_proc, _start_worker, (initializer, initargs))
    except OSError as exc:
        print(f"warning: cannot start {num_proc} worker processes ({exc}); working in this process", file=sys.stderr)
        return None


@contextmanager
def _killable_children() -> Iterator[None]:
    """SIGTERM at its default disposition while the workers are forked, so that each is born killable by
    `Pool.terminate`. A child forked while another thread of this process held a lock (a stream's, say) can hang
    before `_start_worker` resets the stage's SIGTERM handler; with that handler it would outlive terminate and
    `Pool.join` would wait forever. Only the main thread may set handlers; elsewhere the workers reset it alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _start_worker(initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    """A worker's start: the default signal dispositions (the stage's SIGTERM handler, inherited through the fork,
    would keep `Pool.terminate` from ending it; Ctrl-C is for the parent, which stops the pool), then its state."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer(*initargs)
