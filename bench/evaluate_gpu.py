"""Benchmark (not a test): the evaluate stage's own code on a GPU, for an 8B-shaped model, today's path against the
score cache and GPU placement.

    python bench/evaluate_gpu.py make-run RUN_DIR --from runs/<a korean-llm --local run>   # on any machine
    python bench/evaluate_gpu.py measure RUN_DIR --out OUT_DIR [--shape qwen3-8b]            # on the GPU machine

`make-run` copies what prepare left in a finished `--local` run of korean-llm (spec.json, the tokenizer, the
builtin lm-eval task folder: ko_constitution_mc, 60 questions made from the offline Korean corpus) and writes
held-out rows from its cpt and sft data (every text and chat row: several hundred, text and chat mixed).

`measure` builds a random-initialised model of the shape (Qwen3-8B: 36 layers, hidden 4096, Qwen3's 151,936-word
vocabulary) on the GPU and saves it as a local model folder (the base model, as a user's pretrained model), puts a
random LoRA adapter on it as the sft stage's output (the candidate, r 16 on every linear layer), and then times,
each in this process, with the evaluate stage's functions (`load_stage_model`, `load_base`, `measure`,
`measure_cached`, `score_keys`, `ScoreCache`, `placement`):

1. today's path (the stage before the score cache): each model loaded on the CPU and moved to the GPU, the
   candidate and the base measured in full (held-out perplexity, lm-eval through HF, greedy generations of the
   prompts one at a time);
2. the first run with the score cache: models loaded straight onto the GPU (`device_map='auto'`), the prompts
   generated in one batch, the base measured and filed (its identity costs one read of its files);
3. a scheduled run after it: the base's numbers from the cache, its identity from its files' stat; only the
   candidate is loaded and measured.

The champion, when it must be measured again, costs what the base costs (plus its download) and is cached the
same way; it is not in the timing. Results in OUT_DIR/evaluate.json, with the time of each part.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def make_run(run: Path, source: Path) -> None:
    """A run directory as prepare leaves it, from a finished local run (see the module's docstring)."""
    from stages.data import BUILTIN_TASKS_DIR

    shutil.rmtree(run, ignore_errors=True)
    (run / "prepare" / "data" / "evaluate").mkdir(parents=True)
    shutil.copy(source / "spec.json", run / "spec.json")
    shutil.copytree(source / "prepare" / "tokenizer", run / "prepare" / "tokenizer")
    shutil.copytree(source / BUILTIN_TASKS_DIR, run / BUILTIN_TASKS_DIR)
    rows = []
    for stage in ("cpt", "sft"):
        for split in ("train", "eval"):
            path = source / "prepare" / "data" / stage / f"{split}.jsonl"
            rows += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    (run / "prepare" / "data" / "evaluate" / "eval.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    print(f"{run}: {len(rows)} held-out rows")


class Timed:
    """Wall time of each call of the evaluate stage's measuring functions, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, module: Any, name: str) -> None:
        inner = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        setattr(module, name, timed)

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return {k: round(v, 2) for k, v in taken.items()}


def build_models(run_dir: Any, spec: Any, shape: dict[str, Any], work: Path) -> dict[str, float]:
    """The base model folder (random weights of `shape`, Qwen3's vocabulary) and the candidate: a LoRA adapter on
    it, recorded as the sft stage's output."""
    import torch
    from gpu_cases import VOCAB
    from peft import get_peft_model

    from run.run_dir import StageResult, now, write_json_atomic
    from stages.modeling import build_from_config, load_tokenizer, lora_config

    tokenizer = load_tokenizer(run_dir, spec.model)
    spec.model.from_config = spec.model.from_config.model_copy(update={**shape, "max_position_embeddings": 4096})
    start = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = build_from_config(spec.model, tokenizer)
    model.resize_token_embeddings(VOCAB)  # the tokenizer's ids are a subset; the head has Qwen3's size
    built = time.perf_counter() - start
    model.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    saved = time.perf_counter() - start - built

    adapter = get_peft_model(model, lora_config(spec.stages.sft, model))
    for name, param in adapter.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=1e-3)  # a trained adapter is not zero
    adapter.save_pretrained(run_dir.stage_dir("sft") / "model")
    del adapter, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    record = StageResult(
        stage="sft",
        status="succeeded",
        config_hash="bench",
        started_at=now(),
        ended_at=now(),
        extra={"model_kind": "adapter", "base_kind": "pretrained", "base": str(work / "base")},
    )
    write_json_atomic(run_dir.result_path("sft"), record.model_dump(mode="json"))
    return {"build_s": round(built, 1), "save_s": round(saved, 1)}


def measure_paths(run: Path, out: Path, shape_name: str) -> dict[str, Any]:
    import torch
    from gpu_cases import SHAPES

    import stages.measures as measures
    import stages.measuring as measuring
    from run.run_dir import RunDir
    from stages.data import BUILTIN_TASKS_DIR, sha256_file
    from stages.modeling import load_base, load_stage_model, load_tokenizer, spec_base
    from stages.scores import ScoreCache, base_identity

    run_dir = RunDir(run)
    spec = run_dir.load_spec()
    spec.stages.cpt.enabled = False
    spec.stages.rlhf.enabled = False  # the candidate: sft's LoRA adapter
    spec.stages.sft.training.max_seq_length = 2048
    work = run.parent / "models"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(run.parent / ".scores", ignore_errors=True)
    gpu = torch.cuda.is_available()
    result: dict[str, Any] = {"shape": shape_name, "device": torch.cuda.get_device_name() if gpu else "cpu"}
    result["setup"] = build_models(run_dir, spec, SHAPES[shape_name], work)
    spec.model.name_or_path, spec.model.from_config = str(work / "base"), None

    ctx = SimpleNamespace(spec=spec, section=spec.stages.evaluate, run_dir=run_dir, dir=run_dir.stage_dir("evaluate"))
    tokenizer = load_tokenizer(run_dir, spec.model)
    tasks = run / BUILTIN_TASKS_DIR
    for task in tasks.glob("*.yaml"):  # prepare wrote its data file's absolute path: point it here
        here = f"    test: {tasks / (task.stem + '.jsonl')}"
        lines = task.read_text(encoding="utf-8").splitlines()
        lines = [here if line.startswith("    test: ") else line for line in lines]
        task.write_text("\n".join(lines) + "\n", encoding="utf-8")
    heldout = run / "prepare" / "data" / "evaluate" / "eval.jsonl"
    rows = measures.read_rows(heldout)
    timer = Timed()
    for name in ("perplexity", "lm_eval_metrics", "generate"):
        timer.wrap(measures, name)
    result["heldout_rows"] = len(rows)
    result["lm_eval_tasks"] = spec.stages.evaluate.lm_eval_tasks
    result["prompts"], result["max_new_tokens"] = len(spec.stages.evaluate.prompts), spec.stages.evaluate.max_new_tokens

    def timed(phases: dict[str, Any], label: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if gpu:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        value = fn(*args, **kwargs)
        if gpu:
            torch.cuda.synchronize()
        phases[label] = round(time.perf_counter() - begin, 2)
        return value

    def measured(who: str, model: Any) -> Any:
        return measures.measure(ctx, model, tokenizer, rows, who)

    def free() -> None:  # measures.release, once the last reference is gone
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()

    # 1. Today's path: CPU load, then to the GPU; both models measured, the prompts generated one at a time.
    batched = measures.generate

    def one_at_a_time(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, chat: bool) -> list[str]:
        return [batched(model, tokenizer, [prompt], max_new_tokens, chat)[0] for prompt in prompts]

    measures.generate = one_at_a_time
    phases: dict[str, Any] = {}
    start = time.perf_counter()
    model = timed(phases, "candidate_load", load_stage_model, run_dir, spec, "sft", tokenizer)
    candidate = timed(phases, "candidate_measure", measured, "candidate", model)
    del model
    free()
    model = timed(phases, "base_load", load_base, run_dir, spec, spec_base(spec), tokenizer)
    base = timed(phases, "base_measure", measured, "base", model)
    del model
    free()
    phases["total"] = round(time.perf_counter() - start, 2)
    phases["functions"] = timer.take()
    result["today"] = {**phases, "candidate": candidate.metrics, "base": base.metrics, "errors": candidate.errors}
    measures.generate = batched

    # 2 and 3. With placement and the score cache: a first run (cache empty), then the next scheduled run.
    keys = measures.score_keys(ctx, sha256_file(heldout))
    cache = ScoreCache(run.parent)
    placed = measures.placement()

    def load() -> tuple[Any, Any]:
        return load_base(run_dir, spec, spec_base(spec), tokenizer, placement=placed), tokenizer

    def base_numbers(identity: str | None) -> Any:
        parts = ["heldout", "lm_eval", "generations"]
        return measuring.measure_cached(ctx, "base", parts, load, rows, cache, keys, identity=lambda: identity)

    for label in ("cache_cold", "cache_warm"):
        phases = {}
        start = time.perf_counter()
        model = timed(phases, "candidate_load", load_stage_model, run_dir, spec, "sft", tokenizer, placement=placed)
        candidate = timed(phases, "candidate_measure", measured, "candidate", model)
        del model
        free()
        identity = timed(phases, "base_identity", base_identity, spec.model, cache)
        base = timed(phases, "base_cached_or_measured", base_numbers, identity)
        phases["total"] = round(time.perf_counter() - start, 2)
        phases["functions"] = timer.take()
        result[label] = {
            **phases,
            "base_cached": base.cached,
            "candidate": candidate.metrics,
            "base": base.metrics,
            "errors": candidate.errors + base.errors,
        }
    result["speedup_warm_vs_today"] = round(result["today"]["total"] / result["cache_warm"]["total"], 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluate.json").write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["make-run", "measure"])
    parser.add_argument("run", type=Path, help="the run directory (made by make-run)")
    parser.add_argument("--from", dest="source", type=Path, help="make-run: a finished korean-llm --local run")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--shape", default="qwen3-8b")
    args = parser.parse_args(argv)
    if args.command == "make-run":
        if args.source is None:
            parser.error("make-run needs --from RUN")
        make_run(args.run.absolute(), args.source)
        return 0
    result = measure_paths(args.run.absolute(), args.out, args.shape)
    for label in ("today", "cache_cold", "cache_warm"):
        r = result[label]
        parts = {k: v for k, v in r.items() if k.endswith(("load", "measure", "identity", "measured"))}
        print(f"{label:11s} {r['total']:7.1f} s  {json.dumps(parts)}")
        print(f"{'':11s} functions {r['functions']}")
    print(f"today / scheduled run with the cache: {result['speedup_warm_vs_today']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
