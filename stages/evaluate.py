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
   and spread over them when one is too small: `placement`) is measured the same way:
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
   The base model's numbers come from the score cache (`stages/scores.py`, `cache_scores`) where an earlier run
   measured the same model (by content) the same way; then the base model is not even loaded. The candidate is
   always measured.
3. The champion: the `champion` alias of the registered model (deploy.registered_model, else the pipeline name)
   in the MLflow Model Registry. Its numbers come from the version's `posttrain.metric.<name>` tags, then from
   the metrics of the run that registered it. They are measured again, on the model downloaded from the
   registry: the held-out numbers whenever the held-out rows they were measured on differ from this run's, or
   are not recorded (`heldout_change`), and any gated metric found nowhere, each from the score cache first (by
   the version's content fingerprint: the model is then not downloaded). stage.json says which numbers were
   measured again and why (`champion_remeasured`). No champion yet: the gate compares with the base model.
4. The gate: every rule of `stages.evaluate.gate` must hold against the reference (the champion, else the base
   model): within an absolute or relative allowance and, with `min_significance`, better by more than that many
   standard errors (`check_rule`); a metric that was not measured fails its rule, saying so. The registry cannot
   be read: fail. A gate that does not pass ends the pipeline run here (deploy does not run): the MLflow parent
   run is closed.
5. The report (`stages/report.py`: `evaluate/report/report.md` and `report.html`, numbers ± standard error with
   their n, metric panels with the gate's thresholds, one loss panel per training stage) is logged to MLflow
   with the metrics (`candidate/...`, `base/...`, `champion/...`), and stage.json records the decision and the
   numbers: extra {gate, gate_reasons, gate_checks, candidate, base, champion, ...}. `gate` ('pass', 'fail' or
   'skipped') is the Argo output deploy's `when` reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stages.contract import EXIT_OK, RunDir, StageContext, StageRefused
from stages.data import BUILTIN_TASKS_DIR, DataError, confine, resolve_path, within
from stages.report import SAMPLES_METRIC, loss_curves, plus_minus, stderr_name, write_report
from stages.scores import ScoreCache, base_identity, champion_identity
from workflows.spec import TRAINING_STAGES, GateRule, PipelineSpec

CHAMPION = "champion"
CHALLENGER = "challenger"
METRIC_TAG_PREFIX = "posttrain.metric."
"""Model version tags holding the metrics a version was gated with (written by deploy, read here)."""
HELDOUT_TAG = "posttrain.heldout_fingerprint"
"""Model version tag: the fingerprint of the held-out rows its perplexity was measured on (this stage's
`heldout_fingerprint`, written by deploy)."""
EVALUATE_DATA_TAG = "posttrain.data.evaluate.fingerprint"
"""Model version tag: the fingerprint of evaluate's source data in the run that registered it (from prepare)."""
HELDOUT_METRICS = ("eval_loss", "perplexity", "eval_rows", "eval_tokens", "eval_rows_truncated")
"""What `perplexity` measures: numbers that only compare over the same held-out rows."""

GATE_PASS, GATE_FAIL, GATE_SKIPPED = "pass", "fail", "skipped"
TOKENS_PER_BATCH = 8192
"""Perplexity batches hold at most this many tokens (bounds the logits' memory on a large vocabulary)."""


# --------------------------------------------------------------------------- what is evaluated


def candidate_stage(spec: PipelineSpec) -> str:
    """The last enabled training stage: its output is the candidate."""
    enabled = [s for s in TRAINING_STAGES if spec.stage(s).enabled]
    if not enabled:
        raise ValueError("no training stage is enabled: there is no candidate to evaluate")
    return enabled[-1]


def registered_model_name(spec: PipelineSpec) -> str:
    """The MLflow registered model: deploy.registered_model, else the pipeline name."""
    return spec.stages.deploy.registered_model or spec.name


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


def chat_model(spec: PipelineSpec) -> bool:
    """Whether the candidate was tuned on conversations (prompts then go through the chat template)."""
    return spec.stages.sft.enabled or spec.stages.rlhf.enabled


def max_length(spec: PipelineSpec, stage: str) -> int:
    """Tokens per scored row: the candidate stage's training length."""
    return spec.stage(stage).training.max_seq_length


# --------------------------------------------------------------------------- perplexity


def perplexity_data(run_dir: RunDir, stage: str) -> Path | None:
    """evaluate's held-out rows, else the candidate stage's held-out split (text or chat rows), else None."""
    for path in (
        run_dir.root / "prepare" / "data" / "evaluate" / "eval.jsonl",
        run_dir.root / "prepare" / "data" / stage / "eval.jsonl",
    ):
        if path.is_file() and path.stat().st_size > 0:
            return path
    return None


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The normalized rows prepare wrote (one JSON object a line)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def encode_row(tokenizer: Any, row: dict[str, Any], enable_thinking: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100: not scored) of a row, exactly as the training stages see it: a text row is
    the document ending with eos, every token scored; a chat row (or a preference row's prompt + chosen answer)
    goes through the chat template with the assistant's tokens scored."""
    from stages.chat import tokenize_conversation
    from stages.packing import tokenize_document

    if "text" in row:
        ids = tokenize_document(tokenizer, row["text"])
        return ids, list(ids)
    messages = row.get("messages") or [*row["prompt"], *row["chosen"]]
    return tokenize_conversation(tokenizer, messages, enable_thinking=enable_thinking, assistant_only_loss=True)


def perplexity(
    model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_len: int, enable_thinking: bool = False
) -> dict[str, float]:
    """Held-out loss (mean negative log-likelihood per scored token), its perplexity, and the counts.
    Rows longer than `max_len` tokens are cut to their first `max_len`."""
    import torch
    import torch.nn.functional as F

    encoded = [encode_row(tokenizer, row, enable_thinking) for row in rows]
    truncated = sum(1 for ids, _ in encoded if len(ids) > max_len)
    encoded = sorted(((ids[:max_len], labels[:max_len]) for ids, labels in encoded), key=lambda e: len(e[0]))
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    total_nll, total_tokens = 0.0, 0
    model.eval()
    batch: list[tuple[list[int], list[int]]] = []

    def score(batch: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(batch):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
            mask[i, : len(row_ids)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        target = labels[:, 1:].to(device)
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return float(nll), int((target != -100).sum())

    for item in encoded:
        if batch and len(item[0]) * (len(batch) + 1) > TOKENS_PER_BATCH:
            nll, tokens = score(batch)
            total_nll, total_tokens, batch = total_nll + nll, total_tokens + tokens, []
        batch.append(item)
    if batch:
        nll, tokens = score(batch)
        total_nll, total_tokens = total_nll + nll, total_tokens + tokens
    if total_tokens == 0:
        raise ValueError("the held-out rows have no scored tokens")
    loss = total_nll / total_tokens
    return {
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "eval_rows": float(len(rows)),
        "eval_tokens": float(total_tokens),
        "eval_rows_truncated": float(truncated),
    }


# --------------------------------------------------------------------------- lm-eval-harness


BOOTSTRAP_ITERS = 1000
"""lm-eval's bootstrap draws for the standard errors of metrics without a closed form (f1, mcc, bleu; lm-eval caps
bleu, chrf and ter at 100); `acc`-like means use the closed form, sample stddev / sqrt(n), and cost nothing."""


def flatten_lm_eval(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's results ({task: {'acc,none': 0.61, 'acc_stderr,none': 0.02}}, 'n-samples': {task: {'effective':
    60}}) as `<task>/<metric>`, `<task>/<metric>_stderr` and `<task>/n_samples` (a filter other than 'none' is
    kept: `<task>/<metric>/<filter>`); a standard error lm-eval could not compute ('N/A') and non-numbers are
    left out."""
    metrics: dict[str, float] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric, filt = key.split(",", 1)
            name = f"{task}/{metric}" if filt == "none" else f"{task}/{metric}/{filt}"
            metrics[name] = float(value)
    for task, counts in (results.get("n-samples") or {}).items():
        effective = counts.get("effective") if isinstance(counts, dict) else None
        if isinstance(effective, int) and not isinstance(effective, bool):
            metrics[f"{task}/{SAMPLES_METRIC}"] = float(effective)
    return metrics


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's task index: the include_path's tasks alone when they define every task asked for (no
    indexing of the harness's hundreds of built-in tasks), else the built-in tasks plus the include_path's."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def lm_eval_metrics(
    model: Any,
    tokenizer: Any,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    max_len: int | None = None,
) -> dict[str, float]:
    """Run lm-eval-harness tasks on an already loaded model; `include_path` adds a folder of task YAMLs."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"stages.evaluate.lm_eval_include_path {include_path} is not a directory")
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size="auto" if torch.cuda.is_available() else 4,
        max_length=max_len,
    )
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        limit=limit,
        task_manager=task_manager(tasks, include_path),
        log_samples=False,
        bootstrap_iters=BOOTSTRAP_ITERS,
        verbosity="WARNING",
    )
    if results is None:  # only on ranks other than 0
        return {}
    return flatten_lm_eval(results)


# --------------------------------------------------------------------------- generations


def generate(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, chat: bool) -> list[str]:
    """Greedy completions of the prompts (through the chat template when `chat`), in one batch: the prompts are
    padded on the left, so each row's new tokens start at the same column. One batch rather than one prompt at a
    time: a decoding step of an 8B model costs about the same for one row as for a few (measured, docs/
    performance.md, evaluate on a GPU). A row's answer ends at its first stop token (eos, or the end of an
    assistant turn: Gemma's <end_of_turn> is not its eos)."""
    import torch

    from stages.chat import stop_token_ids

    if not prompts:
        return []
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer) if chat else [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if chat:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            for prompt in prompts
        ]
    else:
        texts = list(prompts)
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, tokens in enumerate(encoded):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=[s for s in stops if s is not None],
        )
    outputs = []
    for row in out[:, width:].tolist():
        ends = [i for i, token in enumerate(row) if token in stops]
        text = tokenizer.decode(row[: ends[0]] if ends else row, skip_special_tokens=True)
        outputs.append("".join(c for c in text if c.isprintable() or c in "\n\t").strip())
    return outputs


# --------------------------------------------------------------------------- one model, measured


@dataclass
class Measured:
    """What evaluating one model produced."""

    metrics: dict[str, float] = field(default_factory=dict)
    generations: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # the parts ('heldout', 'lm_eval') whose measurement failed
    cached: dict[str, str] = field(default_factory=dict)  # part -> the run that measured it (the score cache)


def include_dir(spec: PipelineSpec, run_root: Path) -> str | None:
    """stages.evaluate.lm_eval_include_path as a local directory, held to the rules of data paths: pvc:// stays
    inside its claim, in the cluster it must lie on the datasets or checkpoints volume, and no symlink in it may
    lead out of it. Its task YAMLs can import Python (`!function`), so nothing else may be read as one.
    `builtin:<name>` is the folder prepare generated in the run directory."""
    raw = spec.stages.evaluate.lm_eval_include_path
    if raw is None:
        return None
    try:
        if raw.startswith("builtin:"):
            path = run_root / BUILTIN_TASKS_DIR
            if not path.is_dir():
                raise DataError(f"{raw}: prepare did not write {path} (run prepare again with --force)")
        else:
            path = resolve_path(raw, spec)
        path = confine(path, raw, spec, run_root)
    except DataError as exc:
        raise DataError(f"stages.evaluate.lm_eval_include_path: {exc}") from None
    if path.is_dir():
        for link in (p for p in path.rglob("*") if p.is_symlink()):
            if not within(link, path):
                raise DataError(
                    f"stages.evaluate.lm_eval_include_path: {link} is a symlink to {link.resolve()}, outside "
                    f"{raw}; copy the file into the directory instead of linking to it"
                )
    return str(path)


def measure(
    ctx: StageContext,
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    who: str,
    lm_eval: bool = True,
    generations: bool = True,
) -> Measured:
    """Perplexity (over `rows`), lm-eval tasks and generations of one model. A part that fails is recorded in
    `errors` (its metrics are then missing, which fails the gate rules that need them) and the others still run."""
    import torch

    section = ctx.section
    spec = ctx.spec
    stage = candidate_stage(spec)
    if torch.cuda.is_available() and getattr(model, "hf_device_map", None) is None:
        model.to("cuda")  # built from config; a loaded model is already placed over the GPUs (`placement`)
    out = Measured()
    if rows:
        try:
            out.metrics.update(perplexity(model, tokenizer, rows, max_length(spec, stage), thinking(spec)))
        except Exception as exc:
            out.failed.add("heldout")
            out.errors.append(f"{who}: perplexity failed: {type(exc).__name__}: {exc}")
    if section.lm_eval_tasks and lm_eval:
        try:
            out.metrics.update(
                lm_eval_metrics(
                    model,
                    tokenizer,
                    section.lm_eval_tasks,
                    include_dir(spec, ctx.run_dir.root),
                    section.limit,
                    max_length(spec, stage),
                )
            )
        except Exception as exc:
            out.failed.add("lm_eval")
            out.errors.append(f"{who}: lm-eval failed: {type(exc).__name__}: {exc}")
    if section.prompts and generations:
        out.generations = generate(model, tokenizer, section.prompts, section.max_new_tokens, chat_model(spec))
    for message in out.errors:
        print(f"[evaluate] {message}", flush=True)
    print(f"[evaluate] {who}: {fmt_metrics(out.metrics)}", flush=True)
    return out


def thinking(spec: PipelineSpec) -> bool:
    """Whether chat rows render with thinking tags (as sft trained them)."""
    return spec.stages.sft.enabled and spec.stages.sft.enable_thinking


def fmt_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())) or "no metrics"


def release(model: Any) -> None:
    """Free a model's memory before the next one is loaded."""
    import gc

    import torch

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def placement() -> dict[str, Any]:
    """How evaluate loads a model: on a GPU, `device_map='auto'`, which loads the weights straight onto the pod's
    GPUs and spreads the layers over them when the model does not fit one (a 72B model in bf16 is 144 GB; accelerate
    moves the activations between GPUs); on CPU, as the stages load it."""
    import torch

    return {"device_map": "auto"} if torch.cuda.is_available() else {}


# --------------------------------------------------------------------------- the score cache


SCORES_VERSION = 2
"""Part of every score cache key: raise it when a change here changes what a number means."""


def score_keys(ctx: StageContext, heldout_fingerprint: str) -> dict[str, dict[str, Any]] | None:
    """What each part of a model's numbers depends on besides the model: the score cache's keys ('heldout',
    'lm_eval', 'generations'). None (nothing is cached) when `cache_scores` is off."""
    import importlib.metadata

    import torch

    from stages.tokenizer import tokenizer_hash

    spec, section = ctx.spec, ctx.section
    if not section.cache_scores:
        return None
    stage = candidate_stage(spec)
    include = include_dir(spec, ctx.run_dir.root)
    common = {
        "scores": SCORES_VERSION,
        "tokenizer": tokenizer_hash(ctx.run_dir.root / "prepare" / "tokenizer"),
        "max_length": max_length(spec, stage),
        "dtype": spec.model.dtype,
        "attention": spec.model.attn_implementation,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "transformers": importlib.metadata.version("transformers"),
    }
    lm_eval = {
        "tasks": list(section.lm_eval_tasks),
        "include": task_folder_fingerprint(Path(include)) if include else None,
        "limit": section.limit,
        "lm_eval": importlib.metadata.version("lm_eval") if section.lm_eval_tasks else None,
    }
    return {
        "heldout": {**common, "rows": heldout_fingerprint, "thinking": thinking(spec)},
        "lm_eval": {**common, **lm_eval},
        "generations": {
            **common,
            "prompts": list(section.prompts),
            "max_new_tokens": section.max_new_tokens,
            "chat": chat_model(spec),
        },
    }


def task_folder_fingerprint(folder: Path) -> str:
    """The content of an lm-eval task folder, wherever it lies: its YAMLs may name their data files by absolute
    path (prepare's builtin tasks name them inside the run directory, another folder every run), so the folder's
    own path is taken out of them before they are hashed."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        if file.suffix in (".yaml", ".yml"):
            data = data.replace(str(folder).encode(), b"<task folder>")
        digest.update(file.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(data).digest())
    return f"sha256:{digest.hexdigest()}"


def part_value(part: str, measured: Measured) -> Any:
    """What the score cache files for one part of a measurement."""
    if part == "generations":
        return measured.generations
    heldout = part == "heldout"
    return {k: v for k, v in measured.metrics.items() if (k in HELDOUT_METRICS) == heldout}


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
    model, tokenizer = load()
    fresh = measure(
        ctx,
        model,
        tokenizer,
        rows if "heldout" in todo else [],
        who,
        lm_eval="lm_eval" in todo,
        generations="generations" in todo,
    )
    release(model)
    out.metrics.update(fresh.metrics)
    out.errors += fresh.errors
    out.failed |= fresh.failed
    if "generations" in todo:
        out.generations = fresh.generations
    if cache is not None and keys is not None and (model_id := model_id or identity()):
        for part in todo:
            if part not in fresh.failed:
                cache.store(model_id, part, keys[part], part_value(part, fresh), ctx.run_dir.root.name)
    return out


# --------------------------------------------------------------------------- the champion


@dataclass
class Champion:
    """The registered model version under the `champion` alias, and the numbers it was gated with."""

    name: str
    version: str
    run_id: str | None
    metrics: dict[str, float]
    source: dict[str, str]  # metric -> where its value came from: 'tag', 'run' or 're-evaluated'
    tags: dict[str, str] = field(default_factory=dict)
    remeasured: dict[str, str] = field(default_factory=dict)  # metric -> why it was measured again


def registry_client(spec: PipelineSpec, run_root: Path) -> tuple[Any, str]:
    """An MLflow client for the tracking server and its model registry (the same URI), and that URI."""
    from mlflow import MlflowClient

    from stages.tracking_mlflow_server import resolve_tracking_uri

    uri = resolve_tracking_uri(spec, run_root)
    return MlflowClient(tracking_uri=uri, registry_uri=uri), uri


def find_champion(client: Any, name: str) -> Champion | None:
    """The champion version with its recorded metrics (tags first, then its run's metrics), or None when the
    registered model or the alias does not exist yet. Other registry errors propagate."""
    from mlflow.exceptions import MlflowException

    try:
        registered = client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    aliases = registered.aliases or {}
    if CHAMPION not in aliases:
        return None
    version = client.get_model_version(name, str(aliases[CHAMPION]))
    metrics: dict[str, float] = {}
    source: dict[str, str] = {}
    for key, value in (version.tags or {}).items():
        if key.startswith(METRIC_TAG_PREFIX):
            try:
                metrics[key.removeprefix(METRIC_TAG_PREFIX)] = float(value)
                source[key.removeprefix(METRIC_TAG_PREFIX)] = "tag"
            except ValueError:
                continue
    if version.run_id:
        try:
            run_metrics = client.get_run(version.run_id).data.metrics
        except MlflowException:
            run_metrics = {}
        for key, value in run_metrics.items():
            if key not in metrics:
                metrics[key], source[key] = float(value), "run"
    return Champion(
        name=name,
        version=str(version.version),
        run_id=version.run_id,
        metrics=metrics,
        source=source,
        tags=dict(version.tags or {}),
    )


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


def download_champion(client: Any, champion: Champion, dst: Path, tracking_uri: str) -> Path:
    """The champion's model files (safetensors, config, tokenizer), downloaded from the registry into `dst`."""
    import mlflow

    from stages.deploy import registered_files

    uri = client.get_model_version_download_uri(champion.name, champion.version)
    dst.mkdir(parents=True, exist_ok=True)
    path = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst), tracking_uri=tracking_uri)
    return registered_files(Path(path))  # an MLflow transformers model keeps its weights in model/


# --------------------------------------------------------------------------- the gate


@dataclass
class GateCheck:
    """One gate rule, evaluated: `threshold` is the line the candidate had to stay above (higher is better) or
    below, where it could be drawn; the standard errors are lm-eval's, where known."""

    metric: str
    higher_is_better: bool
    max_regression: float
    candidate: float | None
    reference: float | None
    reference_name: str
    passed: bool
    reason: str
    max_regression_relative: float | None = None
    min_significance: float | None = None
    allowed: float | None = None  # the regression allowed: max(max_regression, relative x |reference|)
    threshold: float | None = None
    candidate_stderr: float | None = None
    reference_stderr: float | None = None


def _finite(values: dict[str, float], key: str) -> float | None:
    value = values.get(key)
    return value if value is not None and math.isfinite(value) else None


def check_rule(rule: GateRule, candidate: dict[str, float], reference: dict[str, float], ref_name: str) -> GateCheck:
    """Whether the candidate holds up against the reference on one metric. It may fall behind by the larger of
    max_regression and max_regression_relative x |reference|; with min_significance k it must also be better by
    more than k standard errors of the difference, sqrt(se_candidate^2 + se_reference^2) (the two measurements
    are independent), a rule that fails, saying so, when either standard error is unknown."""
    value, ref = _finite(candidate, rule.metric), _finite(reference, rule.metric)
    se_c, se_r = _finite(candidate, stderr_name(rule.metric)), _finite(reference, stderr_name(rule.metric))
    sign = 1.0 if rule.higher_is_better else -1.0
    direction = "higher" if rule.higher_is_better else "lower"
    allowed = rule.max_regression
    if rule.max_regression_relative is not None and ref is not None:
        allowed = max(allowed, rule.max_regression_relative * abs(ref))
    threshold = ref - sign * allowed if ref is not None else None

    def result(passed: bool, reason: str) -> GateCheck:
        return GateCheck(
            rule.metric,
            rule.higher_is_better,
            rule.max_regression,
            candidate.get(rule.metric),
            reference.get(rule.metric),
            ref_name,
            passed,
            reason,
            rule.max_regression_relative,
            rule.min_significance,
            allowed if ref is not None else None,
            threshold,
            se_c,
            se_r,
        )

    if value is None:
        measured = ", ".join(sorted(candidate)) or "nothing"
        return result(False, f"{rule.metric}: not measured for the candidate (measured: {measured})")
    if ref is None:
        return result(False, f"{rule.metric}: no value for the {ref_name} to compare with")
    # Compared as the threshold itself (not as a difference), so a value on the line rounds the same way.
    passed = value >= ref - allowed if rule.higher_is_better else value <= ref + allowed
    regression = sign * (ref - value)
    how = f"{allowed:.6g}"
    if rule.max_regression_relative is not None:
        how += f" = max({rule.max_regression:g}, {rule.max_regression_relative:g} x {abs(ref):.6g})"
    reason = (
        f"{rule.metric}: candidate {plus_minus(value, se_c)} vs {ref_name} {plus_minus(ref, se_r)} "
        f"({direction} is better; regression {max(regression, 0.0):.6g}, allowed {how}"
    )
    if rule.min_significance is not None:
        k = rule.min_significance
        if se_c is None or se_r is None:
            unknown = [who for who, se in (("candidate", se_c), (ref_name, se_r)) if se is None]
            passed = False
            reason += (
                f"; min_significance {k:g} needs standard errors, unknown for the {' and the '.join(unknown)} "
                f"(no {stderr_name(rule.metric)})"
            )
        else:
            se = math.hypot(se_c, se_r)
            gain = sign * (value - ref)
            significant = gain > k * se
            passed = passed and significant
            threshold = max(threshold, ref + k * se) if rule.higher_is_better else min(threshold, ref - k * se)
            reason += (
                f"; improvement {gain:.6g}, needed more than {k:g} x {se:.3g} = {k * se:.3g}, where {se:.3g} = "
                f"sqrt({se_c:.3g}^2 + {se_r:.3g}^2) is the standard error of the difference: "
                f"{'significant' if significant else 'not significant'}"
            )
    return result(passed, f"{reason}): {'holds' if passed else 'fails'}")


def apply_gate(
    rules: list[GateRule], candidate: dict[str, float], reference: dict[str, float], ref_name: str
) -> tuple[str, list[str], list[GateCheck]]:
    """('pass' or 'fail', the reasons, the checks): pass when every rule holds against the reference."""
    checks = [check_rule(rule, candidate, reference, ref_name) for rule in rules]
    decision = GATE_PASS if all(c.passed for c in checks) else GATE_FAIL
    reasons = [c.reason for c in checks]
    if not rules:
        reasons = ["no gate rules: the candidate passes"]
    return decision, reasons, checks


# --------------------------------------------------------------------------- the stage


def run(ctx: StageContext) -> int:
    """Evaluate the candidate and decide the gate; returns the process exit code."""
    if not ctx.begin():
        return EXIT_OK
    try:
        return evaluate(ctx)
    except StageRefused as exc:  # the candidate changed after its stage recorded it: nothing measured
        ctx.fail(str(exc))
        raise
    except DataError as exc:
        print(f"[evaluate] error: {exc}", file=sys.stderr, flush=True)
        return ctx.fail(str(exc))
    except Exception as exc:
        return ctx.crash(exc)


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
        model = load_stage_model(
            run_dir, spec, stage, tokenizer, ModelInputs(ctx), name="candidate", placement=placement()
        )
        candidate = measure(ctx, model, tokenizer, rows, "candidate")
        release(model)
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
            "limit": section.limit,
            "prompts": list(section.prompts),
            "candidate_generations": candidate.generations,
            "base_generations": base.generations,
            "errors": errors,
            "loss_curves": loss_curves(run_dir, spec),
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
