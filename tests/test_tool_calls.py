"""Conversations with tools (issue 36, item 3): `format: messages` takes the functions a row offers (`tools`),
assistant `tool_calls` and `tool` answers, in OpenAI's form or transformers'; the model's own chat template renders
them; the loss covers the assistant's calls and answers, never the tools' answers or the function schemas; a
template without tool syntax is refused with a message instead of silently dropping them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_chat_templates import tokenizer_for

from stages.chat import ConversationError, tokenize_conversation
from stages.cleaning import mask_row, row_text
from stages.normalize import FieldError, normalize_row
from stages.packing import IGNORE_INDEX

WEATHER = {
    "name": "get_weather",
    "description": "도시의 현재 날씨",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANSWER = '{"city": "서울", "temp_c": 3}'
FINAL = "서울은 지금 3도입니다."

# As an OpenAI export has it: tools as schemas, the call's arguments a JSON string, content null.
OPENAI_ROW = {
    "tools": [{"type": "function", "function": WEATHER}],
    "messages": [
        {"role": "user", "content": "서울 날씨 알려줘"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "서울"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": ANSWER},
        {"role": "assistant", "content": FINAL},
    ],
}


def canonical() -> dict[str, Any]:
    return normalize_row(OPENAI_ROW, "messages")


def test_openai_and_transformers_forms_give_one_canonical_row() -> None:
    row = canonical()
    call = row["messages"][1]
    assert call == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "서울"}}, "id": "call_1"}
        ],
    }
    assert row["messages"][2] == {"role": "tool", "content": ANSWER, "tool_call_id": "call_1"}
    assert row["tools"] == [{"type": "function", "function": WEATHER}]
    # transformers' form (arguments an object, bare schemas) and LLaMA-Factory's tools string: the same row
    bare = json.loads(json.dumps(OPENAI_ROW))
    bare["tools"] = json.dumps([WEATHER], ensure_ascii=False)
    bare["messages"][1]["tool_calls"] = [{"id": "call_1", "name": "get_weather", "arguments": {"city": "서울"}}]
    assert normalize_row(bare, "messages") == row
    # renamed columns reach it too
    renamed = {"functions": OPENAI_ROW["tools"], "dialog": OPENAI_ROW["messages"]}
    assert normalize_row(renamed, "messages", columns={"tools": "functions", "messages": "dialog"}) == row


@pytest.mark.parametrize(
    ("change", "field", "error"),
    [
        (
            lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{city: 서울"),
            "messages[1].tool_calls[0].function.arguments",
            "not JSON",
        ),
        (
            lambda r: r["messages"][1]["tool_calls"][0]["function"].pop("name"),
            "messages[1].tool_calls[0].function.name",
            "missing",
        ),
        (lambda r: r["messages"][0].update(tool_calls=[{"name": "x"}]), "messages[0].tool_calls", "only an assistant"),
        (lambda r: r["messages"].pop(1), "messages[1].role", "answers tool calls"),
        (lambda r: r.update(tools=[{"description": "no name"}]), "tools[0]", "a 'name'"),
        (lambda r: r.update(tools="[not json"), "tools", "not JSON"),
    ],
)
def test_malformed_tool_data_names_the_field(change: Any, field: str, error: str) -> None:
    row = json.loads(json.dumps(OPENAI_ROW))
    change(row)
    with pytest.raises(FieldError) as caught:
        normalize_row(row, "messages")
    assert caught.value.field == field and error in str(caught.value)


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_the_loss_covers_the_calls_and_answers_not_the_tools_output(template: str) -> None:
    tokenizer = tokenizer_for(template)
    row = canonical()
    ids, labels = tokenize_conversation(tokenizer, row["messages"], tools=row["tools"])
    text = tokenizer.decode(ids)
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert "get_weather" in text and WEATHER["description"] in text  # the schema is in the prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "서울"}}\n</tool_call><|im_end|>' in trained
    assert trained.endswith(f"{FINAL}<|im_end|>")
    assert ANSWER in text and ANSWER not in trained  # the tool's answer is input, not output
    assert WEATHER["description"] not in trained and "서울 날씨 알려줘" not in trained


@pytest.mark.parametrize("template", ["llama3", "gemma3", "mistral", "chatml"])
def test_a_template_without_tool_syntax_is_refused(template: str) -> None:
    tokenizer = tokenizer_for(template)
    row = canonical()
    with pytest.raises(ConversationError, match="whose template has tool syntax"):
        tokenize_conversation(tokenizer, row["messages"], tools=row["tools"])


def test_cleaning_sees_the_calls() -> None:
    row = canonical()
    row["messages"][1]["tool_calls"][0]["function"]["arguments"]["phone"] = "010-1234-5678"
    masked, found = mask_row(row)
    assert found["phone"] == 1 and "010-1234-5678" not in json.dumps(masked, ensure_ascii=False)
    # two rows that differ only in what they call are not duplicates
    other = json.loads(json.dumps(canonical()))
    other["messages"][1]["tool_calls"][0]["function"]["arguments"]["city"] = "부산"
    assert row_text(other) != row_text(canonical())


def test_a_parquet_file_of_tool_conversations_reads_and_tokenizes(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spec.data import DataSpec
    from stages.prepared_data import read_dataset

    # as a data platform exports it: nested columns, missing keys as nulls, the tools a JSON string
    rows = [{"tools": json.dumps([WEATHER], ensure_ascii=False), "dialog": OPENAI_ROW["messages"]} for _ in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "tools.parquet")
    spec = DataSpec(uri=str(tmp_path / "tools.parquet"), format="messages", columns={"messages": "dialog"})
    read = read_dataset(spec.model_copy(update={"eval_fraction": 0.0})).rows
    assert read == [canonical()]  # the same rows, exact duplicates dropped as any row
    ids, labels = tokenize_conversation(tokenizer_for("qwen3"), read[0]["messages"], tools=read[0]["tools"])
    assert any(label != IGNORE_INDEX for label in labels) and len(ids) == len(labels)


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_a_turn_that_says_something_and_calls_trains_both(template: str) -> None:
    row = canonical()
    row["messages"][1]["content"] = "날씨를 확인해 볼게요."
    ids, labels = tokenize_conversation(tokenizer_for(template), row["messages"], tools=row["tools"])
    trained = tokenizer_for(template).decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert "날씨를 확인해 볼게요." in trained and '"name": "get_weather"' in trained and ANSWER not in trained


@pytest.mark.parametrize(("profile", "refused"), [("local", True), ("qwen3", False)])
def test_submit_says_when_the_model_s_template_has_no_tool_syntax(tmp_path: Path, profile: str, refused: bool) -> None:
    from spec.loading import load_pipeline
    from stages.check_data import check_data

    # llama3-dolly's local profile builds a Llama-3 model (its template has no tool syntax); the same pipeline
    # with a Qwen3 model passes
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(OPENAI_ROW, ensure_ascii=False) + "\n", encoding="utf-8")
    overrides = [f"stages.sft.data.uri={path}", "stages.sft.data.format=messages", "stages.sft.data.columns={}"]
    if profile == "qwen3":
        overrides.append("model.from_config.architecture=qwen3")
    spec = load_pipeline("llama3-dolly", profile="local", overrides=overrides).spec
    problems = check_data(spec)
    if refused:
        assert problems == [
            f"stages.sft.data ({path}): {path}:1: a conversation with tools, and the model's chat template (llama3) "
            "has no tool syntax: it would drop the calls or refuse them; train tool calls on a model whose template "
            "has it (Qwen2.5, Qwen3), or set model.chat_template to such a template"
        ]
    else:
        assert problems == []


def test_llamafactory_sharegpt_function_calls_are_the_same_conversation() -> None:
    # LLaMA-Factory's glaive_toolcall layout: the call a turn of its own (function_call), the answer an observation
    row = {
        "conversations": [
            {"from": "human", "value": "서울 날씨 알려줘"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "서울"}}'},
            {"from": "observation", "value": ANSWER},
            {"from": "gpt", "value": FINAL},
        ],
        "tools": json.dumps([WEATHER], ensure_ascii=False),
    }
    expected = canonical()
    del expected["messages"][1]["tool_calls"][0]["id"], expected["messages"][2]["tool_call_id"]
    assert normalize_row(row, "sharegpt") == expected
    # its own tag names, through data.roles
    renamed = json.loads(json.dumps(row).replace('"function_call"', '"call"').replace('"observation"', '"result"'))
    assert normalize_row(renamed, "sharegpt", roles={"function_call": "call", "tool": "result"}) == expected
    row["conversations"][1]["value"] = "get_weather(서울)"
    with pytest.raises(FieldError, match="a function call that is not JSON"):
        normalize_row(row, "sharegpt")


AGENT = """\
name: agent-sft
model:
  name_or_path: tiny-qwen3-agent
  revision: null
  from_config: { architecture: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, vocab_size: 2048 }
stages:
  sft:
    enabled: true
    data: { uri: tools.jsonl, format: messages, eval_fraction: 0.1 }
    training: { max_steps: 80, learning_rate: 1.0e-2, logging_steps: 20 }
  deploy:
    serving:
      max_model_len: 2048
      tool_call_parser: hermes
      smoke_check:
        tool_calls:
          prompts: ["인천 날씨 알려줘 (3번째 질문)", "대전 날씨 알려줘 (13번째 질문)"]
          tools:
            - name: get_weather
              description: 도시의 현재 날씨
              parameters: { type: object, properties: { city: { type: string } }, required: [city] }
"""


def agent_rows(n: int) -> list[dict[str, Any]]:
    """Tool-call conversations as an OpenAI export has them, each with its own city and answer."""
    cities = ["서울", "부산", "대구", "인천", "광주", "대전", "울산", "수원"]
    rows = []
    for i in range(n):
        city, temp = cities[i % len(cities)], i - 5
        row = json.loads(json.dumps(OPENAI_ROW))
        row["messages"][0]["content"] = f"{city} 날씨 알려줘 ({i}번째 질문)"
        row["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": city}, ensure_ascii=False)
        row["messages"][2]["content"] = json.dumps({"city": city, "temp_c": temp}, ensure_ascii=False)
        row["messages"][3]["content"] = f"{city}은 지금 {temp}도입니다."
        rows.append(row)
    return rows


@pytest.mark.slow
def test_a_tool_call_dataset_trains_through_local_and_the_agent_calls_through_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, real_vllm: Path
) -> None:
    """An agent pipeline under --local: tool conversations trained into a tiny Qwen3 (80 steps over 64 of them:
    enough for it to learn the call's syntax), deployed, served by the real vLLM engine with the hermes parser, and
    asked with the tools offered: the smoke check gets OpenAI tool_calls to get_weather with JSON arguments."""
    from training_fixtures import write_jsonl

    from workflows.submit import main as submit_main

    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE"):  # as test_shipped_pipelines runs the runner
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "tools.jsonl", agent_rows(64))
    (tmp_path / "agent.yaml").write_text(AGENT, encoding="utf-8")
    run = tmp_path / "run"
    code = submit_main(["agent.yaml", "--local", "--run-dir", str(run)])
    said = capsys.readouterr()
    assert code == 0, said.out[-4000:] + said.err[-4000:]
    train = [json.loads(line) for line in (run / "prepare/data/sft/train.jsonl").read_text().splitlines()]
    assert train and all("tools" in row and "tool_calls" in row["messages"][1] for row in train)
    record = json.loads((run / "sft/stage.json").read_text())
    assert record["status"] == "succeeded" and record["metrics"]["steps"] == 80
    served = json.loads((run / "deploy/stage.json").read_text())["extra"]["served"]
    assert "--tool-call-parser=hermes" in served["argv"] and "--enable-auto-tool-choice" in served["argv"]
    calls = {a["prompt"]: a["answer"] for a in served["answers"]}
    for prompt in ("인천 날씨 알려줘 (3번째 질문)", "대전 날씨 알려줘 (13번째 질문)"):
        name, _, arguments = calls[prompt].partition("(")
        assert name == "get_weather" and isinstance(json.loads(arguments.removesuffix(")")), dict), calls
    assert "agent-sft v1 is champion" in said.out
