"""Data sources: the files a data URI names, listed from local disk, S3 and GCS, and read back as byte streams.

Remote stores are moto's S3 server and a GCS emulator on 127.0.0.1 (tests/object_stores.py), reached by the real
boto3 and google-cloud-storage clients configured only through the environment, as in a pod; a proxy in front of
them plays the failures a store or a network has (a 403, a connection cut mid-body, an object gone mid-read)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from object_stores import GcsEmulator, MotoS3, faulty_proxy

from spec.data import DataSpec
from spec.loading import load_pipeline
from stages import sources
from stages.data import DataError, parse_row
from stages.source_rows import read_source
from stages.sources import SUFFIX_LIST, SourceObject, list_objects, open_parquet, open_stream, s3_client

REPO = Path(__file__).resolve().parents[1]

CLOUD_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_DEFAULT_REGION", "AWS_REGION", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
    "STORAGE_EMULATOR_HOST",
)  # fmt: skip
SUFFIXES = SUFFIX_LIST.replace(".", r"\.")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Cloud credentials come only from what a test sets: none from this machine's files or metadata services.
    for name in CLOUD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def rows(name: str, n: int) -> list[bytes]:
    """n JSONL lines of Korean text rows, each distinct."""
    return [
        json.dumps({"text": f"{name} 문서 {i}: 서울은 아름답습니다."}, ensure_ascii=False).encode() + b"\n"
        for i in range(n)
    ]


def zstd_frames(*parts: bytes) -> bytes:
    """One zstd frame per part, concatenated, as pzstd and streaming writers produce."""
    return b"".join(zstandard.ZstdCompressor().compress(part) for part in parts)


def parquet_bytes(texts: list[str]) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), out)
    return out.getvalue()


def read_lines(obj: SourceObject) -> list[bytes]:
    with open_stream(obj) as stream:
        return list(stream)


# --------------------------------------------------------------------------- local files


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A corpus folder as exports leave it: data files at two levels, compressed and not, and files of other kinds."""
    root = tmp_path / "corpus"
    (root / "2026-11").mkdir(parents=True)
    (root / "a.jsonl").write_bytes(b"".join(rows("a", 3)))
    (root / "b.jsonl.gz").write_bytes(gzip.compress(b"".join(rows("b", 3))))
    (root / "2026-11" / "part-0.jsonl.zst").write_bytes(zstd_frames(*rows("c", 2)))
    (root / "2026-11" / "part-1.parquet").write_bytes(parquet_bytes(["p0", "p1"]))
    (root / "README.md").write_text("# corpus\n", encoding="utf-8")
    (root / "2026-11" / "_SUCCESS").write_bytes(b"")
    return root


def test_a_directory_lists_its_data_files_at_every_level_sorted(corpus: Path) -> None:
    objects = list_objects(str(corpus))
    assert [o.uri for o in objects] == [
        f"{corpus}/2026-11/part-0.jsonl.zst",
        f"{corpus}/2026-11/part-1.parquet",
        f"{corpus}/a.jsonl",
        f"{corpus}/b.jsonl.gz",
    ]
    assert [(o.compression, o.kind) for o in objects] == [("zstd", "jsonl"), ("", "parquet"), ("", "jsonl"),
                                                           ("gzip", "jsonl")]  # fmt: skip
    for o in objects:
        assert o.path == Path(o.uri) and o.size == o.path.stat().st_size and o.version == ""
    assert list_objects(f"file://{corpus}/") == list_objects(str(corpus))


def test_a_local_glob_matches_within_a_segment_and_across_with_double_star(corpus: Path) -> None:
    def uris(pattern: str) -> list[str]:
        return [o.uri.removeprefix(f"{corpus}/") for o in list_objects(f"{corpus}/{pattern}")]

    assert uris("*.jsonl*") == ["a.jsonl", "b.jsonl.gz"]  # not the files a level down
    assert uris("**/part-*") == ["2026-11/part-0.jsonl.zst", "2026-11/part-1.parquet"]
    assert uris("**/*.jsonl") == ["a.jsonl"]  # `**/` includes no folder at all
    assert uris("2026-1?/part-[!1].*") == ["2026-11/part-0.jsonl.zst"]
    assert uris("[ab].jsonl*") == ["a.jsonl", "b.jsonl.gz"]
    with pytest.raises(
        DataError, match=rf"^{corpus}/\*\.md: the pattern matches no {SUFFIXES} files, only README\.md$"
    ):
        list_objects(f"{corpus}/*.md")
    with pytest.raises(DataError, match=rf"^{corpus}/nowhere/\*\.jsonl: the pattern matches nothing: .* not a dir"):
        list_objects(f"{corpus}/nowhere/*.jsonl")


def test_compressed_files_read_back_line_by_line(corpus: Path) -> None:
    long = rows("long", 40_000)  # several MiB: lines cross every read of the store and of the decompressor
    (corpus / "long.jsonl.gz").write_bytes(gzip.compress(b"".join(long)))
    (corpus / "long.jsonl.zst").write_bytes(zstd_frames(b"".join(long[:25_000]), b"".join(long[25_000:])))
    by_name = {Path(o.uri).name: o for o in list_objects(str(corpus))}
    assert read_lines(by_name["a.jsonl"]) == rows("a", 3)
    assert read_lines(by_name["b.jsonl.gz"]) == rows("b", 3)
    assert read_lines(by_name["part-0.jsonl.zst"]) == rows("c", 2)  # one frame per line
    assert read_lines(by_name["long.jsonl.gz"]) == long
    assert read_lines(by_name["long.jsonl.zst"]) == long
    with open_parquet(by_name["part-1.parquet"], corpus / "staging") as parquet:
        assert parquet.read().column("text").to_pylist() == ["p0", "p1"]


def test_a_truncated_or_corrupt_compressed_file_is_named(tmp_path: Path) -> None:
    data = b"".join(rows("t", 2000))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(data)[:-100])
    (tmp_path / "cut.jsonl.zst").write_bytes(zstd_frames(data)[:-100])  # zstandard's stream_reader would end quietly
    (tmp_path / "plain.jsonl.gz").write_bytes(data)
    for name, said in [("cut.jsonl.gz", "not valid gzip data"), ("cut.jsonl.zst", "not valid zstd data"),
                       ("plain.jsonl.gz", "not valid gzip data")]:  # fmt: skip
        [obj] = list_objects(str(tmp_path / name))
        with pytest.raises(DataError, match=rf"^{tmp_path}/{name}: {said} \(.*\); is the file complete\?$"):
            read_lines(obj)


def test_the_rules_of_local_paths_are_kept(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file or directory$"):
        list_objects(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x", encoding="utf-8")
    with pytest.raises(DataError, match=rf"empty: the directory has no {SUFFIXES} files$"):
        list_objects(str(tmp_path / "empty"))
    named = tmp_path / "export.txt"  # named exactly: read whatever its name, as JSONL
    named.write_bytes(b"".join(rows("n", 1)))
    [obj] = list_objects(str(named))
    assert (obj.kind, obj.compression) == ("jsonl", "") and read_lines(obj) == rows("n", 1)
    for name, kind in {
        "a.json": ("json", ""),
        "b.csv.gz": ("csv", "gzip"),
        "c.tsv": ("tsv", ""),
        "d.arrow": ("arrow", ""),
    }.items():
        (tmp_path / name).write_bytes(b"x")
        [obj] = list_objects(str(tmp_path / name))
        assert (obj.kind, obj.compression) == kind
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "a.jsonl").write_bytes(b"".join(rows("a", 1)))
    (tmp_path / "loop" / "x-1.jsonl").symlink_to("x-2.jsonl")
    (tmp_path / "loop" / "x-2.jsonl").symlink_to("x-1.jsonl")
    for uri in (tmp_path / "loop", tmp_path / "loop" / "x-*.jsonl"):
        with pytest.raises(DataError, match=r"loop/x-[12]\.jsonl: a symlink loop"):
            list_objects(str(uri))
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "moved-away.jsonl")
    with pytest.raises(DataError, match=r"dangling\.jsonl is a symlink to .*moved-away\.jsonl, which does not exist"):
        list_objects(str(dangling))
    (tmp_path / "names").mkdir()
    (tmp_path / "names" / os.fsdecode(b"caf\xe9.jsonl")).write_bytes(b"".join(rows("n", 1)))
    for uri in (tmp_path / "names", tmp_path / "names" / "*.jsonl"):
        with pytest.raises(DataError, match=r"caf\\udce9\.jsonl: the file name is not valid UTF-8"):
            list_objects(str(uri))


@pytest.fixture
def volumes(tmp_path: Path) -> tuple[Path, Path]:
    """A datasets and a checkpoints 'mount' under tmp_path, with a corpus on the datasets one and a file outside."""
    datasets, checkpoints = tmp_path / "mnt" / "datasets", tmp_path / "mnt" / "checkpoints"
    (datasets / "corpus").mkdir(parents=True)
    (datasets / "corpus" / "part-0.jsonl").write_bytes(b"".join(rows("a", 1)))
    (checkpoints / "runs").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.jsonl").write_text('{"text": "not yours"}\n', encoding="utf-8")
    return datasets, checkpoints


def test_in_the_cluster_a_glob_reads_only_the_volumes(volumes: tuple[Path, Path], tmp_path: Path) -> None:
    datasets, checkpoints = volumes
    overrides = [f"cluster.datasets.mount_path={datasets}", f"cluster.checkpoints.mount_path={checkpoints}"]
    spec = load_pipeline("korean-llm", "local", overrides).spec
    run_root = checkpoints / "runs" / "korean-llm-abcde"  # where every compiled workflow's run directory is
    with pytest.raises(DataError, match=r"outside the mounted volumes; in the cluster data is read only from"):
        list_objects(f"{tmp_path}/outside/*.jsonl", spec, run_root)
    assert len(list_objects(f"{tmp_path}/outside/*.jsonl", spec, tmp_path / "runs" / "local")) == 1  # locally: any
    claim = spec.cluster.datasets.claim_name
    [obj] = list_objects(f"pvc://{claim}/corpus/part-*.jsonl", spec, run_root)
    assert obj.path == datasets / "corpus" / "part-0.jsonl"
    (datasets / "corpus" / "part-1.jsonl").symlink_to(tmp_path / "outside" / "secret.jsonl")
    with pytest.raises(DataError, match=r"part-1\.jsonl is a symlink to .*secret\.jsonl, outside .*corpus; copy"):
        list_objects(f"pvc://{claim}/corpus/part-*.jsonl", spec, run_root)


def test_hub_and_builtin_datasets_are_no_store_of_files() -> None:
    for uri in ("hf://databricks/databricks-dolly-15k", "builtin:korean-corpus"):
        with pytest.raises(DataError, match=rf"^{uri}: not a store of files"):
            list_objects(uri)


# --------------------------------------------------------------------------- S3


CORPUS = {
    "corpus/part-0.jsonl.gz": gzip.compress(b"".join(rows("s0", 5))),
    "corpus/part-1.jsonl.zst": zstd_frames(*rows("s1", 5)),
    "corpus/sub/part-2.parquet": parquet_bytes(["q0", "q1", "q2"]),
    "corpus/_SUCCESS": b"",
    "corpus-old/x.jsonl": b"".join(rows("old", 1)),
    "raw-export": b"".join(rows("raw", 2)),
}


def put(store: MotoS3 | GcsEmulator, bucket: str, objects: dict[str, bytes], create: bool = True) -> None:
    """Upload `objects` (key → bytes) to a store, creating the bucket first unless told it is there."""
    if create:
        store.create_bucket(bucket)
    for key, data in objects.items():
        if isinstance(store, MotoS3):
            store.client().put_object(Bucket=bucket, Key=key, Body=data)
        else:
            store.client().bucket(bucket).blob(key).upload_from_string(data)


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest) -> MotoS3 | GcsEmulator:
    """Each object store in turn, empty, with the environment pointing at it."""
    return request.getfixturevalue({"s3": "s3", "gs": "gcs"}[request.param])


def test_a_key_a_prefix_and_a_glob_list_the_data_objects(store: MotoS3 | GcsEmulator) -> None:
    put(store, "data", CORPUS)
    scheme = store.scheme

    def keys(uri: str) -> list[str]:
        return [o.uri.removeprefix(f"{scheme}://data/") for o in list_objects(uri)]

    parts = ["corpus/part-0.jsonl.gz", "corpus/part-1.jsonl.zst", "corpus/sub/part-2.parquet"]
    assert keys(f"{scheme}://data/corpus") == keys(f"{scheme}://data/corpus/") == parts  # not corpus-old/
    assert keys(f"{scheme}://data/corpus/part-*") == parts[:2]
    assert keys(f"{scheme}://data/**/part-*") == parts
    assert keys(f"{scheme}://data/corpus/*/part-?.parquet") == parts[2:]
    assert keys(f"{scheme}://data") == ["corpus-old/x.jsonl", *parts]
    [one] = list_objects(f"{scheme}://data/corpus/part-0.jsonl.gz")
    assert (one.size, one.compression, one.kind, one.path) == (len(CORPUS[parts[0]]), "gzip", "jsonl", None)
    if isinstance(store, MotoS3):
        etag = store.client().head_object(Bucket="data", Key=parts[0])["ETag"].strip('"')
        assert one.version == f"etag:{etag}"
    else:
        generation = store.client().bucket("data").get_blob(parts[0]).generation
        assert one.version == f"generation:{generation}"
    [raw] = list_objects(f"{scheme}://data/raw-export")  # named exactly: read whatever its name, as JSONL
    assert (raw.kind, raw.compression) == ("jsonl", "") and read_lines(raw) == rows("raw", 2)


def test_remote_objects_read_back_line_by_line(store: MotoS3 | GcsEmulator, tmp_path: Path) -> None:
    long = rows("long", 40_000)  # several MiB: lines cross the store's reads and the decompressor's
    put(store, "data", {**CORPUS, "big/long.jsonl.gz": gzip.compress(b"".join(long)),
                        "big/long.jsonl.zst": zstd_frames(b"".join(long[:9_999]), b"".join(long[9_999:]))})  # fmt: skip
    by_key = {o.uri.split("/", 3)[3]: o for o in list_objects(f"{store.scheme}://data/")}
    assert read_lines(by_key["corpus/part-0.jsonl.gz"]) == rows("s0", 5)
    assert read_lines(by_key["corpus/part-1.jsonl.zst"]) == rows("s1", 5)
    assert read_lines(by_key["big/long.jsonl.gz"]) == long
    assert read_lines(by_key["big/long.jsonl.zst"]) == long
    staging = tmp_path / "staging"
    with open_parquet(by_key["corpus/sub/part-2.parquet"], staging) as parquet:
        assert parquet.read().column("text").to_pylist() == ["q0", "q1", "q2"]
        assert [b.num_rows for b in parquet.iter_batches(batch_size=2)] == [2, 1]
    assert not staging.exists() or list(staging.iterdir()) == []  # an S3 copy is removed on exit


def test_an_object_replaced_after_listing_is_refused(store: MotoS3 | GcsEmulator, tmp_path: Path) -> None:
    put(store, "data", CORPUS)
    listed = {o.uri.split("/", 3)[3]: o for o in list_objects(f"{store.scheme}://data/corpus")}
    put(store, "data", {"corpus/part-0.jsonl.gz": gzip.compress(b"".join(rows("new", 5))),
                        "corpus/sub/part-2.parquet": parquet_bytes(["new"])}, create=False)  # fmt: skip
    for key in ("corpus/part-0.jsonl.gz", "corpus/sub/part-2.parquet"):
        uri = f"{store.scheme}://data/{key}"
        with pytest.raises(DataError, match=rf"^{uri}: the object changed after it was listed .* run again once"):
            if key.endswith(".parquet"):
                with open_parquet(listed[key], tmp_path / "staging"):
                    pass
            else:
                read_lines(listed[key])
    assert read_lines(listed["corpus/part-1.jsonl.zst"]) == rows("s1", 5)  # the unchanged ones read as listed


def test_what_a_uri_names_not_is_said(store: MotoS3 | GcsEmulator) -> None:
    put(store, "data", {"corpus/_SUCCESS": b"", "corpus/notes.txt": b"x"})
    s = store.scheme
    cases = [
        (f"{s}://no-such-bucket/corpus/", r"no such bucket"),
        (f"{s}://data/missing.jsonl", r"no such object or prefix$"),
        (f"{s}://data/missing/", r"no such object or prefix$"),
        (f"{s}://data/corpus", rf"no {SUFFIXES} objects under {s}://data/corpus/$"),
        (f"{s}://data/corpus/*.jsonl", rf"the pattern matches no {SUFFIXES} objects$"),
        (f"{s}://data/corpus/*", rf"the pattern matches no {SUFFIXES} objects, only corpus/_SUCCESS, corpus/notes"),
        (f"{s}:///corpus", rf"names no bucket; use {s}://<bucket>/"),
    ]
    for uri, said in cases:
        with pytest.raises(DataError, match=rf"^{re.escape(uri)}: {said}"):
            list_objects(uri)


def test_s3_access_denied_names_the_permission_the_pod_needs(s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    put(s3, "data", CORPUS)
    [listed] = list_objects("s3://data/corpus/part-0.jsonl.gz")
    with s3.no_access_keys() as keys:
        for name, value in keys.items():
            monkeypatch.setenv(name, value)
        both = r"s3:GetObject on it \(and s3:ListBucket on the bucket\)"  # HEAD's 403 may hide a missing key
        for uri, needs in [
            ("s3://data/corpus/", "s3:ListBucket on the bucket"),
            ("s3://data/corpus/part-0.jsonl.gz", both),
        ]:
            said = rf"^{uri}: access denied \(AccessDenied: Access Denied\); the pod's AWS identity needs {needs}$"
            with pytest.raises(DataError, match=said) as denied:
                list_objects(uri)
            assert keys["AWS_SECRET_ACCESS_KEY"] not in str(denied.value)
    with s3.keys_allowed("lister", ["s3:ListBucket"]) as keys:  # may list, may not read
        for name, value in keys.items():
            monkeypatch.setenv(name, value)
        uri = "s3://data/corpus/part-0.jsonl.gz"
        with pytest.raises(DataError, match=rf"^{uri}: access denied .*needs s3:GetObject on it$"):
            list_objects(uri)
        with pytest.raises(DataError, match=rf"^{uri}: access denied \(AccessDenied: .*needs s3:GetObject on it$"):
            read_lines(listed)


def test_s3_without_credentials_boto3_or_a_reachable_endpoint_says_what_to_set(
    s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(DataError, match=r"^s3://data/x\.jsonl: no AWS credentials were found in the environment: "
                       r"set cluster\.secrets\.aws_access_key_id/aws_secret_access_key, or .* \(IRSA\)$"):  # fmt: skip
        list_objects("s3://data/x.jsonl")
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(DataError, match=r"^s3://data/x\.jsonl: cannot reach S3 at http://127\.0\.0\.1:9 \(.*\); check"):
        list_objects("s3://data/x.jsonl")
    monkeypatch.setitem(sys.modules, "boto3", None)  # not installed
    with pytest.raises(DataError, match=r"^s3://data/x\.jsonl: s3:// needs boto3, .*posttrain\[storage\]"):
        list_objects("s3://data/x.jsonl")


def test_a_connection_lost_mid_body_fails_the_read_naming_the_object(
    s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(s3, "data", {"big.jsonl.gz": gzip.compress(os.urandom(1 << 20))})  # incompressible: the body is 1 MiB
    [obj] = list_objects("s3://data/big.jsonl.gz")
    with faulty_proxy(s3.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.cut_after = 300_000
        lost = r"^s3://data/big\.jsonl\.gz: reading failed midway \(.*\)"
        with pytest.raises(DataError, match=lost), open_stream(obj) as stream:
            for _ in stream:
                pass


def test_an_s3_compatible_endpoint_by_host_name_is_addressed_path_style(
    s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MinIO and Ceph RGW behind a Service name serve `<endpoint>/<bucket>/<key>`: a virtual-hosted address
    (`<bucket>.minio.svc`) does not resolve. botocore chooses path style for a custom endpoint by itself."""
    put(s3, "data", CORPUS)
    endpoint = s3.endpoint.replace("127.0.0.1", "localhost")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    sent: list[str] = []
    client = s3_client("s3://data")
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    client.list_objects_v2(Bucket="data", Prefix="corpus/")
    assert sent and re.match(rf"{re.escape(endpoint)}/data/?\?list-type=2", sent[0]), sent
    assert len(list_objects("s3://data/corpus/")) == 3


# --------------------------------------------------------------------------- GCS


def test_gcs_access_denied_names_the_role_the_pod_needs(gcs: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    put(gcs, "data", CORPUS)
    denied = {"error": {"code": 403, "message": "posttrain-runner@p.iam.gserviceaccount.com does not have "
                        "storage.objects.list access to the Google Cloud Storage bucket."}}  # fmt: skip
    with faulty_proxy(gcs.endpoint) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        proxy.refuse = (403, denied)
        said = r"give the pod's Google service account roles/storage\.objectViewer on the bucket"
        for uri in ("gs://data/corpus/", "gs://data/corpus/part-0.jsonl.gz"):
            with pytest.raises(
                DataError, match=rf"^{uri}: access denied \(403 .*storage\.objects\.list access.*\); {said}"
            ):
                list_objects(uri)


def test_a_gcs_read_is_pinned_to_the_listed_generation_and_fails_when_it_goes(
    gcs: GcsEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = rows("long", 40_000)
    monkeypatch.setattr(sources, "GCS_CHUNK_BYTES", 1 << 20)  # several requests, each for the listed generation
    with faulty_proxy(gcs.endpoint) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        # uploaded through the proxy: the emulator keeps the object's download link (mediaLink) as first served
        put(GcsEmulator(proxy.endpoint), "data", {"long.jsonl": b"".join(long)})
        [obj] = list_objects("gs://data/long.jsonl")
        assert read_lines(obj) == long
        downloads = [r for r in proxy.requests if "alt=media" in r]
        assert len(downloads) > 3 and all(obj.version.replace(":", "=") in r for r in downloads), downloads
        gone = {"error": {"code": 404, "message": "No such object: data/long.jsonl"}}
        changed = r"^gs://data/long\.jsonl: the object changed after it was listed"
        with pytest.raises(DataError, match=changed), open_stream(obj) as stream:
            next(stream)
            proxy.refuse = (404, gone)  # the generation was replaced (and not kept) while it was read
            for _ in stream:
                pass


def test_gcs_without_credentials_or_the_library_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    with pytest.raises(DataError, match=r"^gs://data/x\.jsonl: no usable Google credentials were found .*Workload"):
        list_objects("gs://data/x.jsonl")
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
    monkeypatch.delattr("google.cloud.storage", raising=False)  # imported by the tests above
    with pytest.raises(DataError, match=r"^gs://data/x\.jsonl: gs:// needs google-cloud-storage, .*posttrain\[storage"):
        list_objects("gs://data/x.jsonl")


def test_prepare_reads_a_bucket_and_records_the_versions_it_read(
    store: MotoS3 | GcsEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole stage on a bucket prefix: rows of every shard (gz, zst, parquet), the objects as inputs with
    their version and size, and the same rows as from the files on a volume."""
    from run.run_dir import RunDir
    from stages.contract import StageContext
    from stages.prepare import run

    put(store, "data", CORPUS)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    off = [f"stages.{s}.enabled=false" for s in ("sft", "rlhf", "evaluate", "deploy")]
    spec = load_pipeline(
        "korean-llm",
        "local",
        ["tracking.wandb_project=null", *off, f"stages.cpt.data.uri={store.scheme}://data/corpus/"],
    ).spec
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_spec(spec)
    assert run(StageContext(run_dir, "prepare", spec)) == 0, run_dir.read_result("prepare").message
    result = run_dir.read_result("prepare")
    counts = result.extra["data"]["cpt"]
    assert counts["read_rows"] == 13 and counts["rows"] == 13
    inputs = {ref.uri: ref.fingerprint for ref in result.inputs.values()}
    version = "etag:" if isinstance(store, MotoS3) else "generation:"
    for key in ("corpus/part-0.jsonl.gz", "corpus/part-1.jsonl.zst", "corpus/sub/part-2.parquet"):
        uri = f"{store.scheme}://data/{key}"
        assert inputs[uri].startswith(version) and inputs[uri].endswith(f":size={len(CORPUS[key])}")
    data = run_dir.stage_dir("prepare") / "data" / "cpt"
    texts = [json.loads(line)["text"] for split in ("train", "eval") for line in (data / f"{split}.jsonl").open()]
    expected = [json.loads(r)["text"] for r in rows("s0", 5) + rows("s1", 5)]
    assert sorted(texts) == sorted([*expected, "q0", "q1", "q2"])
    assert not list(data.glob(".staging/*"))  # the S3 parquet copy is gone


# --------------------------------------------------------------------------- decompression bombs

BOMB_BYTES = 128 << 20
"""What a bomb inflates to: a single line of one byte, over the row limit and over INFLATION_FLOOR_BYTES."""

READ_IN_A_CHILD = """
import resource, sys
from stages.data import DataError, parse_row
from stages.source_rows import read_source
from spec.data import DataSpec
uri = sys.argv[1]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    for raw in read_source(uri, DataSpec.model_validate({"uri": uri, "format": "text"}))[1]:
        if (row := parse_row(raw, 4 << 20, "utf-8")).error:
            print(row.error)
except DataError as exc:
    print(exc)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)  # KiB -> MiB
"""


def compressed(path: Path, chunks: Iterator[bytes], frame_bytes: int = 0) -> Path:
    """`chunks` compressed into `path` (.gz or .zst) as they come, never held whole; `frame_bytes`: a zstd frame
    per that many bytes (as pzstd writes)."""
    with open(path, "wb") as out:
        if path.suffix == ".gz":
            gz = zlib.compressobj(1, zlib.DEFLATED, 31)
            out.writelines(gz.compress(chunk) for chunk in chunks)
            out.write(gz.flush())
            return path
        zst, done = zstandard.ZstdCompressor().compressobj(), 0
        for chunk in chunks:
            out.write(zst.compress(chunk))
            done += len(chunk)
            if frame_bytes and done % frame_bytes == 0:
                out.write(zst.flush())
                zst = zstandard.ZstdCompressor().compressobj()
        out.write(zst.flush())
    return path


def one_byte(total: int) -> Iterator[bytes]:
    """`total` bytes of 'a', without a newline, a MiB at a time."""
    yield from (b"a" * (1 << 20) for _ in range(total >> 20))


@pytest.mark.parametrize("name", ["bomb.jsonl.gz", "bomb.jsonl.zst", "frames.jsonl.zst"])
def test_a_decompression_bomb_fails_while_it_is_read_in_bounded_memory(name: str, tmp_path: Path) -> None:
    # 128 MiB without a newline: zstd stops at the inflation cap, gzip (whose ratio stays near 1000x) at the end
    # of the line, refused as a row over the limit; in a child, so its peak memory is the read's own.
    bomb = compressed(tmp_path / name, one_byte(BOMB_BYTES), frame_bytes=(1 << 20) * (name == "frames.jsonl.zst"))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    child = subprocess.run(
        [sys.executable, "-c", READ_IN_A_CHILD, str(bomb)], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    *said, grew = child.stdout.splitlines()
    if name.endswith(".zst"):
        cap = "over the limit of 1000x (and 67108864 bytes): a decompression bomb, not data"
        assert said == [f"{bomb}: decompresses to more than 67108864 bytes from {bomb.stat().st_size} stored, {cap} "
                        "(raise it with POSTTRAIN_MAX_INFLATION)"]  # fmt: skip
    else:
        assert said == [f"{bomb}:1: row is {BOMB_BYTES} bytes, over the limit of 4194304 (raise it with "
                        "POSTTRAIN_MAX_ROW_BYTES)"]  # fmt: skip
    assert int(grew) < 40, f"the read grew by {grew} MiB"  # the line limit, a chunk, buffers: not the 128 MiB


@pytest.mark.parametrize("name", ["long.jsonl", "long.jsonl.gz", "long.jsonl.zst"])
def test_a_line_over_the_row_limit_is_read_past_not_held(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSTTRAIN_MAX_ROW_BYTES", "1000")
    good = rows("g", 2)
    content = [good[0], b'{"text": "' + b"a" * (8 << 20) + b'"}\n', good[1], b"a" * 5000]  # the last: no newline
    path = tmp_path / name
    if name.endswith("l"):
        path.write_bytes(b"".join(content))
    else:
        compressed(path, iter(content))
    sources_, raws = read_source(str(path), DataSpec.model_validate({"uri": str(path), "format": "text"}))
    read = list(raws)
    assert [len(r.raw or b"") for r in read] == [len(good[0]), 1001, len(good[1]), 1001]  # the rest never held
    parsed = [parse_row(r, 1000, "utf-8") for r in read]
    assert [p.value for p in parsed[::2]] == [json.loads(good[0]), json.loads(good[1])]
    assert [str(p.error) for p in parsed[1::2]] == [
        f"{path}:{n}: row is {size} bytes, over the limit of 1000 (raise it with POSTTRAIN_MAX_ROW_BYTES)"
        for n, size in [(2, len(content[1])), (4, 5000)]
    ]
    assert sources_[0].fingerprint == "sha256:" + hashlib.sha256(b"".join(content)).hexdigest()  # every byte


@pytest.mark.parametrize("name", ["rows.jsonl.gz", "rows.jsonl.zst"])
def test_short_rows_that_inflate_past_the_cap_fail_the_file(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows each within the limit, but one row repeated: 30 MiB from a few KiB. The cap scaled down (a floor of
    # 1 MiB, 100x) to keep the test small; a real corpus (distinct rows, ~4x) is read whole under it.
    monkeypatch.setattr("stages.data.INFLATION_FLOOR_BYTES", 1 << 20)
    monkeypatch.setenv("POSTTRAIN_MAX_INFLATION", "100")
    row = json.dumps({"text": "서울은 아름답습니다. " * 40}, ensure_ascii=False).encode() + b"\n"
    bomb = compressed(tmp_path / name, (row * 1000 for _ in range((30 << 20) // (len(row) * 1000))))
    real = compressed(tmp_path / f"real-{name}", iter(rows("r", 40_000)))
    assert sum(map(len, rows("r", 40_000))) > 1 << 20  # past the floor: the ratio is what lets it through
    spec = DataSpec.model_validate({"uri": str(real), "format": "text"})
    assert len(list(read_source(str(real), spec)[1])) == 40_000
    cap = max(1 << 20, 100 * bomb.stat().st_size)
    with pytest.raises(DataError) as raised:
        list(read_source(str(bomb), spec)[1])
    assert str(raised.value) == (
        f"{bomb}: decompresses to more than {cap} bytes from {bomb.stat().st_size} stored, over the limit of 100x "
        "(and 1048576 bytes): a decompression bomb, not data (raise it with POSTTRAIN_MAX_INFLATION)"
    )
    monkeypatch.setenv("POSTTRAIN_MAX_INFLATION", "1x")
    with pytest.raises(DataError, match=r"^POSTTRAIN_MAX_INFLATION='1x': expected a positive whole ratio"):
        read_source(str(real), spec)


def test_a_parquet_bomb_is_refused_by_its_footer_or_while_it_decodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("stages.data.INFLATION_FLOOR_BYTES", 1 << 20)
    cell = tmp_path / "cell.parquet"  # one 8 MiB cell, compressed: the footer declares it, nothing is read
    pq.write_table(pa.table({"text": ["a" * (8 << 20)]}), cell, compression="zstd")
    spec = DataSpec.model_validate({"uri": str(cell), "format": "text"})
    with pytest.raises(DataError, match=rf"^{cell}: decompresses to more than 1048576 bytes from \d+ stored"):
        read_source(str(cell), spec)[1].__next__()
    # One 512 KiB value repeated through a dictionary: a small footer, 32 MiB once decoded.
    dictionary = tmp_path / "dictionary.parquet"
    column = pa.DictionaryArray.from_arrays(pa.array([0] * 64, pa.int32()), pa.array(["b" * (512 << 10)]))
    pq.write_table(pa.table({"text": column}), dictionary, compression="zstd")
    spec = DataSpec.model_validate({"uri": str(dictionary), "format": "text"})
    with pytest.raises(DataError, match=rf"^{dictionary}: decompresses to more than 1048576 bytes from \d+ stored"):
        list(read_source(str(dictionary), spec)[1])
    small = tmp_path / "small.parquet"
    small.write_bytes(parquet_bytes(["p0", "p1"]))
    assert [r.value for r in read_source(str(small), spec)[1]] == [{"text": "p0"}, {"text": "p1"}]
