"""Warm ranks: a torchrun worker of the tests that forks its stage from the tests' warm-start server instead of
importing torch, transformers, TRL, PEFT and MLflow itself.

A rank's imports take 6-7 s of CPU on a 2-core machine against well under a second of training for the tests' tiny
models, and the tests of tensor, pipeline and expert parallelism start up to four ranks a run, two or three runs a
test. `torchrun_stage(..., warm=True)` (training_fixtures) sets WARM_RANKS; the script torchrun runs for each rank
(stage_hooks.script) then asks the server (workflows/warm_starts.py, stages/warm.py) for a child that is
`python -m stages <argv>` in this worker's environment (torchrun's RANK, MASTER_PORT and the rest are read when the
stage runs, never at import: training_fixtures.RUNTIME_VARIABLES), writing to this worker's stdout, and stands in for
it: SIGTERM and SIGINT from torchrun's agent are passed on, and the worker ends as the child ended (its code, or the
signal that ended it). If this worker dies (SIGKILL), its connection closes and the server sends the child SIGTERM.

What the pod's launch path itself does (torchrun running `python -m stages` in the container, the operator's node
variables) is tested by tests/test_launch.py and tests/test_local_dag.py; the tests that kill a rank, and one
preempted and resumed run each of tensor and pipeline parallelism, start their ranks the usual way (`warm=False`).
"""

from __future__ import annotations

import os
import signal
import sys

WARM_RANKS = "POSTTRAIN_TESTS_WARM_RANKS"
"""Set to 1 in torchrun's environment: each rank forks its stage from the tests' warm-start server."""

FORWARDED = (signal.SIGTERM, signal.SIGINT)
"""What torchrun's agent sends its workers (SIGTERM on a stop or a failed rank; SIGINT on Ctrl-C)."""


def forked(argv: list[str]) -> int | None:
    """Run `python -m stages <argv>` forked from the tests' warm-start server and return how it ended (as an exit
    code; negative: the signal that ended it); None where this rank must run the stage itself (warm ranks not asked
    for, no server, or an environment the server cannot fork in: said on stderr)."""
    from workflows import warm_starts

    address = os.environ.get(warm_starts.SERVER)
    if os.environ.get(WARM_RANKS) != "1" or not address:
        return None
    env = {name: value for name, value in os.environ.items() if name != WARM_RANKS}
    starts = warm_starts.connect(address, env)
    if starts is None:  # connect said why on stderr
        return None
    try:
        sys.stdout.flush()
        child = starts.start([sys.executable, "-m", "stages", *argv], env, output=sys.stdout.fileno())
        if child is None:
            print(f"warning: {warm_starts.SERVER}={address}: no fork; this rank runs its stage itself", file=sys.stderr)
            return None
        print(f"rank {os.environ.get('RANK')}: forked from the tests' warm-start server (pid {child.pid})", flush=True)
        for signum in FORWARDED:
            signal.signal(signum, lambda received, _frame: child.send_signal(received))
        return child.wait()
    finally:
        starts.close()


def end_as(returncode: int) -> None:
    """End this process as its child ended: with its exit code, or killed by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if returncode < 0:
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    os._exit(returncode if returncode >= 0 else 128 - returncode)
