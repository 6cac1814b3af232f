# ruff: noqa: E501  (the Qwen3 chat template below is kept byte-identical, long lines included)
"""The tokenizer every stage uses, saved by prepare to `<run>/prepare/tokenizer/`.

For a real model it is the model's own tokenizer (`AutoTokenizer.from_pretrained` with the spec's revision and
trust_remote_code; HF_TOKEN is read from the environment by the hub client). For a model built from a config
(offline runs) it is a byte-level BPE tokenizer trained here on the run's training text, with the spec's
vocab_size including the special tokens. Either way it ends up with:

- the Qwen3 chat template (`<|im_start|>role\n...<|im_end|>\n`; the last assistant turn and, with
  `enable_thinking=False`, the generation prompt carry the empty thinking block `<think>\n\n</think>\n\n`),
  kept byte-identical to Qwen3's so TRL recognises it and swaps in its training variant for assistant-only loss;
- eos `<|im_end|>` (the end of an assistant turn) and pad `<|endoftext|>` for the trained tokenizer; a loaded
  tokenizer without a pad token pads with its eos token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workflows.spec import PipelineSpec

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_OPEN, THINK_CLOSE)
"""The first ids of a trained tokenizer, in this order. The think tags decode like text (not special)."""

QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
"""Qwen3's chat template (Apache-2.0, from the Qwen3 tokenizer_config.json), unchanged."""


def render_for_training(row: dict[str, Any]) -> str:
    """A canonical data row as the text the tokenizer learns from (chat rows with their role markers)."""
    if "text" in row:
        return row["text"]
    messages = row.get("messages") or [*row["prompt"], *row["chosen"], *row["rejected"]]
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int) -> Any:
    """A byte-level BPE tokenizer trained on `texts`, with exactly `vocab_size` entries at most (the special
    tokens included), wrapped as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # The think tags stay single tokens but decode as text, as in Qwen3.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=model_max_length,
        padding_side="right",
    )


def load_pretrained_tokenizer(spec: PipelineSpec) -> Any:
    """The base model's tokenizer, from the hub or a local path, pinned to the spec's revision."""
    from transformers import AutoTokenizer

    model = spec.model
    tokenizer = AutoTokenizer.from_pretrained(
        model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code
    )
    if tokenizer.chat_template is None:
        missing = [t for t in (IM_START, IM_END) if t not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing})
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tokenizer(spec: PipelineSpec, texts: Iterable[str], out_dir: Path) -> Any:
    """Build (from_config) or load the run's tokenizer, give it the chat template, and save it to `out_dir`."""
    tiny = spec.model.from_config
    if tiny is not None:
        tokenizer = train_bpe_tokenizer(texts, tiny.vocab_size, tiny.max_position_embeddings)
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    else:
        tokenizer = load_pretrained_tokenizer(spec)
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
