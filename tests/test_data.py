"""Reading, validating and normalizing data (stages/data.py): every bad row is named by file, line and field."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spec.data import DataSpec
from spec.loading import load_pipeline
from stages.data import DataError, check_stage_format, sha256_file, write_jsonl
from stages.normalize import normalize_row
from stages.prepared_data import prepare_split, read_dataset, read_lines

REPO = Path(__file__).resolve().parents[1]

GOOD = {
    "text": {"text": "대한민국은 민주공화국이다."},
    "messages": {"messages": [{"role": "user", "content": "안녕?"}, {"role": "assistant", "content": "안녕하세요."}]},
    "alpaca": {"instruction": "번역하세요", "input": "hello", "output": "안녕"},
    "sharegpt": {"conversations": [{"from": "human", "value": "질문"}, {"from": "gpt", "value": "답"}]},
    "preference": {"prompt": "질문", "chosen": "맞는 답", "rejected": "틀린 답"},
}


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def spec_for(path: Path, fmt: str, bad: float = 0.0, **kw: Any) -> DataSpec:
    return DataSpec(uri=str(path), format=fmt, max_bad_row_fraction=bad, **kw)


def msgs(*turns: tuple[Any, Any]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}, ensure_ascii=False)


# (format, bad line, field named in the message ('' for whole-row problems), words of the message)
MALFORMED: list[tuple[str, str | bytes, str, str]] = [
    ("text", '{"text": "unterminated"', "", "not valid JSON"),
    ("text", b'{"text": "\xff\xfe broken"}', "", "invalid UTF-8"),
    ("text", "[1, 2, 3]", "", "expected a JSON object per row, got a list"),
    ("text", '{"body": "no text field"}', "text", "missing"),
    ("text", '{"text": null}', "text", "expected a string, got null"),
    ("text", '{"text": "   "}', "text", "empty string"),
    ("messages", msgs(("user", "q"), ("assistant", None)), "messages[1].content", "expected a string, got null"),
    ("messages", msgs(("bot", "q"), ("assistant", "a")), "messages[0].role", "unknown role 'bot'"),
    ("messages", msgs(("user", "q")), "messages", "no assistant turn"),
    ("messages", msgs(("user", "q"), ("assistant", "a"), ("user", "q2")), "messages[2].role", "end with an assistant"),
    ("messages", msgs(("user", "q"), ("system", "s"), ("assistant", "a")), "messages[1].role", "only come first"),
    ("messages", msgs(("assistant", "a"), ("user", "q"), ("assistant", "a")), "messages[0].role", "must be 'user'"),
    ("messages", '{"messages": "hello"}', "messages", "expected a list of messages, got a string"),
    ("messages", '{"messages": []}', "messages", "empty list"),
    ("messages", '{"messages": ["hi"]}', "messages[0]", "expected an object"),
    ("messages", '{"text": "raw text in a chat dataset"}', "messages", "is it in format 'text'"),
    ("alpaca", '{"instruction": "do", "output": 3}', "output", "expected a string, got a number"),
    ("alpaca", '{"instruction": "", "output": "x"}', "instruction", "empty string"),
    ("sharegpt", '{"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]}',
     "conversations[1].from", "unknown role 'robot'"),
    ("preference", '{"prompt": "q", "chosen": "same", "rejected": "same"}', "rejected", "identical to 'chosen'"),
    ("preference", '{"prompt": "q", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]}',
     "rejected[0].role", "expected 'assistant'"),
    ("preference", '{"chosen": "a", "rejected": "b"}', "prompt", "missing"),
    ("preference", '{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
     '"chosen": "a", "rejected": "b"}', "prompt[1].role", "end with a user turn"),
    # JSON that parses, or nearly, but is no data Python can hold or write
    ("text", '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "", "nested too deeply to read"),
    ("text", '{"text": "a", "id": ' + "7" * 5000 + "}", "", "a number of more than 4300 digits"),
    ("text", '{"text": "half \\ud800 a character"}', "text", "a lone surrogate \\ud800 at character 6"),
    ("messages", '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\udc00"}]}',
     "messages[1].content", "a lone surrogate \\udc00"),
    ("preference", '{"prompt": "q", "chosen": "a", "rejected": "\\udfff"}', "rejected", "a lone surrogate"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "bad", "field", "words"), MALFORMED, ids=[f"{m[0]}-{m[3][:24]}" for m in MALFORMED])
def test_malformed_row_is_named_by_file_line_and_field(tmp_path: Path, fmt: str, bad: str, field: str, words: str):
    path = write_lines(tmp_path / "train.jsonl", [json.dumps(GOOD[fmt], ensure_ascii=False), bad])
    with pytest.raises(DataError) as err:
        read_dataset(spec_for(path, fmt))
    message = str(err.value)
    assert f"{path}:2: " in message
    if field:
        assert f"field '{field}'" in message
    assert words in message
    assert "1 of 2 rows are bad" in message


def test_over_long_row_is_an_error_with_a_configurable_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = write_lines(tmp_path / "train.jsonl", ['{"text": "short"}', json.dumps({"text": "가" * 200})])
    assert len(read_dataset(spec_for(path, "text")).rows) == 2
    monkeypatch.setenv("POSTTRAIN_MAX_ROW_BYTES", "100")
    with pytest.raises(DataError, match=r"train\.jsonl:2: row is \d+ bytes, over the limit of 100"):
        read_dataset(spec_for(path, "text"))


def test_empty_file_and_missing_path_are_errors(tmp_path: Path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.jsonl: empty file"):
        read_dataset(spec_for(empty, "text"))
    with pytest.raises(DataError, match="no such file or directory"):
        read_dataset(spec_for(tmp_path / "nope.jsonl", "text"))


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path: Path):
    path = write_lines(tmp_path / "d.jsonl", ['{"text": "a"}', "", "   ", '{"text": 5}'])
    with pytest.raises(DataError, match=r"d\.jsonl:4: field 'text': expected a string, got a number"):
        read_dataset(spec_for(path, "text"))


def test_bad_rows_within_the_fraction_are_quarantined_and_counted(tmp_path: Path):
    lines = [json.dumps({"text": f"문서 {i}"}, ensure_ascii=False) for i in range(9)] + ['{"text": null}']
    path = write_lines(tmp_path / "train.jsonl", lines)
    dataset = read_dataset(spec_for(path, "text", bad=0.1))
    assert (len(dataset.rows), len(dataset.errors), dataset.total) == (9, 1, 10)
    record = dataset.errors[0].record()
    assert record["file"] == str(path) and record["line"] == 10 and record["field"] == "text"
    assert record["error"] == "expected a string, got null" and '"text": null' in record["raw"]
    with pytest.raises(DataError, match=r"over max_bad_row_fraction=0\.05"):
        read_dataset(spec_for(path, "text", bad=0.05))


def test_quarantined_rows_that_are_no_text_are_written_as_utf8(tmp_path: Path):
    """A row with a lone surrogate, or nested too deeply, is quarantined like any bad row: its record is writable."""
    lines = [
        '{"text": "ok"}',
        '{"text": "x \\ud800"}',
        '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"text": 1}',
    ]
    path = write_lines(tmp_path / "train.jsonl", lines)
    dataset = read_dataset(spec_for(path, "text", bad=0.9))
    assert [e.line for e in dataset.errors] == [2, 3, 4]
    quarantine = tmp_path / "quarantine.jsonl"
    write_jsonl(quarantine, [e.record() for e in dataset.errors])
    records = [json.loads(line) for line in quarantine.read_text(encoding="utf-8").splitlines()]
    assert records[0]["field"] == "text" and "\\ud800" in records[0]["raw"]


def test_a_symlink_loop_or_a_dangling_link_names_the_path(tmp_path: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_lines(corpus / "a.jsonl", ['{"text": "ok"}'])
    (corpus / "loop-1").symlink_to("loop-2")
    (corpus / "loop-2").symlink_to("loop-1")
    with pytest.raises(DataError, match=rf"{re.escape(str(corpus))}/loop-[12]: a symlink loop"):
        read_dataset(spec_for(corpus, "text"))
    looped = tmp_path / "looped.jsonl"
    looped.symlink_to(looped.name)
    with pytest.raises(DataError, match=rf"{re.escape(str(looped))}: a symlink loop"):
        read_dataset(spec_for(looped, "text"))
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "moved-away.jsonl")
    with pytest.raises(DataError, match=r"dangling\.jsonl is a symlink to .*moved-away\.jsonl, which does not exist"):
        read_dataset(spec_for(dangling, "text"))


def test_a_file_name_that_is_not_utf8_is_named_and_refused(tmp_path: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / os.fsdecode(b"caf\xe9.jsonl")).write_text('{"text": "ok"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"caf\\udce9\.jsonl: the file name is not valid UTF-8"):
        read_dataset(spec_for(corpus, "text"))


def test_failure_lists_the_first_errors_only(tmp_path: Path):
    path = write_lines(tmp_path / "train.jsonl", ['{"text": "ok"}'] + ['{"text": 1}'] * 8)
    with pytest.raises(DataError) as err:
        read_dataset(spec_for(path, "text"))
    assert str(err.value).count("expected a string") == 5
    assert "and 3 more" in str(err.value)


def test_rows_are_normalized_to_one_canonical_form_per_kind():
    chat = {"messages": [{"role": "user", "content": "번역하세요\n\nhello"}, {"role": "assistant", "content": "안녕"}]}
    assert normalize_row(GOOD["alpaca"], "alpaca") == chat
    assert normalize_row({"instruction": "질문", "output": "답", "input": ""}, "alpaca")["messages"][0] == {
        "role": "user",
        "content": "질문",
    }
    assert normalize_row(GOOD["sharegpt"], "sharegpt") == {
        "messages": [{"role": "user", "content": "질문"}, {"role": "assistant", "content": "답"}]
    }
    assert normalize_row(GOOD["preference"], "preference") == {
        "prompt": [{"role": "user", "content": "질문"}],
        "chosen": [{"role": "assistant", "content": "맞는 답"}],
        "rejected": [{"role": "assistant", "content": "틀린 답"}],
    }
    assert normalize_row({"body": "x", "text": "y"}, "text") == {"text": "y"}
    thinking = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    }
    assert normalize_row(thinking, "messages")["messages"][1]["content"] == "<think>\nr\n</think>\n\na"


def test_custom_text_field(tmp_path: Path):
    path = write_lines(tmp_path / "d.jsonl", ['{"body": "본문"}'])
    assert read_dataset(spec_for(path, "text", text_field="body")).rows == [{"text": "본문"}]


def test_wrong_format_for_the_stage_is_refused():
    check_stage_format("sft", "alpaca")
    with pytest.raises(DataError, match="cpt reads text"):
        check_stage_format("cpt", "messages")
    with pytest.raises(DataError, match="rlhf reads preference"):
        check_stage_format("rlhf", "text")


def test_directory_of_jsonl_and_parquet_is_read_in_order_with_per_file_fingerprints(tmp_path: Path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    data = tmp_path / "data"
    data.mkdir()
    write_lines(data / "a.jsonl", ['{"text": "첫째"}'])
    pq.write_table(pa.table({"text": ["둘째", None]}), data / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet:2: field 'text': expected a string, got null"):
        read_dataset(spec_for(data, "text"))
    dataset = read_dataset(spec_for(data, "text", bad=0.5))
    assert dataset.rows == [{"text": "첫째"}, {"text": "둘째"}]
    assert [Path(f.uri).name for f in dataset.files] == ["a.jsonl", "b.parquet"]
    assert dataset.files[0].fingerprint == "sha256:" + hashlib.sha256((data / "a.jsonl").read_bytes()).hexdigest()


def test_fingerprints_are_stable_and_follow_the_content(tmp_path: Path):
    path = write_lines(tmp_path / "train.jsonl", ['{"text": "하나"}', '{"text": "둘"}'])
    first = read_dataset(spec_for(path, "text")).fingerprint
    assert read_dataset(spec_for(path, "text")).fingerprint == first
    copy = write_lines(tmp_path / "copy.jsonl", ['{"text": "하나"}', '{"text": "둘"}'])
    assert sha256_file(copy) == sha256_file(path)
    assert read_dataset(spec_for(path, "text", eval_fraction=0.3)).fingerprint != first
    write_lines(path, ['{"text": "하나"}', '{"text": "셋"}'])
    assert read_dataset(spec_for(path, "text")).fingerprint != first


def test_eval_split_is_by_content_deterministic_and_stable_when_rows_are_added(tmp_path: Path):
    spec = load_pipeline("korean-llm", profile="local").spec

    def split(rows: list[dict[str, Any]], fraction: float, name: str, num_proc: int = 1) -> tuple[list, list]:
        source = tmp_path / f"{name}.jsonl"
        write_jsonl(source, rows)
        data = DataSpec(uri=str(source), format="text", eval_fraction=fraction)
        out = tmp_path / name
        prepare_split(out, tmp_path / f"{name}-quarantine.jsonl", "cpt", data, spec, tmp_path, num_proc)
        return list(read_lines(out / "train.jsonl")), list(read_lines(out / "eval.jsonl"))

    rows = [{"text": f"문서 {i}"} for i in range(400)]
    train, held = split(rows, 0.1, "a")
    assert 20 <= len(held) <= 60 and len(train) + len(held) == 400  # about the fraction, by each row's hash
    assert split(rows, 0.1, "b", num_proc=2) == (train, held)  # the same on every run, with any number of workers
    assert [r for r in rows if r in held] == held and [r for r in rows if r in train] == train  # file order kept
    more_train, more_held = split(rows + [{"text": f"새 문서 {i}"} for i in range(400)], 0.1, "c")
    assert all(r in more_held for r in held) and all(r in more_train for r in train)  # no row changes side
    assert split(rows[:3], 0.02, "d")[1] != []  # a non-zero fraction holds out at least one row
    assert split(rows[:1], 0.3, "e") == (rows[:1], []) and split(rows[:50], 0.0, "f") == (rows[:50], [])


def test_hub_dataset_offline_is_a_clear_error():
    pytest.importorskip("datasets")
    # A fresh interpreter: the hub client reads HF_HUB_OFFLINE when it is imported.
    code = (
        "from stages.data import DataError\n"
        "from stages.prepared_data import read_dataset\n"
        "from spec.data import DataSpec\n"
        "try:\n"
        "    read_dataset(DataSpec(uri='hf://posttrain-test/none', format='text'))\n"
        "except DataError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert re.search(r"hf://posttrain-test/none: could not load .*offline.*datasets volume", out.stdout), out.stderr


def test_an_unknown_builtin_is_a_clear_error():  # object stores: tests/test_sources.py
    with pytest.raises(DataError, match="unknown builtin dataset 'nope'; known: korean-corpus"):
        read_dataset(DataSpec(uri="builtin:nope", format="text"))


# --------------------------------------------------------------------------- column and role mapping

DOLLY = {"input": "context", "output": "response"}


def dolly_row(instruction: str, context: str, response: str, category: str = "closed_qa") -> dict[str, str]:
    return {"instruction": instruction, "context": context, "response": response, "category": category}


def jsonl(path: Path, rows: list[Any]) -> Path:
    return write_lines(path, [json.dumps(r, ensure_ascii=False) for r in rows])


def test_a_dolly_row_is_read_as_alpaca_through_columns(tmp_path: Path):
    path = jsonl(
        tmp_path / "dolly.jsonl",
        [
            dolly_row("요약하세요", "헌법 제1조 본문", "민주공화국"),
            dolly_row("하늘은 왜 파랄까?", "", "산란", "open_qa"),
        ],
    )
    dataset = read_dataset(spec_for(path, "alpaca", columns=DOLLY))
    assert dataset.rows == [
        {
            "messages": [
                {"role": "user", "content": "요약하세요\n\n헌법 제1조 본문"},
                {"role": "assistant", "content": "민주공화국"},
            ]
        },
        {"messages": [{"role": "user", "content": "하늘은 왜 파랄까?"}, {"role": "assistant", "content": "산란"}]},
    ]


def test_alpaca_history_and_system_columns_become_earlier_turns(tmp_path: Path):
    """LLaMA-Factory's alpaca: history is [instruction, response] pairs before this turn; read from Parquet."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table(
        {
            "q": ["두 번째 질문"],
            "a": ["두 번째 답"],
            "sys": ["한국어로 답하세요."],
            "past": [[["첫 질문", "첫 답"]]],
        }
    )
    pq.write_table(table, tmp_path / "chat.parquet")
    columns = {"instruction": "q", "output": "a", "system": "sys", "history": "past"}
    assert read_dataset(spec_for(tmp_path / "chat.parquet", "alpaca", columns=columns)).rows == [
        {
            "messages": [
                {"role": "system", "content": "한국어로 답하세요."},
                {"role": "user", "content": "첫 질문"},
                {"role": "assistant", "content": "첫 답"},
                {"role": "user", "content": "두 번째 질문"},
                {"role": "assistant", "content": "두 번째 답"},
            ]
        }
    ]
    bad = {"q": "질문", "a": "답", "past": [["첫 질문", "첫 답"], ["짝이 없음"]]}
    with pytest.raises(DataError, match=r"b\.jsonl:1: field 'past\[1\]' \(columns\.history\): expected a pair"):
        read_dataset(spec_for(jsonl(tmp_path / "b.jsonl", [bad]), "alpaca", columns=columns))


def test_sharegpt_with_its_own_keys_role_tags_and_system_column(tmp_path: Path):
    """A LLaMA-Factory sharegpt dataset: columns for the list, the system prompt and the message keys, and tags."""
    row = {
        "dialog": [{"speaker": "customer", "text": "환불되나요?"}, {"speaker": "agent", "text": "네, 가능합니다."}],
        "prompt_system": "상담원으로 답하세요.",
    }
    columns = {"conversations": "dialog", "system": "prompt_system", "from": "speaker", "value": "text"}
    roles = {"user": "customer", "assistant": "agent"}
    path = jsonl(tmp_path / "sharegpt.jsonl", [row])
    assert read_dataset(spec_for(path, "sharegpt", columns=columns, roles=roles)).rows == [
        {
            "messages": [
                {"role": "system", "content": "상담원으로 답하세요."},
                {"role": "user", "content": "환불되나요?"},
                {"role": "assistant", "content": "네, 가능합니다."},
            ]
        }
    ]
    # a role given in roles accepts its tag only; the default tags of the others still work
    human = {"dialog": [{"speaker": "human", "text": "q"}, {"speaker": "agent", "text": "a"}]}
    assert (
        normalize_row(human, "sharegpt", columns=columns, roles={"assistant": "agent"})["messages"][0]["role"] == "user"
    )
    path = jsonl(tmp_path / "human.jsonl", [row, human])
    expected = (
        r"human\.jsonl:2: field 'dialog\[0\]\.speaker' \(columns\.conversations, "
        r"columns\.from\): unknown role 'human'"
    )
    with pytest.raises(DataError, match=expected):
        read_dataset(spec_for(path, "sharegpt", columns=columns, roles=roles))


def test_messages_with_their_own_role_and_content_keys(tmp_path: Path):
    row = {"chat": [{"author": "user", "body": "안녕?"}, {"author": "model", "body": "안녕하세요."}]}
    columns = {"messages": "chat", "role": "author", "content": "body"}
    path = jsonl(tmp_path / "m.jsonl", [row])
    assert read_dataset(spec_for(path, "messages", columns=columns, roles={"assistant": "model"})).rows == [
        {"messages": [{"role": "user", "content": "안녕?"}, {"role": "assistant", "content": "안녕하세요."}]}
    ]
    expected = r"m\.jsonl:1: field 'chat\[1\]\.author' \(columns\.messages, columns\.role\): unknown role 'model'"
    with pytest.raises(DataError, match=expected):
        read_dataset(spec_for(path, "messages", columns=columns))


def test_preference_with_renamed_columns_and_a_system_column(tmp_path: Path):
    row = {"question": "수도는?", "good": "서울", "bad": "부산", "sys": "짧게 답하세요."}
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad", "system": "sys"}
    path = jsonl(tmp_path / "p.jsonl", [row])
    assert read_dataset(spec_for(path, "preference", columns=columns)).rows == [
        {
            "prompt": [{"role": "system", "content": "짧게 답하세요."}, {"role": "user", "content": "수도는?"}],
            "chosen": [{"role": "assistant", "content": "서울"}],
            "rejected": [{"role": "assistant", "content": "부산"}],
        }
    ]


def test_text_column_mapping_is_text_field(tmp_path: Path):
    path = jsonl(tmp_path / "t.jsonl", [{"body": "본문"}])
    by_columns = read_dataset(spec_for(path, "text", columns={"text": "body"}))
    by_text_field = read_dataset(spec_for(path, "text", text_field="body"))
    assert by_columns.rows == by_text_field.rows == [{"text": "본문"}]
    assert by_columns.fingerprint == by_text_field.fingerprint  # one setting, two spellings


def test_the_mapping_is_part_of_the_fingerprint(tmp_path: Path):
    path = jsonl(tmp_path / "d.jsonl", [{**dolly_row("q", "c", "r"), "output": "o"}])
    plain = read_dataset(spec_for(path, "alpaca")).fingerprint
    assert read_dataset(spec_for(path, "alpaca", columns=DOLLY)).fingerprint != plain
    path = jsonl(
        tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
    )
    tags = read_dataset(spec_for(path, "sharegpt", roles={"user": "human"})).fingerprint
    assert read_dataset(spec_for(path, "sharegpt")).fingerprint != tags


def test_a_row_missing_a_mapped_column_names_the_column_and_the_mapping(tmp_path: Path):
    rows = [dolly_row("q1", "", "a1"), dolly_row("q2", "", "a2"), {"instruction": "q3", "context": "", "answer": "a3"}]
    path = jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as err:
        read_dataset(spec_for(path, "alpaca", columns=DOLLY))
    assert f"{path}:3: field 'response' (columns.output): missing" in str(err.value)
    dataset = read_dataset(spec_for(path, "alpaca", bad=0.5, columns=DOLLY))  # quarantined like any bad row
    assert (len(dataset.rows), dataset.total) == (2, 3)
    assert str(dataset.errors[0]) == f"{path}:3: field 'response' (columns.output): missing"
    assert dataset.errors[0].record()["mapping"] == "columns.output"
    # a row that has the format's own name says so
    own = jsonl(tmp_path / "own.jsonl", [dolly_row("q", "", "a"), {"instruction": "q", "output": "a"}])
    expected = (
        r"own\.jsonl:2: field 'response' \(columns\.output\): missing \(the row has 'output', the format's own name"
    )
    with pytest.raises(DataError, match=expected):
        read_dataset(spec_for(own, "alpaca", columns=DOLLY))


def test_a_mapping_no_row_matches_is_one_error_naming_the_columns_the_rows_have(tmp_path: Path):
    """Alpaca rows read with dolly's columns: every row lacks 'response'; one error says the mapping is wrong."""
    rows = [{"instruction": f"질문 {i}", "input": "", "output": f"답 {i}"} for i in range(3)]
    path = jsonl(tmp_path / "alpaca.jsonl", rows)
    with pytest.raises(DataError) as err:
        read_dataset(spec_for(path, "alpaca", columns=DOLLY), stage="sft")
    message = str(err.value)
    assert "columns.output names column 'response', which no row has (all 3 rows lack it" in message
    assert "they have 'input', 'instruction', 'output'" in message and "fix stages.sft.data.columns.output" in message
    assert message.count("field 'response'") == 1 and f"{path}:1:" in message
    # a sharegpt message key the messages do not have
    convo = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    path = jsonl(tmp_path / "sharegpt.jsonl", [convo, convo])
    expected = (
        r"columns\.value names message key 'content', which no message has \(all 2 "
        r"rows lack it; they have 'from', 'value'\)"
    )
    with pytest.raises(DataError, match=expected):
        read_dataset(spec_for(path, "sharegpt", bad=0.9, columns={"value": "content"}))


def test_a_mapping_the_first_rows_all_miss_stops_the_read_there(tmp_path: Path):
    rows = [{"instruction": f"질문 {i}", "output": f"답 {i}"} for i in range(250)]
    path = jsonl(tmp_path / "big.jsonl", rows)
    with pytest.raises(DataError, match=r"which no row has \(the first 100 rows all lack it"):
        read_dataset(spec_for(path, "alpaca", bad=0.99, columns=DOLLY))
    # a mapped column that some rows have is no mapping mistake: those rows are bad rows as usual
    mixed = jsonl(tmp_path / "mixed.jsonl", [{"instruction": "q", "output": "a"}, dolly_row("q", "", "a")])
    with pytest.raises(DataError, match=r"1 of 2 rows are bad") as err:
        read_dataset(spec_for(mixed, "alpaca", columns=DOLLY))
    assert "which no row has" not in str(err.value)


SPEC_ERRORS = [
    ("alpaca", {"columns": {"answer": "response"}}, r"format 'alpaca' has no column 'answer'; it has instruction, "
     r"input, output, system, history"),
    ("sharegpt", {"columns": {"role": "speaker"}}, r"format 'sharegpt' has no column 'role'; it has conversations, "
     r"system, tools, from, value"),
    ("sharegpt", {"roles": {"bot": "gpt"}}, r"'bot' is not a role; roles maps user, assistant, system, tool, "
     r"function_call"),
    ("alpaca", {"roles": {"user": "human"}}, r"format 'alpaca' has no role tags; roles applies to messages and "
     r"sharegpt"),
    ("text", {"roles": {"user": "human"}}, r"format 'text' has no role tags"),
    ("preference", {"roles": {"assistant": "gpt"}}, r"format 'preference' has no role tags"),
    ("text", {"columns": {"text": "body"}, "text_field": "content"}, r"columns\.text \('body'\) and text_field "
     r"\('content'\) both name the text column"),
    ("alpaca", {"columns": {"output": "instruction"}}, r"instruction \(not mapped\) and columns\.output both read "
     r"'instruction'"),
    ("sharegpt", {"roles": {"user": "x", "assistant": "x"}}, r"roles\.assistant and roles\.user are both 'x'"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "settings", "words"), SPEC_ERRORS, ids=[str(s) for _, s, _ in SPEC_ERRORS])
def test_a_mapping_the_format_cannot_have_is_a_spec_error(fmt: str, settings: dict[str, Any], words: str):
    with pytest.raises(ValueError, match=words):
        DataSpec(uri="d.jsonl", format=fmt, **settings)


def test_a_spec_error_of_the_mapping_names_the_file_line_and_field(tmp_path: Path):
    from spec.document import SpecError
    from spec.loading import load_pipeline

    text = (
        "name: demo\nmodel:\n  name_or_path: Qwen/Qwen3-0.6B\nstages:\n  sft:\n    data:\n"
        "      uri: /mnt/datasets/dolly.jsonl\n      format: alpaca\n"
        "      columns: {input: context, response: response}\n"
    )
    path = tmp_path / "pipeline.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as err:
        load_pipeline(str(path))
    assert f"{path}:9: stages.sft.data.columns.response: format 'alpaca' has no column 'response'" in str(err.value)


def test_the_llama3_dolly_pipeline_reads_dolly_rows_end_to_end(tmp_path: Path):
    from spec.loading import load_pipeline

    data = load_pipeline("llama3-dolly").spec.stages.sft.data
    rows = [
        dolly_row("Who wrote Hamlet?", "", "William Shakespeare.", "open_qa"),
        dolly_row("When was the tower built?", "The tower was built in 1889.", "In 1889."),
    ]
    local = DataSpec(**{**data.model_dump(), "uri": str(jsonl(tmp_path / "dolly.jsonl", rows))})
    assert read_dataset(local, stage="sft").rows == [
        {
            "messages": [
                {"role": "user", "content": "Who wrote Hamlet?"},
                {"role": "assistant", "content": "William Shakespeare."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "When was the tower built?\n\nThe tower was built in 1889."},
                {"role": "assistant", "content": "In 1889."},
            ]
        },
    ]


def test_a_hub_dataset_goes_through_the_same_mapping(monkeypatch: pytest.MonkeyPatch):
    datasets = pytest.importorskip("datasets")
    null_response = {"instruction": "q2", "context": "", "response": None, "category": "open_qa"}
    hub = datasets.Dataset.from_list([dolly_row("q", "c", "a"), null_response])
    asked: list[tuple[str, str, str | None]] = []
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, split, revision: asked.append((name, split, revision)) or hub
    )
    spec = DataSpec(uri="hf://databricks/databricks-dolly-15k", format="alpaca", columns=DOLLY)
    expected = r"databricks-dolly-15k\[train\]:2: field 'response' \(columns\.output\): expected a string, got null"
    with pytest.raises(DataError, match=expected):
        read_dataset(spec)
    dataset = read_dataset(DataSpec(**{**spec.model_dump(), "max_bad_row_fraction": 0.5}))
    assert dataset.rows == [
        {"messages": [{"role": "user", "content": "q\n\nc"}, {"role": "assistant", "content": "a"}]}
    ]
    assert asked[-1] == ("databricks/databricks-dolly-15k", "train", None)
    # a pinned commit is what datasets is asked for, and part of what the rows are known by
    sha = "bdd27f4d94b9c1f951818a7da7fd7aeea5dbff1a"
    pinned = read_dataset(DataSpec(**{**spec.model_dump(), "max_bad_row_fraction": 0.5, "revision": sha}))
    assert asked[-1] == ("databricks/databricks-dolly-15k", "train", sha)
    assert pinned.rows == dataset.rows and pinned.fingerprint != dataset.fingerprint
    with pytest.raises(ValueError, match="revision names a hub dataset's commit: it applies to hf:// URIs only"):
        DataSpec(uri="rows.jsonl", format="text", revision=sha)


def test_personal_data_reaches_neither_the_splits_nor_the_quarantine(tmp_path: Path):
    spec = load_pipeline("korean-llm", profile="local").spec
    phone, rrn = "010-2345-6789", "900101-1234567"
    source = write_lines(
        tmp_path / "rows.jsonl",
        [
            *(json.dumps({"text": f"{i}번 고객 {phone}, 주민번호 {rrn}"}, ensure_ascii=False) for i in range(30)),
            json.dumps({"body": f"잘못된 열 {phone}"}, ensure_ascii=False),  # bad: no 'text', quarantined
        ],
    )
    data = DataSpec(uri=str(source), format="text", eval_fraction=0.1, max_bad_row_fraction=0.1)
    out, quarantine = tmp_path / "out", tmp_path / "quarantine.jsonl"
    counts = prepare_split(out, quarantine, "cpt", data, spec, tmp_path, 1)
    written = "".join(path.read_text(encoding="utf-8") for path in [*out.iterdir(), quarantine] if path.is_file())
    assert phone not in written and rrn not in written
    assert "[전화번호]" in written and "[주민등록번호]" in written
    assert counts["cleaning"]["pii"] == {"rrn": 30, "phone": 30}  # the valid rows; the bad one is only masked
    assert counts["quarantined"] == 1
