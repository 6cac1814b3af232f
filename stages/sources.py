"""Where a dataset's files live: the data files a data URI names, listed from their store and opened as byte streams.

Stores (a stage's `data.uri`):
- a local path (`file://` too, and `pvc://<claim>/<path>` on the claim's mount): a file; a directory, read as the
  files below it whose names end in DATA_SUFFIXES; a glob (`/mnt/datasets/corpus/*.jsonl.zst`,
  `/mnt/datasets/**/part-*.parquet`). The rules of `stages.data.confine` apply: in the cluster a path must stay on
  the mounted volumes, and a file of a directory or a glob that is a symlink out of it is refused;
- `s3://bucket/<key, prefix or glob>` through boto3, credentials and endpoint from the environment (`s3_client`);
- `gs://bucket/<name, prefix or glob>` through google-cloud-storage, credentials from Google ADC (`gcs_client`).

A remote URI names one object when an object has exactly that key; otherwise it is a prefix, read as a folder
(`s3://b/corpus` is `s3://b/corpus/`, never `s3://b/corpus-old/...`). A glob's wildcards (`*`, `?`, `[...]`) match
within one path segment and `**` across segments, in every store alike (`glob_pattern`). A directory, a prefix and a
glob keep only the data files; a file or object named exactly is read whatever its name, as JSONL unless it ends in
`.parquet`. `.gz` and `.zst` names are decompressed as they are read.

A remote object is read exactly as it was listed: the S3 ETag (`If-Match`) or the GCS generation is part of every
read, so an object replaced between listing and reading fails with an error naming it instead of mixing versions.
Every failure is a `DataError` of one line that names the URI, including those raised while a stream is read.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from spec.quoting import quoted
from stages.contract import writable
from stages.data import DataError, _resolved, confine, inflation_cap, inflation_error, resolve_path, within

if TYPE_CHECKING:
    import pyarrow.parquet

    from spec.pipeline import PipelineSpec

TEXT_KINDS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv"}
"""Text files by suffix (stages/file_formats.py), each also read compressed (.gz, .zst)."""

DATA_SUFFIXES = (
    *(suffix + compressed for suffix in TEXT_KINDS for compressed in ("", ".gz", ".zst")),
    ".parquet",
    ".arrow",
)
"""The names a directory, prefix or glob is read for."""

SUFFIX_LIST = ".jsonl, .json, .csv, .tsv, their .gz and .zst, .parquet or .arrow"

METADATA_NAMES = frozenset({"dataset_info.json", "dataset_dict.json", "state.json"})
"""JSON files that describe a dataset rather than hold its rows (LLaMA-Factory's dataset_info.json; `datasets`'
save_to_disk metadata): a directory's listing skips them."""

WILDCARDS = "*?["

READ_BYTES = 1 << 20
"""Bytes asked of a store (or a decompressor) per read."""

GCS_CHUNK_BYTES = 16 << 20
"""Bytes of a GCS object fetched per request while it is read (each request pinned to the listed generation)."""

STORAGE_EXTRA = "pip install 'posttrain[storage]'; the trainer image has it"

_CLIENTS: dict[tuple[Any, ...], Any] = {}
"""The clients made in this process, by `_client_key`."""

GET_OBJECT = "s3:GetObject on it"
LIST_BUCKET = "s3:ListBucket on the bucket"

S3_DENIED = {"AccessDenied", "AllAccessDisabled", "403", "Forbidden"}
S3_BAD_KEYS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
S3_MISSING = {"NoSuchKey", "404", "NotFound"}
S3_CHANGED = {"PreconditionFailed", "412"}


@dataclass(frozen=True)
class SourceObject:
    """One data file of a dataset, wherever it is stored."""

    uri: str
    """What errors name and stage.json records: the local path as given (resolved from file:// or pvc://), or
    s3://bucket/key, gs://bucket/name."""
    size: int
    """Bytes as stored (compressed, for a .gz or .zst file)."""
    version: str
    """Remote: 'etag:<etag>' (S3) or 'generation:<n>' (GCS), the version every read is pinned to. Local: '' (the
    caller hashes the content it reads)."""
    compression: str
    """'' | 'gzip' | 'zstd', from the name (.gz, .zst)."""
    kind: str
    """'jsonl' | 'json' | 'csv' | 'tsv' | 'parquet' | 'arrow' (stages/file_formats.py)."""
    path: Path | None = None
    """Local files only."""


def is_data_name(name: str) -> bool:
    """Whether a file or object name is one a directory, prefix or glob is read for."""
    return name.endswith(DATA_SUFFIXES) and name.rsplit("/", 1)[-1] not in METADATA_NAMES


def _format_of(name: str) -> tuple[str, str]:
    """(compression, kind) of a file or object name: a kind of TEXT_KINDS, 'parquet' or 'arrow'; any other name
    is read as JSONL."""
    compression = "gzip" if name.endswith(".gz") else "zstd" if name.endswith(".zst") else ""
    stem = name.removesuffix(".gz").removesuffix(".zst")
    if stem.endswith((".parquet", ".arrow")) and not compression:
        return "", stem.rsplit(".", 1)[-1]
    return compression, next((kind for suffix, kind in TEXT_KINDS.items() if stem.endswith(suffix)), "jsonl")


def has_wildcards(text: str) -> bool:
    """Whether a path or key is a glob."""
    return any(c in text for c in WILDCARDS)


def glob_pattern(pattern: str) -> re.Pattern[str]:
    """The regular expression of a glob over '/'-separated names: `*` and `?` match within one segment, `**` across
    segments (`a/**/b` matches a/b and a/x/y/b), `[...]` a character of a set (`[!...]` of its complement)."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**", i):
            whole = (i == 0 or pattern[i - 1] == "/") and pattern.startswith("/", i + 2)
            out.append("(?:.*/)?" if whole else ".*")  # `**/` is any number of whole segments, none included
            i += 3 if whole else 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":  # a ']' first in the set is one of its characters
                j += 1
            j = pattern.find("]", j)
            if j == -1:
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1 : j]
            negated = body.startswith("!")
            body = body[1:] if negated else body
            body = body.replace("\\", "\\\\")
            if not negated and body.startswith("^"):  # a literal caret, not the regex's complement
                body = "\\" + body
            out.append(f"[^/{body}]" if negated else f"[{body}]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def _no_match(uri: str, noun: str, others: list[str]) -> DataError:
    """A glob that matches no data file, naming a few of what it does match."""
    shown = ", ".join(quoted(o) for o in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return DataError(
        f"{quoted(uri)}: the pattern matches no {SUFFIX_LIST} {noun}" + (f", only {shown}" if others else "")
    )


def _split(uri: str) -> tuple[str, str]:
    """(bucket, key) of an s3:// or gs:// URI."""
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    if not bucket:
        raise DataError(
            f"{quoted(uri)}: names no bucket; use {uri.split('://', 1)[0]}://<bucket>/<key, prefix or glob>"
        )
    return bucket, key


def list_objects(uri: str, spec: PipelineSpec | None = None, run_root: Path | None = None) -> list[SourceObject]:
    """The data files a data URI names, sorted by uri: the file or object itself, or the data files of a directory,
    prefix or glob. `spec` resolves pvc:// claims and, with `run_root` (the run directory reading them), decides
    which local paths may be read (`stages.data.confine`). DataError naming the URI when there are none, or the
    store cannot be read."""
    if uri.startswith("s3://"):
        objects = _list_s3(uri)
    elif uri.startswith("gs://"):
        objects = _list_gcs(uri)
    elif uri.startswith(("hf://", "builtin:")):
        raise DataError(
            f"{quoted(uri)}: not a store of files; hub and builtin datasets are read by stages.source_rows.read_source"
        )
    else:
        objects = _list_local(uri, spec, run_root)
    return sorted(objects, key=lambda o: o.uri)


# --------------------------------------------------------------------------- local files


def _local_object(path: Path) -> SourceObject:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DataError(
            f"{quoted(path)}: cannot be read ({exc.strerror or exc}); check the file and its permissions"
        ) from None
    compression, kind = _format_of(path.name)
    return SourceObject(str(path), size, "", compression, kind, path)


def _utf8_names(files: list[Path]) -> None:
    for file in files:
        if writable(str(file)) != str(file):  # undecodable bytes in a name: recorded paths must be UTF-8
            raise DataError(f"{quoted(writable(str(file)))}: the file name is not valid UTF-8; rename the file")


def _list_local(uri: str, spec: PipelineSpec | None, run_root: Path | None) -> list[SourceObject]:
    path = resolve_path(uri, spec)
    if has_wildcards(path.as_posix()) and not path.exists() and not path.is_symlink():
        return [_local_object(f) for f in _glob_files(path, uri, spec, run_root)]
    return [_local_object(f) for f in _data_files(confine(path, uri, spec, run_root), uri)]


def _data_files(path: Path, uri: str) -> list[Path]:
    """The data files of a path: the file itself, or the data files of a directory (every level below it)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        for link in (p for p in path.rglob("*") if p.is_symlink()):
            if not within(link, path):
                raise DataError(
                    f"{quoted(uri)}: {quoted(link)} is a symlink to {quoted(link.resolve())}, outside "
                    "the data directory; copy the file into "
                    "the directory (or name it in the spec) instead of linking to it"
                )
        files = [p for p in path.rglob("*") if p.is_file() and is_data_name(p.name)]
        if not files:
            raise DataError(f"{quoted(uri)}: the directory has no {SUFFIX_LIST} files")
        _utf8_names(files)
        return files
    if path.is_symlink():
        _resolved(path)  # a loop says so
        raise DataError(
            f"{quoted(uri)}: {quoted(path)} is a symlink to {quoted(os.readlink(path))}, which does not exist"
        )
    raise DataError(f"{quoted(uri)}: no such file or directory")


def _glob_files(pattern: Path, uri: str, spec: PipelineSpec | None, run_root: Path | None) -> list[Path]:
    """The data files a local glob matches. The folder before the first wildcard is the glob's root: it must be
    readable (`confine`), and so must every match, which may not be a symlink out of the root. Symlinked folders
    are not walked into, as in a directory."""
    parts = pattern.parts
    first = next(i for i, part in enumerate(parts) if has_wildcards(part))
    root = Path(*parts[:first]) if first else Path(".")
    rest = parts[first:]
    confine(root, uri, spec, run_root)
    regex = glob_pattern("/".join(rest))
    depth = None if any("**" in part for part in rest) else len(rest)  # how many levels below root can match
    found = []

    def unreadable(exc: OSError) -> None:
        if root.is_dir():  # a missing root is said below; a folder that cannot be listed would drop its files
            raise DataError(
                f"{quoted(uri)}: {quoted(exc.filename)} cannot be read ({exc.strerror or exc}); check its permissions"
            )

    for folder, subfolders, names in os.walk(root, onerror=unreadable):
        below = Path(folder).relative_to(root)
        if depth is not None and len(below.parts) + 1 >= depth:
            subfolders.clear()
        found += [Path(folder) / name for name in names if regex.match((below / name).as_posix())]
    files = []
    for match in sorted(found):
        if not within(match, root):  # a loop says so
            raise DataError(
                f"{quoted(uri)}: {quoted(match)} is a symlink to {quoted(match.resolve())}, outside "
                f"{quoted(root)}; copy the file there (or name it "
                "in the spec) instead of linking to it"
            )
        if match.is_file() and is_data_name(match.name):
            files.append(confine(match, uri, spec, run_root))
    if not files:
        if not root.is_dir():
            raise DataError(f"{quoted(uri)}: the pattern matches nothing: {quoted(root)} is not a directory")
        raise _no_match(uri, "files", [f.relative_to(root).as_posix() for f in found])
    _utf8_names(files)
    return files


# --------------------------------------------------------------------------- clients


def s3_client(what: str) -> Any:
    """A boto3 S3 client configured from the environment, as in a pod: credentials from AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY (cluster.secrets), a web identity (IRSA) or an instance role; the region from
    AWS_DEFAULT_REGION, else AWS_REGION; the endpoint of an S3-compatible store (MinIO, Ceph RGW) from
    AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL. botocore addresses a custom endpoint path-style
    (`<endpoint>/<bucket>/<key>`), which those stores need. DataError beginning with `what` (what the user set)
    when boto3 is missing or no credentials are found."""
    try:
        import boto3
    except ImportError:
        raise DataError(f"{quoted(what)}: s3:// needs boto3, which is not installed ({STORAGE_EXTRA})") from None
    # One client per process and environment: making one takes a fifth of a second, and a dataset may have thousands
    # of files. Never one from before a fork: its connections would be shared with the parent.
    key = _client_key("AWS_")
    if key in _CLIENTS:
        return _CLIENTS[key]
    session = boto3.session.Session()
    if session.region_name is None and os.environ.get("AWS_REGION"):
        session = boto3.session.Session(region_name=os.environ["AWS_REGION"])  # what the other AWS SDKs read
    if session.get_credentials() is None:
        raise DataError(
            f"{quoted(what)}: no AWS credentials were found in the environment: set "
            "cluster.secrets.aws_access_key_id/aws_secret_access_key, or give the pod a web identity (IRSA)"
        )
    client = _CLIENTS[key] = session.client("s3")
    return client


def gcs_client(what: str) -> Any:
    """A google-cloud-storage client: credentials from Google ADC (Workload Identity in GKE, or
    GOOGLE_APPLICATION_CREDENTIALS). With STORAGE_EMULATOR_HOST set, the client's own emulator mode: that endpoint,
    anonymous credentials and the project from GOOGLE_CLOUD_PROJECT. DataError beginning with `what` (what the user
    set) when google-cloud-storage is missing or no credentials are found."""
    try:
        import google.auth
        import google.auth.exceptions
        from google.cloud import storage
    except ImportError:
        raise DataError(
            f"{quoted(what)}: gs:// needs google-cloud-storage, which is not installed ({STORAGE_EXTRA})"
        ) from None
    # One client per process and environment, as for S3: finding the credentials asks the metadata server.
    key = _client_key("GOOGLE_", "GCE_", "CLOUDSDK_", "STORAGE_EMULATOR_HOST")
    if key in _CLIENTS:
        return _CLIENTS[key]
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        # anonymous: the pod's Google token never goes to a non-Google endpoint
        client = _CLIENTS[key] = storage.Client()
        return client
    try:
        credentials, project = google.auth.default()
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise DataError(
            f"{quoted(what)}: no usable Google credentials were found ({exc}): bind the pod's "
            "ServiceAccount to a Google "
            "service account (Workload Identity), or set GOOGLE_APPLICATION_CREDENTIALS"
        ) from None
    client = _CLIENTS[key] = storage.Client(project=project, credentials=credentials)
    return client


def _client_key(*prefixes: str) -> tuple[Any, ...]:
    """What a cached client depends on: this process, and the environment variables that configure it."""
    return (prefixes, os.getpid(), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))))


# --------------------------------------------------------------------------- S3


def _s3_error(uri: str, exc: Exception, client: Any, permission: str) -> DataError:
    """What a refused or failed S3 call means for `uri`, as one line; `permission` is what the call needs."""
    from botocore.exceptions import ClientError, NoCredentialsError

    endpoint = client.meta.endpoint_url
    if isinstance(exc, NoCredentialsError):
        return DataError(
            f"{quoted(uri)}: no AWS credentials were found in the environment: set "
            "cluster.secrets.aws_access_key_id/aws_secret_access_key, or give the pod a web identity (IRSA)"
        )
    if not isinstance(exc, ClientError):  # BotoCoreError: the endpoint could not be reached or answered badly
        said = " ".join(str(exc).split())
        return DataError(
            f"{quoted(uri)}: cannot reach S3 at {endpoint} ({said}); check AWS_ENDPOINT_URL and the network"
        )
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    said = f"{code}: {' '.join(str(error.get('Message', '')).split())}".rstrip(": ")
    if code == "NoSuchBucket":
        return DataError(f"{quoted(uri)}: no such bucket at {endpoint}; create it, or correct the bucket name")
    if code in S3_MISSING:
        return DataError(f"{quoted(uri)}: no such object or prefix")
    if code in S3_CHANGED:
        return DataError(
            f"{quoted(uri)}: the object changed after it was listed (its ETag is no longer the one "
            "listed): it was rewritten "
            "while the dataset was read; run again once it is complete"
        )
    if code in S3_DENIED:
        return DataError(f"{quoted(uri)}: access denied ({said}); the pod's AWS identity needs {permission}")
    if code in S3_BAD_KEYS:
        return DataError(
            f"{quoted(uri)}: the AWS credentials were refused ({said}); check the keys or the pod's web identity"
        )
    return DataError(f"{quoted(uri)}: S3 at {endpoint} refused the request ({said})")


@contextlib.contextmanager
def _s3_calls(uri: str, client: Any, permission: str) -> Iterator[None]:
    """Turn what boto3 raises inside into a DataError naming `uri`; `permission` is what the calls need."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as exc:
        raise _s3_error(uri, exc, client, permission) from None


def _s3_object(bucket: str, key: str, size: int, etag: str) -> SourceObject:
    compression, kind = _format_of(key)
    return SourceObject(f"s3://{bucket}/{key}", size, "etag:" + etag.strip('"'), compression, kind)


def _list_s3(uri: str) -> list[SourceObject]:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _split(uri)
    client = s3_client(uri)
    denied = False
    if key and not key.endswith("/") and not has_wildcards(key):
        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in S3_MISSING | S3_DENIED:
                raise _s3_error(uri, exc, client, GET_OBJECT) from None
            # S3 answers 403 for a key that may or may not exist when s3:ListBucket is not granted: list to tell
            denied = code in S3_DENIED
        except BotoCoreError as exc:
            raise _s3_error(uri, exc, client, GET_OBJECT) from None
        else:
            return [_s3_object(bucket, key, head["ContentLength"], head["ETag"])]
    cut = min((key.index(c) for c in WILDCARDS if c in key), default=None)
    prefix = key[:cut] if cut is not None else key if not key or key.endswith("/") else f"{key}/"
    listed = []
    with _s3_calls(uri, client, f"{GET_OBJECT} (and {LIST_BUCKET})" if denied else LIST_BUCKET):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            listed += page.get("Contents", [])
    if cut is not None:
        regex = glob_pattern(key)
        listed = [item for item in listed if regex.match(item["Key"])]
    found = [_s3_object(bucket, i["Key"], i["Size"], i["ETag"]) for i in listed if is_data_name(i["Key"])]
    if found:
        return found
    if cut is not None:
        raise _no_match(uri, "objects", [item["Key"] for item in listed])
    if denied and not listed:
        raise DataError(f"{quoted(uri)}: access denied (403 on HEAD); the pod's AWS identity needs {GET_OBJECT}")
    if not listed:
        raise DataError(f"{quoted(uri)}: no such object or prefix")
    raise DataError(f"{quoted(uri)}: no {SUFFIX_LIST} objects under s3://{bucket}/{prefix}")


def _s3_body(obj: SourceObject) -> tuple[Any, Any]:
    """(client, streaming body) of exactly the listed version of an S3 object."""
    bucket, key = _split(obj.uri)
    client = s3_client(obj.uri)
    with _s3_calls(obj.uri, client, GET_OBJECT):
        response = client.get_object(Bucket=bucket, Key=key, IfMatch=f'"{obj.version.removeprefix("etag:")}"')
    return client, response["Body"]


# --------------------------------------------------------------------------- GCS


def _gcs_error(uri: str, exc: Exception, client: Any) -> DataError:
    """What a refused or failed GCS call means for `uri`, as one line."""
    import google.auth.exceptions
    from google.api_core import exceptions as api

    endpoint = getattr(client, "api_endpoint", "") or "storage.googleapis.com"
    if isinstance(exc, api.RetryError) and exc.cause is not None:  # retried until its deadline: what failed last
        exc = exc.cause
    said = " ".join(str(exc).split())
    if isinstance(exc, google.auth.exceptions.GoogleAuthError):
        return DataError(
            f"{quoted(uri)}: the pod's Google credentials could not be used ({said}); check its "
            "Workload Identity binding"
        )
    if isinstance(exc, (api.Forbidden, api.Unauthorized)):
        return DataError(
            f"{quoted(uri)}: access denied ({said}); give the pod's Google service account "
            "roles/storage.objectViewer on "
            "the bucket (storage.objects.list and storage.objects.get)"
        )
    if isinstance(exc, api.GoogleAPICallError):
        return DataError(f"{quoted(uri)}: GCS at {endpoint} refused the request ({said})")
    return DataError(f"{quoted(uri)}: cannot reach GCS at {endpoint} ({type(exc).__name__}: {said}); check the network")


@contextlib.contextmanager
def _gcs_calls(uri: str, client: Any) -> Iterator[None]:
    """Turn what google-cloud-storage raises inside into a DataError naming `uri`."""
    import google.auth.exceptions
    import requests
    from google.api_core import exceptions as api

    try:
        yield
    except (
        api.GoogleAPICallError,
        api.RetryError,
        google.auth.exceptions.GoogleAuthError,
        requests.RequestException,
    ) as exc:
        raise _gcs_error(uri, exc, client) from None


def _gcs_object(bucket: str, blob: Any) -> SourceObject:
    compression, kind = _format_of(blob.name)
    return SourceObject(
        f"gs://{bucket}/{blob.name}", int(blob.size), f"generation:{blob.generation}", compression, kind
    )


def _list_gcs(uri: str) -> list[SourceObject]:
    from google.api_core import exceptions as api

    bucket, key = _split(uri)
    client = gcs_client(uri)
    if key and not key.endswith("/") and not has_wildcards(key):
        with _gcs_calls(uri, client):
            blob = client.bucket(bucket).get_blob(key)  # None for a missing object (or bucket)
        if blob is not None:
            return [_gcs_object(bucket, blob)]
    cut = min((key.index(c) for c in WILDCARDS if c in key), default=None)
    prefix = key[:cut] if cut is not None else key if not key or key.endswith("/") else f"{key}/"
    with _gcs_calls(uri, client):
        try:
            listed = list(client.list_blobs(bucket, prefix=prefix or None))
        except api.NotFound:
            raise DataError(f"{quoted(uri)}: no such bucket; create it, or correct the bucket name") from None
    if cut is not None:
        regex = glob_pattern(key)
        listed = [blob for blob in listed if regex.match(blob.name)]
    found = [_gcs_object(bucket, blob) for blob in listed if is_data_name(blob.name)]
    if found:
        return found
    if cut is not None:
        raise _no_match(uri, "objects", [blob.name for blob in listed])
    if not listed:
        raise DataError(f"{quoted(uri)}: no such object or prefix")
    raise DataError(f"{quoted(uri)}: no {SUFFIX_LIST} objects under gs://{bucket}/{prefix}")


def _gcs_reader(obj: SourceObject) -> tuple[Any, Any]:
    """(client, seekable reader) of exactly the listed generation of a GCS object."""
    bucket, name = _split(obj.uri)
    generation = int(obj.version.removeprefix("generation:"))
    client = gcs_client(obj.uri)
    with _gcs_calls(obj.uri, client):
        blob = client.bucket(bucket).get_blob(name, generation=generation)
    if blob is None or blob.generation != generation:
        raise DataError(_gcs_changed(obj))
    # raw_download: the bytes as stored, never transcoded (an object uploaded with Content-Encoding: gzip)
    return client, blob.open("rb", chunk_size=GCS_CHUNK_BYTES, raw_download=True)


def _gcs_changed(obj: SourceObject) -> str:
    return (
        f"{quoted(obj.uri)}: the object changed after it was listed ({obj.version} is gone): it was "
        "rewritten while the "
        "dataset was read; run again once it is complete"
    )


# --------------------------------------------------------------------------- streams


ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = 0x184D2A50  # the magic of a skippable frame, its low 4 bits any value


class _ZstdFrames:
    """The bytes of a zstd stream passed through unchanged while its frames are followed (their headers and block
    sizes, RFC 8878, nothing decoded): a stream that ends inside a frame is an EOFError when it ends, where
    zstandard's stream_reader would end there quietly, a truncated file read as a shorter one."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._step = "magic"  # the header being collected: magic, descriptor, block, skippable
        self._head = bytearray()
        self._want = 4  # bytes of that header
        self._skip = 0  # bytes to pass before the next header (frame header fields, block contents)
        self._checksum = False

    def read(self, size: int = -1) -> bytes:
        data = self._source.read(size)
        if not data:
            if self._step != "magic" or self._head or self._skip:
                raise EOFError("the stream ends inside a frame")
            return b""
        view, at = memoryview(data), 0
        while at < len(view):
            if self._skip:
                passed = min(self._skip, len(view) - at)
                self._skip -= passed
                at += passed
                continue
            take = min(self._want - len(self._head), len(view) - at)
            self._head += view[at : at + take]
            at += take
            if len(self._head) == self._want:
                self._header(int.from_bytes(self._head, "little"))
                self._head.clear()
        return data

    def _header(self, value: int) -> None:
        """Take a complete header: what follows it, and the next header to collect."""
        if self._step == "magic":
            if value == ZSTD_MAGIC:
                self._step, self._want = "descriptor", 1
            elif value & ~0xF == ZSTD_SKIPPABLE:
                self._step, self._want = "skippable", 4
            else:
                raise EOFError("no zstd frame starts here (a file of another format, or garbage after the data)")
        elif self._step == "descriptor":
            single_segment = value >> 5 & 1
            self._checksum = bool(value >> 2 & 1)
            window = 0 if single_segment else 1
            dictionary = (0, 1, 2, 4)[value & 3]
            content_size = (single_segment, 2, 4, 8)[value >> 6]
            self._skip = window + dictionary + content_size
            self._step, self._want = "block", 3
        elif self._step == "block":
            last, kind, size = value & 1, value >> 1 & 3, value >> 3
            self._skip = 1 if kind == 1 else size  # an RLE block stores its one byte
            if last:
                self._skip += 4 if self._checksum else 0
                self._step, self._want = "magic", 4
        else:  # skippable: its length, then its bytes
            self._skip = value
            self._step, self._want = "magic", 4


class _Zstd(io.RawIOBase):
    """The decompressed bytes of a zstd stream of one or more frames, at most the size of the buffer per read (a
    small input can decompress to gigabytes, which are never held at once); a stream that ends inside a frame is
    an error (`_ZstdFrames`)."""

    def __init__(self, source: Any) -> None:
        import zstandard

        self._reader = zstandard.ZstdDecompressor().stream_reader(
            _ZstdFrames(source), read_size=READ_BYTES, read_across_frames=True, closefd=False
        )

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._reader.readinto(buffer)


class _Guarded(io.RawIOBase):
    """A readable (and, over a seekable source, seekable) stream whose failures are DataErrors naming its object:
    a connection lost, an object changed mid-read, data that does not decompress."""

    def __init__(self, source: Any, obj: SourceObject, closers: list[Any], cap: int | None = None) -> None:
        self._source = source
        self._obj = obj
        self._closers = closers
        self._cap = cap  # the most bytes it may give (a decompressed stream: `inflation_cap`)
        self._given = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(getattr(self._source, "seekable", lambda: False)())

    def readinto(self, buffer: Any) -> int:
        with self._failures():
            data = self._source.read(len(buffer))
        self._given += len(data)
        if self._cap is not None and self._given > self._cap:
            raise inflation_error(self._obj.uri, self._obj.size, self._cap)
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        with self._failures():
            return self._source.seek(offset, whence)

    def tell(self) -> int:
        with self._failures():
            return self._source.tell()

    def close(self) -> None:
        if not self.closed:
            for closer in self._closers:
                with contextlib.suppress(Exception):  # a broken connection cannot close cleanly; nothing is lost
                    closer.close()
        super().close()

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        uri = self._obj.uri
        try:
            yield
        except DataError:
            raise
        except (EOFError, gzip.BadGzipFile) as exc:
            raise DataError(
                f"{quoted(uri)}: not valid {self._obj.compression} data ({exc}); is the file complete?"
            ) from None
        except OSError as exc:
            if self._obj.path is None:  # requests' errors are OSErrors: a store's connection
                raise _read_error(self._obj, exc) from None
            raise DataError(
                f"{quoted(uri)}: cannot be read ({exc.strerror or exc}); check the file and its permissions"
            ) from None
        except Exception as exc:
            raise _read_error(self._obj, exc) from None


def _read_error(obj: SourceObject, exc: Exception) -> DataError:
    """A failure while an object's bytes are read, as one line naming the object."""
    said = " ".join(str(exc).split())
    kind = type(exc).__name__
    if kind == "ZstdError":
        return DataError(f"{quoted(obj.uri)}: not valid zstd data ({said}); is the file complete?")
    if kind == "NotFound" and obj.version.startswith("generation:"):
        return DataError(_gcs_changed(obj))
    return DataError(f"{quoted(obj.uri)}: reading failed midway ({kind}: {said}); the connection to the store broke")


def _raw(obj: SourceObject) -> tuple[Any, list[Any]]:
    """The stored bytes of an object as a readable stream, and what to close after it."""
    if obj.uri.startswith("s3://"):
        _, body = _s3_body(obj)
        return body, [body]
    if obj.uri.startswith("gs://"):
        _, reader = _gcs_reader(obj)
        return reader, [reader]
    path = obj.path or Path(obj.uri)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed with the stream that reads it
    except OSError as exc:
        raise DataError(
            f"{quoted(obj.uri)}: cannot be read ({exc.strerror or exc}); check the file and its permissions"
        ) from None
    return f, [f]


@contextlib.contextmanager
def open_stream(obj: SourceObject) -> Iterator[BinaryIO]:
    """The decompressed bytes of a JSONL object, as a binary file object that can be read line by line. Remote
    bodies are streamed (never held whole), pinned to the listed version; a failure while reading is a DataError
    naming the object, and so is a compressed object that decompresses to more than `inflation_cap` of its size."""
    cap = inflation_cap(obj.size) if obj.compression else None
    source, closers = _raw(obj)
    if obj.compression == "gzip":
        source = gzip.GzipFile(fileobj=source, mode="rb")
        closers.insert(0, source)
    elif obj.compression == "zstd":
        try:
            source = _Zstd(source)
        except ImportError:
            for closer in closers:
                closer.close()
            raise DataError(f"{quoted(obj.uri)}: reading .zst needs zstandard (pip install zstandard)") from None
    stream = io.BufferedReader(_Guarded(source, obj, closers, cap), buffer_size=READ_BYTES)
    try:
        yield stream
    finally:
        stream.close()


@contextlib.contextmanager
def open_parquet(obj: SourceObject, staging_dir: Path) -> Iterator[pyarrow.parquet.ParquetFile]:
    """A Parquet object opened with pyarrow: local files directly, a GCS blob through its seekable reader, an S3
    object downloaded once into staging_dir (removed on exit). pyarrow reads a file's footer first and then its
    columns, out of order, which an S3 body (one forward-only stream) cannot serve. A file whose footer declares
    more data than `inflation_cap` of its size is refused before any of it is read."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{quoted(obj.uri)}: reading Parquet needs pyarrow (pip install pyarrow), which is not installed"
        ) from None
    staged: Path | None = None
    closers: list[Any] = []
    try:
        if obj.uri.startswith("s3://"):
            staged = _stage_s3(obj, staging_dir)
            source: Any = staged
        elif obj.uri.startswith("gs://"):
            _, reader = _gcs_reader(obj)
            source = _Guarded(reader, obj, [reader])
            closers.append(source)
        else:
            source = obj.path or Path(obj.uri)
        try:
            parquet = pq.ParquetFile(source)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{quoted(obj.uri)}: not a readable Parquet file ({' '.join(str(exc).split())})") from None
        closers.insert(0, parquet)
        meta = parquet.metadata
        declared = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if declared > inflation_cap(obj.size):
            raise inflation_error(obj.uri, obj.size, inflation_cap(obj.size))
        yield parquet
    finally:
        for closer in closers:
            closer.close()
        if staged is not None:
            staged.unlink(missing_ok=True)


def _stage_s3(obj: SourceObject, staging_dir: Path) -> Path:
    """The listed version of an S3 object, copied into a file of `staging_dir` a chunk at a time."""
    staging_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=staging_dir, prefix=".s3-", suffix=".parquet")
    staged = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            body, closers = _raw(obj)
            with io.BufferedReader(_Guarded(body, obj, closers), buffer_size=READ_BYTES) as stream:
                for chunk in iter(lambda: stream.read(READ_BYTES), b""):
                    out.write(chunk)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return staged
