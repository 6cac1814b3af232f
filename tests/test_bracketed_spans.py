"""The two-render labelling (`stages.chat._bracketed_spans`) gives exactly the labels of the prefix-rendering one
(`assistant_spans`) for every family's template, on conversations of every shape prepare meets (system prompts,
one to three turns, contents with edge whitespace, reasoning turns, tool calls), and it is the path most rows take:
it is what makes conversations tokenize at the library's speed (bench/prepare_corpus.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_chat_templates import tokenizer_for
from test_tool_calls import canonical

from stages import chat
from stages.chat import ConversationError, tokenize_conversation

SENTENCES = ["서울은 크고 넓습니다.", "부산은 바다가 아름답습니다.", "짧게 답하세요.", "네, 알겠습니다.", "왜요?"]


def conversations(seed: int = 0, count: int = 40) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    out = []
    for n in range(count):
        messages: list[dict[str, Any]] = []
        if n % 3 == 0:
            messages.append({"role": "system", "content": rng.choice(SENTENCES)})
        for _ in range(1 + n % 3):
            messages.append({"role": "user", "content": " ".join(rng.sample(SENTENCES, 2))})
            answer = rng.choice(SENTENCES)
            if n % 5 == 1:
                answer = f"\n{answer}  "  # edge whitespace: templates that trim it must fall back
            if n % 7 == 2:
                answer = f"<think>\n{rng.choice(SENTENCES)}\n</think>\n\n{answer}"
            messages.append({"role": "assistant", "content": answer})
        out.append(messages)
    return out


def labels_both_ways(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[Any, Any, bool]:
    fast_used = chat._bracketed_spans(tokenizer, messages, kwargs.get("enable_thinking", False), kwargs.get("tools"))
    fast = tokenize_conversation(tokenizer, messages, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat, "_bracketed_spans", lambda *args: None)
        slow = tokenize_conversation(tokenizer, messages, **kwargs)
    return fast, slow, fast_used is not None


@pytest.mark.parametrize("template", ["chatml", "qwen2_5", "qwen3", "llama3", "gemma3", "exaone4", "mistral"])
@pytest.mark.parametrize("enable_thinking", [False, True])
def test_the_same_labels_as_prefix_rendering(template: str, enable_thinking: bool) -> None:
    tokenizer = tokenizer_for(template)
    taken = total = 0
    for messages in conversations():
        try:
            fast, slow, used = labels_both_ways(tokenizer, messages, enable_thinking=enable_thinking)
        except ConversationError:
            continue  # a template that refuses the shape (Gemma's system text, say) refuses it both ways
        assert fast == slow, messages
        taken, total = taken + used, total + 1
    assert total >= 20
    if not (template == "qwen3" and enable_thinking):  # Qwen3 thinks only in its last turn
        assert taken >= total * 0.6, (taken, total)  # most rows take the two-render path


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_tool_calls_label_alike_both_ways(template: str) -> None:
    row = canonical()
    fast, slow, used = labels_both_ways(tokenizer_for(template), row["messages"], tools=row["tools"])
    assert fast == slow
    assert not used  # a turn of calls alone has no content to bracket the way it renders: prefix rendering decides
    row["messages"][1]["content"] = "확인해 볼게요."
    fast, slow, used = labels_both_ways(tokenizer_for(template), row["messages"], tools=row["tools"])
    assert fast == slow and used


def test_the_span_mask_by_bisection_is_the_token_by_token_one() -> None:
    rng = random.Random(3)
    for _ in range(200):
        # a byte-level BPE's offsets: growing, several tokens of one character sharing theirs, zero-width ones
        offsets, at = [], 0
        for _ in range(rng.randint(1, 40)):
            width = rng.choice([0, 1, 1, 2, 3])
            offsets += [(at, at + width)] * rng.choice([1, 1, 2])
            at += width
        spans = sorted({tuple(sorted(rng.sample(range(at + 2), 2))) for _ in range(rng.randint(1, 3))})
        spans = [s for i, s in enumerate(spans) if i == 0 or s[0] >= spans[i - 1][1]]
        expected = [int(any(e > a and s < b for a, b in spans)) for s, e in offsets]
        assert chat._span_mask(offsets, spans)[0] == expected
        shuffled = offsets[::-1]  # not growing: the token-by-token path
        assert chat._span_mask(shuffled, spans)[0] == [int(any(e > a and s < b for a, b in spans)) for s, e in shuffled]


@pytest.mark.parametrize("template", ["qwen3", "llama3", "mistral"])
def test_many_conversations_at_once_are_each_one_alone(template: str) -> None:
    """prepare renders a batch, then encodes it, then masks it (`conversation_masks`, for the CPU's caches): each
    conversation gets what it gets alone, and one the template refuses is an error in its place, not the batch's."""
    tokenizer = tokenizer_for(template)
    batch = [(messages, None) for messages in conversations(seed=3, count=12)]
    batch.insert(5, ([{"role": "assistant", "content": "먼저 말함"}], None))  # no prompt before it: refused
    together = chat.conversation_masks(tokenizer, batch)
    assert len(together) == len(batch) and isinstance(together[5], ConversationError)
    for (messages, _), result in zip(batch, together, strict=True):
        try:
            alone = chat.conversation_mask(tokenizer, messages)
        except ConversationError as exc:
            assert isinstance(result, ConversationError) and str(result) == str(exc)
            continue
        assert result == alone
