"""Benchmark (not a test): how far a shipped pipeline's gate metrics move between training seeds, against a
candidate that learned nothing, so each local gate's allowance can sit between the two.

    python bench/gate_noise.py korean-llm --seeds 0 1 2 --out OUT [--variant NAME] [--profile local]

Each run is `python -m workflows.submit PIPELINE --local` in its own folder (its own MLflow store, so the gate
compares with the base model and every run is a first run), with `training.seed` of every training stage set to
one of --seeds; one more run trains with every learning rate divided by 10,000 and no search (a candidate that
learned nothing, trained on the same data by the same code). --set PATH=VALUE applies to every run.
OUT/<pipeline>.json has each run's evaluate metrics (the candidate's and the base model's), and per metric the
mean, the spread across seeds (standard deviation, min, max, the largest pairwise difference) and the untrained
candidate's value.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from spec.loading import load_pipeline  # noqa: E402
from spec.variants import variant_specs  # noqa: E402


def training_stages(pipeline: str, profile: str, variant: str | None) -> tuple[dict[str, float], list[str]]:
    """Training stage → its learning rate, as the profile (and variant) resolve them, and the stages that search
    their hyperparameters first (the untrained run switches that off: the search would choose the learning rate
    again)."""
    spec = load_pipeline(pipeline, profile=profile).spec
    if variant is not None:
        spec = variant_specs(spec)[variant]
    rates, searched = {}, []
    for name in ("cpt", "sft", "rlhf"):
        stage = getattr(spec.stages, name, None)
        if stage is not None and getattr(stage, "enabled", True):
            rates[name] = stage.training.learning_rate
            if getattr(stage, "hpo", None) is not None:
                searched.append(name)
    return rates, searched


def run_once(pipeline: str, folder: Path, sets: list[str], variant: str | None) -> dict[str, Any]:
    """One `--local` run in `folder`: the evaluate stage's candidate and base metrics, and the gate's decision."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "workflows.submit", pipeline, "--local", "--run-dir", str(folder / "run")]
    if variant is not None:
        command += ["--variant", variant]
    for item in sets:
        command += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY")}
    started = time.time()
    with (folder / "runner.log").open("wb") as log:
        code = subprocess.call(command, cwd=folder, env={**env, "PYTHONPATH": str(REPO)}, stdout=log, stderr=log)
    evaluate = next(iter(sorted(folder.rglob("evaluate/stage.json"))), None)  # a variant's run is a subfolder
    if evaluate is None:
        return {"exit": code, "seconds": time.time() - started, "error": "no evaluate stage.json"}
    extra = json.loads(evaluate.read_text(encoding="utf-8"))["extra"]
    return {
        "exit": code,
        "seconds": round(time.time() - started, 1),
        "candidate": extra["candidate"],
        "base": extra["base"],
        "gate": extra["gate"],
    }


def summary(seeded: list[dict[str, Any]], untrained: dict[str, Any]) -> dict[str, Any]:
    """Per metric: the seeds' mean, standard deviation, range and largest pairwise difference, and the untrained
    candidate's value."""
    metrics = sorted({m for run in seeded for m in run.get("candidate", {}) if not m.endswith("_stderr")})
    out = {}
    for metric in metrics:
        values = [run["candidate"][metric] for run in seeded if metric in run.get("candidate", {})]
        if not values or not all(isinstance(v, (int, float)) for v in values):
            continue
        mean = statistics.fmean(values)
        out[metric] = {
            "values": values,
            "mean": mean,
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "relative_stdev": (statistics.stdev(values) / abs(mean)) if len(values) > 1 and mean else 0.0,
            "range": max(values) - min(values),
            "untrained": untrained.get("candidate", {}).get(metric),
            "base": seeded[0].get("base", {}).get(metric),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant")
    parser.add_argument("--profile", default="local")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="PATH=VALUE for every run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="where the runs go (default: OUT/work)")
    args = parser.parse_args()
    work = args.work or args.out / "work"
    rates, searched = training_stages(args.pipeline, args.profile, args.variant)
    name = args.pipeline + (f"-{args.variant}" if args.variant else "") + ("-set" if args.sets else "")
    seeded = []
    for seed in args.seeds:
        sets = [*args.sets, *(f"stages.{stage}.training.seed={seed}" for stage in rates)]
        seeded.append({"seed": seed, **run_once(args.pipeline, work / name / f"seed-{seed}", sets, args.variant)})
        print(json.dumps(seeded[-1].get("candidate", seeded[-1]))[:300], flush=True)
    sets = [*args.sets, *(f"stages.{stage}.training.learning_rate={rate / 10_000:g}" for stage, rate in rates.items())]
    sets += [f"stages.{stage}.hpo=null" for stage in searched]
    untrained = run_once(args.pipeline, work / name / "untrained", sets, args.variant)
    result = {
        "pipeline": args.pipeline,
        "variant": args.variant,
        "profile": args.profile,
        "learning_rates": rates,
        "sets": args.sets,
        "seeded": seeded,
        "untrained": untrained,
        "metrics": summary(seeded, untrained),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result["metrics"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
