"""Tokenization and packing of a training stage's data, and the token cache prepare builds for it.

Rows are lists of `input_ids`, `labels` and `position_ids`. Several documents (CPT) or conversations (SFT)
share a row; `position_ids` restart at 0 where each one starts. The collator passes no `attention_mask`, so
transformers derives a block-diagonal causal mask from the position ids (sdpa, eager, flex) or runs the
varlen kernel (flash-attention): a document never attends to the one packed before it.

- CPT (text): each document ends with the eos token and the documents are laid end to end and cut into rows of
  `max_seq_length`; a document longer than that continues in the next row, starting again at position 0.
- SFT (messages; alpaca and sharegpt arrive normalized to messages from prepare): the model's chat template is
  applied, and only the assistant's tokens (its content and its end-of-turn token: stages.chat) carry loss.
  Conversations are truncated to `max_seq_length` and packed whole, best fit first.

The first token of every segment has label -100: nothing before it in the row may predict it.

The cache lives in `<run>/prepare/cache/<stage>/<key>/` (`train/`, `eval/` as datasets saved to disk, and
`meta.json` written last), keyed by the data fingerprint, the tokenizer, `max_seq_length` and the packing
settings, so a change to any of them builds a new cache and an unchanged one is reused.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.chat import IGNORE_INDEX, ConversationError, tokenize_conversation
from stages.contract import RunDir, canonical_hash, write_json_atomic
from workflows.spec import PipelineSpec, TrainingSpec

__all__ = ["IGNORE_INDEX", "tokenize_conversation"]  # re-exported: where the rows' labels come from
CACHE_FORMAT = 2  # bump when the row layout changes: old caches are then rebuilt
META_JSON = "meta.json"

Row = dict[str, list[int]]

MAX_LISTED_ERRORS = 5


class ConversationRowsError(Exception):
    """Rows of a split that the chat template cannot render into a trainable conversation: (line, problem)."""

    def __init__(self, path: Path, problems: list[tuple[int, str]]) -> None:
        self.path = path
        self.problems = problems
        listed = "\n".join(f"  {path}:{line}: {problem}" for line, problem in problems[:MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(problems) - MAX_LISTED_ERRORS} more" if len(problems) > MAX_LISTED_ERRORS else ""
        super().__init__(f"{len(problems)} conversations cannot be trained on:\n{listed}{more}")


# --------------------------------------------------------------------------- tokenization


def tokenize_document(tokenizer: Any, text: str) -> list[int]:
    """A CPT document's token ids, ending with eos (the document boundary the model learns to predict)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # long ones are cut later
    return [*ids, tokenizer.eos_token_id]


# --------------------------------------------------------------------------- packing


def _segment(ids: list[int], labels: list[int]) -> Row:
    """One document's piece: positions from 0, and no label on its first token."""
    return {
        "input_ids": list(ids),
        "labels": [IGNORE_INDEX, *labels[1:]],
        "position_ids": list(range(len(ids))),
    }


def _join(segments: list[Row]) -> Row:
    return {key: [value for seg in segments for value in seg[key]] for key in ("input_ids", "labels", "position_ids")}


def pack_stream(documents: Iterable[list[int]], max_seq_length: int) -> Iterator[Row]:
    """CPT packing: documents laid end to end and cut into rows of `max_seq_length` (the last may be shorter).
    A document that does not fit continues in the next row, starting at position 0."""
    row: list[Row] = []
    room = max_seq_length
    for ids in documents:
        while ids:
            piece, ids = ids[:room], ids[room:]
            row.append(_segment(piece, piece))
            room -= len(piece)
            if room == 0:
                yield _join(row)
                row, room = [], max_seq_length
    if row:
        yield _join(row)


def split_documents(documents: Iterable[list[int]], max_seq_length: int) -> Iterator[Row]:
    """CPT without packing: one document per row, a long one cut into several rows."""
    for ids in documents:
        for start in range(0, len(ids), max_seq_length):
            piece = ids[start : start + max_seq_length]
            yield _segment(piece, piece)


def pack_best_fit(examples: list[tuple[list[int], list[int]]], max_seq_length: int) -> list[Row]:
    """SFT packing: whole examples (each at most `max_seq_length`) into as few rows as fit, longest first,
    each into the row it fills best (best-fit decreasing)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]), reverse=True)
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        size = len(examples[i][0])
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = max_seq_length, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - size > 0:
            bisect.insort(free, (room - size, b))
    return [_join([_segment(*examples[i]) for i in members]) for members in bins]


@dataclass
class PackedCollator:
    """Stacks rows into a batch, right-padding to the longest row (rounded up to `pad_to_multiple_of`). The
    padding is a segment of its own (its positions restart at 0) with no labels, and no attention_mask is passed,
    so attention stays inside each document through the position ids."""

    pad_token_id: int
    pad_to_multiple_of: int = 1

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in rows)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
        for row in rows:
            pad = width - len(row["input_ids"])
            batch["input_ids"].append([*row["input_ids"], *[self.pad_token_id] * pad])
            batch["labels"].append([*row["labels"], *[IGNORE_INDEX] * pad])
            batch["position_ids"].append([*row["position_ids"], *range(pad)])
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}


def batch_width_multiple(training: TrainingSpec) -> int:
    """What PackedCollator rounds a batch's width up to. On a GPU, packed rows are padded to `max_seq_length`,
    so every step has the same shape and the compiled attention kernels (flex attention) are built once; unpacked
    rows to a multiple of 64. On CPU, nothing: the longest row."""
    if not torch.cuda.is_available():
        return 1
    return training.max_seq_length if training.packing else 64


# --------------------------------------------------------------------------- token cache


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes ('' when it does not exist)."""
    if not path.is_file():
        return ""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_hash(tokenizer_dir: Path) -> str:
    """sha256 over the files of a tokenizer directory (names and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in tokenizer_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(tokenizer_dir)).encode())
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def data_dir(run_dir: RunDir, stage: str) -> Path:
    """Where prepare writes the stage's normalized `train.jsonl` and `eval.jsonl`."""
    return run_dir.root / "prepare" / "data" / stage


def tokenizer_dir(run_dir: RunDir) -> Path:
    """Where prepare writes the run's tokenizer."""
    return run_dir.root / "prepare" / "tokenizer"


def cache_settings(run_dir: RunDir, spec: PipelineSpec, stage: str) -> dict[str, Any]:
    """Everything the cached rows depend on; its hash names the cache."""
    section = spec.stage(stage)
    training = section.training
    settings: dict[str, Any] = {
        "format": CACHE_FORMAT,
        "kind": "text" if section.data is not None and section.data.format == "text" else "chat",
        "data": {split: file_sha256(data_dir(run_dir, stage) / f"{split}.jsonl") for split in ("train", "eval")},
        "tokenizer": tokenizer_hash(tokenizer_dir(run_dir)),
        "max_seq_length": training.max_seq_length,
        "packing": training.packing,
    }
    if settings["kind"] == "chat":
        settings["assistant_only_loss"] = getattr(section, "assistant_only_loss", True)
        settings["enable_thinking"] = getattr(section, "enable_thinking", False)
    return settings


def cache_path(run_dir: RunDir, spec: PipelineSpec, stage: str) -> Path:
    """The cache directory for the stage's current data, tokenizer and settings."""
    key = canonical_hash(cache_settings(run_dir, spec, stage))
    return run_dir.root / "prepare" / "cache" / stage / key[:16]


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _rows_for_split(path: Path, tokenizer: Any, settings: dict[str, Any]) -> tuple[list[Row], dict[str, int]]:
    """Tokenize and pack one split; returns the rows and their counts."""
    max_len = settings["max_seq_length"]
    stats = {"documents": 0, "truncated": 0, "dropped": 0}
    if settings["kind"] == "text":
        documents = []
        for record in _read_jsonl(path):
            documents.append(tokenize_document(tokenizer, record["text"]))
        stats["documents"] = len(documents)
        pack = pack_stream if settings["packing"] else split_documents
        rows = list(pack(documents, max_len))
    else:
        examples = []
        problems: list[tuple[int, str]] = []
        for line, record in enumerate(_read_jsonl(path), start=1):
            stats["documents"] += 1
            try:
                ids, labels = tokenize_conversation(
                    tokenizer, record["messages"], settings["enable_thinking"], settings["assistant_only_loss"]
                )
            except ConversationError as exc:
                problems.append((line, str(exc)))
                continue
            if len(ids) > max_len:
                stats["truncated"] += 1
                ids, labels = ids[:max_len], labels[:max_len]
            if all(label == IGNORE_INDEX for label in labels[1:]):
                stats["dropped"] += 1  # truncation left no assistant token to learn from
                continue
            examples.append((ids, labels))
        if problems:
            raise ConversationRowsError(path, problems)
        if settings["packing"]:
            rows = pack_best_fit(examples, max_len)
        else:
            rows = [_segment(ids, labels) for ids, labels in examples]
    stats["rows"] = len(rows)
    stats["tokens"] = sum(len(row["input_ids"]) for row in rows)
    stats["label_tokens"] = sum(label != IGNORE_INDEX for row in rows for label in row["labels"])
    return rows, stats


def build_token_cache(run_dir: RunDir, spec: PipelineSpec, stage: str) -> Path:
    """Tokenize and pack the stage's prepared data into `<run>/prepare/cache/<stage>/<key>/`; a cache that is
    already complete (its meta.json exists) is reused. Returns the cache directory."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    path = cache_path(run_dir, spec, stage)
    if (path / META_JSON).is_file():
        return path
    settings = cache_settings(run_dir, spec, stage)
    if not settings["data"]["train"]:
        raise FileNotFoundError(f"{data_dir(run_dir, stage) / 'train.jsonl'} is missing: run the prepare stage first")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(run_dir))

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        meta: dict[str, Any] = {"stage": stage, "settings": settings}
        for split in ("train", "eval"):
            rows, stats = _rows_for_split(data_dir(run_dir, stage) / f"{split}.jsonl", tokenizer, settings)
            columns = {key: [row[key] for row in rows] for key in ("input_ids", "labels", "position_ids")}
            Dataset.from_dict(columns).save_to_disk(str(staging / split))
            meta[split] = stats
        write_json_atomic(staging / META_JSON, meta)
        try:
            os.replace(staging, path)
        except OSError:
            if not (path / META_JSON).is_file():  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


@dataclass
class TokenCache:
    """A stage's packed rows, loaded from the cache."""

    path: Path
    train: Any  # datasets.Dataset
    eval: Any | None  # datasets.Dataset, None when there is no held-out data
    meta: dict[str, Any]


def load_token_cache(run_dir: RunDir, spec: PipelineSpec, stage: str) -> TokenCache:
    """The stage's token cache, built first when it is missing (e.g. the data or settings changed)."""
    from datasets import load_from_disk

    path = build_token_cache(run_dir, spec, stage)
    meta = json.loads((path / META_JSON).read_text(encoding="utf-8"))
    evaluation = load_from_disk(str(path / "eval")) if meta["eval"]["rows"] else None
    return TokenCache(path=path, train=load_from_disk(str(path / "train")), eval=evaluation, meta=meta)
