"""The evaluate stage: measure the candidate, compare it with the base model and the registered champion, gate.

    python -m stages evaluate --run-dir DIR [--outputs-dir /tmp/outputs]

Reads top to bottom:

1. The candidate is the output of the last enabled training stage (rlhf, else sft, else cpt). A run that prepare
   ended early (data unchanged, `prepare.skip_if_unchanged`) has no candidate: the stage is recorded as skipped
   and outputs gate=skipped, so deploy does not run. The candidate's model folder (and the stage model folder an
   adapter applies to) is fingerprinted by content as it loads and must be what its stage recorded; stage.json
   records the fingerprints as the inputs `candidate` (and `candidate_base`), which deploy holds the model it
   registers to.
2. Each model (the candidate, then the base model; one in memory at a time, loaded straight onto the pod's GPUs
   and spread over them when one is too small: `placement`) is measured the same way (`stages/measures.py`):
   - held-out perplexity over `prepare/data/evaluate/eval.jsonl` (text rows: every token, ending with eos, as
     cpt trains; chat rows: rendered with the chat template, the assistant's tokens scored, as sft trains);
     without evaluate data, the candidate stage's own held-out split;
   - the lm-eval-harness tasks of `stages.evaluate.lm_eval_tasks` through `lm_eval.simple_evaluate` on an HFLM
     wrapping the loaded model, with `lm_eval_include_path` as extra task YAMLs (tasks over local data files
     work on an offline cluster; `builtin:korean-lm-eval` is the folder prepare generated from the builtin
     corpus); metrics are named `<task>/<metric>` (e.g. `kobest_boolq/acc`), each with lm-eval's standard error
     `<task>/<metric>_stderr` where it has one, and `<task>/n_samples`, the examples the task was measured on;
   - greedy generations for `stages.evaluate.prompts` (through the chat template when sft or rlhf ran), in one
     batch.
   With `backend: vllm` each model is instead saved, freed and measured the same way through vLLM's server, the
   engine KServe serves it with (`stages/vllm_measures.py`); stage.json says what measured each (`engines`).
   The base model's numbers come from the score cache (`stages/scores.py`, `cache_scores`) where an earlier run
   measured the same model (by content) the same way; then the base model is not even loaded. The candidate is
   always measured.
3. The champion: the `champion` alias of the registered model (deploy.registered_model, else the pipeline name)
   in the MLflow Model Registry (`stages/registry.py`). Its numbers come from the version's
   `posttrain.metric.<name>` tags, then from the metrics of the run that registered it. They are measured again,
   on the model downloaded from the registry: the held-out numbers whenever the held-out rows they were measured
   on differ from this run's, or are not recorded (`heldout_change`), and any gated metric found nowhere, each
   from the score cache first (by the version's content fingerprint: the model is then not downloaded).
   stage.json says which numbers were measured again and why (`champion_remeasured`). No champion yet: the gate
   compares with the base model.
4. The gate (`stages/gate.py`): every rule of `stages.evaluate.gate` must hold against the reference (the
   champion, else the base model): within an absolute or relative allowance and, with `min_significance`, better
   by more than that many standard errors (`check_rule`); a metric that was not measured fails its rule, saying
   so. The registry cannot be read: fail. A gate that does not pass ends the pipeline run here (deploy does not
   run): the MLflow parent run is closed.
5. The report (`stages/report.py`: `evaluate/report/report.md` and `report.html`, numbers ± standard error with
   their n, metric panels with the gate's thresholds, one loss panel per training stage) is logged to MLflow
   with the metrics (`candidate/...`, `base/...`, `champion/...`), and stage.json records the decision and the
   numbers: extra {gate, gate_reasons, gate_checks, candidate, base, champion, ...}. `gate` ('pass', 'fail' or
   'skipped') is the Argo output deploy's `when` reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from run.release import GATE_FAIL, GATE_PASS, GATE_SKIPPED
from run.run_dir import RunDir
from stages.contract import StageContext
from stages.data import DataError
from stages.entry import run_stage
from stages.gate import apply_gate
from stages.measures import (
    HELDOUT_METRICS,
    candidate_stage,
    include_dir,
    placement,
    read_rows,
    score_keys,
)
from stages.measuring import measure_cached, measure_loaded
from stages.registry import (
    EVALUATE_DATA_TAG,
    HELDOUT_TAG,
    Champion,
    download_champion,
    find_champion,
    registered_model_name,
    registry_client,
)
from stages.report import loss_curves, prepared_data_counts, stderr_name, write_report
from stages.scores import ScoreCache, base_identity, champion_identity
from stages.vllm_measures import check_environment

# --------------------------------------------------------------------------- the stage


def run(ctx: StageContext) -> int:
    """Evaluate the candidate and decide the gate; returns the process exit code. Refused when the candidate
    changed after its stage recorded it: nothing measured."""
    return run_stage(ctx, lambda: evaluate(ctx), (DataError,))


def evaluate(ctx: StageContext) -> int:
    from stages.modeling import ModelInputs, load_base, load_stage_model, load_tokenizer, spec_base
    from stages.tracking import StageTracker

    run_dir, spec, section = ctx.run_dir, ctx.spec, ctx.section
    stage = candidate_stage(spec)

    # 1. The candidate; nothing to do in a run that prepare ended early.
    if (reason := skip_reason(run_dir, stage)) is not None:
        print(f"[evaluate] skipped: {reason}", flush=True)
        return ctx.finish(status="skipped", message=reason, extra={"gate": GATE_SKIPPED, "gate_reasons": [reason]})
    include_dir(spec, run_dir.root)  # a task folder off the volumes fails here, before any model loads
    check_environment(ctx)  # so does backend: vllm without vLLM
    data_path = perplexity_data(run_dir, stage)
    rows = read_rows(data_path) if data_path is not None else []
    heldout_fingerprint = _sha256(data_path) if data_path is not None else ""
    if data_path is not None:
        ctx.add_input("heldout", run_dir.relative(data_path), heldout_fingerprint)

    with StageTracker(ctx) as tracker:
        tracker.log_params(
            {
                "candidate_stage": stage,
                "registered_model": registered_model_name(spec),
                "heldout": run_dir.relative(data_path) if data_path else "",
                "heldout_rows": len(rows),
            }
        )

        # 2. The candidate, then the base model, measured the same way (one in memory at a time); the base
        #    model's numbers come from the score cache when an earlier run measured the same model the same way.
        tokenizer = load_tokenizer(run_dir, spec.model)
        # Fingerprinted as it loads, held to its stage's record, recorded as the input `candidate` (and
        # `candidate_base`): deploy registers only a model with these fingerprints.
        candidate = measure_loaded(
            ctx,
            "candidate",
            lambda: (
                load_stage_model(
                    run_dir, spec, stage, tokenizer, ModelInputs(ctx), name="candidate", placement=placement()
                ),
                tokenizer,
            ),
            rows,
        )
        keys = score_keys(ctx, heldout_fingerprint)
        cache = ScoreCache(run_dir.root.parent) if keys is not None else None
        wanted = {"heldout": rows, "lm_eval": section.lm_eval_tasks, "generations": section.prompts}
        parts = [part for part, asked in wanted.items() if asked]
        base = measure_cached(
            ctx,
            "base",
            parts,
            lambda: (load_base(run_dir, spec, spec_base(spec), tokenizer, placement=placement()), tokenizer),
            rows,
            cache,
            keys,
            identity=lambda: base_identity(spec.model, cache),
        )
        errors = candidate.errors + base.errors

        # 3. The champion: its recorded numbers, measured again on this run's held-out rows when they were
        #    measured on others (or on unknown ones), and for the gated metrics it has no number for.
        champion: Champion | None = None
        registry_error = ""
        try:
            client, tracking_uri = registry_client(spec, run_dir.root)
            champion = find_champion(client, registered_model_name(spec))
            if champion is not None:
                changed = heldout_change(
                    champion.tags, heldout_fingerprint, evaluate_data_fingerprint(run_dir, data_path)
                )
                errors += remeasure_champion(ctx, client, tracking_uri, champion, rows, changed, cache, keys)
        except Exception as exc:
            registry_error = f"the champion could not be read from the model registry: {type(exc).__name__}: {exc}"
            print(f"[evaluate] {registry_error}", flush=True)

        # 4. The gate, against the champion (else the base model).
        if champion is not None:
            reference, ref_name = champion.metrics, f"champion v{champion.version}"
        else:
            reference, ref_name = base.metrics, "base model"
        decision, reasons, checks = apply_gate(section.gate, candidate.metrics, reference, ref_name)
        if registry_error:
            decision, reasons = GATE_FAIL, [registry_error, *reasons]
        print(f"[evaluate] gate {decision}: " + "; ".join(reasons), flush=True)
        if decision != GATE_PASS:  # deploy runs only after gate=pass: the pipeline run ends here
            tracker.end_pipeline_run("gate-fail", f"gate {decision} against the {ref_name}: " + "; ".join(reasons))

        # 5. The report, the tracker, the record.
        facts: dict[str, Any] = {
            "pipeline": spec.name,
            "run": run_dir.root.name,
            "gate": decision,
            "gate_reasons": reasons,
            "gate_checks": [asdict(c) for c in checks],
            "reference": ref_name,
            "candidate_stage": stage,
            "candidate": candidate.metrics,
            "base": base.metrics,
            "base_cached": base.cached,
            "champion": champion.metrics if champion else {},
            "champion_version": champion.version if champion else "",
            "champion_source": champion.source if champion else {},
            "champion_remeasured": champion.remeasured if champion else {},
            "champion_heldout_fingerprint": champion.tags.get(HELDOUT_TAG, "") if champion else "",
            "heldout_fingerprint": heldout_fingerprint,
            "registered_model": registered_model_name(spec),
            "base_model": spec.model.name_or_path,
            "perplexity_data": run_dir.relative(data_path) if data_path else "",
            "lm_eval_tasks": list(section.lm_eval_tasks),
            "backend": section.backend,
            "engines": {who: m.engine for who, m in (("candidate", candidate), ("base", base)) if m.engine},
            "limit": section.limit,
            "prompts": list(section.prompts),
            "candidate_generations": candidate.generations,
            "base_generations": base.generations,
            "errors": errors,
            "loss_curves": loss_curves(run_dir, spec),
            "data": prepared_data_counts(run_dir),
        }
        report_dir = ctx.dir / "report"
        for path in write_report(report_dir, facts):
            tracker.log_artifact(path, "report")
        tracker.log_metrics(
            {
                **candidate.metrics,
                **{f"candidate/{k}": v for k, v in candidate.metrics.items()},
                **{f"base/{k}": v for k, v in base.metrics.items()},
                **{f"champion/{k}": v for k, v in facts["champion"].items()},
                "gate_passed": 1.0 if decision == GATE_PASS else 0.0,
            },
            step=0,
        )
        generations = report_dir / "generations.json"
        generations.write_text(
            json.dumps(
                [
                    {"prompt": p, "base": b, "candidate": c}
                    for p, b, c in zip(facts["prompts"], base.generations, candidate.generations, strict=True)
                ],
                ensure_ascii=False,
                indent=2,
            ),
            encoding="utf-8",
        )
        tracker.log_artifact(generations, "report")
        extra = {k: v for k, v in facts.items() if k not in ("loss_curves", "pipeline", "run")}
        extra["report"] = run_dir.relative(report_dir / "report.html")
        return ctx.finish(
            outputs={"report": report_dir},
            metrics=candidate.metrics,
            extra=extra,
            message=f"gate {decision} against the {ref_name}",
        )


# --------------------------------------------------------------------------- what is evaluated


def skip_reason(run_dir: RunDir, stage: str) -> str | None:
    """Why this run has nothing to evaluate (prepare ended it early as unchanged), or None."""
    result = run_dir.read_result(stage)
    if result is not None and result.status == "succeeded":
        return None
    prepare = run_dir.read_result("prepare")
    extra = prepare.extra if prepare is not None else {}
    skipped_here = result is not None and result.status == "skipped"
    if skipped_here or (extra.get("skip_if_unchanged") == "true" and extra.get("unchanged") == "true"):
        previous = extra.get("previous_run") or "the last successful run"
        return f"the data is unchanged since {previous}: no new model was trained in this run"
    return None


def perplexity_data(run_dir: RunDir, stage: str) -> Path | None:
    """evaluate's held-out rows, else the candidate stage's held-out split (text or chat rows), else None."""
    for path in (
        run_dir.root / "prepare" / "data" / "evaluate" / "eval.jsonl",
        run_dir.root / "prepare" / "data" / stage / "eval.jsonl",
    ):
        if path.is_file() and path.stat().st_size > 0:
            return path
    return None


def evaluate_data_fingerprint(run_dir: RunDir, data_path: Path | None) -> str | None:
    """The fingerprint prepare recorded for evaluate's source data, when the held-out rows are that data."""
    if data_path is None or data_path.parent.name != "evaluate":
        return None
    prepare = run_dir.read_result("prepare")
    if prepare is None:
        return None
    counts = (prepare.extra.get("data") or {}).get("evaluate") or {}
    return counts.get("fingerprint") or None


def _sha256(path: Path) -> str:
    from stages.data import sha256_file

    return sha256_file(path)


# --------------------------------------------------------------------------- the champion's numbers


def heldout_change(tags: dict[str, str], heldout: str, evaluate_data: str | None) -> str | None:
    """Why a champion's recorded held-out numbers do not compare with this run's (measured on `heldout`), or None
    when they were measured on the same rows. Its version's held-out fingerprint decides; a version registered
    without one is compared by its evaluate data fingerprint, when this run's held-out rows are evaluate's data
    (`evaluate_data`); with neither, it is unknown, which counts as changed."""
    if recorded := tags.get(HELDOUT_TAG):
        if recorded == heldout:
            return None
        return f"measured on other held-out rows ({recorded[:19]}; this run's are {heldout[:19]})"
    if (recorded := tags.get(EVALUATE_DATA_TAG)) and evaluate_data:
        if recorded == evaluate_data:
            return None
        return f"measured on other evaluate data ({recorded[:19]}; this run's is {evaluate_data[:19]})"
    return "the held-out rows its numbers were measured on are not recorded"


def remeasure_champion(
    ctx: StageContext,
    client: Any,
    tracking_uri: str,
    champion: Champion,
    rows: list[dict[str, Any]],
    changed: str | None,
    cache: ScoreCache | None = None,
    keys: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """Measure the champion again where its recorded numbers do not compare with the candidate's: the held-out
    numbers when `changed` says why they are stale (they are dropped first, so a failed measurement fails the
    gate instead of comparing stale numbers), and the gated metrics it has no number for. The score cache
    answers first (by the version's content fingerprint): the model is downloaded only for what it lacks.
    Records what was measured again, and why, in `champion.remeasured` (source 'cache' or 're-evaluated');
    returns the errors of the measurement."""
    from transformers import AutoTokenizer

    from stages.modeling import load_pretrained

    section, spec = ctx.section, ctx.spec
    stale = changed is not None and bool(rows)
    if stale:
        for key in HELDOUT_METRICS:
            champion.metrics.pop(key, None)
            champion.source.pop(key, None)
    gated = [rule.metric for rule in section.gate]
    gated += [stderr_name(rule.metric) for rule in section.gate if rule.min_significance is not None]
    missing = [metric for metric in gated if metric not in champion.metrics]
    heldout = bool(rows) and (stale or any(m in HELDOUT_METRICS for m in missing))
    lm_eval = bool(section.lm_eval_tasks) and any(m not in HELDOUT_METRICS for m in missing)
    if not (heldout or lm_eval):
        return []
    why = [f"held-out numbers {changed}" if stale else "", f"no recorded {missing}" if missing else ""]
    print(f"[evaluate] measuring champion v{champion.version} again: {'; '.join(w for w in why if w)}", flush=True)

    def load() -> tuple[Any, Any]:
        path = download_champion(client, champion, ctx.dir / "champion-model", tracking_uri)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.model.trust_remote_code)
        return load_pretrained(path, spec.model, **placement()), tokenizer

    parts = [part for part, needed in (("heldout", heldout), ("lm_eval", lm_eval)) if needed]
    again = measure_cached(
        ctx, "champion", parts, load, rows, cache, keys, identity=lambda: champion_identity(champion.tags)
    )
    for key, value in again.metrics.items():
        if key in champion.metrics:
            continue
        part = "heldout" if key in HELDOUT_METRICS else "lm_eval"
        champion.metrics[key], champion.source[key] = value, "cache" if part in again.cached else "re-evaluated"
        champion.remeasured[key] = f"held-out numbers {changed}" if stale and key in HELDOUT_METRICS else "not recorded"
    return again.errors
