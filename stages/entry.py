"""A stage module's entry, `run(ctx)` around the stage's body: how a stage begins, what ends it early.

Each stage module reads `run` (begin, then its body) → its body, top to bottom; what ends a stage early is decided
here once, as the contract (stages/contract.py) says:
- a completed stage with the same config is a no-op (`StageContext.begin` says so), exit EXIT_OK;
- StageRefused after the stage began (an input changed since its producer recorded it, a record missing) is
  recorded as failed and raised on: `python -m stages` prints its one `error:` line, exit EXIT_USAGE;
- an error the stage expects (the spec asks for what this machine cannot do, a reward function that cannot be
  used, data that cannot be read, storage that cannot be published to) is one `error:` line, recorded as failed,
  exit EXIT_FAILED, without a traceback;
- anything else is `StageContext.crash`: its traceback kept, the stage recorded as failed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from run.exits import EXIT_OK
from run.run_dir import StageRefused
from stages.contract import StageContext

if TYPE_CHECKING:
    from stages.checkpoints import SigtermCheckpoint


def run_stage(
    ctx: StageContext,
    body: Callable[[], int],
    expected: tuple[type[Exception], ...] = (),
    labelled: bool = True,
    sigterm: SigtermCheckpoint | None = None,
) -> int:
    """Begin the stage, run `body`, and end it as the contract says; returns the process exit code.

    An `expected` error's line is `[<stage>] error: ...` on stderr when `labelled`, else `error: ...` on stdout
    (with the training log). A training stage passes its `sigterm` checkpoint callback: it is installed once the
    stage began (SIGTERM and SIGINT then save a checkpoint) and uninstalled when the body ends, however it ends."""
    if not ctx.begin():
        return EXIT_OK
    if sigterm is not None:
        sigterm.install()
    try:
        return body()
    except StageRefused as exc:
        ctx.fail(str(exc))
        raise
    except expected as exc:
        if labelled:
            print(f"[{ctx.stage}] error: {exc}", file=sys.stderr, flush=True)
        else:
            print(f"error: {exc}", flush=True)
        return ctx.fail(str(exc))
    except Exception as exc:
        return ctx.crash(exc)
    finally:
        if sigterm is not None:
            sigterm.uninstall()
