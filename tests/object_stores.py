"""Object stores on 127.0.0.1 for the publishing tests: moto's S3 server and a GCS emulator, each on a free port.

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
from http.server import HTTPServer
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
        iam = self.client("iam")
        iam.create_user(UserName="reader")
        read = {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"], "Resource": "*"}
        policy = {"Version": "2012-10-17", "Statement": [read]}
        iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
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
