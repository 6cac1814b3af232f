"""`python -m stages <stage> --run-dir DIR`: the one entry point of every stage, in a pod and locally.

Expected failures end with one `error:` line that says what to fix, never a bare traceback: a missing or invalid
spec, a stage whose inputs are not there yet (exit 2), a full disk (exit 1). Everything the stage prints goes
through `MaskingStream`, so the value of a secret-looking environment variable never reaches the pod's log.
"""

from __future__ import annotations

import argparse
import importlib
import io
import sys
from pathlib import Path
from typing import TextIO

from pydantic import ValidationError

from stages.contract import (
    EXIT_FAILED,
    EXIT_USAGE,
    RunDir,
    StageContext,
    StageRefused,
    check_ready,
    disk_full_message,
    is_disk_full,
    mask_secrets,
    secret_values,
)
from workflows.loading import SpecError
from workflows.spec import STAGE_ORDER


class MaskingStream(io.TextIOBase):
    """A text stream that replaces secret values before passing the text on (line by line, so a secret is
    never split across two writes)."""

    def __init__(self, target: TextIO, secrets: set[str]) -> None:
        self.target = target
        self.secrets = secrets
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            complete, _, self.pending = self.pending.rpartition("\n")
            self.target.write(mask_secrets(complete + "\n", self.secrets))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.target.write(mask_secrets(self.pending, self.secrets))
            self.pending = ""
        self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.target, "encoding", "utf-8")


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
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Resolve the spec (from --params-dir for prepare in the cluster), check the stage can start, run it."""
    run_dir = RunDir(args.run_dir)
    if args.params_dir is not None:
        if args.stage != "prepare":
            raise StageRefused("--params-dir is only for the prepare stage")
        from workflows.parameters import resolve_params_dir, stage_switches

        resolved = resolve_params_dir(args.params_dir)
        run_dir.root.mkdir(parents=True, exist_ok=True)
        run_dir.write_spec(resolved)
        if args.outputs_dir is not None:
            # Which stages run is decided here, from validated values, never from raw form input.
            args.outputs_dir.mkdir(parents=True, exist_ok=True)
            for name, value in stage_switches(resolved).items():
                (args.outputs_dir / name).write_text(value, encoding="utf-8")
    spec = run_dir.load_spec()
    result = run_dir.read_result(args.stage) if run_dir.result_path(args.stage).is_file() else None
    if result is None or result.status != "succeeded":
        check_ready(run_dir, spec, args.stage)
    module = importlib.import_module(f"stages.{args.stage}")
    ctx = StageContext(run_dir, args.stage, spec, force=args.force, outputs_dir=args.outputs_dir)
    return int(module.run(ctx))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    secrets = secret_values()
    streams = sys.stdout, sys.stderr
    if secrets:
        sys.stdout, sys.stderr = MaskingStream(sys.stdout, secrets), MaskingStream(sys.stderr, secrets)
    try:
        return run(args)
    except (StageRefused, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
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
        if secrets:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
