"""The hyperparameter search under --local: Optuna's samplers ask, trials of the stage answer, one after another.

Before a stage with `hpo`, the runner (workflows/local.py) runs `hpo.max_trials` trials, each the stage's own
command with `--trial NAME --trial-set path=value ...` (stages/trials.py), its output in
`<run>/hpo/<stage>/trials/<NAME>/<stage>/logs/stage.log`, and shown in the live table as `sft trial 2/4`. Katib's
algorithms map to Optuna's samplers, seeded with `hpo.seed`:

    random → RandomSampler    tpe → TPESampler (what Katib's tpe suggestion runs)
    grid → GridSampler        bayesianoptimization → GPSampler (Gaussian process; needs torch, as the stages do)

The study lives in memory: what it knows comes from the trials' own records, so a rerun of the run directory
rebuilds it from the trials that ended (they are not run again) and asks only for the rest. A failed trial is told
as failed; the search fails once `hpo.max_failed_trials` trials have failed (at the first failure with 0), and
stops early once a trial reaches `hpo.objective.target`. Then the best trial is selected as in the cluster: its
Katib-shaped `currentOptimalTrial` goes to `<run>/hpo/<stage>/optimal-trial.json` and `python -m stages hpo-select`
(stages/hpo.py) sets its values in the run's spec.json and writes `<run>/hpo/<stage>/search.json`; the stage then
trains with them.

A finished search is not done again: search.json made for the same search (`run.search.search_fingerprint`, the
stage's config without the searched fields) is applied to the spec the runner loads (`apply_selections`), so the
selected values are not mistaken for a changed config. --force searches again.

This module never imports torch: Optuna is imported when a search runs, GPSampler's torch only when it samples.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from run.exits import EXIT_RETRYABLE, StageInterrupted
from run.names import katib_parameter_name
from run.run_dir import write_json_atomic
from run.search import finished_search, read_search, search_dir, search_fingerprint, trials_dir, value_at
from spec.pipeline import PipelineSpec
from spec.search import HpoSpec, SearchParameter, SearchValue
from workflows.stage_process import StageRun, launch_stage


def stage_search(spec: PipelineSpec, stage: str) -> HpoSpec | None:
    """The stage's search, when it is enabled and has one."""
    section = spec.stage(stage)
    return getattr(section, "hpo", None) if section.enabled else None


# --------------------------------------------------------------------------- Optuna


def grid_values(parameter: SearchParameter) -> list[SearchValue]:
    """The values grid search walks for a parameter: every choice, or min to max by step (1 for int)."""
    if parameter.type == "categorical":
        return list(parameter.values or [])
    low, high = float(parameter.min), float(parameter.max)  # type: ignore[arg-type]
    step = parameter.step or 1.0
    count = math.floor((high - low) / step + 1e-9) + 1
    if parameter.type == "int":
        return [int(low + i * step) for i in range(count)]
    return [round(low + i * step, 12) for i in range(count)]


def sampler(hpo: HpoSpec) -> Any:
    """The Optuna sampler that runs the Katib algorithm `hpo.algorithm`, seeded with hpo.seed."""
    import optuna

    if hpo.algorithm == "random":
        return optuna.samplers.RandomSampler(seed=hpo.seed)
    if hpo.algorithm == "grid":
        space = {p.path: grid_values(p) for p in hpo.parameters}
        return optuna.samplers.GridSampler(space, seed=hpo.seed)
    if hpo.algorithm == "bayesianoptimization":
        return optuna.samplers.GPSampler(seed=hpo.seed)
    return optuna.samplers.TPESampler(seed=hpo.seed)


def distribution(parameter: SearchParameter) -> Any:
    """The Optuna distribution of a search parameter."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if parameter.type == "categorical":
        return CategoricalDistribution(list(parameter.values or []))
    if parameter.type == "int":
        return IntDistribution(int(parameter.min), int(parameter.max), step=int(parameter.step or 1))  # type: ignore[arg-type]
    log = parameter.type == "log_uniform"
    return FloatDistribution(parameter.min, parameter.max, log=log, step=None if log else parameter.step)  # type: ignore[arg-type]


def value_text(value: SearchValue) -> str:
    """A value as a `--trial-set` argument: floats in full (repr), booleans as true/false."""
    if isinstance(value, bool):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------- the search


@dataclass
class TrialOutcome:
    """How one trial ended, as the runner saw it."""

    name: str
    values: dict[str, SearchValue]
    exit_code: int
    status: str  # the trial's recorded status (succeeded, failed, interrupted), or missing
    objective: float | None


class SearchFailed(Exception):
    """The search cannot select: too many failed trials, or none succeeded. The message says so."""


def trial_prefix(fingerprint: str) -> str:
    """Local trial names start with the search's fingerprint: a changed search never meets an old search's trials."""
    return f"trial-{fingerprint[:8]}-"


def read_trial(run_root: Path, stage: str, name: str, metric: str) -> tuple[str, float | None]:
    """(recorded status, objective value) of a trial; ("missing", None) before it recorded anything."""
    try:
        record = json.loads((trials_dir(run_root, stage) / name / stage / "stage.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "missing", None
    value = (record.get("metrics") or {}).get(metric)
    return str(record.get("status", "missing")), float(value) if isinstance(value, int | float) else None


def recorded_values(run_root: Path, stage: str, name: str, hpo: HpoSpec) -> dict[str, SearchValue] | None:
    """The values a trial was started with (its spec.json), None when it never started."""
    try:
        spec = json.loads((trials_dir(run_root, stage) / name / "spec.json").read_text(encoding="utf-8"))
        return {p.path: value_at(spec["stages"][stage], p.path) for p in hpo.parameters}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def trial_budget(hpo: HpoSpec) -> int:
    """How many trials the search runs: max_trials, or fewer when a grid has fewer points (Katib's grid ends too)."""
    if hpo.algorithm != "grid":
        return hpo.max_trials
    return min(hpo.max_trials, math.prod(len(grid_values(p)) for p in hpo.parameters))


def run_search(
    spec: PipelineSpec,
    run_root: Path,
    stage: str,
    run_trial: Callable[[int, str, list[str]], int],
    force: bool = False,
    on_known: Callable[[int, TrialOutcome], None] | None = None,
    env: dict[str, str] | None = None,
) -> list[TrialOutcome]:
    """Run the stage's search and select its best trial. `run_trial(number, name, trial_args)` runs trial `number`
    (1-based) with the stage's arguments plus `trial_args` and returns its exit code (it raises StageInterrupted
    when the runner was interrupted: the search stops there, and a rerun goes on from the trials that ended);
    `on_known(number, outcome)` hears of each trial that an earlier run ended (told to the study, not run again);
    `env` is the stages' environment, for the selection. Returns every trial's outcome; SearchFailed when the search
    cannot select."""
    import optuna

    hpo = stage_search(spec, stage)
    assert hpo is not None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fingerprint = search_fingerprint(spec, stage)
    prefix = trial_prefix(fingerprint)
    study = optuna.create_study(
        study_name=f"{spec.name}-{stage}",
        direction="minimize" if hpo.objective.goal == "minimize" else "maximize",
        sampler=sampler(hpo),
    )
    distributions = {p.path: distribution(p) for p in hpo.parameters}
    metric = hpo.objective.metric
    outcomes: list[TrialOutcome] = []
    failures = 0
    for number in range(1, trial_budget(hpo) + 1):
        name = f"{prefix}{number}"
        known = None if force else recorded_values(run_root, stage, name, hpo)
        status, value = read_trial(run_root, stage, name, metric)
        if known is not None and status in ("succeeded", "failed"):
            # Ended in an earlier run of this search: told again, not run again.
            ok = status == "succeeded" and value is not None
            study.add_trial(
                optuna.trial.create_trial(
                    params=known,
                    distributions=distributions,
                    value=value if ok else None,
                    state=optuna.trial.TrialState.COMPLETE if ok else optuna.trial.TrialState.FAIL,
                )
            )
            outcomes.append(TrialOutcome(name, known, 0 if ok else 1, status, value))
            if on_known is not None:
                on_known(number, outcomes[-1])
        else:
            if known is not None:  # started before and cut short: it goes on with its values (and checkpoints)
                study.enqueue_trial(known)
            trial = study.ask(distributions)
            values: dict[str, SearchValue] = dict(trial.params)
            args = ["--trial", name]
            for path, value in values.items():
                args += ["--trial-set", f"{path}={value_text(value)}"]
            try:
                code = run_trial(number, name, args)
            except (StageInterrupted, KeyboardInterrupt):
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            status, value = read_trial(run_root, stage, name, metric)
            ok = code == 0 and status == "succeeded" and value is not None
            if code == EXIT_RETRYABLE:
                status = "interrupted"
            study.tell(trial, value if ok else None, state=None if ok else optuna.trial.TrialState.FAIL)
            outcomes.append(TrialOutcome(name, values, code, status, value))
        if outcomes[-1].objective is None or outcomes[-1].status != "succeeded":
            failures += 1
            if failures >= max(1, hpo.max_failed_trials):
                raise SearchFailed(
                    f"[{stage}] the search failed: {failures} of {number} trials failed "
                    f"(stages.{stage}.hpo.max_failed_trials is {hpo.max_failed_trials}); the last one's log: "
                    f"{trials_dir(run_root, stage) / name / stage / 'logs' / 'stage.log'}"
                )
        if _reached(hpo, outcomes[-1].objective):
            break
    succeeded = [o for o in outcomes if o.status == "succeeded" and o.objective is not None]
    if not succeeded:
        raise SearchFailed(f"[{stage}] the search has no successful trial to select")
    best = min(succeeded, key=lambda o: o.objective if hpo.objective.goal == "minimize" else -o.objective)  # type: ignore[operator]
    select_best(run_root, stage, hpo, best, prefix, env)
    return outcomes


OPTIMAL_TRIAL_JSON = "optimal-trial.json"
"""`<run>/hpo/<stage>/optimal-trial.json`: the local search's best trial, shaped as Katib's currentOptimalTrial."""


def optimal_trial(hpo: HpoSpec, best: TrialOutcome) -> dict[str, Any]:
    """The best trial as a Katib Experiment's `status.currentOptimalTrial`: what `hpo-select` reads in the cluster."""
    observed = repr(best.objective)
    return {
        "bestTrialName": best.name,
        "parameterAssignments": [
            {"name": katib_parameter_name(path), "value": value_text(value)} for path, value in best.values.items()
        ],
        "observation": {
            "metrics": [{"name": hpo.objective.metric, "min": observed, "max": observed, "latest": observed}]
        },
    }


def select_best(
    run_root: Path, stage: str, hpo: HpoSpec, best: TrialOutcome, prefix: str, env: dict[str, str] | None
) -> None:
    """Select the best trial as the cluster does: `python -m stages hpo-select` over its currentOptimalTrial (only
    the trials named `prefix...` listed in search.json). What the selection prints is passed on; SearchFailed,
    with its `error:` line, when it refuses."""
    optimal = search_dir(run_root, stage) / OPTIMAL_TRIAL_JSON
    write_json_atomic(optimal, optimal_trial(hpo, best))
    command = [sys.executable, "-m", "stages", "hpo-select", "--run-dir", str(run_root), "--stage", stage]
    command += ["--optimal-trial", str(optimal), "--trial-prefix", prefix]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        why = errors[-1].removeprefix("error:").strip() if errors else (done.stderr.strip() or "no output")
        raise SearchFailed(f"[{stage}] selecting the best trial failed (exit {done.returncode}): {why}")


def _reached(hpo: HpoSpec, value: float | None) -> bool:
    """Whether a trial's objective value reached hpo.objective.target (the search then stops, as Katib's goal)."""
    target = hpo.objective.target
    if target is None or value is None:
        return False
    return value <= target if hpo.objective.goal == "minimize" else value >= target


# --------------------------------------------------------------------------- in the runner's table


def search_needed(spec: PipelineSpec, run_root: Path, stage: str, force: bool) -> bool:
    """Whether the runner searches before `stage`: it has a search, and that search has not selected yet (or
    --force asks for it again)."""
    if stage_search(spec, stage) is None:
        return False
    return force or finished_search(spec, run_root, stage) is None


def search_in_runner(
    spec: PipelineSpec,
    run_root: Path,
    stage_row: Any,
    rows: list[Any],
    env: dict[str, str],
    force: bool,
    gpus: int,
    refresh: Callable[[], None],
    say: Callable[[str], None] | None = None,
    warm: Any = None,
) -> str:
    """Run the search before the stage of `stage_row`, each trial a row of the runner's table (inserted before the
    stage's row, named like `sft trial 2/4`); returns '' once the best values are selected, else why not. `say`
    prints a line per trial where the output is not a terminal (CI logs); `warm` is the run's warm-start server
    (workflows/warm_starts.py), where it has one."""

    stage = stage_row.name
    hpo = stage_search(spec, stage)
    assert hpo is not None
    total = trial_budget(hpo)
    metric = hpo.objective.metric

    def add_row(number: int) -> Any:
        row = StageRun(f"{stage} trial {number}/{total}")
        rows.insert(rows.index(stage_row), row)
        stage_row.last_line = f"searching {', '.join(p.path for p in hpo.parameters)}: trial {number}/{total}"
        return row

    def shown(row: Any, value: float | None) -> None:
        row.metric = f"{metric} {value:.4g}" if value is not None else ""

    def run_trial(number: int, name: str, args: list[str]) -> int:
        row = add_row(number)
        row.status, row.started = "running", time.monotonic()
        log = trials_dir(run_root, stage) / name / stage / "logs" / "stage.log"
        try:
            launch_stage(row, spec, stage, run_root, env, log, refresh, warm=warm, force=force, gpus=gpus, args=args)
        except (StageInterrupted, KeyboardInterrupt):
            row.ended, row.status = time.monotonic(), "interrupted"
            raise
        row.ended = time.monotonic()
        status, value = read_trial(run_root, stage, name, metric)
        ok = row.returncode == 0 and status == "succeeded"
        shown(row, value)
        row.status = "succeeded" if ok else "interrupted" if row.returncode == EXIT_RETRYABLE else "failed"
        if say is not None:
            say(f"{row.name}: {row.status} ({row.elapsed}) {row.metric}".rstrip())
        return row.returncode

    def known(number: int, outcome: TrialOutcome) -> None:
        row = add_row(number)
        row.status = "done before" if outcome.status == "succeeded" else outcome.status
        shown(row, outcome.objective)
        if say is not None:
            say(f"{row.name}: {row.status} {row.metric}".rstrip())

    try:
        run_search(spec, run_root, stage, run_trial, force=force, on_known=known, env=env)
    except SearchFailed as exc:
        return str(exc)
    record = read_search(run_root, stage) or {}
    chosen = ", ".join(f"{path}={value_text(value)}" for path, value in (record.get("best_values") or {}).items())
    stage_row.last_line = f"training with the best trial's values: {chosen}"
    return ""
