"""The two-render labelling (`stages.chat._bracketed_spans`) gives exactly the labels of the prefix-rendering one
(`assistant_spans`) for every family's template, on conversations of every shape prepare meets (system prompts,
one to three turns, contents with edge whitespace, reasoning turns, tool calls), and it is the path most rows take:
it is what makes conversations tokenize at the library's speed (bench/prepare_corpus.py)."""

from __future__ import annotations

import random
import unicodedata
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


def masks_both_ways(tokenizer: Any, batch: list[tuple[list[dict[str, Any]], Any]]) -> tuple[list[Any], list[Any]]:
    """`conversation_masks` from the tokens' byte lengths (byte-level tokenizers) and from the encoder's offsets."""
    by_bytes = chat.conversation_masks(tokenizer, batch)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat, "_byte_lengths", lambda tokenizer: None)
        by_offsets = chat.conversation_masks(tokenizer, batch)
    return by_bytes, by_offsets


EDGE_TEXT = ["이모지 😀👍🏽 와 한자 漢字", "e\u0301 조합 문자", "tab\tand ~`^ ascii", "ｆｕｌｌ　ｗｉｄｔｈ"]


@pytest.mark.parametrize("template", ["qwen3", "llama3", "gemma3", "exaone4", "mistral"])
def test_byte_ends_label_what_the_encoders_offsets_label(template: str) -> None:
    """prepare finds each token's place from its bytes (no offsets from the encoder, a third of the CPU): the same
    masks as the offsets give, with tokens that split a Korean syllable or an emoji between them (512 tokens of
    vocabulary: most characters are several tokens)."""
    tokenizer = tokenizer_for(template)
    assert chat._byte_lengths(tokenizer) is not None  # the tiny tokenizers are byte-level, as Qwen's and Llama's
    batch = [(messages, None) for messages in conversations(seed=5, count=30)]
    for text in EDGE_TEXT:
        batch.append(([{"role": "user", "content": text}, {"role": "assistant", "content": f"{text} {text}"}], None))
    by_bytes, by_offsets = masks_both_ways(tokenizer, batch)
    assert [str(r) if isinstance(r, ConversationError) else r for r in by_bytes] == [
        str(r) if isinstance(r, ConversationError) else r for r in by_offsets
    ]
    assert sum(not isinstance(r, ConversationError) for r in by_bytes) >= 20


def test_text_an_nfc_normalizer_changes_takes_the_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen's tokenizer normalizes to NFC: text that is not NFC has tokens whose bytes are not the text's, and is
    labelled from the encoder's offsets, as right as NFC text is from its bytes."""
    from tokenizers import normalizers

    tokenizer = tokenizer_for("qwen3")
    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    decomposed = unicodedata.normalize("NFD", "서울은 크고 넓습니다.")
    # Three angstrom signs lose a byte each to NFC before the answer, and a Devanagari qa after it gains three: the
    # same number of bytes in all, each token after the first sign out of place.
    shifted = [{"role": "user", "content": "\u212b\u212b\u212b 질문"}, {"role": "assistant", "content": "답 \u0958"}]
    batch = [
        ([{"role": "user", "content": "질문"}, {"role": "assistant", "content": decomposed}], None),
        ([{"role": "user", "content": "질문"}, {"role": "assistant", "content": "서울은 크고 넓습니다."}], None),
        (shifted, None),
    ]
    offsets_used = []
    encode = chat._encode
    monkeypatch.setattr(chat, "_encode", lambda tok, text: offsets_used.append(text) or encode(tok, text))
    by_bytes = chat.conversation_masks(tokenizer, batch)
    assert offsets_used == [chat.render(tokenizer, batch[0][0]), chat.render(tokenizer, shifted)]  # not NFC
    monkeypatch.setattr(chat, "_byte_lengths", lambda tokenizer: None)
    assert by_bytes == chat.conversation_masks(tokenizer, batch)
    ids, mask = by_bytes[0]
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "서울은 크고 넓습니다.<|im_end|>"


def test_a_sentencepiece_style_tokenizer_labels_from_offsets() -> None:
    """Gemma's and Mistral's tokenizers are not byte-level (pieces with ▁, bytes only as a fallback): no byte
    lengths, and the encoder's offsets label them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    backend.train_from_iterator(SENTENCES * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tokenizer.chat_template = chat.template_text("chatml")
    assert chat._byte_lengths(tokenizer) is None
    [(ids, mask)] = chat.conversation_masks(tokenizer, [(conversations(count=1)[0], None)])
    assert tokenizer.convert_ids_to_tokens([t for t, m in zip(ids, mask, strict=True) if m])[-1] == "<|im_end|>"
    assert 0 < sum(mask) < len(ids)


@pytest.mark.parametrize("template", sorted(chat.KNOWN_TEMPLATES))
@pytest.mark.parametrize("enable_thinking", [False, True])
def test_a_shipped_template_writes_plain_contents_as_they_are(template: str, enable_thinking: bool) -> None:
    """For the templates this project ships, a conversation whose assistant contents are plain (no edge whitespace,
    no thinking tags) is rendered once, bracketed: its brackets removed, it is the conversation as rendered without
    them. Checked here on every shape, system prompts and several turns included, so a template change that starts
    testing or cutting contents fails here."""
    tokenizer = tokenizer_for(template)
    checked = 0
    for messages in conversations(seed=11, count=40):
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not chat._plain_contents(tokenizer, messages, turns):
            assert any(messages[i]["content"] != messages[i]["content"].strip() or "think>" in messages[i]["content"]
                       for i in turns)  # fmt: skip
            continue
        bracketed = [dict(m) for m in messages]
        for i in turns:
            bracketed[i]["content"] = f"{chat._OPEN}{messages[i]['content']}{chat._CLOSE}"
        try:
            plain = chat.render(tokenizer, messages, enable_thinking=enable_thinking)
        except ConversationError:
            continue  # a shape the template refuses (Gemma's system text, say)
        marked = chat.render(tokenizer, bracketed, enable_thinking=enable_thinking)
        assert marked.replace(chat._OPEN, "").replace(chat._CLOSE, "") == plain
        checked += 1
    assert checked >= 15


def test_a_template_of_the_users_own_is_rendered_twice_to_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template that is not one of the shipped ones may do anything with a content: its conversation is rendered
    both ways and compared, even where it is a shipped one's copy (here with a comment added); one that cuts each
    answer's last character is labelled on what it really writes."""
    messages = conversations(seed=2, count=3)[0]
    known, copy, cutting = tokenizer_for("chatml"), tokenizer_for("chatml"), tokenizer_for("chatml")
    copy.chat_template = known.chat_template + "{#- a user's copy -#}"
    cutting.chat_template = known.chat_template.replace("message['content']", "message['content'][:-1]")
    chat._gap(known, False), chat._gap(copy, False)  # found once per tokenizer, in renders of their own
    renders = []
    real_render = chat.render
    monkeypatch.setattr(chat, "render", lambda *a, **k: renders.append(1) or real_render(*a, **k))
    assert chat._bracketed_spans(known, messages, False, None) is not None
    assert len(renders) == 1
    renders.clear()
    assert chat._bracketed_spans(copy, messages, False, None) == chat._bracketed_spans(known, messages, False, None)
    assert len(renders) == 3  # the copy twice, the shipped one once
    monkeypatch.undo()
    fast, slow, _ = labels_both_ways(cutting, messages)
    assert fast == slow
    _, labels = fast
    trained = cutting.decode([t for t in labels if t != chat.IGNORE_INDEX])
    assert messages[-1]["content"][:-1] + "<|im_end|>" in trained and messages[-1]["content"] not in trained
