"""A data URI's raw rows: files and buckets (stages.sources), hub datasets, builtin data, with the inputs' fingerprints.

The rows come unparsed where they are JSONL lines (`stages.data.parse_row` parses them, in prepare's workers) and
within the bounds of `stages.data` (row size, inflation); where data may be read from is `stages.data.confine`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from run.config_hash import canonical_hash
from spec.data import DataSpec
from spec.pipeline import PipelineSpec
from spec.quoting import quoted
from stages.data import (
    DataError,
    RawRow,
    SourceFile,
    max_inflation,
    max_row_bytes,
    sha256_file,
    sha256_rows,
)

HUB_PREFIXES = ("hf://datasets/", "hf://")
"""A hub dataset's URI: hf://datasets/<org>/<name> (as huggingface_hub writes it), or the short hf://<org>/<name>."""


def hub_name(uri: str) -> str:
    """The repository id of a hub dataset URI."""
    for prefix in HUB_PREFIXES:
        if uri.startswith(prefix):
            return uri.removeprefix(prefix).strip("/")
    return uri


def read_hub(uri: str, split: str, revision: str | None = None) -> tuple[list[SourceFile], Iterator[RawRow]]:
    """Rows of a hub dataset (split `split`, at `revision`: a commit pins them), through `datasets`: downloaded
    once into HF_HOME (on the checkpoints volume in the cluster, with HF_TOKEN from cluster.secrets.hf_token) and
    read from its memory-mapped Arrow files, never whole into memory."""
    name = hub_name(uri)
    at = f" at revision {revision!r}" if revision else ""
    try:
        import datasets

        hub = datasets.load_dataset(name, split=split, revision=revision)
    except ImportError:
        raise DataError(f"{quoted(uri)}: reading hub datasets needs the 'datasets' package") from None
    except Exception as exc:  # offline, gated, missing: datasets raises many kinds
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        hint = " (this machine is offline: HF_HUB_OFFLINE is set)" if offline else ""
        raise DataError(
            f"{quoted(uri)}: could not load split {split!r}{at} from the Hugging Face hub{hint}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}. Without network access, download the dataset to "
            "the datasets volume and use its path instead."
        ) from None
    described = {"name": name, "split": split, "fp": hub._fingerprint, **({"revision": revision} if revision else {})}
    source = SourceFile(uri, "hf:" + canonical_hash(described))
    display = f"{quoted(uri)}[{split}]"
    return [source], (RawRow(display, i, value=row) for i, row in enumerate(hub, start=1))


def read_builtin(uri: str) -> tuple[list[SourceFile], Iterator[RawRow]]:
    """Rows of a builtin dataset `builtin:<name>`, numbered from 1."""
    from stages.builtin_data import BuiltinDataError, builtin_dataset

    try:
        rows = builtin_dataset(uri.removeprefix("builtin:"))
    except BuiltinDataError as exc:
        raise DataError(f"{quoted(uri)}: {exc}") from None
    return [SourceFile(uri, sha256_rows(rows))], (RawRow(uri, i, value=r) for i, r in enumerate(rows, start=1))


def read_source(
    uri: str,
    data: DataSpec,
    spec: PipelineSpec | None = None,
    run_root: Path | None = None,
    staging: Path | None = None,
) -> tuple[list[SourceFile], Iterator[RawRow]]:
    """The inputs of a data URI and an iterator over its raw rows: a JSONL line comes unparsed (`RawRow.raw`,
    parsed by `parse_row`, in a worker), other sources parsed. The inputs' fingerprints are complete once the
    rows are: a local file's content is hashed as it is read, a stored object is named by its version (etag or
    generation) and size. `run_root` (the run directory) tells whether the cluster's rule for data paths
    applies (see `confine`); `staging` is where a Parquet object from S3 is downloaded while it is read."""
    if uri.startswith("builtin:"):
        return read_builtin(uri)
    if uri.startswith("hf://"):
        return read_hub(uri, data.split, data.revision)
    from stages.file_formats import hashed_as_read, object_rows
    from stages.sources import list_objects

    limit = max_row_bytes()
    max_inflation()  # a bad $POSTTRAIN_MAX_INFLATION fails here, before anything is read
    objects = list_objects(uri, spec, run_root)
    sources = [SourceFile(o.uri, "") for o in objects]

    def rows() -> Iterator[RawRow]:
        for obj, source in zip(objects, sources, strict=True):
            count = 0
            digest = hashlib.sha256() if hashed_as_read(obj) else None
            for row in object_rows(obj, limit, data.encoding, staging or Path(tempfile.gettempdir()), digest):
                count += 1
                yield row
            if digest is not None:
                source.fingerprint = f"sha256:{digest.hexdigest()}"
            elif obj.version:
                source.fingerprint = f"{obj.version}:size={obj.size}"
            else:
                source.fingerprint = sha256_file(obj.path)  # type: ignore[arg-type]
            if count == 0:
                raise DataError(f"{quoted(obj.uri)}: empty file: no rows (an export that failed?)")

    return sources, rows()
