"""Benchmark (not a test): how far two runs of the same pipeline with the same inputs drift apart on GPUs, and
whether the second would pass its gate against the first (issue 34's tolerance on GPUs).

    python bench/determinism_gpu.py korean-llm --profile gpu --out OUT [--work DIR] [--together] [--set K=V ...]

Runs `python -m workflows.submit PIPELINE --local --profile PROFILE` twice, each in a folder of its own under
--work (default OUT; full checkpoints of real size go there, so keep it off a folder that is shipped): the same
command, the same spec, the same seeds, so every stage is launched as its pod launches it (torchrun, one process
per GPU). Deploy is left out (nothing to compare) and so are lm-eval's tasks (not installed where this runs; the
held-out perplexity, the metric every gate decides on, is measured without them). --together runs the two at once
on the same GPUs (a 1.7B pipeline fits one GPU twice): each run's numbers do not depend on the other, only its
times do, unless a kernel is chosen by timing.

OUT/determinism.json has, per stage, each run's metrics and their relative differences, how the two model folders'
weights differ (tensors compared, how many are not bit-identical, the largest element difference relative to its
tensor's largest magnitude), and the second run's gate verdict against the first as its champion (the pipeline's
own rules, with lm-eval's metrics left out).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from resume_gpu import weight_difference  # noqa: E402

from run.run_dir import RunDir  # noqa: E402
from stages.gate import check_rule  # noqa: E402

STAGES = ("cpt", "sft", "rlhf", "evaluate")


def start(pipeline: str, profile: str, root: Path, sets: list[str], log: Path) -> subprocess.Popen[bytes]:
    """One run of the pipeline under --local, into the run directory `root` (its own MLflow store beside it)."""
    command = [sys.executable, "-m", "workflows.submit", pipeline, "--local", "--profile", profile]
    command += [
        "--run-dir",
        str(root),
        "--set",
        "stages.deploy.enabled=false",
        "--set",
        "stages.evaluate.lm_eval_tasks=[]",
    ]
    for item in sets:
        command += ["--set", item]
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def compare(first: Path, second: Path) -> dict[str, Any]:
    """Per stage: both runs' metrics, their relative differences, and how their model folders differ."""
    stages: dict[str, Any] = {}
    for stage in STAGES:
        a, b = RunDir(first).read_result(stage), RunDir(second).read_result(stage)
        if a is None or b is None:
            stages[stage] = {"missing": [name for name, r in (("first", a), ("second", b)) if r is None]}
            continue
        metrics_a, metrics_b = a.metrics, b.metrics
        shared = sorted(metrics_a.keys() & metrics_b.keys())
        entry: dict[str, Any] = {
            "status": [a.status, b.status],
            "metrics_first": metrics_a,
            "metrics_second": metrics_b,
            "relative_difference": {k: relative(metrics_a[k], metrics_b[k]) for k in shared},
        }
        # Tensor by tensor, not stage.json's model fingerprint: an adapter's config names its base by path, which
        # differs between the two run directories.
        if (first / stage / "model").is_dir():
            entry["weights"] = weight_difference(first / stage / "model", second / stage / "model")
        stages[stage] = entry
    return stages


def gate_of_second(first: Path, second: Path) -> dict[str, Any]:
    """The second run's evaluate metrics judged against the first's, as the gate judges a candidate against the
    champion, rule by rule; rules on metrics neither run measured (lm-eval's) are left out."""
    a, b = RunDir(first).read_result("evaluate"), RunDir(second).read_result("evaluate")
    if a is None or b is None:
        return {"verdict": None, "why": "evaluate did not finish in both runs"}
    spec = RunDir(second).load_spec()
    checks = [
        check_rule(rule, b.metrics, a.metrics, "the first run")
        for rule in spec.stages.evaluate.gate
        if rule.metric in a.metrics and rule.metric in b.metrics
    ]
    return {
        "verdict": "pass" if checks and all(c.passed for c in checks) else "fail",
        "rules": [{"metric": c.metric, "passed": c.passed, "reason": c.reason} for c in checks],
    }


def machine() -> dict[str, Any]:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus, "host": platform.node()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline")
    parser.add_argument("--profile", default="gpu")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, help="where the two run directories go (default: OUT)")
    parser.add_argument("--together", action="store_true", help="run both at once on the same GPUs")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="a --set for both runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    roots = [(args.work or args.out) / name / "runs" / "run" for name in ("first", "second")]
    for root in roots:  # a run directory left by an earlier call would be resumed, not run again
        shutil.rmtree(root.parent.parent, ignore_errors=True)
    started, exits = time.time(), []
    handles = []
    for root, name in zip(roots, ("first", "second"), strict=True):
        handles.append(start(args.pipeline, args.profile, root, args.sets, args.out / f"{name}.log"))
        if not args.together:
            exits.append(handles[-1].wait())
    if args.together:
        exits = [handle.wait() for handle in handles]
    result = {
        "pipeline": args.pipeline,
        "profile": args.profile,
        "sets": args.sets,
        "runs": "together on the same GPUs" if args.together else "one after the other",
        "exits": exits,
        "wall_s": round(time.time() - started, 1),
        "machine": machine(),
        "stages": compare(*roots),
        "gate_of_second_against_first": gate_of_second(*roots),
    }
    (args.out / "determinism.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    summary = {
        stage: {k: v for k, v in entry.items() if k not in ("metrics_first", "metrics_second")}
        for stage, entry in result["stages"].items()
    }
    print(json.dumps({**{k: v for k, v in result.items() if k != "stages"}, "stages": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
