"""Benchmark (not a test): `python -m workflows.submit PIPELINE --render DIR` against `import hera.workflows`.

    python bench/render.py            # korean-llm, 7 runs each
    python bench/render.py -n 11 --pipeline llama3-dolly

Each command runs in a fresh interpreter, the two alternating; the figures are medians of wall-clock time.
The CLI must stay light (no torch, no rich or kubernetes on this path): the target is a ratio of at most 1.5.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_RATIO = 1.5


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - start


def median_seconds(commands: list[list[str]], runs: int) -> list[float]:
    """Median wall-clock seconds of each command over `runs` rounds, after one warm-up round.

    The commands alternate within each round, so a busy machine slows them alike instead of skewing the ratio.
    """
    for argv in commands:
        _seconds(argv)
    times: list[list[float]] = [[] for _ in commands]
    for _ in range(runs):
        for i, argv in enumerate(commands):
            times[i].append(_seconds(argv))
    return [statistics.median(t) for t in times]


def main() -> int:
    """Time both commands and print the medians and their ratio; exit 1 when over the target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=7, help="Runs per command (median taken).")
    parser.add_argument("--pipeline", default="korean-llm", help="Pipeline to render.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        baseline, render = median_seconds(
            [
                [sys.executable, "-c", "import hera.workflows"],
                [sys.executable, "-m", "workflows.submit", args.pipeline, "--render", out],
            ],
            args.runs,
        )
    ratio = render / baseline
    print(f"import hera.workflows:                 {baseline:.3f} s (median of {args.runs})")
    print(f"workflows.submit {args.pipeline} --render: {render:.3f} s (median of {args.runs})")
    print(f"ratio: {ratio:.2f}x (target <= {TARGET_RATIO}x)")
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
