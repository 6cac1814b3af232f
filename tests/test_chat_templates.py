"""Assistant masks for every family's real chat template, token by token: the prompt, the system text and the role
headers are -100; the assistant's content and its end-of-turn token are labelled; nothing after it. Templates that
refuse a conversation, or never end an assistant turn, give a ConversationError naming the problem."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest

from spec.model import KNOWN_CHAT_TEMPLATES, TinyModelConfig
from stages.chat import (
    FAMILY_TEMPLATE,
    KNOWN_TEMPLATES,
    ConversationError,
    TemplateError,
    has_generation_tags,
    stop_token_ids,
    template_text,
    tokenize_conversation,
)
from stages.packing import IGNORE_INDEX
from stages.tokenizer import train_bpe_tokenizer

CORPUS = [
    "대한민국은 민주공화국이다. 모든 권력은 국민으로부터 나온다.",
    "서울은 크고 넓습니다. 부산은 바다가 아름답습니다.",
]

SYSTEM, Q1, A1, Q2, A2 = (
    "짧게 답하세요.",
    "서울은 어떤가요?",
    "서울은 크고 넓습니다.",
    "부산은요?",
    "부산은 바다가 아름답습니다.",
)
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2},
]

# Each family's rendering of CONVERSATION, as (text, trained) pieces: exactly what its real template writes.
EXPECTED: dict[str, list[tuple[str, bool]]] = {
    "llama3": [
        (
            f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
            f"<|start_header_id|>user<|end_header_id|>\n\n{Q1}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            False,
        ),
        (f"{A1}<|eot_id|>", True),
        (
            f"<|start_header_id|>user<|end_header_id|>\n\n{Q2}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            False,
        ),
        (f"{A2}<|eot_id|>", True),
    ],
    "gemma3": [
        (f"<bos><start_of_turn>user\n{SYSTEM}\n\n{Q1}<end_of_turn>\n<start_of_turn>model\n", False),
        (f"{A1}<end_of_turn>", True),
        (f"\n<start_of_turn>user\n{Q2}<end_of_turn>\n<start_of_turn>model\n", False),
        (f"{A2}<end_of_turn>", True),
        ("\n", False),
    ],
    "exaone4": [
        (
            f"[|system|]\n{SYSTEM}[|endofturn|]\n[|user|]\n{Q1}[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n",
            False,
        ),
        (f"{A1}[|endofturn|]", True),
        (f"\n[|user|]\n{Q2}[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n", False),
        (f"{A2}[|endofturn|]", True),
        ("\n", False),
    ],
    # Mistral v0.3 writes the system text into the last user message only when it ends the conversation.
    "mistral": [
        (f"<s>[INST] {Q1}[/INST]", False),
        (f" {A1}</s>", True),
        (f"[INST] {Q2}[/INST]", False),
        (f" {A2}</s>", True),
    ],
    # Qwen3 drops past turns' thinking; the last turn's empty thinking block is the generation prompt's.
    "qwen3": [
        (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{A1}<|im_end|>", True),
        (f"\n<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        (f"{A2}<|im_end|>", True),
        ("\n", False),
    ],
    # Qwen2.5 writes the conversation as ChatML (its default system prompt only when none is given).
    "qwen2_5": [
        (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{A1}<|im_end|>", True),
        (f"\n<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{A2}<|im_end|>", True),
        ("\n", False),
    ],
    "chatml": [
        (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{A1}<|im_end|>", True),
        (f"\n<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{A2}<|im_end|>", True),
        ("\n", False),
    ],
}


def tokenizer_for(template: str) -> Any:
    return train_bpe_tokenizer(CORPUS * 20, 512, 1024, template)


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def family(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, tokenizer_for(request.param)


def test_every_known_template_is_checked_and_named_in_the_spec() -> None:
    assert set(EXPECTED) == set(KNOWN_TEMPLATES) == set(KNOWN_CHAT_TEMPLATES)
    assert set(FAMILY_TEMPLATE) == set(TinyModelConfig.model_fields["architecture"].annotation.__args__)


def test_assistant_tokens_are_labelled_token_by_token(family: tuple[str, Any]) -> None:
    name, tokenizer = family
    ids, labels = tokenize_conversation(tokenizer, CONVERSATION)

    assert tokenizer.decode(ids) == "".join(text for text, _ in EXPECTED[name])
    labelled = [tokenizer.decode([t]) for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    trained = "".join(text for text, is_trained in EXPECTED[name] if is_trained)
    assert "".join(labelled) == trained
    # Position by position: each piece's tokens carry their own id as label, or -100.
    position = 0
    for text, is_trained in EXPECTED[name]:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids[position : position + len(piece)] == piece, (name, text)
        expected = piece if is_trained else [IGNORE_INDEX] * len(piece)
        assert labels[position : position + len(piece)] == expected, (name, text)
        position += len(piece)
    assert position == len(ids)
    # The system text, the questions and every role header stay out of the loss.
    for prompt_text in (SYSTEM, Q1, Q2):
        assert prompt_text not in "".join(labelled)
    eot = tokenizer.convert_ids_to_tokens([t for t in labels if t != IGNORE_INDEX][-1])
    assert eot == KNOWN_TEMPLATES[name].eos  # the turn ends with the token generation stops at


def test_without_assistant_only_loss_every_token_is_labelled(family: tuple[str, Any]) -> None:
    _, tokenizer = family
    ids, labels = tokenize_conversation(tokenizer, CONVERSATION, assistant_only_loss=False)
    assert labels == ids


def test_generation_stops_at_the_end_of_turn_token(family: tuple[str, Any]) -> None:
    name, tokenizer = family
    assert tokenizer.convert_tokens_to_ids(KNOWN_TEMPLATES[name].eos) in stop_token_ids(tokenizer)


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_the_same_labels_as_trls_generation_tagged_training_template(name: str) -> None:
    """Where TRL's training variant renders the same text as the model's template, transformers' generation mask
    and the prefix method label the same tokens."""
    ours = tokenizer_for(name)
    tagged = tokenizer_for(name)
    tagged.chat_template = (resources.files("trl") / "chat_templates" / f"{name}_training.jinja").read_text()
    assert "{% generation %}" in tagged.chat_template.replace("{%- generation %}", "{% generation %}").replace(
        "{%- generation -%}", "{% generation %}"
    )
    for messages in (CONVERSATION, CONVERSATION[1:3]):
        assert tokenize_conversation(tagged, messages) == tokenize_conversation(ours, messages)


def test_generation_tags_are_found_as_trl_finds_them() -> None:
    from trl.chat_template_utils import has_generation_markers

    texts = [template_text(name) for name in KNOWN_TEMPLATES]
    texts += [
        "{% generation %}{{ m }}{% endgeneration %}",
        "{%- generation -%}x{%- endgeneration -%}",
        "{%-generation%}",
        "{% endgeneration %}",
        "{{ generation }}",
        "{% if generation %}",
        "",
    ]
    answers = [has_generation_tags(text) for text in texts]
    assert answers == [has_generation_markers(text) for text in texts]
    assert answers[-7:] == [True, True, True, False, False, False, False]


def test_a_reasoning_turn_trains_its_thinking_block() -> None:
    tokenizer = tokenizer_for("qwen3")
    messages = [*CONVERSATION[1:4], {"role": "assistant", "content": f"<think>\n항구 도시.\n</think>\n\n{A2}"}]
    for enable_thinking in (False, True):
        ids, labels = tokenize_conversation(tokenizer, messages, enable_thinking=enable_thinking)
        trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
        assert trained == f"{A1}<|im_end|><think>\n항구 도시.\n</think>\n\n{A2}<|im_end|>"


def test_a_template_that_refuses_the_conversation_says_why() -> None:
    gemma = tokenizer_for("gemma3")
    gemma.chat_template = (resources.files("trl") / "chat_templates" / "gemma.jinja").read_text()  # Gemma 1/2
    with pytest.raises(ConversationError, match="rejects this conversation: System role not supported"):
        tokenize_conversation(gemma, CONVERSATION)
    mistral = tokenizer_for("mistral")
    twice = [CONVERSATION[1], CONVERSATION[3], {"role": "assistant", "content": A1}]
    with pytest.raises(ConversationError, match="roles must alternate user/assistant"):
        tokenize_conversation(mistral, twice)


def test_a_template_without_an_end_of_turn_token_is_refused() -> None:
    tokenizer = tokenizer_for("chatml")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(ConversationError, match="never learn to stop"):
        tokenize_conversation(tokenizer, CONVERSATION)


def test_a_template_that_renders_no_assistant_turn_is_refused() -> None:
    tokenizer = tokenizer_for("chatml")
    tokenizer.chat_template = (
        "{% for m in messages if m['role'] != 'assistant' %}{{ '<|im_start|>' + m['content'] + '<|im_end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(ConversationError):
        tokenize_conversation(tokenizer, CONVERSATION)


def test_unknown_template_names_and_missing_files_are_errors(tmp_path: Any) -> None:
    with pytest.raises(TemplateError, match="neither a known template"):
        template_text(str(tmp_path / "missing.jinja"))
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages }}", encoding="utf-8")
    assert template_text(str(path)) == "{{ messages }}"


def _conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(messages, tools) of every kind prepare renders: plain, without a system text, a reasoning turn (in the
    content and under each of its field names), None values, and a conversation with tools."""
    from test_tool_calls import canonical

    thinking = {"role": "assistant", "content": f"<think>\n항구 도시.\n</think>\n\n{A2}"}
    reasoned = [
        [*CONVERSATION[:4], {"role": "assistant", "content": A2, field: "항구 도시."}]
        for field in ("reasoning_content", "thinking", "reasoning")
    ]
    tool_row = canonical()
    return [
        (CONVERSATION, None),
        (CONVERSATION[1:], None),
        ([*CONVERSATION[:4], thinking], None),
        *((messages, None) for messages in reasoned),
        ([{**m, "name": None} for m in CONVERSATION], None),
        (tool_row["messages"], tool_row["tools"]),
        (CONVERSATION[1:2], None),
    ]


@pytest.mark.parametrize("name", sorted(KNOWN_TEMPLATES))
def test_a_shipped_template_renders_as_transformers_renders_it(name: str) -> None:
    """Shipped templates skip transformers' sandbox (stages.chat._shipped_template): the same text, or the same
    refusal, as `apply_chat_template` for every conversation, generation prompt and thinking setting."""
    from stages.chat import _shipped_template, render

    tokenizer = tokenizer_for(name)
    assert _shipped_template(tokenizer) is not None
    checked = 0
    for messages, tools in _conversations():
        for generation_prompt in (False, True):
            for enable_thinking in (False, True):
                try:
                    expected = tokenizer.apply_chat_template(
                        messages,
                        tools=tools,
                        tokenize=False,
                        add_generation_prompt=generation_prompt,
                        enable_thinking=enable_thinking,
                    )
                except Exception as exc:  # the template refuses it: render says the same
                    with pytest.raises(ConversationError) as refused:
                        render(tokenizer, messages, generation_prompt, enable_thinking, tools)
                    assert str(exc) in str(refused.value)
                    continue
                assert render(tokenizer, messages, generation_prompt, enable_thinking, tools) == expected
                checked += 1
    assert checked >= 16


def test_a_template_changed_by_one_character_is_rendered_in_transformers_sandbox() -> None:
    from stages.chat import _shipped_template, render

    tokenizer = tokenizer_for("chatml")
    tokenizer.chat_template = tokenizer.chat_template + " "
    assert _shipped_template(tokenizer) is None
    tokenizer.chat_template = "{{ ''.__class__.__mro__ }}"  # the sandbox refuses what a plain environment would run
    with pytest.raises(Exception, match=r"unsafe"):
        render(tokenizer, CONVERSATION)
