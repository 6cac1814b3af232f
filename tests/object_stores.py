"""Object stores on 127.0.0.1 for the publishing and data-source tests: moto's S3 server and a GCS emulator, each on a
free port, and a proxy that makes either fail as a store or a network does.

The deploy stage reaches them with the real boto3 and google-cloud-storage clients through the environment a user
sets for an S3-compatible store or the GCS emulator (`env`); the tests read back what arrived with their own
clients, pointed at the store explicitly.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from typing import Any, Protocol

import requests

ACCESS_KEY_ID = "AKIAPOSTTRAINTEST0001"
SECRET_ACCESS_KEY = "posttrain-test-secret-9f3Kq2vXw7"
REGION = "eu-west-1"
GCS_PROJECT = "posttrain-test"


class ObjectStore(Protocol):
    """What the publishing tests need of a store."""

    scheme: str
    env: dict[str, str]
    """The environment that points the deploy stage's client at this store."""

    def reset(self) -> None:
        """Remove every bucket and object."""
        ...

    def create_bucket(self, name: str) -> None: ...

    def objects(self) -> dict[str, bytes]:
        """Every object of every bucket: `<bucket>/<key>` -> bytes."""
        ...


class MotoS3:
    """moto's S3 in server mode."""

    scheme = "s3"

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, service: str = "s3", **keys: str) -> Any:
        import boto3

        keys = keys or {"aws_access_key_id": ACCESS_KEY_ID, "aws_secret_access_key": SECRET_ACCESS_KEY}
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, **keys)

    def reset(self) -> None:
        """Empty the store (moto's backends are process-wide: this empties every moto server of the process)."""
        self._moto_api("reset")

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})

    def objects(self) -> dict[str, bytes]:
        s3 = self.client()
        found = {}
        for bucket in s3.list_buckets()["Buckets"]:
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket["Name"]):
                for item in page.get("Contents", []):
                    body = s3.get_object(Bucket=bucket["Name"], Key=item["Key"])["Body"].read()
                    found[f"{bucket['Name']}/{item['Key']}"] = body
        return found

    def _moto_api(self, path: str, body: str = "") -> None:
        # text/plain: a form content type would let the server parse the body away
        response = requests.post(f"{self.endpoint}/moto-api/{path}", data=body, headers={"Content-Type": "text/plain"})
        response.raise_for_status()

    @contextmanager
    def read_only_keys(self) -> Iterator[dict[str, str]]:
        """Keys of an IAM user who may read but not write, with authorization on while inside: the environment
        of a pod whose identity lacks s3:PutObject."""
        with self.keys_allowed("reader", ["s3:Get*", "s3:List*"]) as keys:
            yield keys

    @contextmanager
    def no_access_keys(self) -> Iterator[dict[str, str]]:
        """Keys of an IAM user who may do nothing with S3 (no s3:ListBucket, no s3:GetObject), with authorization on
        while inside: the environment of a pod whose identity was never granted the bucket."""
        with self.keys_allowed("stranger", ["iam:GetUser"]) as keys:
            yield keys

    @contextmanager
    def keys_allowed(self, user: str, actions: list[str]) -> Iterator[dict[str, str]]:
        """Keys of a new IAM user allowed `actions` only; every request is authorized against them while inside."""
        iam = self.client("iam")
        iam.create_user(UserName=user)
        allow = {"Effect": "Allow", "Action": actions, "Resource": "*"}
        policy = {"Version": "2012-10-17", "Statement": [allow]}
        iam.put_user_policy(UserName=user, PolicyName="granted", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        self._moto_api("reset-auth", "0")  # every request from now on is authenticated and authorized
        try:
            yield {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        finally:
            self._moto_api("reset-auth", "inf")


class GcsEmulator:
    """gcp-storage-emulator, in memory."""

    scheme = "gs"

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.env = {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": GCS_PROJECT}

    def client(self) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project=GCS_PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": self.endpoint}
        )

    def reset(self) -> None:
        """Empty the store."""
        requests.get(f"{self.endpoint}/wipe").raise_for_status()

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(name)

    def objects(self) -> dict[str, bytes]:
        gcs = self.client()
        return {
            f"{bucket.name}/{blob.name}": blob.download_as_bytes()
            for bucket in gcs.list_buckets()
            for blob in gcs.list_blobs(bucket.name)
        }


class FaultyProxy:
    """An HTTP server on 127.0.0.1 that passes requests on to a store and can fail as a store or a network does:
    answer every request with an error of its own (`refuse`), or break the connection partway through a response
    body (`cut_after`). Records each request's path and query (`requests`)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.refuse: tuple[int, dict[str, Any]] | None = None
        """(status, JSON body) to answer every request with, instead of passing it on."""
        self.cut_after: int | None = None
        """Close the connection after this many bytes of a GET's response body."""
        self.requests: list[str] = []
        self.endpoint = ""

    def handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet: the tests read their own output
                pass

            def _pass_on(self) -> None:
                proxy.requests.append(f"{self.command} {self.path}")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.refuse is not None:
                    status, answer = proxy.refuse
                    data = json.dumps(answer).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data if self.command != "HEAD" else b"")
                    return
                # the Host header stays the proxy's: a store builds the links it answers with (GCS's mediaLink) on it
                headers = {k: v for k, v in self.headers.items() if k.lower() != "content-length"}
                reply = requests.request(
                    self.command, proxy.upstream + self.path, headers=headers, data=body, stream=True, timeout=30
                )
                data = reply.raw.read(decode_content=False) if self.command != "HEAD" else b""
                self.send_response(reply.status_code)
                for name, value in reply.headers.items():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", reply.headers.get("Content-Length", str(len(data))))
                self.end_headers()
                if self.command == "GET" and proxy.cut_after is not None and len(data) > proxy.cut_after:
                    self.wfile.write(data[: proxy.cut_after])
                    self.wfile.flush()
                    self.close_connection = True  # the client is left waiting for bytes that never come
                    return
                self.wfile.write(data)

            do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _pass_on

        return Handler


@contextmanager
def faulty_proxy(upstream: str) -> Iterator[FaultyProxy]:
    """A FaultyProxy in front of `upstream` on a free port of 127.0.0.1, passing everything on until told not to."""
    proxy = FaultyProxy(upstream)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), proxy.handler())
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = httpd.server_address[:2]
        proxy.endpoint = f"http://{host}:{port}"
        yield proxy
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@contextmanager
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 server on 127.0.0.1 at a free port, empty."""
    from moto.server import ThreadedMotoServer

    requests_log = logging.getLogger("werkzeug")  # one line per request on stderr, among the stage's output
    level = requests_log.level
    requests_log.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        store = MotoS3(f"http://{host}:{port}")
        store.reset()
        yield store
    finally:
        server.stop()
        requests_log.setLevel(level)


@contextmanager
def gcs_emulator() -> Iterator[GcsEmulator]:
    """The GCS emulator on 127.0.0.1 at a free port, empty. Served from its own request handler, since its
    `create_server` needs the port up front and would race for a free one."""
    from gcp_storage_emulator.server import RequestHandler
    from gcp_storage_emulator.storage import Storage

    httpd = HTTPServer(("127.0.0.1", 0), partial(RequestHandler, Storage(use_memory_fs=True)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = httpd.server_address[:2]
        yield GcsEmulator(f"http://{host}:{port}")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
