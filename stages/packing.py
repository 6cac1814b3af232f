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

The cache lives in `<run>/prepare/cache/<stage>/<key>/` (`train/`, `eval/`, and `meta.json` written last), keyed
by the data fingerprint, the tokenizer, `max_seq_length` and the packing settings, so a change to any of them
builds a new cache and an unchanged one is reused. Each split is a few flat arrays (tokens, loss flags, row
segments: see SplitWriter), written in a stream by `num_proc` tokenizing processes and read memory-mapped
(TokenRows): neither building nor training holds the corpus in memory, and the ranks of a node share the pages.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from run.config_hash import canonical_hash
from run.run_dir import RunDir, write_json_atomic
from spec.data import datasets
from spec.pipeline import PipelineSpec
from spec.training import TrainingSpec
from stages.chat import IGNORE_INDEX, ConversationError, conversation_masks, encode_texts, tokenize_conversation
from stages.router_loss import TOKEN_MASK
from stages.workers import default_num_proc, ordered_map

__all__ = ["IGNORE_INDEX", "tokenize_conversation"]  # re-exported: where the rows' labels come from
CACHE_FORMAT = 3  # bump when the row layout changes: old caches are then rebuilt (3: flat memory-mapped arrays)
META_JSON = "meta.json"

Row = dict[str, list[int]]

MAX_LISTED_ERRORS = 5


class ConversationRowsError(Exception):
    """Rows of a split that the chat template cannot render into a trainable conversation: the first few as
    (line, problem), and how many there are in all."""

    def __init__(self, path: Path, problems: list[tuple[int, str]], total: int | None = None) -> None:
        self.path = path
        self.problems = problems[:MAX_LISTED_ERRORS]
        self.total = len(problems) if total is None else total
        listed = "\n".join(f"  {path}:{line}: {problem}" for line, problem in self.problems)
        more = f"\n  ... and {self.total - len(self.problems)} more" if self.total > len(self.problems) else ""
        super().__init__(f"{self.total} conversations cannot be trained on:\n{listed}{more}")


# --------------------------------------------------------------------------- tokenization


def tokenize_document(tokenizer: Any, text: str) -> list[int]:
    """A CPT document's token ids, ending with eos (the document boundary the model learns to predict)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # long ones are cut later
    return [*ids, tokenizer.eos_token_id]


# --------------------------------------------------------------------------- packing plans

Segment = tuple[int, int]
"""[start, end) of one document's piece in a split's flat token array."""


class StreamPacker:
    """CPT packing, planned on lengths: documents laid end to end and cut into rows of `max_seq_length` (the last
    may be shorter). A document that does not fit continues in the next row, starting at position 0."""

    def __init__(self, max_seq_length: int) -> None:
        self.max_seq_length = max_seq_length
        self.row: list[Segment] = []
        self.room = max_seq_length

    def add(self, start: int, length: int) -> list[list[Segment]]:
        """Lay a document (its tokens at [start, start + length)) into the rows; returns the rows it completed."""
        done = []
        while length:
            take = min(self.room, length)
            self.row.append((start, start + take))
            start, length, self.room = start + take, length - take, self.room - take
            if self.room == 0:
                done.append(self.row)
                self.row, self.room = [], self.max_seq_length
        return done

    def finish(self) -> list[list[Segment]]:
        """The last, partly filled row, if any."""
        row, self.row, self.room = self.row, [], self.max_seq_length
        return [row] if row else []


def document_rows(start: int, length: int, max_seq_length: int) -> list[list[Segment]]:
    """CPT without packing: one document per row, a long one cut into several rows."""
    end = start + length
    return [[(s, min(s + max_seq_length, end))] for s in range(start, end, max_seq_length)]


def best_fit(lengths: Sequence[int], max_seq_length: int) -> list[list[int]]:
    """SFT packing, planned on lengths: the examples (each at most `max_seq_length`) into as few rows as fit,
    longest first (ties in input order), each into the row it fills best (best-fit decreasing). The room left in
    the rows is kept in a segment tree over 1..max_seq_length, as TRL's `pack_dataset(strategy="bfd")` does;
    TRL packs each map batch of an Arrow table of token lists on its own, this plans the whole split at once
    from its lengths alone, so the tokens never have to be in memory."""
    size = 1 << (max_seq_length - 1).bit_length()
    tree = [0] * (2 * size)  # tree[size + r - 1] = r when some row has room r; inner nodes hold their max

    def set_leaf(room: int, value: int) -> None:
        i = size + room - 1
        tree[i] = value
        while i > 1:
            i >>= 1
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left >= right else right

    def smallest_room_at_least(need: int) -> int:
        if tree[1] < need:
            return 0
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] >= need else 2 * i + 1
        return tree[i]

    bins: list[list[int]] = []
    by_room: dict[int, deque[int]] = {}  # room left -> bins with that room, oldest first
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for i in order:
        need = lengths[i]
        room = smallest_room_at_least(need)
        if room:
            b = by_room[room].popleft()
            if not by_room[room]:
                del by_room[room]
                set_leaf(room, 0)
        else:
            room, b = max_seq_length, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - need
        if left > 0:
            if left not in by_room:
                by_room[left] = deque()
                set_leaf(left, left)
            by_room[left].append(b)
    return bins


def _row(segments: list[Segment], tokens: Sequence[int], loss: Sequence[int] | None = None) -> Row:
    """A row's input_ids, labels and position_ids from its segments of a split's flat arrays: positions restart
    at 0 in each segment, and the first token of a segment has no label (nothing before it in the row predicts
    it); tokens without loss (`loss` 0) have none either."""
    ids, labels, positions = [], [], []
    for start, end in segments:  # numpy: a training row is read at every step
        piece = np.asarray(tokens[start:end], dtype=np.int64)
        labelled = piece.copy() if loss is None else np.where(np.asarray(loss[start:end], bool), piece, IGNORE_INDEX)
        labelled[0] = IGNORE_INDEX
        ids.append(piece)
        labels.append(labelled)
        positions.append(np.arange(end - start))
    if not ids:
        return {"input_ids": [], "labels": [], "position_ids": []}
    return {
        "input_ids": np.concatenate(ids).tolist(),
        "labels": np.concatenate(labels).tolist(),
        "position_ids": np.concatenate(positions).tolist(),
    }


def pack_stream(documents: Iterable[list[int]], max_seq_length: int) -> Iterator[Row]:
    """CPT packing of token lists (StreamPacker's plan, as rows)."""
    tokens: list[int] = []
    packer = StreamPacker(max_seq_length)
    for ids in documents:
        start = len(tokens)
        tokens += ids
        for segments in packer.add(start, len(ids)):
            yield _row(segments, tokens)
    for segments in packer.finish():
        yield _row(segments, tokens)


def split_documents(documents: Iterable[list[int]], max_seq_length: int) -> Iterator[Row]:
    """CPT without packing, of token lists (document_rows' plan, as rows)."""
    for ids in documents:
        for segments in document_rows(0, len(ids), max_seq_length):
            yield _row(segments, ids)


def example_row(ids: list[int], labels: list[int]) -> Row:
    """One (ids, labels) example as a row of its own: positions from 0, no label on its first token."""
    return {"input_ids": list(ids), "labels": [IGNORE_INDEX, *labels[1:]], "position_ids": list(range(len(ids)))}


def pack_best_fit(examples: list[tuple[list[int], list[int]]], max_seq_length: int) -> list[Row]:
    """SFT packing of (ids, labels) examples (best_fit's plan, as rows)."""
    rows = []
    for members in best_fit([len(ids) for ids, _ in examples], max_seq_length):
        parts = [example_row(*examples[i]) for i in members]
        rows.append({key: [v for part in parts for v in part[key]] for key in ("input_ids", "labels", "position_ids")})
    return rows


@dataclass
class PackedCollator:
    """Stacks rows into a batch, right-padding to the longest row (rounded up to `pad_to_multiple_of`). No
    attention_mask is passed, so attention stays inside each document through the position ids. The padding has no
    labels and continues the row's last document (its positions run on): causal attention keeps it out of every
    real token's output, and it is never a segment of its own. On its own it would attend to nothing but padding:
    where the pad token's embedding row is zero (a model built from config) its hidden states would be exactly zero
    in every layer, and RMSNorm's backward at zero multiplies whatever gradient reaches them by 1/sqrt(eps) (1000)
    at each norm, which overflowed bf16 on Qwen3-30B-A3B's 48 layers (docs/performance.md, B5)."""

    pad_token_id: int
    pad_to_multiple_of: int = 1
    mark_padding: bool = False
    """Add the padding's mask (stages.router_loss.TOKEN_MASK: 1 for a row's tokens, 0 for padding), for a model
    whose router load-balancing loss must not count the padding (`mask_router_loss` takes it out again)."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in rows)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        keys = ["input_ids", "labels", "position_ids", *([TOKEN_MASK] if self.mark_padding else [])]
        batch: dict[str, list[list[int]]] = {key: [] for key in keys}
        for row in rows:
            pad = width - len(row["input_ids"])
            batch["input_ids"].append([*row["input_ids"], *[self.pad_token_id] * pad])
            batch["labels"].append([*row["labels"], *[IGNORE_INDEX] * pad])
            last = row["position_ids"][-1] + 1 if row["position_ids"] else 0
            batch["position_ids"].append([*row["position_ids"], *range(last, last + pad)])
            if self.mark_padding:
                batch[TOKEN_MASK].append([1] * len(row["input_ids"]) + [0] * pad)
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


def split_sha256(run_dir: RunDir, stage: str, split: str) -> str:
    """sha256 of a prepared split ('' when it does not exist): what prepare recorded in the stage's manifest.json
    while writing it, when the file is still the one it wrote (same size and modification time); hashed here
    otherwise. Every training rank asks at start, and a corpus split can be hundreds of GB."""
    path = data_dir(run_dir, stage) / f"{split}.jsonl"
    if not path.is_file():
        return ""
    try:
        manifest = json.loads((data_dir(run_dir, stage) / "manifest.json").read_text(encoding="utf-8"))
        written = manifest["files"][split]
        stat = path.stat()
        if written["size"] == stat.st_size and written["mtime_ns"] == stat.st_mtime_ns:
            return str(written["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return file_sha256(path)


def cache_settings(run_dir: RunDir, spec: PipelineSpec, stage: str) -> dict[str, Any]:
    """Everything the cached rows depend on; its hash names the cache."""
    section = spec.stage(stage)
    training = section.training
    settings: dict[str, Any] = {
        "format": CACHE_FORMAT,
        "kind": "text" if any(d.format == "text" for d in datasets(section.data)) else "chat",
        "data": {split: split_sha256(run_dir, stage, split) for split in ("train", "eval")},
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


# The cache of one split, flat arrays written in a stream and read memory-mapped (the ranks of a node share the
# page cache, and nothing is loaded whole). Measured against Arrow lists of input_ids/labels/position_ids
# (datasets' save_to_disk): 4 bytes a token instead of 3 x 8 (or 3 x 4 with int32 features), written at the speed
# of the disk instead of Arrow's list builders (bench/prepare_corpus.py, docs/performance.md).
TOKENS = "tokens.bin"  # uint32: the token ids of every kept document or conversation, in input order
LOSS = "loss.bin"  # uint8 (chat only): 1 where the token carries loss (the assistant's tokens)
SEGMENTS = "segments.bin"  # int64 pairs: [start, end) of each row's pieces in TOKENS, row after row
ROWS = "rows.bin"  # int64: where each row's segments start in SEGMENTS, and the total at the end
EXAMPLES = ".examples.bin"  # int64 pairs, while building (chat): [start, end) of each kept conversation

TOKENIZE_BATCH_BYTES = 1 << 20
"""Bytes of JSONL a worker tokenizes per batch: big enough that sending it costs little next to the work."""


class SplitWriter:
    """Writes one split's flat arrays, appending as tokens and rows arrive."""

    def __init__(self, directory: Path, chat: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.tokens = open(directory / TOKENS, "wb")  # noqa: SIM115 -- closed in close()
        self.loss = open(directory / LOSS, "wb") if chat else None  # noqa: SIM115
        self.segments = open(directory / SEGMENTS, "wb")  # noqa: SIM115
        self.examples = open(directory / EXAMPLES, "wb") if chat else None  # noqa: SIM115
        self.n_tokens = 0
        self.n_segments = 0
        self.row_starts: list[int] = [0]
        self.rows_file = open(directory / ROWS, "wb")  # noqa: SIM115

    def append(self, ids: np.ndarray, loss: np.ndarray | None) -> int:
        """Append tokens (and their loss flags); returns where they start."""
        start = self.n_tokens
        ids.astype(np.uint32, copy=False).tofile(self.tokens)
        if self.loss is not None and loss is not None:
            loss.astype(np.uint8, copy=False).tofile(self.loss)
        self.n_tokens += len(ids)
        return start

    def add_rows(self, rows: list[list[Segment]]) -> None:
        """Append rows, each a list of segments."""
        if not rows:
            return
        flat = [bound for row in rows for segment in row for bound in segment]
        np.asarray(flat, dtype=np.int64).tofile(self.segments)
        ends = np.cumsum([len(row) for row in rows], dtype=np.int64) + self.n_segments
        ends.tofile(self.rows_file)
        self.n_segments = int(ends[-1])

    def close(self) -> None:
        for f in (self.tokens, self.loss, self.segments, self.examples, self.rows_file):
            if f is not None:
                f.close()


def _memmap(path: Path, dtype: Any) -> np.ndarray:
    """A read-only memory map of a flat array file (an empty array for an empty file, which mmap refuses)."""
    if path.stat().st_size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class TokenRows:
    """The rows of a split's cache, memory-mapped: `rows[i]` is {input_ids, labels, position_ids} as lists.
    Pickles as its directory (a DataLoader worker or datasets' fingerprinting never copies the arrays)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.tokens = _memmap(self.directory / TOKENS, np.uint32)
        loss = self.directory / LOSS
        self.loss = _memmap(loss, np.uint8) if loss.is_file() else None
        self.segments = _memmap(self.directory / SEGMENTS, np.int64).reshape(-1, 2)
        self.row_ends = _memmap(self.directory / ROWS, np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": str(self.directory)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(Path(state["directory"]))  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.row_ends)

    def __getitem__(self, i: int) -> Row:
        first = int(self.row_ends[i - 1]) if i > 0 else 0
        segments = [(int(s), int(e)) for s, e in self.segments[first : int(self.row_ends[i])]]
        return _row(segments, self.tokens, self.loss)

    def __call__(self, batch: dict[str, list[int]]) -> dict[str, list[list[int]]]:
        """The datasets transform: row indices -> the rows' columns."""
        rows = [self[i] for i in batch["row"]]
        return {key: [row[key] for row in rows] for key in ("input_ids", "labels", "position_ids")}


def rows_dataset(directory: Path) -> Any:
    """A split's rows as a `datasets.Dataset` (what the Trainer and TRL take): an Arrow column of row numbers,
    formatted on access from the memory-mapped arrays."""
    from datasets import Dataset

    rows = TokenRows(directory)
    return Dataset.from_dict({"row": np.arange(len(rows), dtype=np.int64)}).with_transform(rows)


# --------------------------------------------------------------------------- building the cache, in parallel

_WORKER: dict[str, Any] = {}


def _init_tokenizer_worker(tokenizer_path: str, settings: dict[str, Any]) -> None:
    """A tokenize worker's state, loaded once: the run's tokenizer and the cache settings."""
    from transformers import AutoTokenizer

    _WORKER["tokenizer"] = AutoTokenizer.from_pretrained(tokenizer_path)
    _WORKER["settings"] = settings


@dataclass
class TokenizedBatch:
    """A batch of one split, tokenized: the kept documents' tokens end to end, their lengths, and counts."""

    ids: np.ndarray
    loss: np.ndarray | None
    lengths: np.ndarray
    label_tokens: int
    documents: int
    truncated: int = 0
    dropped: int = 0
    problems: list[tuple[int, str]] = field(default_factory=list)
    lines: np.ndarray | None = None
    """The line number of each kept document in the split (for a mixture's tokens per dataset)."""


def _tokenize_batch(lines: list[tuple[int, str]]) -> TokenizedBatch:
    """Tokenize (line number, JSONL line) pairs of a prepared split with the worker's tokenizer."""
    tokenizer, settings = _WORKER["tokenizer"], _WORKER["settings"]
    records = [json.loads(line) for _, line in lines]
    if settings["kind"] == "text":
        encoded = encode_texts(tokenizer, [r["text"] for r in records])
        docs = [[*ids, tokenizer.eos_token_id] for ids in encoded]
        lengths = np.asarray([len(d) for d in docs], dtype=np.int64)
        ids = np.fromiter((t for d in docs for t in d), dtype=np.uint32, count=int(lengths.sum()))
        numbers = np.asarray([line for line, _ in lines], dtype=np.int64)
        return TokenizedBatch(ids, None, lengths, int(lengths.sum()) - len(docs), len(docs), lines=numbers)
    max_len = settings["max_seq_length"]
    kept_ids: list[np.ndarray] = []
    kept_loss: list[np.ndarray] = []
    kept_lines: list[int] = []
    batch = TokenizedBatch(np.empty(0, np.uint32), None, np.empty(0, np.int64), 0, len(records))
    conversations = [(record["messages"], record.get("tools")) for record in records]
    tokenized = conversation_masks(tokenizer, conversations, settings["enable_thinking"])
    for (line, _), result in zip(lines, tokenized, strict=True):
        if isinstance(result, ConversationError):
            batch.problems.append((line, str(result)))
            continue
        ids, mask = result
        if len(ids) > max_len:
            batch.truncated += 1
            ids, mask = ids[:max_len], mask[:max_len]
        loss = np.asarray(mask, dtype=np.uint8) if settings["assistant_only_loss"] else np.ones(len(ids), np.uint8)
        learned = int(loss[1:].sum())
        if not learned:
            batch.dropped += 1  # truncation left no assistant token to learn from
            continue
        kept_ids.append(np.asarray(ids, dtype=np.uint32))
        kept_loss.append(loss)
        kept_lines.append(line)
        batch.label_tokens += learned
    batch.lengths = np.asarray([len(ids) for ids in kept_ids], dtype=np.int64)
    batch.ids = np.concatenate(kept_ids) if kept_ids else np.empty(0, np.uint32)
    batch.loss = np.concatenate(kept_loss) if kept_loss else np.empty(0, np.uint8)
    batch.lines = np.asarray(kept_lines, dtype=np.int64)
    return batch


def _line_batches(path: Path) -> Iterator[list[tuple[int, str]]]:
    """(line number, line) of a prepared JSONL split, in batches of about TOKENIZE_BATCH_BYTES."""
    if not path.is_file():
        return
    batch: list[tuple[int, str]] = []
    size = 0
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            batch.append((number, line))
            size += len(line)
            if size >= TOKENIZE_BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def write_split(
    path: Path,
    out: Path,
    tokenizer_path: Path,
    settings: dict[str, Any],
    num_proc: int,
    spans: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Tokenize a prepared split in `num_proc` workers and write its packed rows into `out`; returns the counts
    (with `spans`, a mixture's [first, last] line of each dataset in the split, also `dataset_tokens`: the tokens
    of each dataset's kept documents). ConversationRowsError (listing the first few, with their line numbers) when
    the chat template refuses some conversations."""
    chat = settings["kind"] == "chat"
    max_len, packing = settings["max_seq_length"], settings["packing"]
    writer = SplitWriter(out, chat)
    packer = StreamPacker(max_len)
    stats: dict[str, Any] = {"documents": 0, "truncated": 0, "dropped": 0, "label_tokens": 0}
    firsts = np.asarray([first for first, _ in spans or []], dtype=np.int64)
    dataset_tokens = np.zeros(len(firsts), dtype=np.int64)
    problems: list[tuple[int, str]] = []
    n_problems = 0
    try:
        batches = _line_batches(path)
        init = (str(tokenizer_path), settings)
        for batch in ordered_map(_tokenize_batch, batches, num_proc, _init_tokenizer_worker, init):
            for key in ("documents", "truncated", "dropped", "label_tokens"):
                stats[key] += getattr(batch, key)
            n_problems += len(batch.problems)
            problems += batch.problems[: MAX_LISTED_ERRORS - len(problems)]
            if len(firsts) and batch.lines is not None and len(batch.lines):
                owner = np.searchsorted(firsts, batch.lines, side="right") - 1
                np.add.at(dataset_tokens, owner, batch.lengths)
            start = writer.append(batch.ids, batch.loss)
            starts = start + np.cumsum(batch.lengths) - batch.lengths
            if chat:
                assert writer.examples is not None
                np.stack([starts, starts + batch.lengths], axis=1).astype(np.int64).tofile(writer.examples)
                continue
            for s, n in zip(starts.tolist(), batch.lengths.tolist(), strict=True):
                writer.add_rows(packer.add(s, n) if packing else document_rows(s, n, max_len))
        if n_problems:
            raise ConversationRowsError(path, problems, n_problems)
        writer.add_rows(packer.finish())
        if chat:
            assert writer.examples is not None
            writer.examples.close()
            examples = _memmap(out / EXAMPLES, np.int64).reshape(-1, 2)
            lengths = (examples[:, 1] - examples[:, 0]).tolist()
            bins = best_fit(lengths, max_len) if packing else [[i] for i in range(len(lengths))]
            for at in range(0, len(bins), 10_000):
                writer.add_rows([[tuple(examples[i].tolist()) for i in members] for members in bins[at : at + 10_000]])
            del examples
    finally:
        writer.close()
    (out / EXAMPLES).unlink(missing_ok=True)
    rows = TokenRows(out)
    stats["rows"] = len(rows)
    stats["tokens"] = int((rows.segments[:, 1] - rows.segments[:, 0]).sum()) if len(rows) else 0
    if spans:
        stats["dataset_tokens"] = dataset_tokens.tolist()
    return stats


def build_token_cache(run_dir: RunDir, spec: PipelineSpec, stage: str, num_proc: int | None = None) -> Path:
    """Tokenize and pack the stage's prepared data into `<run>/prepare/cache/<stage>/<key>/`, in `num_proc`
    processes (default: `stages.workers.default_num_proc`); a cache that is already complete (its meta.json
    exists) is reused. Returns the cache directory."""
    from stages.data import in_cluster

    path = cache_path(run_dir, spec, stage)
    if (path / META_JSON).is_file():
        return path
    settings = cache_settings(run_dir, spec, stage)
    if not settings["data"]["train"]:
        raise FileNotFoundError(f"{data_dir(run_dir, stage) / 'train.jsonl'} is missing: run the prepare stage first")
    if num_proc is None:
        num_proc = default_num_proc(spec, in_cluster(spec, run_dir.root))

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        meta: dict[str, Any] = {"stage": stage, "settings": settings}
        mixture = _mixture_spans(data_dir(run_dir, stage))
        for split in ("train", "eval"):
            source = data_dir(run_dir, stage) / f"{split}.jsonl"
            spans = [d[f"{split}_lines"] for d in mixture] if mixture else None
            meta[split] = write_split(source, staging / split, tokenizer_dir(run_dir), settings, num_proc, spans)
        write_json_atomic(staging / META_JSON, meta)
        try:
            os.replace(staging, path)
        except OSError:
            if not (path / META_JSON).is_file():  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _mixture_spans(directory: Path) -> list[dict[str, Any]]:
    """A mixture's datasets as prepare's manifest records them (where each one's rows lie in the splits); [] for a
    stage of one dataset."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return list(manifest.get("datasets") or [])


@dataclass
class TokenCache:
    """A stage's packed rows, memory-mapped from the cache."""

    path: Path
    train: Any  # datasets.Dataset of row numbers, formatted into rows on access (rows_dataset)
    eval: Any | None  # the same, None when there is no held-out data
    meta: dict[str, Any]


def load_token_cache(run_dir: RunDir, spec: PipelineSpec, stage: str) -> TokenCache:
    """The stage's token cache, built first when it is missing (e.g. the data or settings changed)."""
    path = build_token_cache(run_dir, spec, stage)
    meta = json.loads((path / META_JSON).read_text(encoding="utf-8"))
    evaluation = rows_dataset(path / "eval") if meta["eval"]["rows"] else None
    return TokenCache(path=path, train=rows_dataset(path / "train"), eval=evaluation, meta=meta)
