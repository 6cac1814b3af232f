"""A worker process of prepare that dies (the OOM killer's SIGKILL, a crash, an exit) fails the map at once: the
stage ends within seconds, recorded failed (exit 1) with one `error:` line that says how the worker died and what to
change, no traceback, and no worker left behind. A map that waited for the lost batch would hang for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import faults
import pytest
from training_fixtures import REPO, child_env, text_rows, write_jsonl

from run.exits import EXIT_FAILED
from run.run_dir import RunDir
from spec.loading import load_pipeline

ONLY_CPT = [f"stages.{s}.enabled=false" for s in ("sft", "rlhf", "evaluate", "deploy")]
ADVICE = "likely out of memory: lower stages.prepare.num_proc (2 workers ran)"


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="prepare runs in one process here: no workers")
def test_a_prepare_worker_killed_fails_the_stage_in_seconds_with_one_error_line(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, text_rows(3000))  # six batches of rows
    overrides = ["tracking.wandb_project=null", *ONLY_CPT, f"stages.cpt.data.uri={corpus}", "stages.prepare.num_proc=2"]
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(load_pipeline("korean-llm", "local", overrides).spec)
    stage = faults.start(run_dir, "prepare", KILL_PREPARE_WORKER="2")
    workers: list[Path] = []
    deadline = time.monotonic() + 300  # the stage's start, on a loaded machine
    while stage.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        workers = list(faults.fault_dir(run_dir).glob("worker-*"))
        if len(workers) == 2:
            break
    assert len(workers) == 2, faults.output_of(stage)[-3000:]
    try:
        code = stage.wait(timeout=60)  # the kill comes at a worker's second batch
    except subprocess.TimeoutExpired:
        faults.sigkill(stage)
        pytest.fail("prepare waited for its dead worker:\n" + faults.output_of(stage)[-3000:])
    ended = time.time()
    out = faults.output_of(stage)
    killed = list(faults.fault_dir(run_dir).glob("killed-*"))  # both workers, when they reach the batch together
    assert killed and ended - min(p.stat().st_mtime for p in killed) < 10, "the stage should end within seconds"
    assert code == EXIT_FAILED, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "was killed by signal 9 (SIGKILL), " + ADVICE in errors[0], out[-3000:]
    assert any(f"worker process {p.name.split('-')[1]} was" in errors[0] for p in killed)
    assert "Traceback" not in out
    result = run_dir.read_result("prepare")
    assert result.status == "failed" and "SIGKILL" in result.message and ADVICE in result.message
    assert not [p for p in workers if alive(int(p.name.split("-")[1]))], "a worker was left behind"
    data = run_dir.stage_dir("prepare") / "data"
    left = [p for p in data.rglob("*") if p.is_file()] if data.exists() else []
    assert left == [], "half-written data left behind"


# --------------------------------------------------------------------------- the map itself, in a child process

_MAP = """
import json, os, signal, sys, time
from stages import workers

def report(**what):
    print(json.dumps({"pids": sorted(pids()), **what}), flush=True)

def pids():
    children = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    return [int(p) for p in open(children).read().split()]

seen = []
def note_pids(results):
    for result in results:
        seen.extend(pids())
        yield result

%s

started = time.monotonic()
try:
    out = list(note_pids(workers.ordered_map(fn, batches, 2, *init)))
    report(out=out)
except BaseException as exc:
    report(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started, workers=sorted(set(seen)))
"""


def map_in_child(scenario: str) -> dict:
    """Run ordered_map over `scenario`'s fn, batches and init in a child (a map that hangs fails the test instead
    of hanging it): its result or error, how long it took, the workers it saw and the children left at the end."""
    with tempfile.TemporaryDirectory() as scratch:  # the scenario's files
        done = subprocess.run(
            [sys.executable, "-c", _MAP % scenario],
            env=child_env(PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=scratch,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.splitlines()[-1]), "stderr": done.stderr}


def test_a_worker_killed_mid_map_raises_worker_died_with_the_advice() -> None:
    # killed at the 51st item: the map has yielded results (and seen its workers) before, however loaded the box
    got = map_in_child(
        """
def fn(x):
    if x == 50:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.01)
    return x * x
batches, init = range(100), ()
"""
    )
    assert got["error"].startswith("WorkerDied: worker process ")
    assert "was killed by signal 9 (SIGKILL), " + ADVICE in got["error"], got
    assert got["seconds"] < 10 and got["pids"] == [] and got["workers"]
    assert not [pid for pid in got["workers"] if alive(pid)]


def test_a_worker_that_exits_without_a_signal_says_its_status() -> None:
    got = map_in_child(
        """
def fn(x):
    if x == 3:
        os._exit(3)
    return x
batches, init = range(100), ()
"""
    )
    assert "exited with status 3 before its work was done" in got["error"], got
    assert got["seconds"] < 10 and got["pids"] == []


def test_a_worker_ended_by_sigterm_interrupts_the_stage() -> None:
    """SIGTERM passed on to the stage's process group ends its workers too: the stage is interrupted (exit 75),
    even where its own handler only sets a flag (a training stage building its token cache)."""
    got = map_in_child(
        """
def fn(x):
    if x == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    return x
batches, init = range(100), ()
"""
    )
    assert got["error"] == "StageInterrupted: interrupted by SIGTERM" and got["pids"] == []


def test_a_worker_killed_while_the_parent_writes_to_it_ends_the_write() -> None:
    """A worker stops at its first batch (SIGSTOP: it reads nothing more) and is killed a second later; its
    batches are far bigger than a pipe holds, so the parent is blocked writing the next one to it by then."""
    got = map_in_child(
        """
import threading
def fn(batch):
    if batch[0] == 1:
        with open("stopped.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace("stopped.tmp", "stopped")
        os.kill(os.getpid(), signal.SIGSTOP)
    return len(batch)
def killer():
    while not os.path.exists("stopped"):
        time.sleep(0.05)
    time.sleep(1)
    os.kill(int(open("stopped").read()), signal.SIGKILL)
threading.Thread(target=killer, daemon=True).start()
batches, init = (bytes([i + 1]) * (16 << 20) for i in range(16)), ()
"""
    )
    assert "killed by signal 9 (SIGKILL)" in got["error"], got
    assert got["seconds"] < 10 and got["pids"] == []


def test_a_worker_that_never_gets_ready_is_left_out_and_stopped_at_the_end() -> None:
    """A worker can hang as it starts (forked while another thread of the stage held a lock): it gets no batch,
    the others do the work, and it is ended with the map."""
    got = map_in_child(
        """
def one_hangs():
    try:
        os.close(os.open("hung", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    time.sleep(600)
def fn(x):
    return -x
batches, init = range(40), (one_hangs,)
"""
    )
    assert got["out"] == [-x for x in range(40)] and got["pids"] == []


def test_an_initializer_that_fails_raises_its_error_instead_of_restarting_workers() -> None:
    got = map_in_child(
        """
def broken():
    raise KeyError("tokenizer.json")
fn, batches, init = abs, range(10), (broken,)
"""
    )
    assert got["error"] == "KeyError: 'tokenizer.json'" and got["pids"] == []


def test_the_results_keep_their_order_and_a_workers_error_is_raised_in_its_place() -> None:
    got = map_in_child(
        """
def fn(x):
    time.sleep(0.002 * (x % 3))  # answers come back out of order
    return -x
batches, init = range(200), ()
"""
    )
    assert got["out"] == [-x for x in range(200)] and got["pids"] == []
    got = map_in_child(
        """
def fn(x):
    if x == 7:
        raise ValueError(f"row {x}")
    return x
batches, init = range(50), ()
"""
    )
    assert got["error"] == "ValueError: row 7" and got["pids"] == []
