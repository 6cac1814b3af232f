"""The builtin Korean datasets: generated from the installed konlpy corpus, deterministic, valid in their format."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from spec.data import DataSpec
from spec.lm_eval_tasks import BUILTIN_TASK_NAMES, LM_EVAL_TASKS
from stages.builtin_data import (
    BUILTIN_DATASETS,
    BUILTIN_LM_EVAL_TASKS,
    DOLLY_CATEGORIES,
    DOLLY_COLUMNS,
    HELDOUT_BILLS,
    BuiltinDataError,
    bills,
    builtin_dataset,
    constitution,
    corpus_dir,
    ko_constitution_mc,
    source_files,
    write_lm_eval_tasks,
)
from stages.data import DataError, read_jsonl, sha256_rows
from stages.normalize import normalize_row
from stages.prepared_data import read_dataset

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(find_spec("konlpy") is None, reason="the builtin data needs the konlpy package")


def test_corpus_is_read_from_the_installed_konlpy_without_importing_it():
    files = source_files()
    assert files[0].name == "constitution.txt" and len(files) == 11
    assert all(f.is_file() for f in files)
    assert corpus_dir().parent.parent.name == "konlpy"
    for name in BUILTIN_DATASETS:
        builtin_dataset(name)
    assert "konlpy" not in sys.modules  # importing konlpy would need Java


@pytest.mark.parametrize("name", sorted(BUILTIN_DATASETS))
def test_every_row_is_valid_and_canonical_unless_read_through_columns(name: str):
    builtin = BUILTIN_DATASETS[name]
    rows = builtin_dataset(name)
    assert rows
    for row in rows:
        normalized = normalize_row(row, builtin.format, columns=builtin.columns)
        # Rows in a canonical form come out as they are; dolly's and ShareGPT's shapes are read into one.
        assert normalized == row or builtin.columns or builtin.format == "sharegpt"


def test_sizes_and_content_come_from_the_corpus():
    constitution_text = (corpus_dir() / "kolaw" / "constitution.txt").read_text(encoding="utf-8")
    corpus = builtin_dataset("korean-corpus")
    instructions = builtin_dataset("korean-instructions")
    preferences = builtin_dataset("korean-preferences")
    assert len(constitution().articles) == 130 and len(corpus) > 130
    assert 200 <= len(instructions) <= 1000 and len(preferences) >= 100
    article_1 = constitution().articles[0]
    assert article_1.text.startswith("제1조") and article_1.text.splitlines()[0].split(" ", 1)[1] in constitution_text
    answers = [r["messages"][-1]["content"] for r in instructions]
    assert article_1.text in answers
    assert all(p["chosen"] != p["rejected"] for p in preferences)
    assert sum(p["chosen"][0]["content"] in constitution_text for p in preferences) >= 100


def test_heldout_documents_are_not_used_for_training():
    heldout = {r["text"] for r in builtin_dataset("korean-heldout")}
    assert len(heldout) >= 5
    training_text = "\n".join(r["text"] for r in builtin_dataset("korean-corpus"))
    training_text += "\n".join(m["content"] for r in builtin_dataset("korean-instructions") for m in r["messages"])
    training_text += "\n".join(v for r in builtin_dataset("korean-dolly") for v in r.values())
    for doc in heldout:
        body = doc.split("\n", 1)[1] if doc.startswith("대한민국헌법 부칙") else doc
        assert body[:200] not in training_text


DOLLY_CONTEXTS = {
    "open_qa": False,
    "closed_qa": True,
    "information_extraction": True,
    "summarization": True,
    "brainstorming": False,
    "classification": False,
    "creative_writing": False,
    "general_qa": False,
}
"""databricks-dolly-15k's categories → whether korean-dolly's rows of it have a context."""


def test_korean_dolly_is_shaped_like_databricks_dolly():
    rows = builtin_dataset("korean-dolly")
    assert 150 <= len(rows) <= 300 and len({tuple(r.values()) for r in rows}) == len(rows)
    assert all(list(r) == ["instruction", "context", "response", "category"] for r in rows)
    assert all(isinstance(v, str) and (v.strip() or k == "context") for r in rows for k, v in r.items())
    assert {r["category"] for r in rows} == set(DOLLY_CATEGORIES) == set(DOLLY_CONTEXTS)
    for row in rows:
        assert bool(row["context"]) == DOLLY_CONTEXTS[row["category"]], row
    # a context is an article of the constitution or the start of a training bill, line for line
    articles = {a.text for a in constitution().articles}
    bill_lines = [set(b.text.splitlines()) for b in bills()[:-HELDOUT_BILLS]]
    for context in (r["context"] for r in rows if r["context"]):
        assert context in articles or any(set(context.splitlines()) <= lines for lines in bill_lines), context
    kinds = {"article" if r["context"] in articles else "bill" for r in rows if r["context"]}
    assert kinds == {"article", "bill"}


def test_korean_dolly_is_read_as_alpaca_only_through_the_columns():
    """The rows keep dolly's names: the spec's columns are what map them, as for databricks-dolly-15k."""
    rows = builtin_dataset("korean-dolly")
    builtin = BUILTIN_DATASETS["korean-dolly"]
    assert (builtin.format, builtin.columns) == ("alpaca", {"input": "context", "output": "response"})
    with pytest.raises(DataError, match=r"korean-dolly:1: field 'output': missing"):
        read_dataset(DataSpec(uri="builtin:korean-dolly", format="alpaca"))
    dataset = read_dataset(DataSpec(uri="builtin:korean-dolly", format="alpaca", columns=DOLLY_COLUMNS), stage="sft")
    assert len(dataset.rows) == len(rows) and not dataset.errors
    closed = next(r for r in rows if r["category"] == "closed_qa")
    user = f"{closed['instruction']}\n\n{closed['context']}"
    assert {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": closed["response"]}]} in (
        dataset.rows
    )
    open_qa = next(r for r in rows if r["category"] == "open_qa")
    assert {"role": "user", "content": open_qa["instruction"]} in (m for r in dataset.rows for m in r["messages"])


def test_generation_is_deterministic_across_processes():
    here = {name: sha256_rows(builtin_dataset(name)) for name in BUILTIN_DATASETS}
    here["ko_constitution_mc"] = sha256_rows(ko_constitution_mc())
    code = (
        "from stages.builtin_data import BUILTIN_DATASETS, builtin_dataset, ko_constitution_mc\n"
        "from stages.data import sha256_rows\n"
        "for n in sorted(BUILTIN_DATASETS): print(n, sha256_rows(builtin_dataset(n)))\n"
        "print('ko_constitution_mc', sha256_rows(ko_constitution_mc()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    there = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert there == here


def test_the_multiple_choice_task_asks_for_the_true_continuation_of_an_article():
    rows = ko_constitution_mc()
    assert 40 <= len(rows) <= 80 and ko_constitution_mc() == rows
    first_lines = {a.number: a.text.splitlines()[0].replace("① ", "") for a in constitution().articles}
    assert len({r["article"] for r in rows}) == len(rows)
    for row in rows:
        assert set(row) == {"article", "context", "choices", "answer"}
        number, choices = row["article"], row["choices"]
        prefix = f"대한민국헌법 제{number}조 "
        assert row["context"].startswith(prefix) and len(choices) == 4 == len(set(choices))
        start = row["context"].removeprefix(prefix)
        line = first_lines[number].split(" ", 1)[1]
        assert f"{start} {choices[row['answer']]}" in line  # the true continuation, word for word
        wrong = [c for i, c in enumerate(choices) if i != row["answer"]]
        assert all(f"{start} {c}" not in line for c in wrong)
        assert all(any(c in text for n, text in first_lines.items() if n != number) for c in wrong)
    assert len({r["answer"] for r in rows}) == 4  # the answer's position varies


def test_the_task_folder_is_an_lm_eval_task_over_a_local_file(tmp_path: Path):
    counts, fingerprint = write_lm_eval_tasks(LM_EVAL_TASKS, tmp_path / "a")
    assert counts == {"ko_constitution_mc": len(ko_constitution_mc())}
    assert tuple(BUILTIN_LM_EVAL_TASKS) == BUILTIN_TASK_NAMES  # what submit checks task names against
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["ko_constitution_mc.jsonl", "ko_constitution_mc.yaml"]
    task = yaml.safe_load((tmp_path / "a" / "ko_constitution_mc.yaml").read_text(encoding="utf-8"))
    data_file = Path(task["dataset_kwargs"]["data_files"]["test"])
    assert task["task"] == "ko_constitution_mc" and task["dataset_path"] == "json" and task["test_split"] == "test"
    assert task["output_type"] == "multiple_choice"
    assert [m["metric"] for m in task["metric_list"]] == ["acc", "acc_norm"]
    # datasets reads data_files relative to the working directory: the path must not depend on it.
    assert data_file.is_absolute() and data_file == (tmp_path / "a" / "ko_constitution_mc.jsonl").absolute()
    assert [r.value for r in read_jsonl(data_file, 1 << 20)] == ko_constitution_mc()
    # The fingerprint is of the questions and the task, not of where the folder is.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "old.yaml").write_text("task: old\n", encoding="utf-8")
    assert write_lm_eval_tasks(LM_EVAL_TASKS, tmp_path / "b") == (counts, fingerprint)
    assert not (tmp_path / "b" / "old.yaml").exists()  # the folder holds the builtin tasks only
    with pytest.raises(BuiltinDataError, match="unknown builtin lm-eval task folder 'nope'; known: korean-lm-eval"):
        write_lm_eval_tasks("nope", tmp_path / "c")


def test_the_corpus_text_is_not_committed_to_the_repository():
    probe = constitution().articles[9].text.splitlines()[0][6:60]  # a sentence of article 10
    assert len(probe) > 30
    # What git would commit: tracked files and new ones it does not ignore (not the venv, runs, or a carried copy of
    # the konlpy wheel's files in an ignored folder).
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode("utf-8")
    paths = [REPO / name for name in listed.split("\0") if name]
    assert len(paths) > 100
    for path in paths:
        if path.is_file() and path.suffix in {".py", ".json", ".jsonl", ".txt", ".md", ".yaml", ".yml"}:
            assert probe not in path.read_text(encoding="utf-8", errors="ignore"), path


def test_korean_sharegpt_is_the_instructions_in_sharegpt_shape() -> None:
    rows = builtin_dataset("korean-sharegpt")
    assert rows and all(set(row) == {"conversations"} for row in rows)
    assert {turn["from"] for row in rows for turn in row["conversations"]} == {"system", "human", "gpt"}
    dataset = read_dataset(DataSpec(uri="builtin:korean-sharegpt", format="sharegpt"), stage="sft")
    assert [row["messages"] for row in dataset.rows] == [
        row["messages"] for row in builtin_dataset("korean-instructions")
    ]
