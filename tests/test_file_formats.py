"""Data files as users have them (stages/file_formats.py): JSON arrays (LLaMA-Factory's files), CSV and TSV exports
(UTF-8 with a byte order mark, cp949), compressed, Arrow from `datasets`' save_to_disk, in the users' own Korean
columns: the same rows as the JSONL file, errors naming the file and line."""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spec.data import DataSpec
from spec.loading import load_pipeline
from stages import file_formats
from stages.check_data import check_stage_data
from stages.cleaning import row_text
from stages.data import DataError
from stages.prepared_data import read_dataset

ROWS = [
    {"지시": f"{i}번 질문에 답하세요.", "입력": "" if i % 2 else f"참고 {i}", "답변": f"답은 {i}입니다.\n둘째 줄"}
    for i in range(12)
]
COLUMNS = {"instruction": "지시", "input": "입력", "output": "답변"}
SPEC = load_pipeline("korean-llm", profile="local").spec


def alpaca(uri: Path, **extra: Any) -> DataSpec:
    return DataSpec(uri=str(uri), format="alpaca", columns=COLUMNS, eval_fraction=0.0, **extra)


def canonical(uri: Path, **extra: Any) -> list[dict[str, Any]]:
    return read_dataset(alpaca(uri, **extra)).rows


@pytest.fixture
def expected(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "reference.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS), encoding="utf-8")
    return canonical(path)


def csv_text(rows: list[dict[str, Any]], delimiter: str = ",") -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), delimiter=delimiter, lineterminator="\r\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def test_a_json_array_reads_as_its_jsonl_twin(tmp_path: Path, expected: list, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "alpaca_ko.json"
    path.write_text(json.dumps(ROWS, ensure_ascii=False, indent=2), encoding="utf-8")
    assert canonical(path) == expected
    monkeypatch.setattr(file_formats, "CHUNK_CHARS", 7)  # every element across chunk boundaries
    assert canonical(path) == expected
    gz = tmp_path / "alpaca_ko.json.gz"
    gz.write_bytes(gzip.compress(json.dumps(ROWS, ensure_ascii=False).encode()))
    assert canonical(gz) == expected
    lines = tmp_path / "lines.json"  # a .json file of JSON lines, as datasets reads it too
    lines.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in ROWS), encoding="utf-8")
    assert canonical(lines) == expected


def test_json_array_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"지시": "a", "답변": "b"},\n  {"지시": "a", "지시": "c", "답변": "b"}\n]', encoding="utf-8")
    dataset = read_dataset(alpaca(path, max_bad_row_fraction=0.5))
    assert len(dataset.rows) == 1
    assert [(e.line, e.error) for e in dataset.errors] == [
        (3, "key '지시' given twice in one object (which one is meant?)")
    ]
    path.write_text('[\n  {"지시": "a", "답변": "b"}\n  {"지시": "c"}\n]', encoding="utf-8")
    with pytest.raises(DataError, match=r"rows\.json:3: not a JSON array: ',' or ']' expected"):
        read_dataset(alpaca(path))
    path.write_text('[{"지시": "a", "답변": "b"},', encoding="utf-8")
    with pytest.raises(DataError, match=r"rows\.json:1: the JSON array ends before its '\]'"):
        read_dataset(alpaca(path))


def test_csv_and_tsv_exports_read_as_their_jsonl_twin(tmp_path: Path, expected: list) -> None:
    excel = tmp_path / "export.csv"  # UTF-8 with a byte order mark, CRLF, a quoted field over two lines
    excel.write_bytes(b"\xef\xbb\xbf" + csv_text(ROWS).encode())
    assert canonical(excel) == expected
    korean_excel = tmp_path / "cp949.csv"
    korean_excel.write_bytes(csv_text(ROWS).encode("cp949"))
    assert canonical(korean_excel, encoding="cp949") == expected
    with pytest.raises(DataError, match=r"cp949\.csv: byte \d+ is not text in utf-8; .*set data\.encoding: cp949"):
        canonical(korean_excel)
    tsv = tmp_path / "export.tsv.gz"
    tsv.write_bytes(gzip.compress(csv_text(ROWS, "\t").encode()))
    assert canonical(tsv) == expected


def test_table_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text('지시,답변\n"한 줄\n두 줄",답\n질문,답,남는 값\n', encoding="utf-8")
    dataset = read_dataset(alpaca(path, max_bad_row_fraction=0.5))
    assert len(dataset.rows) == 1 and row_text(dataset.rows[0]).startswith("한 줄\n두 줄")
    assert [(e.line, e.error) for e in dataset.errors] == [(4, "3 fields where the header names 2 columns")]
    path.write_text("지시,답변,지시\n가,나,다\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.csv:1: column '지시' is given twice in the header"):
        read_dataset(alpaca(path))


def test_arrow_from_save_to_disk_and_an_arrow_file(tmp_path: Path, expected: list) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))  # the stream format, beside dataset_info.json
    assert {p.name for p in saved.iterdir()} >= {"dataset_info.json", "state.json"}
    assert canonical(saved) == expected  # the metadata files are not read as rows
    table = pa.Table.from_pylist(ROWS)
    path = tmp_path / "rows.arrow"
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    assert canonical(path) == expected


def test_the_up_front_check_reads_every_kind(tmp_path: Path) -> None:
    # A column mapping the file does not have is found on the first rows of a JSON array and of a CSV file.
    for name, content in (("a.json", json.dumps(ROWS, ensure_ascii=False)), ("b.csv", csv_text(ROWS))):
        path = tmp_path / name
        path.write_text(content, encoding="utf-8")
        data = DataSpec(uri=str(path), format="alpaca", columns={**COLUMNS, "output": "응답"})
        problems = check_stage_data(SPEC, "sft", data)
        assert problems and "응답" in problems[0], problems
        assert not check_stage_data(SPEC, "sft", alpaca(path))


def test_the_up_front_check_masks_personal_data_in_its_lines(tmp_path: Path) -> None:
    # A role the format does not know, quoted in the error line: a phone number there is masked as prepare masks it.
    path = tmp_path / "chats.json"
    bad = [{"messages": [{"role": "010-2345-6789", "content": "안녕"}, {"role": "assistant", "content": "네"}]}]
    path.write_text(json.dumps(bad, ensure_ascii=False), encoding="utf-8")
    problems = check_stage_data(SPEC, "sft", DataSpec(uri=str(path), format="messages"))
    assert problems and "[전화번호]" in problems[0] and "010-2345-6789" not in "".join(problems), problems
    off = DataSpec(uri=str(path), format="messages", cleaning={"pii": "off"})
    assert "010-2345-6789" in "".join(check_stage_data(SPEC, "sft", off))
