"""Measuring one model end to end: the score cache first, then the section's backend for the rest.

`measure_cached` answers each part (held-out numbers, lm-eval tasks, generations) from the score cache
(stages/scores.py) where an earlier run measured the same model the same way; `measure_loaded` measures what is
left with `stages.evaluate.backend`: transformers in this process (stages/measures.py) or vLLM's server
(stages/vllm_measures.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stages.contract import StageContext
from stages.measures import Measured, measure, part_value, release
from stages.scores import ScoreCache
from stages.vllm_measures import measure_served


def measure_loaded(
    ctx: StageContext,
    who: str,
    load: Callable[[], tuple[Any, Any]],
    rows: list[dict[str, Any]],
    lm_eval: bool = True,
    generations: bool = True,
) -> Measured:
    """`measure` on the model `load` returns (model, tokenizer), by the section's backend: loaded here and freed
    after ('transformers'), or saved, freed and measured through vLLM's server ('vllm', stages/vllm_measures.py)."""
    if ctx.section.backend == "vllm":
        return measure_served(ctx, who, load, rows, lm_eval=lm_eval, generations=generations)
    model, tokenizer = load()
    out = measure(ctx, model, tokenizer, rows, who, lm_eval=lm_eval, generations=generations)
    release(model)
    return out


def measure_cached(
    ctx: StageContext,
    who: str,
    parts: list[str],
    load: Callable[[], tuple[Any, Any]],
    rows: list[dict[str, Any]],
    cache: ScoreCache | None,
    keys: dict[str, dict[str, Any]] | None,
    identity: Callable[[], str | None],
) -> Measured:
    """The `parts` of a model's numbers: from the score cache where it holds them for this model (`identity`,
    asked before loading) and these keys; the rest measured on the model `load` returns (model, tokenizer), which
    is loaded only then, and filed in the cache (a model known only once loaded, a hub model downloaded by it, is
    filed under the identity asked for again). A part whose measurement failed is not filed."""
    out = Measured()
    model_id = identity() if cache is not None and keys is not None else None
    todo = []
    for part in parts:
        entry = cache.lookup(model_id, part, keys[part]) if cache is not None and keys and model_id else None
        if entry is None:
            todo.append(part)
            continue
        out.cached[part] = entry.run
        if part == "generations":
            out.generations = [str(g) for g in entry.value]
        else:
            out.metrics.update({k: float(v) for k, v in entry.value.items()})
    if out.cached:
        runs = ", ".join(f"{part} from run {run}" for part, run in out.cached.items())
        print(f"[evaluate] {who}: numbers from the score cache ({runs})", flush=True)
    if not todo:
        return out
    fresh = measure_loaded(
        ctx,
        who,
        load,
        rows if "heldout" in todo else [],
        lm_eval="lm_eval" in todo,
        generations="generations" in todo,
    )
    out.metrics.update(fresh.metrics)
    out.engine = fresh.engine
    out.errors += fresh.errors
    out.failed |= fresh.failed
    if "generations" in todo:
        out.generations = fresh.generations
    if cache is not None and keys is not None and (model_id := model_id or identity()):
        for part in todo:
            if part not in fresh.failed:
                cache.store(model_id, part, keys[part], part_value(part, fresh), ctx.run_dir.root.name)
    return out
