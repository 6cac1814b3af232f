"""The base model section of a pipeline: which model every stage starts from, and its tiny stand-in."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from spec.fields import FieldError, Int64, OneLine, Seed, StrictModel
from spec.model_shapes import AttentionShape

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
    head_dim: Int64 = Field(
        32,
        gt=0,
        description="Per-head dimension (vLLM's CPU attention serves 32, 64, 80, 96, 112, 128 and up; not 16).",
    )
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
        if self.architecture == "qwen2" and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise FieldError(
                ("head_dim",),
                f"a qwen2 model's heads are hidden_size / num_attention_heads = "
                f"{self.hidden_size / self.num_attention_heads:g} wide (vLLM and Qwen2.5's configs derive it), not "
                f"head_dim {self.head_dim}: set hidden_size to {self.head_dim * self.num_attention_heads}, or "
                "num_attention_heads to match",
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
