"""Data that is valid enough to get past a first look but no data Python can hold or write: arrays nested 100,000
deep, a 5000-digit number, a lone surrogate (`\\ud800`, half a character, which cannot be written as UTF-8), a
symlink loop in a data directory and a decompression bomb (a few KiB of zstd that inflate to 100 MiB of one line).
prepare fails on each with one `error:` message naming the file and line (or the link, or the limit), exit 1,
`stage.json` failed with that message, no traceback, nothing half-written; in process and through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from test_bad_input import Case, bad_data, check_nothing_half_written, only, run_in_process, snapshot, with_run_dir

REPO = Path(__file__).resolve().parents[2]
DEEP = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"


def symlink_loop(tmp: Path) -> list[str]:
    """prepare over a data directory with a good file and two links that point at each other."""
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "part-0.jsonl").write_text('{"text": "서울은 아름답습니다."}\n', encoding="utf-8")
    (corpus / "loop-a.jsonl").symlink_to("loop-b.jsonl")
    (corpus / "loop-b.jsonl").symlink_to("loop-a.jsonl")
    return with_run_dir([*only("cpt"), f"stages.cpt.data.uri={corpus}"], stage="prepare")(tmp)


FORGED = "\n[prepare] cpt: all rows fine\r\x1b[2K"


def forged_file_name(tmp: Path) -> list[str]:
    """prepare over a data directory whose file name holds a newline, a carriage return and a terminal escape."""
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / f"part{FORGED}.jsonl").write_text('{"text": 5}\n', encoding="utf-8")
    return with_run_dir([*only("cpt"), f"stages.cpt.data.uri={corpus}"], stage="prepare")(tmp)


def parquet_column_twice(tmp: Path) -> list[str]:
    """prepare over a Parquet file whose two columns are both named 'text'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [pa.array(["좋은 문장."]), pa.array(["다른 문장."])]
    pq.write_table(pa.Table.from_arrays(columns, names=["text", "text"]), tmp / "data.parquet")
    overrides = [*only("cpt"), f"stages.cpt.data.uri={tmp / 'data.parquet'}"]
    return with_run_dir(overrides, stage="prepare")(tmp)


def zstd_bomb(tmp: Path) -> list[str]:
    """prepare over 100 MiB of one byte without a newline, compressed a MiB at a time into a few KiB."""
    bomb = zstandard.ZstdCompressor().compressobj()
    content = b"".join(bomb.compress(b"a" * (1 << 20)) for _ in range(100)) + bomb.flush()
    return bad_data("cpt", "text", content, "corpus.jsonl.zst")(tmp)


CASES = [
    Case("data-nested-too-deep", "stages", bad_data("cpt", "text", '{"text": "좋은 문장."}\n' + DEEP),
         ("data.jsonl:2: arrays or objects nested too deeply",), code=1),
    Case("data-5000-digits", "stages", bad_data("cpt", "text", '{"text": "a", "id": ' + "9" * 5000 + "}\n"),
         ("data.jsonl:1: a number of more than 4300 digits",), code=1),
    Case("data-lone-surrogate", "stages", bad_data("sft", "messages", '{"messages": [{"role": "user", "content": '
                                                   '"q"}, {"role": "assistant", "content": "a\\ud800"}]}\n'),
         ("data.jsonl:1: field 'messages[1].content': a lone surrogate \\ud800",), code=1),
    Case("data-symlink-loop", "stages", symlink_loop, ("corpus/loop-a.jsonl: a symlink loop",), code=1),
    Case("data-duplicate-key", "stages", bad_data("cpt", "text", '{"text": "좋은 문장.", "text": "다른 문장."}\n'),
         ("data.jsonl:1: key 'text' given twice in one object",), code=1),
    Case("data-duplicate-nested-key", "stages", bad_data("sft", "messages", '{"messages": [{"role": "user", '
                                                         '"content": "q", "role": "assistant"}]}\n'),
         ("data.jsonl:1: key 'role' given twice in one object",), code=1),
    Case("data-parquet-column-twice", "stages", parquet_column_twice,
         ("data.parquet: column 'text' is given twice",), code=1),
    Case("data-file-name-forges-lines", "stages", forged_file_name,
         ("corpus/part\\n[prepare] cpt: all rows fine\\r\\x1b[2K.jsonl':1",), code=1),
    Case("data-zstd-bomb", "stages", zstd_bomb,
         ("corpus.jsonl.zst: decompresses to more than 67108864 bytes from", "over the limit of 1000x"), code=1),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_prepare_fails_with_one_message_and_a_failed_record(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    argv = case.build(tmp_path)
    before = snapshot(tmp_path)
    code, output = run_in_process(case, argv, tmp_path, capsys)
    assert code == case.code, output
    assert case.says[0] in output and "Traceback" not in output
    assert output.count("error:") == 1 and output.lstrip().startswith("[prepare] error: "), output
    assert all(line.startswith("  ") for line in output.strip().splitlines()[1:]), output  # the rest: its rows
    assert not any(c in output for c in "\r\x1b\u2028"), output
    check_nothing_half_written(tmp_path, case, before)  # stage.json failed, naming the same file and line
    assert not (tmp_path / "run" / "prepare" / "logs" / "traceback.txt").exists()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_real_cli_says_the_same(case: Case, tmp_path: Path) -> None:
    argv = case.build(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "stages", *argv]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert case.says[0] in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    record = json.loads((tmp_path / "run" / "prepare" / "stage.json").read_text(encoding="utf-8"))
    assert record["status"] == "failed" and case.says[0] in record["message"]
