"""The rows of one data file by its kind: JSONL lines, JSON arrays, CSV and TSV tables, Parquet and Arrow.

A file's kind comes from its name (`stages.sources`: `.jsonl`, `.json`, `.csv`, `.tsv`, `.parquet`, `.arrow`, each
text kind optionally `.gz` or `.zst`). Every kind is read as a stream in bounded memory, and every byte read goes
into the file's digest where it is hashed as it is read:

- JSONL: one JSON object per line, left unparsed (`RawRow.raw`) for prepare's workers (`stages.data.parse_row`);
- JSON: an array of objects, as LLaMA-Factory's and Alpaca's dataset files are, read element by element (a buffer
  of at most one element beyond the current chunk); a `.json` file that does not start with `[` is JSON lines.
  Each element is checked as a JSONL line is: a key given twice, a row over the size limit, undecodable text;
- CSV and TSV: a header row, then one row per record (quoted fields may span lines), as spreadsheets export them;
  a UTF-8 byte order mark is skipped, `data.encoding` decodes (cp949 for Korean Excel exports), a header naming a
  column twice is refused, and a record with more or fewer fields than the header is a bad row. Values stay text;
- Parquet (`stages.data.parquet_rows`) and Arrow IPC, file or stream format (`datasets`' `save_to_disk` writes the
  stream format), a record batch at a time.
"""

from __future__ import annotations

import codecs
import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from spec.quoting import quoted
from stages.data import (
    RAW_EXCERPT_CHARS,
    DataError,
    RawRow,
    RowError,
    _too_long,
    jsonl_lines,
    parquet_rows,
    parse_jsonl_line,
    unreadable,
)

if TYPE_CHECKING:
    from stages.sources import SourceObject

CHUNK_CHARS = 1 << 20
"""Bytes read (and decoded) at a time from a JSON array or a table."""

_SCANNER = json.JSONDecoder()


def _decoded(stream: BinaryIO, name: str, encoding: str, digest: Any) -> Iterator[str]:
    """The text of a stream in chunks, a UTF-8 byte order mark skipped; DataError naming the file and the byte
    offset where it is not text in `encoding`."""
    decoder = codecs.getincrementaldecoder("utf-8-sig" if encoding == "utf-8" else encoding)()
    offset = 0
    while True:
        data = stream.read(CHUNK_CHARS)
        if digest is not None:
            digest.update(data)
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            other = "cp949" if encoding == "utf-8" else "utf-8"
            raise DataError(
                f"{quoted(name)}: byte {offset + exc.start} is not text in {encoding}; if the file is {other} (as "
                f"Korean Excel exports are cp949), set data.encoding: {other}"
            ) from None
        offset += len(data)
        if text:
            yield text
        if not data:
            return


def json_array_rows(stream: BinaryIO, name: str, limit: int, encoding: str, digest: Any = None) -> Iterator[RawRow]:
    """The elements of a JSON array file as parsed rows numbered by the line each starts on; a file that does not
    start with `[` is read as JSON lines, one value per line (as `datasets`' json loader reads both)."""
    chunks = _decoded(stream, name, encoding, digest)
    buffer, position, line, done = "", 0, 1, False

    def more() -> bool:
        nonlocal buffer, position, done
        if done:
            return False
        chunk = next(chunks, None)
        if chunk is None:
            done = True
            return False
        buffer, position = buffer[position:] + chunk, 0
        return True

    def skip(characters: str) -> str:
        """Skip `characters` (counting lines); the next other character, '' at the end of the file."""
        nonlocal position, line
        while True:
            while position < len(buffer) and buffer[position] in characters:
                line += buffer[position] == "\n"
                position += 1
            if position < len(buffer):
                return buffer[position]
            if not more():
                return ""

    array = skip(" \t\r\n") == "["
    if array:
        position += 1
    first = True
    while True:
        if array:
            mark = skip(" \t\r\n")
            if mark == "]":
                position += 1
                if skip(" \t\r\n"):
                    raise DataError(f"{quoted(name)}:{line}: text after the end of the JSON array")
                return
            if not first:
                if mark != ",":
                    raise DataError(f"{quoted(name)}:{line}: not a JSON array: ',' or ']' expected")
                position += 1
            if not skip(" \t\r\n"):
                raise DataError(f"{quoted(name)}:{line}: the JSON array ends before its ']'")
        elif not skip(" \t\r\n"):
            return
        first = False
        while True:
            try:
                _, end = _SCANNER.raw_decode(buffer, position)
            except json.JSONDecodeError as exc:
                if len(buffer) - position > 4 * limit or not more():
                    raise DataError(f"{quoted(name)}:{line}: not valid JSON: {exc.msg}") from None
                continue
            if end < len(buffer) or not more():  # a number at the chunk's end may go on in the next
                break
        element, start = buffer[position:end], line
        line += element.count("\n")
        position = end
        yield _element_row(element, name, start, limit)


def _element_row(element: str, name: str, line: int, limit: int) -> RawRow:
    """One JSON element as a row, checked exactly as a JSONL line is (`parse_jsonl_line`: size, a key given twice,
    nesting, numbers too long to read)."""
    return parse_jsonl_line(element.encode("utf-8", "surrogatepass"), name, line, limit)


class _Lines:
    """The lines of decoded chunks, for csv (which splits quoted fields across lines itself), counting them."""

    def __init__(self, chunks: Iterator[str]) -> None:
        self.chunks, self.pending, self.read = chunks, "", 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        while "\n" not in self.pending:
            chunk = next(self.chunks, None)
            if chunk is None:
                if not self.pending:
                    raise StopIteration
                line, self.pending = self.pending, ""
                self.read += 1
                return line
            self.pending += chunk
        line, _, self.pending = self.pending.partition("\n")
        self.read += 1
        return line + "\n"


def table_rows(
    stream: BinaryIO, name: str, limit: int, encoding: str, delimiter: str, digest: Any = None
) -> Iterator[RawRow]:
    """The records of a CSV (`delimiter` ',') or TSV ('\\t') file as rows keyed by its header, numbered by the line
    each starts on."""
    lines = _Lines(_decoded(stream, name, encoding, digest))
    csv.field_size_limit(max(limit, 1))
    reader = csv.reader(lines, delimiter=delimiter)
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise DataError(f"{quoted(name)}:1: the header is not readable ({exc})") from None
    if not header or not any(h.strip() for h in header):
        raise DataError(f"{quoted(name)}: no header row (the first line names the columns)")
    header = [h.strip() for h in header]
    twice = next((h for h in header if header.count(h) > 1), None)
    if twice is not None:
        raise DataError(f"{quoted(name)}:1: column {twice!r} is given twice in the header (which one is meant?)")
    while True:
        start = lines.read + 1
        try:
            record = next(reader, None)
        except csv.Error as exc:
            error = f"not a readable record ({exc})"
            yield RawRow(name, start, error=RowError(name, start, "", error, lines.pending[:RAW_EXCERPT_CHARS]))
            continue
        if record is None:
            return
        if not any(field.strip() for field in record):
            continue  # a blank line
        excerpt = delimiter.join(record)[:RAW_EXCERPT_CHARS]
        size = sum(len(field.encode("utf-8", "surrogatepass")) for field in record)
        if size > limit:
            yield RawRow(name, start, error=_too_long(name, start, size, limit, excerpt))
        elif len(record) != len(header):
            error = f"{len(record)} fields where the header names {len(header)} columns"
            yield RawRow(name, start, error=RowError(name, start, "", error, excerpt))
        else:
            yield RawRow(name, start, value=dict(zip(header, record, strict=True)))


def arrow_rows(source: Any, name: str, limit: int) -> Iterator[RawRow]:
    """Rows of an Arrow IPC file or stream (`source`: a path, or a binary stream for the stream format)."""
    import pyarrow as pa

    try:
        if isinstance(source, str) and _is_arrow_file(source):
            reader: Any = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        number = 0
        for batch in batches:
            for value in batch.to_pylist():
                number += 1
                text = json.dumps(value, ensure_ascii=False, default=str)
                if len(text.encode()) > limit:
                    excerpt = text[:RAW_EXCERPT_CHARS]
                    yield RawRow(name, number, error=_too_long(name, number, len(text.encode()), limit, excerpt))
                else:
                    yield RawRow(name, number, value=value)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{quoted(name)}: not a readable Arrow IPC file or stream ({exc})") from None


def _is_arrow_file(path: str) -> bool:
    """Whether a local file is in the Arrow IPC file format (it starts with ARROW1), not the stream format."""
    with open(path, "rb") as file:
        return file.read(6) == b"ARROW1"


def object_rows(obj: SourceObject, limit: int, encoding: str, staging: Path, digest: Any = None) -> Iterator[RawRow]:
    """The raw rows of one data file or object, by its kind: JSONL lines unparsed, every other kind parsed. The
    bytes of a streamed kind go into `digest` as they are read; Parquet and a local Arrow file are read by pyarrow
    (their fingerprint is the file's hash or the object's version)."""
    from stages.sources import open_parquet, open_stream

    if obj.kind == "parquet":
        with open_parquet(obj, staging) as parquet:
            yield from parquet_rows(parquet, obj.uri, limit, obj.size)
        return
    if obj.kind == "arrow" and obj.path is not None:
        yield from arrow_rows(str(obj.path), obj.uri, limit)
        return
    try:
        with open_stream(obj) as stream:
            if obj.kind == "arrow":
                yield from arrow_rows(stream, obj.uri, limit)
            elif obj.kind == "json":
                yield from json_array_rows(stream, obj.uri, limit, encoding, digest)
            elif obj.kind in ("csv", "tsv"):
                yield from table_rows(stream, obj.uri, limit, encoding, "," if obj.kind == "csv" else "\t", digest)
            else:
                for number, raw, size in jsonl_lines(stream, limit, digest):
                    yield RawRow(obj.uri, number, raw=raw, size=size if size > len(raw) else 0)
    except OSError as exc:
        raise unreadable(obj.uri, exc) from None


def hashed_as_read(obj: SourceObject) -> bool:
    """Whether `object_rows` hashes the object's bytes as it reads them (a local file of a streamed kind); else its
    fingerprint is its version (a stored object) or the local file's hash."""
    return not obj.version and obj.kind not in ("parquet", "arrow")
