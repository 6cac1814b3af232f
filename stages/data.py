"""Training data: reading every source, validating rows, normalizing them to one canonical form per kind.

Sources (a stage's `data.uri`): a JSONL file, a Parquet file, a directory of `.jsonl`/`.parquet` files (read in
sorted order), `hf://org/name` (a hub dataset, through `datasets`), or `builtin:<name>` (see
`stages.builtin_data`). `file://` paths work as plain paths, and `pvc://<claim>/<path>` is read from the mount
of that claim in the spec's cluster volumes.

Where data may come from (`confine`):
- in the cluster (the run directory is on the checkpoints volume, as every compiled workflow's is), a data path
  must resolve, `..` and symlinks followed, under cluster.datasets.mount_path or cluster.checkpoints.mount_path;
- locally (`--local`, or a run directory anywhere else) any path of your own machine may be read;
- everywhere: a `pvc://` path stays inside its claim's mount, and a file in a data directory that is a symlink to
  somewhere outside that directory is refused (a data directory is read as a whole, so what it links to is not
  what the spec names).

Canonical forms, what every later stage reads:

    text        {"text": str}
    chat        {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
                (formats messages, alpaca and sharegpt)
    preference  {"prompt": [messages...], "chosen": [{"role": "assistant", "content": str}],
                 "rejected": [{"role": "assistant", "content": str}]}

A bad row is reported as `<file>:<line>: field '<path>': <problem>`, e.g.
`train.jsonl:17: field 'messages[2].content': expected a string, got null`. Bad rows are quarantined and
counted when they stay within the dataset's `max_bad_row_fraction`; beyond it the dataset fails, listing the
first errors. Blank lines of a JSONL file are not rows and are skipped; every other line is either a row or an
error, never silently dropped. JSON that Python cannot hold as data is a bad row too: arrays or objects nested too
deeply to read, a number too long to convert, a string with a lone surrogate (an escape such as `\\ud800` that
encodes half a character, which cannot be written as UTF-8). A file that cannot be read, a file name that is not
UTF-8 and a symlink loop fail the dataset, naming the path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.contract import canonical_hash, writable
from workflows.spec import DataSpec, PipelineSpec

DEFAULT_MAX_ROW_BYTES = 4 * 1024 * 1024
"""Rows larger than this (bytes of the JSONL line or of the row as JSON) are errors."""

MAX_ROW_BYTES_ENV = "POSTTRAIN_MAX_ROW_BYTES"
"""Environment variable that overrides DEFAULT_MAX_ROW_BYTES."""

NORMALIZATION_VERSION = 1
"""Part of every dataset fingerprint: bump it when the canonical forms or the validation rules change."""

MAX_LISTED_ERRORS = 5
RAW_EXCERPT_CHARS = 500

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}

STAGE_FORMATS: dict[str, tuple[str, ...]] = {
    "cpt": ("text",),
    "sft": ("messages", "alpaca", "sharegpt"),
    "rlhf": ("preference",),
    "evaluate": ("text", "messages", "alpaca", "sharegpt"),
}
"""Formats each stage can train or evaluate on."""

DATA_SUFFIXES = (".jsonl", ".parquet")

BUILTIN_TASKS_DIR = Path("prepare") / "data" / "evaluate" / "lm_eval"
"""Where prepare writes a builtin lm-eval task folder (`lm_eval_include_path: builtin:<name>`), in the run
directory; evaluate reads it from there."""


class DataError(Exception):
    """A dataset that cannot be used: missing, unreadable, empty, or with too many bad rows."""


@dataclass
class RowError:
    """One bad row: where it is, which field, what is wrong, and an excerpt of the row."""

    file: str
    line: int
    field: str
    error: str
    raw: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{where}: field '{self.field}': {self.error}" if self.field else f"{where}: {self.error}"

    def record(self) -> dict[str, Any]:
        """The quarantine record of this row."""
        return {"file": self.file, "line": self.line, "field": self.field, "error": self.error, "raw": self.raw}


class FieldError(Exception):
    """A field of a row is wrong; raised by the validators, turned into a RowError with file and line."""

    def __init__(self, field: str, error: str) -> None:
        super().__init__(f"{field}: {error}")
        self.field = field
        self.error = error


@dataclass
class RawRow:
    """A row as read from a source, before validation: a parsed value, or the error that prevented parsing."""

    file: str
    line: int
    value: Any = None
    error: RowError | None = None


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
            "text_field": data.text_field,
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
            raise DataError(f"{path}: cannot be resolved ({exc.strerror or exc})") from None
        raise DataError(f"{path}: a symlink loop (following it leads back to it); remove the link or fix it") from None


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
                f"{uri}: resolves to {path.resolve()}, outside the mounted volumes; in the cluster data is read "
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
                        f"{uri}: the path leaves the claim {claim!r} (mounted at {volume.mount_path}); "
                        "use a path inside it, without '..'"
                    )
                return path
        raise DataError(f"{uri}: claim {claim!r} is not one of the cluster volumes (cluster.datasets/checkpoints)")
    if uri.startswith(("gs://", "s3://")):
        raise DataError(
            f"{uri}: object storage is not read directly; copy the data to the datasets volume and use its path"
        )
    return Path(uri)


def data_files(path: Path, uri: str) -> list[Path]:
    """The data files of a path: the file itself, or the .jsonl/.parquet files of a directory, sorted."""
    if path.is_file():
        return [path]
    if path.is_dir():
        for link in (p for p in path.rglob("*") if p.is_symlink()):
            if not within(link, path):
                raise DataError(
                    f"{uri}: {link} is a symlink to {link.resolve()}, outside the data directory; copy the file into "
                    "the directory (or name it in the spec) instead of linking to it"
                )
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not files:
            raise DataError(f"{uri}: the directory has no .jsonl or .parquet files")
        for file in files:
            if writable(str(file)) != str(file):  # undecodable bytes in a name: recorded paths must be UTF-8
                raise DataError(f"{writable(str(file))}: the file name is not valid UTF-8; rename the file")
        return files
    if path.is_symlink():
        _resolved(path)  # a loop says so
        raise DataError(f"{uri}: {path} is a symlink to {os.readlink(path)}, which does not exist")
    raise DataError(f"{uri}: no such file or directory")


def _unreadable(path: Path, exc: OSError) -> DataError:
    return DataError(f"{path}: cannot be read ({exc.strerror or exc}); check the file and its permissions")


def read_jsonl(path: Path, limit: int) -> Iterator[RawRow]:
    """Rows of a JSONL file: one JSON object per line; blank lines are skipped."""
    name = str(path)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark is not data
            if not raw.strip():
                continue
            excerpt = raw.rstrip(b"\r\n")[:RAW_EXCERPT_CHARS].decode("utf-8", errors="replace")
            if len(raw) > limit:
                yield RawRow(name, number, error=_too_long(name, number, len(raw), limit, excerpt))
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                error = f"invalid UTF-8 at byte {exc.start} of the line"
                yield RawRow(name, number, error=RowError(name, number, "", error, excerpt))
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                error = f"not valid JSON: {exc.msg} (column {exc.colno})"
                yield RawRow(name, number, error=RowError(name, number, "", error, excerpt))
                continue
            except RecursionError:
                error = "arrays or objects nested too deeply to read (a data row is a few levels deep)"
                yield RawRow(name, number, error=RowError(name, number, "", error, excerpt))
                continue
            except ValueError as exc:  # a number Python refuses to convert (sys.get_int_max_str_digits)
                error = f"not valid JSON: {exc}"
                if "integer string conversion" in str(exc):
                    limit_digits = sys.get_int_max_str_digits()
                    error = f"a number of more than {limit_digits} digits, too long to read (write it as a string)"
                yield RawRow(name, number, error=RowError(name, number, "", error, excerpt))
                continue
            yield RawRow(name, number, value=value)


def read_parquet(path: Path, limit: int) -> Iterator[RawRow]:
    """Rows of a Parquet file (numbered from 1 in file order), through pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow (pip install pyarrow), which is not installed"
        ) from None
    name = str(path)
    try:
        parquet = pq.ParquetFile(path)
        number = 0
        for batch in parquet.iter_batches(batch_size=1024):
            for value in batch.to_pylist():
                number += 1
                size = len(json.dumps(value, ensure_ascii=False, default=str).encode())
                if size > limit:
                    excerpt = json.dumps(value, ensure_ascii=False, default=str)[:RAW_EXCERPT_CHARS]
                    yield RawRow(name, number, error=_too_long(name, number, size, limit, excerpt))
                else:
                    yield RawRow(name, number, value=value)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{name}: not a readable Parquet file ({exc})") from None


def _too_long(name: str, number: int, size: int, limit: int, excerpt: str) -> RowError:
    error = f"row is {size} bytes, over the limit of {limit} (raise it with {MAX_ROW_BYTES_ENV})"
    return RowError(name, number, "", error, excerpt)


def read_hub(uri: str, split: str) -> tuple[list[SourceFile], Iterator[RawRow]]:
    """Rows of a hub dataset `hf://org/name` (split `split`), through `datasets`."""
    name = uri.removeprefix("hf://").strip("/")
    try:
        import datasets

        hub = datasets.load_dataset(name, split=split)
    except ImportError:
        raise DataError(f"{uri}: reading hub datasets needs the 'datasets' package") from None
    except Exception as exc:  # offline, gated, missing: datasets raises many kinds
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        hint = " (this machine is offline: HF_HUB_OFFLINE is set)" if offline else ""
        raise DataError(
            f"{uri}: could not load split {split!r} from the Hugging Face hub{hint}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}. Without network access, download the dataset to "
            "the datasets volume and use its path instead."
        ) from None
    source = SourceFile(uri, "hf:" + canonical_hash({"name": name, "split": split, "fp": hub._fingerprint}))
    display = f"{uri}[{split}]"
    return [source], (RawRow(display, i, value=row) for i, row in enumerate(hub, start=1))


def read_builtin(uri: str) -> tuple[list[SourceFile], Iterator[RawRow]]:
    """Rows of a builtin dataset `builtin:<name>`, numbered from 1."""
    from stages.builtin_data import BuiltinDataError, builtin_dataset

    try:
        rows = builtin_dataset(uri.removeprefix("builtin:"))
    except BuiltinDataError as exc:
        raise DataError(f"{uri}: {exc}") from None
    return [SourceFile(uri, sha256_rows(rows))], (RawRow(uri, i, value=r) for i, r in enumerate(rows, start=1))


def read_source(
    uri: str, data: DataSpec, spec: PipelineSpec | None = None, run_root: Path | None = None
) -> tuple[list[SourceFile], Iterator[RawRow]]:
    """The inputs of a data URI with their fingerprints, and an iterator over its raw rows. `run_root` (the run
    directory) tells whether the cluster's rule for data paths applies (see `confine`)."""
    if uri.startswith("builtin:"):
        return read_builtin(uri)
    if uri.startswith("hf://"):
        return read_hub(uri, data.split)
    limit = max_row_bytes()
    files = data_files(confine(resolve_path(uri, spec), uri, spec, run_root), uri)
    sources = []
    for f in files:
        try:
            sources.append(SourceFile(str(f), sha256_file(f)))
        except OSError as exc:
            raise _unreadable(f, exc) from None

    def rows() -> Iterator[RawRow]:
        for f in files:
            reader = read_parquet if f.suffix == ".parquet" else read_jsonl
            count = 0
            try:
                for row in reader(f, limit):
                    count += 1
                    yield row
            except OSError as exc:
                raise _unreadable(f, exc) from None
            if count == 0:
                raise DataError(f"{f}: empty file: no rows (an export that failed?)")

    return sources, rows()


# --------------------------------------------------------------------------- validation and normalization

_FORMAT_KEYS = {
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "preference": ("chosen", "rejected"),
}


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _format_hint(row: dict[str, Any], fmt: str, text_field: str) -> str:
    """' (the row looks like format X ...)' when a missing field is explained by another format."""
    keys = {**_FORMAT_KEYS, "text": (text_field,)}
    for other, needed in keys.items():
        if other != fmt and all(k in row for k in needed):
            return f" (the row has {', '.join(repr(k) for k in needed)}: is it in format {other!r}?)"
    return ""


def _required(row: dict[str, Any], key: str, fmt: str, text_field: str, path: str | None = None) -> Any:
    path = path or key
    if key not in row:
        raise FieldError(path, "missing" + _format_hint(row, fmt, text_field))
    return row[key]


def _string(value: Any, path: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise FieldError(path, f"expected a string, got {_type_name(value)}")
    if not allow_empty and not value.strip():
        raise FieldError(path, "empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = f"\\u{ord(value[exc.start]):04x}"
        raise FieldError(
            path, f"a lone surrogate {surrogate} at character {exc.start + 1}: half of a character, not text"
        ) from None
    return value


def _message_list(
    value: Any, path: str, role_key: str = "role", content_key: str = "content", roles: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """Validate a list of chat messages (role/content, or from/value for sharegpt) into canonical messages."""
    if not isinstance(value, list):
        raise FieldError(path, f"expected a list of messages, got {_type_name(value)}")
    if not value:
        raise FieldError(path, "empty list: a conversation needs at least one message")
    roles = roles or {r: r for r in ROLES}
    out = []
    for i, message in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(message, dict):
            raise FieldError(
                where, f"expected an object with {role_key!r} and {content_key!r}, got {_type_name(message)}"
            )
        if role_key not in message:
            raise FieldError(f"{where}.{role_key}", "missing")
        role = message[role_key]
        if not isinstance(role, str):
            raise FieldError(f"{where}.{role_key}", f"expected a string, got {_type_name(role)}")
        if role not in roles:
            raise FieldError(f"{where}.{role_key}", f"unknown role {role!r} (expected one of {', '.join(roles)})")
        role = roles[role]
        if role == "system" and i != 0:
            raise FieldError(f"{where}.{role_key}", "a system message may only come first")
        if content_key not in message:
            raise FieldError(f"{where}.{content_key}", "missing")
        content = _string(message[content_key], f"{where}.{content_key}")
        reasoning = message.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            reasoning = _string(reasoning, f"{where}.reasoning_content", allow_empty=True)
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
        out.append({"role": role, "content": content})
    return out


def _conversation(messages: list[dict[str, str]], path: str, role_key: str = "role") -> list[dict[str, str]]:
    """Check the shape of a training conversation: user first, an assistant turn, the assistant last."""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    first = len(messages) - len(turns)
    if not turns:
        raise FieldError(path, "only a system message: no user or assistant turn")
    if turns[0]["role"] != "user":
        raise FieldError(f"{path}[{first}].{role_key}", f"the first turn must be 'user', got {turns[0]['role']!r}")
    if not any(m["role"] == "assistant" for m in turns):
        raise FieldError(path, "no assistant turn: nothing to learn from")
    if turns[-1]["role"] != "assistant":
        last = len(messages) - 1
        raise FieldError(f"{path}[{last}].{role_key}", "the conversation must end with an assistant turn")
    return messages


def _normalize_text(row: dict[str, Any], text_field: str) -> dict[str, Any]:
    return {"text": _string(_required(row, text_field, "text", text_field), text_field)}


def _normalize_messages(row: dict[str, Any], text_field: str) -> dict[str, Any]:
    messages = _message_list(_required(row, "messages", "messages", text_field), "messages")
    return {"messages": _conversation(messages, "messages")}


def _normalize_alpaca(row: dict[str, Any], text_field: str) -> dict[str, Any]:
    instruction = _string(_required(row, "instruction", "alpaca", text_field), "instruction")
    extra = _string(row.get("input") or "", "input", allow_empty=True)
    output = _string(_required(row, "output", "alpaca", text_field), "output")
    messages = []
    if row.get("system") is not None:
        messages.append({"role": "system", "content": _string(row["system"], "system")})
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return {"messages": messages}


def _normalize_sharegpt(row: dict[str, Any], text_field: str) -> dict[str, Any]:
    value = _required(row, "conversations", "sharegpt", text_field)
    messages = _message_list(value, "conversations", "from", "value", SHAREGPT_ROLES)
    return {"messages": _conversation(messages, "conversations", "from")}


def _completion(value: Any, path: str) -> list[dict[str, str]]:
    """A chosen/rejected answer: a string, or a list of assistant messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": _string(value, path)}]
    messages = _message_list(value, path)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            raise FieldError(f"{path}[{i}].role", f"expected 'assistant' in a completion, got {m['role']!r}")
    return messages


def _normalize_preference(row: dict[str, Any], text_field: str) -> dict[str, Any]:
    prompt = _required(row, "prompt", "preference", text_field)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": _string(prompt, "prompt")}]
    else:
        prompt = _message_list(prompt, "prompt")
        if prompt[-1]["role"] != "user":
            raise FieldError(
                f"prompt[{len(prompt) - 1}].role", f"the prompt must end with a user turn, got {prompt[-1]['role']!r}"
            )
    chosen = _completion(_required(row, "chosen", "preference", text_field), "chosen")
    rejected = _completion(_required(row, "rejected", "preference", text_field), "rejected")
    if chosen == rejected:
        raise FieldError("rejected", "identical to 'chosen': the pair teaches no preference")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


NORMALIZERS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    "text": _normalize_text,
    "messages": _normalize_messages,
    "alpaca": _normalize_alpaca,
    "sharegpt": _normalize_sharegpt,
    "preference": _normalize_preference,
}


def normalize_row(value: Any, fmt: str, text_field: str = "text") -> dict[str, Any]:
    """The canonical form of one row of format `fmt`; FieldError names the field that is wrong."""
    if not isinstance(value, dict):
        raise FieldError("", f"expected a JSON object per row, got {_type_name(value)}")
    return NORMALIZERS[fmt](value, text_field)


# --------------------------------------------------------------------------- datasets


def check_stage_format(stage: str, fmt: str) -> None:
    """DataError when `stage` cannot use data of format `fmt`."""
    allowed = STAGE_FORMATS.get(stage)
    if allowed is not None and fmt not in allowed:
        raise DataError(f"stages.{stage}.data.format is {fmt!r}, but {stage} reads {' or '.join(allowed)}")


def _excerpt(value: Any) -> str:
    """The start of a row as JSON, writable as UTF-8 (a lone surrogate kept as its escape)."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        return f"<{_type_name(value)} too deep or too large to show>"
    return writable(text[:RAW_EXCERPT_CHARS])


def read_dataset(
    data: DataSpec, spec: PipelineSpec | None = None, stage: str | None = None, run_root: Path | None = None
) -> Dataset:
    """Read, validate and normalize one dataset; bad rows within `max_bad_row_fraction` are kept as errors.
    `run_root` is the run directory reading it (it decides which paths may be read, see `confine`).

    Raises DataError for an unusable dataset: a missing or empty source, no valid rows, or more bad rows
    than allowed (the message lists the first few)."""
    uri = spec.data_uri(data) if spec is not None else data.uri
    if stage is not None:
        check_stage_format(stage, data.format)
    files, raw_rows = read_source(uri, data, spec, run_root)
    rows: list[dict[str, Any]] = []
    errors: list[RowError] = []
    total = 0
    for raw in raw_rows:
        total += 1
        if raw.error is not None:
            errors.append(raw.error)
            continue
        try:
            rows.append(normalize_row(raw.value, data.format, data.text_field))
        except FieldError as exc:
            errors.append(RowError(raw.file, raw.line, exc.field, exc.error, _excerpt(raw.value)))
    where = f"stages.{stage}.data ({uri})" if stage else uri
    if total == 0:
        raise DataError(f"{where}: no rows")
    if errors and len(errors) / total > data.max_bad_row_fraction:
        listed = "\n".join(f"  {e}" for e in errors[:MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(errors) - MAX_LISTED_ERRORS} more" if len(errors) > MAX_LISTED_ERRORS else ""
        raise DataError(
            f"{where}: {len(errors)} of {total} rows are bad ({len(errors) / total:.2%}), over "
            f"max_bad_row_fraction={data.max_bad_row_fraction}:\n{listed}{more}"
        )
    if not rows:
        raise DataError(f"{where}: no valid rows")
    if data.max_samples is not None:
        rows = rows[: data.max_samples]
    return Dataset(uri, data.format, rows, errors, total, files, dataset_fingerprint(data, files))


def split_eval(rows: list[dict[str, Any]], eval_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split rows into (train, eval). The eval rows are those with the smallest content hashes, so the split
    is the same on every run and a row stays on its side when rows are added; both sides keep file order.
    A non-zero fraction holds out at least one row (when there are two or more)."""
    if eval_fraction <= 0 or len(rows) < 2:
        return list(rows), []
    n_eval = min(len(rows) - 1, max(1, round(len(rows) * eval_fraction)))
    ranked = sorted(range(len(rows)), key=lambda i: (canonical_hash(rows[i]), i))
    held = set(ranked[:n_eval])
    train = [r for i, r in enumerate(rows) if i not in held]
    return train, [r for i, r in enumerate(rows) if i in held]


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
