"""A stage's prepared data: its rows streamed from the source through validation, cleaning and the eval split.

One pass, in bounded memory, whatever the size of the corpus:

1. the source's rows are read in the parent (`stages.source_rows.read_source`: JSONL lines as bytes, Parquet, hub and
   builtin rows parsed) and sent in batches to `num_proc` worker processes (`stages.workers.ordered_map`);
2. a worker parses each line (`data.encoding`), validates and normalizes it to the canonical form
   (`stages.data`), NFC-normalizes it and computes what the cleaning filters need (`stages.cleaning`): the
   length and Hangul-ratio verdict, whether it contains evaluation text, the exact-duplicate key, the MinHash
   signature, and the row's split key;
3. the parent takes the results back in input order and keeps the state that spans rows: the exact and near
   duplicate sets, the bad-row budget (`max_bad_row_fraction`), `max_samples`, and the counts. Every kept row goes
   to the train or the eval file by its split key, a hash of its content: the same row lands on the same side on
   every run, whatever else the data holds, and adding rows never moves an old one.

`prepare_split` writes `prepare/data/<stage>/{train,eval}.jsonl` (one canonical row per line), next to each a
`.origins` file (the user's `<file>:<line>` of every row, for errors found later, when tokenizing), the quarantine
(`prepare/quarantine/<stage>.jsonl`) and `manifest.json` (counts, and the sha256, size and mtime of each file,
which the token cache's key reads instead of hashing the file again). Everything is written to temporary files
and renamed at the end: a dataset that fails leaves nothing a rerun would trust. A stage's list of datasets (a
mixture) is read dataset by dataset, each split on its own, then written into the stage's files by weight
(`prepare_split`, `mix_counts`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from run.config_hash import canonical_hash
from run.run_dir import check_still_ours, write_json_atomic
from spec.data import CleaningSpec, DataSpec
from spec.pipeline import PipelineSpec
from spec.quoting import quoted
from stages.cleaning import CheckedRow, CleaningCounts, Contamination, Deduplication, check_row
from stages.data import (
    MAPPING_PROBE_ROWS,
    MAX_LISTED_ERRORS,
    DataError,
    Dataset,
    RawRow,
    RowError,
    SourceFile,
    _excerpt,
    _UnmappedColumn,
    check_stage_format,
    data_field,
    dataset_fingerprint,
    kind_of,
    max_row_bytes,
    parse_row,
)
from stages.normalize import ColumnMap, FieldError, MissingField, _normalize
from stages.pii import mask
from stages.source_rows import read_source
from stages.workers import ordered_map

READ_BATCH_ROWS = 512
"""Rows per batch sent to a worker."""

SPLIT_KEY_BITS = 64


# --------------------------------------------------------------------------- the worker's part


@dataclass
class RowJob:
    """What a worker needs to turn a raw row into a result; set once per dataset, before the workers fork."""

    mapping: ColumnMap
    limit: int
    data: DataSpec
    contamination: Contamination | None


@dataclass
class RowResult:
    """One row as a worker leaves it: the canonical row as a JSONL line, or why it is bad or dropped."""

    file: str
    line: int
    row: str = ""
    error: RowError | None = None
    field: str = ""
    """The field a bad row's FieldError named (for the check that the column mapping is wrong)."""
    present: list[str] | None = None
    """The keys the row had, when the error was a missing field."""
    checked: CheckedRow | None = None
    """What the cleaning checks found without other rows (stages.cleaning.check_row): a reason to drop the row, or
    its duplicate keys; the row itself travels as `row`."""
    split: float = 0.0
    """Where the row falls in [0, 1): below the eval fraction, it is held out."""


_JOB: dict[str, RowJob] = {}


def _set_job(job: RowJob) -> None:
    _JOB["job"] = job


def process_rows(batch: list[RawRow]) -> list[RowResult]:
    """Parse, validate, normalize and clean a batch of raw rows with the worker's job."""
    job = _JOB["job"]
    return [process_row(raw, job) for raw in batch]


def process_row(raw: RawRow, job: RowJob) -> RowResult:
    """One raw row through parsing, validation, normalization and the per-row cleaning work."""
    raw = parse_row(raw, job.limit, job.data.encoding)
    result = RowResult(raw.file, raw.line)
    if raw.error is not None:
        result.error = _scrubbed(raw.error, job.data.cleaning)
        return result
    try:
        row = _normalize(raw.value, job.mapping)
    except FieldError as exc:
        error = RowError(raw.file, raw.line, exc.field, exc.error, _excerpt(raw.value), exc.mapping)
        result.error = _scrubbed(error, job.data.cleaning)
        result.field = exc.field
        result.present = exc.present if isinstance(exc, MissingField) else None
        return result
    checked = check_row(row, job.data.cleaning, job.contamination)
    result.checked = replace(checked, row={})
    if checked.reason is None:
        result.row = json.dumps(checked.row, ensure_ascii=False)
        result.split = int(canonical_hash(checked.row)[: SPLIT_KEY_BITS // 4], 16) / 2**SPLIT_KEY_BITS
    return result


def _scrubbed(error: RowError, cleaning: CleaningSpec) -> RowError:
    """A bad row's error with the personal data of its excerpt and message masked (unless cleaning.pii is off): the
    quarantine and the error lines must not carry what the prepared data may not."""
    if cleaning.pii == "off":
        return error
    return replace(error, error=mask(error.error)[0], raw=mask(error.raw)[0])


# --------------------------------------------------------------------------- the parent's part


class DatasetReader:
    """Reads one dataset in a stream: `rows()` yields the kept rows (origin, JSONL line, split key) in input
    order, and afterwards `files`, `fingerprint`, `total`, `errors` and `counts` describe what was read.

    Raises DataError (from `rows()`) for an unusable dataset: a missing or empty source, no valid rows, a column
    mapping the data does not have, or more bad rows than `max_bad_row_fraction` allows (listing the first)."""

    def __init__(
        self,
        data: DataSpec,
        spec: PipelineSpec | None = None,
        stage: str | None = None,
        run_root: Path | None = None,
        num_proc: int = 1,
        contamination: Contamination | None = None,
        quarantine: IO[str] | None = None,
        staging: Path | None = None,
        index: int | None = None,
    ) -> None:
        self.data = data
        self.uri = spec.data_uri(data) if spec is not None else data.uri
        self.stage = stage
        self.field = data_field(stage, index) if stage is not None else None
        """The spec path of the dataset ('stages.sft.data', or 'stages.sft.data.1' in a list)."""
        if stage is not None:
            check_stage_format(stage, data.format, index)
        self.where = f"{self.field} ({quoted(self.uri)})" if stage else quoted(self.uri)
        self.spec, self.run_root, self.num_proc, self.staging = spec, run_root, num_proc, staging
        self.job = RowJob(ColumnMap.of(data), max_row_bytes(), data, contamination)
        self.quarantine = quarantine
        self.files: list[SourceFile] = []
        self.total = 0
        self.errors: list[RowError] = []
        """Every bad row without a quarantine file to write them to; with one, the first few."""
        self.n_errors = 0
        self.undecodable: dict[str, tuple[RowError, int]] = {}
        """Per file, its first line that is not in data.encoding and how many are: one message each, not one a row."""
        self.counts = CleaningCounts()

    @property
    def fingerprint(self) -> str:
        """What determines the dataset's rows: the inputs' content and the settings that shape the rows."""
        return dataset_fingerprint(self.data, self.files)

    def rows(self) -> Iterator[tuple[str, str, float]]:
        self.files, raw_rows = read_source(self.uri, self.data, self.spec, self.run_root, self.staging)
        dedup = Deduplication(self.data.cleaning)
        unmapped = _UnmappedColumn()
        kept = 0
        results = ordered_map(process_rows, _batches(raw_rows), self.num_proc, _set_job, (self.job,))
        try:
            for batch in results:
                for result in batch:
                    self.total += 1
                    if result.error is not None:
                        self._bad(result, unmapped)
                        continue
                    unmapped.stop()
                    origin = f"{quoted(result.file)}:{result.line}"  # one line of the .origins file, whatever the name
                    assert result.checked is not None
                    reason = dedup.reason(result.checked, origin)
                    self.counts.record(reason, result.checked.pii)
                    if reason is not None:
                        continue
                    kept += 1
                    yield origin, result.row, result.split
                    if self.data.max_samples is not None and kept >= self.data.max_samples:
                        return
        finally:
            results.close()
        self._check(unmapped, kept)

    def _bad(self, result: RowResult, unmapped: _UnmappedColumn) -> None:
        error = result.error
        assert error is not None
        self.n_errors += 1
        if self.quarantine is not None:
            self.quarantine.write(json.dumps(error.record(), ensure_ascii=False) + "\n")
        if error.undecodable is not None:
            first, count = self.undecodable.get(error.file, (error, 0))
            self.undecodable[error.file] = (first, count + 1)
        if self.quarantine is None or (error.undecodable is None and len(self.errors) < MAX_LISTED_ERRORS):
            self.errors.append(error)
        if result.field or result.present is not None:
            unmapped.see(result.field, result.present, error, self.job.mapping)
        else:
            unmapped.stop()
        if unmapped.rows >= MAPPING_PROBE_ROWS:
            raise unmapped.error(self.where, self.field, every=False)

    def _check(self, unmapped: _UnmappedColumn, kept: int) -> None:
        if self.total == 0:
            raise DataError(f"{self.where}: no rows")
        if unmapped.rows:  # every row lacks the mapped column
            raise unmapped.error(self.where, self.field, every=True)
        if self.n_errors and self.n_errors / self.total > self.data.max_bad_row_fraction:
            lines = self._error_lines()
            listed = "\n".join(f"  {line}" for line in lines[:MAX_LISTED_ERRORS])
            one_a_line = self.n_errors - sum(count for _, count in self.undecodable.values())
            more = len(self.undecodable) + one_a_line - min(len(lines), MAX_LISTED_ERRORS)
            raise DataError(
                f"{self.where}: {self.n_errors} of {self.total} rows are bad ({self.n_errors / self.total:.2%}), "
                f"over max_bad_row_fraction={self.data.max_bad_row_fraction}:\n{listed}"
                + (f"\n  ... and {more} more" if more else "")
            )
        if not kept:
            dropped = ", ".join(f"{n} {r}" for r, n in self.counts.as_dict()["dropped"].items() if n)
            hint = ""
            if self.counts.contaminated and self.stage:
                hint = (
                    f"; its rows are evaluation data too: evaluate on other data, or set {self.field}."
                    "cleaning.decontaminate: false to train on them anyway"
                )
            raise DataError(
                f"{self.where}: no valid rows" + (f" (cleaning dropped {dropped}{hint})" if dropped else "")
            )

    def _error_lines(self) -> list[str]:
        """The bad rows to list: one line for each file with lines not in data.encoding (the first of them, and how
        many more), then the other bad rows, one a line."""
        setting = f"{self.field or 'data'}.encoding"
        lines = []
        for file, (first, count) in self.undecodable.items():
            assert first.undecodable is not None
            more = f", and so are {count - 1} more of its lines" if count > 1 else ""
            lines.append(f"{quoted(file)}:{first.line}: {first.undecodable.message(file, setting, more)}")
        return lines + [str(e) for e in self.errors if e.undecodable is None]


def _batches(rows: Iterator[RawRow]) -> Iterator[list[RawRow]]:
    batch: list[RawRow] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= READ_BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------- writing a stage's splits


class _HashedFile:
    """A temporary file next to its destination, hashed as it is written, renamed into place by `commit`."""

    def __init__(self, path: Path) -> None:
        check_still_ours(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        self.tmp = Path(tmp)
        self.file = os.fdopen(fd, "w", encoding="utf-8")
        self.digest = hashlib.sha256()
        self.lines = 0

    def write_line(self, line: str) -> None:
        data = line + "\n"
        self.file.write(data)
        self.digest.update(data.encode("utf-8"))
        self.lines += 1

    def commit(self) -> dict[str, Any]:
        """Rename into place; the file's record for the manifest."""
        self.file.close()
        os.replace(self.tmp, self.path)
        stat = self.path.stat()
        return {"sha256": self.digest.hexdigest(), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def prepare_split(
    out_dir: Path,
    quarantine_path: Path,
    stage: str,
    mixture: DataSpec | list[DataSpec],
    spec: PipelineSpec,
    run_root: Path,
    num_proc: int,
    contamination: Contamination | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Read a stage's data, one dataset or the list of a mixture, and write its train and eval splits, their
    origins, the quarantine and the manifest (see the module docstring); returns the stage's counts for stage.json.
    The evaluate stage's rows all go to eval. DataError for an unusable dataset, with nothing written.

    A mixture's datasets are each read and split on their own (their own cleaning, eval_fraction, bad-row budget),
    then written one after the other: eval rows as they are, training rows by `weight` (`mix_counts`, the sample
    drawn with `seed`). Each row's origin names its dataset (`data.1 "file.csv":12`), and the counts have a record
    per dataset (`datasets`: rows, share, and where its rows lie in each split)."""
    splits = ("eval",) if stage == "evaluate" else ("train", "eval")
    if not isinstance(mixture, list):
        with ExitStack() as stack:
            files, origins, quarantine = _split_files(stack, out_dir, splits, quarantine_path)
            checked = contamination if mixture.cleaning.decontaminate else None
            reader = DatasetReader(
                mixture, spec, stage, run_root, num_proc, checked, quarantine.file, out_dir / ".staging"
            )
            _write_dataset(reader, stage, files, origins)
            records = _commit(stack, files, origins, quarantine, quarantine_path, reader.n_errors)
        counts = _counts(reader, stage, files)
        return _finish(out_dir, stage, counts, records)

    parts = out_dir / ".parts"
    shutil.rmtree(parts, ignore_errors=True)
    with ExitStack() as stack, _removed(parts):
        files, origins, quarantine = _split_files(stack, out_dir, splits, quarantine_path)
        readers, part_files = [], []
        for i, data in enumerate(mixture):  # each dataset split on its own, into its part files
            checked = contamination if data.cleaning.decontaminate else None
            reader = DatasetReader(
                data, spec, stage, run_root, num_proc, checked, quarantine.file, parts / "staging", index=i
            )
            part = {s: _HashedFile(parts / str(i) / f"{s}.jsonl") for s in splits}
            part_origins = {s: _HashedFile(parts / str(i) / f"{s}.origins") for s in splits}
            _write_dataset(reader, stage, part, part_origins)
            for f in (*part.values(), *part_origins.values()):
                f.file.close()
            readers.append(reader)
            part_files.append((part, part_origins))
        train_counts = [part["train"].lines if "train" in part else 0 for part, _ in part_files]
        target = mix_counts(train_counts, [d.weight for d in mixture])
        records_of: list[dict[str, Any]] = []
        for i, (part, part_origins) in enumerate(part_files):
            record: dict[str, Any] = {"index": i}
            for split in splits:
                first = files[split].lines
                n = target[i] if split == "train" else part[split].lines
                _copy_rows(part[split], part_origins[split], files[split], origins[split], f"data.{i} ", n, seed, i)
                record[f"{split}_lines"] = [first + 1, files[split].lines]
            records_of.append(record)
        records = _commit(stack, files, origins, quarantine, quarantine_path, sum(r.n_errors for r in readers))
    per_dataset = []
    total_train = sum(target) or 1
    for i, (reader, record) in enumerate(zip(readers, records_of, strict=True)):
        c = _counts(reader, stage, {s: _Lines(record[f"{s}_lines"]) for s in splits})
        c.update(record, index=i, weight=mixture[i].weight, read_train_rows=train_counts[i])
        c["share"] = (
            c["train_rows"] / total_train if stage != "evaluate" else c["eval_rows"] / max(files["eval"].lines, 1)
        )
        per_dataset.append(c)
    counts = {
        "uri": ", ".join(c["uri"] for c in per_dataset),
        "format": "+".join(dict.fromkeys(d.format for d in mixture)),
        "kind": kind_of(mixture[0].format),
        "rows": sum(f.lines for f in files.values()),
        "train_rows": files["train"].lines if "train" in files else 0,
        "eval_rows": files["eval"].lines,
        "quarantined": sum(c["quarantined"] for c in per_dataset),
        "read_rows": sum(c["read_rows"] for c in per_dataset),
        "cleaning": _summed([c["cleaning"] for c in per_dataset]),
        "fingerprint": "sha256:" + canonical_hash([c["fingerprint"] for c in per_dataset] + [seed, target]),
        "sources": [source for c in per_dataset for source in c["sources"]],
        "datasets": per_dataset,
    }
    return _finish(out_dir, stage, counts, records)


@contextmanager
def _removed(directory: Path) -> Iterator[None]:
    """Remove `directory` (a mixture's part files) when the block ends, however it ends."""
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class _Lines:
    """A split's line range [first, last] in the stage's file (for a mixture's per-dataset counts)."""

    span: list[int]

    @property
    def lines(self) -> int:
        return self.span[1] - self.span[0] + 1


def mix_counts(available: list[int], weights: list[float | None]) -> list[int]:
    """The training rows each dataset of a mixture contributes: every row of each without weights; with weights,
    the stage's total (the sum of what they have) split by weight, rounded by largest remainder so that the counts
    add up to the total exactly."""
    if any(w is None for w in weights):
        return list(available)
    total = sum(available)
    wanted = [total * float(w or 0) / sum(float(w or 0) for w in weights) for w in weights]
    counts = [int(x) for x in wanted]
    by_remainder = sorted(range(len(wanted)), key=lambda i: (counts[i] - wanted[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _copy_rows(
    part: _HashedFile,
    part_origins: _HashedFile,
    to: _HashedFile,
    to_origins: _HashedFile,
    prefix: str,
    n: int,
    seed: int,
    index: int,
) -> None:
    """Write `n` rows of a part file into the stage's split: every row once per whole pass, then a sample of the
    rest drawn with (`seed`, `index`) in file order (a weight asking more rows than the dataset has repeats it)."""
    rows, origins, available = part.tmp, part_origins.tmp, part.lines
    if available == 0 or n == 0:
        return
    passes, rest = divmod(n, available)
    chosen = np.sort(np.random.default_rng([seed, index]).choice(available, size=rest, replace=False))
    for repeat in range(passes + (1 if rest else 0)):
        sample = chosen if repeat == passes else None
        at = 0
        with rows.open(encoding="utf-8") as lines, origins.open(encoding="utf-8") as where:
            for number, (line, origin) in enumerate(zip(lines, where, strict=True)):
                if sample is not None:
                    if at >= len(sample):
                        break
                    if sample[at] != number:
                        continue
                    at += 1
                to.write_line(line.rstrip("\n"))
                to_origins.write_line(prefix + origin.rstrip("\n"))


def _summed(cleanings: list[dict[str, Any]]) -> dict[str, Any]:
    """The cleaning counts of a mixture's datasets added up, kind by kind."""
    out: dict[str, Any] = {}
    for cleaning in cleanings:
        for key, value in cleaning.items():
            if isinstance(value, dict):
                into = out.setdefault(key, {})
                for k, n in value.items():
                    into[k] = into.get(k, 0) + n
            elif isinstance(value, int | float):
                out[key] = out.get(key, 0) + value
    return out


def _split_files(
    stack: ExitStack, out_dir: Path, splits: tuple[str, ...], quarantine_path: Path
) -> tuple[dict[str, _HashedFile], dict[str, _HashedFile], _HashedFile]:
    """The temporary files of a stage's splits, their origins and its quarantine, discarded unless committed."""
    files = {s: _HashedFile(out_dir / f"{s}.jsonl") for s in splits}
    origins = {s: _HashedFile(out_dir / f"{s}.origins") for s in splits}
    quarantine = _HashedFile(quarantine_path)
    everything = [*files.values(), *origins.values(), quarantine]
    stack.callback(_remove_empty, [out_dir, out_dir.parent, quarantine_path.parent])
    stack.callback(lambda: [f.discard() for f in everything])
    return files, origins, quarantine


def _write_dataset(
    reader: DatasetReader, stage: str, files: dict[str, _HashedFile], origins: dict[str, _HashedFile]
) -> None:
    """Stream one dataset's rows into its split files by their split keys (see the module docstring)."""
    data = reader.data
    # For a dataset too small for the keys to give both sides a row: the row of each side nearest the other.
    nearest: dict[str, tuple[float, str, str]] = {}
    for origin, line, split in reader.rows():
        side = "eval" if stage == "evaluate" or split < data.eval_fraction else "train"
        files[side].write_line(line)
        origins[side].write_line(origin)
        key = split if side == "train" else -split
        if side not in nearest or key < nearest[side][0]:
            nearest[side] = (key, line, origin)
    if stage != "evaluate":
        train, held = files["train"].lines, files["eval"].lines
        if not train and held:  # training needs a row; held-out rows are optional
            _move_row(nearest["eval"], files["eval"], origins["eval"], files["train"], origins["train"])
        elif data.eval_fraction > 0 and not held and train > 1:  # a non-zero fraction holds out at least one
            _move_row(nearest["train"], files["train"], origins["train"], files["eval"], origins["eval"])


def _commit(
    stack: ExitStack,
    files: dict[str, _HashedFile],
    origins: dict[str, _HashedFile],
    quarantine: _HashedFile,
    quarantine_path: Path,
    bad_rows: int,
) -> dict[str, Any]:
    """Rename a stage's files into place (the quarantine only when rows were bad); the splits' records."""
    records = {s: f.commit() for s, f in files.items()}
    for f in origins.values():
        f.commit()
    if bad_rows:
        quarantine.commit()
    else:
        quarantine.discard()
        quarantine_path.unlink(missing_ok=True)
    stack.pop_all()
    return records


def _counts(reader: DatasetReader, stage: str, files: dict[str, Any]) -> dict[str, Any]:
    """One dataset's counts for stage.json."""
    return {
        "uri": reader.uri,
        "format": reader.data.format,
        "kind": kind_of(reader.data.format),
        "rows": sum(f.lines for f in files.values()),
        "train_rows": files["train"].lines if "train" in files else 0,
        "eval_rows": files["eval"].lines,
        "quarantined": reader.n_errors,
        "read_rows": reader.total,
        "cleaning": reader.counts.as_dict(),
        "fingerprint": reader.fingerprint,
        "sources": [{"uri": f.uri, "fingerprint": f.fingerprint} for f in reader.files],
    }


def _finish(out_dir: Path, stage: str, counts: dict[str, Any], records: dict[str, Any]) -> dict[str, Any]:
    """Remove what the evaluate stage has no use for, write the manifest; the counts."""
    if stage == "evaluate":
        (out_dir / "train.jsonl").unlink(missing_ok=True)
        (out_dir / "train.origins").unlink(missing_ok=True)
    write_json_atomic(out_dir / "manifest.json", {**counts, "files": records})
    return counts


def _remove_empty(directories: list[Path]) -> None:
    """Remove the directories a failed dataset created, when nothing else is in them."""
    for directory in directories:
        with suppress(OSError):
            directory.rmdir()


def _move_row(
    row: tuple[float, str, str],
    source: _HashedFile,
    source_origins: _HashedFile,
    to: _HashedFile,
    to_origins: _HashedFile,
) -> None:
    """Move a row (key, line, origin) from one side of a small split to the other: the source side's files are
    written again without it. Only a dataset too small to give both sides a row by their keys gets here."""
    _, line, origin = row
    source.file.flush()
    source_origins.file.flush()
    lines = source.tmp.read_text(encoding="utf-8").splitlines()
    where = source_origins.tmp.read_text(encoding="utf-8").splitlines()
    at = where.index(origin)
    for f, content in ((source, lines), (source_origins, where)):
        f.file.seek(0)
        f.file.truncate()
        f.digest, f.lines = hashlib.sha256(), 0
        for i, text in enumerate(content):
            if i != at:
                f.write_line(text)
    to.write_line(line)
    to_origins.write_line(origin)


def read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a prepared JSONL split, one at a time."""
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def origins_of(path: Path, lines: list[int]) -> dict[int, str]:
    """The user's `<file>:<line>` of rows of a prepared split, by their line numbers in it (1-based)."""
    wanted, found = set(lines), {}
    origins = path.with_suffix(".origins")
    if origins.is_file():
        with origins.open(encoding="utf-8") as f:
            for number, origin in enumerate(f, start=1):
                if number in wanted:
                    found[number] = origin.rstrip("\n")
    return found


def read_dataset(
    data: DataSpec, spec: PipelineSpec | None = None, stage: str | None = None, run_root: Path | None = None
) -> Dataset:
    """Read, validate, clean and normalize one dataset into memory (for small data: prepare streams a stage's
    dataset to disk with `stages.prepared_data.prepare_split` instead); bad rows within `max_bad_row_fraction`
    are kept as errors. `run_root` is the run directory reading it (it decides which paths may be read, see
    `confine`).

    Raises DataError for an unusable dataset: a missing or empty source, no valid rows, or more bad rows
    than allowed (the message lists the first few)."""
    from stages.prepared_data import DatasetReader

    reader = DatasetReader(data, spec, stage, run_root)
    rows, origins = [], []
    for origin, line, _ in reader.rows():
        rows.append(json.loads(line))
        origins.append(origin)
    return Dataset(
        reader.uri, data.format, rows, reader.errors, reader.total, reader.files, reader.fingerprint, origins
    )
