"""Benchmark (not a test): the user's own trainer settings in real sft stage runs under torchrun.

    python bench/user_configs_gpu.py --out DIR                          # every GPU case on this node's GPUs (2+)
    python bench/user_configs_gpu.py --cases zero3_json --out DIR       # one case
    python bench/user_configs_gpu.py --tiny --out DIR                   # CPU smoke: 2 processes over gloo (ddp)
    python bench/user_configs_gpu.py --code OTHER/ --cases ... --out DIR  # the stages of another checkout

Three spec features reach the Trainer only on a GPU node, and the tests see them only at spec load and in the
rendered jobs: `stages.sft.training.extra_args` (more TrainingArguments / SFTConfig fields),
`stages.sft.distributed.deepspeed_config` (the user's DeepSpeed JSON) and `stages.sft.distributed.accelerate_config`
(the YAML `accelerate config` writes). Each case writes a pipeline file that names the user's config file by a
relative path (as a user does), loads it with `spec.loading.load_pipeline` (which embeds the file), lays out
the run directory as prepare leaves it (spec.json, normalized chat rows, the run's tokenizer; a tiny Qwen3 built
from `model.from_config`, random weights, nothing downloaded) and runs the real entry point,
`python -m stages sft --run-dir RUN` (`stages.__main__.main`), under `torchrun --nproc-per-node N`.

Evidence, per case, in OUT/results.json:
- `probe`: what the Trainer really runs with, read inside the stage process by a callback added before training
  (`on_train_begin`, after accelerate and DeepSpeed prepared model, optimizer and scheduler): the arguments the
  extra_args set, the optimizer inside its wrappers (class, betas, eps, fused), the scheduler's lambda, the
  accelerator's distributed type, the DeepSpeed engine's own readings (ZeRO stage, clipping, buckets, how much of
  the model and optimizer state this rank holds, the config with its "auto" values filled in) or the FSDP
  plugin's and the sharded model's;
- what the stage wrote: stage.json (status, first and last training loss), logs/distributed.json,
  logs/log_history.json (loss, learning rate, grad norm per logged step), and the model folder, loaded back with
  `from_pretrained` and scored on held-out rows against the untrained model;
- `checks`: each expected reading against the one seen, and `passed`.

Needs the trainer image's packages (torch, transformers, trl, peft, accelerate, datasets; deepspeed for the ZeRO
cases, with nvcc and ninja for zero2_cpu_offload_ds_adam's CPU Adam). Without mlflow the stage's tracker journals
its records (sft/logs/tracking-unsent.jsonl) and the stage goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from user_configs_cases import BY_NAME, CASES, COMMON_TRAINING, GPU_SHAPE, REFUSED_EXTRA_ARGS, TINY_SHAPE, Case

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- the users' config files


# ---------------------------------------------------------------------------- cases


# ---------------------------------------------------------------------------- the run directory


def pipeline_document(case: Case, tiny: bool) -> dict[str, Any]:
    """The pipeline file a user would write for the case (its config file named by a relative path)."""
    distributed: dict[str, Any] = {"strategy": case.strategy, **case.distributed}
    if case.deepspeed_json is not None:
        distributed["deepspeed_config"] = "ds_config.json"
    if case.accelerate_yaml is not None:
        distributed["accelerate_config"] = "accelerate_config.yaml"
    training = {
        **COMMON_TRAINING,
        "max_steps": 20 if tiny else 30,
        **case.training,
        "extra_args": case.extra_args,
    }
    return {
        "name": "user-configs",
        "model": {
            "name_or_path": "tiny-qwen3-ko",
            "revision": None,
            "from_config": TINY_SHAPE if tiny else GPU_SHAPE,
        },
        "stages": {
            "sft": {
                "enabled": True,
                "method": "full",
                "data": {"uri": "chat.jsonl", "format": "messages"},
                "training": training,
                "distributed": distributed,
            },
            "evaluate": {"enabled": False},
            "deploy": {"enabled": False},
        },
        "tracking": {"tensorboard": False},
    }


def prepare_run(case: Case, case_dir: Path, tiny: bool) -> Path:
    """The case's pipeline file and config file, and a run directory as prepare leaves it for sft."""
    import yaml

    from run.run_dir import RunDir
    from spec.loading import load_pipeline
    from stages.tokenizer import build_tokenizer, render_for_training

    sys.path.insert(0, str(REPO / "tests"))
    from training_fixtures import chat_rows, write_jsonl  # the tests' Korean conversations, as prepare writes them

    case_dir.mkdir(parents=True, exist_ok=True)
    rows = chat_rows(48 if tiny else 480)
    write_jsonl(case_dir / "chat.jsonl", rows)
    if case.deepspeed_json is not None:
        (case_dir / "ds_config.json").write_text(json.dumps(case.deepspeed_json, indent=2), encoding="utf-8")
    if case.accelerate_yaml is not None:
        (case_dir / "accelerate_config.yaml").write_text(case.accelerate_yaml, encoding="utf-8")
    pipeline = case_dir / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(pipeline_document(case, tiny), sort_keys=False, allow_unicode=True))
    spec = load_pipeline(str(pipeline)).spec  # reads and embeds ds_config.json / accelerate_config.yaml
    root = case_dir / "run"
    run_dir = RunDir(root)
    root.mkdir()
    run_dir.write_spec(spec)
    n_eval = max(4, len(rows) // 20)
    write_jsonl(root / "prepare/data/sft/train.jsonl", rows[n_eval:])
    write_jsonl(root / "prepare/data/sft/eval.jsonl", rows[:n_eval])
    build_tokenizer(spec, [render_for_training(row) for row in rows], root / "prepare/tokenizer")
    return root


def refusals(tmp: Path) -> dict[str, str]:
    """What loading a pipeline says for extra_args the spec owns."""
    import yaml

    from spec.document import SpecError
    from spec.loading import load_pipeline

    document = pipeline_document(BY_NAME["ddp_extra_args"], tiny=True)
    seen: dict[str, str] = {}
    for key, value in REFUSED_EXTRA_ARGS.items():
        document["stages"]["sft"]["training"]["extra_args"] = {key: value}
        path = tmp / f"refused-{key}.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
        try:
            load_pipeline(str(path))
            seen[key] = "ACCEPTED"
        except SpecError as exc:
            seen[key] = str(exc).splitlines()[0]
    return seen


# ---------------------------------------------------------------------------- inside the stage process


def _plain(value: Any) -> Any:
    """A JSON-able copy (enums as their value, tuples as lists, the rest as text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return getattr(value, "value", None) if hasattr(value, "value") else str(value)


def _auto_left(config: Any, path: str = "") -> list[str]:
    """Paths of a DeepSpeed config still set to "auto" (transformers fills them in before the engine starts)."""
    if isinstance(config, dict):
        return [p for k, v in config.items() for p in _auto_left(v, f"{path}.{k}" if path else str(k))]
    return [path] if config == "auto" else []


def _optimizer_reading(optimizer: Any) -> dict[str, Any]:
    chain = []
    while hasattr(optimizer, "optimizer") and len(chain) < 6:
        chain.append(type(optimizer).__name__)
        optimizer = optimizer.optimizer
    defaults = optimizer.defaults
    return {
        "wrappers": chain,
        "base": {
            "class": type(optimizer).__name__,
            "betas": list(defaults.get("betas", ())),
            "eps": defaults.get("eps"),
            "fused": bool(defaults.get("fused")),
            "lr": defaults.get("lr"),
            "weight_decays": sorted({g.get("weight_decay") for g in optimizer.param_groups}),
        },
    }


def _scheduler_reading(scheduler: Any) -> dict[str, Any]:
    chain = []
    while hasattr(scheduler, "scheduler") and len(chain) < 6:
        chain.append(type(scheduler).__name__)
        scheduler = scheduler.scheduler
    lambdas = getattr(scheduler, "lr_lambdas", None) or [None]
    func = getattr(lambdas[0], "func", lambdas[0])
    return {
        "wrappers": chain,
        "class": type(scheduler).__name__,
        "lambda": getattr(func, "__name__", None),
        "keywords": _plain(getattr(lambdas[0], "keywords", {})),
    }


def _deepspeed_reading(trainer: Any) -> dict[str, Any]:
    engine = trainer.deepspeed
    zero = engine.optimizer
    total = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    reading: dict[str, Any] = {
        "zero_stage": engine.zero_optimization_stage(),
        "gradient_clipping": engine.gradient_clipping(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "train_batch_size": engine.train_batch_size(),
        "bf16": engine.bfloat16_enabled(),
        "allgather_bucket_size": engine.zero_allgather_bucket_size(),
        "reduce_bucket_size": engine.zero_reduce_bucket_size(),
        "overlap_comm": engine.zero_overlap_comm(),
        "offload_optimizer": str(getattr(engine.zero_offload_optimizer(), "device", "none")).split(".")[-1],
        "optimizer_wrapper": type(zero).__name__,
        "config": _plain(config),
        "auto_left": _auto_left(config),
    }
    if reading["zero_stage"] == 3:
        here = sum(p.ds_tensor.numel() for p in engine.module.parameters())
        reading.update(
            {
                "prefetch_bucket_size": engine.zero_prefetch_bucket_size(),
                "param_persistence_threshold": engine.zero_param_persistence_threshold(),
                "max_live_parameters": engine.zero_max_live_parameters(),
                "gather_16bit_weights_on_model_save": engine.zero_gather_16bit_weights_on_model_save(),
                "parameters_total": total,
                "parameters_here": here,
                "parameter_fraction_here": round(here / total, 3),
            }
        )
    else:
        partitions = getattr(zero, "single_partition_of_fp32_groups", [])
        here = sum(t.numel() for t in partitions)
        reading.update(
            {
                "parameters_total": total,
                "optimizer_state_here": here,
                "optimizer_state_fraction_here": round(here / total, 3),
                "optimizer_state_device": partitions[0].device.type if partitions else None,
            }
        )
    return reading


def _fsdp_reading(trainer: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    plugin = trainer.accelerator.state.fsdp_plugin
    model = trainer.model_wrapped
    wrapped = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    here = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    first = params[0]
    return {
        "version": plugin.fsdp_version,
        "reshard_after_forward": plugin.reshard_after_forward,
        "cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading,
        "activation_checkpointing": plugin.activation_checkpointing,
        "state_dict_type": str(plugin.state_dict_type).split(".")[-1],
        "cpu_offload": _plain(plugin.cpu_offload),
        "wrapped_modules": wrapped,
        "wrapped_layers": sum(name.endswith("DecoderLayer") for name in wrapped),
        "parameter_placements": str(getattr(first, "placements", None)),
        "parameters_total": total,
        "parameters_here": here,
        "parameter_fraction_here": round(here / total, 3),
    }


def probe_reading(trainer: Any) -> dict[str, Any]:
    """What the Trainer runs with, once accelerate (and DeepSpeed) prepared it."""
    args, accelerator = trainer.args, trainer.accelerator
    names = (
        "optim",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "ddp_timeout",
        "lr_scheduler_type",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "learning_rate",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_steps",
        "bf16",
        "gradient_checkpointing",
    )
    import stages

    reading: dict[str, Any] = {
        "stages_from": str(Path(stages.__file__).parent.parent),  # the checkout whose stage code runs (--code)
        "args": {name: _plain(getattr(args, name)) for name in names},
        "accelerator": {
            "distributed_type": str(accelerator.state.distributed_type).split(".")[-1],
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
        },
        "optimizer": _optimizer_reading(trainer.optimizer),
        "scheduler": _scheduler_reading(trainer.lr_scheduler),
    }
    if trainer.is_deepspeed_enabled:
        reading["deepspeed"] = _deepspeed_reading(trainer)
    if trainer.is_fsdp_enabled:
        reading["fsdp"] = _fsdp_reading(trainer)
    return reading


def stage_main(run_dir: str, probe: str) -> int:
    """`python -m stages sft --run-dir RUN` with a callback that writes `probe_reading` at the start of training."""
    from transformers import TrainerCallback

    import stages.sft
    from stages.__main__ import main

    class Probe(TrainerCallback):
        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            try:
                reading = probe_reading(self.trainer)
            except Exception:  # a probe that breaks must not break the stage
                reading = {"error": traceback.format_exc()}
            if int(os.environ.get("RANK", "0")) == 0:
                Path(probe).write_text(json.dumps(reading, indent=2, default=str), encoding="utf-8")
            return control

    train_to_plan = stages.sft.train_to_plan

    def probed(trainer: Any, checkpoint: Any, stage: str) -> int:
        trainer.add_callback(Probe(trainer))
        return train_to_plan(trainer, checkpoint, stage)

    stages.sft.train_to_plan = probed
    return main(["sft", "--run-dir", run_dir])


# ---------------------------------------------------------------------------- reading the results back


def _dig(data: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return "<missing>"
        data = data[part]
    return data


def _matches(seen: Any, expected: Any) -> bool:
    if isinstance(expected, float) and isinstance(seen, int | float):
        return math.isclose(seen, expected, rel_tol=0.02)
    if isinstance(expected, list) and isinstance(seen, list) and len(seen) == len(expected):
        return all(_matches(s, e) for s, e in zip(seen, expected, strict=True))
    return seen == expected


def model_reading(root: Path) -> dict[str, Any]:
    """The stage's model folder: its files, and whether it loads whole and is the trained model: its loss on the
    stage's held-out rows (the token cache's eval rows, assistant tokens only, as the stage's evaluation measures
    it) against the untrained model the stage started from."""
    import torch
    from transformers import AutoModelForCausalLM

    from run.run_dir import RunDir
    from stages.modeling import build_from_config, load_tokenizer
    from stages.packing import load_token_cache

    model_dir = root / "sft" / "model"
    files = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
    reading: dict[str, Any] = {"files": files, "safetensors": [f for f in files if f.endswith(".safetensors")]}
    if not reading["safetensors"]:
        reading["loads"] = False
        return reading
    run_dir = RunDir(root)
    spec = run_dir.load_spec()
    tokenizer = load_tokenizer(run_dir, spec.model)
    try:
        trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    except Exception as exc:
        reading.update({"loads": False, "error": f"{type(exc).__name__}: {exc}"[:500]})
        return reading
    untrained = build_from_config(spec.model, tokenizer).float()
    rows = load_token_cache(run_dir, spec, "sft").eval

    def loss(model: Any) -> float:
        """Mean loss per label token over the held-out packed rows (documents kept apart by the position ids)."""
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for row in rows:
                batch = {k: torch.tensor([row[k]]) for k in ("input_ids", "labels", "position_ids")}
                n = int((batch["labels"][0, 1:] != -100).sum())
                total += model(**batch).loss.item() * n
                count += n
        return total / count

    from safetensors import safe_open

    saved: set[str] = set()
    for name in reading["safetensors"]:
        with safe_open(str(model_dir / name), "pt") as f:
            keys = f.keys()  # a safetensors file is not iterable
            saved |= {f.get_slice(key).get_dtype() for key in keys}
    empty = [n for n, p in trained.named_parameters() if p.numel() == 0]
    reading.update(
        {
            "loads": not empty,
            "parameters": sum(p.numel() for p in trained.parameters()),
            "empty_tensors": empty,
            "saved_dtypes": sorted(saved),
            "heldout_loss_trained": round(loss(trained), 4),
            "heldout_loss_untrained": round(loss(untrained), 4),
        }
    )
    return reading


def case_result(case: Case, root: Path, probe: Path, returncode: int, seconds: float, tiny: bool) -> dict[str, Any]:
    """The evidence the case left behind, and the checks against what it should show."""
    result: dict[str, Any] = {"note": case.note, "strategy": case.strategy, "returncode": returncode}
    result["seconds"] = round(seconds, 1)
    record_path = root / "sft" / "stage.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    result["stage_json"] = {k: record.get(k) for k in ("status", "error", "metrics") if k in record}
    logs = root / "sft" / "logs"
    if (logs / "distributed.json").exists():
        result["distributed_json"] = json.loads((logs / "distributed.json").read_text())
    history = json.loads((logs / "log_history.json").read_text()) if (logs / "log_history.json").exists() else []
    result["log_history"] = [
        {k: e[k] for k in ("step", "loss", "learning_rate", "grad_norm") if k in e} for e in history if "loss" in e
    ]
    result["probe"] = json.loads(probe.read_text()) if probe.exists() else None
    result["model"] = model_reading(root)

    checks: dict[str, Any] = {}
    status = result["stage_json"].get("status")
    checks["stage.json status"] = {"expected": "succeeded", "seen": status, "ok": status == "succeeded"}
    losses = [e["loss"] for e in result["log_history"]]
    decreased = len(losses) >= 2 and losses[-1] < 0.8 * losses[0]
    checks["training loss decreased"] = {"seen": [losses[:1], losses[-1:]], "ok": decreased}
    rates = [e["learning_rate"] for e in result["log_history"]]
    if case.training.get("warmup_ratio"):
        warmed = len(rates) >= 3 and rates[0] < max(rates)
        checks["learning rate warms up"] = {"seen": rates, "ok": warmed}
    model = result["model"]
    checks["model loads whole"] = {"seen": model.get("safetensors"), "ok": bool(model.get("loads"))}
    if model.get("loads"):
        # The loaded model scores the held-out rows about as the stage's own evaluation did, far below the untrained
        # model. Close, not equal: the Trainer evaluated in bf16 with flex attention, a mean over batches and ranks
        # (the sampler repeats rows to fill both), this is float32 and sdpa, one mean over every label token.
        eval_loss = (result["stage_json"].get("metrics") or {}).get("eval_loss", math.nan)
        trained, untrained = model["heldout_loss_trained"], model["heldout_loss_untrained"]
        checks["saved model is the trained one"] = {
            "seen": {"loaded": trained, "stage_eval_loss": eval_loss, "untrained": untrained},
            "ok": math.isclose(trained, eval_loss, rel_tol=0.2) and trained < 0.8 * untrained,
        }
    for path, expected in case.expect.items():
        if tiny and path == "accelerator.distributed_type":
            expected = "MULTI_CPU"
        seen = _dig(result["probe"], path)
        checks[path] = {"expected": expected, "seen": seen, "ok": _matches(seen, expected)}
    result["checks"] = checks
    result["passed"] = all(c["ok"] for c in checks.values())
    return result


# ---------------------------------------------------------------------------- the driver


def environment() -> dict[str, Any]:
    """Device and software versions, for the record (those bench/gpu_suite.py records)."""
    from gpu_suite import environment as suite_environment

    return suite_environment()


def run_case(case: Case, out: Path, tiny: bool, processes: int, code: Path, timeout: float) -> dict[str, Any]:
    case_dir = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=out))
    root = prepare_run(case, case_dir, tiny)
    probe = case_dir / "probe.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        str(Path(__file__).resolve()),
        "stage",
        "--run-dir",
        str(root),
        "--probe",
        str(probe),
        "--code",
        str(code),
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "NCCL_NVLS_ENABLE": "0",  # no NVLink multicast on shared hosts
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]),
    }
    log = out / f"{case.name}.log"
    started = time.time()
    with log.open("w") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        # A session of its own, so that a run past its time is ended with all its workers (not only torchrun).
        process = subprocess.Popen(
            command, env=env, cwd=case_dir, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode = process.wait()
    result = case_result(case, root, probe, returncode, time.time() - started, tiny)
    result["code"] = str(code)
    result["log_tail"] = log.read_text(errors="replace")[-3000:] if not result["passed"] else ""
    return result


def suite(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    code = Path(args.code).resolve()
    default = [c.name for c in CASES if c.gpu != args.tiny]
    names = args.cases.split(",") if args.cases else default
    processes = args.processes
    results: dict[str, Any] = {}
    deadline = time.time() + args.budget_s
    path = out / args.results  # an absolute --results stays where it is
    env = environment()
    refused = refusals(out)
    for name in names:
        left = deadline - time.time()
        if left < 40:
            results[name] = {"skipped": "out of time"}
            continue
        print(f"=== {name} ({code})", flush=True)
        results[name] = run_case(BY_NAME[name], out, args.tiny, processes, code, left)
        verdict = "PASSED" if results[name]["passed"] else "FAILED"
        failed = [k for k, c in results[name]["checks"].items() if not c["ok"]]
        print(f"=== {name}: {verdict} in {results[name]['seconds']} s {failed or ''}", flush=True)
        path.write_text(json.dumps({"env": env, "refused_extra_args": refused, "results": results}, indent=2))
    path.write_text(json.dumps({"env": env, "refused_extra_args": refused, "results": results}, indent=2))
    return 0 if all(r.get("passed") for r in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="suite", choices=["suite", "stage"])
    parser.add_argument("--out", default="bench-user-configs", help="where results.json, the logs and runs go")
    parser.add_argument("--results", default="results.json", help="the results file, in --out unless absolute")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: the GPU cases)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, the ddp case, gloo")
    parser.add_argument("--processes", type=int, default=2, help="torchrun processes (one per GPU)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip cases that would start after this")
    parser.add_argument("--code", default=str(REPO), help="the checkout whose stages/ and workflows/ run")
    parser.add_argument("--run-dir", help="(stage) the run directory")
    parser.add_argument("--probe", help="(stage) where rank 0 writes the probe's reading")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.code).resolve()))
    if args.command == "stage":
        return stage_main(args.run_dir, args.probe)
    return suite(args)


if __name__ == "__main__":
    raise SystemExit(main())
