"""Chat templates: which template a model speaks, and which tokens of a rendered conversation are the assistant's.

Any template works. A conversation is rendered with the tokenizer's own template and tokenized once, as
transformers does; the labels cover what the model generates after the generation prompt: the assistant's
content and the end-of-turn token that closes it (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`,
`[|endofturn|]`, `</s>`, ...), never the prompt, the system text, the role headers, a thinking block the
generation prompt already holds, or the whitespace after the end-of-turn token.

How the assistant's text is found (`assistant_spans`):

- a template with `{% generation %}` tags (its author marked what the assistant generates): transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)`;
- any other template, first in two renders (`_bracketed_spans`): the conversation, and once more with each assistant
  content between two private-use characters; where the second without them is the first, each turn is its
  content, the end-of-turn token after it, and what the template writes between the generation prompt and a content
  (`_gap`: Mistral's space). Most rows of most templates take it (Qwen3's, 1-3 turns: a third of the CPU time);
- rendering growing prefixes decides the rest: turn i is what `render(messages[:i+1])` adds to
  `render(messages[:i], add_generation_prompt=True)`, located in the whole conversation. For templates that do
  not render a prefix the same way inside the whole conversation (Qwen3 drops past thinking blocks; Mistral puts
  the system text before the last user message only), each message is located by rendering it with a marker
  appended, and the turn starts where the whole conversation stops following the generation prompt.

We do not swap in TRL's training variants (`get_training_chat_template`): for Qwen3 the variant renders a
thinking block into every past turn, so the model would train on text it never sees at inference; a test
checks that for Llama-3 and Gemma 3, whose variants render the same text, both give the same labels.

A template that rejects a conversation (Gemma's or Mistral's role alternation, a template without system
support) raises ConversationError with the template's own message, for prepare to report with the data row.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np

IGNORE_INDEX = -100

_MARK = "\ue000"  # a private-use character: not whitespace (trim keeps it), not in any template's syntax
_OPEN, _CLOSE = "\ue001", "\ue002"  # around each assistant content, for `_bracketed_spans`


class ConversationError(ValueError):
    """The chat template cannot render this conversation, or renders it without an assistant turn to learn."""


class TemplateError(ValueError):
    """A chat template (model.chat_template or the tokenizer's own) that cannot be used at all."""


# --------------------------------------------------------------------------- known templates


@dataclass(frozen=True)
class TemplateTokens:
    """The special tokens a template writes, as a tokenizer trained for it must have them."""

    bos: str | None
    eos: str  # what ends an assistant turn, the token generation stops at
    pad: str | None
    extra: tuple[str, ...] = ()  # role markers and other control tokens
    text_tokens: tuple[str, ...] = ()  # single tokens that decode as text (Qwen3's think tags)


QWEN_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Single tokens of Qwen2.5's and Qwen3's vocabularies that decode as text: vLLM's hermes tool-call parser finds a
call between the first two."""

KNOWN_TEMPLATES: dict[str, TemplateTokens] = {
    "chatml": TemplateTokens(None, "<|im_end|>", "<|endoftext|>", ("<|im_start|>",)),
    "qwen2_5": TemplateTokens(None, "<|im_end|>", "<|endoftext|>", ("<|im_start|>",), QWEN_TOOL_TOKENS),
    "qwen3": TemplateTokens(
        None, "<|im_end|>", "<|endoftext|>", ("<|im_start|>",), ("<think>", "</think>", *QWEN_TOOL_TOKENS)
    ),
    "llama3": TemplateTokens(
        "<|begin_of_text|>", "<|eot_id|>", None, ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
    ),
    "gemma3": TemplateTokens("<bos>", "<end_of_turn>", "<pad>", ("<eos>", "<start_of_turn>")),
    "exaone4": TemplateTokens(
        "[BOS]",
        "[|endofturn|]",
        "[PAD]",
        ("[|system|]", "[|user|]", "[|assistant|]", "[|tool|]"),
        ("<think>", "</think>"),
    ),
    "mistral": TemplateTokens("<s>", "</s>", None, ("<unk>", "[INST]", "[/INST]")),
}
"""Template names `model.chat_template` accepts. qwen2_5, qwen3, llama3 and gemma3 are the models' own templates as TRL
ships them (trl/chat_templates/); chatml, exaone4 and mistral are in stages/chat_templates/."""

FAMILY_TEMPLATE: dict[str, str] = {
    "qwen2": "qwen2_5",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "llama": "llama3",
    "gemma3": "gemma3",
    "exaone4": "exaone4",
    "mistral": "mistral",
}
"""The template of each `model.from_config.architecture`: a tiny model speaks its family's real template."""

_TRL_TEMPLATES = {
    "qwen2_5": "qwen2_5.jinja",
    "qwen3": "qwen3.jinja",
    "llama3": "llama3.jinja",
    "gemma3": "gemma3.jinja",
}


def template_text(name_or_path: str) -> str:
    """The Jinja source of a known template name, or of a template file (a path)."""
    if name_or_path in _TRL_TEMPLATES:
        return (resources.files("trl") / "chat_templates" / _TRL_TEMPLATES[name_or_path]).read_text(encoding="utf-8")
    if name_or_path in KNOWN_TEMPLATES:
        return (resources.files("stages") / "chat_templates" / f"{name_or_path}.jinja").read_text(encoding="utf-8")
    path = Path(os.path.expanduser(name_or_path))
    if not path.is_file():
        known = ", ".join(KNOWN_TEMPLATES)
        raise TemplateError(f"model.chat_template: {name_or_path!r} is neither a known template ({known}) nor a file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"model.chat_template: cannot read {path}: {exc}") from None


# TRL's own check (trl.chat_template_utils.has_generation_markers) is this one pattern, but importing its module
# loads transformers' whole modeling stack: measured 5.7 s, a third of prepare on a tiny run, where nothing else needs
# it. tests/test_chat_templates.py holds the two to the same answers.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tags(template: str) -> bool:
    """Whether a template marks the assistant's output with `{% generation %}` (TRL's check, `{%-`/`-%}` included)."""
    return _GENERATION_TAG.search(template) is not None


# --------------------------------------------------------------------------- rendering


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    generation_prompt: bool = False,
    enable_thinking: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as the tokenizer's template writes it (with the functions `tools` offers, where given);
    ConversationError when the template refuses it."""
    from jinja2.exceptions import TemplateError as JinjaError

    try:
        shipped = _shipped_template(tokenizer)
        if shipped is not None:
            return shipped.render(
                messages=_template_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=generation_prompt,
                **tokenizer.special_tokens_map,  # bos_token, eos_token, ...: transformers passes them too
                enable_thinking=enable_thinking,
            )
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            enable_thinking=enable_thinking,
        )
    except JinjaError as exc:
        raise ConversationError(f"the chat template rejects this conversation: {exc}") from None


# A template this project ships (KNOWN_TEMPLATES, byte for byte) is trusted code: it is rendered in a plain Jinja
# environment set up as transformers sets up its sandbox (`_cached_compile_jinja_template`: the same options, filter
# and globals), with the messages prepared as `apply_chat_template` prepares them (keys whose value is None dropped,
# reasoning under each name templates read). Measured on 3,000 bench conversations (bench/prepare_corpus.py's),
# Qwen3's template: 0.21 s against 0.50 s through `apply_chat_template`, whose sandbox checks every attribute the
# template reads and whose inputs are copied to plain data first. Any other template (a hub model's own, a file of
# the user's) is untrusted and goes through transformers' sandbox. tests/test_chat_templates.py holds the two to the
# same text on every shipped template.
def _shipped_template(tokenizer: Any) -> Any:
    """The compiled template, where the tokenizer's chat template is one this project ships; otherwise None."""
    template = getattr(tokenizer, "chat_template", None)
    return _compiled(template) if isinstance(template, str) else None


@cache
def _shipped_texts() -> frozenset[str]:
    return frozenset(template_text(name) for name in KNOWN_TEMPLATES)


@cache
def _compiled(template: str) -> Any:
    """`template` compiled, if it is one this project ships (None for any other)."""
    if template not in _shipped_texts():
        return None
    import jinja2
    import jinja2.ext

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=dict, namespace=jinja2.utils.Namespace
    )
    return environment.from_string(template)


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as `apply_chat_template` hands them to the template: None values dropped (as it does inline),
    then a reasoning given under any of its names also under each name templates read (its own helper)."""
    from transformers.utils.chat_template_utils import _alias_reasoning_fields

    return _alias_reasoning_fields([{k: v for k, v in m.items() if v is not None} for m in messages])


def check_tools_rendered(text: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
    """ConversationError when the template left out a tool call, a tool's answer or an offered function: a
    template without tool syntax (Gemma 3's, Llama 3's original one) drops them silently, and the model would
    learn answers to questions it never saw."""
    names = [t["function"]["name"] for t in tools or []]
    names += [c["function"]["name"] for m in messages for c in m.get("tool_calls", [])]
    answers = [m["content"] for m in messages if m["role"] == "tool"]
    missing = [repr(n) for n in dict.fromkeys(names) if n not in text]
    missing += [f"the tool answer {a[:30]!r}" for a in answers if a not in text]
    if missing:
        raise ConversationError(
            f"the chat template does not render tools ({', '.join(missing[:3])} left out): {_TOOL_SYNTAX}"
        )


_TOOL_SYNTAX = (
    "train tool calls on a model whose template has tool syntax (Qwen2.5, Qwen3), or set model.chat_template to such "
    "a template"
)


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))  # noqa: RUF071 (strings, character by character, as meant)


def _marked(messages: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """The messages with a marker appended to message i's content."""
    out = [dict(m) for m in messages]
    out[i]["content"] = f"{out[i]['content']}{_MARK}"
    return out


def _stop_tokens(tokenizer: Any) -> list[str]:
    """Tokens that may close an assistant turn: the special and added (control) tokens, longest first; not the
    tokens that decode as text (Qwen3's think tags)."""
    stops = _STOPS.get(tokenizer)
    if stops is None:
        text_tokens = {t for tokens in KNOWN_TEMPLATES.values() for t in tokens.text_tokens}
        found = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
        stops = sorted((t for t in found if t and t not in text_tokens), key=len, reverse=True)
        _STOPS[tokenizer] = stops
    return stops


_STOPS: WeakKeyDictionary[Any, list[str]] = WeakKeyDictionary()


def _turn_end(tokenizer: Any, text: str, at: int) -> int | None:
    """The end of the end-of-turn token that `text` has at `at` (after optional whitespace), else None."""
    skipped = len(text[at:]) - len(text[at:].lstrip(" \n"))
    for token in _stop_tokens(tokenizer):
        if text.startswith(token, at + skipped):
            return at + skipped + len(token)
    return None


def _content_turn_end(tokenizer: Any, text: str, content_end: int, calls: bool) -> int | None:
    """Where the turn whose content ends at `content_end` ends: after the end-of-turn token that follows it, or,
    for a turn that calls tools (its calls come after the content), after the next end-of-turn token."""
    if not calls:
        return _turn_end(tokenizer, text, content_end)
    found = [at + len(token) for token in _stop_tokens(tokenizer) if (at := text.find(token, content_end)) >= 0]
    return min(found) if found else None


def _ends_turn(tokenizer: Any, said: str) -> bool:
    """Whether `said` ends with an end-of-turn token."""
    return any(said.endswith(token) for token in _stop_tokens(tokenizer))


def assistant_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    enable_thinking: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of what the assistant generates in it (each turn's
    content, its tool calls and its reasoning where the template renders them into the turn, and its end-of-turn
    token)."""
    text = render(tokenizer, messages, enable_thinking=enable_thinking, tools=tools)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ConversationError("an assistant message first: there is no prompt it answers")
        # A turn that reasons was generated in thinking mode: its generation prompt holds no (empty) thinking block.
        thinking = enable_thinking or "</think>" in message["content"]
        prompt = render(tokenizer, messages[:i], generation_prompt=True, enable_thinking=thinking, tools=tools)
        last = i == len(messages) - 1 and thinking == enable_thinking
        turn = text if last else render(tokenizer, messages[: i + 1], enable_thinking=thinking, tools=tools)
        said = turn[len(prompt) :].rstrip(" \n") if turn.startswith(prompt) else ""
        if said and text.startswith(turn[: len(prompt) + len(said)]) and _ends_turn(tokenizer, said):
            start, end = len(prompt), len(prompt) + len(said)  # a prefix-preserving template (most of them)
        else:
            start, end = _located_turn(tokenizer, messages, i, text, prompt, thinking, tools)
        if spans and start < spans[-1][1]:
            raise ConversationError(f"the chat template renders assistant message {i} before the one ahead of it")
        spans.append((start, end))
    if not spans:
        raise ConversationError("no assistant message: nothing to learn from")
    return text, spans


def _bracketed_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    enable_thinking: bool,
    tools: list[dict[str, Any]] | None,
    text: str | None = None,
) -> tuple[str, list[tuple[int, int]]] | None:
    """`assistant_spans` in two renders instead of 1 + 2 per assistant turn: the conversation as it is, and once
    more with each assistant content between two private-use characters. Where the second, without them, is the
    first character for character (the template wrote each content where it is, unchanged), a turn is its content
    and the end-of-turn token after it (after its tool calls, where it makes some), from where the generation prompt
    ends (`_gap`). None where that does not hold (a template that trims, splits or moves a content: Qwen3's
    reasoning turns, Mistral's system text), or a turn does not end with an end-of-turn token: `assistant_spans`
    decides those, and tests/test_chat_templates.py holds the two to the same labels.

    `text` is the conversation already rendered, where the caller has it. Where it is not and every assistant
    content is plain for a template this module ships (`_plain_contents`), the bracketed render is the only one:
    the template is known to write such a content as it is, whatever is around it."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0 or any(_OPEN in m["content"] or _CLOSE in m["content"] for m in messages):
        return None
    gap = _gap(tokenizer, enable_thinking)
    if gap is None:
        return None
    bracketed = [dict(m) for m in messages]
    for i in turns:
        bracketed[i]["content"] = f"{_OPEN}{messages[i]['content']}{_CLOSE}"
    marked = render(tokenizer, bracketed, enable_thinking=enable_thinking, tools=tools)
    if marked.count(_OPEN) != len(turns) or marked.count(_CLOSE) != len(turns):
        return None
    unmarked = marked.replace(_OPEN, "").replace(_CLOSE, "")
    if text is None and not _plain_contents(tokenizer, messages, turns):
        text = render(tokenizer, messages, enable_thinking=enable_thinking, tools=tools)
    if text is not None and unmarked != text:
        return None
    text = unmarked
    spans: list[tuple[int, int]] = []
    removed = 0  # bracket characters before the position, in `marked`
    at = 0
    for i in turns:
        opened = marked.index(_OPEN, at)
        closed = marked.index(_CLOSE, opened)
        start, content_end = opened - removed - len(gap), closed - removed - 1
        removed += 2
        at = closed + 1
        if text[start : start + len(gap)] != gap:
            return None
        end = _content_turn_end(tokenizer, text, content_end, "tool_calls" in messages[i])
        if end is None or (spans and start < spans[-1][1]):
            return None
        spans.append((start, end))
    return text, spans


def _plain_contents(tokenizer: Any, messages: list[dict[str, Any]], turns: list[int]) -> bool:
    """Whether the tokenizer's template is one of KNOWN_TEMPLATES, as shipped, and each assistant content is plain
    for it: text without whitespace at either end and without thinking tags. Those templates test a content only
    for thinking tags and trim only its ends (tests/test_bracketed_spans.py renders each of them both ways on such
    contents), so the bracketed render without its brackets is the conversation's, and `_bracketed_spans` need not
    render it a second time to compare: measured, that render was a fifth of prepare's CPU time on conversations."""
    known = _KNOWN_TEXT.get(tokenizer)
    if known is None:
        texts = {template_text(name) for name in KNOWN_TEMPLATES}
        known = _KNOWN_TEXT[tokenizer] = tokenizer.chat_template in texts
    if not known:
        return False
    for i in turns:
        content = messages[i]["content"]
        if not isinstance(content, str) or not content or content != content.strip() or "think>" in content:
            return False
    return True


_KNOWN_TEXT: WeakKeyDictionary[Any, bool] = WeakKeyDictionary()


def _gap(tokenizer: Any, enable_thinking: bool) -> str | None:
    """What the model generates between the generation prompt and an answer's content in this template (Mistral's
    space after `[/INST]`; Qwen3's empty thinking block in thinking mode; mostly nothing), found once per tokenizer
    on a one-turn conversation by `assistant_spans`; None when that conversation cannot be rendered so."""
    gaps = _GAPS.setdefault(tokenizer, {})
    if enable_thinking not in gaps:
        content = "\ue003"
        probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": content}]
        try:
            text, [(start, _)] = assistant_spans(tokenizer, probe, enable_thinking)
        except (ConversationError, TemplateError, ValueError):
            gaps[enable_thinking] = None
        else:
            at = text.find(content, start)
            gaps[enable_thinking] = text[start:at] if at >= 0 else None
    return gaps[enable_thinking]


_GAPS: WeakKeyDictionary[Any, dict[bool, str | None]] = WeakKeyDictionary()


def _located_turn(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    i: int,
    text: str,
    prompt: str,
    enable_thinking: bool,
    tools: list[dict[str, Any]] | None,
) -> tuple[int, int]:
    """Turn i's span in `text` for a template that renders it differently in the whole conversation: the end
    of its content (where a marker appended to it shows up) and the end-of-turn token after it; the start,
    after the message before it, where `text` stops following the generation prompt."""
    content_end = _common_prefix(text, render(tokenizer, _marked(messages, i), False, enable_thinking, tools))
    end = _content_turn_end(tokenizer, text, content_end, "tool_calls" in messages[i])
    if end is None:
        raise ConversationError(
            f"the chat template closes assistant message {i} with no end-of-turn token: the model would never "
            "learn to stop (set model.chat_template to a template that ends each assistant turn with one)"
        )
    before_in_text = _common_prefix(text, render(tokenizer, _marked(messages, i - 1), False, enable_thinking, tools))
    marked_prompt = render(tokenizer, _marked(messages[:i], i - 1), True, enable_thinking, tools)
    before_in_prompt = _common_prefix(prompt, marked_prompt)
    header = prompt[before_in_prompt:]  # the closing of message i-1 and the generation prompt
    start = before_in_text + _common_prefix(text[before_in_text:], header)
    calls_only = "tool_calls" in messages[i] and not messages[i]["content"]
    if calls_only:  # the turn starts where its (empty) content is: the header may share a prefix with the calls
        start = min(start, content_end)
    if not before_in_text <= start < content_end + calls_only:
        raise ConversationError(f"the chat template renders assistant message {i} where it cannot be found")
    return start, end


# --------------------------------------------------------------------------- tokens and labels


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    enable_thinking: bool = False,
    assistant_only_loss: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and labels of a conversation (offering the functions `tools`, where given) rendered with the
    tokenizer's chat template: labels are the ids on the assistant's tokens, its tool calls included (see the
    module docstring), and -100 elsewhere, the tools' answers included; every token is labelled when not
    `assistant_only_loss`. ConversationError when the template refuses it, leaves its tools out, or it has no
    assistant turn."""
    ids, mask = conversation_mask(tokenizer, messages, enable_thinking, tools)
    if not assistant_only_loss:
        return list(ids), list(ids)
    return list(ids), [tid if m else IGNORE_INDEX for tid, m in zip(ids, mask, strict=True)]


def conversation_mask(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    enable_thinking: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its assistant mask (1 on what the assistant generates): what
    `tokenize_conversation` labels, without building the labels (the token cache stores the mask as it is)."""
    [result] = conversation_masks(tokenizer, [(messages, tools)], enable_thinking)
    if isinstance(result, ConversationError):
        raise result
    return result


def conversation_masks(
    tokenizer: Any,
    conversations: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]],
    enable_thinking: bool = False,
) -> list[tuple[list[int], list[int]] | ConversationError]:
    """`conversation_mask` of each (messages, tools), or the ConversationError that refuses it, in three passes:
    every conversation rendered, then every text encoded, then masked. Measured on 3,000 bench conversations
    (bench/prepare_corpus.py's): 28% less CPU than each conversation through all three in turn, since the encoder's
    tables stay in the CPU's caches from one encode to the next instead of being evicted by the template renders."""
    template = tokenizer.chat_template
    if template is None:
        raise TemplateError("the tokenizer has no chat template: set model.chat_template (e.g. chatml or llama3)")
    tagged = has_generation_tags(template)
    results: list[Any] = []
    for messages, tools in conversations:
        try:
            results.append(_rendered(tokenizer, messages, enable_thinking, tools, tagged))
        except ConversationError as exc:
            results.append(exc)
    texts = [r[0] for r in results if isinstance(r, tuple) and isinstance(r[0], str)]
    encoded = iter(_encode_many(tokenizer, texts))
    out: list[tuple[list[int], list[int]] | ConversationError] = []
    for result in results:
        if isinstance(result, ConversationError):
            out.append(result)
            continue
        try:
            if not isinstance(result[0], str):  # a {% generation %}-tagged template: transformers' mask
                ids, mask = result
                _check_turns_end(tokenizer, ids, mask, range(len(ids)))
            else:
                text, spans = result
                ids, ends, offsets = next(encoded)
                masked = _byte_span_mask(tokenizer, text, ends, spans) if ends is not None else None
                if masked is None:  # not a byte-level tokenizer, or its bytes do not add up: the encoder's offsets
                    if offsets is None:
                        ids, offsets = _encode(tokenizer, text)
                    masked = _span_mask(offsets, spans)
                mask, last_tokens = masked
                _check_turns_end(tokenizer, ids, mask, last_tokens)
        except ConversationError as exc:
            out.append(exc)
            continue
        out.append((ids, mask))
    return out


def _rendered(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    enable_thinking: bool,
    tools: list[dict[str, Any]] | None,
    tagged: bool,
) -> tuple[Any, Any]:
    """A conversation rendered: (text, the assistant's character spans), or, for a `{% generation %}`-tagged
    template, (ids, mask) as transformers tokenizes it."""
    text = None
    if tools or any(m["role"] == "tool" or "tool_calls" in m for m in messages):
        try:
            text = render(tokenizer, messages, enable_thinking=enable_thinking, tools=tools)
        except ConversationError as exc:
            raise ConversationError(f"{exc} (a conversation with tools: {_TOOL_SYNTAX})") from None
        check_tools_rendered(text, messages, tools)
    if tagged:
        return _generation_mask(tokenizer, messages, enable_thinking, tools)
    bracketed = _bracketed_spans(tokenizer, messages, enable_thinking, tools, text)
    return bracketed or assistant_spans(tokenizer, messages, enable_thinking, tools)


def _generation_mask(
    tokenizer: Any, messages: list[dict[str, Any]], enable_thinking: bool, tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """transformers' assistant mask of a `{% generation %}`-tagged template, without the whitespace tokens that
    follow an end-of-turn token inside the tagged block (nothing the model generates)."""
    from jinja2.exceptions import TemplateError as JinjaError

    try:
        out = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            enable_thinking=enable_thinking,
        )
    except JinjaError as exc:
        raise ConversationError(f"the chat template rejects this conversation: {exc}") from None
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    for j in range(len(ids) - 1, -1, -1):
        if mask[j] and (j + 1 == len(ids) or not mask[j + 1]):  # the last token of a span
            k = j
            while k >= 0 and mask[k] and not tokenizer.decode([ids[k]]).strip():
                mask[k] = 0
                k -= 1
    if not any(mask):
        raise ConversationError("the chat template's {% generation %} blocks cover no token of this conversation")
    return ids, mask


def _encode(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text`, no special tokens added: the fast tokenizer's own encoder (what
    `tokenizer(text, return_offsets_mapping=True)` calls, without its 0.4 ms of wrapping per conversation)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], encoded["offset_mapping"]
    encoding = backend.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added: what `tokenizer(texts, add_special_tokens=False)` gives,
    from the fast tokenizer's encoder without the offsets it would compute and drop (`encode_batch_fast`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


def _encode_many(
    tokenizer: Any, texts: list[str]
) -> list[tuple[list[int], np.ndarray | None, list[tuple[int, int]] | None]]:
    """Token ids of each text, no special tokens added, with where each token ends: for a byte-level tokenizer
    (`_byte_lengths`) the UTF-8 byte at which each token ends, from the encoder without its offsets
    (`encode_batch_fast`), which measured a third less CPU per conversation than with them turned into Python tuples
    (2,000 bench conversations, 0.54 against 0.94 ms, medians of 7 alternating runs); for any other, the encoder's
    character offsets (`_encode`). (ids, byte ends, None) or (ids, None, offsets)."""
    lengths = _byte_lengths(tokenizer)
    if lengths is None:
        return [(ids, None, offsets) for ids, offsets in (_encode(tokenizer, text) for text in texts)]
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [(e.ids, np.cumsum(lengths[np.asarray(e.ids, dtype=np.int64)]), None) for e in encodings]


def _byte_lengths(tokenizer: Any) -> np.ndarray | None:
    """The UTF-8 length of each token id where the tokenizer is a byte-level BPE (Qwen's, Llama 3's, EXAONE's, the
    tiny models'): its tokens are the text's bytes, one character of the vocabulary per byte, so their ends are the
    running sum of these lengths. None for any other tokenizer (Gemma's and Mistral's SentencePiece pieces), one
    that normalizes other than by NFC, adds a prefix space, falls back to bytes or strips around added tokens."""
    if tokenizer in _BYTE_LENGTHS:
        return _BYTE_LENGTHS[tokenizer]
    _BYTE_LENGTHS[tokenizer] = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    config = json.loads(backend.to_str())
    model, pre, normalizer = config.get("model") or {}, config.get("pre_tokenizer") or {}, config.get("normalizer")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [step for step in steps if step.get("type") == "ByteLevel"]
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or len(byte_level) != 1
        or byte_level[0].get("add_prefix_space")
        or normalizer not in (None, {"type": "NFC"})
        or any(token.get("lstrip") or token.get("rstrip") for token in config.get("added_tokens", []))
    ):
        return None
    alphabet = set(_byte_alphabet())
    lengths = np.zeros(backend.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for piece, index in backend.get_vocab(with_added_tokens=False).items():
        if not set(piece) <= alphabet:
            return None
        lengths[index] = len(piece)
    for index, token in backend.get_added_tokens_decoder().items():
        lengths[index] = len(token.content.encode("utf-8"))
    _BYTE_LENGTHS[tokenizer] = lengths
    _NFC[tokenizer] = normalizer is not None
    return lengths


_BYTE_LENGTHS: WeakKeyDictionary[Any, np.ndarray | None] = WeakKeyDictionary()
_NFC: WeakKeyDictionary[Any, bool] = WeakKeyDictionary()


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()


def _byte_span_mask(
    tokenizer: Any, text: str, ends: np.ndarray, spans: list[tuple[int, int]]
) -> tuple[list[int], list[int]] | None:
    """`_span_mask` from the tokens' byte ends instead of the encoder's offsets: 1 on each token that overlaps a
    span's bytes. None where the tokens' bytes are not the text's (an NFC normalizer meeting text that is not NFC):
    the caller asks the encoder for offsets."""
    data = text.encode("utf-8")
    if (len(ends) and int(ends[-1]) != len(data)) or (
        _NFC.get(tokenizer) and not unicodedata.is_normalized("NFC", text)
    ):
        return None
    ascii_text = len(data) == len(text)
    starts = np.concatenate(([0], ends[:-1]))
    mask = np.zeros(len(ends), dtype=np.int8)
    last_tokens = []
    for start, end in spans:
        if not ascii_text:
            start, end = len(text[:start].encode("utf-8")), len(text[:end].encode("utf-8"))
        lo, hi = int(np.searchsorted(ends, start, "right")), int(np.searchsorted(starts, end, "left"))
        mask[lo:hi] = 1
        last_tokens.append(hi - 1)
    return mask.tolist(), last_tokens


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """1 on each token that overlaps a character span, else 0; and the last token of each span. Offsets of a
    byte-level BPE only grow, so each span's tokens are found by bisection; else token by token."""
    n = len(offsets)
    starts = [a for a, _ in offsets]
    ends = [b for _, b in offsets]
    mask = [0] * n
    last_tokens = []
    if starts == sorted(starts) and ends == sorted(ends):  # (sorted: linear on a sorted list, in C)
        for start, end in spans:
            lo, hi = bisect.bisect_right(ends, start), bisect.bisect_left(starts, end)
            mask[lo:hi] = [1] * (hi - lo)
            last_tokens.append(hi - 1)
        return mask, last_tokens
    for start, end in spans:
        for j, (tok_start, tok_end) in enumerate(offsets):
            if tok_end > start and tok_start < end:
                mask[j] = 1
    return mask, list(range(n))


def _check_turns_end(tokenizer: Any, ids: list[int], mask: list[int], candidates: Iterable[int]) -> None:
    """Every labelled span must end with an end-of-turn token, or the model never learns to stop: each of the
    `candidates` positions that ends a run of labelled tokens holds one."""
    stops = _STOP_IDS.get(tokenizer)
    if stops is None:
        stops = _STOP_IDS[tokenizer] = frozenset(tokenizer.convert_tokens_to_ids(_stop_tokens(tokenizer)))
    for j in candidates:
        if 0 <= j < len(mask) and mask[j] and (j + 1 == len(mask) or not mask[j + 1]) and ids[j] not in stops:
            raise ConversationError(
                f"an assistant turn ends with {tokenizer.decode([ids[j]])!r}, not an end-of-turn token: the model "
                "would never learn to stop (use a chat template that closes each assistant turn with one)"
            )


_STOP_IDS: WeakKeyDictionary[Any, frozenset[int]] = WeakKeyDictionary()


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids generation stops at: eos and the token that closes an assistant turn in this template."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    try:
        text, spans = assistant_spans(tokenizer, probe)
    except (ConversationError, TemplateError):
        return ids
    end_of_turn = tokenizer(text[spans[0][0] : spans[0][1]], add_special_tokens=False)["input_ids"][-1:]
    return ids + [t for t in end_of_turn if t not in ids]
