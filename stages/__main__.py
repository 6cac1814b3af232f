"""`python -m stages <stage> --run-dir DIR`: the one entry point of every stage, in a pod and locally.

A training stage also runs the trials of its hyperparameter search (`--trial NAME --trial-set path=value ...`,
stages/trials.py), `python -m stages hpo-select ...` selects the search's best trial (stages/hpo.py), and
`python -m stages sync-tracking --run-dir DIR` sends what a run's stages could not send to MLflow during an outage
(stages/tracking_outbox.py; `posttrain runs sync-tracking DIR` runs it), and `python -m stages check-data --spec FILE`
checks each enabled stage's data on its first rows before a run starts (stages/check_data.py; `workflows.submit
--local` and `--dry-run` run it, exit 2 with one `error:` line per problem; prepare runs the same check first).

Expected failures end with one `error:` line that says what to fix, never a bare traceback: a missing or invalid
spec, a stage whose inputs are not there yet (exit 2), a full disk (exit 1), a stage another process is running
(exit 75, nothing written), a run directory deleted or replaced while the stage ran (exit 1, nothing more written:
`run.run_dir.check_still_ours`). Everything the stage prints goes through `MaskingStream`, so neither the value of a
secret-looking environment variable nor anything credential-shaped (`spec.credentials`) reaches the log.

Whatever escapes a stage ends as a truthful record: SIGTERM and SIGINT raise `StageInterrupted` (training stages
first save a checkpoint, see `stages.checkpoints.SigtermCheckpoint`), recorded as interrupted with exit 75; any
other exception goes through `StageContext.crash` (traceback file, one `error:` line, recorded as failed).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from pathlib import Path

from pydantic import ValidationError

from run.exits import (
    EXIT_FAILED,
    EXIT_RETRYABLE,
    EXIT_USAGE,
    INTERRUPTS,
    StageInterrupted,
    interrupt_signal,
    interrupts_raise,
)
from run.masking import MaskingStream, PassThrough, secret_values
from run.run_dir import RunDir, RunDirGone, StageBusy, StageRefused, check_still_ours, hold_stage_lock
from run.search import apply_selections
from spec.document import SpecError
from spec.fields import STAGE_ORDER
from stages.contract import StageContext, check_ready, disk_full_message, is_disk_full
from stages.float8 import quiet_torchao_import
from stages.trials import prepare_trial, report_metrics


class ReaderSafeStream(PassThrough):
    """A text stream that outlives its reader. When a write finds the pipe closed (the local runner that read the
    stage's output was killed), the process's stdout and stderr are pointed at /dev/null, so that no later print,
    nor the flush at exit, fails: the stage goes on to save and to record how it ended."""

    def write(self, text: str) -> int:
        try:
            self.target.write(text)
        except BrokenPipeError:
            output_to_devnull()
        return len(text)

    def flush(self) -> None:
        try:
            self.target.flush()
        except BrokenPipeError:
            output_to_devnull()

    def __getattr__(self, name: str) -> object:  # e.g. `buffer`, for code that writes bytes
        return getattr(self.target, name)


def output_to_devnull() -> None:
    """Point file descriptors 1 and 2 at /dev/null (what Python's documentation advises after EPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages", description=__doc__)
    parser.add_argument("stage", choices=STAGE_ORDER, help="Stage to run.")
    parser.add_argument("--run-dir", required=True, type=Path, help="Run directory holding spec.json.")
    parser.add_argument(
        "--force",
        action="store_true",
        help="Run the stage again, also when it completed with another config; a training stage starts over "
        "(its checkpoints and model from before are moved aside to <stage>/superseded-<hash8>-<time>/).",
    )
    parser.add_argument(
        "--params-dir",
        type=Path,
        help="prepare only: a folder of Argo parameter files (one file per UI parameter) to resolve the spec from.",
    )
    parser.add_argument("--outputs-dir", type=Path, help="Where to write Argo output parameters (one file each).")
    parser.add_argument(
        "--trial",
        metavar="NAME",
        help="Training stages: run a trial of the stage's hyperparameter search (stages.<stage>.hpo) in "
        "<run-dir>/hpo/<stage>/trials/NAME/, for hpo.trial_max_steps steps (see stages/trials.py).",
    )
    parser.add_argument(
        "--trial-set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="With --trial: the trial's value of a searched parameter (its path inside the stage), once for each.",
    )
    return parser.parse_args(argv)


def ignore_interrupts() -> None:
    """While the outcome is being recorded, a further SIGTERM or Ctrl-C must not cut the record short."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_IGN)


def missing_spec(run_dir: RunDir, stage: str) -> str:
    """What to say when the run directory has no spec.json: who writes it, and how to make one."""
    start = f"python -m workflows.submit <pipeline> --local --run-dir {run_dir.root}"
    if stage == "prepare":
        return (
            f"{run_dir.spec_path} is missing: prepare reads the run's spec from it. `{start}` writes it and runs "
            "prepare (in the cluster, prepare gets --params-dir and writes it)"
        )
    return (
        f"{run_dir.spec_path} is missing: {run_dir.root} is not a prepared run; run the prepare stage first "
        f"(`{start}` writes spec.json and runs prepare, then {stage})"
    )


def run(args: argparse.Namespace) -> int:
    """Resolve the spec (from --params-dir for prepare in the cluster), check the stage can start, run it."""
    run_dir = RunDir(args.run_dir)
    if args.params_dir is not None:
        if args.stage != "prepare":
            raise StageRefused("--params-dir is only for the prepare stage")
        from spec.form import resolve_params_dir, stage_switches

        # A search that already selected in this run directory keeps its values (prepare run again).
        resolved = apply_selections(resolve_params_dir(args.params_dir), run_dir.root)
        hold_stage_lock(run_dir, "prepare")  # before spec.json: a second prepare pod must not rewrite it
        run_dir.write_spec(resolved)
        if args.outputs_dir is not None:
            # Which stages run is decided here, from validated values, never from raw form input.
            args.outputs_dir.mkdir(parents=True, exist_ok=True)
            for name, value in stage_switches(resolved).items():
                (args.outputs_dir / name).write_text(value, encoding="utf-8")
    if not run_dir.spec_path.is_file():
        raise StageRefused(missing_spec(run_dir, args.stage))
    spec = run_dir.load_spec()
    trial, objective = None, ""
    if args.trial is not None:
        if args.params_dir is not None:
            raise StageRefused("--trial runs a trial of a stage of a prepared run; --params-dir is for prepare")
        check_ready(run_dir, spec, args.stage)  # the run's inputs, before the trial's folder is made
        run_dir, spec, trial = prepare_trial(run_dir, spec, args.stage, args.trial, args.trial_set)
        objective = trial.objective
    elif args.trial_set:
        raise StageRefused("--trial-set is for a trial: give --trial NAME too")
    result = run_dir.read_result(args.stage) if run_dir.result_path(args.stage).is_file() else None
    if result is None or result.status != "succeeded" or args.force:  # a stage that will run needs its inputs
        check_ready(run_dir, spec, args.stage)
    module = importlib.import_module(f"stages.{args.stage}")
    ctx = StageContext(run_dir, args.stage, spec, force=args.force, outputs_dir=args.outputs_dir, trial=trial)
    try:
        code = int(module.run(ctx))
        check_still_ours(run_dir.root)  # the stage's end: a run directory gone meanwhile is no success
        if trial is not None and code == 0:
            code = report_metrics(run_dir, args.stage, objective)
        return code
    except (StageInterrupted, KeyboardInterrupt) as exc:
        ignore_interrupts()
        return ctx.interrupted(exc)
    except StageRefused as exc:  # main() prints it; refused after it began, the record says so too
        ctx.fail(str(exc))
        raise
    except StageBusy:
        raise
    except Exception as exc:
        if ctx.result is None:  # nothing recorded yet (e.g. an invalid stage.json): main() says what to fix
            raise
        ignore_interrupts()
        return ctx.crash(exc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_torchao_import()
    if argv[:1] == ["hpo-select"]:
        from stages.hpo import main as select_main

        return select_main(argv[1:])
    if argv[:1] == ["check-data"]:
        from stages.check_data import main as check_main

        return check_main(argv[1:])
    if argv[:1] == ["sync-tracking"]:
        from stages.tracking_outbox import main as sync_main

        return sync_main(argv[1:])
    args = parse_args(argv)
    secrets = secret_values()
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ReaderSafeStream(sys.stdout), ReaderSafeStream(sys.stderr)
    # Always: besides the environment's secret values, anything credential-shaped (a URI's user:password@) is masked.
    sys.stdout, sys.stderr = MaskingStream(sys.stdout, secrets), MaskingStream(sys.stderr, secrets)
    try:
        with interrupts_raise():
            return run(args)
    except (StageRefused, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunDirGone as exc:  # nothing to record: the record's folder is gone
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except StageBusy as exc:
        # 75 (EX_TEMPFAIL), not 2: the request is fine, only not now. In the cluster this is a retry (Argo's, or a
        # restarted pod) that starts while the previous attempt still runs; a retry later finds the lock free.
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RETRYABLE
    except (StageInterrupted, KeyboardInterrupt) as exc:  # before the stage began: nothing to record
        name = signal.Signals(interrupt_signal(exc)).name
        print(f"[{args.stage}] interrupted by {name} before it started; nothing recorded", file=sys.stderr)
        return EXIT_RETRYABLE
    except ValidationError as exc:  # a stage.json that is not a stage record (edited, or from another version)
        first = str(exc).splitlines()[0]
        print(f"error: {args.run_dir}/{args.stage}/stage.json is not a valid stage record ({first})", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        print(f"error: [{args.stage}] {disk_full_message(exc, args.run_dir.absolute())}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
