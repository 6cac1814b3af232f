"""A trial of a hyperparameter search: the stage trained briefly with given values, in a run directory of its own.

    python -m stages sft --run-dir RUN --trial NAME --trial-set training.learning_rate=3e-4 --trial-set lora.r=16

is what Katib runs for each trial (and what the local search runs). The trial trains in
`RUN/hpo/<stage>/trials/<NAME>/`, a run directory whose `spec.json` is the run's spec with the trial's values set,
the stage's `training.max_steps` set to `hpo.trial_max_steps` (a checkpoint half way and at the end, two kept) and
`hpo` dropped; the run's earlier stages (prepare, and cpt for sft, ...) are relative links to the run's own folders,
read and never written: trials run at once, and each writes only inside its own folder. Its stage folder
(`<trial>/<stage>/`) has the stage's lock, stage.json, checkpoints and logs, so a trial resumes, refuses and
records exactly as the stage does.

When the trial succeeded, rank 0 appends `<metric>=<value>` lines, the objective first, to the file named by
$POSTTRAIN_KATIB_METRICS_FILE (Katib's File metrics collector, TEXT format) and prints them.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

from run.exits import EXIT_FAILED, EXIT_OK
from run.run_dir import RunDir, StageRefused, StageResult
from run.search import set_values, trials_dir
from spec.document import Origins, SpecError
from spec.fields import STAGE_ORDER, TRAINING_STAGES
from spec.loading import validate_document
from spec.pipeline import PipelineSpec
from spec.search import SearchParameter, SearchValue
from stages.contract import Trial, is_main_process

METRICS_FILE_ENV = "POSTTRAIN_KATIB_METRICS_FILE"
"""Where a trial appends its metric lines (Katib's File metrics collector reads them)."""

TRIAL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,251}[a-z0-9])?$")
"""A trial's name: lowercase letters, digits and '-', as Katib names its trials (`<experiment>-<random>`, a
Kubernetes object name); it names a folder, so nothing else is accepted."""

TRIAL_CHECKPOINTS = 2
"""Checkpoints a trial writes (half way and at the end) and keeps: enough to resume a preempted trial."""


def check_trial_name(name: str) -> str:
    """`name` when it is a DNS label; StageRefused otherwise."""
    if not TRIAL_NAME.match(name):
        raise StageRefused(
            f"--trial {name!r}: a trial name is lowercase letters, digits and '-' (at most 253, starting and "
            "ending with a letter or digit), as Katib names its trials"
        )
    return name


def parse_assignments(texts: list[str]) -> dict[str, str]:
    """`--trial-set path=value` arguments as {path: value text}; StageRefused naming the bad one."""
    assignments: dict[str, str] = {}
    for text in texts:
        path, sep, value = text.partition("=")
        if not sep or not path.strip():
            raise StageRefused(f"--trial-set {text!r}: expected <path>=<value>, e.g. training.learning_rate=3e-4")
        path = path.strip()
        if path in assignments:
            raise StageRefused(f"--trial-set {text!r}: {path} is set twice")
        assignments[path] = value.strip()
    return assignments


def _matches(choice: SearchValue, text: str) -> bool:
    """Whether the text Katib (or a person) gave names this categorical choice."""
    if isinstance(choice, bool):
        return text.lower() == str(choice).lower()
    if isinstance(choice, int | float):
        try:
            return float(text) == float(choice)
        except ValueError:
            return False
    return text == choice


def parse_value(parameter: SearchParameter, text: str) -> SearchValue:
    """The value `text` gives `parameter`, checked against its search space; ValueError saying why not."""
    if parameter.type == "categorical":
        for choice in parameter.values or []:
            if _matches(choice, text):
                return choice
        raise ValueError(f"not one of {parameter.values}")
    try:
        number = float(text)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    value: SearchValue = number
    if parameter.type == "int":
        if number != int(number):
            raise ValueError("not a whole number")
        value = int(number)
    low, high = float(parameter.min), float(parameter.max)  # type: ignore[arg-type]
    slack = 1e-9 * max(abs(low), abs(high))  # a value printed with fewer digits than it had stays inside
    if not low - slack <= number <= high + slack:
        raise ValueError(f"outside the search space ({low:g} to {high:g})")
    return value


def trial_values(spec: PipelineSpec, stage: str, assignments: dict[str, str]) -> dict[str, SearchValue]:
    """The trial's values by path: every searched parameter given once, each inside its space."""
    hpo = getattr(spec.stage(stage), "hpo", None)
    if hpo is None:
        raise StageRefused(f"--trial: stages.{stage} has no hpo section in the run's spec.json, so nothing to search")
    parameters = {p.path: p for p in hpo.parameters}
    values: dict[str, SearchValue] = {}
    for path, text in assignments.items():
        if path not in parameters:
            raise StageRefused(
                f"--trial-set {path}={text}: {path} is not searched in stages.{stage}.hpo (it searches "
                f"{', '.join(parameters)})"
            )
        try:
            values[path] = parse_value(parameters[path], text)
        except ValueError as exc:
            raise StageRefused(f"--trial-set {path}={text}: {exc} (stages.{stage}.hpo parameter {path})") from None
    missing = [path for path in parameters if path not in values]
    if missing:
        raise StageRefused(f"--trial: no value for {', '.join(missing)}: give --trial-set <path>=<value> for each")
    return values


def trial_spec(spec: PipelineSpec, stage: str, values: dict[str, SearchValue], source: str) -> PipelineSpec:
    """The run's spec as a trial trains it: the values set, max_steps = hpo.trial_max_steps, checkpoints half way
    and at the end, hpo dropped. StageRefused (naming `source`) when the values break a rule of the spec."""
    hpo = spec.stage(stage).hpo  # type: ignore[attr-defined]
    document = spec.model_dump(mode="json", exclude={"profiles"})
    set_values(document, stage, values)
    section = document["stages"][stage]
    training = section["training"]
    training["max_steps"] = hpo.trial_max_steps
    training["save_steps"] = max(1, math.ceil(hpo.trial_max_steps / TRIAL_CHECKPOINTS))
    training["save_total_limit"] = TRIAL_CHECKPOINTS
    if training.get("eval_steps") and training["eval_steps"] > hpo.trial_max_steps:
        training["eval_steps"] = None  # the final evaluation measures the objective anyway
    section["hpo"] = None
    try:
        return validate_document(document, Origins(), source)
    except SpecError as exc:
        raise StageRefused(f"--trial-set: the values break a rule of the spec: {exc}") from None


def link_earlier_stages(trial_root: Path, run_root: Path, spec: PipelineSpec, stage: str) -> None:
    """`<trial>/<earlier stage>` → the run's folder of it, for each enabled stage before `stage`, as relative links
    (a relative link survives a move of the run directory). Made atomically: every rank may do it."""
    for earlier in STAGE_ORDER[: STAGE_ORDER.index(stage)]:
        if not spec.stage(earlier).enabled:
            continue
        link = trial_root / earlier
        target = Path(os.path.relpath(run_root / earlier, trial_root))
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        staging = trial_root / f".{earlier}.{os.getpid()}.link"
        staging.unlink(missing_ok=True)
        staging.symlink_to(target, target_is_directory=True)
        os.replace(staging, link)


def prepare_trial(
    run_dir: RunDir, spec: PipelineSpec, stage: str, name: str, texts: list[str]
) -> tuple[RunDir, PipelineSpec, Trial]:
    """The trial's run directory and spec (written by rank 0; every rank computes the same one)."""
    if stage not in TRAINING_STAGES:
        raise StageRefused(f"--trial: {stage} is not a training stage; searches run {', '.join(TRAINING_STAGES)}")
    check_trial_name(name)
    values = trial_values(spec, stage, parse_assignments(texts))
    objective = spec.stage(stage).hpo.objective.metric  # type: ignore[attr-defined]
    root = trials_dir(run_dir.root, stage) / name
    trial_dir = RunDir(root)
    trained = trial_spec(spec, stage, values, str(trial_dir.spec_path))
    root.mkdir(parents=True, exist_ok=True)
    link_earlier_stages(root, run_dir.root, spec, stage)
    if is_main_process():
        trial_dir.write_spec(trained)
    return trial_dir, trained, Trial(name=name, run=run_dir, values=values, objective=objective)


def metric_lines(result: StageResult, objective: str) -> list[str]:
    """`<metric>=<value>` lines of a trial's record, the objective first (Katib's TEXT metrics format)."""
    names = [objective, *sorted(name for name in result.metrics if name != objective)]
    return [f"{name}={result.metrics[name]!r}" for name in names if name in result.metrics]


def report_metrics(trial_dir: RunDir, stage: str, objective: str) -> int:
    """Rank 0, after the trial's stage returned: print its metric lines and append them to
    $POSTTRAIN_KATIB_METRICS_FILE. EXIT_FAILED, with one `error:` line, when the trial did not succeed or did not
    record the objective (Katib would wait for a metric that never comes)."""
    if not is_main_process():
        return EXIT_OK
    result = trial_dir.read_result(stage)
    if result is None or result.status != "succeeded":
        return EXIT_FAILED
    if objective not in result.metrics:
        print(
            f"error: [{stage}] the trial recorded no {objective} (it recorded {', '.join(result.metrics) or 'none'}): "
            "nothing to report to the search",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    lines = metric_lines(result, objective)
    target = os.environ.get(METRICS_FILE_ENV)
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a", encoding="utf-8") as f:
            f.write("".join(f"{line}\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
    for line in lines:
        print(line, flush=True)
    return EXIT_OK
