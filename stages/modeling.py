"""The model a training stage starts from, and the model it leaves behind.

Where a stage starts:
- the first enabled training stage starts from the base model: `model.from_config` builds a seeded, randomly
  initialised Qwen3 with the tokenizer's vocabulary; otherwise the weights load with `from_pretrained`
  (revision, dtype, safetensors only, remote code only when `model.trust_remote_code`);
- a later stage (cpt → sft → rlhf) starts from the output of the enabled training stage before it: a full model
  directory, or a LoRA adapter, which a LoRA stage continues and a full stage merges first.

What a stage leaves in `<run>/<stage>/model/`: safetensors weights and the tokenizer; an adapter (with the base
it applies to recorded in stage.json) or, for full training or `lora.merge_after`, a full model, with its content
fingerprint in stage.json (`extra.model_fingerprint`). Every stage that loads a stage's model folder (the next
training stage, evaluate, deploy) fingerprints what it loads and refuses a folder that changed since its producer
recorded it, or since its own earlier attempt loaded it (`ModelInputs`).

On CPU the weights are float32 and there is no gradient checkpointing and no bf16. Attention is one of the
implementations that keep packed documents apart through their position ids (see stages/packing.py): sdpa on
CPU; on a GPU flash-attention 2 where installed, else flex attention for the packing stages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from stages.contract import RunDir, StageContext, StageRefused, is_main_process
from workflows.spec import TRAINING_STAGES, ModelSpec, PipelineSpec, TrainingStage

ModelKind = Literal["full", "adapter"]
BaseKind = Literal["from_config", "pretrained", "stage"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


class NotSupportedHere(RuntimeError):
    """The spec asks for something this machine cannot do (e.g. QLoRA without a CUDA GPU)."""


@dataclass(frozen=True)
class BaseRef:
    """The weights a stage started from (and an adapter applies to): the spec's base model (built from config or
    loaded by name) or a full model written by an earlier stage (a path relative to the run directory)."""

    kind: BaseKind
    name: str


@dataclass
class StartingModel:
    """The model a stage trains, ready for the trainer."""

    model: Any  # transformers.PreTrainedModel or peft.PeftModel
    kind: ModelKind  # what the stage trains: the full weights or an adapter
    base: BaseRef
    upstream: str | None  # the training stage whose output this continues, if any
    continued_adapter: bool = False  # a LoRA stage that goes on training the upstream stage's adapter
    save_dtype: torch.dtype | None = None  # the loaded dtype, when training upcast the weights to float32 masters
    inputs: ModelInputs | None = None  # the stage model folders it loaded, fingerprinted (held to again at a merge)


# --------------------------------------------------------------------------- fingerprints

FINGERPRINT = "model_fingerprint"
"""stage.json extra key of a stage that writes a model folder: that folder's `model_fingerprint`."""

_CHUNK = 1 << 20
_HASH_THREADS = 4


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(model_dir: Path) -> dict[str, str]:
    """sha256 (hex) of every file under `model_dir`, by its path relative to it. The files are hashed on a few
    threads (hashlib releases the GIL), so the shards of a large model hash in parallel."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        digests = list(pool.map(file_sha256, files))
    return {path.relative_to(model_dir).as_posix(): digest for path, digest in zip(files, digests, strict=True)}


def fingerprint_of(digests: dict[str, str]) -> str:
    """'sha256:<hex>' over the sorted (file name, file sha256) pairs of `file_digests`."""
    combined = hashlib.sha256()
    for name in sorted(digests):
        combined.update(f"{name}\0{digests[name]}\n".encode())
    return f"sha256:{combined.hexdigest()}"


def model_fingerprint(model_dir: Path) -> str:
    """The content fingerprint of a model folder: sha256 over its sorted file names and each file's sha256
    (weights, config, tokenizer: every file, so any change to what loads changes it).

    It costs one read of every byte. An 8B model is about 16 GB in bf16: sha256 runs at about 1.4 GB/s a core
    (with the SHA extensions of current x86 CPUs), so about 12 s of CPU, spread over up to four threads (one
    shard each); on a network volume its read speed decides (about 30 s at 500 MB/s). It is worth it: seconds
    against the hours the stages around it train, and it is the only record of what a stage actually loaded.
    A config hash says what a stage was asked to do; a model folder rewritten after its stage recorded it (a
    stage rerun by hand or by a stale retry, a copy over it) keeps the config hash and changes the bytes, and
    without this the next stage, evaluate's gate and deploy's registration would go on from a model nobody
    recorded, with lineage saying otherwise."""
    return fingerprint_of(file_digests(model_dir))


@dataclass
class ModelInputs:
    """The stage model folders a stage loads (an upstream stage's output; the stage model an adapter applies to),
    each fingerprinted once, right before it loads, recorded in stage.json's inputs, and held to:

    - the fingerprint the stage that wrote it recorded (`extra.model_fingerprint`), or with `measured_by`, the
      one that stage recorded for it as its input (deploy registers exactly the model evaluate measured);
    - for the base of an adapter, the fingerprint the adapter's stage recorded for that base: an adapter fits
      only the weights it was trained on;
    - the fingerprint this stage recorded for it in an unfinished earlier attempt (its checkpoints, and any
      partial work, were made from that model: `StageContext.begin` keeps it in the record).

    A folder that differs is refused (StageRefused: the stage records it as failed, prints one `error:` line and
    exits 2) before it loads: nothing is trained, measured or registered from it. Rank 0 checks (under torchrun
    the other ranks load the same folders; a refusal ends rank 0, and torchrun then stops the others)."""

    ctx: StageContext
    measured_by: str | None = None
    earlier: dict[str, str] = field(init=False)  # uri → fingerprint, from this stage's unfinished earlier attempt
    loaded: dict[str, tuple[str, str]] = field(init=False, default_factory=dict)  # uri → (input name, fingerprint)

    def __post_init__(self) -> None:
        inputs = self.ctx.result.inputs.values() if self.ctx.result is not None else []
        self.earlier = {ref.uri: ref.fingerprint for ref in inputs if ref.fingerprint.startswith("sha256:")}

    def check(
        self, name: str, model_dir: Path, digests: dict[str, str] | None = None, adapter_of: str | None = None
    ) -> None:
        """Fingerprint `model_dir` (or take `digests`, its `file_digests` read along the way), refuse it when it
        changed, record it as the input `name`. `adapter_of`: the stage whose adapter applies to this folder.
        Checking a folder again (a merge at the end of training reloads its base) holds it to the fingerprint it
        had when it loaded first."""
        if not is_main_process():
            return
        run_dir, stage = self.ctx.run_dir, self.ctx.stage
        uri = run_dir.relative(model_dir)
        producer = uri.split("/", 1)[0]
        actual = fingerprint_of(digests) if digests is not None else model_fingerprint(model_dir)

        def again(who: str) -> str:
            return f"python -m stages {who} --run-dir {run_dir.root} --force"

        expected, where = self._recorded(uri)
        if expected != actual and self.measured_by is not None:
            raise StageRefused(
                f"[{stage}] {uri} is not the model {self.measured_by} measured: its files hash to {actual}, "
                f"{where} records {expected}. {stage} publishes only what {self.measured_by} measured and gated: "
                f"run {self.measured_by} again ({again(self.measured_by)}), then {stage}."
            )
        if expected != actual:
            raise StageRefused(
                f"[{stage}] {uri} changed after {producer} recorded it: its files hash to {actual}, {where} records "
                f"{expected}. {stage} loads only a model its stage recorded: put back the model {producer} wrote, "
                f"or run {producer} again ({again(producer)}), then {stage}."
            )
        trained_on = _input_fingerprint(run_dir, adapter_of, uri) if adapter_of is not None else None
        if trained_on is not None and trained_on != actual:
            raise StageRefused(
                f"[{stage}] {uri} is not the model {adapter_of}'s adapter was trained on: {adapter_of}/stage.json "
                f"records {trained_on} for it, it is {actual} now ({producer} ran again after {adapter_of}). An "
                f"adapter fits only the weights it was trained on: run {adapter_of} again "
                f"({again(adapter_of)}), then {stage}."
            )
        before = self.loaded[uri][1] if uri in self.loaded else self.earlier.get(uri)
        if before is not None and before != actual:
            raise StageRefused(
                f"[{stage}] {uri} changed while {stage} was in progress: {stage} loaded {before} before, it is "
                f"{actual} now. Going on would mix work from two models (checkpoints trained from the old one). "
                f"Run {stage} with --force to start it over from the current {uri} ({again(stage)})."
            )
        name = self.loaded[uri][0] if uri in self.loaded else name
        self.loaded[uri] = (name, actual)
        self.ctx.add_input(name, uri, actual)

    def _recorded(self, uri: str) -> tuple[str, str]:
        """(the fingerprint `uri` must have, the record that says so); StageRefused when none is recorded."""
        run_dir, stage = self.ctx.run_dir, self.ctx.stage
        source = self.measured_by or uri.split("/", 1)[0]
        where = f"{source}/stage.json"
        if self.measured_by is not None:
            recorded = _input_fingerprint(run_dir, source, uri) or ""
        else:
            result = run_dir.read_result(source)
            recorded = str(result.extra.get(FINGERPRINT, "")) if result is not None else ""
        if not recorded.startswith("sha256:"):
            raise StageRefused(
                f"[{stage}] {where} records no content fingerprint of {uri} (it was written by an older version): "
                f"nothing to hold {uri} to. Run {source} again (python -m stages {source} --run-dir {run_dir.root} "
                f"--force), then {stage}."
            )
        return recorded, where


def _input_fingerprint(run_dir: RunDir, stage: str, uri: str) -> str | None:
    """The content fingerprint `stage` recorded for its input `uri`, if any."""
    result = run_dir.read_result(stage)
    found = [ref.fingerprint for ref in result.inputs.values() if ref.uri == uri] if result is not None else []
    return next((f for f in found if f.startswith("sha256:")), None)


# --------------------------------------------------------------------------- settings


def on_gpu() -> bool:
    """Whether this process trains on a CUDA GPU."""
    return torch.cuda.is_available()


def weights_dtype(model_spec: ModelSpec) -> torch.dtype | str:
    """float32 on CPU; the spec's dtype on GPU."""
    if not on_gpu():
        return torch.float32
    return "auto" if model_spec.dtype == "auto" else _DTYPES[model_spec.dtype]


def attention_implementation(model_spec: ModelSpec) -> str:
    """The spec's choice, else the fastest kernel that keeps packed documents apart: flash-attention 2 (varlen
    through the position ids) on a GPU where it is installed, otherwise sdpa with the block-diagonal mask that
    transformers builds from the position ids. A packing stage on a GPU may switch to flex attention
    (`packed_attention`)."""
    if model_spec.attn_implementation is not None:
        return model_spec.attn_implementation
    if on_gpu() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def packed_attention(model_spec: ModelSpec, stage: str, section: TrainingStage) -> str | None:
    """The kernel a stage that packs documents (cpt, sft with `training.packing`) switches to on a GPU without
    flash-attention: flex attention, whose block mask, built from the position ids, skips the blocks between
    documents (sdpa gets a dense block-diagonal mask and computes every block; see docs/performance.md). Every
    step has the same shape there (batch_width_multiple), so it compiles once. None keeps the model's kernel: the
    spec names one, the stage does not pack (rlhf's padded batches would recompile flex attention at every new
    length), QLoRA, or on CPU."""
    if model_spec.attn_implementation is not None or not on_gpu() or _has("flash_attn"):
        return None
    if stage not in ("cpt", "sft") or not section.training.packing or section.method == "qlora":
        return None  # QLoRA: the document-boundary check has not passed with flex attention on 4-bit weights
    return "flex_attention"


def float32_masters(model: Any, section: TrainingStage) -> torch.dtype | None:
    """Full fine-tuning on a GPU under DDP (or in one process) trains float32 master weights, with the forward
    and backward passes in bf16 under autocast (the Trainer's `bf16`): a bf16 weight loses every update smaller
    than half its spacing (0.2-0.4% of it), and at fine-tuning learning rates (an Adam step of 2e-5 on a weight
    of 0.02) that is nearly all of them. Upcasts `model` in place and returns the dtype it was loaded in, to save
    the final model in; None when it stays as it is: `training.pure_bf16` (faster, half the memory), CPU (float32
    already), or FSDP and DeepSpeed, which keep float32 masters themselves (accelerate upcasts for FSDP2; ZeRO's
    optimizer holds float32 copies)."""
    loaded = next(model.parameters()).dtype
    low = loaded in (torch.bfloat16, torch.float16)
    if not (on_gpu() and low and section.distributed.strategy == "ddp" and not section.training.pure_bf16):
        return None
    model.float()
    return loaded


def check_method(stage: str, section: TrainingStage) -> None:
    """Refuse what this machine cannot do, naming the spec field to change."""
    if section.method != "qlora":
        return
    missing = [what for what, ok in (("a CUDA GPU", on_gpu()), ("bitsandbytes", _has("bitsandbytes"))) if not ok]
    if missing:
        raise NotSupportedHere(
            f"stages.{stage}.method is 'qlora', which needs bitsandbytes and a CUDA GPU; this machine has no "
            f"{' and no '.join(missing)}. Use method 'lora' (or 'full') here."
        )


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _quantization_config(section: TrainingStage, model_spec: ModelSpec) -> Any:
    """4-bit NF4 quantization for QLoRA."""
    from transformers import BitsAndBytesConfig

    compute = _DTYPES.get(model_spec.dtype, torch.bfloat16)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute if compute != torch.float32 else torch.bfloat16,
    )


# --------------------------------------------------------------------------- loading


def load_tokenizer(run_dir: RunDir, model_spec: ModelSpec) -> Any:
    """The run's tokenizer, as prepare wrote it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        run_dir.root / "prepare" / "tokenizer", trust_remote_code=model_spec.trust_remote_code
    )


def build_from_config(model_spec: ModelSpec, tokenizer: Any) -> Any:
    """A randomly initialised Qwen3 from `model.from_config`, seeded, with the tokenizer's vocabulary size."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tiny = model_spec.from_config
    assert tiny is not None
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        max_position_embeddings=tiny.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=weights_dtype(model_spec), attn_implementation=attention_implementation(model_spec)
        )
    model.config._name_or_path = model_spec.name_or_path
    return model


def load_pretrained(path_or_id: str | Path, model_spec: ModelSpec, revision: str | None = None, **kwargs: Any) -> Any:
    """Weights from a hub id or a directory: safetensors only, remote code only when the spec allows it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path_or_id),
        revision=revision,
        dtype=weights_dtype(model_spec),
        attn_implementation=attention_implementation(model_spec),
        trust_remote_code=model_spec.trust_remote_code,
        use_safetensors=True,
        **kwargs,
    )


def load_adapter(model: Any, adapter_dir: Path, is_trainable: bool = False) -> Any:
    """A LoRA adapter from a stage's model folder, from safetensors only: PEFT would fall back to a pickled
    `adapter_model.bin` when that is all the folder holds, and unpickling runs code."""
    from peft import PeftModel

    if not (adapter_dir / "adapter_model.safetensors").is_file():
        found = sorted(p.name for p in adapter_dir.iterdir()) if adapter_dir.is_dir() else []
        raise NotSupportedHere(
            f"{adapter_dir} has no adapter_model.safetensors (found: {', '.join(found) or 'nothing'}); adapters load "
            "from safetensors only. Rerun the stage that wrote it, or convert the adapter with safetensors first."
        )
    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=is_trainable)


def load_base(run_dir: RunDir, spec: PipelineSpec, base: BaseRef, tokenizer: Any, quantization: Any = None) -> Any:
    """The weights `base` names, built or loaded."""
    extra: dict[str, Any] = {}
    if quantization is not None:
        extra = {"quantization_config": quantization, "device_map": {"": torch.cuda.current_device()}}
    if base.kind == "from_config":
        if quantization is not None:
            raise NotSupportedHere(
                "QLoRA quantizes pretrained weights; a model built with model.from_config trains with method 'lora'"
            )
        return build_from_config(spec.model, tokenizer)
    if base.kind == "stage":
        return load_pretrained(run_dir.root / base.name, spec.model, **extra)
    return load_pretrained(spec.model.name_or_path, spec.model, revision=spec.model.revision, **extra)


def spec_base(spec: PipelineSpec) -> BaseRef:
    """The pipeline's base model."""
    return BaseRef("from_config" if spec.model.from_config is not None else "pretrained", spec.model.name_or_path)


def upstream_stage(spec: PipelineSpec, stage: str) -> str | None:
    """The enabled training stage just before `stage`, whose output `stage` continues."""
    before = TRAINING_STAGES[: TRAINING_STAGES.index(stage)]
    enabled = [s for s in before if spec.stage(s).enabled]
    return enabled[-1] if enabled else None


@dataclass(frozen=True)
class StageOutput:
    """What a finished training stage left: a full model or an adapter over `base`."""

    stage: str
    path: Path
    kind: ModelKind
    base: BaseRef


def stage_output(run_dir: RunDir, stage: str) -> StageOutput:
    """The model a succeeded training stage wrote, from its stage.json."""
    result = run_dir.read_result(stage)
    if result is None or result.status != "succeeded":
        state = "has not run" if result is None else f"is {result.status}"
        raise RuntimeError(f"stage {stage} {state} in {run_dir.root}: it must succeed before the stages after it")
    extra = result.extra
    return StageOutput(
        stage=stage,
        path=run_dir.stage_dir(stage) / "model",
        kind=extra["model_kind"],
        base=BaseRef(extra["base_kind"], extra["base"]),
    )


def lora_config(section: TrainingStage) -> Any:
    """The stage's LoRA adapter settings."""
    from peft import LoraConfig

    return LoraConfig(
        r=section.lora.r,
        lora_alpha=section.lora.alpha,
        lora_dropout=section.lora.dropout,
        target_modules=section.lora.target_modules,
        task_type="CAUSAL_LM",
    )


def load_starting_model(
    run_dir: RunDir, spec: PipelineSpec, stage: str, tokenizer: Any, inputs: ModelInputs | None = None
) -> StartingModel:
    """The model `stage` trains: the base model or the upstream stage's output, with a LoRA adapter (new or
    continued) when the stage's method is lora or qlora. With `inputs` (the stages pass it), each stage model
    folder is fingerprinted and checked before it loads: the upstream output as input `model`, the stage model
    an upstream adapter applies to as `model_base`."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    section: TrainingStage = spec.stage(stage)  # type: ignore[assignment]
    check_method(stage, section)
    quantization = _quantization_config(section, spec.model) if section.method == "qlora" else None

    upstream = upstream_stage(spec, stage)
    adapter_dir: Path | None = None
    if upstream is None:
        base = spec_base(spec)
    else:
        previous = stage_output(run_dir, upstream)
        if previous.kind == "full":
            base = BaseRef("stage", run_dir.relative(previous.path))
        else:
            base, adapter_dir = previous.base, previous.path
    if inputs is not None and upstream is not None:
        if adapter_dir is None:
            inputs.check("model", run_dir.root / base.name)  # the upstream's full model
        else:
            if base.kind == "stage":  # the stage model the upstream adapter applies to
                inputs.check("model_base", run_dir.root / base.name, adapter_of=upstream)
            inputs.check("model", adapter_dir)
    model = load_base(run_dir, spec, base, tokenizer, quantization)
    switch = packed_attention(spec.model, stage, section)
    if switch is not None:
        model.set_attn_implementation(switch)

    if section.method == "full":
        if adapter_dir is not None:  # full training after a LoRA stage: merge its adapter first
            model = load_adapter(model, adapter_dir).merge_and_unload()
            model.requires_grad_(True)  # PEFT loaded the base frozen; full training trains every weight
        save_dtype = float32_masters(model, section)
        start = StartingModel(
            model=model, kind="full", base=base, upstream=upstream, save_dtype=save_dtype, inputs=inputs
        )
    else:
        if quantization is not None:
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=section.training.gradient_checkpointing
            )
        if adapter_dir is not None:  # continue the upstream adapter (its own r/alpha/targets)
            model = load_adapter(model, adapter_dir, is_trainable=True)
        else:
            model = get_peft_model(model, lora_config(section))
        start = StartingModel(
            model=model,
            kind="adapter",
            base=base,
            upstream=upstream,
            continued_adapter=adapter_dir is not None,
            inputs=inputs,
        )
    start.model.config.use_cache = False  # a KV cache in training would hide the packed-document boundaries
    return start


def load_stage_model(
    run_dir: RunDir,
    spec: PipelineSpec,
    stage: str,
    tokenizer: Any,
    inputs: ModelInputs | None = None,
    name: str = "model",
) -> Any:
    """A finished stage's model for inference: a full model, or an adapter merged into its base. With `inputs`,
    each stage model folder is fingerprinted and checked before it loads (input `name`, and `<name>_base` for
    the stage model an adapter applies to)."""
    output = stage_output(run_dir, stage)
    if output.kind == "full":
        if inputs is not None:
            inputs.check(name, output.path)
        return load_pretrained(output.path, spec.model)
    if inputs is not None:
        if output.base.kind == "stage":
            inputs.check(f"{name}_base", run_dir.root / output.base.name, adapter_of=stage)
        inputs.check(name, output.path)
    base = load_base(run_dir, spec, output.base, tokenizer)
    return load_adapter(base, output.path).merge_and_unload()


# --------------------------------------------------------------------------- saving


def save_stage_model(
    trainer: Any, tokenizer: Any, run_dir: RunDir, spec: PipelineSpec, stage: str, start: StartingModel
) -> dict[str, str]:
    """Write the trained model into `<run>/<stage>/model/` (safetensors + tokenizer) and return what it is, for
    stage.json's extra. Every rank calls this (FSDP and ZeRO-3 gather the weights); rank 0 writes."""
    section: TrainingStage = spec.stage(stage)  # type: ignore[assignment]
    out = run_dir.stage_dir(stage) / "model"
    if is_main_process() and out.exists():
        shutil.rmtree(out)
    trainer.accelerator.wait_for_everyone()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    unwrapped.config.use_cache = True
    if start.save_dtype is not None:  # trained on float32 masters: the model is served in the dtype it came in
        unwrapped.to(start.save_dtype)
    trainer.save_model(str(out))
    kind: ModelKind = start.kind
    if is_main_process():
        (out / "training_args.bin").unlink(missing_ok=True)  # a pickle, not part of the model
        tokenizer.save_pretrained(out)
        if start.kind == "adapter" and section.lora.merge_after:
            merged = _merge_adapter(run_dir, spec, start, out, tokenizer)
            for name in _ADAPTER_FILES:
                (out / name).unlink(missing_ok=True)
            merged.save_pretrained(out)
            kind = "full"
    trainer.accelerator.wait_for_everyone()
    return {"model_kind": kind, "base": start.base.name, "base_kind": start.base.kind}


def _merge_adapter(run_dir: RunDir, spec: PipelineSpec, start: StartingModel, adapter_dir: Path, tokenizer: Any) -> Any:
    """The adapter in `adapter_dir` merged into a fresh, unquantized copy of its base. A base that is a stage's
    model folder is read again from disk, hours after training started from it: it must still be what it was."""
    if start.inputs is not None and start.base.kind == "stage":
        start.inputs.check("model", run_dir.root / start.base.name)
    model = load_base(run_dir, spec, start.base, tokenizer)
    merged = load_adapter(model, adapter_dir).merge_and_unload()
    merged.config.use_cache = True
    return merged


def describe(model: Any) -> dict[str, int]:
    """Parameter counts (all and trainable), for the log and the tracker."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"parameters": total, "trainable_parameters": trainable}
