"""The typed pipeline spec: what a pipeline YAML file in `workflows/pipelines/` may say.

Every model forbids unknown fields and documents each field, so error messages and `--help`-grade
documentation come from the model itself. Cross-field rules live in validators next to the fields.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from workflows import validation
from workflows.credentials import looks_secret_name
from workflows.model_shapes import AttentionShape, known_shape, tensor_parallel_problem

STAGE_ORDER: tuple[str, ...] = ("prepare", "cpt", "sft", "rlhf", "evaluate", "deploy")
"""The DAG, in order. prepare always runs; the others can be switched off."""

TRAINING_STAGES: tuple[str, ...] = ("cpt", "sft", "rlhf")
"""Stages that train and run as a PyTorchJob."""

OPTIONAL_STAGES: tuple[str, ...] = ("cpt", "sft", "rlhf", "evaluate", "deploy")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class StrictModel(BaseModel):
    """Base for every spec model: unknown fields are errors, numbers are finite (no .inf or .nan), values are
    re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False)


class FieldError(ValueError):
    """A rule across fields that one field breaks: `loc` (relative to the model whose validator raises it) names
    that field, so the error points at its file and line."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def _check(problem: str | None, prefix: str = "") -> None:
    """Raise a validation error for a problem a `workflows.validation` rule found."""
    if problem:
        raise ValueError(prefix + problem)


def _obeys(rule: Callable[[Any], str | None]) -> AfterValidator:
    """A validator for an annotated type: the value must pass a `workflows.validation` rule."""

    def check(value: Any) -> Any:
        _check(rule(value))
        return value

    return AfterValidator(check)


Labels = Annotated[dict[str, str], _obeys(validation.labels)]
"""Label keys and values as the API server accepts them (labels, node selectors)."""
Annotations = Annotated[dict[str, str], _obeys(validation.annotations)]
"""Annotation keys, and their total size."""
KubernetesName = Annotated[str, _obeys(validation.dns_subdomain)]
"""The name of a Kubernetes object (a DNS-1123 subdomain)."""
ImageReference = Annotated[str, _obeys(validation.image_reference)]
"""A container image: [registry[:port]/]repository[:tag][@digest]."""
OneLine = Annotated[str, _obeys(validation.one_line)]
"""A name, path or URI: no control characters, so it cannot forge a line where a message or a log prints it."""


def _dns_label(value: str, what: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise ValueError(f"{what} must be a DNS-1123 label (lowercase letters, digits, '-'; at most 63), got {value!r}")
    return value


Quantity = Annotated[
    str,
    Field(pattern=_QUANTITY.pattern, description="A Kubernetes quantity, e.g. '8', '500m', '64Gi'."),
]


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1
"""numpy's seeds are unsigned 32-bit integers (transformers seeds it with the same value)."""
MAX_DURATION_SECONDS = 10 * 365 * 24 * 3600
"""The longest any duration field may be (ten years): Argo and Go hold durations in nanoseconds in an int64
(about 292 years), and the workflow's deadline adds the stages' up, retries included."""


class IntegerRange:
    """An after-validator: the integer lies in [low, high] (`what` says why in the error). A validator rather than
    ge/le, which a field's own ge/le would replace instead of tightening."""

    def __init__(self, low: int, high: int, what: str) -> None:
        self.low, self.high, self.what = low, high, what

    def __call__(self, value: int) -> int:
        if not self.low <= value <= self.high:
            raise ValueError(f"{value} is outside {self.low}..{self.high}, {self.what}")
        return value


Int32 = Annotated[
    int, AfterValidator(IntegerRange(-(2**31), INT32_MAX, "the range of an int32, as the cluster reads it"))
]
"""An integer the cluster reads as int32 (replica and trial counts, history limits, Argo's and the operator's TTLs,
backoff limits)."""
Int64 = Annotated[int, AfterValidator(IntegerRange(-(2**63), INT64_MAX, "the range of a 64-bit integer"))]
"""Any other integer: the API server, Argo, JSON readers and torch hold at most 64 bits."""
Seconds = Annotated[
    int, AfterValidator(IntegerRange(0, MAX_DURATION_SECONDS, "at most ten years (Go durations add them up)"))
]
"""A duration in whole seconds (deadlines, grace periods, timeouts): at most MAX_DURATION_SECONDS."""
Seed = Annotated[int, AfterValidator(IntegerRange(0, SEED_MAX, "the range of numpy's seeds"))]
"""A random seed (numpy's range)."""


def out_of_int64(node: Any) -> tuple[tuple[str | int, ...], int] | None:
    """The path and value of the first integer in a document that does not fit in 64 bits, or None. Typed fields
    have tighter bounds; this covers the free-form sections too (affinity, deepspeed_config, extra_args), whose
    readers (the API server, Go, JSON decoders) hold no more."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(node, ())]
    while stack:
        value, where = stack.pop()
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value <= INT64_MAX:
            return where, value
        if isinstance(value, dict):
            stack.extend((v, (*where, k)) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, (*where, i)) for i, v in reversed(list(enumerate(value))))
    return None


CronExpression = Annotated[
    str,
    _obeys(validation.cron_expression),
    Field(description="Five fields (minute hour day-of-month month day-of-week) or @daily, @weekly, @every 6h..."),
]


# --------------------------------------------------------------------------- model


KNOWN_CHAT_TEMPLATES = ("chatml", "qwen2_5", "qwen3", "llama3", "gemma3", "exaone4", "mistral")
"""Template names model.chat_template accepts (stages/chat.py holds them)."""


MOE_ARCHITECTURES = ("qwen3_moe",)
"""The `model.from_config.architecture` values that build a mixture-of-experts model."""

_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


class TinyModelConfig(StrictModel):
    """A randomly initialised model built from a config, for runs that cannot download weights."""

    architecture: Literal["qwen2", "qwen3", "qwen3_moe", "llama", "gemma3", "exaone4", "mistral"] = Field(
        "qwen3",
        description="Model family whose transformers config class is used: qwen2 (Qwen2.5), qwen3, qwen3_moe "
        "(mixture of experts), llama, gemma3 (text-only, Gemma3ForCausalLM), exaone4, mistral. The family's own "
        "settings come with it (gemma3 and exaone4 interleave sliding-window layers with full-attention ones, the "
        "last layer full; their window is a quarter of max_position_embeddings).",
    )
    hidden_size: Int64 = Field(64, gt=0, description="Hidden size.")
    intermediate_size: Int64 = Field(128, gt=0, description="MLP intermediate size.")
    num_hidden_layers: Int64 = Field(2, gt=0, description="Number of decoder layers.")
    num_attention_heads: Int64 = Field(4, gt=0, description="Attention heads.")
    num_key_value_heads: Int64 = Field(2, gt=0, description="Key/value heads (grouped-query attention).")
    head_dim: Int64 = Field(16, gt=0, description="Per-head dimension.")
    max_position_embeddings: Int64 = Field(2048, gt=0, description="Longest position the model supports.")
    num_experts: Int64 | None = Field(
        None, gt=0, description="qwen3_moe only: experts in each mixture-of-experts layer. None: 8."
    )
    num_experts_per_tok: Int64 | None = Field(
        None, gt=0, description="qwen3_moe only: experts each token is routed to (top-k), at most num_experts. None: 2."
    )
    moe_intermediate_size: Int64 | None = Field(
        None, gt=0, description="qwen3_moe only: each expert's MLP intermediate size. None: intermediate_size."
    )
    vocab_size: Int64 = Field(2048, ge=256, description="Size of the byte-level BPE vocabulary trained on the corpus.")
    seed: Seed = Field(0, description="Seed for the random initialisation.")

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldError(
                ("num_key_value_heads",),
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads}): each key/value head serves a whole group of query heads",
            )
        return self

    @model_validator(mode="after")
    def _experts(self) -> TinyModelConfig:
        if self.architecture not in MOE_ARCHITECTURES:
            for name in _MOE_FIELDS:
                if getattr(self, name) is not None:
                    raise FieldError(
                        (name,),
                        f"{name} sizes a mixture-of-experts model ({', '.join(MOE_ARCHITECTURES)}); architecture "
                        f"{self.architecture!r} is dense: remove {name}, or pick a mixture-of-experts architecture",
                    )
            return self
        experts, per_token, _ = self.moe_sizes() or (0, 0, 0)
        if per_token > experts:
            raise FieldError(
                ("num_experts_per_tok",),
                f"num_experts_per_tok ({per_token}) is more than num_experts ({experts}): each token is routed "
                "to that many distinct experts",
            )
        return self

    def attention(self) -> AttentionShape:
        """The attention shape this config builds."""
        return AttentionShape(self.num_attention_heads, self.num_key_value_heads)

    def moe_sizes(self) -> tuple[int, int, int] | None:
        """(num_experts, num_experts_per_tok, moe_intermediate_size) with their defaults filled in; None for a
        dense architecture."""
        if self.architecture not in MOE_ARCHITECTURES:
            return None
        return (
            self.num_experts if self.num_experts is not None else 8,
            self.num_experts_per_tok if self.num_experts_per_tok is not None else 2,
            self.moe_intermediate_size if self.moe_intermediate_size is not None else self.intermediate_size,
        )


class ModelSpec(StrictModel):
    """The base model every stage starts from."""

    name_or_path: OneLine = Field(
        description="Hugging Face hub id (e.g. 'Qwen/Qwen3-8B-Base') or a local/PVC path to a model directory.",
        min_length=1,
    )
    revision: OneLine | None = Field(None, description="Hub revision (branch, tag or commit) to pin; None is 'main'.")
    trust_remote_code: bool = Field(
        False,
        description="Allow model code from the hub to run. Off by default; turn on only for models you trust.",
    )
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = Field(
        "bfloat16", description="Dtype the weights are loaded in on GPU (CPU runs always use float32)."
    )
    attn_implementation: Literal["sdpa", "flash_attention_2", "flex_attention", "eager"] | None = Field(
        None,
        description="Attention kernel; None picks the fastest one that honours packed-document boundaries.",
    )
    from_config: TinyModelConfig | None = Field(
        None,
        description="Build a randomly initialised model from this config instead of loading weights "
        "(used by the offline 'local' profile). name_or_path then only names the run.",
    )
    chat_template: str | None = Field(
        None,
        description="The chat template conversations are rendered with, for a model without one (a *-Base model, "
        f"a CPT output) or to replace its own: a known name ({', '.join(KNOWN_CHAT_TEMPLATES)}), whose special "
        "tokens are added to the tokenizer (the embeddings grow to hold them, and are trained and saved), or the "
        "path of a Jinja file (a template with {% generation %} tags decides the trained tokens itself). None "
        "keeps the model's own template (a model built from config: its family's).",
    )

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        if value is not None and value not in KNOWN_CHAT_TEMPLATES and not re.search(r"[/\\]|\.jinja2?$", value):
            raise ValueError(
                f"{value!r} is neither a known chat template ({', '.join(KNOWN_CHAT_TEMPLATES)}) nor the path of "
                "a Jinja file"
            )
        return value


# --------------------------------------------------------------------------- data

DataFormat = Literal["text", "messages", "alpaca", "sharegpt", "preference"]

FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "messages": ("messages", "role", "content"),
    "alpaca": ("instruction", "input", "output", "system", "history"),
    "sharegpt": ("conversations", "system", "from", "value"),
    "preference": ("prompt", "chosen", "rejected", "system"),
}
"""The names `data.columns` may map, per format: the row's columns, and the keys inside each message."""

MESSAGE_KEYS = frozenset({"role", "content", "from", "value"})
"""The keys of FORMAT_COLUMNS that name a key inside each message, not a column of the row."""

ROLE_NAMES = ("user", "assistant", "system")
"""The canonical roles `data.roles` maps to the tags a dataset uses."""

FORMATS_WITH_ROLES = ("messages", "sharegpt")
"""The formats whose messages carry a role tag (`data.roles` applies to them only)."""


class CleaningSpec(StrictModel):
    """What prepare removes from a dataset, judged on each row's text (stages/cleaning.py says which text)."""

    unicode_nfc: bool = Field(
        True,
        description="NFC-normalize every string of every row: Korean exported by macOS tools comes decomposed "
        "(NFD, each syllable as jamo), which tokenizes into different, longer tokens than the same text composed.",
    )
    dedup: bool = Field(
        True,
        description="Drop rows whose text repeats one kept before, across all files of the stage, comparing the "
        "text NFC-normalized, casefolded, with whitespace runs collapsed.",
    )
    near_dedup_threshold: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Drop rows whose estimated Jaccard similarity to a row kept before reaches this (e.g. 0.8), "
        "by MinHash LSH over 4-character shingles of the text without spaces and punctuation (robust to Korean "
        "spacing variants). None: no near-duplicate removal.",
    )
    near_dedup_num_perm: Int64 = Field(
        128,
        ge=16,
        le=1024,
        description="MinHash permutations for near_dedup_threshold: more estimate the similarity better and cost "
        "proportionally more time and memory.",
    )
    min_chars: Int64 = Field(0, ge=0, description="Drop rows whose text has fewer characters (after NFC).")
    max_chars: Int64 | None = Field(
        None, gt=0, description="Drop rows whose text has more characters (after NFC); None: no limit."
    )
    min_hangul_ratio: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Drop rows whose Hangul share of letters is below this: Hangul syllables and jamo over all "
        "letters (Hangul, Latin, Hanja...; digits, punctuation, symbols and spaces do not count). Above 0, a row "
        "without letters is dropped too; 0 turns the check off.",
    )
    decontaminate: bool = Field(
        True,
        description="Drop rows that contain evaluation text: the documents (questions, answers, choices) of "
        "stages.evaluate.lm_eval_tasks (not applied to stages.evaluate.data, itself evaluation data). A row is "
        "contaminated when its words equal an evaluation text's, or when it shares decontamination_ngram "
        "consecutive words with one (case and punctuation ignored).",
    )
    decontamination_ngram: Int64 = Field(
        13,
        ge=3,
        le=100,
        description="Words in a row for decontaminate: a run this long shared with an evaluation text drops the "
        "row; evaluation texts shorter than this match only a row equal to them. 13 follows GPT-3 and lm-eval's "
        "decontamination; Korean words (eojeol) include their particles and endings, so the same overlap is fewer "
        "words in Korean.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> CleaningSpec:
        if self.max_chars is not None and self.max_chars <= self.min_chars:
            raise FieldError(
                ("max_chars",),
                f"max_chars ({self.max_chars}) must be greater than min_chars ({self.min_chars}), or no row is kept",
            )
        return self


class DataSpec(StrictModel):
    """One dataset a stage reads."""

    uri: OneLine = Field(
        description="Where the data is: a JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet file, a folder of them "
        "(read at every level, in sorted order), or a glob ('*' and '?' within a folder, '**' across folders), on a "
        "mounted volume (a path, 'file://', 'pvc://<claim>/<path>'), in S3 or an S3-compatible store "
        "('s3://bucket/<key, prefix or glob>'; keys and endpoint from cluster.secrets, or IRSA), or in GCS "
        "('gs://bucket/<name, prefix or glob>'; Workload Identity); 'hf://datasets/org/name' for a hub dataset, or "
        "'builtin:<name>' for the data generated offline by the project. '{data_version}' is replaced by the "
        "pipeline's data_version.",
        min_length=1,
    )
    format: DataFormat = Field(
        description="Row format: text ({'text'}), messages (OpenAI chat), alpaca (instruction/input/output), "
        "sharegpt (conversations/from/value), preference (prompt/chosen/rejected)."
    )
    split: str = Field("train", description="Split to read for hub datasets.")
    text_field: str = Field(
        "text", min_length=1, description="Field holding the text for the 'text' format (the same as columns.text)."
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Where the format's fields are in the dataset: the format's name → the dataset's column (or "
        "message key), as LLaMA-Factory's dataset_info 'columns'. text: text; alpaca: instruction, input, output, "
        "system, history (earlier [instruction, response] pairs); sharegpt: conversations, system, and the message "
        "keys from, value; messages: messages, and the message keys role, content; preference: prompt, chosen, "
        "rejected, system. E.g. {input: context, output: response} reads databricks-dolly-15k as alpaca. Names not "
        "given keep the format's own.",
    )
    roles: dict[str, str] = Field(
        default_factory=dict,
        description="The role tags the messages use (sharegpt and messages only): user, assistant or system → the "
        "dataset's tag, as LLaMA-Factory's user_tag/assistant_tag/system_tag, e.g. {user: human, assistant: gpt}. "
        "A role given here accepts only its tag; one not given accepts the defaults (sharegpt: human or user, gpt "
        "or assistant, system; messages: the role's own name).",
    )
    max_samples: Int64 | None = Field(None, gt=0, description="Use at most this many rows (after validation).")
    eval_fraction: float = Field(
        0.02, ge=0.0, lt=0.5, description="Fraction of rows held out for evaluation (perplexity, eval loss)."
    )
    max_bad_row_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of rows that may fail validation; they are quarantined and counted, never "
        "silently dropped. 0 makes any bad row an error.",
    )
    encoding: Literal["utf-8", "cp949", "euc-kr"] = Field(
        "utf-8",
        description="Byte encoding of JSONL files. cp949 (or its subset euc-kr) reads Korean exports of legacy "
        "Windows tools as they are, without converting them first; Parquet and hub datasets are unaffected.",
    )
    cleaning: CleaningSpec = Field(
        default_factory=CleaningSpec,
        description="Normalization, filters, deduplication and decontamination of the rows read, judged on a row's "
        "text: a text row's text, a chat row's message contents, a preference row's prompt and chosen answer.",
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme = uri.split(":", 1)[0] if re.match(r"^[a-z][a-z0-9+.-]*:", uri) else ""
        if scheme and scheme not in {"hf", "builtin", "file", "pvc", "gs", "s3"}:
            raise ValueError(f"unsupported URI scheme {scheme!r}; use a path, hf://, builtin:, gs:// or s3://")
        return uri

    @model_validator(mode="after")
    def _mapping(self) -> DataSpec:
        known = FORMAT_COLUMNS[self.format]
        for key, column in self.columns.items():
            if key not in known:
                raise FieldError(
                    ("columns", key),
                    f"format {self.format!r} has no column {key!r}; it has {', '.join(known)}",
                )
            if not column:
                raise FieldError(("columns", key), "an empty column name")
        if "text" in self.columns and self.text_field not in ("text", self.columns["text"]):
            raise FieldError(
                ("columns", "text"),
                f"columns.text ({self.columns['text']!r}) and text_field ({self.text_field!r}) both name the text "
                "column; set one of them",
            )
        # Two names read from one column (or message key) is a mapping mistake, never a way to copy a value.
        for group in ([k for k in known if k not in MESSAGE_KEYS], [k for k in known if k in MESSAGE_KEYS]):
            seen: dict[str, str] = {}
            for key in group:
                column = self.columns.get(key, key)
                if column in seen:
                    first = seen[column]
                    names = [f"columns.{k}" if k in self.columns else f"{k} (not mapped)" for k in (first, key)]
                    raise FieldError(
                        ("columns", key if key in self.columns else first),
                        f"{names[0]} and {names[1]} both read {column!r}; map each to its own column",
                    )
                seen[column] = key
        if self.roles and self.format not in FORMATS_WITH_ROLES:
            raise FieldError(
                ("roles",),
                f"format {self.format!r} has no role tags; roles applies to {' and '.join(FORMATS_WITH_ROLES)}",
            )
        tags: dict[str, str] = {}
        for role, tag in self.roles.items():
            if role not in ROLE_NAMES:
                raise FieldError(("roles", role), f"{role!r} is not a role; roles maps {', '.join(ROLE_NAMES)}")
            if not tag:
                raise FieldError(("roles", role), "an empty role tag")
            if tag in tags:
                raise FieldError(("roles", role), f"roles.{role} and roles.{tags[tag]} are both {tag!r}")
            tags[tag] = role
        return self


# --------------------------------------------------------------------------- training


class LoraSpec(StrictModel):
    """LoRA adapter settings (used when method is lora or qlora)."""

    r: Int64 = Field(16, gt=0, description="Adapter rank.")
    alpha: Int64 = Field(32, gt=0, description="Scaling numerator (lora_alpha).")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter input. 0 by default (PEFT's, LLaMA-Factory's and Unsloth's default too): "
        "dropout keeps a mask of every LoRA layer's input for the backward pass, which cost 19 GiB and 4% of the "
        "speed of a LoRA step of an 8B model at 2 rows of 4096 (docs/performance.md, B2 on an H100).",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules that get adapters: 'all-linear' or a list of module names."
    )
    target_experts: bool = Field(
        True,
        description="On a mixture-of-experts model, also put adapters on the experts' weights (one rank-r adapter "
        "per expert on each stacked expert matrix, e.g. qwen3_moe's mlp.experts.gate_up_proj and down_proj, "
        "through PEFT target_parameters): transformers keeps them as 3-D parameters, which target_modules never "
        "reaches. PEFT applies no dropout to such adapters, so dropout is then 0 for the whole adapter. Off: "
        "adapters on target_modules only (the attention projections, and any dense MLP layers). The router "
        "(mlp.gate) stays frozen either way: it keeps the base model's routing. Ignored on dense models.",
    )
    merge_after: bool = Field(
        False,
        description="Merge the adapter into the base weights when the stage ends, so the next stage "
        "starts from a full model; otherwise the next stage continues the same adapter.",
    )


TRAINER_ARGS_OWNED: dict[str, str] = {
    "output_dir": "the run directory (the stage's checkpoints folder)",
    "per_device_train_batch_size": "training.per_device_batch_size",
    "per_device_eval_batch_size": "training.per_device_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "learning_rate": "training.learning_rate",
    "num_train_epochs": "training.epochs",
    "max_steps": "training.max_steps",
    "warmup_steps": "training.warmup_ratio",
    "warmup_ratio": "training.warmup_ratio",
    "lr_scheduler_type": "training.lr_scheduler",
    "weight_decay": "training.weight_decay",
    "max_grad_norm": "training.max_grad_norm",
    "seed": "training.seed",
    "data_seed": "training.seed",
    "logging_steps": "training.logging_steps",
    "save_strategy": "training.save_steps",
    "save_steps": "training.save_steps",
    "save_total_limit": "training.save_total_limit",
    "eval_strategy": "training.eval_steps",
    "eval_steps": "training.eval_steps",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "activation_checkpointing": "training.gradient_checkpointing or distributed.activation_checkpointing",
    "max_length": "training.max_seq_length",
    "max_seq_length": "training.max_seq_length",
    "max_completion_length": "training.max_seq_length",
    "packing": "training.packing",
    "bf16": "model.dtype (mixed precision follows the weights' dtype)",
    "fp16": "model.dtype (mixed precision follows the weights' dtype)",
    "use_cpu": "the stage's resources (it trains on CPU only where there is no GPU)",
    "fsdp": "distributed.strategy",
    "fsdp_config": "distributed.strategy",
    "deepspeed": "distributed.strategy or distributed.deepspeed_config",
    "ddp_backend": "distributed.strategy",
    "report_to": "tracking (the stage's tracker reports to MLflow, W&B and TensorBoard)",
    "resume_from_checkpoint": "nothing: the stage resumes from its newest valid checkpoint itself",
    "trust_remote_code": "model.trust_remote_code",
    "beta": "stages.rlhf.beta",
    "num_generations": "stages.rlhf.num_generations",
    "precompute_ref_log_probs": "stages.rlhf.precompute_ref_log_probs",
    "reward_weights": "stages.rlhf.reward_functions",
    "assistant_only_loss": "stages.sft.assistant_only_loss",
    "logging_dir": "the run directory (the stage's logs folder)",
    "accelerator_config": "distributed.accelerate_config (embedded in the spec, not a path read in the pod)",
    "chat_template_path": "model.chat_template",
}
"""Trainer config fields that a spec field sets (training.extra_args may not): the field → the spec field to use."""

_HUB_UPLOAD = (
    "the trainer would upload the model to the Hugging Face Hub with the pods' token at every save, before "
    "evaluate's gate: a run publishes only through the deploy stage, after the gate"
)
TRAINER_ARGS_REFUSED: dict[str, str] = {
    "push_to_hub": _HUB_UPLOAD,
    "push_to_hub_": _HUB_UPLOAD,
    "hub_": _HUB_UPLOAD,
    "trackio_": "the trainer would send metrics to a Trackio Space with the pods' token: the tracking section "
    "decides where runs are tracked",
    "log_completions_hub_repo": "GRPO would upload its completions to that Hugging Face Hub dataset with the pods' "
    "token",
    "vllm_server_base_url": "GRPO would send its prompts and the policy's weights to that server",
    "vllm_server_host": "GRPO would send its prompts and the policy's weights to that server",
    "model_init_kwargs": "they reach from_pretrained (remote code, another revision or repository): the model "
    "section decides how the model loads",
}
"""Trainer config fields that send data out of the cluster or run code: training.extra_args may not set them,
in the pipeline file either. An entry ending in `_` is a prefix (every `hub_*` field); any other also covers the
names ending in `_<entry>` (`ref_model_init_kwargs`, `teacher_model_init_kwargs`)."""

FORM_EXTRA_ARGS: tuple[str, ...] = (
    # the optimizer and the schedule's shape
    "optim", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_kwargs",
    # regularisation
    "label_smoothing_factor", "neftune_noise_alpha", "average_tokens_across_devices",
    # memory and speed
    "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "activation_offloading",
    "torch_empty_cache_steps", "torch_compile", "torch_compile_mode", "ddp_timeout",
    # TRL's preference losses (DPO, KTO, ORPO)
    "loss_type", "label_smoothing", "use_weighting", "ld_alpha", "discopop_tau", "f_divergence_type",
    "f_alpha_divergence_coef", "ref_model_mixup_alpha", "ref_model_sync_steps", "sync_ref_model", "disable_dropout",
    "desirable_weight", "undesirable_weight",
    # GRPO's sampling and clipping
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "epsilon", "epsilon_high", "delta",
    "scale_rewards", "num_iterations", "steps_per_generation", "mask_truncated_completions",
    "importance_sampling_level", "top_entropy_quantile",
)  # fmt: skip
"""The training.extra_args a run's form (`submit --set`, the Argo UI's overrides) may add, change or remove:
hyperparameters of the optimizer and the losses. Every other key is the pipeline file's (workflows/parameters.py)."""


def refused_trainer_arg(key: str) -> str | None:
    """Why training.extra_args may not set `key` anywhere (TRAINER_ARGS_REFUSED); None when it may."""
    for name, why in TRAINER_ARGS_REFUSED.items():
        if key.startswith(name) if name.endswith("_") else key == name or key.endswith(f"_{name}"):
            return why
    return None


class TrainingSpec(StrictModel):
    """Hyperparameters of a training stage."""

    learning_rate: float = Field(2e-5, gt=0, lt=1, description="Peak learning rate.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: Int64 | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    per_device_batch_size: Int64 = Field(1, gt=0, description="Micro-batch size per GPU (rows of max_seq_length).")
    gradient_accumulation_steps: Int64 = Field(1, gt=0, description="Micro-batches per optimizer step.")
    max_seq_length: Int64 = Field(4096, ge=16, description="Tokens per packed row / truncation length.")
    packing: bool = Field(True, description="Pack documents into full rows, with attention kept inside documents.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps spent warming up.")
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(True, description="Recompute activations to save memory (GPU only).")
    pure_bf16: bool = Field(
        False,
        description="Full fine-tuning on GPU with DDP or one process: keep the weights and optimizer state in "
        "model.dtype instead of float32 master weights with bf16 compute. Faster and about half the memory, but an "
        "update smaller than half a bf16 step of its weight (about 0.4% of it) is lost, which at fine-tuning "
        "learning rates is most of them. FSDP and DeepSpeed always keep float32 master weights.",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Mixture-of-experts models: weight of the router's load-balancing loss added to the training "
        "loss (the model returns its router logits for it). None: the model config's own coefficient (Qwen3-MoE: "
        "0.001); 0: no auxiliary loss. Ignored, with a log line, on dense models.",
    )
    seed: Seed = Field(42, description="Seed for data order and initialisation.")
    logging_steps: Int64 = Field(10, gt=0, description="Log metrics every this many steps.")
    save_steps: Int64 = Field(200, gt=0, description="Write a checkpoint every this many steps.")
    save_total_limit: Int64 = Field(3, ge=2, description="Checkpoints kept; at least 2 so a torn one has a fallback.")
    eval_steps: Int64 | None = Field(None, gt=0, description="Evaluate held-out loss every this many steps.")
    extra_args: dict[str, str | Int64 | float | bool | None] = Field(
        default_factory=dict,
        description="More settings for the trainer's config, passed through as they are: fields of transformers' "
        "TrainingArguments, or of TRL's SFTConfig / DPOConfig / GRPOConfig... for the stage's trainer, e.g. "
        "{optim: adamw_torch_fused, adam_beta2: 0.95, neftune_noise_alpha: 5}. Scalars only; the stage refuses a "
        "name its config class does not have. Settings the spec owns (learning_rate, bf16, deepspeed...) are "
        "refused here: set their spec field. So are settings that send data out of the cluster or run code: the "
        "Hugging Face Hub upload (push_to_hub, hub_*: the deploy stage publishes, after the gate), trackio_*, "
        "log_completions_hub_repo, vllm_server_base_url, vllm_server_host and *model_init_kwargs. With DeepSpeed "
        "offloading the optimizer (and no 'optimizer' section in its config), optimizer settings here (optim, "
        "optim_args, adam_beta1, adam_beta2, adam_epsilon) make the trainer's own optimizer run on the CPU; without "
        "them DeepSpeed's faster CPU Adam runs, with the learning rate and weight decay only. A run's form (submit "
        "--set, the Argo UI) may add, change or remove only these keys, every other one is the pipeline file's: "
        f"{', '.join(FORM_EXTRA_ARGS)}.",
    )

    @field_validator("extra_args")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        # FieldError names the key, so the error points at its own line (a file's, or the form's override).
        for key in value:
            if key in TRAINER_ARGS_OWNED:
                raise FieldError((key,), f"extra_args.{key} is set by the spec: use {TRAINER_ARGS_OWNED[key]} instead")
            if (why := refused_trainer_arg(key)) is not None:
                raise FieldError((key,), f"extra_args.{key} is refused: {why}")
        return value


class DistributedSpec(StrictModel):
    """How the stage spreads over GPUs under torchrun."""

    strategy: Literal["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"] = Field(
        "ddp", description="Data-parallel engine: DDP, FSDP2, or DeepSpeed ZeRO stage 2/3."
    )
    cpu_offload: bool = Field(False, description="Offload optimizer state (and parameters for ZeRO-3/FSDP) to CPU.")
    activation_checkpointing: bool = Field(
        False, description="FSDP activation checkpointing (in addition to gradient_checkpointing)."
    )
    deepspeed_config: dict[str, Any] | str | None = Field(
        None,
        description="Your own DeepSpeed config instead of the generated one (strategy deepspeed_zero2/3, the same "
        "ZeRO stage): a path to its JSON file, relative to the pipeline file (to the current directory in --set), "
        "read when the pipeline is loaded and embedded into the spec, so the pods get it with the spec. 'auto' "
        "values are filled in from the trainer's arguments as usual. The stage saves its model whole: ZeRO-3 always "
        "gathers the 16-bit weights on save (stage3_gather_16bit_weights_on_model_save).",
    )

    accelerate_config: dict[str, Any] | str | None = Field(
        None,
        description="Your own accelerate config (the YAML `accelerate config` writes): a path, read and embedded "
        "as deepspeed_config is. Its distributed_type must agree with strategy (DEEPSPEED: deepspeed_zero<zero_stage>, "
        "FSDP: fsdp, MULTI_GPU or NO: ddp); its deepspeed_config (zero_stage, offload_*_device, gradient_clipping, "
        "which also sets the trainer's max_grad_norm) or fsdp_config (fsdp_* keys) settings are passed to the "
        "trainer, except what would leave the stage's model folder without weights: fsdp_state_dict_type (the stage "
        "saves full state dicts) and zero3_save_16bit_model (ZeRO-3 always gathers the weights on save). The process "
        "counts (num_processes, num_machines, ...) come from the stage's resources and are ignored.",
    )

    @field_validator("deepspeed_config", "accelerate_config")
    @classmethod
    def _embedded(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if isinstance(value, str):
            raise ValueError(
                "a config file is read when the pipeline file is loaded (python -m workflows.submit); "
                "here it must be the config itself, a mapping"
            )
        return value

    @model_validator(mode="after")
    def _accelerate_matches(self) -> DistributedSpec:
        if self.accelerate_config is None:
            return self
        if self.deepspeed_config is not None:
            raise FieldError(("accelerate_config",), "give deepspeed_config or accelerate_config, not both")
        kind = str(self.accelerate_config.get("distributed_type", "NO"))
        deepspeed = self.accelerate_config.get("deepspeed_config") or {}
        expected = {
            "DEEPSPEED": f"deepspeed_zero{deepspeed.get('zero_stage', 2) if isinstance(deepspeed, dict) else 2}",
            "FSDP": "fsdp",
            "MULTI_GPU": "ddp",
            "NO": "ddp",
        }.get(kind)
        if expected is None:
            raise FieldError(
                ("accelerate_config",),
                f"distributed_type {kind!r} is not supported here (DEEPSPEED, FSDP, MULTI_GPU or NO)",
            )
        if isinstance(deepspeed, dict) and deepspeed.get("deepspeed_config_file"):
            raise FieldError(
                ("accelerate_config",),
                "its deepspeed_config.deepspeed_config_file is not read from here: give that file as "
                "distributed.deepspeed_config instead",
            )
        if self.strategy != expected:
            raise FieldError(
                ("strategy",),
                f"the accelerate config's distributed_type {kind} needs strategy {expected!r}, not {self.strategy!r}",
            )
        return self

    @model_validator(mode="after")
    def _deepspeed_matches(self) -> DistributedSpec:
        if self.deepspeed_config is None:
            return self
        if not self.strategy.startswith("deepspeed"):
            raise FieldError(
                ("deepspeed_config",),
                f"a DeepSpeed config goes with strategy deepspeed_zero2 or deepspeed_zero3, not {self.strategy!r}",
            )
        zero = self.deepspeed_config.get("zero_optimization") or {}
        stage = zero.get("stage") if isinstance(zero, dict) else None
        expected = 3 if self.strategy == "deepspeed_zero3" else 2
        if stage is not None and stage != expected:
            raise FieldError(
                ("deepspeed_config",),
                f"the DeepSpeed config's zero_optimization.stage is {stage!r} but strategy is {self.strategy!r}: "
                f"make them agree (strategy deepspeed_zero{stage} or stage {expected})",
            )
        return self


# --------------------------------------------------------------------------- kubernetes


class Toleration(StrictModel):
    """A Kubernetes toleration."""

    key: str | None = Field(None, description="Taint key; None with operator Exists matches every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal or Exists.")
    value: str | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; None tolerates all effects."
    )
    toleration_seconds: Int64 | None = Field(
        None, alias="tolerationSeconds", description="For NoExecute: how long the pod stays bound."
    )

    @model_validator(mode="after")
    def _coherent(self) -> Toleration:
        # The API server's rules for a Toleration (k8s.io/kubernetes validation).
        if self.key is not None:
            _check(validation.qualified_name(self.key), "toleration ")
        elif self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists (it then tolerates every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"a toleration with operator Exists takes no value, got {self.value!r}")
        if self.value:
            _check(validation.label_value(self.value), "toleration ")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds only applies to effect NoExecute")
        return self

    def to_k8s(self) -> dict[str, Any]:
        """This toleration as a core/v1 Toleration object."""
        return self.model_dump(by_alias=True, exclude_none=True)


MAX_NODES = 512
"""The most pods one training stage may have."""


class RdmaSpec(StrictModel):
    """RDMA network devices (InfiniBand or RoCE) for NCCL between a training stage's nodes; without them NCCL
    runs over TCP sockets. Needs the cluster's RDMA device plugin, and a namespace whose Pod Security admits the
    IPC_LOCK capability that RDMA needs to pin memory (`privileged`: neither `restricted` nor `baseline` allows
    it; README, "Fast networking")."""

    resource: str = Field(
        description="The device plugin's extended resource, e.g. 'rdma/rdma_shared_device_a' (the RDMA shared "
        "device plugin) or 'nvidia.com/hostdev' (the NVIDIA Network Operator's SR-IOV devices)."
    )
    count: Int64 = Field(1, ge=1, le=16, description="Devices per pod (a limit of that resource).")
    nccl_ib_hca: str | None = Field(
        None,
        description="NCCL_IB_HCA: the adapters NCCL uses, e.g. 'mlx5' or '=mlx5_0,mlx5_1'; None lets NCCL choose.",
    )
    nccl_socket_ifname: str | None = Field(
        None,
        description="NCCL_SOCKET_IFNAME: the interface of NCCL's bootstrap, e.g. 'eth0'; None lets NCCL choose.",
    )

    @field_validator("resource")
    @classmethod
    def _extended_resource(cls, name: str) -> str:
        _check(validation.qualified_name(name), "rdma.resource: ")
        prefix = name.rpartition("/")[0]
        if not prefix or prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io") or name == "nvidia.com/gpu":
            raise ValueError(
                f"rdma.resource {name!r} is not a device plugin's resource: it is 'domain/name', e.g. "
                "'rdma/rdma_shared_device_a' or 'nvidia.com/hostdev' (GPUs are gpus_per_node)"
            )
        return name


class Resources(StrictModel):
    """What one stage's pods ask the cluster for."""

    nodes: Int64 = Field(1, ge=1, le=MAX_NODES, description="Nodes (pods) in the job: one Master plus nodes-1 Workers.")
    gpus_per_node: Int64 = Field(0, ge=0, le=16, description="GPUs per pod (nvidia.com/gpu); also torchrun's nproc.")
    rdma: RdmaSpec | None = Field(
        None,
        description="Training stages: RDMA devices per pod for NCCL between nodes (InfiniBand or RoCE), the "
        "IPC_LOCK capability they need, and NCCL's IB settings. None: NCCL over TCP.",
    )
    cpu: Quantity | None = Field(
        None,
        description="CPU request and limit per pod. None: derived from the stage (training: 8 per GPU, evaluate "
        "and deploy: 4 per GPU, at least 4; prepare: 4).",
    )
    memory: Quantity | None = Field(
        None,
        description="Memory request and limit per pod, /dev/shm included. None: derived from the model's size "
        "(its weights in model.dtype: once per GPU plus 16Gi for training, plus offloaded optimizer state with "
        "distributed.cpu_offload; 1.5 times plus 8Gi for evaluate; 2.5 times plus 8Gi for deploy, which merges an "
        "adapter and loads the result again; 16Gi for prepare) and shm_size.",
    )
    shm_size: Quantity | None = Field(
        "16Gi",
        description="Size of the memory-backed /dev/shm (NCCL and dataloader workers need it); None: none.",
    )
    ephemeral_storage: Quantity | None = Field(
        None,
        description="Ephemeral storage (the pod's /tmp and caches) request and limit per pod. None: none, except "
        "deploy, whose model MLflow stages in /tmp: the weights plus 10Gi.",
    )
    node_selector: Labels = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")
    affinity: dict[str, Any] | None = Field(
        None, description="A core/v1 Affinity object, as in a pod spec (nodeAffinity, podAntiAffinity...)."
    )
    image: ImageReference | None = Field(None, description="Image for this stage; None uses cluster.image.")
    priority_class: KubernetesName | None = Field(None, description="PriorityClass name for the pods.")
    queue: str | None = Field(
        None,
        description="Kueue LocalQueue name (label kueue.x-k8s.io/queue-name) and the job's scheduling queue.",
    )
    annotations: Annotations = Field(default_factory=dict, description="Extra pod annotations.")
    labels: Labels = Field(default_factory=dict, description="Extra pod labels.")

    @field_validator("affinity")
    @classmethod
    def _affinity(cls, affinity: dict[str, Any] | None) -> dict[str, Any] | None:
        if affinity is not None:
            _check(validation.kubernetes_object(affinity, "V1Affinity"))
        return affinity

    @field_validator("queue")
    @classmethod
    def _queue(cls, name: str | None) -> str | None:
        if name is not None:  # a LocalQueue name, also written as a label value
            _check(validation.dns_subdomain(name) or validation.label_value(name), "queue: ")
        return name


class StepPolicy(StrictModel):
    """The Argo step around a single-pod stage (prepare, evaluate, deploy): its timeout, retries and grace period."""

    active_deadline_seconds: Seconds = Field(
        24 * 3600,
        gt=0,
        description="The step's timeout: the pod is stopped after running this long (SIGTERM, then SIGKILL after "
        "the grace period; time spent waiting to be scheduled does not count), and the attempt is retried like an "
        "interrupted one. Default 24 hours.",
    )
    retries: Int64 = Field(
        2,
        ge=0,
        le=20,
        description="Argo retries of the step, only after a failure a retry can fix: the pod was deleted, evicted "
        "or lost with its node (Argo status Error), or the stage was interrupted (exit 75: SIGTERM, or another "
        "process still held the stage) or killed (exit 137 or 143, not OOMKilled). A failed stage (exit 1) or bad "
        "input (exit 2) is never retried.",
    )
    retry_backoff: str = Field(
        "30s",
        description="Wait before the first retry, in seconds or as a Go duration ('90s', '2m', '1h30m'); it doubles "
        "with each retry, each wait at most 1h.",
    )
    termination_grace_period_seconds: Seconds = Field(
        120,
        ge=30,
        description="Time a stopped pod (preempted, or past its timeout) gets between SIGTERM and SIGKILL to "
        "record itself as interrupted.",
    )

    @field_validator("retry_backoff", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # `retry_backoff: 120` in YAML means seconds, as Argo reads it
        # What Argo accepts for a retry backoff: whole seconds, or a Go duration such as '90s', '2m', '1h30m'.
        if isinstance(value, str) and not (value.isdigit() or validation.go_duration_seconds(value) is not None):
            raise ValueError(
                f"retry_backoff must be whole seconds or a Go duration such as '90s', '2m' or '1h30m', got {value!r}"
            )
        return value


class RunPolicy(StepPolicy):
    """The PyTorchJob's runPolicy, and the Argo retry around it."""

    active_deadline_seconds: Seconds = Field(
        7 * 24 * 3600,
        gt=0,
        description="Fail the job after this long (the operator marks it Failed). The step's timeout is this plus "
        "an hour, so even a job that never starts (stuck at Created) ends; default 7 days.",
    )
    ttl_seconds_after_finished: Int32 | None = Field(
        7 * 24 * 3600, ge=0, description="Delete the finished PyTorchJob after this long."
    )
    backoff_limit: Int32 | None = Field(0, ge=0, description="Pod restarts the operator allows before failing the job.")
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "Running",
        description="Which pods the operator deletes when the job ends. Running (default) deletes the pods still "
        "running, e.g. Workers left waiting on a failed Master, which would otherwise hold their GPUs until the job "
        "is deleted; finished pods stay for their logs. None keeps every pod, All deletes every pod.",
    )
    retries: Int64 = Field(
        2, ge=0, le=20, description="Argo retries of the stage; each creates a fresh PyTorchJob that resumes."
    )
    retry_backoff: str = Field(
        "2m",
        description="Wait before the first retry, in seconds or as a Go duration ('90s', '2m', '1h30m'); it doubles "
        "with each retry, each wait at most 1h. Retries are limited in number, and by the workflow's deadline, not "
        "by the time since the first attempt: a stage that fails after days is still retried.",
    )
    termination_grace_period_seconds: Seconds = Field(
        300,
        ge=30,
        description="Time a preempted pod gets between SIGTERM and SIGKILL: it must cover one training step "
        "plus writing a checkpoint.",
    )


class StageBase(StrictModel):
    """Fields every stage has."""

    enabled: bool = Field(True, description="Run this stage; a disabled stage drops out and the DAG closes up.")
    resources: Resources = Field(default_factory=Resources, description="Pods, GPUs and scheduling.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables (never secrets: use cluster.secrets)."
    )
    run_policy: StepPolicy = Field(
        default_factory=StepPolicy, description="The step's timeout, retries and grace period in the cluster."
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable name {name!r} is not valid")
            # Any casing, word by word (AWS_ACCESS_KEY_ID, wandb_key); a path names a mounted file, not a secret.
            if looks_secret_name(name) and not value.startswith("/"):
                raise ValueError(
                    f"{name} looks like a secret: its value would be in the template, readable by anyone who may "
                    "submit; reference a Kubernetes Secret through cluster.secrets instead"
                )
        return env


# --------------------------------------------------------------------------- hyperparameter search

HPO_ALGORITHMS = ("random", "tpe", "bayesianoptimization", "grid")
"""Search algorithms, named as Katib names them (Optuna's samplers run them under --local)."""

HPO_FIXED_FIELDS = ("enabled", "resources", "run_policy", "env", "hpo", "data", "method", "distributed")
"""Stage fields a search may not vary: the trial jobs' shape and data are the stage's own, so trials are comparable
and each one fits the pods the template was compiled with."""

TRAINING_METRICS = ("eval_loss", "perplexity", "train_loss_first", "train_loss_last")
"""What cpt and sft record in stage.json (eval_* and perplexity need held-out rows: data.eval_fraction > 0)."""

PREFERENCE_METRICS = (
    "eval_loss",
    "eval_rewards_margin",
    "eval_rewards_accuracy",
    "train_loss_first",
    "train_loss_last",
    "rewards_margin_first",
    "rewards_margin_last",
    "rewards_accuracy_first",
    "rewards_accuracy_last",
)
"""What rlhf records with dpo, orpo and kto."""

GRPO_METRICS = ("train_loss_first", "train_loss_last", "reward_first", "reward_last", "kl_first", "kl_last")
"""What rlhf records with grpo (no held-out loss)."""


def recorded_metrics(stage: str, algorithm: str | None = None) -> tuple[str, ...]:
    """The metrics a training stage writes into its stage.json, which a search may optimise."""
    if stage != "rlhf":
        return TRAINING_METRICS
    return GRPO_METRICS if algorithm == "grpo" else PREFERENCE_METRICS


SearchValue = Int64 | float | str | bool


class SearchParameter(StrictModel):
    """One dimension of a search: a field of the stage, and the values trials may give it."""

    path: str = Field(
        description="Dotted path of the field inside the stage's section, e.g. training.learning_rate, lora.r, "
        "training.warmup_ratio, beta."
    )
    type: Literal["uniform", "log_uniform", "int", "categorical"] = Field(
        description="uniform or log_uniform: a real number between min and max (log_uniform samples its logarithm, "
        "for learning rates); int: a whole number between min and max; categorical: one of values."
    )
    min: float | None = Field(None, description="Smallest value (uniform, log_uniform, int).")
    max: float | None = Field(None, description="Largest value (uniform, log_uniform, int).")
    step: float | None = Field(
        None, gt=0, description="Spacing of the values between min and max; required for uniform under grid search."
    )
    values: list[SearchValue] | None = Field(None, description="The choices (categorical): at least two, distinct.")

    @property
    def keys(self) -> tuple[str, ...]:
        """The path split at its dots."""
        return tuple(self.path.split("."))

    def candidates(self) -> list[SearchValue]:
        """Values whose validity decides the whole range: both ends, or every choice."""
        if self.type == "categorical":
            return list(self.values or [])
        if self.type == "int":
            return [int(self.min), int(self.max)]  # type: ignore[arg-type]
        return [self.min, self.max]  # type: ignore[list-item]

    @model_validator(mode="after")
    def _range(self) -> SearchParameter:
        if not re.match(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$", self.path):
            raise FieldError(
                ("path",), f"path must be dotted field names, e.g. training.learning_rate, got {self.path!r}"
            )
        if self.type == "categorical":
            for name in ("min", "max", "step"):
                if getattr(self, name) is not None:
                    raise FieldError((name,), f"a categorical parameter takes values, not {name}")
            values = self.values or []
            if len({json_key(v) for v in values}) < 2:
                raise FieldError(
                    ("values",),
                    f"a categorical parameter needs at least two distinct values to search over, got {values}: "
                    "set the field itself in the stage instead",
                )
            if len({json_key(v) for v in values}) != len(values):
                raise FieldError(("values",), f"values repeat: {values}")
            return self
        if self.values is not None:
            raise FieldError(("values",), f"a {self.type} parameter takes min and max, not values")
        if self.min is None or self.max is None:
            raise FieldError(("min" if self.min is None else "max",), f"a {self.type} parameter needs min and max")
        if self.min >= self.max:
            raise FieldError(("max",), f"max ({self.max:g}) must be greater than min ({self.min:g})")
        if self.type == "log_uniform" and self.min <= 0:
            raise FieldError(("min",), f"log_uniform samples the logarithm: min must be positive, got {self.min:g}")
        if self.type == "int":
            for name in ("min", "max", "step"):
                value = getattr(self, name)
                if value is not None and value != int(value):
                    raise FieldError((name,), f"an int parameter's {name} must be a whole number, got {value:g}")
        return self


def json_key(value: SearchValue) -> str:
    """A value as JSON, so True, 1 and 1.0 stay distinct choices."""
    return f"{type(value).__name__}:{value!r}"


def search_field_problem(section: type[BaseModel], parameter: SearchParameter) -> str | None:
    """Why a search parameter's path is not a field a search may vary in a stage of type `section`; None if it is."""
    model: type[BaseModel] = section
    for depth, key in enumerate(parameter.keys):
        fields = model.model_fields
        if key not in fields:
            known = ", ".join(sorted(fields))
            prefix = ".".join(parameter.keys[:depth]) or "the stage"
            return f"{parameter.path}: {prefix} has no field {key!r} (it has {known})"
        if depth == 0 and key in HPO_FIXED_FIELDS:
            return f"{parameter.path}: a search may not vary {key} (every trial runs the stage's own {key})"
        annotation = fields[key].annotation
        if depth < len(parameter.keys) - 1:
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return f"{parameter.path}: {'.'.join(parameter.keys[: depth + 1])} is a value, not a section"
            model = annotation
            continue
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return f"{parameter.path} is a section; name one of its fields"
        whole = annotation in (int, int | None)
        if whole and parameter.type in ("uniform", "log_uniform"):
            return f"{parameter.path} is a whole number: search it with type int or categorical"
        numeric = annotation in (int, float, int | None, float | None)
        if parameter.type != "categorical" and not numeric:
            return f"{parameter.path} is not a number: search it with type categorical"
    return None


class HpoObjective(StrictModel):
    """What the search optimises: a metric the stage records in its stage.json."""

    metric: str = Field(description="Metric name, e.g. eval_loss (cpt, sft, rlhf) or eval_rewards_accuracy (rlhf).")
    goal: Literal["minimize", "maximize"] = Field("minimize", description="Whether smaller or larger is better.")
    target: float | None = Field(
        None, description="Stop the search early once a trial reaches this value (Katib's objective goal)."
    )


class HpoSpec(StrictModel):
    """A hyperparameter search before the stage: short trials of the stage (Katib in the cluster, Optuna under
    --local); the stage then trains with the best trial's values."""

    parameters: list[SearchParameter] = Field(min_length=1, description="The search space.")
    objective: HpoObjective = Field(description="The metric to optimise.")
    algorithm: Literal["random", "tpe", "bayesianoptimization", "grid"] = Field(
        "tpe", description="Katib's algorithm name: random, tpe, bayesianoptimization or grid."
    )
    max_trials: Int64 = Field(12, ge=1, le=1000, description="Trials in all.")
    parallel_trials: Int32 = Field(2, ge=1, description="Trials running at once (each is a job of the stage's shape).")
    max_failed_trials: Int32 = Field(3, ge=0, description="The search fails once this many trials have failed.")
    trial_max_steps: Int64 = Field(50, gt=0, description="Optimizer steps each trial trains (its max_steps).")
    seed: Seed | None = Field(None, description="Seed of the search algorithm (None: a random one).")

    @model_validator(mode="after")
    def _coherent(self) -> HpoSpec:
        paths = [p.path for p in self.parameters]
        for index, path in enumerate(paths):
            if path in paths[:index]:
                raise FieldError(("parameters", index, "path"), f"{path} is searched twice")
        if self.parallel_trials > self.max_trials:
            raise FieldError(
                ("parallel_trials",), f"parallel_trials ({self.parallel_trials}) exceeds max_trials ({self.max_trials})"
            )
        if self.algorithm == "grid":
            for index, parameter in enumerate(self.parameters):
                if parameter.type == "log_uniform":
                    raise FieldError(
                        ("parameters", index, "type"),
                        "grid search walks evenly spaced values: use uniform with a step, or categorical values",
                    )
                if parameter.type == "uniform" and parameter.step is None:
                    raise FieldError(("parameters", index, "step"), "grid search needs a step for a uniform parameter")
        if self.algorithm == "bayesianoptimization":
            for index, parameter in enumerate(self.parameters):
                if parameter.type == "uniform":
                    # Katib's scikit-optimize service samples every real-valued parameter on a log scale.
                    raise FieldError(
                        ("parameters", index, "type"),
                        "Katib's bayesianoptimization samples every real-valued parameter log-uniformly: use "
                        "log_uniform (min > 0), int or categorical, or another algorithm",
                    )
        return self


class TrainingStage(StageBase):
    """A stage that trains (cpt, sft, rlhf): a PyTorchJob."""

    method: Literal["full", "lora", "qlora"] = Field("full", description="Full fine-tuning, LoRA, or QLoRA (4-bit).")
    data: DataSpec | None = Field(None, description="Training data.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Hyperparameters.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="Adapter settings for lora/qlora.")
    distributed: DistributedSpec = Field(default_factory=DistributedSpec, description="Distributed strategy.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Job deadlines, cleanup and retries.")
    hpo: HpoSpec | None = Field(
        None,
        description="Search hyperparameters with short trials of this stage first (a Katib Experiment in the "
        "cluster, Optuna under --local); the stage then trains with the best trial's values.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> TrainingStage:
        if self.enabled and self.data is None:
            raise ValueError("an enabled training stage needs 'data'")
        if self.method == "qlora" and self.distributed.strategy == "deepspeed_zero3":
            raise ValueError("qlora cannot be sharded with deepspeed_zero3; use ddp or fsdp")
        if self.training.eval_steps is not None and self.data is not None and self.data.eval_fraction == 0:
            raise FieldError(
                ("training", "eval_steps"),
                "training.eval_steps evaluates held-out rows, and data.eval_fraction is 0: hold rows out "
                "(data.eval_fraction: 0.02) or drop eval_steps",
            )
        return self


class CptStage(TrainingStage):
    """Continued pre-training on raw text."""

    @model_validator(mode="after")
    def _text_data(self) -> CptStage:
        if self.data is not None and self.data.format != "text":
            raise ValueError(f"cpt trains on raw text: data.format must be 'text', got {self.data.format!r}")
        return self


class SftStage(TrainingStage):
    """Supervised fine-tuning on conversations or instructions."""

    assistant_only_loss: bool = Field(True, description="Only assistant tokens carry loss.")
    enable_thinking: bool = Field(
        False, description="Render Qwen3 thinking tags in the chat template (empty when the data has none)."
    )

    @model_validator(mode="after")
    def _chat_data(self) -> SftStage:
        if self.data is not None and self.data.format not in ("messages", "alpaca", "sharegpt"):
            raise ValueError(
                f"sft reads messages, alpaca or sharegpt: data.format {self.data.format!r} is not one of them"
            )
        return self


BUILTIN_REWARDS: dict[str, tuple[str, ...]] = {
    "hangul_ratio": (),
    "length": ("min", "max"),
    "format": ("require_end", "closed_think", "end_token_ids", "end_texts"),
}
"""The built-in GRPO rewards (stages/rewards.py) and the arguments each takes."""

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RewardFunction(StrictModel):
    """A GRPO reward: a built-in, or a function of a module the pipeline file allows (`module:function`)."""

    name: str = Field(
        description=f"Built-in reward ({', '.join(repr(n) for n in BUILTIN_REWARDS)}) or 'module:function', a "
        "function defined in a module listed in stages.rlhf.reward_modules."
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the reward (for a built-in: the ones it takes)."
    )

    @model_validator(mode="after")
    def _known_args(self) -> RewardFunction:
        if self.name in BUILTIN_REWARDS:
            unknown = sorted(set(self.args) - set(BUILTIN_REWARDS[self.name]))
            if unknown:
                takes = ", ".join(BUILTIN_REWARDS[self.name]) or "none"
                raise FieldError(("args",), f"{unknown} are not arguments of the {self.name} reward (it takes {takes})")
        return self


class RlhfStage(TrainingStage):
    """Preference optimisation after SFT."""

    algorithm: Literal["dpo", "orpo", "kto", "grpo"] = Field("dpo", description="Preference algorithm.")
    beta: float = Field(
        0.1,
        ge=0,
        description="Strength of the KL/preference term; greater than 0, except for grpo, where 0 (TRL's default) "
        "drops the KL term and the reference model.",
    )
    precompute_ref_log_probs: bool = Field(
        True, description="Compute the reference model's log-probabilities once, before training."
    )
    reward_functions: list[RewardFunction] = Field(
        default_factory=list, description="GRPO rewards (ignored by the other algorithms)."
    )
    reward_modules: list[str] = Field(
        default_factory=list,
        description="Python modules (installed in the trainer image) whose functions reward_functions may name as "
        "'module:function', e.g. ['acme_rewards.korean']. Only these modules are ever imported for a reward. "
        "Pipeline file only: the form may choose among the built-ins and these modules' functions, nothing else.",
    )
    num_generations: Int64 = Field(4, ge=2, description="GRPO completions per prompt.")

    @model_validator(mode="after")
    def _preference_data(self) -> RlhfStage:
        # DPO and KTO scale the preference margin by beta (no gradient at 0), ORPO weighs its odds-ratio term by it.
        if self.algorithm != "grpo" and self.beta == 0:
            raise ValueError(f"beta must be greater than 0 for {self.algorithm} (only grpo accepts 0)")
        for module in self.reward_modules:
            if not _MODULE_NAME.match(module):
                raise FieldError(("reward_modules",), f"{module!r} is not a Python module name (package.module)")
        for i, reward in enumerate(self.reward_functions):
            if reward.name in BUILTIN_REWARDS:
                continue
            module, colon, function = reward.name.partition(":")
            if not colon or not _MODULE_NAME.match(module) or not _IDENTIFIER.match(function):
                raise FieldError(
                    ("reward_functions", i, "name"),
                    f"{reward.name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor "
                    "'module:function' (a function name, no dots)",
                )
            if module not in self.reward_modules:
                raise FieldError(
                    ("reward_functions", i, "name"),
                    f"{reward.name!r}: module {module!r} is not in stages.rlhf.reward_modules; a reward runs code, "
                    "so its module must be listed there, in the pipeline file",
                )
        if self.algorithm == "grpo":
            if self.enabled and not self.reward_functions:
                raise ValueError("grpo needs at least one entry in reward_functions")
        elif self.data is not None and self.data.format != "preference":
            raise ValueError(f"{self.algorithm} reads preference data: data.format must be 'preference'")
        return self


class PrepareStage(StageBase):
    """Resolve the spec, validate data, tokenize: a plain container step."""

    enabled: Literal[True] = Field(True, description="prepare always runs.")
    skip_if_unchanged: bool = Field(
        False,
        description="End the run early, as skipped, when the data fingerprints match the last successful run.",
    )
    num_proc: Int64 | None = Field(
        None,
        gt=0,
        le=256,
        description="Worker processes that parse, clean and tokenize the data. Default: the prepare pod's CPU "
        "request (resources.cpu, rounded down) in the cluster, the machine's usable CPUs locally.",
    )


class GateRule(StrictModel):
    """One rule of the champion/challenger gate."""

    metric: str = Field(
        min_length=1, description="Metric name from the evaluation (e.g. 'perplexity', 'kobest_boolq/acc')."
    )
    higher_is_better: bool = Field(True, description="Direction of the metric.")
    max_regression: float = Field(
        0.0, ge=0, description="How far the candidate may fall behind the champion (absolute) and still pass."
    )
    max_regression_relative: float | None = Field(
        None,
        ge=0,
        le=1,
        description="How far the candidate may fall behind, as a fraction of the reference's value (0.05: 5% worse, "
        "e.g. a perplexity of 10.5 against 10.0). The allowance is the larger of this and max_regression. None: "
        "max_regression alone.",
    )
    min_significance: float | None = Field(
        None,
        gt=0,
        description="Require a significant improvement: the candidate must beat the reference by more than this "
        "many standard errors, candidate - reference > k * sqrt(se_candidate^2 + se_reference^2), with the "
        "standard errors lm-eval reports (`<task>/<metric>_stderr`); a side whose standard error is unknown fails "
        "the rule, saying so. Only for lm-eval metrics (`<task>/<metric>`). None: no significance required.",
    )

    @model_validator(mode="after")
    def _significance_needs_a_stderr(self) -> GateRule:
        if self.min_significance is not None and "/" not in self.metric:
            raise FieldError(
                ("min_significance",),
                f"metric {self.metric!r} has no standard error: min_significance applies to lm-eval metrics "
                "('<task>/<metric>', e.g. 'arc_easy/acc'), whose standard errors lm-eval reports; remove "
                "min_significance or use max_regression_relative",
            )
        return self


class EvaluateStage(StageBase):
    """Evaluate the candidate against the base model and the registered champion."""

    data: DataSpec | None = Field(None, description="Held-out text or chat data for perplexity.")
    lm_eval_tasks: list[str] = Field(
        default_factory=list, description="lm-eval-harness tasks (e.g. kobest_boolq, kmmlu, haerae)."
    )
    lm_eval_include_path: OneLine | None = Field(
        None,
        description="Directory of extra lm-eval task YAMLs (tasks over local data files, for offline clusters), or "
        "'builtin:korean-lm-eval' for the tasks prepare generates offline from the builtin corpus "
        "(ko_constitution_mc). Pipeline file only (task YAMLs can run Python); in the cluster it must lie on the "
        "datasets or checkpoints volume.",
    )
    limit: Int64 | None = Field(None, gt=0, description="Examples per lm-eval task (None: all).")
    prompts: list[str] = Field(default_factory=list, description="Prompts for the sampled-generation table.")
    max_new_tokens: Int64 = Field(128, gt=0, description="Tokens generated per prompt.")
    cache_scores: bool = Field(
        True,
        description="Reuse the base model's and the champion's numbers that an earlier run of the pipeline measured "
        "on the same model (by content: files, config or hub commit) with the same held-out rows, tokenizer, "
        "lm-eval tasks, prompts, lengths, dtype and library versions; they are kept beside the run directories, "
        "in .scores/. A scheduled run then measures only the candidate. Off: every model is measured every run.",
    )
    gate: list[GateRule] = Field(
        default_factory=lambda: [GateRule(metric="perplexity", higher_is_better=False, max_regression=0.0)],
        description="Rules the candidate must pass to become champion; all must hold. Set in the pipeline file: "
        "the form may add rules, lower a rule's max_regression or max_regression_relative, or raise its "
        "min_significance (tighten the gate), never remove, relax or reverse one.",
    )


class SmokeCheckSpec(StrictModel):
    """Real chat requests to the new model's vLLM server before it keeps traffic or becomes champion."""

    prompts: Int64 = Field(
        3,
        ge=1,
        le=20,
        description="How many of stages.evaluate.prompts are sent, first ones first (a built-in Korean greeting "
        "when evaluate has none), each as one user message to the OpenAI-compatible /v1/chat/completions.",
    )
    max_tokens: Int64 = Field(64, gt=0, le=4096, description="Tokens the server may generate per answer.")
    max_latency_seconds: float = Field(
        60.0, gt=0, description="Longest wait for one complete answer; a slower answer fails the check."
    )
    expected_substrings: list[str] = Field(
        default_factory=list,
        description="When set, every answer must contain at least one of these (case-insensitive), e.g. a few "
        "Hangul particles for a Korean model. Answers are always checked to be non-empty and not the prompt echoed.",
    )
    ready_timeout_seconds: Seconds = Field(
        1800,
        gt=0,
        description="Longest wait for the new revision to be ready (model download and load included), and for "
        "each traffic change to take effect.",
    )

    @field_validator("expected_substrings")
    @classmethod
    def _non_blank(cls, values: list[str]) -> list[str]:
        if any(not v.strip() for v in values):
            raise ValueError("expected_substrings must not hold empty strings: every answer would contain one")
        return values


class AutoscalingSpec(StrictModel):
    """Knative's request-based autoscaler for the predictor (KServe scaleMetric/scaleTarget), instead of scaling on
    CPU, which says nothing about a GPU server's load."""

    metric: Literal["concurrency", "rps"] = Field(
        "concurrency",
        description="concurrency: requests in flight per replica; rps: requests per second per replica.",
    )
    target: Int32 = Field(
        gt=0,
        description="The value per replica the autoscaler aims at (e.g. 8 concurrent requests per vLLM replica); "
        "replicas stay within min_replicas..max_replicas.",
    )


class ServingSpec(StrictModel):
    """The KServe InferenceService rendered for the model, and how a new model rolls out in the cluster."""

    enabled: bool = Field(True, description="Render (and in-cluster apply) an InferenceService.")
    runtime: KubernetesName = Field("kserve-vllm", description="ServingRuntime name.")
    gpus: Int32 = Field(1, ge=0, description="GPUs for the predictor.")
    max_model_len: Int32 | None = Field(None, gt=0, description="vLLM --max-model-len.")
    min_replicas: Int32 = Field(1, ge=0, description="Predictor minReplicas.")
    max_replicas: Int32 = Field(1, ge=1, description="Predictor maxReplicas.")
    service_account: KubernetesName | None = Field(
        None,
        description="ServiceAccount of the predictor, e.g. one bound through Workload Identity or IRSA to read "
        "gs:// or s3:// storage. None uses the namespace's default account, never the workflow's (which may "
        "create jobs).",
    )
    rollout: Literal["replace", "canary"] = Field(
        "replace",
        description="How the cluster's serve step moves traffic to a new model (KServe's Knative mode, revisions). "
        "replace: the new revision takes all traffic once ready, then the smoke check decides whether it stays. "
        "canary: it gets canary_traffic_percent[0] of the traffic beside the previous model and is smoke-checked "
        "on its own address, then each further step, then all of it. Any failed check rolls traffic back to the "
        "previous revision and leaves the champion alias where it was.",
    )
    canary_traffic_percent: list[Int32] = Field(
        default_factory=lambda: [10, 50],
        min_length=1,
        description="Canary traffic steps in percent (each 1-99, increasing); 100 follows the last one.",
    )
    canary_interval_seconds: Seconds = Field(
        60, ge=0, description="How long each canary step serves its share before it is checked again."
    )
    smoke_check: SmokeCheckSpec = Field(
        default_factory=SmokeCheckSpec, description="The requests that decide whether a new model keeps its traffic."
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Request-based autoscaling (Knative); None keeps KServe's default for the mode (concurrency "
        "100 per replica).",
    )

    @field_validator("canary_traffic_percent")
    @classmethod
    def _steps(cls, steps: list[int]) -> list[int]:
        if any(not 0 < s < 100 for s in steps):
            raise ValueError(f"canary_traffic_percent steps must each lie between 1 and 99, got {steps}")
        if steps != sorted(set(steps)):
            raise ValueError(f"canary_traffic_percent steps must increase, got {steps}")
        return steps

    @model_validator(mode="after")
    def _replicas(self) -> ServingSpec:
        if self.min_replicas > self.max_replicas:
            raise FieldError(
                ("min_replicas",),
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas}): KServe refuses it",
            )
        return self


class DeployStage(StageBase):
    """Register the model, move aliases, serve it."""

    registered_model: str | None = Field(
        None,
        min_length=1,
        description="MLflow registered model name, whose challenger and champion aliases deploy moves; None uses the "
        "pipeline name. Pipeline file only: the form cannot point a run at another model's aliases.",
    )
    storage_uri: OneLine | None = Field(
        None,
        description="Where the served model is published: 'gs://...', 's3://...' or 'pvc://claim/path' (a folder "
        "inside the claim, without '..'). None serves it from the checkpoints volume.",
    )
    serving: ServingSpec = Field(default_factory=ServingSpec, description="The InferenceService.")

    @field_validator("storage_uri")
    @classmethod
    def _storage_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        if not re.match(r"^(gs|s3|pvc)://[^/]+", uri):
            raise ValueError("storage_uri must start with gs://, s3:// or pvc://")
        if uri.startswith("pvc://"):
            claim, _, path = uri[len("pvc://") :].partition("/")
            if len(claim) > 253 or not _DNS_SUBDOMAIN.match(claim):
                raise ValueError(f"storage_uri {uri!r} must name a PersistentVolumeClaim: pvc://CLAIM/PATH")
            segments = [s for s in path.split("/") if s]
            if not segments:
                raise ValueError(
                    f"storage_uri {uri!r} is the root of the claim: name a folder inside it, e.g. pvc://{claim}/models"
                )
            if ".." in segments:
                raise ValueError(f"storage_uri {uri!r} must stay inside its claim: no '..' in the path")
        return uri


class Stages(StrictModel):
    """The stages of the DAG, in order."""

    prepare: PrepareStage = Field(default_factory=PrepareStage, description="Resolve spec, validate data.")
    cpt: CptStage = Field(default_factory=lambda: CptStage(enabled=False), description="Continued pre-training.")
    sft: SftStage = Field(default_factory=lambda: SftStage(enabled=False), description="Supervised fine-tuning.")
    rlhf: RlhfStage = Field(default_factory=lambda: RlhfStage(enabled=False), description="Preference optimisation.")
    evaluate: EvaluateStage = Field(default_factory=EvaluateStage, description="Evaluation and gate.")
    deploy: DeployStage = Field(default_factory=DeployStage, description="Registry and serving.")

    def enabled(self) -> list[str]:
        """Names of the stages that run, in DAG order."""
        return [name for name in STAGE_ORDER if getattr(self, name).enabled]


# --------------------------------------------------------------------------- cluster


class SecretRef(StrictModel):
    """A key of a Kubernetes Secret; the value is only ever read by the pod, through secretKeyRef."""

    name: str = Field(description="Secret name.")
    key: str = Field(description="Key inside the Secret.")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", name) or len(name) > 253:
            raise ValueError(f"secret name {name!r} is not a valid Kubernetes name")
        return name


class Secrets(StrictModel):
    """Secrets the pods read. Names only: values never appear in the spec, parameters or logs."""

    hf_token: SecretRef | None = Field(None, description="Hugging Face token (HF_TOKEN), for gated models.")
    wandb_api_key: SecretRef | None = Field(None, description="W&B API key (WANDB_API_KEY).")
    mlflow_username: SecretRef | None = Field(None, description="MLflow basic-auth user (MLFLOW_TRACKING_USERNAME).")
    mlflow_password: SecretRef | None = Field(None, description="MLflow basic-auth password.")
    mlflow_token: SecretRef | None = Field(None, description="MLflow bearer token (MLFLOW_TRACKING_TOKEN).")
    slack_webhook: SecretRef | None = Field(None, description="Slack incoming-webhook URL for notifications.")
    langfuse_public_key: SecretRef | None = Field(None, description="Langfuse public key (LANGFUSE_PUBLIC_KEY).")
    langfuse_secret_key: SecretRef | None = Field(None, description="Langfuse secret key (LANGFUSE_SECRET_KEY).")
    aws_access_key_id: SecretRef | None = Field(None, description="S3 access key id (AWS_ACCESS_KEY_ID).")
    aws_secret_access_key: SecretRef | None = Field(None, description="S3 secret key (AWS_SECRET_ACCESS_KEY).")
    aws_endpoint_url: SecretRef | None = Field(
        None,
        description="Endpoint of an S3-compatible store such as MinIO or Ceph RGW (AWS_ENDPOINT_URL), kept in the "
        "Secret beside its keys; boto3 addresses it path-style. Unset: AWS S3 (or cluster.env AWS_ENDPOINT_URL).",
    )

    def env(self) -> dict[str, SecretRef]:
        """Environment variable name → secret reference, for the secrets that are set."""
        names = {
            "hf_token": "HF_TOKEN",
            "wandb_api_key": "WANDB_API_KEY",
            "mlflow_username": "MLFLOW_TRACKING_USERNAME",
            "mlflow_password": "MLFLOW_TRACKING_PASSWORD",
            "mlflow_token": "MLFLOW_TRACKING_TOKEN",
            "langfuse_public_key": "LANGFUSE_PUBLIC_KEY",
            "langfuse_secret_key": "LANGFUSE_SECRET_KEY",
            "aws_access_key_id": "AWS_ACCESS_KEY_ID",
            "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
            "aws_endpoint_url": "AWS_ENDPOINT_URL",
        }
        return {env: ref for field, env in names.items() if (ref := getattr(self, field)) is not None}


class VolumeSpec(StrictModel):
    """A ReadWriteMany PersistentVolumeClaim every pod mounts."""

    claim_name: str = Field(description="PVC name.")
    mount_path: OneLine = Field(description="Where it is mounted in every pod.")
    read_only: bool = Field(False, description="Mount read-only.")

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"mount_path must be an absolute path without '..', got {path!r}")
        return path.rstrip("/") or "/"


class ClusterSpec(StrictModel):
    """Where and as whom the pipeline runs."""

    namespace: str = Field("posttrain", description="Namespace of the workflows and jobs.")
    service_account: str = Field(
        "posttrain-workflow",
        description="ServiceAccount of the steps that create the training jobs and apply the InferenceService (Argo "
        "resource templates), the only pods that hold a Kubernetes API token (the kit's posttrain-workflow Role).",
    )
    pod_service_account: str = Field(
        "posttrain-runner",
        description="ServiceAccount of every pod that runs stage code (prepare, the training jobs' pods, evaluate, "
        "deploy, the notification): no Kubernetes API token is mounted in them (automountServiceAccountToken: "
        "false) and the account has no Role. Bind cloud identity for buckets (GKE Workload Identity, EKS IRSA) to it.",
    )
    executor_service_account: str = Field(
        "posttrain-executor",
        description="ServiceAccount whose token Argo mounts into its own init and wait containers of those pods, "
        "never into the stage's container, to report the step's outputs (workflowtaskresults create/patch only). "
        "Argo reads the token from the Secret '<name>.service-account-token', which the kit creates.",
    )
    executor_security_context: bool = Field(
        True,
        description="Give Argo's init and wait containers of those pods the restricted securityContext (no "
        "privilege escalation, all capabilities dropped, read-only root filesystem) through the templates' "
        "podSpecPatch, so the pods pass Pod Security `restricted` whatever the controller's executor settings. Turn "
        "off only with the controller's init-less pod layout (initlessPod, beta), which has no containers by those "
        "names; then set the controller's executor.securityContext instead (manifests/README.md).",
    )
    image: ImageReference = Field(
        "ghcr.io/posttrain/trainer:0.1.0", description="Trainer image (stages and control steps run in it)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    image_pull_secrets: list[KubernetesName] = Field(default_factory=list, description="Secrets for pulling the image.")
    datasets: VolumeSpec = Field(
        default_factory=lambda: VolumeSpec(claim_name="posttrain-datasets", mount_path="/mnt/datasets", read_only=True),
        description="Volume with the input data.",
    )
    checkpoints: VolumeSpec = Field(
        default_factory=lambda: VolumeSpec(claim_name="posttrain-checkpoints", mount_path="/mnt/checkpoints"),
        description="Volume with run directories (resolved spec, checkpoints, models).",
    )
    secrets: Secrets = Field(default_factory=Secrets, description="Secret references.")
    env: dict[str, str] = Field(
        default_factory=lambda: {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        description="Environment for every training pod (NCCL settings and the like; never secrets).",
    )
    argo_ui_url: str | None = Field(
        None,
        description="Base URL of the Argo UI, for links in notifications (e.g. https://argo.example.com).",
    )
    grafana_url: str | None = Field(
        None,
        description="Base URL of Grafana, for a link in notifications to the run's dashboard "
        "(`<grafana_url>/d/posttrain-run?var-run=<workflow>`, the dashboard of manifests/components/monitoring), "
        "e.g. https://grafana.example.com. None: no link.",
    )
    run_as_user: Int64 | None = Field(1000, ge=0, description="UID the pods run as (None: the image's user).")
    metrics_port: Int64 | None = Field(
        9200,
        ge=1024,
        le=65535,
        description="Port on which a training stage serves its Prometheus metrics (step, loss, tokens/s, MFU, ETA, "
        "GPU memory, deadline) from rank 0: the Master pod's container port named `metrics`, which "
        "manifests/components/monitoring's PodMonitor scrapes. None: no metrics server. Not 9400 (the DCGM "
        "exporter's) nor 9090 (Prometheus'); a port already taken only costs the metrics, never the stage.",
    )
    job_kind: Literal["pytorchjob", "trainjob"] = Field(
        "pytorchjob",
        description="What a training stage creates: `pytorchjob`, a Kubeflow Training Operator v1 PyTorchJob "
        "(kubeflow.org/v1); or `trainjob`, a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, on "
        "JobSet) that runs on the ClusterTrainingRuntime `training_runtime` (manifests/components/trainer-v2).",
    )
    training_runtime: str = Field(
        "posttrain-torch",
        description="With job_kind `trainjob`: the ClusterTrainingRuntime the TrainJobs run on. It holds what a "
        "TrainJob cannot set (security contexts, /dev/shm, the grace period, the JobSet's restart policy); its "
        "first replicated job must be `node` with a torch ML policy (preflight checks).",
    )

    @field_validator(
        "namespace", "service_account", "pod_service_account", "executor_service_account", "training_runtime"
    )
    @classmethod
    def _names(cls, value: str) -> str:
        return _dns_label(value, "name")

    @field_validator("run_as_user")
    @classmethod
    def _non_root(cls, uid: int | None) -> int | None:
        if uid == 0:
            raise ValueError("pods run as non-root (runAsNonRoot): use a non-zero UID, or null for the image's user")
        return uid

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return StageBase._env_names(env)

    @field_validator("grafana_url")
    @classmethod
    def _grafana_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if not re.match(r"^https?://[^/@\s]+(/\S*)?$", url):
            raise ValueError(
                f"grafana_url {url!r} must be an http(s) URL without credentials, e.g. https://grafana.example.com"
            )
        return url.rstrip("/")


# --------------------------------------------------------------------------- tracking, schedule, notifications


class TrackingSpec(StrictModel):
    """Experiment tracking. Credentials come from cluster.secrets (or the environment locally)."""

    mlflow_tracking_uri: OneLine | None = Field(
        None,
        description="MLflow server URI; None: MLFLOW_TRACKING_URI, else a SQLite store beside the run directories "
        "(runs/mlflow.db), shared by the runs there.",
    )
    mlflow_experiment: str | None = Field(None, description="MLflow experiment; None uses the pipeline name.")
    wandb_project: str | None = Field(
        None, description="W&B project ($WANDB_PROJECT overrides it); None, and no $WANDB_PROJECT, turns W&B off."
    )
    wandb_entity: str | None = Field(None, description="W&B entity, team or user ($WANDB_ENTITY overrides it).")
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files into the run directory (tags train/..., eval/...)."
    )
    langfuse_host: str | None = Field(
        None,
        description="Langfuse server (e.g. https://langfuse.example.com): every stage's start, checkpoints, end and "
        "error become events of one trace per run, sent with the Langfuse SDK. Its keys come from "
        "cluster.secrets.langfuse_public_key and langfuse_secret_key (locally from LANGFUSE_PUBLIC_KEY and "
        "LANGFUSE_SECRET_KEY). None: $LANGFUSE_HOST when set, else no Langfuse.",
    )

    @field_validator("langfuse_host")
    @classmethod
    def _langfuse_host(cls, host: str | None) -> str | None:
        if host is None:
            return None
        if not re.match(r"^https?://[^/@\s]+(/\S*)?$", host):
            raise ValueError(
                f"langfuse_host {host!r} must be an http(s) URL without credentials, e.g. https://langfuse.example.com"
            )
        return host.rstrip("/")


class ScheduleSpec(StrictModel):
    """When the CronWorkflow starts the pipeline."""

    cron: list[CronExpression] = Field(
        default_factory=list, description="Cron expressions; empty means no CronWorkflow."
    )
    timezone: str = Field("UTC", description="IANA timezone the cron expressions are read in (e.g. Asia/Seoul).")
    concurrency_policy: Literal["Forbid", "Allow", "Replace"] = Field(
        "Forbid", description="What to do when a run is still going at the next tick."
    )
    starting_deadline_seconds: Seconds = Field(
        3600, ge=0, description="A tick missed by more than this (controller down) is not started late."
    )
    successful_history: Int32 = Field(5, ge=0, description="Succeeded workflows kept by the CronWorkflow.")
    failed_history: Int32 = Field(5, ge=0, description="Failed workflows kept by the CronWorkflow.")
    suspend: bool = Field(False, description="Register the CronWorkflow suspended.")

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, tz: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown timezone {tz!r} (use an IANA name such as 'Asia/Seoul')") from None
        return tz


class NotificationSpec(StrictModel):
    """Where the outcome of each run is posted."""

    slack: bool = Field(False, description="Post to the Slack webhook in cluster.secrets.slack_webhook.")
    on: list[Literal["Succeeded", "Failed", "Error"]] = Field(
        default_factory=lambda: ["Succeeded", "Failed", "Error"], description="Workflow outcomes that notify."
    )
    channel_note: str | None = Field(None, description="A line added to every message (e.g. who to ping).")


class WorkflowSpec(StrictModel):
    """How Argo keeps and bounds each run."""

    ttl_seconds_after_success: Int32 = Field(7 * 24 * 3600, ge=0, description="Keep a succeeded workflow this long.")
    ttl_seconds_after_failure: Int32 = Field(14 * 24 * 3600, ge=0, description="Keep a failed workflow this long.")
    pod_gc: Literal["OnPodCompletion", "OnPodSuccess", "OnWorkflowCompletion", "OnWorkflowSuccess"] = Field(
        "OnPodSuccess", description="When pods are deleted; failed pods stay for their logs by default."
    )
    active_deadline_seconds: Seconds | None = Field(
        None,
        gt=0,
        description="Backstop for the whole workflow (Argo stops it, and retries no step, past this); the steps' "
        "timeouts are the detectors. None: the enabled steps' worst case, each step (retries + 1) times its timeout "
        "plus the waits between its retries (training steps: run_policy.active_deadline_seconds plus an hour, plus "
        "the cleanup before a retry, the create step and the waits between the wait step's retries; serve: an hour), "
        "summed in DAG order, plus the exit handler's steps and an hour for scheduling.",
    )
    parallelism: Int64 | None = Field(
        None,
        ge=1,
        description="With variants: how many variants' stage chains run at once (Argo's `parallelism` of the entry "
        "DAG, which counts the pods it runs at a time; a chain runs one pod at a time, each training stage one job). "
        "None: all at once. The deadline then allows for the chains running in ceil(variants / parallelism) waves.",
    )
    labels: Labels = Field(default_factory=dict, description="Labels on every workflow of the pipeline.")


class RetentionSpec(StrictModel):
    """Which run directories (`<checkpoints>/runs/<run>`) a run deletes when it ends: a last step runs
    `python -m workflows.runs prune` for the pipeline. It never deletes a run without a final state, the run whose
    model is the registered champion or challenger, or one a serving revision uses."""

    keep_last: Int64 | None = Field(
        None, ge=1, description="Keep the newest this many runs of the pipeline; None (and no keep_days): never prune."
    )
    keep_days: float | None = Field(
        None, gt=0, description="Also keep every run younger than this many days; None: age keeps nothing."
    )

    @property
    def enabled(self) -> bool:
        """Whether the pipeline prunes at all."""
        return self.keep_last is not None or self.keep_days is not None


# --------------------------------------------------------------------------- variants

VARIANT_FIXED_SECTIONS = (
    "name",
    "cluster",
    "schedule",
    "workflow",
    "notifications",
    "retention",
    "profiles",
    "variants",
    "variant",
)
"""Top-level fields a variant may not override: one WorkflowTemplate holds every variant, so its pods' cluster,
schedule, workflow settings, notifications and retention are the pipeline's."""
RESERVED_VARIANT_NAMES = ("pipeline", "switches", "cleanup", "notify", "retention", "exit-handler")
"""Steps of the workflow that a variant's chain (a template named after the variant) would clash with."""
VARIANT_FIXED_FIELDS = (
    ("tracking", "mlflow_tracking_uri"),
    ("tracking", "mlflow_experiment"),
    ("tracking", "wandb_project"),
    ("tracking", "wandb_entity"),
    ("tracking", "langfuse_host"),
)
"""Tracking settings shared by the variants, so their runs sit side by side in one experiment (tagged with the
variant); a variant may turn its own TensorBoard files on or off (`tracking.tensorboard`)."""


class Variant(StrictModel):
    """One model of a pipeline that trains several: the pipeline's spec with its own overrides."""

    name: str = Field(
        description="A DNS label: the variant's runs, training jobs and InferenceService are named "
        "'<pipeline>-<variant>', which must fit the pipeline name's limit."
    )
    description: str = Field("", description="What this variant is, shown in the form's run-<variant> switch.")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="A partial spec merged onto the pipeline's (after its profile): base model, resources, stage "
        "settings. Not the sections one template shares (name, cluster, schedule, workflow, notifications, "
        "retention) nor the tracking server and experiment.",
    )
    profiles: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The variant's own overlay per profile, merged last when that profile is applied (e.g. its "
        "tiny stand-in model under 'local').",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        _dns_label(name, "variant name")
        return name


def variant_fixed_problem(keys: tuple[str, ...]) -> str | None:
    """Why a variant may not override the field at `keys`, or None when it may."""
    if keys[:1] and keys[0] in VARIANT_FIXED_SECTIONS:
        return f"{keys[0]} is the pipeline's, shared by all its variants (one template holds them): set it at the top"
    for fixed in VARIANT_FIXED_FIELDS:
        if keys[: len(fixed)] == fixed or fixed[: len(keys)] == keys:
            return (
                f"{'.'.join(fixed)} is shared by all variants (their runs go to one experiment, tagged with the "
                "variant): set it at the top"
            )
    return None


# --------------------------------------------------------------------------- pipeline

# The PyTorchJob operator names each replica's Service '<job>-worker-<index>', a DNS-1035 label of at most 63
# characters. The longest job name comes from resubmitting a scheduled run: the CronWorkflow names its runs
# '<name>-<10-digit unix time>', a resubmission appends '-<5 random>', and the job '-<stage>-<5 random>'.
LONGEST_SERVICE_NAME = (
    f"<name>-<10 digits>-<5 random>-{max(TRAINING_STAGES, key=len)}-<5 random>-worker-<{MAX_NODES - 2}>"
)
MAX_PIPELINE_NAME_LENGTH = 63 - len(
    f"-{'9' * 10}-{'x' * 5}-{max(TRAINING_STAGES, key=len)}-{'x' * 5}-worker-{MAX_NODES - 2}"
)
"""The longest pipeline name whose worst-case Service name still fits."""


DESCRIPTION_ANNOTATION = "workflows.argoproj.io/description"
"""The annotation that carries the pipeline's description into the Argo UI."""


class PipelineSpec(StrictModel):
    """A post-training pipeline: base model + data → evaluated, registered, served model."""

    @model_validator(mode="before")
    @classmethod
    def _integers_fit_64_bits(cls, data: Any) -> Any:
        found = out_of_int64(data) if isinstance(data, dict) else None
        if found is not None:
            raise FieldError(
                found[0], f"{found[1]} does not fit in a 64-bit integer, the most the cluster and its tools read"
            )
        return data

    name: str = Field(
        description="Pipeline name: the WorkflowTemplate and CronWorkflow are named after it ('<name>-<profile>' "
        "with --profile), and so are the runs. A DNS label that "
        f"starts with a letter, at most {MAX_PIPELINE_NAME_LENGTH} characters (the training jobs' Service names "
        "are built from it)."
    )
    description: str = Field("", description="What this pipeline is for, shown in the Argo UI.")
    model: ModelSpec = Field(description="Base model.")
    data_version: OneLine = Field(
        "latest",
        description="Version label of the input data, recorded as lineage and substituted in data URIs.",
    )
    stages: Stages = Field(default_factory=Stages, description="Stages of the DAG.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Namespace, volumes, image, secrets.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="MLflow and W&B.")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="Cron schedule.")
    notifications: NotificationSpec = Field(default_factory=NotificationSpec, description="Slack notifications.")
    workflow: WorkflowSpec = Field(default_factory=WorkflowSpec, description="Workflow retention and deadline.")
    retention: RetentionSpec = Field(
        default_factory=RetentionSpec, description="Which old run directories each run deletes at its end."
    )
    profiles: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Named overlays merged onto this spec by --profile (the 'local' profile is used by --local). "
        "A profile's WorkflowTemplate and CronWorkflow are named '<name>-<profile>', so a profile name that is "
        "registered or submitted holds lowercase letters, digits and '-'. A profile never replaces a data URI that "
        "the pipeline file (outside profiles) sets: its stages.<stage>.data section is left out for that stage, "
        "unless the profile says `replaces_data: true` (the shipped 'local' profiles do, to run offline on "
        "builtin: data); a --set URI always wins. A profile's max_steps, like any max_steps, overrides epochs "
        "(the local runner warns).",
    )
    variants: list[Variant] = Field(
        default_factory=list,
        description="Several models from one submission: each variant is this spec with its own overrides, run as "
        "its own stage chain (run directory, MLflow parent run, gate against its own champion, registered model "
        "'<registered_model>-<variant>' unless it sets one, InferenceService), in parallel in the cluster "
        "(workflow.parallelism) and one after the other with --local. Empty: one model.",
    )
    variant: str | None = Field(
        None,
        description="Set by the compiler in a variant's resolved spec: the variant it is (tagged on its MLflow "
        "runs). Not written in pipeline files.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if len(name) > MAX_PIPELINE_NAME_LENGTH:
            raise ValueError(
                f"pipeline name must be at most {MAX_PIPELINE_NAME_LENGTH} characters, got {len(name)}: a training "
                f"stage's Services are named {LONGEST_SERVICE_NAME!r} and must fit a 63-character DNS label"
            )
        _dns_label(name, "pipeline name")
        if not name[0].isalpha():
            raise ValueError(f"pipeline name must start with a letter, as the Service names it begins do: {name!r}")
        return name

    @field_validator("description")
    @classmethod
    def _description(cls, description: str) -> str:
        problem = validation.annotations({DESCRIPTION_ANNOTATION: description})
        _check(problem, "too long for the workflow's annotation: ")
        return description

    @field_validator("data_version")
    @classmethod
    def _data_version(cls, version: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", version):
            raise ValueError("data_version may hold letters, digits, '.', '_' and '-' (at most 63)")
        return version

    @model_validator(mode="after")
    def _coherent(self) -> PipelineSpec:
        if self.notifications.slack and self.cluster.secrets.slack_webhook is None:
            raise ValueError("notifications.slack needs cluster.secrets.slack_webhook")
        self._langfuse_keys()
        if self.stages.deploy.enabled and not self.stages.evaluate.enabled:
            raise ValueError("stages.deploy needs stages.evaluate: only a model that passed the gate is deployed")
        trained = [s for s in TRAINING_STAGES if getattr(self.stages, s).enabled]
        if self.stages.evaluate.enabled and not trained:
            raise ValueError("stages.evaluate needs at least one training stage (cpt, sft or rlhf) to evaluate")
        for stage in ("prepare", "evaluate", "deploy"):
            if self.stage(stage).resources.rdma is not None:
                raise FieldError(
                    ("stages", stage, "resources", "rdma"),
                    f"RDMA devices are for the training stages' NCCL between nodes; {stage} runs in one pod",
                )
        for stage in TRAINING_STAGES:
            self._rdma_env_agrees(stage)
            self._trainjob_can_say(stage)
            self._search_space(stage)
        self._serving_fits_model()
        self._variants_fit()
        return self

    def _variants_fit(self) -> None:
        """Variant names are distinct and short enough, and their overrides leave the shared sections alone."""
        if self.variants and self.variant is not None:
            raise FieldError(("variant",), "a variant's resolved spec has no variants of its own")
        searched = [s for s in TRAINING_STAGES if self.variants and getattr(self.stage(s), "hpo", None) is not None]
        if searched:  # a search's Experiment and trials are one run's: not yet one per variant
            raise FieldError(("stages", searched[0], "hpo"), "a hyperparameter search cannot be combined with variants")
        seen: set[str] = set()
        for index, variant in enumerate(self.variants):
            at = ("variants", index)
            if variant.name in seen:
                raise FieldError((*at, "name"), f"variant {variant.name!r} is named twice; each name is unique")
            if variant.name in STAGE_ORDER:  # the form's run-<variant> would be the stages' run-<stage>
                raise FieldError((*at, "name"), f"a variant cannot be named after the stage {variant.name!r}")
            if variant.name in RESERVED_VARIANT_NAMES:
                raise FieldError((*at, "name"), f"{variant.name!r} names a step of the workflow; pick another name")
            seen.add(variant.name)
            combined = f"{self.name}-{variant.name}"
            if len(combined) > MAX_PIPELINE_NAME_LENGTH:
                raise FieldError(
                    (*at, "name"),
                    f"the variant's runs, jobs and InferenceService are named {combined!r} ({len(combined)} "
                    f"characters), over the {MAX_PIPELINE_NAME_LENGTH} a pipeline name may have: shorten the "
                    "variant or pipeline name",
                )
            for stage, section in (variant.overrides.get("stages") or {}).items():
                if isinstance(section, dict) and "hpo" in section:
                    raise FieldError(
                        (*at, "overrides", "stages", stage, "hpo"),
                        "a hyperparameter search cannot be combined with variants",
                    )
            overlays = [((*at, "overrides"), variant.overrides)]
            overlays += [((*at, "profiles", name), overlay) for name, overlay in variant.profiles.items()]
            for where, overlay in overlays:
                for key, value in overlay.items():
                    # A mapping merges key by key (its keys are what it sets); anything else replaces the field.
                    paths = [(key, sub) for sub in value] if isinstance(value, dict) else [(key,)]
                    if key in VARIANT_FIXED_SECTIONS:
                        paths = [(key,)]
                    for path in paths:
                        if (problem := variant_fixed_problem(path)) is not None:
                            raise FieldError((*where, *path), problem)

    def _langfuse_keys(self) -> None:
        """Langfuse needs both keys in the cluster, and keys are only given to a named server."""
        secrets = self.cluster.secrets
        keys = {"langfuse_public_key": secrets.langfuse_public_key, "langfuse_secret_key": secrets.langfuse_secret_key}
        missing = [name for name, ref in keys.items() if ref is None]
        if self.tracking.langfuse_host is not None and missing:
            raise FieldError(
                ("cluster", "secrets", missing[0]),
                f"tracking.langfuse_host needs cluster.secrets.{missing[0]} (a Secret key): the pods get the Langfuse "
                "keys only from a Secret",
            )
        if self.tracking.langfuse_host is None and len(missing) < len(keys):
            given = next(name for name, ref in keys.items() if ref is not None)
            raise FieldError(
                ("tracking", "langfuse_host"),
                f"cluster.secrets.{given} is set but tracking.langfuse_host is not: name the Langfuse server the keys "
                "are for",
            )

    def _search_space(self, stage: str) -> None:
        """A search varies fields the stage has, with values the stage accepts, towards a metric it records."""
        section = self.stage(stage)
        hpo = getattr(section, "hpo", None)
        if hpo is None or not section.enabled:
            return
        at = ("stages", stage, "hpo")
        for index, parameter in enumerate(hpo.parameters):
            where = (*at, "parameters", index)
            problem = search_field_problem(type(section), parameter)
            if problem is not None:
                raise FieldError((*where, "path"), problem)
            document = section.model_dump(mode="json")
            for value in parameter.candidates():
                target = document
                for key in parameter.keys[:-1]:
                    target = target[key]
                target[parameter.keys[-1]] = value
                try:
                    type(section).model_validate(document)
                except ValueError as exc:
                    first = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
                    raise FieldError(
                        (*where, "values" if parameter.type == "categorical" else "min"),
                        f"stages.{stage}.{parameter.path} cannot be {value!r}: {first}",
                    ) from None
        recorded = recorded_metrics(stage, getattr(section, "algorithm", None))
        metric = hpo.objective.metric
        if metric not in recorded:
            raise FieldError(
                (*at, "objective", "metric"),
                f"stage {stage} does not record {metric!r}; it records {', '.join(recorded)}",
            )
        held_out = metric.startswith("eval_") or metric == "perplexity"
        if held_out and section.data is not None and section.data.eval_fraction == 0:
            raise FieldError(
                (*at, "objective", "metric"),
                f"{metric} is measured on held-out rows and stages.{stage}.data.eval_fraction is 0: hold rows out "
                "(data.eval_fraction: 0.05) or optimise a training metric",
            )
        if self.cluster.job_kind == "trainjob":
            raise FieldError(at, "Katib runs the trials as PyTorchJobs: a search needs cluster.job_kind pytorchjob")

    def _trainjob_can_say(self, stage: str) -> None:
        """What a Trainer v2.1 TrainJob cannot set per job is refused, not dropped: it belongs in the runtime."""
        section = self.stage(stage)
        if self.cluster.job_kind != "trainjob" or not section.enabled:
            return
        runtime = f"the ClusterTrainingRuntime {self.cluster.training_runtime}"
        if section.resources.rdma is not None:
            raise FieldError(
                ("stages", stage, "resources", "rdma"),
                f"a TrainJob cannot add the IPC_LOCK capability RDMA needs: give {runtime} the RDMA devices and "
                "IPC_LOCK, or use cluster.job_kind pytorchjob",
            )
        if section.resources.priority_class is not None:
            raise FieldError(
                ("stages", stage, "resources", "priority_class"),
                f"a TrainJob cannot set a PriorityClass: set priorityClassName in {runtime}, or use cluster.job_kind "
                "pytorchjob",
            )

    def _rdma_env_agrees(self, stage: str) -> None:
        """An NCCL setting named both in resources.rdma and in an env section must say the same in both."""
        section = self.stage(stage)
        rdma = section.resources.rdma
        if rdma is None:
            return
        for field, var in (("nccl_ib_hca", "NCCL_IB_HCA"), ("nccl_socket_ifname", "NCCL_SOCKET_IFNAME")):
            value = getattr(rdma, field)
            for where, env in ((f"stages.{stage}.env", section.env), ("cluster.env", self.cluster.env)):
                if value is not None and var in env and env[var] != value:
                    raise FieldError(
                        ("stages", stage, "resources", "rdma", field),
                        f"{where} sets {var}={env[var]} and resources.rdma.{field} says {value}: set it in one place",
                    )

    def _serving_fits_model(self) -> None:
        """vLLM splits the model over serving.gpus GPUs (tensor parallelism): they must divide its heads."""
        serving = self.stages.deploy.serving
        if not (self.stages.deploy.enabled and serving.enabled and serving.gpus > 1):
            return
        config = self.model.from_config
        shape = config.attention() if config is not None else known_shape(self.model.name_or_path)
        if shape is None or (problem := tensor_parallel_problem(shape, serving.gpus)) is None:
            return
        fits = [n for n in range(1, 17) if tensor_parallel_problem(shape, n) is None]
        raise FieldError(
            ("stages", "deploy", "serving", "gpus"),
            f"vLLM cannot split {self.model.name_or_path} over {serving.gpus} GPUs: {problem}; use one of "
            f"{', '.join(map(str, fits))}",
        )

    def data_uri(self, data: DataSpec) -> str:
        """The data URI with '{data_version}' replaced."""
        return data.uri.replace("{data_version}", self.data_version)

    def stage(self, name: str) -> StageBase:
        """The stage called `name`."""
        return getattr(self.stages, name)
