"""The outcome of a hyperparameter search: the best trial's values set in the run's spec, and the search's record.

    python -m stages hpo-select --run-dir RUN --stage sft --optimal-trial FILE

runs after the search in the cluster; FILE holds the Katib Experiment's `status.currentOptimalTrial`. The local
search (workflows/search.py) runs the same command over its best trial, in the same shape (with `--trial-prefix`,
so that search.json lists only that search's trials). Selecting:

- writes `RUN/hpo/<stage>/search.json` (atomically): the algorithm, the objective, the best trial, its values by
  path and its objective value, the fingerprint of the search (`search_fingerprint`: the stage's config, hpo
  section included, without the searched fields) and every trial under `RUN/hpo/<stage>/trials/` with its values, status
  and metrics;
- rewrites `RUN/spec.json` (atomically, after search.json) with the best values set in `stages.<stage>`, so the
  stage that follows trains with them (its `hpo` section stays: it says what was searched);
- logs the best values as params `hpo.<stage>.<path>` and the best objective as the metric
  `hpo.<stage>.<metric>` on the pipeline run's MLflow parent (tracking never fails the selection).

Selecting again with the same outcome changes nothing; bad input ends with one `error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from run.exits import EXIT_OK, EXIT_USAGE
from run.names import katib_parameter_name
from run.run_dir import RunDir, StageRefused, now, write_json_atomic
from run.search import search_fingerprint, search_path, set_values, stage_hpo, trials_dir, value_at
from spec.document import Origins, SpecError
from spec.fields import TRAINING_STAGES
from spec.loading import validate_document
from spec.pipeline import PipelineSpec
from spec.search import HpoSpec, SearchValue
from stages.trials import parse_value


def collect_trials(run_root: Path, stage: str, hpo: HpoSpec, prefix: str = "") -> list[dict[str, Any]]:
    """Every trial under `<run>/hpo/<stage>/trials/` (whose name starts with `prefix`): its values (from its
    spec.json), status, objective and metrics (from its stage.json; status `missing` before it recorded one)."""
    trials = []
    root = trials_dir(run_root, stage)
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not folder.name.startswith(prefix) or not (folder / "spec.json").is_file():
            continue
        try:
            spec = json.loads((folder / "spec.json").read_text(encoding="utf-8"))
            values = {p.path: value_at(spec["stages"][stage], p.path) for p in hpo.parameters}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            record = json.loads((folder / stage / "stage.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = {}
        metrics = record.get("metrics") or {}
        trials.append(
            {
                "name": folder.name,
                "values": values,
                "status": record.get("status", "missing"),
                "objective": metrics.get(hpo.objective.metric),
                "metrics": metrics,
            }
        )
    return trials


def checked_values(hpo: HpoSpec, stage: str, values: dict[str, Any]) -> dict[str, SearchValue]:
    """The best values by path, each one a searched parameter's and inside its space; StageRefused otherwise."""
    parameters = {p.path: p for p in hpo.parameters}
    unknown = [path for path in values if path not in parameters]
    if unknown:
        raise StageRefused(f"{', '.join(unknown)} not searched in stages.{stage}.hpo ({', '.join(parameters)})")
    missing = [path for path in parameters if path not in values]
    if missing:
        raise StageRefused(f"no best value for {', '.join(missing)}")
    checked: dict[str, SearchValue] = {}
    for path, value in values.items():
        try:
            checked[path] = parse_value(parameters[path], str(value))
        except ValueError as exc:
            raise StageRefused(f"best value {path}={value}: {exc}") from None
    return checked


def select(
    run_dir: RunDir,
    stage: str,
    best_values: dict[str, Any],
    best_trial: str,
    best_objective: float | None = None,
    trial_prefix: str = "",
) -> dict[str, Any]:
    """Set the best trial's values in the run's spec.json and write the search's record (see the module's
    docstring); returns the record. StageRefused for values outside the search, or that break a rule of the spec."""
    spec = run_dir.load_spec()
    hpo = stage_hpo(spec, stage)
    values = checked_values(hpo, stage, best_values)
    fingerprint = search_fingerprint(spec, stage)

    document = spec.model_dump(mode="json", exclude={"profiles"})
    set_values(document, stage, values)
    try:
        selected = validate_document(document, Origins(), str(run_dir.spec_path))
    except SpecError as exc:
        raise StageRefused(f"the best values break a rule of the spec: {exc}") from None

    metric = hpo.objective.metric
    trials = collect_trials(run_dir.root, stage, hpo, trial_prefix)
    if best_objective is None:
        best_objective = next((t["objective"] for t in trials if t["name"] == best_trial), None)
    record = {
        "stage": stage,
        "algorithm": hpo.algorithm,
        "objective": hpo.objective.model_dump(mode="json"),
        "best_trial": best_trial,
        "best_values": values,
        "best_objective": best_objective,
        "search": fingerprint,
        "hpo": hpo.model_dump(mode="json"),
        "trials": trials,
        "selected_at": now(),
    }
    write_json_atomic(search_path(run_dir.root, stage), record)
    run_dir.write_spec(selected)  # after search.json: a selection cut short in between is simply done again
    shown = ", ".join(f"{path}={value}" for path, value in values.items())
    outcome = f"{metric} {best_objective:.6g}" if best_objective is not None else f"{metric} unknown"
    print(f"[{stage}] search: best trial {best_trial} ({outcome}) of {len(trials)}: {shown}", flush=True)
    log_selection(selected, run_dir.root, stage, values, metric, best_objective, best_trial)
    return record


def log_selection(
    spec: PipelineSpec,
    run_root: Path,
    stage: str,
    values: dict[str, SearchValue],
    metric: str,
    best_objective: float | None,
    best_trial: str,
) -> None:
    """The best values and objective on the pipeline run's MLflow parent; a warning, never a failure, when MLflow
    cannot take them."""
    from stages.tracking_mlflow_server import log_to_pipeline_run

    params = {f"hpo.{stage}.{path}": value for path, value in values.items()}
    metrics = {f"hpo.{stage}.{metric}": best_objective} if best_objective is not None else {}
    try:
        log_to_pipeline_run(spec, run_root, params, metrics, {f"posttrain.hpo.{stage}.best_trial": best_trial})
    except Exception as exc:  # tracking never fails a stage
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        print(f"[{stage}] warning: MLflow did not take the search's outcome ({first})", flush=True)


# --------------------------------------------------------------------------- Katib's optimal trial


def katib_selection(hpo: HpoSpec, stage: str, optimal: Any) -> tuple[dict[str, str], str, float | None]:
    """(values by path, trial name, objective value) from a Katib Experiment's `status.currentOptimalTrial`;
    StageRefused saying what is wrong with it."""
    if not isinstance(optimal, dict):
        raise StageRefused(f"expected the JSON object of status.currentOptimalTrial, got {type(optimal).__name__}")
    name = optimal.get("bestTrialName")
    if not isinstance(name, str) or not name:
        raise StageRefused("bestTrialName is empty: the search has no successful trial to select")
    by_katib = {katib_parameter_name(p.path): p.path for p in hpo.parameters}
    assignments = optimal.get("parameterAssignments")
    if not isinstance(assignments, list):
        raise StageRefused("parameterAssignments is missing or not a list")
    values: dict[str, str] = {}
    for index, item in enumerate(assignments):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "value" not in item:
            raise StageRefused(f"parameterAssignments[{index}] is not a {{name, value}} object")
        if item["name"] not in by_katib:
            raise StageRefused(
                f"parameterAssignments[{index}]: {item['name']!r} is not a parameter of stages.{stage}.hpo "
                f"(Katib names: {', '.join(by_katib)})"
            )
        values[by_katib[item["name"]]] = str(item["value"])
    return values, name, _observed(optimal, hpo)


def _observed(optimal: dict[str, Any], hpo: HpoSpec) -> float | None:
    """The objective's value in the optimal trial's observation (its min when minimising, max when maximising, else
    its latest); None when Katib has none ("unavailable")."""
    observation = optimal.get("observation") or {}
    metrics = observation.get("metrics") if isinstance(observation, dict) else None
    for metric in metrics if isinstance(metrics, list) else []:
        if isinstance(metric, dict) and metric.get("name") == hpo.objective.metric:
            best = "min" if hpo.objective.goal == "minimize" else "max"
            for key in (best, "latest"):
                try:
                    value = float(metric.get(key))
                except (TypeError, ValueError):
                    continue
                if math.isfinite(value):
                    return value
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages hpo-select", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="Run directory holding spec.json.")
    parser.add_argument("--stage", required=True, choices=TRAINING_STAGES, help="The stage that was searched.")
    parser.add_argument(
        "--optimal-trial",
        required=True,
        type=Path,
        help="JSON file with the Katib Experiment's status.currentOptimalTrial.",
    )
    parser.add_argument(
        "--trial-prefix",
        default="",
        help="List only the trials whose names start with it in search.json (the local search's trials are named "
        "after the search).",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    source = args.optimal_trial
    run_dir = RunDir(args.run_dir)
    try:
        hpo = stage_hpo(run_dir.load_spec(), args.stage)
        try:
            optimal = json.loads(source.read_text(encoding="utf-8"))
            values, name, objective = katib_selection(hpo, args.stage, optimal)
        except OSError as exc:
            raise StageRefused(f"{source}: cannot read it ({exc.strerror or exc})") from None
        except ValueError as exc:  # JSONDecodeError; StageRefused is not a ValueError
            raise StageRefused(f"{source}: not valid JSON ({exc})") from None
        except StageRefused as exc:
            raise StageRefused(f"{source}: {exc}") from None
        select(run_dir, args.stage, values, name, objective, args.trial_prefix)
    except (StageRefused, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
