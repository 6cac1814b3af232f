"""The prepare stage: validate and normalize every enabled stage's data, build the tokenizer, open tracking.

Reads top to bottom:

1. ctx.begin(): a completed prepare with the same config is a no-op.
2. For each enabled stage with data (evaluate first, then cpt, sft, rlhf): stream every row through validation,
   normalization and cleaning (`stages.prepared_data`, in `stages.prepare.num_proc` worker processes):
   quarantine bad rows within the stage's max_bad_row_fraction, drop duplicates, filtered rows and rows that
   contain evaluation text (the evaluate stage's rows and its lm-eval task documents), split off the eval rows
   by a hash of their content, and write `prepare/data/<stage>/{train,eval}.jsonl` (evaluate: eval.jsonl only),
   their `.origins` and `manifest.json`, recording each input with its fingerprint (sha256 of a local file's
   content, the etag or generation and size of a stored object). A builtin lm-eval task folder
   (`stages.evaluate.lm_eval_include_path: builtin:<name>`) is generated into `prepare/data/evaluate/lm_eval/`
   first and recorded too. Every task of `stages.evaluate.lm_eval_tasks` must be defined by lm-eval or the
   include path.
3. The fingerprint of what decides the run's result (each stage's data, the model, each stage's configuration, the
   project version: `stages.run_inputs`), and whether it equals the last successful run's (see `last_success`);
   with `skip_if_unchanged` and nothing changed, the run ends after prepare (steps 4 and 5 are not needed), and
   otherwise prepare says what changed.
4. The tokenizer (`stages.tokenizer`) into `prepare/tokenizer/`, trained on the training rows for a model
   built from config.
5. Token caches: `stages.packing.build_token_cache(run_dir, spec, stage)` for each enabled training stage;
   tokenization happens once, here. Every conversation goes through the model's chat template (stages.chat),
   the ones the trainers template themselves (rlhf's pairs, evaluate's chat rows) too: a row the template
   refuses, a model without a template, a tokenizer without eos fail here (one error, exit 2).
6. Tracking: the MLflow parent run of the pipeline run and prepare's own run, W&B group; then ctx.finish
   with the Argo output parameters `fingerprint`, `unchanged`, `tokenizer_hash`, `mlflow_parent_run_id`, and
   `proceed`/`skip-reason` (the later stages run only when proceed is true; the reason shows in the Argo UI
   and the notification).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from run.config_hash import canonical_hash
from run.exits import EXIT_OK
from run.run_dir import RunDir, StageRefused
from spec.data import DataSpec, datasets
from spec.fields import STAGE_ORDER, TRAINING_STAGES
from spec.pipeline import PipelineSpec
from stages.check_data import check_data, data_specs
from stages.contract import StageContext
from stages.data import BUILTIN_TASKS_DIR, MAX_LISTED_ERRORS, DataError, in_cluster
from stages.prepared_data import origins_of, prepare_split, read_lines
from stages.run_inputs import run_inputs, what_changed
from stages.tokenizer import build_tokenizer, render_for_training, tokenizer_hash
from stages.tracking import StageTracker
from stages.workers import default_num_proc


def dropped_note(cleaning: dict[str, Any]) -> str:
    """', dropped: 3 duplicate, 1 too_short; personal data: 2 phone, 1 email' for the log line of a stage's data
    ('' when cleaning dropped none and found no personal data)."""
    dropped = [f"{n} {reason}" for reason, n in cleaning.get("dropped", {}).items() if n]
    found = [f"{n} {kind}" for kind, n in cleaning.get("pii", {}).items() if n]
    return (f", dropped: {', '.join(dropped)}" if dropped else "") + (
        f"; personal data: {', '.join(found)}" if found else ""
    )


def write_stage_data(
    ctx: StageContext, stage: str, data: DataSpec | list[DataSpec], num_proc: int, contamination: Any = None
) -> dict[str, Any]:
    """Stream a stage's data (one dataset, or a mixture's list) into its normalized splits, origins, quarantine
    and manifest (`stages.prepared_data.prepare_split`; `contamination` applies to the datasets that
    decontaminate), record its inputs and log its counts; return the counts for stage.json."""
    training = getattr(ctx.spec.stage(stage), "training", None)
    c = prepare_split(
        ctx.dir / "data" / stage,
        ctx.dir / "quarantine" / f"{stage}.jsonl",
        stage,
        data,
        ctx.spec,
        ctx.run_dir.root,
        num_proc,
        contamination,
        seed=training.seed if training is not None else 0,
    )
    for source in c["sources"]:
        ctx.add_input(f"{stage}:{source['uri']}", source["uri"], source["fingerprint"])
    print(
        f"[prepare] {stage}: {c['train_rows']} train + {c['eval_rows']} eval rows, {c['quarantined']} quarantined"
        f"{dropped_note(c['cleaning'])} ({_described(c, data)})",
        flush=True,
    )
    for d, dataset in zip(c.get("datasets", []), datasets(data), strict=False):  # a mixture's, one line each
        weight = f", weight {dataset.weight:g}" if dataset.weight is not None else ""
        if stage == "evaluate":
            rows = f"{d['eval_rows']} eval rows ({d['share']:.1%} of the stage's)"
        else:
            rows = (
                f"{d['train_rows']} train rows ({d['share']:.1%} of the stage's{weight}; it has "
                f"{d['read_train_rows']}) + {d['eval_rows']} eval"
            )
        print(
            f"[prepare] {stage} data.{d['index']}: {rows}, {d['quarantined']} quarantined"
            f"{dropped_note(d['cleaning'])} ({_described(d, dataset)})",
            flush=True,
        )
    return c


def _described(counts: dict[str, Any], data: DataSpec | list[DataSpec]) -> str:
    """'uri, format, key←column, ...' of one dataset; the URIs of a mixture."""
    if isinstance(data, list):
        return f"{len(data)} datasets"
    return f"{counts['uri']}, {data.format}" + "".join(f", {key}←{column}" for key, column in data.columns.items())


def data_label(spec: PipelineSpec, stage: str) -> str:
    """'stages.sft.data (uri)' for errors about a stage's data as a whole (a mixture: every dataset's URI)."""
    uris = ", ".join(spec.data_uri(d) for d in datasets(spec.stage(stage).data))
    return f"stages.{stage}.data ({uris})"


def evaluation_texts(ctx: StageContext) -> Any:
    """What training data must not contain (`stages.cleaning.Contamination`): the evaluate stage's held-out rows
    and the documents of its lm-eval tasks; None when no training stage decontaminates or there is nothing to
    compare with. Tasks whose documents cannot be loaded here (a hub dataset, offline) are named in the log."""
    from stages.cleaning import Contamination, lm_eval_texts, row_text

    spec = ctx.spec
    mixtures = data_specs(spec)
    wanted = [s for s, ds in mixtures.items() if s != "evaluate" and any(d.cleaning.decontaminate for d in ds)]
    section = spec.stages.evaluate
    if not wanted or not section.enabled:
        return None
    texts = [row_text(row) for row in read_lines(ctx.dir / "data" / "evaluate" / "eval.jsonl")]
    if section.lm_eval_tasks:
        from stages.measures import include_dir

        include = include_dir(spec, ctx.run_dir.root)
        documents, unavailable = lm_eval_texts(section.lm_eval_tasks, str(include) if include else None)
        texts += documents
        if unavailable:
            print(
                f"[prepare] decontamination: the documents of {', '.join(unavailable)} could not be loaded here; "
                "training data is not checked against them",
                flush=True,
            )
    if not texts:
        return None
    ngram = min(d.cleaning.decontamination_ngram for s in wanted for d in mixtures[s] if d.cleaning.decontaminate)
    print(f"[prepare] decontamination: {len(texts)} evaluation texts, {ngram}-word spans", flush=True)
    return Contamination(texts, ngram)


def write_builtin_tasks(ctx: StageContext) -> dict[str, Any] | None:
    """The builtin lm-eval task folder that stages.evaluate.lm_eval_include_path names (`builtin:<name>`),
    written into the run directory for evaluate; its record for stage.json, or None when the spec names none."""
    from stages.builtin_data import BuiltinDataError, write_lm_eval_tasks

    section = ctx.spec.stages.evaluate
    uri = section.lm_eval_include_path
    if not section.enabled or uri is None or not uri.startswith("builtin:"):
        return None
    try:
        rows, fingerprint = write_lm_eval_tasks(uri.removeprefix("builtin:"), ctx.run_dir.root / BUILTIN_TASKS_DIR)
    except BuiltinDataError as exc:
        raise DataError(f"stages.evaluate.lm_eval_include_path: {uri}: {exc}") from None
    ctx.add_input(f"evaluate:{uri}", uri, fingerprint)
    listed = ", ".join(f"{task} ({n} rows)" for task, n in rows.items())
    print(f"[prepare] evaluate: lm-eval tasks {listed} ({uri})", flush=True)
    return {"uri": uri, "dir": str(BUILTIN_TASKS_DIR), "rows": rows, "fingerprint": fingerprint}


def check_lm_eval_tasks(ctx: StageContext) -> None:
    """DataError naming every task of stages.evaluate.lm_eval_tasks that neither the installed lm-eval nor the
    include path defines: found here, before anything trains, not by evaluate hours later."""
    section = ctx.spec.stages.evaluate
    if not section.enabled or not section.lm_eval_tasks:
        return
    from spec.lm_eval_tasks import unknown_tasks
    from stages.measures import include_dir

    problems = unknown_tasks(ctx.spec, include_dir(ctx.spec, ctx.run_dir.root))
    if problems:
        raise DataError("; ".join(problems))


def build_token_caches(run_dir: RunDir, spec: PipelineSpec, stages: list[str], num_proc: int) -> dict[str, Path]:
    """Tokenize each training stage's data once, in `num_proc` processes; StageRefused naming the stage's data
    and the rows (the user's file and line) when the chat template cannot render some of its conversations."""
    from stages.packing import ConversationRowsError, build_token_cache

    caches = {}
    for stage in stages:
        try:
            caches[stage] = Path(build_token_cache(run_dir, spec, stage, num_proc))
        except ConversationRowsError as exc:
            where = origins_of(exc.path, [line for line, _ in exc.problems])
            rows = [(where.get(line, f"{exc.path}:{line}"), problem) for line, problem in exc.problems]
            raise StageRefused(f"{data_label(spec, stage)}: {conversation_errors(rows, exc.total)}") from None
    return caches


def conversation_errors(rows: list[tuple[str, str]], total: int | None = None) -> str:
    """The rows (where, problem) a chat template cannot turn into a trainable conversation, the first few listed
    (`total`: how many there are, when `rows` are only the first)."""
    total = len(rows) if total is None else total
    listed = "\n".join(f"  {where}: {problem}" for where, problem in rows[:MAX_LISTED_ERRORS])
    more = f"\n  ... and {total - min(len(rows), MAX_LISTED_ERRORS)} more" if total > MAX_LISTED_ERRORS else ""
    return f"{total} conversations cannot be trained on with the model's chat template:\n{listed}{more}"


def check_conversations(ctx: StageContext, tokenizer: Any, stage: str) -> None:
    """Render every conversation the trainers will template themselves (preference pairs for rlhf, chat rows for
    evaluate) with the model's chat template: a row the template refuses fails prepare, naming it, instead of
    the stage hours later."""
    from stages.chat import ConversationError, tokenize_conversation

    problems: list[tuple[str, str]] = []
    total = 0
    for split in ("train", "eval"):
        path = ctx.dir / "data" / stage / f"{split}.jsonl"
        failed: list[tuple[int, str]] = []
        for line, row in enumerate(read_lines(path), start=1):
            conversations = [row["messages"]] if "messages" in row else []
            if "prompt" in row:
                conversations = [[*row["prompt"], *row["chosen"]], [*row["prompt"], *row["rejected"]]]
            try:
                for messages in conversations:
                    tokenize_conversation(tokenizer, messages, tools=row.get("tools"))
            except ConversationError as exc:
                total += 1
                if len(failed) + len(problems) < MAX_LISTED_ERRORS:
                    failed.append((line, str(exc)))
        where = origins_of(path, [line for line, _ in failed])
        problems += [(where.get(line, f"{path}:{line}"), problem) for line, problem in failed]
    if total:
        raise StageRefused(f"{data_label(ctx.spec, stage)}: {conversation_errors(problems, total)}")


def needs_chat_template(counts: dict[str, dict[str, Any]]) -> bool:
    """Whether any stage reads conversations (a model without a chat template can still do CPT)."""
    return any(c["kind"] in ("chat", "preference") for c in counts.values())


def training_texts(ctx: StageContext, stages: list[str]) -> Iterator[str]:
    """The training rows of `stages` as the text a tokenizer is trained on, read back from their splits."""
    for stage in stages:
        for row in read_lines(ctx.dir / "data" / stage / "train.jsonl"):
            yield render_for_training(row)


def build_tokenizer_and_caches(
    ctx: StageContext, counts: dict[str, dict[str, Any]], num_proc: int
) -> tuple[Path, Any, str, dict[str, Path]]:
    """The tokenizer (trained on the training rows, every stage but evaluate, when the model is built from
    config) and the token caches of the stages the packer tokenizes (text and chat data; preference data
    is tokenized by the preference trainer itself, after prepare checked the template renders it)."""
    from stages.chat import TemplateError

    training = [s for s in TRAINING_STAGES if s in counts]
    tokenizer_dir = ctx.dir / "tokenizer"
    try:
        tokenizer = build_tokenizer(
            ctx.spec, training_texts(ctx, training), tokenizer_dir, needs_template=needs_chat_template(counts)
        )
    except TemplateError as exc:
        raise StageRefused(str(exc)) from None
    tok_hash = tokenizer_hash(tokenizer_dir)
    print(f"[prepare] tokenizer: {len(tokenizer)} tokens, {tok_hash[:19]}", flush=True)
    for stage, c in counts.items():
        if stage in ("rlhf", "evaluate") and c["kind"] in ("chat", "preference"):
            check_conversations(ctx, tokenizer, stage)
    packed = [s for s in training if counts[s]["kind"] in ("text", "chat")]
    return tokenizer_dir, tokenizer, tok_hash, build_token_caches(ctx.run_dir, ctx.spec, packed, num_proc)


def count_tokens(counts: dict[str, Any], cache: Path) -> None:
    """Add a stage's tokens, as its token cache counted them, to its counts: the split's tokens, and a mixture's
    tokens and token share per dataset."""
    meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
    counts["tokens"] = {split: meta[split]["tokens"] for split in ("train", "eval")}
    for split in ("train", "eval"):
        per_dataset = meta[split].get("dataset_tokens") or []
        total = sum(per_dataset) or 1
        for d, tokens in zip(counts.get("datasets", []), per_dataset, strict=False):
            d[f"{split}_tokens"] = tokens
            if split == "train":
                d["token_share"] = tokens / total


def _done(record: dict[str, Any] | None) -> bool:
    """Whether a stage record says the stage succeeded or was skipped."""
    return record is not None and record.get("status") in ("succeeded", "skipped")


def ended_as_designed(results: dict[str, dict[str, Any] | None]) -> bool:
    """Whether a run's enabled stages (name → stage.json, None when it has none) add up to a run that ended as
    the DAG intends: every stage succeeded (or was skipped), or evaluate succeeded with a gate that did not pass
    and the stages after it never ran (deploy runs only after gate=pass)."""
    if all(_done(r) for r in results.values()):
        return True
    evaluate = results.get("evaluate") or {}
    if evaluate.get("status") != "succeeded" or evaluate.get("extra", {}).get("gate") != "fail":
        return False
    cut = STAGE_ORDER.index("evaluate")
    return all(
        _done(r) if STAGE_ORDER.index(s) <= cut else (r is None or r.get("status") == "skipped")
        for s, r in results.items()
    )


def last_success(run_dir: RunDir, spec: PipelineSpec) -> tuple[str | None, str | None]:
    """(run name, data fingerprint) of the newest other run of this pipeline, next to this one, that completed:
    every enabled stage succeeded (or was skipped), or it ended after a failed gate (`ended_as_designed`).
    (None, None) when there is none.

    Run directories of a pipeline are siblings (`runs/<name>` locally, `<checkpoints>/runs/<workflow>` in the
    cluster), so this reads their spec.json and stage.json files; nothing else keeps state."""
    best: tuple[str, str, str] | None = None  # (ended_at, name, fingerprint)
    for other in sorted(run_dir.root.parent.iterdir()) if run_dir.root.parent.is_dir() else []:
        if other == run_dir.root or not (other / "spec.json").is_file():
            continue
        try:
            other_spec = json.loads((other / "spec.json").read_text(encoding="utf-8"))
            if other_spec.get("name") != spec.name:
                continue
            enabled = [s for s in STAGE_ORDER if other_spec.get("stages", {}).get(s, {}).get("enabled", s == "prepare")]
            results = {s: _read_record(other / s / "stage.json") for s in enabled}
        except (OSError, ValueError):
            continue
        if results.get("prepare") is not None and ended_as_designed(results):
            prepare = results["prepare"]
            fingerprint = prepare.get("extra", {}).get("fingerprint")
            if fingerprint and (best is None or (prepare.get("ended_at") or "") > best[0]):
                best = (prepare.get("ended_at") or "", other.name, fingerprint)
    return (best[1], best[2]) if best else (None, None)


def _read_record(path: Path) -> dict[str, Any] | None:
    """A stage.json as a dict; None when the stage never ran (raises ValueError for a broken file)."""
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def run(ctx: StageContext) -> int:
    """Run the prepare stage."""
    if not ctx.begin():
        return EXIT_OK
    spec = ctx.spec

    # 1. Data: validate, clean, quarantine, split, write; the evaluate stage's first, since training data is
    #    checked against it (decontamination).
    num_proc = default_num_proc(spec, in_cluster(spec, ctx.run_dir.root))
    counts: dict[str, dict[str, Any]] = {}
    tasks: dict[str, Any] | None = None
    # Each stage's data on its first rows, before any worker starts: a missing file, a wrong format, column mapping or
    # encoding fails here in seconds, as `submit --local` refuses it (stages/check_data.py), with the same lines.
    problems = check_data(spec, ctx.run_dir.root, remote=True)
    if problems:
        for problem in problems:
            print(f"[prepare] error: {problem}", file=sys.stderr, flush=True)
        return ctx.fail("\n".join(problems))
    try:
        tasks = write_builtin_tasks(ctx)
        check_lm_eval_tasks(ctx)
        specs = {stage: spec.stage(stage).data for stage in data_specs(spec)}
        if "evaluate" in specs:
            counts["evaluate"] = write_stage_data(ctx, "evaluate", specs["evaluate"], num_proc)
        contamination = evaluation_texts(ctx)
        for stage, data in specs.items():
            if stage != "evaluate":
                counts[stage] = write_stage_data(ctx, stage, data, num_proc, contamination)
        counts = {s: counts[s] for s in specs}  # DAG order
    except DataError as exc:
        print(f"[prepare] error: {exc}", file=sys.stderr, flush=True)
        return ctx.fail(str(exc))

    # 2. Fingerprints, and the cron rule: nothing changed since the last successful run (data, model,
    #    configuration, project version: stages.run_inputs) ends the run here.
    fingerprints = {s: c["fingerprint"] for s, c in counts.items()}
    if tasks is not None:  # evaluation data too: other questions are another run's data
        fingerprints["evaluate:lm_eval"] = tasks["fingerprint"]
    data_fingerprint = "sha256:" + canonical_hash(fingerprints)
    inputs = run_inputs(spec, fingerprints)
    fingerprint = "sha256:" + canonical_hash(inputs)
    previous_run, previous_fingerprint = last_success(ctx.run_dir, spec)
    unchanged = previous_fingerprint == fingerprint
    skip_reason = ""
    if spec.stages.prepare.skip_if_unchanged:
        if previous_run is None:
            print("[prepare] no earlier successful run to compare with", flush=True)
        elif unchanged:
            print(f"[prepare] data and configuration unchanged since run {previous_run}", flush=True)
            skip_reason = (
                f"data and configuration unchanged since run {previous_run} ({fingerprint[:19]}): nothing to train"
            )
        else:
            changes = what_changed(spec, inputs, ctx.run_dir.root.parent / previous_run)
            print(f"[prepare] changed since run {previous_run}: {'; '.join(changes)}", flush=True)

    # 3-4. Tokenizer and token caches (not needed when the run ends here). What fails unexpectedly, here or
    #      anywhere in this stage, is recorded by the entry point (`StageContext.crash`, in stages/__main__.py).
    tokenizer_dir, tokenizer, tok_hash, caches = None, None, "", {}
    if not skip_reason:
        tokenizer_dir, tokenizer, tok_hash, caches = build_tokenizer_and_caches(ctx, counts, num_proc)
        for stage, cache in caches.items():
            count_tokens(counts[stage], cache)

    # 5. Tracking: the pipeline run's parent run (W&B group) and prepare's own run.
    outputs: dict[str, Path] = {"tokenizer": tokenizer_dir} if tokenizer_dir else {}
    for stage in counts:
        for split in ("train", "eval"):
            path = ctx.dir / "data" / stage / f"{split}.jsonl"
            if path.is_file():
                outputs[f"{stage}_{split}"] = path
    outputs.update({f"{stage}_token_cache": path for stage, path in caches.items()})
    if tasks is not None:
        outputs["evaluate_lm_eval"] = ctx.run_dir.root / BUILTIN_TASKS_DIR
    metrics: dict[str, float] = {"tokenizer_vocab_size": len(tokenizer)} if tokenizer is not None else {}
    for stage, c in counts.items():
        metrics.update({f"{stage}_rows": c["rows"], f"{stage}_quarantined": c["quarantined"]})
        metrics.update({f"{stage}_dropped_{reason}": n for reason, n in c["cleaning"]["dropped"].items()})
        metrics.update({f"{stage}_pii_{kind}": n for kind, n in c["cleaning"]["pii"].items()})
        if "tokens" in c:
            metrics[f"{stage}_train_tokens"] = c["tokens"]["train"]
        for d in c.get("datasets", []):
            at = f"{stage}_data{d['index']}"  # not '..._rows': the run's summary lists those as the stages' rows
            metrics.update({f"{at}_rows_in_stage": d["rows"], f"{at}_share": d["share"]})
            if "train_tokens" in d:
                metrics[f"{stage}_data{d['index']}_train_tokens"] = d["train_tokens"]
    with StageTracker(ctx) as tracker:
        if skip_reason:  # no stage runs after this one: close the pipeline's MLflow run, saying why
            tracker.end_pipeline_run("skipped", skip_reason)
        tracker.log_params(
            {
                "data": {s: {k: c[k] for k in ("uri", "format", "fingerprint")} for s, c in counts.items()},
                "data_fingerprint": data_fingerprint,
                "inputs_fingerprint": fingerprint,
                "tokenizer_hash": tok_hash,
                **({"lm_eval_tasks": {k: tasks[k] for k in ("uri", "fingerprint")}} if tasks else {}),
            }
        )
        tracker.log_metrics(metrics, step=0)
        for stage in counts:
            quarantine = ctx.dir / "quarantine" / f"{stage}.jsonl"
            if quarantine.is_file():
                tracker.log_artifact(quarantine, "quarantine")
        extra = {
            "data": counts,
            **({"lm_eval_tasks": tasks} if tasks else {}),
            "fingerprint": fingerprint,
            "inputs": inputs,
            "tokenizer_hash": tok_hash,
            "unchanged": "true" if unchanged else "false",
            "previous_run": previous_run or "",
            "skip_if_unchanged": "true" if spec.stages.prepare.skip_if_unchanged else "false",
            # Argo outputs gating the DAG: every later stage runs only when proceed is true.
            "proceed": "false" if skip_reason else "true",
            "skip-reason": skip_reason,
            "mlflow_parent_run_id": tracker.parent_run_id or "",
        }
        return ctx.finish(outputs=outputs, metrics=metrics, extra=extra, message=skip_reason)
