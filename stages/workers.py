"""Worker processes of the prepare stage: an ordered parallel map over batches, sized to the pod's CPU request.

Parsing, cleaning and tokenizing are pure per-row work, so prepare sends batches of rows to `num_proc` forked
processes and takes the results back in input order: the output is the same bytes whatever the number of workers.
Each worker builds its own state once (`initializer`, e.g. loading the tokenizer), never per batch. With one process
everything runs inline, without a pool, and so it does, with a warning, where the system cannot start the workers.

The pool is this module's own. `multiprocessing.Pool` replaces a worker the OOM killer took and loses its batch, so
the map waits for it forever, and its terminate deadlocks on a worker killed while holding the shared task queue's
lock; `ProcessPoolExecutor`'s manager thread can wait forever on a message a dying worker half wrote. Here each
worker has a pipe of its own and shares nothing with the others, and the parent waits on the pipes and the workers'
sentinels together: a worker that dies ends the map at once with WorkerDied, which says how it died.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

from run.exits import StageInterrupted
from spec.pipeline import PipelineSpec
from spec.sizing import pod_size
from stages.contract import ExplainedFailure

T = TypeVar("T")
R = TypeVar("R")

IN_FLIGHT_PER_WORKER = 4
"""Batches a worker may have queued or finished ahead of the consumer: enough to keep every worker busy, few
enough that memory stays bounded when the consumer (writing to disk) is the slower side."""

READY = -1
"""The index of a worker's first answer: its state is built (or, with an error, could not be)."""

STOP_SECONDS = 5.0
"""How long workers get to end (told to, or by SIGTERM) before they are killed."""


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
    IN_FLIGHT_PER_WORKER per worker ahead of the consumer. Stopping the iteration early stops the workers; a worker
    that dies raises WorkerDied (StageInterrupted for SIGTERM or SIGINT) at once, its siblings stopped."""
    pool = _start_pool(fn, num_proc, initializer, initargs) if num_proc > 1 else None
    if pool is None:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, batches)
        return
    finished = False
    try:
        yield from pool.map(batches)
        finished = True
    finally:
        pool.stop(finished)


class WorkerDied(ExplainedFailure):
    """A worker process ended while the map still needed it: killed by a signal (SIGKILL is most often the
    out-of-memory killer's) or exited. The message says how, and what to change."""

    def __init__(self, pid: int, exitcode: int | None, num_proc: int) -> None:
        self.pid, self.exitcode = pid, exitcode
        if exitcode is None:
            how = f"worker process {pid} stopped answering (its pipe closed)"
        elif exitcode < 0:
            how = f"worker process {pid} was killed by signal {-exitcode} ({_signal_name(-exitcode)})"
        else:
            how = f"worker process {pid} exited with status {exitcode} before its work was done"
        if exitcode == -signal.SIGKILL:
            advice = (
                f"likely out of memory: lower stages.prepare.num_proc ({num_proc} workers ran) or give the prepare "
                "step more memory (stages.prepare.resources.memory)"
            )
        else:
            advice = "its output above may say why"
        super().__init__(f"{how}, {advice}")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as its cause (as multiprocessing.Pool does)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _start_pool(
    fn: Callable[[T], R], num_proc: int, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]
) -> _Pool | None:
    """`num_proc` forked workers, started; None, with a warning, where the system cannot start them (a process
    limit, a fork refused for memory): the work then runs in this process, slower, with the same output."""
    try:
        with _quiet_tokenizers(), _killable_children():
            return _Pool(multiprocessing.get_context("fork"), fn, num_proc, initializer, initargs)
    except OSError as exc:
        print(f"warning: cannot start {num_proc} worker processes ({exc}); working in this process", file=sys.stderr)
        return None


class _Pool:
    """Forked workers, each with a pipe of its own: `(index, batch)` goes in, `(index, ok, result or error)` comes
    back, after a first answer that says the worker is ready. Nothing is shared between workers (no queue, no lock
    a killed worker could keep), so a worker's death is seen at once, on its sentinel or as the end of its pipe,
    and stopping the rest never waits on it."""

    def __init__(
        self,
        context: Any,
        fn: Callable[[T], R],
        num_proc: int,
        initializer: Callable[..., None] | None,
        initargs: tuple[Any, ...],
    ) -> None:
        self.processes: list[Any] = []
        self.pipes: list[Connection] = []
        # Batches sent to each worker and not answered yet; None until the worker says it is ready. A worker that
        # never is (one forked while another thread held a lock can hang) gets no batch: the others do the work.
        self.load: list[int | None] = []
        try:
            for _ in range(num_proc):
                ours, theirs = context.Pipe()
                # The child closes what it inherits of the other pipes (and our end of its own), so that each
                # worker's pipe ends with that worker, and with this process.
                inherited = [*self.pipes, ours]
                process = context.Process(
                    target=_serve, args=(theirs, inherited, fn, initializer, initargs), daemon=True
                )
                self.pipes.append(ours)
                try:
                    process.start()
                finally:
                    theirs.close()
                self.processes.append(process)
                self.load.append(None)
        except BaseException:
            self.stop(finished=False)
            raise

    def map(self, batches: Iterable[T]) -> Iterator[R]:
        source = iter(batches)
        limit = len(self.processes) * IN_FLIGHT_PER_WORKER
        answers: dict[int, tuple[bool, Any]] = {}
        sent = taken = 0
        exhausted = False
        while True:
            while not exhausted and sent - taken < limit and (worker := self._least_loaded()) is not None:
                try:
                    batch = next(source)
                except StopIteration:
                    exhausted = True
                    break
                self._send(worker, (sent, batch))
                self.load[worker] += 1  # type: ignore[operator]
                sent += 1
            if taken in answers:
                ok, value = answers.pop(taken)
                taken += 1
                if not ok:
                    raise _rebuilt(*value)
                yield value
            elif exhausted and taken == sent:  # nothing left to read or to wait for
                return
            else:
                self._receive(answers)

    def _least_loaded(self) -> int | None:
        """The ready worker with the fewest batches, None when all that are ready have IN_FLIGHT_PER_WORKER."""
        ready = [(load, worker) for worker, load in enumerate(self.load) if load is not None]
        load, worker = min(ready, default=(IN_FLIGHT_PER_WORKER, None))
        return worker if load < IN_FLIGHT_PER_WORKER else None

    def _send(self, worker: int, message: Any) -> None:
        try:
            self.pipes[worker].send(message)
        except OSError:  # the worker's end is closed: it died, before or while this was written
            raise self._died(worker) from None

    def _receive(self, answers: dict[int, tuple[bool, Any]]) -> None:
        """Wait for answers, or for a worker to end; the answers that came go into `answers`."""
        sentinels = [process.sentinel for process in self.processes]
        ready = set(wait([*self.pipes, *sentinels]))
        for worker, pipe in enumerate(self.pipes):
            if pipe in ready:
                try:
                    index, ok, value = pipe.recv()
                except (EOFError, OSError):  # it died, perhaps while writing
                    raise self._died(worker) from None
                if index == READY and not ok:  # its initializer failed
                    raise _rebuilt(*value)
                if index == READY:
                    self.load[worker] = 0
                else:
                    answers[index] = ok, value
                    self.load[worker] -= 1  # type: ignore[operator]
        for worker, sentinel in enumerate(sentinels):
            if sentinel in ready:
                raise self._died(worker)

    def _died(self, worker: int) -> BaseException:
        process = self.processes[worker]
        process.join(timeout=5)  # its pipe or sentinel says it ended: this is at most a moment
        if process.exitcode in (-signal.SIGTERM, -signal.SIGINT):
            # The stage's process group got the signal (the local runner passes it on): the stage is interrupted,
            # whether or not its own handler (a training stage's only sets a flag) has raised yet.
            return StageInterrupted(-process.exitcode)
        return WorkerDied(process.pid, process.exitcode, len(self.processes))

    def stop(self, finished: bool) -> None:
        """End the workers: told to, once all is done; else (stopped early, or failed), and those that never got
        ready, by SIGTERM, since the work they have is not wanted. One still there after a few seconds is killed:
        none is left behind."""
        if finished:
            for pipe in self.pipes:
                with suppress(OSError):
                    pipe.send(None)
        deadline = time.monotonic() + (STOP_SECONDS if finished else 0)
        for process, load in zip(self.processes, self.load, strict=True):
            if load is not None:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()


def _serve(
    pipe: Connection,
    inherited: list[Connection],
    fn: Callable[[T], R],
    initializer: Callable[..., None] | None,
    initargs: tuple[Any, ...],
) -> None:
    """A worker: its state first, then each batch of its pipe, answered in turn, until None or the pipe's end."""
    for other in inherited:
        other.close()
    try:
        _start_worker(initializer, initargs)
    except Exception as exc:
        _answer(pipe, READY, False, _remote(exc))
        return
    if not _answer(pipe, READY, True, None):
        return
    # A thread reads the batches as they come, so that the parent, writing one, never waits on this worker while
    # it is busy writing a result the parent has not read yet.
    batches: queue.SimpleQueue[Any] = queue.SimpleQueue()
    threading.Thread(target=_read_batches, args=(pipe, batches), daemon=True).start()
    while (task := batches.get()) is not None:
        index, batch = task
        try:
            result = True, fn(batch)
        except Exception as exc:
            result = False, _remote(exc)
        if not _answer(pipe, index, *result):
            return


def _read_batches(pipe: Connection, batches: queue.SimpleQueue[Any]) -> None:
    try:
        while (task := pipe.recv()) is not None:
            batches.put(task)
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:
        batches.put(None)


def _answer(pipe: Connection, index: int, ok: bool, value: Any) -> bool:
    """Send an answer (an error in its place when it cannot be pickled); False when the parent is gone."""
    try:
        data = ForkingPickler.dumps((index, ok, value))
    except Exception as exc:
        data = ForkingPickler.dumps((index, False, _remote(exc)))
    try:
        pipe.send_bytes(data)
    except OSError:
        return False
    return True


def _remote(exc: BaseException) -> tuple[BaseException, str]:
    """`exc` as the parent will raise it (itself where it survives pickling, else a RuntimeError that names it),
    and this worker's traceback of it."""
    trace = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(ForkingPickler.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}"), trace
    return exc, trace


def _rebuilt(exc: BaseException, trace: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(f'\n"""\n{trace}"""')
    return exc


@contextmanager
def _killable_children() -> Iterator[None]:
    """SIGTERM at its default disposition while the workers are forked, so that each is born killable by
    `_Pool.stop`. A child forked while another thread of this process held a lock (a stream's, say) can hang
    before `_start_worker` resets the stage's SIGTERM handler; with that handler it would outlive SIGTERM until
    `_Pool.stop` killed it. Only the main thread may set handlers; elsewhere the workers reset it alone."""
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
    would keep `_Pool.stop` from ending it; Ctrl-C is for the parent, which stops the pool), then its state."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer(*initargs)
