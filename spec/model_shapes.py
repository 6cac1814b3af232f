"""Attention shapes of well-known base models, for the checks that must hold before any weights are downloaded.

Serving a model over N GPUs with vLLM (tensor parallelism) needs N to divide the attention heads, and the
key/value heads to be divisible by N or N by them (vLLM replicates KV heads when N exceeds them). The spec checks
that at submit time for the model it names: a model built from `model.from_config` has its shape in the spec,
and a well-known hub model (or a local copy of one, named after it) has it in `KNOWN_MODELS`, taken from each
model's published `config.json`. Any other model is checked by vLLM itself when it loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """Query heads and key/value heads of a model."""

    heads: int
    kv_heads: int


KNOWN_MODELS: dict[str, AttentionShape] = {
    # Qwen2.5 (the -Instruct and -Coder repos share the shape)
    "qwen2.5-0.5b": AttentionShape(14, 2),
    "qwen2.5-1.5b": AttentionShape(12, 2),
    "qwen2.5-3b": AttentionShape(16, 2),
    "qwen2.5-7b": AttentionShape(28, 4),
    "qwen2.5-14b": AttentionShape(40, 8),
    "qwen2.5-32b": AttentionShape(40, 8),
    "qwen2.5-72b": AttentionShape(64, 8),
    # Qwen3 (dense and mixture-of-experts); the -Base and -FP8 repos share the shape.
    "qwen3-0.6b": AttentionShape(16, 8),
    "qwen3-1.7b": AttentionShape(16, 8),
    "qwen3-4b": AttentionShape(32, 8),
    "qwen3-8b": AttentionShape(32, 8),
    "qwen3-14b": AttentionShape(40, 8),
    "qwen3-32b": AttentionShape(64, 8),
    "qwen3-30b-a3b": AttentionShape(32, 4),
    "qwen3-235b-a22b": AttentionShape(64, 4),
    # Llama 3.x
    "meta-llama-3-8b": AttentionShape(32, 8),
    "meta-llama-3-70b": AttentionShape(64, 8),
    "llama-3.1-8b": AttentionShape(32, 8),
    "llama-3.1-70b": AttentionShape(64, 8),
    "llama-3.2-1b": AttentionShape(32, 8),
    "llama-3.2-3b": AttentionShape(24, 8),
    # Mistral
    "mistral-7b-v0.1": AttentionShape(32, 8),
    "mistral-7b-v0.3": AttentionShape(32, 8),
    # Gemma 3
    "gemma-3-1b": AttentionShape(4, 1),
    "gemma-3-4b": AttentionShape(8, 4),
    "gemma-3-12b": AttentionShape(16, 8),
    "gemma-3-27b": AttentionShape(32, 16),
}
"""Model name (the last path component, lower-case, without the variant suffixes below) → attention shape."""

KNOWN_MIXTURES = frozenset({"qwen3-30b-a3b", "qwen3-235b-a22b"})
"""The models of `KNOWN_MODELS` that are mixtures of experts."""

_VARIANTS = ("-base", "-instruct", "-it", "-pt", "-hf", "-fp8", "-chat")


def _known_name(name_or_path: str) -> str:
    """The `KNOWN_MODELS` key a hub id or a path ending in a model's name would have."""
    name = name_or_path.rstrip("/").rsplit("/", 1)[-1].lower()
    changed = True
    while changed:
        changed = False
        for suffix in _VARIANTS:
            if name.endswith(suffix) and name.removesuffix(suffix) != "":
                name, changed = name.removesuffix(suffix), True
    return name


def known_shape(name_or_path: str) -> AttentionShape | None:
    """The attention shape of a well-known model named by hub id or by a path ending in its name."""
    return KNOWN_MODELS.get(_known_name(name_or_path))


def known_mixture(name_or_path: str) -> bool:
    """Whether a well-known model named by hub id or by a path ending in its name is a mixture of experts."""
    return _known_name(name_or_path) in KNOWN_MIXTURES


def tensor_parallel_problem(shape: AttentionShape, size: int) -> str | None:
    """Why `size` GPUs cannot split this model's attention (vLLM's rule), or None when they can."""
    if size <= 1:
        return None
    if shape.heads % size:
        return f"{size} does not divide the model's {shape.heads} attention heads"
    if shape.kv_heads % size and size % shape.kv_heads:
        return f"{size} and the model's {shape.kv_heads} key/value heads do not divide one another"
    return None
