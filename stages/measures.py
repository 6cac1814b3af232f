"""Measuring one model: held-out perplexity, lm-eval-harness tasks, greedy generations, score cache reuse.

evaluate (stages/evaluate.py) measures the candidate, the base model and, where needed, the champion with these; the
numbers of a part an earlier run measured on the same model the same way come from the score cache
(`stages/scores.py`, `stages.measuring.measure_cached`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spec.fields import TRAINING_STAGES
from spec.pipeline import PipelineSpec
from stages.contract import StageContext
from stages.data import BUILTIN_TASKS_DIR, DataError, confine, resolve_path, within
from stages.report import SAMPLES_METRIC

HELDOUT_METRICS = ("eval_loss", "perplexity", "eval_rows", "eval_tokens", "eval_rows_truncated")
"""What `perplexity` measures: numbers that only compare over the same held-out rows."""
TOKENS_PER_BATCH = 8192
"""Perplexity batches hold at most this many tokens (bounds the logits' memory on a large vocabulary)."""


# --------------------------------------------------------------------------- what is evaluated


def candidate_stage(spec: PipelineSpec) -> str:
    """The last enabled training stage: its output is the candidate."""
    enabled = [s for s in TRAINING_STAGES if spec.stage(s).enabled]
    if not enabled:
        raise ValueError("no training stage is enabled: there is no candidate to evaluate")
    return enabled[-1]


def chat_model(spec: PipelineSpec) -> bool:
    """Whether the candidate was tuned on conversations (prompts then go through the chat template)."""
    return spec.stages.sft.enabled or spec.stages.rlhf.enabled


def max_length(spec: PipelineSpec, stage: str) -> int:
    """Tokens per scored row: the candidate stage's training length."""
    return spec.stage(stage).training.max_seq_length


# --------------------------------------------------------------------------- perplexity


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
    return tokenize_conversation(
        tokenizer, messages, enable_thinking=enable_thinking, assistant_only_loss=True, tools=row.get("tools")
    )


def perplexity(
    model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_len: int, enable_thinking: bool = False
) -> dict[str, float]:
    """Held-out loss (mean negative log-likelihood per scored token), its perplexity, and the counts.
    Rows longer than `max_len` tokens are cut to their first `max_len`."""
    import torch
    import torch.nn.functional as F

    encoded, truncated = scored_rows(tokenizer, rows, max_len, enable_thinking)
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
    return heldout_numbers(total_nll, total_tokens, len(rows), truncated)


def scored_rows(
    tokenizer: Any, rows: list[dict[str, Any]], max_len: int, enable_thinking: bool = False
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Each row's ids and labels (`encode_row`) cut to `max_len` tokens, shortest first, and how many were cut."""
    encoded = [encode_row(tokenizer, row, enable_thinking) for row in rows]
    truncated = sum(1 for ids, _ in encoded if len(ids) > max_len)
    return sorted(((ids[:max_len], labels[:max_len]) for ids, labels in encoded), key=lambda e: len(e[0])), truncated


def heldout_numbers(total_nll: float, total_tokens: int, rows: int, truncated: int) -> dict[str, float]:
    """The held-out metrics from the summed negative log-likelihood of the scored tokens."""
    if total_tokens == 0:
        raise ValueError("the held-out rows have no scored tokens")
    loss = total_nll / total_tokens
    return {
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "eval_rows": float(rows),
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
    from lm_eval.models.huggingface import HFLM

    check_include_path(include_path)
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size="auto" if torch.cuda.is_available() else 4,
        max_length=max_len,
    )
    return run_lm_eval(lm, tasks, include_path, limit)


def check_include_path(include_path: str | None) -> None:
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"stages.evaluate.lm_eval_include_path {include_path} is not a directory")


def run_lm_eval(lm: Any, tasks: list[str], include_path: str | None, limit: int | None) -> dict[str, float]:
    """lm-eval-harness's tasks on `lm` (an lm-eval model: HFLM, or local-completions through vLLM), flattened."""
    from lm_eval import simple_evaluate

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

    if not prompts:
        return []
    device = next(model.parameters()).device
    stops = generation_stops(tokenizer, chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = prompt_ids(tokenizer, prompts, chat)
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
            eos_token_id=stops,
        )
    return [answer_text(tokenizer, row, stops) for row in out[:, width:].tolist()]


def generation_stops(tokenizer: Any, chat: bool) -> list[int]:
    """The tokens that end an answer: eos, and under the chat template the end of an assistant turn."""
    from stages.chat import stop_token_ids

    stops = stop_token_ids(tokenizer) if chat else [tokenizer.eos_token_id]
    return [s for s in stops if s is not None]


def prompt_ids(tokenizer: Any, prompts: list[str], chat: bool) -> list[list[int]]:
    """The token ids each prompt is answered from: a user turn through the chat template (with the generation
    prompt, no thinking) when `chat`, else the prompt's own text."""
    if chat:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            for prompt in prompts
        ]
    else:
        texts = list(prompts)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def answer_text(tokenizer: Any, new_ids: list[int], stops: list[int]) -> str:
    """An answer's text from its new token ids: up to the first stop token, special tokens and unprintable
    characters left out, trimmed."""
    ends = [i for i, token in enumerate(new_ids) if token in stops]
    text = tokenizer.decode(new_ids[: ends[0]] if ends else new_ids, skip_special_tokens=True)
    return "".join(c for c in text if c.isprintable() or c in "\n\t").strip()


# --------------------------------------------------------------------------- one model, measured


@dataclass
class Measured:
    """What evaluating one model produced."""

    metrics: dict[str, float] = field(default_factory=dict)
    generations: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # the parts ('heldout', 'lm_eval') whose measurement failed
    cached: dict[str, str] = field(default_factory=dict)  # part -> the run that measured it (the score cache)
    engine: str = ""  # what measured it: 'transformers <version>' or 'vllm <version>' ('' when all came from cache)


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
    print(f"[evaluate] {who}: {where(model)}", flush=True)
    out = Measured(engine=f"transformers {transformers_version()}")
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


def transformers_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


def thinking(spec: PipelineSpec) -> bool:
    """Whether chat rows render with thinking tags (as sft trained them)."""
    return spec.stages.sft.enabled and spec.stages.sft.enable_thinking


def fmt_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())) or "no metrics"


def release(model: Any) -> None:
    """Free a model's memory before the next one is loaded."""
    del model
    free_memory()


def free_memory() -> None:
    """Collect what no longer has a reference, and give the GPU memory it held back."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def where(model: Any) -> str:
    """Where a model's weights are, for the log: the devices its layers were spread over, or its one device."""
    spread = getattr(model, "hf_device_map", None)
    if not spread:
        return f"on {next(model.parameters()).device}"
    devices = sorted({str(device) for device in spread.values()})
    return f"{len(spread)} modules over {', '.join(f'cuda:{d}' if d.isdigit() else d for d in devices)}"


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
        "transformers": transformers_version(),
    }
    if section.backend != "transformers":  # keys of the default backend stay as earlier runs filed them
        common["backend"] = section.backend
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
