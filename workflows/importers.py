"""Recipes of other trainers as pipeline files: a LLaMA-Factory or axolotl training YAML → a posttrain pipeline.

    python -m workflows.import llamafactory examples/train_lora/llama3_lora_sft.yaml -o my-pipeline.yaml
    python -m workflows.import axolotl examples/llama-3/lora-1b.yml              # the pipeline on stdout

What maps: the model, each dataset (a local file or a hub id; LLaMA-Factory's dataset_info.json columns and
tags become data.columns and data.roles, axolotl's datasets[].type alpaca / chat_template / sharegpt /
completion the format; several datasets become a list, LLaMA-Factory's interleave_probs their weights), the chat
template, the method (stage or rl; LoRA, QLoRA or full), the LoRA settings, the hyperparameters, the precision and
the DeepSpeed config. Every key that does not map is listed (key: value → why)
on stderr; the written file is validated with `spec.loading.load_pipeline` first, and an existing output is
never overwritten without --force.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from spec.document import SpecError, load_json, load_yaml
from spec.loading import load_pipeline
from spec.model import KNOWN_CHAT_TEMPLATES

if TYPE_CHECKING:
    from spec.pipeline import PipelineSpec

EXIT_USAGE = 2

LR_SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")

# LLaMA-Factory's template names → model.chat_template (those not here are reported).
LLAMAFACTORY_TEMPLATES = {
    "llama3": "llama3",
    "qwen": "qwen2_5",
    "qwen2_5": "qwen2_5",
    "qwen3": "qwen3",
    "qwen3_nothink": "qwen3",
    "gemma3": "gemma3",
    "mistral": "mistral",
    "chatml": "chatml",
    "exaone": "exaone4",
}

# TrainingArguments fields a recipe may set that the spec has no field for: passed on as training.extra_args.
PASS_THROUGH = ("optim", "adam_beta1", "adam_beta2", "adam_epsilon", "ddp_timeout", "torch_compile")

# Keys that configure the other tool itself, or things this project decides on its own: noted, not an error.
HANDLED_HERE = {
    "output_dir": "outputs go to the run directory",
    "overwrite_output_dir": "outputs go to a new run directory",
    "do_train": "the stage trains",
    "report_to": "tracking is set in the pipeline's tracking section (MLflow, W&B)",
    "plot_loss": "the stage plots its loss curve",
    "overwrite_cache": "the token cache is keyed by its settings",
    "preprocessing_num_workers": "prepare decides its own workers",
    "dataloader_num_workers": "the stage sets it",
    "resume_from_checkpoint": "stages resume from their newest valid checkpoint by themselves",
    "dataset_dir": "read to find dataset_info.json",
    "save_only_model": "checkpoints keep the optimizer state, to resume",
    "dataset_prepared_path": "prepare keeps its own token cache",
    "strict": "axolotl's own option",
    "special_tokens": "the chat template adds its special tokens",
    "local_rank": "set by torchrun",
    "debug": "axolotl's own option",
    "wandb_project": "set tracking.wandb_project in the pipeline",
    "flash_attention": "model.attn_implementation picks a kernel that honours packed documents",
}


class ImportError_(SpecError):
    """A recipe that cannot be turned into a pipeline at all (unreadable, not a mapping, an unsupported stage)."""


@dataclass
class Imported:
    """The pipeline document built from a recipe, and what could not be mapped (key, value, why)."""

    document: dict[str, Any]
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)

    def skip(self, key: str, value: Any, why: str) -> None:
        self.unmapped.append((key, value, why))


def _name(stem: str) -> str:
    """A pipeline name (a DNS label) from a file name."""
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")
    return (name or "imported")[:40].strip("-") or "imported"


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    node = doc
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def _find(value: str, recipe_dir: Path) -> Path:
    """A path a recipe names: both tools read it from the current directory (where they are started, e.g. the
    LLaMA-Factory checkout); next to the recipe when it is only there."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists() or not (recipe_dir / path).exists():
        return path.absolute()
    return (recipe_dir / path).absolute()


def _put_data(imported: Imported, section: str, data: list[dict[str, Any]]) -> None:
    """stages.<section>.data, one dataset or the list of a mixture, each keeping what the hyperparameters put
    there (eval_fraction, max_samples)."""
    stage = imported.document["stages"][section]
    hyperparameters = stage.get("data", {})
    mixture = [{**d, **hyperparameters} for d in data]
    stage["data"] = mixture[0] if len(mixture) == 1 else mixture


def _deepspeed(imported: Imported, section: str, value: str, recipe_dir: Path, out_dir: Path) -> None:
    """distributed.deepspeed_config (a path relative to the pipeline file) and the strategy of its ZeRO stage."""
    path = _find(value, recipe_dir)
    if not path.is_file():
        imported.skip("deepspeed", value, f"{path} does not exist here; set stages.{section}.distributed by hand")
        return
    try:
        stage = (load_json(path.read_text(encoding="utf-8"), str(path)).get("zero_optimization") or {}).get("stage")
    except (SpecError, ValueError, AttributeError):
        imported.skip("deepspeed", value, f"{path} is not a DeepSpeed JSON config")
        return
    if stage not in (2, 3):
        imported.skip("deepspeed", value, f"ZeRO stage {stage!r}: only stage 2 or 3 (deepspeed_zero2/3) is supported")
        return
    relative = os.path.relpath(path.resolve(), out_dir.resolve())
    _set(imported.document, f"stages.{section}.distributed", {"strategy": f"deepspeed_zero{stage}"})
    _set(imported.document, f"stages.{section}.distributed.deepspeed_config", relative)


def _hyperparameters(imported: Imported, recipe: dict[str, Any], section: str, names: dict[str, str]) -> set[str]:
    """Map `recipe[key]` to `stages.<section>.<path>` for each key → path of `names`; the keys used."""
    used = set()
    for key, path in names.items():
        if key not in recipe or recipe[key] is None:
            continue
        value = recipe[key]
        used.add(key)
        if path == "training.lr_scheduler" and value not in LR_SCHEDULERS:
            imported.skip(key, value, f"the spec's schedules are {', '.join(LR_SCHEDULERS)}")
            continue
        if path == "lora.target_modules":
            value = _lora_targets(value)
        elif path == "lora.modules_to_save" and isinstance(value, str):  # LLaMA-Factory: "embed_tokens,lm_head"
            value = [v.strip() for v in value.split(",") if v.strip()]
        _set(imported.document, f"stages.{section}.{path}", value)
    return used


def _lora_targets(value: Any) -> Any:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if value in (["all"], ["all-linear"]) or value == "all-linear":
        return "all-linear"
    return list(value)


def _precision(imported: Imported, recipe: dict[str, Any]) -> set[str]:
    used = {k for k in ("bf16", "fp16", "tf32") if k in recipe}
    if recipe.get("bf16") in (True, "auto", "true"):
        _set(imported.document, "model.dtype", "bfloat16")
    elif recipe.get("fp16") in (True, "true"):
        _set(imported.document, "model.dtype", "float16")
    if recipe.get("tf32"):
        imported.skip("tf32", recipe["tf32"], "TF32 matmuls are the GPU's default for mixed precision here")
    return used


def _leftovers(imported: Imported, recipe: dict[str, Any], used: set[str]) -> None:
    """Report every key of the recipe not used (None values are unset: nothing to report)."""
    for key, value in recipe.items():
        if key in used or value is None or value == "" or value == []:
            continue
        if key in PASS_THROUGH:
            _set(imported.document, f"stages.{imported.document['_section']}.training.extra_args.{key}", value)
            continue
        imported.skip(key, value, HANDLED_HERE.get(key, "no pipeline field for it"))


def _skeleton(name: str, model: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name_or_path": model},
        "stages": {"evaluate": {"enabled": False}, "deploy": {"enabled": False}},
    }


# --------------------------------------------------------------------------- LLaMA-Factory

SHARED_HYPERPARAMETERS = {
    "learning_rate": "training.learning_rate",
    "max_steps": "training.max_steps",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "warmup_ratio": "training.warmup_ratio",
    "weight_decay": "training.weight_decay",
    "max_grad_norm": "training.max_grad_norm",
    "seed": "training.seed",
    "logging_steps": "training.logging_steps",
    "save_steps": "training.save_steps",
    "save_total_limit": "training.save_total_limit",
    "eval_steps": "training.eval_steps",
}
"""Recipe keys that LLaMA-Factory and axolotl name alike → the spec field each sets."""

LLAMAFACTORY_STAGES = {"sft": ("sft", None), "dpo": ("rlhf", "dpo"), "orpo": ("rlhf", "orpo"), "kto": ("rlhf", "kto")}
LLAMAFACTORY_HYPERPARAMETERS = {
    **SHARED_HYPERPARAMETERS,
    "num_train_epochs": "training.epochs",
    "per_device_train_batch_size": "training.per_device_batch_size",
    "cutoff_len": "training.max_seq_length",
    "lr_scheduler_type": "training.lr_scheduler",
    "packing": "training.packing",
    "lora_rank": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target": "lora.target_modules",
    "additional_target": "lora.modules_to_save",
    "val_size": "data.eval_fraction",
    "max_samples": "data.max_samples",
    "pref_beta": "beta",
}

_ALPACA_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "system": "system",
    "history": "history",
}
_PREFERENCE_COLUMNS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system"}
_LLAMAFACTORY_TOOL_TAGS = {"function_call": "function_tag", "tool": "observation_tag"}
"""data.roles → the dataset_info tag that names it, for sharegpt rows with tool calls."""


def _llamafactory_datasets(imported: Imported, recipe: dict[str, Any], info: dict[str, Any], info_dir: Path) -> None:
    """data from the recipe's `dataset` (one name or several, comma-separated: a mixture) with their
    dataset_info.json entries (else hub ids); `mix_strategy` and `interleave_probs` become the datasets' weights."""
    section = imported.document["_section"]
    kind = imported.document["stages"][section].get("algorithm")
    names = recipe["dataset"]
    listed = [n.strip() for n in names.split(",")] if isinstance(names, str) else [str(n) for n in names]
    data = [_llamafactory_dataset(imported, name, info, info_dir, kind) for name in listed if name]
    strategy = str(recipe.get("mix_strategy") or "concat")
    probs = recipe.get("interleave_probs")
    if strategy.startswith("interleave") and len(data) > 1:
        listed_probs = probs if isinstance(probs, list) else str(probs).split(",") if probs is not None else None
        try:
            weights = [float(p) for p in listed_probs] if listed_probs is not None else [1.0] * len(data)
        except (TypeError, ValueError):
            weights = []  # not numbers: said below, as a count that does not match
        if len(weights) != len(data) or any(w <= 0 for w in weights):
            imported.skip("interleave_probs", probs, f"not {len(data)} positive probabilities, one per dataset")
        else:
            for dataset, weight in zip(data, weights, strict=True):
                dataset["weight"] = weight
        if strategy != "interleave_over":
            imported.skip(
                "mix_strategy",
                strategy,
                "the stage keeps as many training rows as its datasets have in all, split by weight, repeating a "
                "dataset that has fewer (interleave_over's way), instead of stopping at the first exhausted one",
            )
    elif strategy not in ("concat", "interleave_under", "interleave_over"):
        imported.skip("mix_strategy", strategy, "concat, interleave_under or interleave_over; read as concat")
    _put_data(imported, section, data)


def _llamafactory_dataset(
    imported: Imported, first: str, info: dict[str, Any], info_dir: Path, kind: str | None
) -> dict[str, Any]:
    """One dataset of the recipe: dataset_info.json's entry, else a hub id."""
    entry = info.get(first)
    data: dict[str, Any] = {}
    if entry is None:
        if "/" not in first:
            imported.skip("dataset", first, "not in dataset_info.json (give --dataset-info) nor a hub id; set data.uri")
            data = {"uri": first}
        else:
            data = {"uri": f"hf://datasets/{first}"}
    elif entry.get("file_name"):
        data = {"uri": str(info_dir / entry["file_name"])}  # any kind prepare reads, JSON arrays included
    elif entry.get("hf_hub_url"):
        data = {"uri": f"hf://datasets/{entry['hf_hub_url']}"}
    else:
        imported.skip(f"dataset_info.{first}", entry, "neither file_name nor hf_hub_url; set data.uri")
        data = {"uri": first}
    entry = entry or {}
    formatting = entry.get("formatting", "alpaca")
    columns = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    if kind is not None or entry.get("ranking"):
        data["format"] = "preference"
        if formatting == "sharegpt":
            imported.skip(
                f"dataset_info.{first}.formatting", formatting, "preference rows are read as prompt/chosen/rejected"
            )
        mapped = {_PREFERENCE_COLUMNS[k]: v for k, v in columns.items() if k in _PREFERENCE_COLUMNS}
    elif formatting == "sharegpt":
        data["format"] = "sharegpt"
        mapped = {"conversations": columns["messages"]} if "messages" in columns else {}
        if "system" in columns:
            mapped["system"] = columns["system"]
        mapped.update(
            {t: tags[f"{t2}_tag"] for t, t2 in (("from", "role"), ("value", "content")) if f"{t2}_tag" in tags}
        )
        if "tools" in columns:
            mapped["tools"] = columns["tools"]
        roles = {role: tags[f"{role}_tag"] for role in ("user", "assistant", "system") if f"{role}_tag" in tags}
        roles |= {ours: tags[theirs] for ours, theirs in _LLAMAFACTORY_TOOL_TAGS.items() if theirs in tags}
        if roles:
            data["roles"] = roles
    else:
        data["format"] = "alpaca"
        mapped = {_ALPACA_COLUMNS[k]: v for k, v in columns.items() if k in _ALPACA_COLUMNS}
    known = {"prompt", "query", "response", "system", "history", "messages", "chosen", "rejected"}
    for key in set(columns) - known - ({"tools"} if data["format"] == "sharegpt" else set()):
        imported.skip(f"dataset_info.{first}.columns.{key}", columns[key], "no such column in the spec's formats")
    data["columns"] = {k: v for k, v in mapped.items() if k != v}
    if not data["columns"]:
        del data["columns"]
    return data


def from_llamafactory(recipe: dict[str, Any], recipe_path: Path, out_dir: Path, dataset_info: Path | None) -> Imported:
    """A pipeline document from a LLaMA-Factory training YAML."""
    model = recipe.get("model_name_or_path")
    if not model:
        raise ImportError_(f"{recipe_path}: no model_name_or_path")
    stage = recipe.get("stage", "sft")
    if stage not in LLAMAFACTORY_STAGES:
        raise ImportError_(f"{recipe_path}: stage {stage!r} is not supported (sft, dpo, orpo, kto)")
    section, algorithm = LLAMAFACTORY_STAGES[stage]
    imported = Imported(_skeleton(_name(recipe_path.stem), str(model)))
    doc = imported.document
    doc["_section"] = section
    stage_doc: dict[str, Any] = {}
    doc["stages"][section] = stage_doc
    if algorithm:
        stage_doc["algorithm"] = algorithm
    used = {
        "model_name_or_path",
        "stage",
        "finetuning_type",
        "quantization_bit",
        "dataset",
        "template",
        "deepspeed",
        "mix_strategy",
        "interleave_probs",
    }
    if recipe.get("trust_remote_code"):
        doc["model"]["trust_remote_code"] = True
    used.add("trust_remote_code")
    finetuning = recipe.get("finetuning_type", "lora")
    if finetuning == "lora":
        stage_doc["method"] = "qlora" if recipe.get("quantization_bit") == 4 else "lora"
        if recipe.get("quantization_bit") not in (None, 4):
            imported.skip("quantization_bit", recipe["quantization_bit"], "only 4-bit (QLoRA) is supported")
    elif finetuning == "full":
        stage_doc["method"] = "full"
    else:
        stage_doc["method"] = "full"
        imported.skip("finetuning_type", finetuning, "no freeze tuning here: imported as full fine-tuning")
    template = recipe.get("template")
    if template in LLAMAFACTORY_TEMPLATES:
        doc["model"]["chat_template"] = LLAMAFACTORY_TEMPLATES[template]
    elif template is not None:
        imported.skip("template", template, f"known templates: {', '.join(KNOWN_CHAT_TEMPLATES)} (or a Jinja file)")
    if recipe.get("disable_gradient_checkpointing") is not None:
        stage_doc.setdefault("training", {})["gradient_checkpointing"] = not recipe["disable_gradient_checkpointing"]
        used.add("disable_gradient_checkpointing")
    if "pref_beta" in recipe and section != "rlhf":
        used.add("pref_beta")
    used |= _hyperparameters(imported, recipe, section, LLAMAFACTORY_HYPERPARAMETERS)
    used |= _precision(imported, recipe)
    info_path = (
        dataset_info or _find(str(recipe.get("dataset_dir") or "data"), recipe_path.parent) / "dataset_info.json"
    )
    info: dict[str, Any] = {}
    if info_path.is_file():
        info = json.loads(info_path.read_text(encoding="utf-8"))
    if recipe.get("dataset"):
        _llamafactory_datasets(imported, recipe, info, info_path.parent.absolute())
    else:
        raise ImportError_(f"{recipe_path}: no dataset")
    if recipe.get("deepspeed"):
        _deepspeed(imported, section, str(recipe["deepspeed"]), recipe_path.parent, out_dir)
    _leftovers(imported, recipe, used)
    return imported


# --------------------------------------------------------------------------- axolotl

AXOLOTL_HYPERPARAMETERS = {
    **SHARED_HYPERPARAMETERS,
    "num_epochs": "training.epochs",
    "micro_batch_size": "training.per_device_batch_size",
    "sequence_len": "training.max_seq_length",
    "lr_scheduler": "training.lr_scheduler",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "sample_packing": "training.packing",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules",
    "lora_modules_to_save": "lora.modules_to_save",
    "val_set_size": "data.eval_fraction",
    "rl_beta": "beta",
}
AXOLOTL_RL = {"dpo": "dpo", "orpo": "orpo", "kto": "kto", "grpo": "grpo"}


def _axolotl_datasets(
    imported: Imported, datasets: list[Any], section: str, preference: bool, recipe_dir: Path
) -> None:
    """data from the config's `datasets`: one dataset, or the list of a mixture (axolotl concatenates them, as a
    list without weights does)."""
    data = [_axolotl_dataset(imported, d, i, preference, recipe_dir) for i, d in enumerate(datasets)]
    _put_data(imported, section, data)


def _axolotl_dataset(imported: Imported, first: Any, index: int, preference: bool, recipe_dir: Path) -> dict[str, Any]:
    """One entry of the config's `datasets`."""
    at = f"datasets[{index}]"
    if not isinstance(first, dict) or not first.get("path"):
        raise ImportError_(f"{at} has no path: {first!r}")
    path = str(first["path"])
    local = first.get("ds_type") in ("json", "parquet") or path.startswith((".", "/")) or Path(path).suffix
    uri = str(_find(path, recipe_dir)) if local else f"hf://datasets/{path}"
    data: dict[str, Any] = {"uri": uri}
    if first.get("split"):
        data["split"] = first["split"]
    if first.get("revision") and not local:
        data["revision"] = str(first["revision"])  # a hub dataset's commit: pinned rows
    kind = first.get("type")
    type_name = kind if isinstance(kind, str) else ""
    if preference:
        data["format"] = "preference"
        if kind is not None:
            imported.skip(f"{at}.type", kind, "preference rows are read as prompt/chosen/rejected columns")
    elif type_name in ("alpaca", "alpaca_chat"):
        data["format"] = "alpaca"
    elif type_name == "completion":
        data["format"] = "text"
        if first.get("field"):
            data["columns"] = {"text": first["field"]}
    elif type_name.startswith("sharegpt"):
        data["format"] = "sharegpt"
    elif type_name == "chat_template":
        data["format"] = "messages"
        columns = {}
        if first.get("field_messages"):
            columns["messages"] = first["field_messages"]
        if first.get("field_tools"):
            columns["tools"] = first["field_tools"]
        mappings = first.get("message_property_mappings") or {}
        for ours in ("role", "content"):
            column = mappings.get(ours) or first.get(f"message_field_{ours}")
            if column:
                columns[ours] = column
        if columns:
            data["columns"] = {k: v for k, v in columns.items() if k != v} or None
            if data["columns"] is None:
                del data["columns"]
        roles = {}
        for role, tags in (first.get("roles") or {}).items():
            if role in ("user", "assistant", "system", "tool") and tags:
                roles[role] = tags[0] if isinstance(tags, list) else tags
                if isinstance(tags, list) and len(tags) > 1:
                    imported.skip(f"{at}.roles.{role}", tags, f"one tag per role: {tags[0]!r} kept")
        if roles:
            data["roles"] = roles
        if first.get("chat_template"):
            imported.skip(f"{at}.chat_template", first["chat_template"], "the model's chat_template is used")
    else:
        data["format"] = "alpaca"
        imported.skip(
            f"{at}.type", kind, "not a known type (alpaca, chat_template, sharegpt, completion): read as alpaca"
        )
    for key in set(first) - {
        "path",
        "type",
        "split",
        "ds_type",
        "field",
        "field_messages",
        "field_tools",
        "roles",
        "message_property_mappings",
        "message_field_role",
        "message_field_content",
        "chat_template",
        "data_files",
        "revision",
    }:
        imported.skip(f"{at}.{key}", first[key], "no pipeline field for it")
    if first.get("data_files"):
        files = first["data_files"]
        data["uri"] = str(_find(files if isinstance(files, str) else files[0], recipe_dir))
    return data


def from_axolotl(recipe: dict[str, Any], recipe_path: Path, out_dir: Path) -> Imported:
    """A pipeline document from an axolotl config YAML."""
    model = recipe.get("base_model")
    if not model:
        raise ImportError_(f"{recipe_path}: no base_model")
    rl = recipe.get("rl")
    if rl is not None and rl not in AXOLOTL_RL:
        raise ImportError_(f"{recipe_path}: rl {rl!r} is not supported ({', '.join(AXOLOTL_RL)})")
    datasets = recipe.get("datasets") or recipe.get("pretraining_dataset")
    pretraining = "pretraining_dataset" in recipe and not recipe.get("datasets")
    section = "rlhf" if rl else "cpt" if pretraining else "sft"
    imported = Imported(_skeleton(_name(recipe_path.stem), str(model)))
    doc = imported.document
    doc["_section"] = section
    stage_doc: dict[str, Any] = {"algorithm": AXOLOTL_RL[rl]} if rl else {}
    doc["stages"][section] = stage_doc
    used = {
        "base_model",
        "rl",
        "datasets",
        "pretraining_dataset",
        "adapter",
        "load_in_4bit",
        "load_in_8bit",
        "chat_template",
        "deepspeed",
        "train_on_inputs",
        "base_model_config",
        "model_type",
        "tokenizer_type",
    }
    for key in ("model_type", "tokenizer_type"):
        if recipe.get(key) and not str(recipe[key]).startswith("Auto"):
            imported.skip(key, recipe[key], "transformers' Auto classes load the model")
    adapter = recipe.get("adapter")
    if adapter == "qlora" or (adapter == "lora" and recipe.get("load_in_4bit")):
        stage_doc["method"] = "qlora"
    elif adapter == "lora":
        stage_doc["method"] = "lora"
    elif adapter is None:
        stage_doc["method"] = "full"
    else:
        imported.skip("adapter", adapter, "lora or qlora only: imported as full fine-tuning")
        stage_doc["method"] = "full"
    if recipe.get("load_in_8bit"):
        imported.skip("load_in_8bit", True, "8-bit weights are not supported (qlora: 4-bit)")
    template = recipe.get("chat_template")
    if template in KNOWN_CHAT_TEMPLATES:
        doc["model"]["chat_template"] = template
    elif template not in (None, "tokenizer_default"):
        imported.skip("chat_template", template, f"known templates: {', '.join(KNOWN_CHAT_TEMPLATES)}")
    if recipe.get("train_on_inputs") is not None and section == "sft":
        stage_doc["assistant_only_loss"] = not recipe["train_on_inputs"]
    used |= _hyperparameters(imported, recipe, section, AXOLOTL_HYPERPARAMETERS)
    used |= _precision(imported, recipe)
    if recipe.get("optimizer"):
        stage_doc.setdefault("training", {}).setdefault("extra_args", {})["optim"] = recipe["optimizer"]
        used.add("optimizer")
    if recipe.get("warmup_steps") is not None:
        imported.skip(
            "warmup_steps", recipe["warmup_steps"], "the spec warms up for training.warmup_ratio (a fraction)"
        )
        used.add("warmup_steps")
    if not datasets:
        raise ImportError_(f"{recipe_path}: no datasets")
    listed = datasets if isinstance(datasets, list) else [datasets]
    _axolotl_datasets(imported, listed, section, bool(rl), recipe_path.parent)
    if recipe.get("deepspeed"):
        _deepspeed(imported, section, str(recipe["deepspeed"]), recipe_path.parent, out_dir)
    if recipe.get("fsdp") or recipe.get("fsdp_config"):
        imported.skip("fsdp", recipe.get("fsdp") or recipe.get("fsdp_config"), "set distributed.strategy: fsdp")
        used |= {"fsdp", "fsdp_config"}
    _leftovers(imported, recipe, used)
    return imported


# --------------------------------------------------------------------------- command line

IMPORTERS = ("llamafactory", "axolotl")


def import_recipe(tool: str, recipe_path: Path, out_dir: Path, dataset_info: Path | None = None) -> Imported:
    """Read a recipe and map it; ImportError_ when it cannot be."""
    try:
        text = recipe_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ImportError_(f"{recipe_path}: cannot read it: {exc.strerror or exc}") from None
    recipe = load_yaml(text, str(recipe_path))
    if not isinstance(recipe, dict):
        raise ImportError_(f"{recipe_path}: a recipe is a mapping of settings")
    if tool == "llamafactory":
        imported = from_llamafactory(recipe, recipe_path, out_dir, dataset_info)
    else:
        imported = from_axolotl(recipe, recipe_path, out_dir)
    imported.document.pop("_section", None)
    stages = imported.document["stages"]
    for last in ("evaluate", "deploy"):  # after the training stage, as the DAG runs
        stages[last] = stages.pop(last)
    return imported


def render_pipeline(imported: Imported, tool: str, recipe_path: Path, schema: str | None) -> str:
    """The pipeline file's text: a header, the document, and what was not mapped as comments."""
    header = [f"# yaml-language-server: $schema={schema}"] if schema else []
    header += [
        f"# Imported from {recipe_path.name} ({tool}) by `python -m workflows.import`; review it, then e.g.",
        "#   python -m workflows.submit THIS_FILE --dry-run",
    ]
    if imported.unmapped:
        header.append("# Not mapped:")
        header += [f"#   {key}: {json.dumps(value, default=str)} → {why}" for key, value, why in imported.unmapped]
    body = yaml.safe_dump(imported.document, sort_keys=False, allow_unicode=True, width=120)
    return "\n".join(header) + "\n" + body


def parser() -> argparse.ArgumentParser:
    """The command line."""
    from workflows.commands import add_version_option

    p = argparse.ArgumentParser(
        prog="python -m workflows.import",
        description="Turn a LLaMA-Factory or axolotl training recipe into a posttrain pipeline file.",
        epilog="examples:\n"
        "  python -m workflows.import llamafactory examples/train_lora/llama3_lora_sft.yaml -o my-sft.yaml\n"
        "  python -m workflows.import axolotl examples/llama-3/lora-1b.yml > my-sft.yaml\n\n"
        "What could not be mapped is listed on stderr (and in the file's header) as `key: value → why`.\n"
        "exit codes: 0 written and runnable as it is; 3 written, but its data cannot be read as the pipeline\n"
        "says (the `not runnable:` lines say why: a dataset file that is not there, a column it lacks); 2 bad input\n"
        "(unreadable recipe, unsupported stage, output exists without --force)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version_option(p)
    p.add_argument("tool", choices=IMPORTERS, help="The trainer the recipe is written for.")
    p.add_argument("recipe", type=Path, help="The recipe YAML.")
    p.add_argument("-o", "--output", type=Path, help="Write the pipeline here (default: print it).")
    p.add_argument("--force", action="store_true", help="Overwrite an existing output file.")
    p.add_argument(
        "--dataset-info",
        type=Path,
        metavar="PATH",
        help="LLaMA-Factory's dataset_info.json (default: <recipe dir>/<dataset_dir or data>/dataset_info.json).",
    )
    return p


EXIT_NOT_RUNNABLE = 3
"""Written, but the pipeline cannot run as it is: the data check (`python -m stages check-data`) refused its data."""


def _validate(text: str, out_dir: Path, shown: str) -> PipelineSpec:
    """Load the pipeline as submit would (its relative paths resolved from `out_dir`); SpecError, naming the file
    as `shown`, if it fails."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=out_dir, delete=False, encoding="utf-8") as tmp:
        tmp.write(text)
    try:
        return load_pipeline(tmp.name).spec
    except SpecError as exc:
        raise SpecError(str(exc).replace(tmp.name, shown)) from None
    finally:
        os.unlink(tmp.name)


def not_runnable(spec: PipelineSpec) -> list[str]:
    """Why the imported pipeline cannot run as it is: the data check's problems with the data this machine can read
    (a dataset file the recipe names and that is not there, a column the rows lack, an encoding). Data on the hub
    or in a bucket is prepare's to check."""
    from workflows.data_check import data_problems

    errors, _ = data_problems([spec])
    return [line.removeprefix("error: ") for line in errors]


def main(argv: list[str] | None = None) -> int:
    """Import a recipe; returns the exit code."""
    args = parser().parse_args(argv)
    output: Path | None = args.output
    if output is not None and output.exists() and not args.force:
        print(f"error: {output} exists; pass --force to overwrite it", file=sys.stderr)
        return EXIT_USAGE
    out_dir = output.parent if output is not None else Path.cwd()
    try:
        imported = import_recipe(args.tool, args.recipe, out_dir, args.dataset_info)
        schema = None
        if output is not None:
            schema = os.path.relpath(
                Path(__file__).resolve().parent.parent / "docs" / "pipeline.schema.json", out_dir.resolve()
            )
        text = render_pipeline(imported, args.tool, args.recipe, schema)
        spec = _validate(text, out_dir, str(output or "the imported pipeline"))
    except SpecError as exc:
        lines = str(exc).splitlines()
        print(
            f"error: {lines[0]}" if len(lines) == 1 else "error: the imported pipeline is not valid:", file=sys.stderr
        )
        for line in lines[1:] if len(lines) == 1 else lines:
            print(f"  {line}", file=sys.stderr)
        return EXIT_USAGE
    for key, value, why in imported.unmapped:
        print(f"not mapped: {key}: {json.dumps(value, default=str)} → {why}", file=sys.stderr)
    problems = not_runnable(spec)
    for problem in problems:
        print(f"not runnable: {problem}", file=sys.stderr)
    code = EXIT_NOT_RUNNABLE if problems else 0
    if output is None:
        sys.stdout.write(text)
        return code
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(output)
    print(f"wrote {output}" + (": fix what is not runnable, then submit it" if problems else ""), file=sys.stderr)
    return code
