"""The runs CLI: commands on run directories.

    python -m workflows.runs sync-tracking runs/korean-llm-20260101-000000

`sync-tracking DIR` sends to MLflow what the stages of a run directory could not send during an outage (each
stage's `<stage>/logs/tracking-unsent.jsonl`) and ends the MLflow runs of stage attempts that died without
ending them (KILLED), so that no run of a finished stage stays RUNNING. It is safe to run any number of times,
also while a stage runs (that stage's journal is left to it). Exit status: 0 when everything got through, 1 when
something is still pending (the server is unreachable, or a process runs that stage), 2 when DIR is not a
run directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXAMPLE = """example:
  python -m workflows.runs sync-tracking runs/korean-llm-20260101-000000
  MLFLOW_TRACKING_URI=https://mlflow.example.com python -m workflows.runs sync-tracking /mnt/checkpoints/runs/NAME

The tracking server is the run's own: spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else the
run directory's mlflow.db."""


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m workflows.runs",
        description="Commands on run directories.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sync = commands.add_parser(
        "sync-tracking",
        help="Send what the stages could not send to MLflow during an outage; end runs left RUNNING.",
        description="Send every stage's unsent MLflow records (<stage>/logs/tracking-unsent.jsonl) of a run\n"
        "directory, and end the MLflow runs of stage attempts that died (KILLED). Exit 0 when everything got\n"
        "through, 1 when something is still pending, 2 when DIR is not a run directory.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sync.add_argument("run_dir", metavar="DIR", type=Path, help="A run directory (the one holding spec.json).")
    return p


def sync_tracking_command(run_dir: Path) -> int:
    """Run `sync-tracking` on `run_dir`, print what was sent and what is pending; returns the exit status."""
    if not (run_dir / "spec.json").is_file():
        what = "does not exist" if not run_dir.exists() else "has no spec.json"
        print(
            f"error: {run_dir} is not a run directory ({what}); give the directory a run was started in, "
            "e.g. runs/korean-llm-20260101-000000",
            file=sys.stderr,
        )
        return 2
    from stages.__main__ import MaskingStream
    from stages.contract import secret_values

    # What MLflow prints (its run links name the tracking URI, credentials and all) is masked, as in a stage.
    streams = sys.stdout, sys.stderr
    secrets = secret_values()
    sys.stdout, sys.stderr = MaskingStream(sys.stdout, secrets), MaskingStream(sys.stderr, secrets)
    try:
        return _sync_and_report(run_dir)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


def _sync_and_report(run_dir: Path) -> int:
    """Send the journals, print per stage what was sent and what is pending; returns the exit status."""
    from stages.contract import RunDir, StageRefused
    from stages.tracking import sync_tracking
    from workflows.loading import SpecError

    try:
        report = sync_tracking(RunDir(run_dir))
    except (SpecError, StageRefused) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {run_dir}/spec.json is not a readable run spec ({first})", file=sys.stderr)
        return 2
    print(f"MLflow at {report.uri}")
    if not report.stages:
        print("  nothing to send: no stage left unsent records or a run open")
    for stage in report.stages:
        parts = []
        if stage.sent or stage.already:
            parts.append(
                f"sent {stage.sent} records" + (f" ({stage.already} were there already)" if stage.already else "")
            )
        if stage.pending:
            parts.append(f"{stage.pending} still pending")
        parts += stage.notes
        print(f"  {stage.stage}: {'; '.join(parts) or 'nothing to send'}")
    if report.unreachable is not None:
        print(
            f"error: MLflow at {report.uri} could not be reached ({report.unreachable}): {report.pending} records "
            f"are still pending; run `python -m workflows.runs sync-tracking {run_dir}` again once it is back",
            file=sys.stderr,
        )
        return 1
    if report.pending:
        print(f"{report.pending} records are still pending (see above)", file=sys.stderr)
        return 1
    print("everything got through")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "sync-tracking":
        return sync_tracking_command(args.run_dir)
    return 2  # argparse already refused anything else


if __name__ == "__main__":
    sys.exit(main())
