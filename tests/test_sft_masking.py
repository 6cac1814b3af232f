"""SFT labels: only what the assistant says (its content and its <|im_end|>) carries loss, for messages,
alpaca and sharegpt rows as prepare normalizes them, single- and multi-turn, packed or not; with reasoning, the
final turn's thinking block is assistant output and carries loss, and earlier turns' thinking is not in the row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from training_fixtures import chat_rows, make_run_dir, text_rows

from spec.loading import load_pipeline
from stages.chat import template_text
from stages.modeling import load_tokenizer
from stages.normalize import normalize_row
from stages.packing import IGNORE_INDEX, load_token_cache, tokenize_conversation
from stages.tokenizer import build_tokenizer, render_for_training

TURN_END = "<|im_end|>"  # Qwen3's end-of-turn token

RAW_ROWS: list[tuple[str, dict[str, Any]]] = [
    (
        "messages",
        {
            "messages": [
                {"role": "system", "content": "당신은 친절한 도우미입니다."},
                {"role": "user", "content": "서울은 어떤가요?"},
                {"role": "assistant", "content": "서울은 크고 넓습니다."},
                {"role": "user", "content": "부산은요?"},
                {"role": "assistant", "content": "부산은 바다가 아름답습니다."},
            ]
        },
    ),
    (
        "alpaca",
        {"instruction": "다음 문장을 요약하세요.", "input": "한강은 아름답습니다.", "output": "한강이 아름답다."},
    ),
    ("alpaca", {"instruction": "인사해 주세요.", "output": "안녕하세요!"}),
    (
        "sharegpt",
        {
            "conversations": [
                {"from": "system", "value": "짧게 답하세요."},
                {"from": "human", "value": "김치는 맛있나요?"},
                {"from": "gpt", "value": "네, 맛있습니다."},
                {"from": "human", "value": "제주도는요?"},
                {"from": "gpt", "value": "제주도는 조용합니다."},
                {"from": "human", "value": "고마워요."},
                {"from": "gpt", "value": "천만에요."},
            ]
        },
    ),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    spec = load_pipeline("korean-llm", profile="local").spec
    corpus = [render_for_training(row) for row in text_rows(100) + chat_rows(100)]
    return build_tokenizer(spec, corpus, tmp_path_factory.mktemp("tokenizer"))


def labeled_spans(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of consecutive positions that carry loss."""
    spans: list[list[int]] = []
    previous = False
    for token, label in zip(ids, labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token  # a label is the token itself (the model shifts)
            if not previous:
                spans.append([])
            spans[-1].append(token)
        previous = label != IGNORE_INDEX
    return spans


@pytest.mark.parametrize(("fmt", "raw"), RAW_ROWS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(RAW_ROWS)])
def test_only_assistant_tokens_carry_loss(tokenizer: Any, fmt: str, raw: dict[str, Any]) -> None:
    messages = normalize_row(raw, fmt)["messages"]
    ids, labels = tokenize_conversation(tokenizer, messages)

    # The tokens are the rendered conversation, unchanged.
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    # One labeled span per assistant turn: exactly its content and its <|im_end|>.
    answers = [m["content"] + TURN_END for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(span) for span in labeled_spans(ids, labels)] == answers
    # Nothing the user or system wrote, and no role header, carries loss.
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] not in trained
    assert "assistant\n" not in trained and "<think>" not in trained


def test_without_assistant_only_loss_every_token_carries_loss(tokenizer: Any) -> None:
    messages = normalize_row(RAW_ROWS[0][1], "messages")["messages"]
    ids, labels = tokenize_conversation(tokenizer, messages, assistant_only_loss=False)
    assert labels == ids


def test_packed_sft_rows_keep_the_masking(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", n_text=20, n_chat=80)
    spec = run_dir.load_spec()
    tokenizer = load_tokenizer(run_dir, spec.model)
    cache = load_token_cache(run_dir, spec, "sft")
    row = max(cache.train, key=lambda r: r["position_ids"].count(0))
    assert row["position_ids"].count(0) > 1  # several conversations share the row

    spans = [tokenizer.decode(s) for s in labeled_spans(row["input_ids"], row["labels"])]
    assert spans and all(span.endswith(TURN_END) for span in spans)
    assert all("<|im_start|>" not in span and "?" not in span for span in spans)  # no user question is trained
    assert cache.meta["train"]["label_tokens"] < cache.meta["train"]["tokens"] / 2


THINKING_ROW = {
    "messages": [
        {"role": "user", "content": "서울은 어떤가요?"},
        {"role": "assistant", "content": "서울은 크고 넓습니다.", "reasoning_content": "수도에 대해 묻는다."},
        {"role": "user", "content": "부산은요?"},
        {"role": "assistant", "content": "부산은 바다가 아름답습니다.", "reasoning_content": "항구 도시를 떠올린다."},
    ]
}


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_the_last_turns_thinking_is_trained_and_past_thinking_is_dropped(tokenizer: Any, enable_thinking: bool) -> None:
    assert tokenizer.chat_template == template_text("qwen3")  # Qwen3's own template, as every stage uses it
    messages = normalize_row(THINKING_ROW, "messages")["messages"]  # reasoning_content → <think>...</think>
    ids, labels = tokenize_conversation(tokenizer, messages, enable_thinking=enable_thinking)

    # The template keeps the thinking of the turn after the last user message only (it is what the model
    # generates there, tags included), and drops the thinking of earlier assistant turns from the text.
    pieces = [
        ("<|im_start|>user\n서울은 어떤가요?<|im_end|>\n<|im_start|>assistant\n", False),
        ("서울은 크고 넓습니다.<|im_end|>", True),
        ("\n<|im_start|>user\n부산은요?<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\n항구 도시를 떠올린다.\n</think>\n\n부산은 바다가 아름답습니다.<|im_end|>", True),
        ("\n", False),
    ]
    expected_ids, expected_labels = [], []
    for text, trained in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected_ids += piece
        expected_labels += piece if trained else [IGNORE_INDEX] * len(piece)
    assert ids == expected_ids and labels == expected_labels
    assert "수도에 대해 묻는다" not in tokenizer.decode(ids)
    think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert [t for t, label in zip(ids, labels, strict=True) if t in think and label != IGNORE_INDEX] == think
