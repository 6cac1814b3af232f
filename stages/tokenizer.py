"""The tokenizer every stage uses, saved by prepare to `<run>/prepare/tokenizer/`.

For a real model it is the model's own tokenizer (`AutoTokenizer.from_pretrained` with the spec's revision and
trust_remote_code; HF_TOKEN is read from the environment by the hub client), with its own chat template, or the
one `model.chat_template` names (base models and CPT outputs have none; a known template's special tokens are
added, and the model's embeddings grow to hold them: see stages.modeling). For a model built from a config
(offline runs) it is a byte-level BPE tokenizer trained here on the run's training text, with the spec's
vocab_size including the special tokens of its family's real chat template (Qwen3's for qwen3 and qwen3_moe,
Llama-3's for llama, Gemma 3's, EXAONE 4's, Mistral's: stages.chat), so a tiny model speaks its family's format.

A tokenizer without a pad token pads with its eos token; one without an eos token is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spec.pipeline import PipelineSpec

IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def render_for_training(row: dict[str, Any]) -> str:
    """A canonical data row as the text a tokenizer learns from (the messages' contents, one per line; the
    template's markers are special tokens, never split)."""
    if "text" in row:
        return row["text"]
    messages = row.get("messages") or [*row["prompt"], *row["chosen"], *row["rejected"]]
    calls = [json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if "tool_calls" in m]
    tools = [json.dumps(row["tools"], ensure_ascii=False)] if "tools" in row else []
    return "\n".join([*tools, *(m["content"] for m in messages), *calls])


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int, template: str = "qwen3") -> Any:
    """A byte-level BPE tokenizer trained on `texts`, with exactly `vocab_size` entries at most (the special
    tokens included), wrapped as a transformers fast tokenizer, with the special tokens of the known chat
    template `template` (see stages.chat.KNOWN_TEMPLATES) and that template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from stages.chat import KNOWN_TEMPLATES, template_text

    tokens = KNOWN_TEMPLATES[template]
    # Every control token first, then the text tokens, so vocab_size counts them all.
    special = [t for t in (tokens.pad, tokens.bos, tokens.eos, *tokens.extra, *tokens.text_tokens) if t is not None]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys(special)),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # Tokens such as Qwen3's think tags stay single tokens but decode as text, as in the real tokenizers.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens.text_tokens])
    trained = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=tokens.bos,
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        model_max_length=model_max_length,
        padding_side="right",
        extra_special_tokens=[t for t in tokens.extra if t not in (tokens.bos, tokens.eos, tokens.pad)],
    )
    trained.chat_template = template_text(template)
    return trained


def load_pretrained_tokenizer(spec: PipelineSpec, needs_template: bool = True) -> Any:
    """The base model's tokenizer, from the hub or a local path, pinned to the spec's revision; with
    `model.chat_template` when the spec sets one (a known template brings its special tokens, which the model's
    embeddings grow to hold). TemplateError when a chat stage needs a template and there is none, or the
    tokenizer has no eos token."""
    from transformers import AutoTokenizer

    from stages.chat import KNOWN_TEMPLATES, TemplateError, template_text

    model = spec.model
    tokenizer = AutoTokenizer.from_pretrained(
        model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code
    )
    if model.chat_template is not None:
        known = KNOWN_TEMPLATES.get(model.chat_template)
        if known is not None:
            needed = [t for t in (known.eos, *known.extra) if t not in tokenizer.get_vocab()]
            if needed:
                tokenizer.add_special_tokens({"additional_special_tokens": needed}, replace_extra_special_tokens=False)
            if known.eos in tokenizer.get_vocab():
                tokenizer.eos_token = known.eos  # generation stops where an assistant turn ends
        tokenizer.chat_template = template_text(model.chat_template)
    elif tokenizer.chat_template is None and needs_template:
        raise TemplateError(
            f"{model.name_or_path} has no chat template, and the pipeline trains or evaluates on conversations: "
            f"set model.chat_template to one of {', '.join(KNOWN_TEMPLATES)} or to a Jinja file"
        )
    if tokenizer.eos_token is None:
        raise TemplateError(f"{model.name_or_path}'s tokenizer has no eos token: it cannot end a document or a turn")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tokenizer(spec: PipelineSpec, texts: Iterable[str], out_dir: Path, needs_template: bool = True) -> Any:
    """Build (from_config: trained here, with the family's template or model.chat_template's) or load the run's
    tokenizer, and save it to `out_dir`."""
    from stages.chat import FAMILY_TEMPLATE, KNOWN_TEMPLATES, template_text

    tiny = spec.model.from_config
    if tiny is not None:
        name = spec.model.chat_template or FAMILY_TEMPLATE[tiny.architecture]
        base = name if name in KNOWN_TEMPLATES else FAMILY_TEMPLATE[tiny.architecture]
        tokenizer = train_bpe_tokenizer(texts, tiny.vocab_size, tiny.max_position_embeddings, base)
        tokenizer.chat_template = template_text(name)
        if tokenizer.pad_token is None:  # Llama-3 and Mistral have none, as their real tokenizers
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = load_pretrained_tokenizer(spec, needs_template)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def load_tokenizer(path: Path) -> Any:
    """The tokenizer prepare saved (a `<run>/prepare/tokenizer` directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_hash(path: Path) -> str:
    """'sha256:<hex>' over the names and bytes of a saved tokenizer's files, for cache keys."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(file.read_bytes())
    return f"sha256:{digest.hexdigest()}"
