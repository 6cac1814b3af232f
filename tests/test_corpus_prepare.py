"""Corpus-scale prepare (stages/prepared_data.py, stages/packing.py, stages/workers.py): a directory of plain and
compressed shards, NFD and CP949 input, duplicates and evaluation text dropped and counted, the same bytes with any
number of workers, nothing left behind by a dataset that fails, and a token cache read memory-mapped that holds
exactly the rows the packers make."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import zstandard

from run.run_dir import RunDir
from spec.loading import load_pipeline
from stages.chat import tokenize_conversation
from stages.contract import StageContext
from stages.packing import TokenRows, pack_best_fit, pack_stream, tokenize_document
from stages.prepare import run
from stages.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
ONLY_CPT = [f"stages.{s}.enabled=false" for s in ("sft", "rlhf", "evaluate", "deploy")]


def kolaw_sentences() -> list[str]:
    """Korean sentences of the law texts the konlpy wheel ships (read as files: importing konlpy needs Java)."""
    spec = importlib.util.find_spec("konlpy")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(spec.submodule_search_locations[0]) / "data" / "corpus" / "kolaw"
    lines = [line.strip() for f in sorted(folder.glob("*.txt")) for line in f.read_text("utf-8").splitlines()]
    return [line for line in lines if len(line) >= 20]


SENTENCES = kolaw_sentences()


def doc(i: int) -> str:
    """A distinct Korean document: three law sentences and its number."""
    return f"{i}번 문서. " + " ".join(SENTENCES[(i * 3 + k) % len(SENTENCES)] for k in range(3))


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


def prepare(tmp_path: Path, overrides: list[str], name: str = "run") -> tuple[StageContext, int]:
    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null", *overrides]).spec
    run_dir = RunDir(tmp_path / name)
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, "prepare", spec)
    return ctx, run(ctx)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(autouse=True)
def _local_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_a_directory_of_compressed_shards_is_read_normalized_deduplicated_and_counted(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "part").mkdir(parents=True)
    (corpus / "a.jsonl").write_bytes(jsonl([{"text": doc(i)} for i in range(60)]))
    # duplicates of a.jsonl's documents: the same text in NFD (jamo, as macOS tools write it), other spacing
    copies = [{"text": unicodedata.normalize("NFD", doc(i))} for i in range(5)]
    copies += [{"text": "  " + doc(i).replace(" ", "   ") + "\n"} for i in range(5, 8)]
    (corpus / "part" / "b.jsonl.gz").write_bytes(
        gzip.compress(jsonl([{"text": doc(i)} for i in range(60, 90)] + copies))
    )
    nfd = [{"text": unicodedata.normalize("NFD", doc(i))} for i in range(90, 120)]
    (corpus / "part" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(nfd)))
    (corpus / "notes.txt").write_text("not data")

    ctx, code = prepare(tmp_path, [*ONLY_CPT, f"stages.cpt.data.uri={corpus}", "stages.prepare.num_proc=2"])
    assert code == 0, ctx.run_dir.read_result("prepare").message
    counts = ctx.run_dir.read_result("prepare").extra["data"]["cpt"]
    assert counts["read_rows"] == 128 and counts["rows"] == 120
    assert {r: n for r, n in counts["cleaning"]["dropped"].items() if n} == {"duplicate": 8}
    assert [s["uri"] for s in counts["sources"]] == [
        str(corpus / "a.jsonl"),
        str(corpus / "part" / "b.jsonl.gz"),
        str(corpus / "part" / "c.jsonl.zst"),
    ]
    data = ctx.dir / "data" / "cpt"
    rows = lines(data / "train.jsonl") + lines(data / "eval.jsonl")
    assert sorted(r["text"] for r in rows) == sorted(doc(i) for i in range(120))  # NFC, the first copy kept
    origins = (data / "train.origins").read_text().splitlines()
    at = origins.index(f"{corpus / 'part' / 'c.jsonl.zst'}:1")  # the user's file and line of every row
    assert lines(data / "train.jsonl")[at]["text"] == doc(90)


def test_cp949_data_is_read_with_its_encoding_and_named_without_it(tmp_path: Path) -> None:
    path = tmp_path / "legacy.jsonl"
    path.write_bytes(jsonl([{"text": doc(i)} for i in range(4)]).decode().encode("cp949"))
    overrides = [*ONLY_CPT, f"stages.cpt.data.uri={path}"]

    ctx, code = prepare(tmp_path, [*overrides, "stages.cpt.data.encoding=cp949"], "cp949")
    assert code == 0
    data = ctx.dir / "data" / "cpt"
    assert sorted(r["text"] for r in lines(data / "train.jsonl") + lines(data / "eval.jsonl")) == sorted(
        map(doc, range(4))
    )

    ctx, code = prepare(tmp_path, overrides, "utf8")
    message = ctx.run_dir.read_result("prepare").message
    assert code == 1 and f"{path}:1: invalid UTF-8 at byte" in message and len(message.splitlines()) == 1
    assert "and so are 3 more of its 4 lines; the file decodes as cp949" in message
    assert f"`iconv -f cp949 -t utf-8 {path} > {tmp_path / 'legacy.utf8.jsonl'}`" in message
    assert message.endswith("or set stages.cpt.data.encoding: cp949")

    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(path.read_bytes() + '{"text": "깨진 '.encode("cp949") + b"\xff\xff" + b'"}\n')
    ctx, code = prepare(tmp_path, [*ONLY_CPT, f"stages.cpt.data.uri={broken}", "stages.cpt.data.encoding=cp949"], "bad")
    assert code == 1 and f"{broken}:5: invalid cp949 at byte" in ctx.run_dir.read_result("prepare").message


def test_lines_not_in_the_datas_encoding_are_one_message_per_file_after_the_first_rows(tmp_path: Path) -> None:
    """Past the rows the up-front check reads (stages/check_data.py), prepare's own listing says the same: the lines
    of a file that are not UTF-8 are one line, its first and how many more, never one line per row."""
    path = tmp_path / "mixed.jsonl"
    good = [{"text": doc(i)} for i in range(30)]
    path.write_bytes(jsonl(good) + jsonl([{"text": doc(100 + i)} for i in range(8)]).decode().encode("cp949"))
    ctx, code = prepare(tmp_path, [*ONLY_CPT, f"stages.cpt.data.uri={path}"])
    message = ctx.run_dir.read_result("prepare").message
    assert code == 1 and message.splitlines()[0].endswith(
        "8 of 38 rows are bad (21.05%), over max_bad_row_fraction=0.0:"
    )
    assert message.splitlines()[1].startswith(f"  {path}:31: invalid UTF-8 at byte 13 of the line (0xb9), and so")
    assert "and so are 7 more of its lines; the file decodes as cp949" in message
    assert len(message.splitlines()) == 2


def test_training_rows_that_contain_evaluation_text_are_dropped_and_counted(tmp_path: Path) -> None:
    held_out = [doc(1000 + i) for i in range(3)]
    evaluate = tmp_path / "heldout.jsonl"
    evaluate.write_bytes(jsonl([{"text": t} for t in held_out]))
    words = held_out[1].split()
    rows = [{"text": doc(i)} for i in range(40)]
    rows += [{"text": held_out[0]}, {"text": unicodedata.normalize("NFD", held_out[2])}]  # the same texts
    rows += [{"text": "서문. " + " ".join(words[5:18]) + " 끝."}]  # a 13-word span of one
    rows += [{"text": "서문. " + " ".join(words[5:17]) + " 끝."}]  # 12 words: kept
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(jsonl(rows))
    overrides = [f"stages.{s}.enabled=false" for s in ("sft", "rlhf", "deploy")]
    overrides += [f"stages.cpt.data.uri={corpus}", f"stages.evaluate.data.uri={evaluate}"]
    overrides += ["stages.evaluate.data.format=text", "stages.evaluate.lm_eval_tasks=[]"]
    overrides += ["stages.evaluate.lm_eval_include_path=null"]

    ctx, code = prepare(tmp_path, overrides)
    assert code == 0, ctx.run_dir.read_result("prepare").message
    counts = ctx.run_dir.read_result("prepare").extra["data"]["cpt"]
    dropped = {r: n for r, n in counts["cleaning"]["dropped"].items() if n}
    assert dropped == {"contaminated": 3} and counts["rows"] == 41
    ctx, code = prepare(tmp_path, [*overrides, "stages.cpt.data.cleaning.decontaminate=false"], "off")
    assert ctx.run_dir.read_result("prepare").extra["data"]["cpt"]["rows"] == 44


def test_any_number_of_workers_writes_the_same_bytes_and_the_cache_holds_the_packers_rows(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(jsonl([{"text": doc(i) * (1 + i % 4)} for i in range(300)]))
    overrides = [f"stages.{s}.enabled=false" for s in ("rlhf", "evaluate", "deploy")]
    overrides += [f"stages.cpt.data.uri={corpus}", "stages.cpt.training.max_seq_length=128"]
    one, code = prepare(tmp_path, [*overrides, "stages.prepare.num_proc=1"], "one")
    assert code == 0
    two, code = prepare(tmp_path, [*overrides, "stages.prepare.num_proc=2"], "two")
    assert code == 0
    files = sorted(p.relative_to(one.dir) for p in one.dir.rglob("*") if p.is_file() and "/tokenizer" not in str(p))
    written = [f for f in files if f.parts[0] in ("data", "cache")]
    assert any(f.name == "tokens.bin" for f in written) and any(f.name == "train.jsonl" for f in written)
    for f in written:
        if f.name not in ("meta.json", "manifest.json"):  # they record file times
            assert (one.dir / f).read_bytes() == (two.dir / f).read_bytes(), f

    tokenizer = load_tokenizer(one.dir / "tokenizer")
    for stage in ("cpt", "sft"):
        cache = next((one.dir / "cache" / stage).iterdir())
        rows = TokenRows(cache / "train")
        assert len(pickle.dumps(rows)) < 1000  # a worker or datasets' fingerprint gets the path, not the arrays
        train = lines(one.dir / "data" / stage / "train.jsonl")
        if stage == "cpt":
            expected = list(pack_stream([tokenize_document(tokenizer, r["text"]) for r in train], 128))
        else:
            examples = [tokenize_conversation(tokenizer, r["messages"]) for r in train]
            max_len = one.spec.stages.sft.training.max_seq_length
            expected = pack_best_fit([(ids[:max_len], labels[:max_len]) for ids, labels in examples], max_len)
        assert [rows[i] for i in range(len(rows))] == expected


def test_a_dataset_that_fails_midway_leaves_nothing_behind(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(jsonl([{"text": doc(i)} for i in range(50)]))
    # the bad rows come after the rows the up-front check samples (stages/check_data.py): the workers meet them
    (corpus / "b.jsonl").write_bytes(jsonl([{"text": doc(i)} for i in range(50, 80)]) + b"{broken\n" * 20)
    ctx, code = prepare(tmp_path, [*ONLY_CPT, f"stages.cpt.data.uri={corpus}", "stages.prepare.num_proc=2"])
    assert code == 1 and "20 of 100 rows are bad" in ctx.run_dir.read_result("prepare").message
    left = [p.name for p in (ctx.dir / "data").rglob("*") if p.is_file()] if (ctx.dir / "data").exists() else []
    assert left == [] and not (ctx.dir / "cache").exists()


def test_sigterm_while_workers_read_stops_them_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A preempted prepare pod: the stage ends interrupted (exit 75) in seconds, its workers with it, and no split,
    quarantine or cache is left for a rerun to trust."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(jsonl([{"text": doc(i) * 3} for i in range(60_000)]))
    spec = load_pipeline(
        "korean-llm",
        "local",
        ["tracking.wandb_project=null", *ONLY_CPT, f"stages.cpt.data.uri={corpus}", "stages.prepare.num_proc=2"],
    ).spec
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(spec)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    command = [sys.executable, "-m", "stages", "prepare", "--run-dir", str(run_dir.root)]
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while len(workers) < 2 and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.2)
        children = Path(f"/proc/{child.pid}/task/{child.pid}/children")
        workers = [int(p) for p in children.read_text().split()] if children.exists() else []
    assert len(workers) == 2, "the workers should have started"
    time.sleep(1.0)  # reading and writing, mid-dataset
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=300)  # a hang guard: under a loaded CI machine the ending takes more than 60 s
    assert child.returncode == 75, out[-2000:]
    assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers)
    stage = run_dir.stage_dir("prepare")
    left = [p.name for p in (stage / "data").rglob("*") if p.is_file()] if (stage / "data").exists() else []
    assert left == [] and not (stage / "cache").exists()
    assert run_dir.read_result("prepare").status == "interrupted"


def test_workers_that_cannot_start_leave_the_work_to_this_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fork refused (a process limit, no memory for the copy): the map runs in this process with a warning, the
    same results in the same order."""
    from stages import workers

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", "/dev/shm/sem.mp-x")

    monkeypatch.setattr(workers.multiprocessing, "get_context", refused)
    assert list(workers.ordered_map(abs, [-3, 2, -1], num_proc=2)) == [3, 2, 1]
    assert "warning: cannot start 2 worker processes ([Errno 13] Permission denied" in capsys.readouterr().err


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


def test_workers_default_to_the_prepare_pods_cpu_request_in_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages import workers

    monkeypatch.setattr(workers, "usable_cpus", lambda: 16)
    spec = load_pipeline("korean-llm", "local").spec
    spec.stages.prepare.resources.cpu = "7500m"
    assert workers.default_num_proc(spec, in_cluster=True) == 7  # the request, rounded down
    assert workers.default_num_proc(spec, in_cluster=False) == 16  # locally: the machine's CPUs
    spec.stages.prepare.resources.cpu = "500m"
    assert workers.default_num_proc(spec, in_cluster=True) == 1
    spec.stages.prepare.num_proc = 32
    assert workers.default_num_proc(spec, in_cluster=True) == 16  # never more than this process may use


@pytest.mark.parametrize("template", ["qwen3", "gemma3"])
def test_documents_encode_as_the_tokenizer_call_does(template: str) -> None:
    """CPT documents are encoded without offsets (`encode_texts`, the tokenizer's `encode_batch_fast`): the ids the
    tokenizer's own call gives, Korean, emoji and long documents alike."""
    from stages.chat import encode_texts
    from stages.tokenizer import train_bpe_tokenizer

    texts = ["서울은 크고 넓습니다. " * 50, "이모지 😀👍🏽 漢字", "", "e\u0301 ascii\ttabs"]
    tokenizer = train_bpe_tokenizer(texts * 10, 400, 1024, template)
    assert encode_texts(tokenizer, texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]
