"""Training data's rows: where they may be read from, their bounds and parsing, and the datasets and errors they make.

Each row is validated and normalized to its canonical form by `stages.normalize`; `stages.source_rows` reads a
URI's rows, and `stages.prepared_data` makes datasets of them.

Sources (a stage's `data.uri`): a file, a directory or a glob of `.jsonl`, `.jsonl.gz`, `.jsonl.zst` and
`.parquet` files, on a volume or in a bucket (`s3://`, `gs://`; listed and opened by `stages.sources`),
`hf://datasets/org/name` (a hub dataset, through `datasets`), or `builtin:<name>` (see `stages.builtin_data`).
`file://` paths work as plain paths, and `pvc://<claim>/<path>` is read from the mount of that claim in the spec's
cluster volumes. JSONL is decoded with `data.encoding` (UTF-8, or CP949/EUC-KR for Korean legacy exports).

Where data may come from (`confine`):
- in the cluster (the run directory is on the checkpoints volume, as every compiled workflow's is), a data path
  must resolve, `..` and symlinks followed, under cluster.datasets.mount_path or cluster.checkpoints.mount_path;
- locally (`--local`, or a run directory anywhere else) any path of your own machine may be read;
- everywhere: a `pvc://` path stays inside its claim's mount, and a file in a data directory that is a symlink to
  somewhere outside that directory is refused (a data directory is read as a whole, so what it links to is not
  what the spec names).

A bad row is reported as `<file>:<line>: field '<path>': <problem>`, e.g.
`train.jsonl:17: field 'messages[2].content': expected a string, got null`, or with a mapped column
`train.jsonl:3: field 'response' (columns.output): missing`. Bad rows are quarantined and counted when they stay
within the dataset's `max_bad_row_fraction`; beyond it the dataset fails, listing the first errors. When every row
(or each of the first MAPPING_PROBE_ROWS) lacks a mapped column, the dataset fails with one error instead, saying
that the mapping names a column the data does not have, and which columns it has. Blank lines of a JSONL file are
not rows and are skipped; every other line is either a row or an error, never silently dropped. JSON that Python
cannot hold as data is a bad row too: arrays or objects nested too deeply to read, a number too long to convert, a
string with a lone surrogate (an escape such as `\\ud800` that encodes half a character, which cannot be written as
UTF-8). A file that cannot be read, a file name that is not UTF-8 and a symlink loop fail the dataset, naming the path.

Reading takes bounded memory whatever the data (`jsonl_lines`, `inflation_cap`): a line over the row limit is read
past a chunk at a time, never held whole, and a compressed file that decompresses to more than MAX_INFLATION times
its size (and more than INFLATION_FLOOR_BYTES) fails the dataset: a decompression bomb, not a corpus.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from run.config_hash import canonical_hash
from spec.data import DataSpec
from spec.pipeline import PipelineSpec
from spec.quoting import quoted
from stages.contract import writable
from stages.normalize import ColumnMap, _type_name

DEFAULT_MAX_ROW_BYTES = 4 * 1024 * 1024
"""Rows larger than this (bytes of the JSONL line or of the row as JSON) are errors."""

MAX_ROW_BYTES_ENV = "POSTTRAIN_MAX_ROW_BYTES"
"""Environment variable that overrides DEFAULT_MAX_ROW_BYTES."""

LINE_CHUNK_BYTES = 1 << 20
"""Bytes read at a time past the row limit of a line too long to be a row."""

DEFAULT_MAX_INFLATION = 1000
"""A compressed file may decompress to this many times its stored size (beyond INFLATION_FLOOR_BYTES). Text
compresses 3-10x, templated rows (one long instruction repeated in every row) about 100x; gzip cannot exceed
about 1000x, zstd reaches 30000x on a run of one byte, what a decompression bomb is."""

MAX_INFLATION_ENV = "POSTTRAIN_MAX_INFLATION"
"""Environment variable that overrides DEFAULT_MAX_INFLATION."""

INFLATION_FLOOR_BYTES = 64 << 20
"""Decompressed bytes any compressed file may have, whatever its ratio (a small file of repeated rows)."""

NORMALIZATION_VERSION = 2
"""Part of every dataset fingerprint: bump it when the canonical forms or the validation rules change.
2: column and role mapping; alpaca history; a system column for sharegpt and preference; a blank system is none."""

MAX_LISTED_ERRORS = 5
RAW_EXCERPT_CHARS = 500


MAPPING_PROBE_ROWS = 100
"""When this many rows in a row, from the first, all lack the same mapped column, the mapping is wrong, not the
rows: the dataset fails there, without reading the rest."""

STAGE_FORMATS: dict[str, tuple[str, ...]] = {
    "cpt": ("text",),
    "sft": ("messages", "alpaca", "sharegpt"),
    "rlhf": ("preference",),
    "evaluate": ("text", "messages", "alpaca", "sharegpt"),
}
"""Formats each stage can train or evaluate on."""

BUILTIN_TASKS_DIR = Path("prepare") / "data" / "evaluate" / "lm_eval"
"""Where prepare writes a builtin lm-eval task folder (`lm_eval_include_path: builtin:<name>`), in the run
directory; evaluate reads it from there."""


class DataError(Exception):
    """A dataset that cannot be used: missing, unreadable, empty, or with too many bad rows."""


@dataclass(frozen=True)
class Undecodable:
    """Why a JSONL line is not text in the dataset's encoding: the first bad byte, and the encoding the line does
    decode as, when it is one `data.encoding` offers."""

    byte: int
    """Offset of the first bad byte in the line."""
    value: int
    """That byte."""
    encoding: str
    """The dataset's encoding (data.encoding)."""
    decodes_as: str = ""
    """'cp949' for a UTF-8 dataset whose line is CP949 (a Korean Windows export), 'utf-8' for the other way
    round, '' when neither."""

    def message(self, file: str, setting: str = "data.encoding", more: str = "") -> str:
        """What is wrong with a line of `file` and what to do; `more` says how many other lines are alike (the
        message then speaks of the file)."""
        label = "UTF-8" if self.encoding == "utf-8" else self.encoding
        head = f"invalid {label} at byte {self.byte} of the line (0x{self.value:02x}){more}"
        subject = "the file" if more else "the line"
        if self.decodes_as == "cp949":
            iconv = f"iconv -f cp949 -t utf-8 {shlex.quote(file)} > {shlex.quote(_utf8_name(file))}"
            return (
                f"{head}; {subject} decodes as cp949 (CP949/EUC-KR, a Korean Windows export): convert the file to "
                f"UTF-8 (`{quoted(iconv)}`, then read the new file) or set {setting}: cp949"
            )
        if self.decodes_as:
            return f"{head}; {subject} decodes as {self.decodes_as}: set {setting}: {self.decodes_as}"
        if self.encoding == "utf-8":
            return (
                f"{head}; not UTF-8 text, nor CP949: re-encode the file as UTF-8 "
                "(`iconv -f <its encoding> -t utf-8`), or check it is the data file meant"
            )
        return head


def _utf8_name(file: str) -> str:
    """Where `iconv` may write the UTF-8 copy of `file`: beside it, `.utf8` before its suffixes."""
    path = Path(file)
    stem, suffixes = path.name.split(".", 1) if "." in path.name else (path.name, "jsonl")
    return str(path.with_name(f"{stem}.utf8.{suffixes}"))


@dataclass
class RowError:
    """One bad row: where it is, which field, what is wrong, and an excerpt of the row."""

    file: str
    line: int
    field: str
    error: str
    raw: str = ""
    mapping: str = ""
    """The spec fields that renamed the field (e.g. 'columns.output'), when any did."""
    undecodable: Undecodable | None = None
    """A line that is not text in the dataset's encoding: where, and what it decodes as (for one message per file)."""

    def __str__(self) -> str:
        where = f"{quoted(self.file)}:{self.line}"
        if not self.field:
            return f"{where}: {self.error}"
        mapping = f" ({self.mapping})" if self.mapping else ""
        return f"{where}: field '{quoted(self.field)}'{mapping}: {self.error}"

    def record(self) -> dict[str, Any]:
        """The quarantine record of this row."""
        record = {"file": self.file, "line": self.line, "field": self.field, "error": self.error, "raw": self.raw}
        return record | ({"mapping": self.mapping} if self.mapping else {})


@dataclass
class RawRow:
    """A row as read from a source, before validation: a parsed value, or the error that prevented parsing."""

    file: str
    line: int
    value: Any = None
    error: RowError | None = None
    raw: bytes | None = None
    """A JSONL line not parsed yet (parse_row parses it, in a worker process)."""
    size: int = 0
    """Bytes of the whole line when `raw` is only its beginning (a line over the row limit, read past)."""


@dataclass
class SourceFile:
    """One input of a dataset and the sha256 of its content."""

    uri: str
    fingerprint: str


@dataclass
class Dataset:
    """A validated dataset: canonical rows, bad rows, and the fingerprints of what it was read from."""

    uri: str
    format: str
    rows: list[dict[str, Any]]
    errors: list[RowError]
    total: int
    files: list[SourceFile]
    fingerprint: str
    origins: list[str] = field(default_factory=list)  # '<file>:<line>' of each row, for errors found later

    @property
    def kind(self) -> str:
        """text, chat or preference."""
        return kind_of(self.format)


def kind_of(fmt: str) -> str:
    """The canonical kind of a data format."""
    return {"text": "text", "preference": "preference"}.get(fmt, "chat")


def max_row_bytes() -> int:
    """The row size limit: $POSTTRAIN_MAX_ROW_BYTES, else DEFAULT_MAX_ROW_BYTES."""
    value = os.environ.get(MAX_ROW_BYTES_ENV, "")
    if not value:
        return DEFAULT_MAX_ROW_BYTES
    if not value.isdigit() or int(value) <= 0:
        raise DataError(f"{MAX_ROW_BYTES_ENV}={value!r}: expected a positive number of bytes")
    return int(value)


def max_inflation() -> int:
    """The decompression ratio limit: $POSTTRAIN_MAX_INFLATION, else DEFAULT_MAX_INFLATION."""
    value = os.environ.get(MAX_INFLATION_ENV, "")
    if not value:
        return DEFAULT_MAX_INFLATION
    if not value.isdigit() or int(value) <= 0:
        raise DataError(f"{MAX_INFLATION_ENV}={value!r}: expected a positive whole ratio, such as 1000")
    return int(value)


def inflation_cap(stored: int) -> int:
    """The most bytes a compressed file of `stored` bytes may decompress to."""
    return max(INFLATION_FLOOR_BYTES, max_inflation() * stored)


def inflation_error(uri: str, stored: int, cap: int) -> DataError:
    """The error of a file that decompresses to more than `inflation_cap` of its stored size."""
    return DataError(
        f"{quoted(uri)}: decompresses to more than {cap} bytes from {stored} stored, over the limit of "
        f"{max_inflation()}x (and {INFLATION_FLOOR_BYTES} bytes): a decompression bomb, not data "
        f"(raise it with {MAX_INFLATION_ENV})"
    )


# --------------------------------------------------------------------------- fingerprints


def sha256_file(path: Path) -> str:
    """'sha256:<hex>' of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def sha256_rows(rows: list[dict[str, Any]]) -> str:
    """'sha256:<hex>' of rows as canonical JSONL (for generated data that has no file)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())
        digest.update(b"\n")
    return f"sha256:{digest.hexdigest()}"


def dataset_fingerprint(data: DataSpec, files: list[SourceFile]) -> str:
    """What determines a dataset's normalized rows: the inputs' content and the settings that shape the rows."""
    return "sha256:" + canonical_hash(
        {
            "version": NORMALIZATION_VERSION,
            "format": data.format,
            # what is read from where (text_field and columns.text are one setting, so they hash alike)
            "columns": ColumnMap.of(data).renames,
            "roles": data.roles,
            "max_samples": data.max_samples,
            "eval_fraction": data.eval_fraction,
            "files": [f.fingerprint for f in files],
        }
    )


# --------------------------------------------------------------------------- readers


def within(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or below it, both with symlinks and `..` resolved; DataError naming the path when
    it cannot be resolved (a symlink loop)."""
    return _resolved(path).is_relative_to(_resolved(root))


def _resolved(path: Path) -> Path:
    """`path` with symlinks and `..` resolved; DataError for a symlink loop (RuntimeError before Python 3.13,
    OSError ELOOP since)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
            raise DataError(f"{quoted(path)}: cannot be resolved ({exc.strerror or exc})") from None
        raise DataError(
            f"{quoted(path)}: a symlink loop (following it leads back to it); remove the link or fix it"
        ) from None


def in_cluster(spec: PipelineSpec | None, run_root: Path | None) -> bool:
    """Whether a run directory is on the cluster's checkpoints volume (so the stage runs in a pod of the DAG)."""
    if spec is None or run_root is None:
        return False
    return within(Path(run_root), Path(spec.cluster.checkpoints.mount_path))


def confine(path: Path, uri: str, spec: PipelineSpec | None, run_root: Path | None) -> Path:
    """`path` when a stage may read it (see the module docstring); DataError naming the rule otherwise."""
    if spec is not None and in_cluster(spec, run_root):
        volumes = [spec.cluster.datasets, spec.cluster.checkpoints]
        if not any(within(path, Path(v.mount_path)) for v in volumes):
            mounts = " or ".join(f"{v.mount_path} ({v.claim_name})" for v in volumes)
            raise DataError(
                f"{quoted(uri)}: resolves to {quoted(path.resolve())}, outside the mounted volumes; "
                "in the cluster data is read "
                f"only from {mounts}: put the data on the datasets volume and use its path"
            )
    return path


def resolve_path(uri: str, spec: PipelineSpec | None = None) -> Path:
    """The local path of a file URI: a plain path, file://path, or pvc://<claim>/<path> under the claim's mount
    (never outside it)."""
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if uri.startswith("pvc://"):
        claim, _, rest = uri.removeprefix("pvc://").partition("/")
        volumes = [spec.cluster.datasets, spec.cluster.checkpoints] if spec is not None else []
        for volume in volumes:
            if volume.claim_name == claim:
                path = Path(volume.mount_path) / rest
                if Path(rest).is_absolute() or not within(path, Path(volume.mount_path)):
                    raise DataError(
                        f"{quoted(uri)}: the path leaves the claim {claim!r} (mounted at {volume.mount_path}); "
                        "use a path inside it, without '..'"
                    )
                return path
        raise DataError(
            f"{quoted(uri)}: claim {claim!r} is not one of the cluster volumes (cluster.datasets/checkpoints)"
        )
    return Path(uri)


def unreadable(path: Path | str, exc: OSError) -> DataError:
    return DataError(f"{quoted(path)}: cannot be read ({exc.strerror or exc}); check the file and its permissions")


def jsonl_lines(stream: BinaryIO, limit: int, digest: Any = None) -> Iterator[tuple[int, bytes, int]]:
    """(line number, bytes, size) of each non-blank line of a JSONL stream. A line of more than `limit` bytes
    comes cut to its first `limit` + 1, with `size` its whole length: the rest is read past a chunk at a time and
    never held, so a stream without a newline takes bounded memory. Every byte read goes into `digest` (a hashlib
    object) when given, so the content is fingerprinted in the same pass."""
    number = 0
    while raw := stream.readline(limit + 1):
        number += 1
        if digest is not None:
            digest.update(raw)
        size = len(raw)
        if size > limit and not raw.endswith(b"\n"):
            while chunk := stream.readline(LINE_CHUNK_BYTES):
                if digest is not None:
                    digest.update(chunk)
                size += len(chunk)
                if chunk.endswith(b"\n"):
                    break
        if raw.strip():
            yield number, raw, size


class DuplicateKey(ValueError):
    """A JSON object that gives one key twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _keys_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once. json.loads keeps whichever of two equal keys came last, so a
    row {"text": a, "text": b} would train on b while every other reader of the file may see a. (This doubles
    json's parse time, a few microseconds a row: small beside tokenizing it.)"""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return value


_ROW_DECODER = json.JSONDecoder(object_pairs_hook=_keys_once)


def parse_jsonl_line(raw: bytes, name: str, number: int, limit: int, encoding: str = "utf-8", size: int = 0) -> RawRow:
    """One JSONL line decoded (`encoding`) and parsed, or the RowError saying why it cannot be. `size`: the whole
    line's length when `raw` is only its beginning."""
    if number == 1 and encoding == "utf-8":
        raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark is not data
    line = raw.rstrip(b"\r\n")
    excerpt = line[:RAW_EXCERPT_CHARS].decode(encoding, errors="replace")
    if max(size, len(raw)) > limit:
        return RawRow(name, number, error=_too_long(name, number, max(size, len(raw)), limit, excerpt))
    try:
        text = line.decode(encoding)
    except UnicodeDecodeError as exc:
        undecodable = _undecodable(line, exc, encoding)
        error = RowError(name, number, "", undecodable.message(name), excerpt, undecodable=undecodable)
        return RawRow(name, number, error=error)
    try:
        value = _ROW_DECODER.decode(text)
    except json.JSONDecodeError as exc:
        error = f"not valid JSON: {exc.msg} (column {exc.colno})"
        return RawRow(name, number, error=RowError(name, number, "", error, excerpt))
    except DuplicateKey as exc:
        error = f"key {exc.key!r} given twice in one object (which one is meant?)"
        return RawRow(name, number, error=RowError(name, number, "", error, excerpt))
    except RecursionError:
        error = "arrays or objects nested too deeply to read (a data row is a few levels deep)"
        return RawRow(name, number, error=RowError(name, number, "", error, excerpt))
    except ValueError as exc:  # a number Python refuses to convert (sys.get_int_max_str_digits)
        error = f"not valid JSON: {exc}"
        if "integer string conversion" in str(exc):
            limit_digits = sys.get_int_max_str_digits()
            error = f"a number of more than {limit_digits} digits, too long to read (write it as a string)"
        return RawRow(name, number, error=RowError(name, number, "", error, excerpt))
    return RawRow(name, number, value=value)


def _undecodable(line: bytes, exc: UnicodeDecodeError, encoding: str) -> Undecodable:
    """Why a line is not text in `encoding`, with the encoding it is when that is one data.encoding offers."""
    decodes_as = ""
    for other in ("cp949",) if encoding == "utf-8" else ("utf-8",):
        try:
            line.decode(other)
        except UnicodeDecodeError:
            continue
        decodes_as = other
    return Undecodable(exc.start, line[exc.start], encoding, decodes_as)


def read_jsonl(path: Path, limit: int, encoding: str = "utf-8") -> Iterator[RawRow]:
    """Rows of a JSONL file: one JSON object per line; blank lines are skipped."""
    with open(path, "rb") as f:
        for number, raw, size in jsonl_lines(f, limit):
            yield parse_jsonl_line(raw, str(path), number, limit, encoding, size)


def parquet_rows(parquet: Any, name: str, limit: int, stored: int | None = None) -> Iterator[RawRow]:
    """Rows of a pyarrow ParquetFile (numbered from 1 in file order), read a batch at a time. `stored`: the
    file's size, when its rows may come to `inflation_cap` of it at most, counted as JSON: its footer declares
    less (checked when it is opened), but one long value repeated through a dictionary decodes to far more."""
    if (twice := _column_given_twice(parquet.schema_arrow)) is not None:  # to_pylist would keep the last one
        raise DataError(f"{quoted(name)}: column {twice!r} is given twice (which one is meant?)")
    number = 0
    decoded = 0
    cap = inflation_cap(stored) if stored is not None else None
    try:
        for batch in parquet.iter_batches(batch_size=1024):
            for value in batch.to_pylist():
                number += 1
                size = len(json.dumps(value, ensure_ascii=False, default=str).encode())
                decoded += size
                if cap is not None and decoded > cap:
                    raise inflation_error(name, stored or 0, cap)
                if size > limit:
                    excerpt = json.dumps(value, ensure_ascii=False, default=str)[:RAW_EXCERPT_CHARS]
                    yield RawRow(name, number, error=_too_long(name, number, size, limit, excerpt))
                else:
                    yield RawRow(name, number, value=value)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{quoted(name)}: not a readable Parquet file ({exc})") from None


def _column_given_twice(schema: Any, path: str = "") -> str | None:
    """The dotted path of the first column or struct field whose name its parent gives twice, or None."""
    import pyarrow as pa

    names = [f.name for f in schema]
    for f in schema:
        if names.count(f.name) > 1:
            return path + f.name
        inner = f.type
        while pa.types.is_list(inner) or pa.types.is_large_list(inner):
            inner = inner.value_type
        if pa.types.is_struct(inner) and (found := _column_given_twice(list(inner), f"{path}{f.name}.")):
            return found
    return None


def _too_long(name: str, number: int, size: int, limit: int, excerpt: str) -> RowError:
    error = f"row is {size} bytes, over the limit of {limit} (raise it with {MAX_ROW_BYTES_ENV})"
    return RowError(name, number, "", error, excerpt)


def parse_row(raw: RawRow, limit: int, encoding: str) -> RawRow:
    """A raw row with its JSONL line parsed (the others as they are)."""
    if raw.raw is None:
        return raw
    return parse_jsonl_line(raw.raw, raw.file, raw.line, limit, encoding, raw.size)


# --------------------------------------------------------------------------- datasets


def data_field(stage: str, index: int | None = None) -> str:
    """The spec path of a stage's data ('stages.sft.data'), or of one dataset of its list ('stages.sft.data.1', as
    `--set` takes it)."""
    return f"stages.{stage}.data" + (f".{index}" if index is not None else "")


def check_stage_format(stage: str, fmt: str, index: int | None = None) -> None:
    """DataError when `stage` cannot use data of format `fmt` (`index`: the dataset's in the stage's list)."""
    allowed = STAGE_FORMATS.get(stage)
    if allowed is not None and fmt not in allowed:
        raise DataError(f"{data_field(stage, index)}.format is {fmt!r}, but {stage} reads {' or '.join(allowed)}")


def _excerpt(value: Any) -> str:
    """The start of a row as JSON, writable as UTF-8 (a lone surrogate kept as its escape)."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        return f"<{_type_name(value)} too deep or too large to show>"
    return writable(text[:RAW_EXCERPT_CHARS])


class _UnmappedColumn:
    """Whether every row read so far lacks the same mapped column (or message key): then the mapping is wrong, not
    the rows, and one error says so instead of a line per row."""

    def __init__(self) -> None:
        self.first: RowError | None = None
        self.shape = ""
        self.source = ""
        self.present: set[str] = set()
        self.rows = 0
        self.stopped = False

    def see(self, field: str, present: list[str] | None, error: RowError, mapping: ColumnMap) -> None:
        """Count a bad row (its error named `field`; `present` are the row's keys when the field was missing): one
        more that lacks the mapped column, or the end of the run."""
        shape = re.sub(r"\[\d+\]", "[]", field)  # a message's key: whichever message of the row lacks it
        if present is None or not mapping.renamed(field) or shape != (self.shape or shape):
            self.stop()
        if self.stopped:
            return
        self.first, self.shape, self.source = self.first or error, shape, mapping.renamed(field)
        self.present.update(present or [])
        self.rows += 1

    def stop(self) -> None:
        """A row has the column, or fails for another reason: the mapping is not what is wrong."""
        self.stopped, self.rows = True, 0

    def error(self, where: str, field: str | None, every: bool) -> DataError:
        """The dataset error: the mapping names a column the data does not have, and what the data has."""
        assert self.first is not None
        nested = "." in self.first.field
        name = self.first.field.rsplit(".", 1)[-1]
        if every:
            scope = f"all {self.rows} rows lack it" if self.rows > 1 else "the only row lacks it"
        else:
            scope = f"the first {self.rows} rows all lack it"
        lacking = f"no message has ({scope};" if nested else f"no row has ({scope};"
        present = sorted(self.present)
        listed = ", ".join(repr(k) for k in present[:30]) + (", ..." if len(present) > 30 else "")
        fix = f"{field or 'data'}.{self.source}"
        return DataError(
            f"{where}: {self.source} names {'message key' if nested else 'column'} {name!r}, which {lacking} "
            f"they have {listed or 'no keys'}): fix {fix}. The first row: {self.first}"
        )


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSONL (UTF-8, one object per line), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
