"""`python -m workflows.switches`: which variants a run trains, read from the form's `run-<variant>` values.

    python -m workflows.switches --params-dir /params --outputs-dir /tmp/outputs qwen-7b qwen-72b

The first step of a pipeline with variants. Argo writes each `run-<variant>` parameter into a file (a value never
reaches an expression or a command line); this step checks each is `true` or `false` and writes it back as an
output, which the DAG's conditions then read. A bad value fails the run here with the parameter named (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def read_switches(params_dir: Path, variants: list[str]) -> dict[str, str]:
    """`run-<variant>` → 'true'/'false' for each variant; ValueError naming the parameter whose value is neither."""
    switches = {}
    for variant in variants:
        name = f"run-{variant}"
        path = params_dir / name
        try:
            value = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"parameter {name}: cannot read {path} ({exc})") from None
        if value not in ("true", "false"):
            raise ValueError(f"parameter {name}: expected true or false, got {value[:40]!r}")
        switches[name] = value
    return switches


def main(argv: list[str] | None = None) -> int:
    """Read the switches, write them as outputs; 2 on a bad value."""
    parser = argparse.ArgumentParser(prog="python -m workflows.switches", description=__doc__.splitlines()[0])
    parser.add_argument("--params-dir", type=Path, required=True, help="Where Argo wrote the form's values.")
    parser.add_argument("--outputs-dir", type=Path, required=True, help="Where the outputs are written.")
    parser.add_argument("variants", nargs="+", help="The pipeline's variants.")
    args = parser.parse_args(argv)
    try:
        switches = read_switches(args.params_dir, args.variants)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.outputs_dir.mkdir(parents=True, exist_ok=True)
    for name, value in switches.items():
        (args.outputs_dir / name).write_text(value, encoding="utf-8")
    chosen = [v for v in args.variants if switches[f"run-{v}"] == "true"]
    print(f"variants to train: {', '.join(chosen) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
