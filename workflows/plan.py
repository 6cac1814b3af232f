"""Warnings about a run's plan, said before it starts: what a profile changed and what the data and steps will give.

The local runner prints them under its plan (workflows/local.py), and they need only the loaded spec (plus a row
count of a local JSONL file), so a cluster submission can print the same. Each names the stage, what it found and
what to change:

- `max_steps` overrides an `epochs` someone set (on data a profile did not swap in): as in transformers'
  TrainingArguments (and so LLaMA-Factory and Axolotl), a set `max_steps` wins over epochs; the warning says so,
  where each value came from, and how to train the epochs instead (`--set stages.<stage>.training.max_steps=null`).
- an eval split under MIN_EVAL_ROWS rows of the user's data: estimated here for a local JSONL file, counted after
  prepare (`prepared_warnings`).
- evaluate measures built-in data while a training stage trains on the user's own: the gate then compares the
  models on text unrelated to what they learned.

`local_mesh` says, before a --local run starts, what its machine makes of a stage's tensor- and expert-parallel
groups: --local runs a training stage as one process per GPU here (one without GPUs), so a group size that does not
divide that count is an error there and then (the stage would stop only after the stages before it ran), and a
stage of one process trains unsplit (a warning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spec.data import datasets
from spec.document import LoadedPipeline
from spec.fields import TRAINING_STAGES
from spec.loading import REPLACES_DATA
from spec.pipeline import PipelineSpec

MIN_EVAL_ROWS = 20
"""Fewer held-out rows than this make eval_loss and perplexity noise (one odd row moves them by more than training
does), so a gate decided on them is a coin toss; 20 rows is the least where the mean settles at these sizes."""
MAX_COUNTED_BYTES = 64 * 2**20
"""A local JSONL file up to this size has its rows counted before the run (a larger one is counted by prepare)."""
BUILTIN_PREFIX = "builtin:"


def _origin(loaded: LoadedPipeline, *keys: str) -> str:
    where = loaded.origins.by_path.get(tuple(keys))
    return f" ({where})" if where else ""


def _local_rows(uri: str) -> int | None:
    """Non-blank lines of a local JSONL file, or None when `uri` is not one (or too large to count here)."""
    path = Path(uri.removeprefix("file://"))
    if "://" in uri.removeprefix("file://") or uri.startswith(BUILTIN_PREFIX) or path.suffix != ".jsonl":
        return None
    try:
        if not path.is_file() or path.stat().st_size > MAX_COUNTED_BYTES:
            return None
        with path.open("rb") as handle:
            return sum(1 for line in handle if line.strip())
    except OSError:
        return None


def expected_eval_rows(rows: int, eval_fraction: float) -> int:
    """About how many of `rows` prepare holds out (stages/prepared_data.py: a fraction of them by hash, and at
    least one when the fraction is not zero and there is more than one row)."""
    if eval_fraction <= 0 or rows <= 1:
        return 0
    return max(1, round(rows * eval_fraction))


def small_eval_warning(
    stage: str,
    eval_rows: int,
    rows: int | None,
    eval_fraction: float | None,
    estimated: bool = True,
    mixture: bool = False,
) -> str:
    """The warning for a stage whose eval split holds (about, when `estimated`) `eval_rows` rows, under
    MIN_EVAL_ROWS."""
    if stage == "evaluate":
        return (
            f"evaluate: its data has {eval_rows} rows, under {MIN_EVAL_ROWS}: its perplexity, and the gate decided "
            "on it, is noise; give stages.evaluate.data more held-out rows"
        )
    of = f" of the {rows} rows" if rows is not None else " rows"
    fraction = f" (eval_fraction {eval_fraction:g})" if eval_fraction is not None else ""
    about = "about " if estimated else ""
    where = f"the eval_fraction of stages.{stage}.data's datasets" if mixture else f"stages.{stage}.data.eval_fraction"
    return (
        f"{stage}: {about}{eval_rows}{of} are held out for eval{fraction}, under {MIN_EVAL_ROWS}: its eval_loss "
        f"is noise; raise {where} or add rows"
    )


def profile_swapped_data(loaded: LoadedPipeline) -> set[str]:
    """The stages whose data the applied profile replaced (it says `replaces_data: true` and names a URI): their
    step budget is the profile's, for its own data, and the plan already shows it against the file's epochs."""
    overlay = (loaded.document.get("profiles") or {}).get(loaded.profile) or {} if loaded.profile else {}
    if not isinstance(overlay, dict) or overlay.get(REPLACES_DATA) is not True:
        return set()
    stages = overlay.get("stages") if isinstance(overlay.get("stages"), dict) else {}
    return {
        name
        for name, section in stages.items()
        if isinstance(section, dict) and any(isinstance(d, dict) and "uri" in d for d in _as_list(section.get("data")))
    }


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def plan_warnings(loaded: LoadedPipeline) -> list[str]:
    """The warnings about the plan of `loaded` (see the module docstring), one line each."""
    spec = loaded.spec
    warnings: list[str] = []
    swapped = profile_swapped_data(loaded)
    for name in spec.stages.enabled():
        section = spec.stage(name)
        training = getattr(section, "training", None)
        stage_doc = ((loaded.document.get("stages") or {}).get(name) or {}) if name in TRAINING_STAGES else {}
        set_epochs = "epochs" in ((stage_doc.get("training") or {}) if isinstance(stage_doc, dict) else {})
        if training is not None and training.max_steps and set_epochs and name not in swapped:
            warnings.append(
                f"{name}: max_steps {training.max_steps}{_origin(loaded, 'stages', name, 'training', 'max_steps')} "
                f"overrides epochs {training.epochs:g}{_origin(loaded, 'stages', name, 'training', 'epochs')}: it "
                f"trains {training.max_steps} optimizer steps, as max_steps does in transformers, LLaMA-Factory and "
                f"Axolotl; to train the epochs instead: --set stages.{name}.training.max_steps=null"
            )
        mixture = datasets(getattr(section, "data", None))
        counted = [(data, _local_rows(spec.data_uri(data))) for data in mixture]
        if not counted or any(rows is None for _, rows in counted):
            continue
        rows = sum(n or 0 for _, n in counted)
        if name == "evaluate":
            held = rows
        else:
            held = sum(expected_eval_rows(n or 0, data.eval_fraction) for data, n in counted)
        if 0 < held < MIN_EVAL_ROWS:
            fraction = None if name == "evaluate" or len(mixture) > 1 else mixture[0].eval_fraction
            listed = isinstance(getattr(section, "data", None), list)
            warnings.append(small_eval_warning(name, held, rows, fraction, mixture=listed))
    if (unrelated := unrelated_evaluation(spec)) is not None:
        warnings.append(unrelated)
    return warnings


def unrelated_evaluation(spec: PipelineSpec) -> str | None:
    """A warning when evaluate measures built-in data while a training stage trains on the user's own data."""
    evaluate = spec.stages.evaluate
    if not evaluate.enabled or evaluate.data is None:
        return None
    measured = datasets(evaluate.data)
    own = [
        (name, spec.data_uri(data), data.format)
        for name in spec.stages.enabled()
        if name in TRAINING_STAGES
        for data in datasets(getattr(spec.stage(name), "data", None))
        if not spec.data_uri(data).startswith(BUILTIN_PREFIX)
    ]
    if not all(spec.data_uri(d).startswith(BUILTIN_PREFIX) for d in measured) or not own:
        return None
    trained = ", ".join(f"{name} on {uri} ({fmt})" for name, uri, fmt in own)
    described = ", ".join(f"{spec.data_uri(d)} ({d.format})" for d in measured)
    return (
        f"evaluate: measures {described}, built-in data unrelated to what the model trains "
        f"on ({trained}); the gate compares the models on it. Point stages.evaluate.data at held-out rows of your "
        "own (e.g. --set stages.evaluate.data.uri=heldout.jsonl), or remove stages.evaluate.data to measure the "
        "candidate stage's own held-out split"
    )


def prepared_warnings(prepare_extra: dict[str, Any], already: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The small-eval-split warnings from prepare's counts (its stage.json `extra.data`), for the stages not in
    `already` (warned before the run from an estimate) and not on built-in data."""
    warnings = []
    for stage, counts in (prepare_extra.get("data") or {}).items():
        if stage in already or not isinstance(counts, dict) or str(counts.get("uri", "")).startswith(BUILTIN_PREFIX):
            continue  # the project's own offline data is small by design: nothing the user can add rows to
        held = int(counts.get("eval_rows") or 0)
        if 0 < held < MIN_EVAL_ROWS:
            rows = int(counts.get("rows") or 0) or None
            warnings.append(small_eval_warning(stage, held, rows, None, estimated=False, mixture="datasets" in counts))
    return warnings


def local_mesh(spec: PipelineSpec, gpus: int) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the enabled training stages' tensor, expert and pipeline parallelism on a machine of
    `gpus` GPUs, where --local runs each training stage as max(gpus, 1) processes (see the module docstring)."""
    processes = max(gpus, 1)
    errors: list[str] = []
    warnings: list[str] = []
    for name in TRAINING_STAGES:
        section = spec.stage(name)
        if not section.enabled:
            continue
        for field in ("tensor_parallel", "expert_parallel", "pipeline_parallel"):
            size = getattr(section.distributed, field)
            where = f"stages.{name}.distributed.{field}"
            if size == 1:
                continue
            if processes == 1:
                warnings.append(f"{where} is {size}, but this machine runs {name} as one process: it trains unsplit")
            elif processes % size:
                errors.append(
                    f"{where} is {size}, which does not divide the {processes} processes --local runs {name} with "
                    f"(one per GPU here): set it to a divisor of {processes}, or CUDA_VISIBLE_DEVICES to a multiple "
                    f"of {size} GPUs"
                )
        pp = section.distributed.pipeline_parallel
        mesh = pp * section.distributed.tensor_parallel
        if pp > 1 and processes > 1 and not processes % pp and processes % mesh:
            errors.append(
                f"stages.{name}.distributed.pipeline_parallel {pp} times "
                f"tensor_parallel {section.distributed.tensor_parallel} does not divide the {processes} processes "
                f"--local runs {name} with (one per GPU here): each pipeline takes {mesh}"
            )
        ep = section.distributed.expert_parallel
        if pp > 1 and ep > 1 and processes > 1 and not processes % pp and (processes // pp) % ep:
            errors.append(
                f"stages.{name}.distributed.expert_parallel {ep} does not divide the {processes // pp} processes of "
                f"each of the {pp} pipeline stages --local runs {name} with (one per GPU here): each stage "
                "spreads its experts over its own processes"
            )
    return errors, warnings
