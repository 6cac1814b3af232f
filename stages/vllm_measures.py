"""Measuring a model through vLLM's OpenAI-compatible server: evaluate's `backend: vllm`.

The same numbers as stages/measures.py, taken from the engine that serves the model in KServe:

1. The model evaluate loaded (an adapter merged into its base, the vocabulary grown for the chat template's tokens,
   as the transformers backend measures it) is saved as safetensors with the run's tokenizer into
   `evaluate/vllm/<who>/` and freed, so that the GPUs are vLLM's.
2. vLLM's server starts on it from its own environment (run/vllm_server.py: the trainer image's /opt/vllm, or
   `.venv-vllm` under --local) with `run.serving.evaluation_server_argv`, on 127.0.0.1; its log is
   `evaluate/logs/vllm-<who>.log`.
3. Through the API, on the same rows, prompts and tokenizer as the transformers backend:
   - held-out loss: each row's token ids (`measures.scored_rows`) are the prompt of a one-token completion with
     `prompt_logprobs=0`, for which vLLM returns the log-probability of every prompt token given the ones before
     it; the scored tokens' (the labels') are summed;
   - lm-eval tasks: lm-eval's `local-completions` model on /v1/completions, sending token ids encoded with the
     saved tokenizer (loglikelihoods from echo + logprobs), with the same tasks, limit and length;
   - generations: the prompt ids of `measures.prompt_ids`, greedy, stopping at `measures.generation_stops`; the
     answer's token ids (`return_token_ids`) are decoded here as the transformers backend decodes its own.
4. The server is stopped and the folder deleted before the next model is loaded.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from run.serving import RUNTIME_ENV, evaluation_server_argv
from run.vllm_server import ServerFailed, engine_version, server_env, start_ready, vllm_python, where_expected
from stages.contract import StageContext
from stages.data import DataError
from stages.measures import (
    TOKENS_PER_BATCH,
    Measured,
    answer_text,
    candidate_stage,
    chat_model,
    check_include_path,
    fmt_metrics,
    free_memory,
    generation_stops,
    heldout_numbers,
    include_dir,
    max_length,
    prompt_ids,
    run_lm_eval,
    scored_rows,
    thinking,
)

READY_TIMEOUT_S = 1800.0
"""How long vLLM may take to load a model and be ready: a 72B model over 8 GPUs reads 144 GB and compiles its
graphs; the tiny local models take under a minute."""
REQUEST_TIMEOUT_S = 600
LM_EVAL_BATCH = 8
"""Requests lm-eval sends in one API call (it does not change the numbers: each is scored on its own)."""


def check_environment(ctx: StageContext) -> None:
    """DataError (the stage's one `error:` line, before any model loads) when the section asks for vLLM and there is
    none; `--local` refuses such a pipeline before anything starts (workflows/local.py)."""
    if ctx.section.backend == "vllm" and vllm_python() is None:
        raise DataError(
            f"stages.evaluate.backend is 'vllm' but there is no vLLM environment at {where_expected()}: "
            "`make local` sets up .venv-vllm (the trainer image has /opt/vllm); or set backend: transformers"
        )


@dataclass(frozen=True)
class Endpoint:
    """A running server: where it answers, the name it serves the model under, and the saved model's folder."""

    base_url: str
    name: str
    folder: Path
    version: str

    def complete(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """POST /v1/completions; the choices in prompt order."""
        response = requests.post(
            f"{self.base_url}/v1/completions", json={"model": self.name, **payload}, timeout=REQUEST_TIMEOUT_S
        )
        if response.status_code != 200:
            raise RuntimeError(f"vLLM answered {response.status_code}: {response.text[:500]}")
        return sorted(response.json()["choices"], key=lambda choice: choice["index"])


def measure_served(
    ctx: StageContext,
    who: str,
    load: Callable[[], tuple[Any, Any]],
    rows: list[dict[str, Any]],
    lm_eval: bool = True,
    generations: bool = True,
) -> Measured:
    """`measures.measure` through vLLM: the model `load` returns is saved, freed and served; a part that fails is
    recorded in `errors` and the others still run, as there."""
    spec, section = ctx.spec, ctx.section
    stage = candidate_stage(spec)
    max_len = max_length(spec, stage)
    out = Measured()
    folder = ctx.dir / "vllm" / who
    tokenizer, positions, heads = save_for_serving(load, folder)
    asked = [part for part, wanted in (("heldout", rows), ("lm_eval", section.lm_eval_tasks and lm_eval)) if wanted]
    try:
        with served(ctx, who, folder, positions, heads) as endpoint:
            out.engine = f"vllm {endpoint.version}"
            if rows:
                try:
                    out.metrics.update(perplexity(endpoint, tokenizer, rows, max_len, thinking(spec)))
                except Exception as exc:
                    out.failed.add("heldout")
                    out.errors.append(f"{who}: perplexity failed: {type(exc).__name__}: {exc}")
            if section.lm_eval_tasks and lm_eval:
                try:
                    out.metrics.update(lm_eval_metrics(endpoint, tokenizer, ctx, max_len))
                except Exception as exc:
                    out.failed.add("lm_eval")
                    out.errors.append(f"{who}: lm-eval failed: {type(exc).__name__}: {exc}")
            if section.prompts and generations:
                out.generations = generate(
                    endpoint, tokenizer, section.prompts, section.max_new_tokens, chat_model(spec)
                )
    except ServerFailed as exc:  # every part asked fails (the gate then fails on missing metrics), as a part does
        out.failed.update(asked)
        out.errors.append(f"{who}: vLLM did not serve the model: {exc}")
        out.generations = ["" for _ in section.prompts] if generations else []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for message in out.errors:
        print(f"[evaluate] {message}", flush=True)
    print(f"[evaluate] {who}: {fmt_metrics(out.metrics)}", flush=True)
    return out


def save_for_serving(load: Callable[[], tuple[Any, Any]], folder: Path) -> tuple[Any, int | None, int]:
    """Load the model, save it as safetensors with its tokenizer into `folder`, free it; returns the tokenizer, the
    model's position limit and its attention heads (what the server's length and tensor parallelism must fit)."""
    model, tokenizer = load()
    if folder.exists():
        shutil.rmtree(folder)
    model.config.use_cache = True  # a training stage may have saved it off; vLLM reads the config as it is
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    text = model.config.get_text_config()
    positions, heads = getattr(text, "max_position_embeddings", None), int(getattr(text, "num_attention_heads", 1))
    del model
    free_memory()
    return tokenizer, positions, heads


def tensor_parallel(gpus: int, heads: int) -> int:
    """vLLM's tensor-parallel size on the evaluate pod's GPUs: all of them, or the most that divide the attention
    heads (vLLM shards whole heads)."""
    return max((n for n in range(1, max(gpus, 1) + 1) if heads % n == 0 and gpus % n == 0), default=1)


@contextmanager
def served(ctx: StageContext, who: str, folder: Path, positions: int | None, heads: int) -> Iterator[Endpoint]:
    """vLLM serving `folder` until the block ends."""
    spec, section = ctx.spec, ctx.section
    stage = candidate_stage(spec)
    python = vllm_python()
    if python is None:  # checked when the stage started; the variable may have changed since
        raise ServerFailed(f"no vLLM environment at {where_expected()}")
    # A scored row is max_length tokens and one is generated after it; a generation is its prompt and
    # max_new_tokens; never past the model's positions.
    length = max_length(spec, stage) + max(section.max_new_tokens, 1)
    if positions is not None:
        length = min(length, int(positions))
    shards = tensor_parallel(section.resources.gpus_per_node, heads)
    seed = spec.stage(stage).training.seed

    def argv_on(port: int) -> list[str]:
        return evaluation_server_argv(
            str(python),
            str(folder),
            who,
            port,
            max_model_len=length,
            dtype=spec.model.dtype,
            tensor_parallel=shards,
            seed=seed,
        )

    server, base_url, ready = start_ready(
        argv_on,
        server_env(RUNTIME_ENV, shards),
        ctx.dir / "logs" / f"vllm-{who}.log",
        READY_TIMEOUT_S,
        "the start timeout",
        lambda argv: print(f"[evaluate] {who}: starting vLLM: {' '.join(argv)}", flush=True),
    )
    try:
        version = engine_version(base_url)
        print(f"[evaluate] {who}: vLLM {version} ready after {ready:.0f}s", flush=True)
        yield Endpoint(base_url, who, folder, version)
    finally:
        server.stop()


def perplexity(
    endpoint: Endpoint, tokenizer: Any, rows: list[dict[str, Any]], max_len: int, enable_thinking: bool
) -> dict[str, float]:
    """`measures.perplexity` from vLLM's prompt logprobs: the log-probability of each scored token given the ones
    before it, summed over the rows (sent in batches of at most TOKENS_PER_BATCH tokens)."""
    encoded, truncated = scored_rows(tokenizer, rows, max_len, enable_thinking)
    total_nll, total_tokens = 0.0, 0
    batches: list[list[tuple[list[int], list[int]]]] = [[]]
    for item in encoded:
        if batches[-1] and len(item[0]) * (len(batches[-1]) + 1) > TOKENS_PER_BATCH:
            batches.append([])
        batches[-1].append(item)
    for batch in (b for b in batches if b):
        choices = endpoint.complete(
            {"prompt": [ids for ids, _ in batch], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
        )
        for (ids, labels), choice in zip(batch, choices, strict=True):
            logprobs = choice["prompt_logprobs"]
            for position in range(1, len(ids)):
                if labels[position] != -100:
                    total_nll -= float(logprobs[position][str(ids[position])]["logprob"])
                    total_tokens += 1
    return heldout_numbers(total_nll, total_tokens, len(rows), truncated)


def lm_eval_metrics(endpoint: Endpoint, tokenizer: Any, ctx: StageContext, max_len: int) -> dict[str, float]:
    """The section's lm-eval tasks through lm-eval's local-completions model on the server, with the saved
    tokenizer; a beginning-of-sequence token where the tokenizer adds one, as lm-eval's HFLM does."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    section = ctx.section
    include = include_dir(ctx.spec, ctx.run_dir.root)
    check_include_path(include)
    adds_bos = len(tokenizer("x")["input_ids"]) > len(tokenizer("x", add_special_tokens=False)["input_ids"])
    lm = LocalCompletionsAPI(
        base_url=f"{endpoint.base_url}/v1/completions",
        model=endpoint.name,
        tokenizer=str(endpoint.folder),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        add_bos_token=adds_bos,
        max_length=max_len,
        batch_size=LM_EVAL_BATCH,
        num_concurrent=1,
        max_retries=1,
        timeout=REQUEST_TIMEOUT_S,
    )
    return run_lm_eval(lm, section.lm_eval_tasks, include, section.limit)


def generate(endpoint: Endpoint, tokenizer: Any, prompts: list[str], max_new_tokens: int, chat: bool) -> list[str]:
    """`measures.generate` through vLLM: greedy completions of the same prompt ids, in one request."""
    if not prompts:
        return []
    stops = generation_stops(tokenizer, chat)
    choices = endpoint.complete(
        {
            "prompt": prompt_ids(tokenizer, prompts, chat),
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "stop_token_ids": stops,
            "return_token_ids": True,
        }
    )
    return [answer_text(tokenizer, list(choice["token_ids"]), stops) for choice in choices]
