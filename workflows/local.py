"""The embedded runner: the pipeline's DAG on this machine, each stage a process started as its pod starts it.

`python -m workflows.submit korean-llm --local` lands here with the spec already validated (the `local`
profile applied). The runner writes `spec.json` into the run directory (`runs/<pipeline>-<UTC time>` by
default, with `-2`, `-3`... when another runner took that name in the same second), then runs every enabled stage
in DAG order, exactly as the cluster runs it (workflows/stage_process.py, workflows/launch.py):

    python -m stages <stage> --run-dir DIR                 # prepare, evaluate, deploy: as their Argo steps
    torchrun --module stages <stage> --run-dir DIR         # training stages: the PyTorchJob's argv, with the
                                                           # operator's PET_* variables for one node of one
                                                           # process per GPU (one without GPUs)

It shows a live table (status, elapsed time, last log line), keeps each stage's full output in
`<run>/<stage>/logs/stage.log`, stops at the first failure with the log tail and the command that resumes
(completed stages are no-ops by the stage contract), and ends with a summary table, the evaluation report and the
commands that open MLflow, TensorBoard and `wandb sync`. Without $MLFLOW_TRACKING_URI (or tracking.mlflow_tracking_uri)
the runs in one folder share one MLflow store beside them (`runs/mlflow.db`, `runs/mlartifacts/`), so the gate of a
local run compares with the last local champion; each run's tracking.json names the store it used.
A stage whose module does not exist is reported as missing and fails the run; it is never skipped. As in the
cluster DAG, the stages after prepare are skipped when prepare ends the run (`proceed=false`), and deploy is
skipped, with the gate's reasons, when evaluate's gate is not `pass`; the run then ends with the command that
registers the candidate anyway (exit 0, or EXIT_GATE_FAILED with --fail-on-gate). Before it starts, the runner
prints its plan (effective_plan) and the warnings of workflows/plan.py. A stage with `hpo` is preceded by its search
(workflows/search.py): Optuna's trials, one row each in the table (`sft trial 2/4`), then the best trial's values.

Two runners never share a run directory: each holds a lock on `<run>/.runner.lock` while it runs, and a run
directory whose completed stages (or checkpoints) were made with another config keeps its spec.json (the runner
refuses before writing anything; use a new run directory, or --force, with which the training stages start over
and their old checkpoints are moved aside). Values of secret-looking environment variables are masked in the stage
logs. Each stage also holds its own lock (`run.run_dir.hold_stage_lock`), so a stage started by hand next to a
runner is refused too. A run directory deleted or replaced while the runner holds it (its `.runner.lock` no longer
the file it locked) fails the run with one `error:` line, exit 1: noticed when a stage ends and before the next one
starts, so no stage is reported done and none starts in a folder made again under the old name.

The runner never leaves a stage running without it. SIGTERM (`timeout`, a CI cancel) or Ctrl-C to the runner is
passed on to the stage's process group, which saves a checkpoint (training stages) and exits with 75; the runner
reads its output meanwhile (the stage never meets a broken pipe), waits for that at most the stage's
`run_policy.termination_grace_period_seconds` (then kills it, and records it interrupted when it could not), shows
the stage as interrupted, prints the resume command as the user typed it, and exits (128 + the signal's number). A
second Ctrl-C is passed on too (the stage stops at once), a third kills it. The stage runs in its own session, so
a terminal's Ctrl-C reaches it only through the runner, once; and on Linux it gets SIGTERM when the runner itself
dies (SIGKILL included), so it saves and stops rather than training on unsupervised.

Without GPUs (the tiny local models, where a stage's imports take longer than its training), the stages are forked
from a warm-start server that imported torch, transformers, TRL, MLflow and W&B once, for the run and the next runs
of the same process, or for the runs of any process with POSTTRAIN_WARM_SERVER (workflows/warm_starts.py,
stages/warm.py): each is still its own process with its own session, output, exit code and signals, as above; its
log's first line ends with `(warm start)` (`(warm start, shared server)`). `POSTTRAIN_WARM_STARTS=0` starts every
stage as a fresh process, as its pod does (the training stages under torchrun).

This module never imports torch or transformers: GPUs are counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from run.config_hash import conflicting_stages
from run.exits import EXIT_GATE_FAILED, EXIT_RETRYABLE, EXIT_USAGE, StageInterrupted, interrupt_signal, interrupts_raise
from run.masking import mask_secrets
from run.names import RUN_ROOT
from run.release import GATE_PASS
from run.run_dir import RunDir, still_locked, try_lock
from run.search import apply_selections
from run.serving import LOCAL_SERVE_VARIABLE
from run.tracking import local_store_uri
from run.vllm_server import ENV_DIR, VLLM_PYTHON_VARIABLE, vllm_python, where_expected
from spec.data import datasets
from spec.document import LoadedPipeline
from spec.loading import PIPELINES_DIR, REPLACES_DATA
from spec.pipeline import PipelineSpec
from workflows.plan import local_mesh, plan_warnings, prepared_warnings
from workflows.search import search_in_runner, search_needed
from workflows.stage_process import StageRun, launch_stage, record_interrupted, run_stage
from workflows.warm_starts import warm_starts

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNS_DIR = Path("runs")
KEY_METRICS = ("eval_loss", "perplexity", "train_loss", "loss")
"""The metric a stage's summary row shows: the first of these its stage.json has."""

_STYLE = {
    "pending": "dim",
    "running": "cyan",
    "succeeded": "green",
    "done before": "green",
    "skipped": "yellow",
    "failed": "bold red",
    "interrupted": "yellow",
    "missing": "bold red",
    "not run": "dim",
}


# --------------------------------------------------------------------------- environment


def gpu_count() -> int:
    """GPUs this machine offers: CUDA_VISIBLE_DEVICES when set, else the lines of `nvidia-smi -L`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        return 0 if not devices or devices[0] == "-1" else len(devices)
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else 0


def default_run_dir(spec: PipelineSpec, runs_dir: Path = RUNS_DIR) -> Path:
    """A new, empty runs/<pipeline>-<UTC timestamp> (created here, so that two runners started in the same
    second get two directories: the second one gets a `-2` suffix, and so on)."""
    base = f"{spec.name}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    runs_dir.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = runs_dir / (base if n == 1 else f"{base}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise RuntimeError(f"no free run directory name {base}-N in {runs_dir}")


class RunDirBusy(Exception):
    """Another runner holds the run directory."""


def lock_run_dir(run_root: Path) -> Any:
    """Hold `<run>/.runner.lock` (an exclusive, non-blocking flock, released when the process ends); RunDirBusy
    when another runner holds it."""
    handle, holder = try_lock(run_root / ".runner.lock", f"pid {os.getpid()} on {os.uname().nodename}")
    if handle is None:
        raise RunDirBusy(
            f"{run_root} is in use by another runner ({holder or 'unknown process'}); wait for it to end, "
            "or use another --run-dir"
        )
    return handle


def run_dir_gone(run_root: Path, lock: Any, stage: str) -> str | None:
    """What to say when the run directory whose `.runner.lock` the runner holds (`lock`) was deleted or replaced
    (while `stage` ran, or before it started); None while it is the one locked."""
    if still_locked(lock, run_root / ".runner.lock"):
        return None
    return (
        f"run directory {run_root} was deleted or replaced while {stage} was running; the run stopped and wrote "
        "nothing more"
    )


def local_tracking_uri(run_root: Path) -> str:
    """The local MLflow store: one SQLite database beside the run directories (`runs/mlflow.db`), shared by the
    local runs, so the gate compares with the last local champion (run.tracking.local_store_uri)."""
    return local_store_uri(run_root)


def checkout_first(pythonpath: str) -> str:
    """`pythonpath` with this checkout first, once (a runner whose own PYTHONPATH names it gives its stages the same
    value, which a shared warm-start server compares)."""
    rest = [p for p in pythonpath.split(os.pathsep) if p and p != str(REPO_ROOT)]
    return os.pathsep.join([str(REPO_ROOT), *rest])


def stage_env(run_root: Path) -> dict[str, str]:
    """The stages' environment: this one, plus the local MLflow store ($MLFLOW_TRACKING_URI wins) and the checkout
    on PYTHONPATH. W&B's own variables (WANDB_MODE, WANDB_PROJECT, ...) pass through as they are."""
    env = dict(os.environ)
    env.setdefault("MLFLOW_TRACKING_URI", local_tracking_uri(run_root))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = checkout_first(env.get("PYTHONPATH", ""))
    return env


def stage_module_exists(stage: str) -> bool:
    """Whether `stages/<stage>.py` exists (found without importing it)."""
    return importlib.util.find_spec(f"stages.{stage}") is not None


# --------------------------------------------------------------------------- reading results


def read_stage_json(run_root: Path, stage: str) -> dict[str, Any] | None:
    path = run_root / stage / "stage.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def key_metric(stage: str, result: dict[str, Any] | None) -> str:
    """The summary's metric for a stage: rows for prepare, else the first of KEY_METRICS it recorded."""
    if not result:
        return ""
    metrics = result.get("metrics") or {}
    extra = result.get("extra") or {}
    if stage == "evaluate" and extra.get("gate"):
        shown = next((f", {n} {metrics[n]:.4g}" for n in ("perplexity", "eval_loss") if n in metrics), "")
        return f"gate {extra['gate']}{shown}"
    if stage == "deploy" and extra.get("model_version"):
        aliases = ", ".join(extra.get("aliases") or [])
        return f"{extra.get('registered_model', '')} v{extra['model_version']}" + (f" ({aliases})" if aliases else "")
    if stage == "prepare":
        rows = {k.removesuffix("_rows"): int(v) for k, v in metrics.items() if k.endswith("_rows")}
        dropped: dict[str, int] = {}  # by cleaning filter, over every stage ('<stage>_dropped_<reason>')
        for k, v in metrics.items():
            if "_dropped_" in k and v:
                reason = k.split("_dropped_", 1)[1]
                dropped[reason] = dropped.get(reason, 0) + int(v)
        note = f"; dropped {', '.join(f'{n} {r}' for r, n in dropped.items())}" if dropped else ""
        return ", ".join(f"{s} {n}" for s, n in rows.items()) + (" rows" if rows else "") + note
    for name in KEY_METRICS:
        if name in metrics:
            return f"{name} {metrics[name]:.4g}"
    if metrics:
        name = sorted(metrics)[0]
        return f"{name} {metrics[name]:.4g}"
    return ""


def register_anyway_hint(run_root: Path) -> str:
    """How to register a candidate whose gate failed: deploy by hand, which registers it as challenger only
    (champion stays) with the gate's decision in the version's tags (stages/deploy.py)."""
    return (
        "To register this candidate anyway (as challenger only; champion stays, and the registry records "
        "posttrain.gate and posttrain.gate_overridden=true):\n"
        f"  python -m stages deploy --run-dir {run_root}"
    )


def deploy_skip_reason(evaluate_result: dict[str, Any]) -> str:
    """Why deploy does not run after this evaluate record ('' when the gate passed): the cluster DAG runs deploy
    only when evaluate's `gate` output is `pass`."""
    extra = evaluate_result.get("extra") or {}
    gate = extra.get("gate", "")
    if gate == GATE_PASS:
        return ""
    reasons = [r for r in extra.get("gate_reasons") or [] if isinstance(r, str)]
    failed = [c["reason"] for c in extra.get("gate_checks") or [] if isinstance(c, dict) and not c.get("passed")]
    why = (failed or reasons or [evaluate_result.get("message", "")])[0]
    return f"gate {gate or 'unknown'}" + (f": {why}" if why else "")


# --------------------------------------------------------------------------- running


def effective_plan(loaded: LoadedPipeline) -> list[str]:
    """What the run will train on, said before it starts: the profile and what it sets, the model, and per stage
    the data (URI, format, column mapping) and the step budget, each marked where a profile or --set set it
    instead of the pipeline file. A profile that swaps data or caps steps is never silent about it, nor is one
    whose data was left out because the pipeline file names its own (spec/loading.py, replaces_data)."""
    spec = loaded.spec
    overlay = (loaded.document.get("profiles") or {}).get(loaded.profile) or {} if loaded.profile else {}
    kept = loaded.origins.data_kept
    by_profile = f" [profile {loaded.profile}]"

    def mark(*keys: str | int) -> str:
        if loaded.origins.by_path.get(keys) == "--set":
            return " [--set]"
        if keys[:1] == ("stages",) and keys[2:3] == ("data",) and keys[1] in kept:
            return ""
        node: Any = overlay
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return ""
            node = node[key]
        return by_profile

    lines = []
    if loaded.profile is not None:
        sets = [
            f"{top}.{stage}.{key}" if top == "stages" else top
            for top, value in overlay.items()
            if top != REPLACES_DATA
            for stage, section in (value.items() if top == "stages" and isinstance(value, dict) else [("", None)])
            for key in (section if isinstance(section, dict) else [""])
            if not (top == "stages" and key == "data" and stage in kept)
        ]
        data_note = "; replaces the pipeline file's data (replaces_data: true)" if overlay.get(REPLACES_DATA) else ""
        lines.append(f"profile {loaded.profile}: sets {', '.join(sets) or 'nothing'}{data_note}")
    tiny = spec.model.from_config
    built = f" (built from config: {tiny.architecture}, {tiny.num_hidden_layers} layers, random init)" if tiny else ""
    lines.append(f"model: {spec.model.name_or_path}{built}{mark('model')}")
    for name in spec.stages.enabled():
        section = spec.stage(name)
        data = getattr(section, "data", None)
        if data is None:
            continue
        described = []
        for i, dataset in enumerate(datasets(data)):
            mapping = ", ".join(f"{key}←{column}" for key, column in dataset.columns.items())
            weight = f", weight {dataset.weight:g}" if dataset.weight is not None else ""
            at = ("stages", name, "data", i) if isinstance(data, list) else ("stages", name, "data")
            described.append(
                f"{spec.data_uri(dataset)} ({dataset.format}{'; ' + mapping if mapping else ''}{weight})"
                + (mark(*at, "uri") or mark(*at))
            )
        line = f"{name}: data {' + '.join(described)}"
        if isinstance(data, list) and not any(mark("stages", name, "data", i) for i in range(len(data))):
            line += mark("stages", name, "data")
        if name in kept:
            line += f" [the pipeline file's; profile {loaded.profile}'s data left out: it has no replaces_data: true]"
        training = getattr(section, "training", None)
        if training is not None:
            capped = mark("stages", name, "training", "max_steps")
            budget = f"{training.max_steps} steps" if training.max_steps else f"{training.epochs:g} epochs"
            instead = f" (the pipeline file says {training.epochs:g} epochs)" if capped == by_profile else ""
            line += f", {budget}{capped or mark('stages', name, 'training', 'epochs')}{instead}"
        lines.append(line)
    return lines


def render(spec: PipelineSpec, run_root: Path, runs: list[StageRun], live: bool = True) -> Table:
    """The progress (or summary) table."""
    table = Table(title=f"{spec.name}  ·  {run_root}", title_justify="left", expand=False)
    table.add_column("stage", no_wrap=True, min_width=8)
    table.add_column("status", no_wrap=True, min_width=11)
    table.add_column("time", justify="right", no_wrap=True, min_width=6)
    table.add_column("last log line" if live else "key metric", overflow="ellipsis", no_wrap=True, max_width=70)
    for run in runs:
        summary = run.metric or (run.message.splitlines()[0] if run.message else "")
        detail = (run.last_line or summary) if live else summary  # a skipped stage shows why
        table.add_row(run.name, Text(run.status, style=_STYLE.get(run.status, "")), run.elapsed, detail)
    return table


def print_summary(console: Console, spec: PipelineSpec, run_root: Path, runs: list[StageRun]) -> None:
    """The run's summary: the table on a terminal; elsewhere (CI, a pod's log, a file) one plain line per stage,
    never cut or wrapped, so that a gate's reason reads whole."""
    if console.is_terminal:
        console.print(render(spec, run_root, runs, live=False))
        return
    console.print(f"{spec.name} · {run_root}", markup=False, soft_wrap=True)
    for run in runs:
        detail = run.metric or (run.message.splitlines()[0] if run.message else "")
        line = f"  {run.name:<9} {run.status:<11} {run.elapsed:>7}  {detail}".rstrip()
        console.print(line, markup=False, soft_wrap=True, highlight=False)


def invocation(loaded: LoadedPipeline) -> list[str]:
    """The command that runs `loaded` again, for a caller that did not say how it was started: the pipeline by name
    when it is a shipped one, else by its path, with its --profile (unless the default `local`) and --variant. Its
    --set options cannot be recovered from the spec: the hint says to repeat them."""
    source = Path(loaded.source)
    shipped = PIPELINES_DIR / f"{source.stem}.yaml"
    pipeline = source.stem if shipped.is_file() and shipped.resolve() == source.resolve() else loaded.source
    argv = ["python", "-m", "workflows.submit", pipeline, "--local"]
    if loaded.profile is not None and loaded.profile != "local":
        argv += ["--profile", loaded.profile]
    return argv


def rerun_hint(loaded: LoadedPipeline, run_root: Path, stage: str, resume: list[str] | None = None) -> str:
    """How to resume: `resume` (the runner's command line as the user gave it, without --variant, --run-dir and
    --force; default `invocation(loaded)`) on this run directory, with this variant; or the stage alone."""
    spec = loaded.spec
    argv = list(resume) if resume is not None else invocation(loaded)
    if spec.variant is not None:  # each variant has its own run directory
        argv += ["--variant", spec.variant]
    argv += ["--run-dir", str(run_root)]
    repeat = ""
    if resume is None and any(applied.startswith("--set") for applied in loaded.origins.applied):
        repeat = "   (with the same --set options)"
    alone = ["python", "-m", "stages", stage, "--run-dir", str(run_root)]
    if stage == SERVE_ROW:
        alone = ["python", "-m", "workflows.local_serving", "--run-dir", str(run_root)]
    return (
        "Resume (completed stages are no-ops):\n"
        f"  {shlex.join(argv)}{repeat}\n"
        f"  or this stage alone: {shlex.join(alone)}"
    )


def run_local(
    loaded: LoadedPipeline,
    run_dir: Path | None = None,
    force: bool = False,
    resume: list[str] | None = None,
    *,
    fail_on_gate: bool = False,
) -> int:
    """Run the pipeline's enabled stages in DAG order on this machine; returns the exit code (0: all done).
    `resume` is how the user started it (without --variant, --run-dir and --force), for the hint (rerun_hint)."""
    spec = loaded.spec
    console = Console()
    if spec.stages.evaluate.enabled and spec.stages.evaluate.backend == "vllm" and vllm_python() is None:
        console.print(
            Text(
                f"error: stages.evaluate.backend is 'vllm' but there is no vLLM environment at {where_expected()}: "
                "`make local` sets up .venv-vllm; or set stages.evaluate.backend=transformers",
                style="bold red",
            ),
            soft_wrap=True,
        )
        return EXIT_USAGE
    gpus = gpu_count()
    mesh_errors, _ = local_mesh(spec, gpus)
    if mesh_errors:  # before the run directory exists: nothing has started
        console.print(Text(f"error: {mesh_errors[0]}", style="bold red"), soft_wrap=True)
        return EXIT_USAGE
    run_root = Path(run_dir or default_run_dir(spec)).absolute()
    try:
        lock = lock_run_dir(run_root)
    except RunDirBusy as exc:
        console.print(Text(f"error: {exc}", style="bold red"), soft_wrap=True)
        return EXIT_USAGE
    try:
        with interrupts_raise():
            return _run_locked(loaded, run_root, lock, force, console, gpus, resume, fail_on_gate=fail_on_gate)
    except (StageInterrupted, KeyboardInterrupt) as exc:  # between stages: no stage to stop
        name = signal.Signals(interrupt_signal(exc)).name
        console.print(Text(f"{name}: the run stopped between stages", style="bold red"), soft_wrap=True)
        return 128 + interrupt_signal(exc)
    finally:
        lock.close()


def _run_locked(
    loaded: LoadedPipeline,
    run_root: Path,
    lock: Any,
    force: bool,
    console: Console,
    gpus: int,
    resume: list[str] | None = None,
    *,
    fail_on_gate: bool = False,
) -> int:
    """run_local's work, with the run directory locked, on a machine of `gpus` GPUs."""
    spec = loaded.spec
    if not force:  # the values a finished search selected are the run's, not a changed config
        spec = apply_selections(spec, run_root)
    conflicts = [] if force else conflicting_stages(RunDir(run_root), spec)
    if conflicts:
        console.print(
            Text(
                f"error: {run_root} holds {', '.join(conflicts)} completed with another config (or with its "
                "checkpoints); its spec.json is left as it is. Use a new --run-dir (or none), or --force to run "
                "those stages again (their old checkpoints and models are moved aside, not deleted).",
                style="bold red",
            ),
            soft_wrap=True,
        )
        return EXIT_USAGE
    RunDir(run_root).write_spec(spec)
    stages = spec.stages.enabled()
    runs = [StageRun(name) for name in stages]
    env = stage_env(run_root)
    if "deploy" in stages and spec.stages.deploy.serving.enabled:
        runs.append(StageRun(SERVE_ROW))
        if vllm_python() is not None:
            env[LOCAL_SERVE_VARIABLE] = "1"  # deploy leaves champion to the serve step, as in the cluster
    plural = "s" if gpus != 1 else ""
    header = f"{spec.name} → {run_root} ({gpus} GPU{plural}; stages: {', '.join(stages)})"
    console.print(header, markup=False, soft_wrap=True)
    for line in effective_plan(loaded):
        console.print(f"  {line}", markup=False, soft_wrap=True)
    warned = plan_warnings(loaded) + local_mesh(spec, gpus)[1]
    for line in warned:
        console.print(Text(f"  warning: {line}", style="yellow"), soft_wrap=True)

    exit_code = 0
    failed: StageRun | None = None
    gone = ""  # the run directory was deleted or replaced: what the error line says
    skip_reason = ""
    gate_reason = ""
    live = Live(render(spec, run_root, runs), console=console, refresh_per_second=4, transient=True)

    def redraw() -> None:
        if console.is_terminal:
            live.update(render(spec, run_root, runs))

    echo = None if console.is_terminal else lambda line: console.print(line, markup=False, soft_wrap=True)
    with live if console.is_terminal else _Quiet(), warm_starts(env, gpus) as warm:
        for run in list(runs):  # a search adds a row per trial to `runs`
            if failed is not None:
                run.status = "not run"
                continue
            if skip_reason:  # prepare ended the run (skip_if_unchanged), as the cluster DAG does
                run.status, run.message = "skipped", skip_reason
                continue
            if run.name == "deploy" and gate_reason:  # deploy runs only after gate=pass, as in the cluster
                run.status, run.message = "skipped", gate_reason
                continue
            if run.name == SERVE_ROW:
                if serve_row(run, runs, run_root, env, redraw, echo):
                    failed, exit_code = run, 1
                if not console.is_terminal:
                    console.print(f"{run.name}: {run.status} ({run.elapsed})", markup=False)
                continue
            if not stage_module_exists(run.name):
                run.status, run.message = "missing", f"stages/{run.name}.py does not exist yet"
                failed, exit_code = run, 1
                continue
            gone = run_dir_gone(run_root, lock, run.name) or ""  # before the stage writes its log there
            if gone:
                run.status, run.message = "not run", "the run directory is gone"
                failed, exit_code = run, 1
                continue
            before = read_stage_json(run_root, run.name)
            run.status, run.started = "running", time.monotonic()
            if not console.is_terminal:
                console.print(f"{run.name}: running", markup=False)

            def refresh() -> None:
                if console.is_terminal:
                    live.update(render(spec, run_root, runs))

            try:
                if search_needed(spec, run_root, run.name, force):
                    say = None if console.is_terminal else lambda line: console.print(line, markup=False)
                    why = search_in_runner(spec, run_root, run, runs, env, force, gpus, refresh, say, warm)
                    if why:
                        run.ended, run.status, run.message = time.monotonic(), "failed", why
                        failed, exit_code = run, 1
                        continue
                log = run_root / run.name / "logs" / "stage.log"
                grace = spec.stage(run.name).run_policy.termination_grace_period_seconds
                launch_stage(run, spec, run.name, run_root, env, log, refresh, grace, warm, echo, force, gpus)
            except (StageInterrupted, KeyboardInterrupt) as exc:
                # The stage got the signal and has exited (run_stage waited): its record says how it ended, or,
                # killed before it could say so, the runner does.
                name = signal.Signals(interrupt_signal(exc)).name
                if run.returncode is not None and run.returncode < 0 and not run_dir_gone(run_root, lock, run.name):
                    killed = f"killed by the runner after {name} (it did not stop in time); running it again resumes"
                    record_interrupted(run_root, run.name, killed)
                run.ended, run.status = time.monotonic(), "interrupted"
                if run.returncode is None:  # before its process began (the warm-start server importing, a trial)
                    run.message = f"{name} to the runner before the stage started"
                else:
                    recorded = (read_stage_json(run_root, run.name) or {}).get("message", "")
                    run.message = f"{name} to the runner; the stage exited with {run.returncode}" + (
                        f": {recorded}" if recorded else ""
                    )
                failed, exit_code = run, 128 + interrupt_signal(exc)
                if not console.is_terminal:
                    console.print(f"{run.name}: interrupted ({run.elapsed}): {run.message}", markup=False)
                continue
            run.ended = time.monotonic()
            gone = run_dir_gone(run_root, lock, run.name) or ""  # whatever the stage said, it is no success
            if gone:
                run.status, run.message = "failed", "its run directory was deleted or replaced"
                failed, exit_code = run, 1
                if not console.is_terminal:
                    console.print(f"{run.name}: failed ({run.elapsed})", markup=False)
                continue
            result = read_stage_json(run_root, run.name)
            status = (result or {}).get("status")
            if run.returncode == 0 and status in ("succeeded", "skipped"):
                same = before is not None and before.get("ended_at") == (result or {}).get("ended_at")
                run.status = "done before" if same else status
                run.metric = key_metric(run.name, result)
                if run.name == "prepare" and (result or {}).get("extra", {}).get("proceed") == "false":
                    skip_reason = result["extra"].get("skip-reason", "") or "prepare ended the run"
                    console.print(f"ending the run: {skip_reason}", markup=False, soft_wrap=True)
                if run.name == "prepare":  # the eval splits' real sizes, for the stages not warned about before
                    estimated = {line.split(":", 1)[0] for line in warned}
                    for line in prepared_warnings((result or {}).get("extra") or {}, estimated):
                        console.print(Text(f"warning: {line}", style="yellow"), soft_wrap=True)
                if run.name == "evaluate" and (gate_reason := deploy_skip_reason(result or {})):
                    console.print(f"skipping deploy: {gate_reason}", markup=False, soft_wrap=True)
            else:
                run.status = "interrupted" if run.returncode == EXIT_RETRYABLE else "failed"
                run.message = (result or {}).get("message", "") or f"exit code {run.returncode}"
                failed, exit_code = run, run.returncode or 1
            if not console.is_terminal:
                console.print(f"{run.name}: {run.status} ({run.elapsed})", markup=False)

    print_summary(console, spec, run_root, runs)
    if failed is None and spec.retention.enabled:
        exit_code = run_retention(spec, run_root, console)
    if gone:  # no resume command, no tracking hints: the run directory they would name is not this run's
        console.print(Text(f"error: {gone}", style="bold red"), soft_wrap=True)
        return exit_code
    if failed is not None:
        if failed.tail:
            log_path = run_root / failed.name / "logs" / "stage.log"
            if failed.name == SERVE_ROW:
                log_path = run_root / "deploy" / "logs" / "serve.log"
            console.print(
                Text(f"{failed.name} {failed.status}; last lines of {log_path}:", style="bold red"), soft_wrap=True
            )
            console.print(Text("\n".join(failed.tail)), soft_wrap=True)
        else:
            console.print(Text(f"{failed.name}: {failed.message}", style="bold red"), soft_wrap=True)
        console.print(rerun_hint(loaded, run_root, failed.name, resume), markup=False, soft_wrap=True)
    elif gate_reason and spec.stages.deploy.enabled:
        gate_note = Text(f"The gate did not pass ({gate_reason}); deploy was skipped.", style="bold yellow")
        console.print(gate_note, soft_wrap=True)
        console.print(register_anyway_hint(run_root), markup=False, soft_wrap=True)
        if fail_on_gate and exit_code == 0:
            exit_code = EXIT_GATE_FAILED
    uri = spec.tracking.mlflow_tracking_uri or env["MLFLOW_TRACKING_URI"]
    for line in where_to_look(spec, run_root, uri):
        console.print(line, markup=False, soft_wrap=True)
    return exit_code


SERVE_ROW = "serve"
"""The row of the local serve step (workflows/local_serving.py), after deploy, where the cluster's rollout runs."""


def serve_row(
    run: StageRun,
    runs: list[StageRun],
    run_root: Path,
    env: dict[str, str],
    refresh: Callable[[], None],
    echo: Callable[[str], None] | None,
) -> bool:
    """Run the local serve step after a deploy that succeeded: vLLM serves the deployed model and answers the
    smoke check (`python -m workflows.local_serving`, its output in `deploy/logs/serve.log`). Skipped, with the
    reason on its row, where deploy did not run or no serving environment is set up. True when it failed."""
    deploy = next(r for r in runs if r.name == "deploy")
    if deploy.status not in ("succeeded", "done before"):
        run.status, run.message = "skipped", "nothing deployed"
        return False
    if vllm_python() is None:
        run.status = "skipped"
        where = where_expected() if os.environ.get(VLLM_PYTHON_VARIABLE) else ENV_DIR.name
        run.message = f"no vLLM serving environment ({where}: `make local` sets it up)"
        return False
    served = ((read_stage_json(run_root, "deploy") or {}).get("extra") or {}).get("served")
    if deploy.status == "done before" and served:
        run.status, run.metric = "done before", f"vLLM {served.get('engine_version', '')}"
        return False
    command = [sys.executable, "-m", "workflows.local_serving", "--run-dir", str(run_root)]
    run.status, run.started = "running", time.monotonic()
    run.returncode = run_stage(run, command, env, run_root / "deploy" / "logs" / "serve.log", refresh, echo=echo)
    run.ended = time.monotonic()
    if run.returncode == 0:  # its last line says what answered and where champion is
        run.status, run.metric = "succeeded", run.last_line.removeprefix("[serve] ")
        return False
    run.status = "failed"
    run.message = next((line for line in reversed(run.tail) if "error:" in line), f"exit code {run.returncode}")
    return True


def where_to_look(spec: PipelineSpec, run_root: Path, uri: str) -> list[str]:
    """The summary's last lines: the evaluation report, and the commands that open what the run tracked (the
    MLflow UI on its store, TensorBoard on its event files, `wandb sync` for its offline W&B runs)."""
    lines = []
    report = ((read_stage_json(run_root, "evaluate") or {}).get("extra") or {}).get("report")
    if report and (run_root / report).is_file():
        lines.append(f"Report: {run_root / report}")
    if uri.startswith("sqlite:///"):
        lines.append(f"MLflow UI: mlflow ui --backend-store-uri {uri}")
    else:
        lines.append(f"MLflow: {mask_secrets(uri)}")
    if spec.tracking.tensorboard and any(run_root.glob("*/logs/tensorboard")):
        lines.append(f"TensorBoard: tensorboard --logdir {run_root}")
    if any((run_root / "wandb").glob("offline-run-*")):
        lines.append(f"W&B (offline runs): wandb sync {run_root / 'wandb'}/offline-run-*")
    return lines


def run_retention(spec: PipelineSpec, run_root: Path, console: Console) -> int:
    """The cluster's retention step on this machine: `python -m workflows.runs prune` over the runs folder this run
    lies in (this run itself is never deleted); its exit code."""
    if run_root.parent.name != RUN_ROOT:
        console.print(f"retention: {run_root} is not in a {RUN_ROOT}/ folder; nothing pruned", markup=False)
        return 0
    retention = spec.retention
    command = [sys.executable, "-m", "workflows.runs", "prune", "--pipeline", spec.name]
    command += ["--checkpoints", str(run_root.parent.parent), "--current", run_root.name]
    if retention.keep_last is not None:
        command += ["--keep-last", str(retention.keep_last)]
    if retention.keep_days is not None:
        command += ["--keep-days", f"{retention.keep_days:g}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = checkout_first(env.get("PYTHONPATH", ""))
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    for line in (done.stdout + done.stderr).splitlines():
        console.print(f"retention: {line}", markup=False, soft_wrap=True)
    return done.returncode


class _Quiet:
    """Stands in for the live view when the output is not a terminal (CI logs get plain lines)."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def run_local_variants(
    variants: dict[str, LoadedPipeline],
    run_dir: Path | None = None,
    force: bool = False,
    resume: list[str] | None = None,
    *,
    fail_on_gate: bool = False,
) -> int:
    """Run each variant's stages (run_local), one variant after the other, each in its own run directory
    (`runs/<pipeline>-<variant>-<time>`, or `run_dir` for a single one), then a summary of all; returns the first
    failure's exit code (0: all done). A failed variant does not stop the next (they are separate models, as in
    the cluster); an interrupt does. `resume`: as for run_local."""
    console = Console()
    outcomes: list[tuple[str, str, int | None]] = []
    for name, loaded in variants.items():
        root = run_dir if run_dir is not None else default_run_dir(loaded.spec)
        console.print(f"variant {name}", style="bold", markup=False)
        code = run_local(loaded, root, force, resume, fail_on_gate=fail_on_gate)
        outcomes.append((name, str(Path(root).absolute()), code))
        if code >= 128:  # interrupted: the variants left are not started
            break
    rows = [(name, root, "done" if code == 0 else f"failed (exit {code})") for name, root, code in outcomes]
    ran = {name for name, _, _ in outcomes}
    rows += [(name, "", "not run") for name in variants if name not in ran]
    if not console.is_terminal:  # plain lines, never cut (see print_summary)
        console.print("variants", markup=False)
        for name, root, outcome in rows:
            console.print(f"  {name}  {outcome}  {root}".rstrip(), markup=False, soft_wrap=True, highlight=False)
        return next((code for _, _, code in outcomes if code), 0)
    table = Table(title="variants", title_justify="left", expand=False)
    for column in ("variant", "run directory", "outcome"):
        table.add_column(column, no_wrap=column != "run directory")
    for name, root, outcome in rows:
        style = _STYLE.get("succeeded" if outcome == "done" else "failed" if outcome != "not run" else "", "")
        table.add_row(name, root, Text(outcome, style=style))
    console.print(table)
    return next((code for _, _, code in outcomes if code), 0)
