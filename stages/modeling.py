"""The model a training stage starts from, and the model it leaves behind.

Where a stage starts:
- the first enabled training stage starts from the base model: `model.from_config` builds a seeded, randomly
  initialised model of the family it names (qwen2, qwen3, qwen3_moe, llama, gemma3, exaone4, mistral) with the
  tokenizer's vocabulary; otherwise the weights load with `from_pretrained` (revision, dtype, safetensors only,
  remote code only when `model.trust_remote_code`);
- a later stage (cpt → sft → rlhf) starts from the output of the enabled training stage before it: a full model
  directory, or a LoRA adapter, which a LoRA stage continues and a full stage merges first.

What a stage leaves in `<run>/<stage>/model/` (`stages.training.save_stage_model` writes it): safetensors weights
and the tokenizer; an adapter (with the base it applies to recorded in stage.json) or, for full training or
`lora.merge_after`, a full model, with its content fingerprint in stage.json (`extra.model_fingerprint`). Every
stage that loads a stage's model folder (the next training stage, evaluate, deploy) fingerprints what it loads and
refuses a folder that changed since its producer recorded it, or since its own earlier attempt loaded it
(`ModelInputs`).

Under FSDP2 over several processes the model loads once per job (`stages.sharded_loading`): rank 0 reads it, the
other ranks build a skeleton on the meta device that accelerate fills by broadcast. Under DeepSpeed ZeRO-3 over
several processes it is created partitioned (zero.Init) and rank 0's copy of the checkpoint is loaded into the
partitions; a partitioned parameter's own tensor is empty, so sizes here read `full_numel` / `full_shape`.

On CPU the weights are float32 and there is no gradient checkpointing and no bf16. Attention is one of the
implementations that keep packed documents apart through their position ids (see stages/packing.py): sdpa on
CPU; on a GPU flash-attention 2 where installed, else flex attention for the packing stages.

Mixture-of-experts models (transformers 5 stacks each layer's experts into 3-D parameters): on a GPU their experts
run as one grouped GEMM (`experts_implementation`); LoRA reaches the experts through PEFT's target_parameters
(`lora_config`, `lora.target_experts`); the router's load-balancing loss is set from
`training.router_aux_loss_coef` (`router_aux_loss`); under QLoRA the experts are 4-bit too, quantized as they load
and dequantized inside the grouped path (stages/quantized_experts.py, `experts_note`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from run.run_dir import RunDir, StageRefused
from spec.fields import TRAINING_STAGES
from spec.model import ModelSpec, TinyModelConfig
from spec.pipeline import PipelineSpec
from spec.training import TrainingStage
from stages.contract import ExplainedFailure, NotSupportedHere, StageContext, is_main_process
from stages.distributed import zero3_loading
from stages.expert_lora import GROUPED_EXPERTS
from stages.float8 import (
    check_float8,
    compile_decoder_layers,
    compiles_decoder_layers,
    train_in_float8,
)
from stages.model_parallel import (
    average_split_adapters,
    check_fits,
    load_sharded,
    shard_whole,
    shards_at_load,
    tensor_parallel_size,
    trains_float32_masters,
    whole_layer_adapters,
)
from stages.quantized_experts import is_quantized, quantized_experts, shaped_experts
from stages.sharded_loading import (
    first_rank_placement,
    full_numel,
    full_shape,
    loads_once,
    on_meta,
    parameter_count,
    partitions_at_load,
    skeleton,
    tell_apart,
)

ModelKind = Literal["full", "adapter"]
BaseKind = Literal["from_config", "pretrained", "stage"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    merged_adapter: Path | None = None  # full training: the upstream stage's adapter merged into the base first
    save_dtype: torch.dtype | None = None  # the loaded dtype, when training upcast the weights to float32 masters
    zero3_config: Any = None  # transformers' HfDeepSpeedConfig the model loaded partitioned under, kept alive
    inputs: ModelInputs | None = None  # the stage model folders it loaded, fingerprinted (held to again at a merge)
    loaded_config: dict[str, Any] = field(default_factory=dict)  # config values training changed, put back at save


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


def experts_implementation() -> str | None:
    """How a mixture-of-experts model runs its experts: on a CUDA GPU torch's grouped GEMM (one kernel for the
    tokens of all experts, about 8× faster than the per-expert loop of transformers' 'eager'), through the stages'
    own experts forward (GROUPED_EXPERTS, stages/expert_lora.py: transformers' 'grouped_mm' with cheaper routing);
    on CPU None, transformers' own default."""
    return GROUPED_EXPERTS if on_gpu() else None


def _fused_experts(model: Any) -> Any:
    """`model`, its experts switched to `experts_implementation()` when it is a mixture-of-experts model (a dense
    model refuses the setting)."""
    choice = experts_implementation()
    if choice is not None and expert_parameters(model) and not quantized_experts(model):  # 4-bit: the quantizer's
        model.set_experts_implementation(choice)
    return model


def low_rank_experts(model: Any, stage: str) -> None:
    """Where the experts run as grouped GEMMs (`experts_implementation`), a LoRA model's adapters on them are
    applied as low-rank grouped products beside the base's instead of PEFT's merged weights (stages/expert_lora.py:
    nothing of the expert stack's size made per step). On CPU the per-expert loop keeps PEFT's path, except on
    4-bit experts and experts split over ranks (`distributed.expert_parallel`), which have no other."""
    split = any(getattr(module, "_is_expert_parallel", False) for module in model.modules())
    grouped = experts_implementation() == GROUPED_EXPERTS and expert_parameters(model)
    if not (quantized_experts(model) or split or grouped):
        return
    from stages.expert_lora import ALIGNMENT_BYTES, unfit_adapters, use_low_rank_experts

    switched = use_low_rank_experts(model)
    if switched:
        print(f"[{stage}] lora: {switched} expert adapters applied as low-rank grouped products", flush=True)
    if unfit := unfit_adapters(model):
        raise NotSupportedHere(
            f"stages.{stage}.lora.r: LoRA on 4-bit or split experts ({', '.join(unfit)}) runs only as low-rank "
            f"grouped products, one adapter at a time, whose rank rows must fill {ALIGNMENT_BYTES} bytes: r a "
            "multiple of 8 (in bf16). Choose such an r, or lora.target_experts: false"
        )


def expert_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    """A mixture-of-experts model's expert weights, by name: transformers 5 stacks each layer's experts into 3-D
    parameters ([experts, out, in]) of a module that counts them in `num_experts` (qwen3_moe:
    `model.layers.N.mlp.experts.gate_up_proj` and `.down_proj`), 4-bit ones included. Empty for a dense model."""
    found: dict[str, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int):
            continue
        for name, param in module.named_parameters(recurse=False):
            # ZeRO-3 partitioned: the tensor itself is empty; 4-bit: it is the packed bytes
            shape = param.quant_state.shape if is_quantized(param) else full_shape(param)
            # expert parallelism: the module counts its own group's share of the experts, the DTensor's shape is
            # every rank's (its local tensor may be less still: FSDP2 shards the share over the groups' copies)
            spread = getattr(module, "_is_expert_parallel", False) and shape[0] % count == 0
            if len(shape) == 3 and (count == shape[0] or spread):
                found[f"{module_name}.{name}"] = param
    return found


def _in_layer(name: str) -> str:
    """A parameter's name inside its decoder layer: model.layers.3.mlp.experts.down_proj → mlp.experts.down_proj."""
    parts = name.split(".")
    numbers = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[numbers[-1] + 1 :]) if numbers else name


def experts_note(model: Any) -> str | None:
    """What QLoRA did with a mixture-of-experts model's stacked experts, for the log (None for a dense model):
    4-bit, or the dtype they stayed in (loaded without stages.experts_quantizer's config: under FSDP)."""
    experts = expert_parameters(model)
    if not experts:
        return None
    names = ", ".join(sorted({_in_layer(name) for name in experts}))
    total = sum(full_numel(p) * p.element_size() for p in model.parameters())
    size = sum(full_numel(p) * p.element_size() for p in experts.values())
    four_bit = quantized_experts(model)
    if len(four_bit) == len(experts):
        return (
            f"QLoRA: this mixture-of-experts model's {len(experts)} stacked expert tensors ({names} of every layer) "
            f"are 4-bit NF4: {size / 2**30:.2f} GiB of the {total / 2**30:.2f} GiB its weights take"
        )
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in experts.values()})
    return (
        f"QLoRA: this mixture-of-experts model's {len(experts) - len(four_bit)} stacked expert tensors ({names}) "
        f"stay {'/'.join(dtypes)}: {size / 2**30:.2f} GiB of the {total / 2**30:.2f} GiB its weights take (4-bit "
        "under any distributed.strategy but fsdp)"
    )


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


FLEX_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}
"""Flex attention's kernel for every query length. For queries under 128 tokens Inductor picks its decoding kernel
instead, and with Qwen3-30B-A3B's heads (32 query heads on 4 key-value heads) it found no kernel for that on an H100
(`NoValidChoicesError ... target: flex_attention`, bench/flex_shapes.py, 2026-11-27); the main kernel takes them."""


def use_attention(model: Any, implementation: str) -> None:
    """Switch `model` to the attention `implementation` (`packed_attention`'s choice); with flex attention every
    forward of its decoder passes FLEX_KERNEL_OPTIONS on to the kernel (transformers hands a forward's
    `kernel_options` to flex attention; the hook sits on the decoder, which PEFT's wrapper calls as a module)."""
    model.set_attn_implementation(implementation)
    if implementation == "flex_attention":
        model.base_model.register_forward_pre_hook(_flex_kernel_options, with_kwargs=True)


def _flex_kernel_options(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    kwargs.setdefault("kernel_options", dict(FLEX_KERNEL_OPTIONS))
    return args, kwargs


def float32_masters(model: Any, section: TrainingStage) -> torch.dtype | None:
    """Full fine-tuning on a GPU under DDP (or in one process) trains float32 master weights, with the forward
    and backward passes in bf16 under autocast (the Trainer's `bf16`): a bf16 weight loses every update smaller
    than half its spacing (0.2-0.4% of it), and at fine-tuning learning rates (an Adam step of 2e-5 on a weight
    of 0.02) that is nearly all of them. Upcasts `model` in place and returns the dtype it was loaded in, to save
    the final model in; None when it stays as it is: `training.pure_bf16` (faster, half the memory), CPU (float32
    already), or FSDP and DeepSpeed, which keep float32 masters themselves (accelerate upcasts for FSDP2; ZeRO's
    optimizer holds float32 copies). Pipeline parallelism (`distributed.pipeline_parallel`) shards each stage with
    FSDP2 itself, over these masters."""
    loaded = next(model.parameters()).dtype
    low = loaded in (torch.bfloat16, torch.float16)
    own_masters = section.distributed.strategy == "ddp" or section.distributed.pipeline_parallel > 1
    if not (on_gpu() and low and own_masters and not section.training.pure_bf16):
        return None
    model.float()
    return loaded


def adapter_inputs_uncast(model: Any, stage: str) -> int:
    """cpt and sft on a GPU: LoRA layers take their input in the compute dtype instead of PEFT's cast to the
    adapter weights' float32. Under the Trainer's autocast (every forward of a model the Trainer prepared, on a GPU
    always bf16 or fp16: `precision_arguments`) the adapter's matmuls cast that float32 copy straight back, so the
    cast is a round trip of every LoRA layer's activations: 16% of a LoRA step's GPU time on an 8B model at rows
    of 4096 (docs/performance.md, B2 on an H100). The adapter weights stay float32 masters; only LoRA dropout
    then runs in bf16. Not in rlhf, whose trainers also run forwards outside the Trainer's autocast (generation,
    reference passes), where a bf16 input would meet float32 weights. Returns the number of layers changed."""
    from peft.tuners.lora import LoraLayer

    if not on_gpu() or stage not in ("cpt", "sft"):
        return 0
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False  # peft.helpers.disable_input_dtype_casting, for good
    return len(layers)


def check_method(stage: str, section: TrainingStage) -> None:
    """Refuse what this machine cannot do, naming the spec field to change."""
    if section.training.fp8:
        check_float8(stage)
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
    """4-bit NF4 quantization for QLoRA: bitsandbytes' settings, the stacked experts of a mixture-of-experts model
    included (stages/quantized_experts.py; a dense model loads as with bitsandbytes' own config). Under FSDP the
    experts stay bf16, as bitsandbytes leaves them: FSDP2 replaces each parameter it shards by a DTensor, and a
    4-bit expert stack's quantization state (bitsandbytes' Params4bit) would not survive it."""
    from transformers import BitsAndBytesConfig

    from stages.experts_quantizer import ExpertsBitsAndBytesConfig

    config = BitsAndBytesConfig if section.distributed.strategy == "fsdp" else ExpertsBitsAndBytesConfig
    compute = _DTYPES.get(model_spec.dtype, torch.bfloat16)
    return config(
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
    """A randomly initialised model from `model.from_config`, seeded, with the tokenizer's vocabulary size."""
    from transformers import AutoModelForCausalLM

    tiny = model_spec.from_config
    assert tiny is not None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = AutoModelForCausalLM.from_config(
            tiny_config(tiny, tokenizer),
            dtype=weights_dtype(model_spec),
            attn_implementation=attention_implementation(model_spec),
        )
    model.config._name_or_path = model_spec.name_or_path
    return _fused_experts(model)


_WINDOWED_EVERY = {"gemma3": 6, "exaone4": 4}
"""Families that interleave sliding-window layers with full-attention ones: every n-th layer is full (5:1, 3:1)."""


def tiny_config(tiny: TinyModelConfig, tokenizer: Any) -> Any:
    """The transformers config of `tiny.architecture`'s family with the spec's sizes and the tokenizer's vocabulary
    and special tokens. The family's own settings are kept (the config class's defaults, tied embeddings included:
    gemma3 ties them, the others do not), except where they only fit a full-size model:

    - gemma3, exaone4: the default layer pattern leaves a 2-layer model without a full-attention layer, and a
      4096-token window never slides in rows this short. Every n-th layer and the last one attend fully, the others
      over a quarter of max_position_embeddings. gemma3 scales queries by head_dim**-0.5, as Gemma 3 1B to 12B
      do (the config's default, 256, is their head_dim);
    - mistral: no sliding window (Mistral 7B v0.2 and later);
    - qwen3_moe: every layer is a mixture-of-experts layer, top-k weights renormalised (Qwen3-30B-A3B's
      `norm_topk_prob`)."""
    import transformers

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": tiny.hidden_size,
        "intermediate_size": tiny.intermediate_size,
        "num_hidden_layers": tiny.num_hidden_layers,
        "num_attention_heads": tiny.num_attention_heads,
        "num_key_value_heads": tiny.num_key_value_heads,
        "head_dim": tiny.head_dim,  # exaone4's config has no such field; its attention reads the attribute
        "max_position_embeddings": tiny.max_position_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    family: dict[str, Any] = {}
    if tiny.architecture in _WINDOWED_EVERY:
        every, last = _WINDOWED_EVERY[tiny.architecture], tiny.num_hidden_layers - 1
        family["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 or i == last else "sliding_attention"
            for i in range(tiny.num_hidden_layers)
        ]
        family["sliding_window"] = max(1, tiny.max_position_embeddings // 4)
    if tiny.architecture == "gemma3":
        family["query_pre_attn_scalar"] = tiny.head_dim
    elif tiny.architecture == "exaone4":
        family["sliding_window_pattern"] = _WINDOWED_EVERY["exaone4"]
    elif tiny.architecture == "mistral":
        family["sliding_window"] = None
    elif (moe := tiny.moe_sizes()) is not None:
        family.update(
            num_experts=moe[0],
            num_experts_per_tok=moe[1],
            moe_intermediate_size=moe[2],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    config_class = {
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "qwen3_moe": "Qwen3MoeConfig",
        "llama": "LlamaConfig",
        "gemma3": "Gemma3TextConfig",
        "exaone4": "Exaone4Config",
        "mistral": "MistralConfig",
    }[tiny.architecture]
    return getattr(transformers, config_class)(**common, **family)


def load_pretrained(path_or_id: str | Path, model_spec: ModelSpec, revision: str | None = None, **kwargs: Any) -> Any:
    """Weights from a hub id or a directory: safetensors only, remote code only when the spec allows it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path_or_id),
        revision=revision,
        dtype=weights_dtype(model_spec),
        attn_implementation=attention_implementation(model_spec),
        trust_remote_code=model_spec.trust_remote_code,
        use_safetensors=True,
        **kwargs,
    )
    return _fused_experts(model)


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


def load_base(
    run_dir: RunDir,
    spec: PipelineSpec,
    base: BaseRef,
    tokenizer: Any,
    quantization: Any = None,
    placement: dict[str, Any] | None = None,
    once: bool = False,
) -> Any:
    """The weights `base` names, built or loaded; `placement` (e.g. a device_map) applies to loaded weights.
    `once` (FSDP2 over several processes): rank 0 alone reads the weights, onto its GPU where they fit, and every
    other rank gets the same model as a skeleton on the meta device (`stages.sharded_loading`)."""
    extra: dict[str, Any] = dict(placement or {})
    if quantization is not None:
        device = torch.cuda.current_device() if on_gpu() else "cpu"  # CPU: bitsandbytes' CPU backend (tests)
        extra = {"quantization_config": quantization, "device_map": {"": device}}
    if base.kind == "from_config":
        if quantization is not None:
            raise NotSupportedHere(
                "QLoRA quantizes pretrained weights; a model built with model.from_config trains with method 'lora'"
            )
        if once and not is_main_process():
            return skeleton(lambda: build_from_config(spec.model, tokenizer))
        return build_from_config(spec.model, tokenizer)
    source, revision = base_source(run_dir, spec, base)
    if once:
        shape = model_skeleton(source, spec.model, revision)
        if not is_main_process():
            grow_vocabulary(shape, tokenizer, mean_resizing=False)  # rank 0's rows arrive by broadcast
            return shape
        extra.update(first_rank_placement(parameter_count(shape)))
    model = load_pretrained(source, spec.model, revision=revision, **extra)
    grow_vocabulary(model, tokenizer)
    return model


def base_source(run_dir: RunDir, spec: PipelineSpec, base: BaseRef) -> tuple[str | Path, str | None]:
    """Where a loaded base's weights are, and at which revision: a stage's model folder, or the pipeline's model."""
    if base.kind == "stage":
        return run_dir.root / base.name, None
    return spec.model.name_or_path, spec.model.revision


def sharded_settings(spec: PipelineSpec, section: TrainingStage) -> dict[str, Any]:
    """`from_pretrained`'s settings for a model sharded as it loads (tensor or expert parallelism): float32 where it
    trains float32 masters (`stages.model_parallel.trains_float32_masters`), else the spec's dtype."""
    return {
        "dtype": torch.float32 if trains_float32_masters(section) else weights_dtype(spec.model),
        "attn_implementation": attention_implementation(spec.model),
        "trust_remote_code": spec.model.trust_remote_code,
    }


def shard_built(whole: Any, spec: PipelineSpec, section: TrainingStage) -> Any:
    """A model made whole in this process, sharded for tensor or expert parallelism, its experts (if any) on the
    stages' forward."""
    return _fused_experts(shard_whole(whole, section, **sharded_settings(spec, section)))


def load_model_parallel(
    run_dir: RunDir, spec: PipelineSpec, stage: str, base: BaseRef, tokenizer: Any, merge: Path | None = None
) -> tuple[Any, torch.dtype | None]:
    """The weights `base` names sharded for tensor or expert parallelism (`stages.model_parallel`), and the dtype to
    save the trained model in when it trains float32 masters (None otherwise). Each rank reads its shards from the
    checkpoint folder; a model that must change before it trains (built from config, a vocabulary to grow, the
    upstream adapter in `merge` to merge in for full training) is made whole in each process first."""
    from transformers import AutoConfig

    section: TrainingStage = spec.stage(stage)  # type: ignore[assignment]
    masters = trains_float32_masters(section)
    if base.kind != "from_config" and merge is None:
        source, revision = base_source(run_dir, spec, base)
        config = AutoConfig.from_pretrained(
            str(source), revision=revision, trust_remote_code=spec.model.trust_remote_code
        )
        check_fits(stage, section, config)
        if len(tokenizer) <= config.get_text_config().vocab_size:
            dtype = weights_dtype(spec.model)
            saved = getattr(config.get_text_config(), "dtype", None) if dtype == "auto" else dtype
            model = load_sharded(source, revision, section, **sharded_settings(spec, section))
            return _fused_experts(model), (_as_dtype(saved) if masters else None)
    whole = load_base(run_dir, spec, base, tokenizer)
    if merge is not None:
        whole = load_adapter(whole, merge).merge_and_unload()
    check_fits(stage, section, whole.config)
    saved = next(whole.parameters()).dtype
    return shard_built(whole, spec, section), (saved if masters else None)


def _as_dtype(value: Any) -> torch.dtype:
    """A config's dtype (a torch dtype or its name; none: bf16) as a torch dtype."""
    if isinstance(value, torch.dtype):
        return value
    return getattr(torch, str(value).removeprefix("torch.")) if value else torch.bfloat16


def model_skeleton(source: str | Path, model_spec: ModelSpec, revision: str | None = None) -> Any:
    """The model a checkpoint holds, built from its config alone with its parameters on the meta device, in the dtype
    `load_pretrained` would give them ('auto': the checkpoint's own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(source), revision=revision, trust_remote_code=model_spec.trust_remote_code)
    dtype = weights_dtype(model_spec)
    if dtype == "auto":
        dtype = getattr(config.get_text_config(), "dtype", None) or torch.bfloat16
    model = skeleton(
        lambda: AutoModelForCausalLM.from_config(
            config,
            dtype=dtype,
            attn_implementation=attention_implementation(model_spec),
            trust_remote_code=model_spec.trust_remote_code,
        )
    )
    return _fused_experts(model)


def grow_vocabulary(model: Any, tokenizer: Any, mean_resizing: bool = True) -> None:
    """Grow the input embeddings and the LM head to the tokenizer's size when model.chat_template brought tokens
    the model does not have; the new rows start at the mean of the old ones (transformers' mean_resizing), so they
    do not skew the first predictions. A model folder a stage wrote has them already (saved grown)."""
    have = full_shape(model.get_input_embeddings().weight)[0]
    if len(tokenizer) > have:
        print(f"model: embeddings {have} → {len(tokenizer)} rows for the chat template's new tokens", flush=True)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=mean_resizing)


def template_token_ids(spec: PipelineSpec, tokenizer: Any) -> list[int]:
    """The ids of the control tokens of model.chat_template (a known template set on a model that lacks one): new
    rows, or rows a base model never trained (Llama-3 base's <|eot_id|>). A LoRA stage trains them too
    (`lora_config`), or the model could not learn to end a turn; full fine-tuning trains every row anyway."""
    from stages.chat import KNOWN_TEMPLATES

    known = KNOWN_TEMPLATES.get(spec.model.chat_template or "")
    if known is None or spec.model.from_config is not None:
        return []
    ids = tokenizer.convert_tokens_to_ids([known.eos, *known.extra])
    return sorted({i for i in ids if i is not None and i != tokenizer.unk_token_id})


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


def lora_config(section: TrainingStage, model: Any, trained_tokens: list[int] | None = None) -> Any:
    """The stage's LoRA adapter settings for `model`.

    A mixture-of-experts model keeps its experts as stacked 3-D parameters (`expert_parameters`), which no
    target_modules entry reaches: with `lora.target_experts` they get adapters through PEFT's target_parameters,
    one rank-r adapter per expert on each stacked matrix. The names are resolved here, not by PEFT: on transformers
    5, PEFT 0.21 widens 'all-linear' on such a model to the experts and the router by itself (what 'all-linear' met
    on transformers 4, where they were nn.Linear), with twice the rank on gate_up_proj; 'all-linear' is therefore
    passed as the linear modules' names (the attention projections, and any dense MLP). The router stays frozen.
    PEFT cannot put dropout on a parameter's adapter (it refuses lora_dropout > 0 there), so an adapter with
    expert targets has none."""
    from peft import LoraConfig

    lora = section.lora
    experts = expert_parameters(model)
    targets = lora.target_modules
    if experts and targets == "all-linear":
        targets = _linear_module_names(model)
    parameters = sorted({_in_layer(name) for name in experts}) if lora.target_experts else []
    if parameters and tensor_parallel_size(section) > 1:
        # PEFT 0.21 cannot split a parameter adapter with its layer ("'ParamWrapper' object has no attribute
        # 'weight'", measured on two gloo processes)
        raise NotSupportedHere(
            "lora.target_experts puts adapters on the experts, which distributed.tensor_parallel cannot split with "
            "them: set lora.target_experts to false (adapters on attention), or tensor_parallel to 1 "
            "(expert_parallel alone splits the experts and trains their adapters)"
        )
    dropout = lora.dropout
    if parameters and dropout:
        print(
            f"lora.dropout {dropout} → 0: the adapters on the experts' weights ({', '.join(parameters)}; "
            "lora.target_experts) cannot apply dropout, and one adapter has one dropout",
            flush=True,
        )
        dropout = 0.0
    # The chat template's tokens (`template_token_ids`) must be learnt, or the model never ends a turn: their
    # input-embedding rows train through PEFT's trainable tokens, and an untied LM head trains whole (a copy in the
    # adapter, as Axolotl's lora_modules_to_save): TRL's fused loss reads the head's weight and bias directly, which
    # a modules_to_save copy has and PEFT's token adapter on a head does not. A tied head cannot: PEFT would wrap
    # the shared weights in the token adapter (no bias), and a head copy would be lost on reload (tied again).
    token_rows, head = None, None
    if trained_tokens and model.config.get_text_config().tie_word_embeddings:
        print(
            "lora: the chat template's token rows are not trained (tied embeddings: PEFT's token adapter on the "
            "shared head breaks TRL's fused loss); train the first stage with method 'full' to train them",
            flush=True,
        )
    elif trained_tokens and tensor_parallel_size(section) > 1:
        # PEFT copies the head whole, and the copy of a split one fails (measured, PEFT 0.21)
        raise NotSupportedHere(
            "the chat template's tokens are new to this model: their embedding rows and the whole head train beside "
            "the adapter, which distributed.tensor_parallel does not split; set it to 1 for this stage, or train the "
            "first training stage with method 'full'"
        )
    elif trained_tokens:
        token_rows = {"embed_tokens": trained_tokens}
        output = model.get_output_embeddings()
        head = [name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is output]
        print(
            f"lora: the chat template's tokens train: their embedding rows and the whole head ({head[0]})", flush=True
        )
    saved = sorted(set(head or []) | set(lora.modules_to_save))
    if lora.modules_to_save:
        whole_embedding = _embedding_saved(model, lora.modules_to_save)
        if model.config.get_text_config().tie_word_embeddings and (whole_embedding or _head_saved(model, saved)):
            raise ExplainedFailure(
                f"lora.modules_to_save {lora.modules_to_save} names the embedding or the head of a model whose "
                "embeddings are tied to its head: the trained copy would be lost when the model is loaded tied "
                "again. Train this stage with method 'full', or leave those modules out"
            )
        if whole_embedding:
            token_rows = None  # the whole embedding trains: its template rows with it
        print(f"lora: trained whole beside the adapter: {', '.join(lora.modules_to_save)}", flush=True)
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=dropout,
        target_modules=targets,
        target_parameters=parameters or None,
        trainable_token_indices=token_rows,
        modules_to_save=saved or None,
        task_type="CAUSAL_LM",
    )


def _named_like(model: Any, module: Any, names: list[str]) -> bool:
    """Whether one of `names` matches `module`'s path in `model` as PEFT matches modules_to_save (the whole path,
    or its dotted tail)."""
    path = next((name for name, m in model.named_modules() if m is module), None)
    return path is not None and any(path == name or path.endswith("." + name) for name in names)


def _embedding_saved(model: Any, names: list[str]) -> bool:
    return _named_like(model, model.get_input_embeddings(), names)


def _head_saved(model: Any, names: list[str]) -> bool:
    return _named_like(model, model.get_output_embeddings(), names)


def _linear_module_names(model: Any) -> list[str]:
    """What PEFT's 'all-linear' targets, by module name: every nn.Linear (bitsandbytes' 4-bit layers are ones)
    but the output head."""
    head = model.get_output_embeddings()
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
    )


def prepare_for_kbit_training(model: Any, gradient_checkpointing: bool) -> Any:
    """PEFT's `prepare_model_for_kbit_training` (base frozen, the weights bitsandbytes left in 16 bits cast to
    float32, inputs that require grad for gradient checkpointing), except for a mixture-of-experts model's expert
    weights: those are not quantized either, and PEFT would cast them to float32 too, doubling most of the model
    (Qwen3-30B-A3B: 54 GiB of bf16 experts → 108 GiB). They stay in the dtype they loaded in, frozen: PEFT is
    handed an empty tensor in their place while it casts."""
    from peft import prepare_model_for_kbit_training

    experts = [param for param in expert_parameters(model).values() if not is_quantized(param)]
    kept = [param.data for param in experts]
    for param in experts:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    try:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    finally:
        for param, data in zip(experts, kept, strict=True):
            param.data = data
    return model


def router_aux_loss(model: Any, stage: str, section: TrainingStage) -> dict[str, Any]:
    """Sets a mixture-of-experts model's router load-balancing loss from `training.router_aux_loss_coef` and returns
    the config values it changed (to be put back before the model is saved). None keeps the config's coefficient;
    the model returns its router logits whenever the coefficient is not 0, so the loss the trainer optimises
    includes coefficient × aux loss (the transformers Trainer takes the model's loss; TRL's trainers read the same
    config). A dense model has no router: a coefficient given for it is ignored, with a log line."""
    coef = section.training.router_aux_loss_coef
    config = model.config.get_text_config()
    if not hasattr(config, "output_router_logits"):
        if coef is not None:
            print(
                f"[{stage}] training.router_aux_loss_coef ({coef}) ignored: {type(model).__name__} is not a "
                "mixture-of-experts model",
                flush=True,
            )
        return {}
    loaded = {"output_router_logits": config.output_router_logits, "router_aux_loss_coef": config.router_aux_loss_coef}
    coef = config.router_aux_loss_coef if coef is None else coef
    config.router_aux_loss_coef = coef
    config.output_router_logits = coef != 0  # 0: not even the router logits are gathered
    if hasattr(model, "router_aux_loss_coef"):
        model.router_aux_loss_coef = coef  # the forward reads the copy the model took from its config at init
    print(
        f"[{stage}] router load-balancing loss: {coef} × aux loss"
        if coef
        else f"[{stage}] router load-balancing loss: off"
    )
    return loaded


def load_starting_model(
    run_dir: RunDir, spec: PipelineSpec, stage: str, tokenizer: Any, inputs: ModelInputs | None = None
) -> StartingModel:
    """The model `stage` trains: the base model or the upstream stage's output, with a LoRA adapter (new or
    continued) when the stage's method is lora or qlora. With `inputs` (the stages pass it), each stage model
    folder is fingerprinted and checked before it loads: the upstream output as input `model`, the stage model
    an upstream adapter applies to as `model_base`."""
    from peft import get_peft_model
    from transformers import set_seed

    section: TrainingStage = spec.stage(stage)  # type: ignore[assignment]
    check_method(stage, section)
    # A new adapter's A matrices and new embedding rows (mean_resizing) are random draws: from the spec's seed, every
    # run starts from the same model (the Trainer seeds again for dropout and data order when it is built).
    set_seed(section.training.seed)
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
    # ZeRO-3: the model is created partitioned as it loads, not whole in every process, which needs the DeepSpeed
    # config the Trainer only makes later (`stages.sharded_loading`). Not for full training after a LoRA stage (the
    # adapter merges into whole weights), nor for GRPO's full training (its reference model is read from a copy of
    # the starting weights that `stages.rlhf.point_grpo_at_reference` saves). DPO's and KTO's reference is loaded
    # partitioned too (`stages.rlhf.frozen_reference`).
    zero3 = None
    grpo = stage == "rlhf" and getattr(section, "algorithm", None) == "grpo"
    whole = section.method == "full" and (adapter_dir is not None or grpo)
    if partitions_at_load(section) and not whole:
        zero3 = zero3_loading(stage, section, weights_dtype(spec.model))
    sharded = shards_at_load(section)
    if sharded:  # an upstream adapter merges before the weights are sharded
        merge = adapter_dir if section.method == "full" else None
        model, sharded_save_dtype = load_model_parallel(run_dir, spec, stage, base, tokenizer, merge)
    else:
        model = load_base(run_dir, spec, base, tokenizer, quantization, once=loads_once(section))
        sharded_save_dtype = None
    if quantization is not None and (note := experts_note(model)) is not None:
        print(f"[{stage}] {note}", flush=True)
    loaded_config = router_aux_loss(model, stage, section)
    switch = packed_attention(spec.model, stage, section)
    if switch is not None:
        use_attention(model, switch)

    if section.method == "full":
        # Full training after a LoRA stage merges its adapter first (a skeleton has the merged shape already).
        if adapter_dir is not None and not on_meta(model) and not sharded:
            model = load_adapter(model, adapter_dir).merge_and_unload()
            model.requires_grad_(True)  # PEFT loaded the base frozen; full training trains every weight
        save_dtype = sharded_save_dtype if sharded else float32_masters(model, section)
        if section.training.fp8:
            whole_layers = compiles_decoder_layers(stage, section)
            train_in_float8(model, stage, compile_layers=False if whole_layers else None)
            if whole_layers:
                compile_decoder_layers(model, section.recomputes_activations, section.training.recompute_layers)
        start = StartingModel(
            model=model,
            kind="full",
            base=base,
            upstream=upstream,
            merged_adapter=adapter_dir,
            save_dtype=save_dtype,
            inputs=inputs,
            loaded_config=loaded_config,
            zero3_config=zero3,
        )
    else:
        if quantization is not None:
            model = prepare_for_kbit_training(model, section.training.gradient_checkpointing)
        split = whole_layer_adapters() if tensor_parallel_size(section) > 1 else contextlib.nullcontext()
        with shaped_experts(model), split:  # PEFT sizes adapters on 4-bit experts from their shape
            if adapter_dir is not None:  # continue the upstream adapter (its own r/alpha/targets)
                model = load_adapter(model, adapter_dir, is_trainable=True)
            else:
                model = get_peft_model(model, lora_config(section, model, template_token_ids(spec, tokenizer)))
        if sharded:
            average_split_adapters(model)
        low_rank_experts(model, stage)
        adapter_inputs_uncast(model, stage)
        start = StartingModel(
            model=model,
            kind="adapter",
            base=base,
            upstream=upstream,
            continued_adapter=adapter_dir is not None,
            inputs=inputs,
            loaded_config=loaded_config,
            zero3_config=zero3,
        )
    start.model.config.use_cache = False  # a KV cache in training would hide the packed-document boundaries
    if on_meta(start.model):
        tell_apart(start.model)  # the adapter's parameters too
    return start


def load_stage_model(
    run_dir: RunDir,
    spec: PipelineSpec,
    stage: str,
    tokenizer: Any,
    inputs: ModelInputs | None = None,
    name: str = "model",
    placement: dict[str, Any] | None = None,
) -> Any:
    """A finished stage's model for inference: a full model, or an adapter merged into its base. With `inputs`,
    each stage model folder is fingerprinted and checked before it loads (input `name`, and `<name>_base` for
    the stage model an adapter applies to). `placement` (e.g. a device_map) applies to loaded weights."""
    output = stage_output(run_dir, stage)
    if output.kind == "full":
        if inputs is not None:
            inputs.check(name, output.path)
        return load_pretrained(output.path, spec.model, **(placement or {}))
    if inputs is not None:
        if output.base.kind == "stage":
            inputs.check(f"{name}_base", run_dir.root / output.base.name, adapter_of=stage)
        inputs.check(name, output.path)
    base = load_base(run_dir, spec, output.base, tokenizer, placement=placement)
    return load_adapter(base, output.path).merge_and_unload()


def describe(model: Any) -> dict[str, int]:
    """Parameter counts (all and trainable), for the log and the tracker."""
    total = sum(full_numel(p) for p in model.parameters())
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    return {"parameters": total, "trainable_parameters": trainable}
