"""`python -m stages <stage> --run-dir DIR`: the one entry point of every stage, in a pod and locally."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from stages.contract import EXIT_USAGE, RunDir, StageContext, StageRefused
from workflows.loading import SpecError
from workflows.spec import STAGE_ORDER


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages", description=__doc__)
    parser.add_argument("stage", choices=STAGE_ORDER, help="Stage to run.")
    parser.add_argument("--run-dir", required=True, type=Path, help="Run directory holding spec.json.")
    parser.add_argument("--force", action="store_true", help="Run a completed stage again even if its config changed.")
    parser.add_argument(
        "--params-dir",
        type=Path,
        help="prepare only: a folder of Argo parameter files (one file per UI parameter) to resolve the spec from.",
    )
    parser.add_argument("--outputs-dir", type=Path, help="Where to write Argo output parameters (one file each).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = RunDir(args.run_dir)
    try:
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
        module = importlib.import_module(f"stages.{args.stage}")
        ctx = StageContext(run_dir, args.stage, spec, force=args.force, outputs_dir=args.outputs_dir)
        return int(module.run(ctx))
    except (StageRefused, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
