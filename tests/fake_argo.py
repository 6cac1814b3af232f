"""A fake Argo server for tests: a real HTTP server on 127.0.0.1 speaking the routes the client calls.

It keeps WorkflowTemplates, CronWorkflows and Workflows in memory with resourceVersions, answers 409 to a
duplicate create and to an update with a stale resourceVersion, checks the bearer token (401), can be told to
answer 403 (per verb and resource, or everything but an allowed set, e.g. SUBMITTER_RBAC), validates every request
body against the Argo JSON schema made strict (unknown fields are errors, 400), and plays a scripted status
progression for each submitted workflow (one step per GET), for --watch.

Like the real server, it stores templates as a round trip through Go structs leaves them (empty `metadata`,
`inputs` and `outputs` on every template) and labels them with their creator, so a client comparing its
object with the server's copy has to look past what the server adds.

Error bodies look like the real server's (grpc-gateway): {"code": N, "message": "..."}.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from schema_validation import _argo_definitions as _strict_argo_definitions
from schema_validation import require_schemas

# (request body definition, the object inside it) for each create/update route.
_BODIES = {
    ("POST", "workflowtemplates"): ("io.argoproj.workflow.v1alpha1.WorkflowTemplateCreateRequest", "template"),
    ("PUT", "workflowtemplates"): ("io.argoproj.workflow.v1alpha1.WorkflowTemplateUpdateRequest", "template"),
    ("POST", "cronworkflows"): ("io.argoproj.workflow.v1alpha1.CreateCronWorkflowRequest", "cronWorkflow"),
    ("PUT", "cronworkflows"): ("io.argoproj.workflow.v1alpha1.UpdateCronWorkflowRequest", "cronWorkflow"),
    ("POST", "workflows"): ("io.argoproj.workflow.v1alpha1.WorkflowCreateRequest", "workflow"),
}
_ROUTES = {"workflow-templates": "workflowtemplates", "cron-workflows": "cronworkflows", "workflows": "workflows"}
_VERBS = {"GET": "get", "POST": "create", "PUT": "update"}
_UI_PAGE = "<!doctype html><html><head><title>Argo</title></head><body></body></html>"
_GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 409: 6, 500: 13}
_CREATOR_LABEL = "workflows.argoproj.io/creator"

SUBMITTER_RBAC = frozenset({("create", "workflows"), ("get", "workflows"), ("get", "workflowtemplates")})
"""What the submitter role allows: submit and follow runs, read the templates, write none."""


@cache
def _validators() -> dict[str, Any]:
    """A strict Draft 2020-12 validator for each request body definition (the same strictness as the
    rendered-manifest tests: unknown fields are errors)."""
    definitions = _strict_argo_definitions()
    return {
        name: Draft202012Validator({"$ref": f"#/definitions/{name}", "definitions": definitions})
        for name, _ in _BODIES.values()
    }


def schema_errors(definition: str, body: Any) -> list[str]:
    """Strict-schema violations of `body` as 'path: message' lines (empty when valid)."""
    validator = _validators()[definition]
    errors = sorted(validator.iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(body)'}: {e.message}" for e in errors]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Answer(Exception):
    """An error answer with a status and a grpc-gateway style body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Recorded:
    """One request the server received (after authentication)."""

    method: str
    path: str
    body: Any


@dataclass
class FakeArgo:
    """The fake server. Use as a context manager, or start()/stop()."""

    token: str = "fake-token-s3cr3t"
    """The only bearer token accepted."""
    namespaces: set[str] = field(default_factory=lambda: {"posttrain", "llm-training", "default"})
    """Namespaces that exist; any other answers 404."""
    base_href: str = "/"
    """Path prefix the API is served under ('/argo/' serves /argo/api/v1/...)."""
    validate: bool = True
    """Validate request bodies against the strict schema (needs the shared schema file)."""
    ui_fallback: bool = False
    """Answer paths outside the API with 200 and an HTML page, as the server's UI does."""
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    """(verb, resource) pairs answered with 403, e.g. ('create', 'workflows'); ('*', '*') forbids all."""
    allowed: frozenset[tuple[str, str]] | None = None
    """When set, the only (verb, resource) pairs not answered with 403 (e.g. SUBMITTER_RBAC)."""
    store: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    """(resource, namespace, name) → the stored object."""
    requests: list[Recorded] = field(default_factory=list)
    """Every authenticated request, in order."""
    statuses: list[dict[str, Any]] = field(default_factory=list)
    """Status progression for submitted workflows: the n-th GET of a workflow returns the n-th (the last sticks)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self._gets: dict[str, int] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> FakeArgo:
        """Listen on a random port of 127.0.0.1 in a background thread."""
        if self.validate:
            _validators()  # load the schema once, before the first request
        fake = self

        class Handler(_Handler):
            server_state = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-argo", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeArgo:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """host:port, the form ARGO_SERVER usually takes."""
        assert self._server is not None, "start() the server first"
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        """http://host:port (no base href)."""
        return f"http://{self.address}"

    def env(self, **extra: str) -> dict[str, str]:
        """ARGO_* variables pointing at this server, with its token."""
        env = {"ARGO_SERVER": self.url, "ARGO_TOKEN": self.token}
        if self.base_href != "/":
            env["ARGO_BASE_HREF"] = self.base_href
        env.update(extra)
        return env

    # ----------------------------------------------------------------- test helpers

    def objects(self, resource: str) -> dict[tuple[str, str], dict[str, Any]]:
        """(namespace, name) → object, for one resource ('workflowtemplates', 'cronworkflows', 'workflows')."""
        with self._lock:
            return {(ns, n): copy.deepcopy(o) for (r, ns, n), o in self.store.items() if r == resource}

    def put_object(self, resource: str, obj: dict[str, Any]) -> None:
        """Store an object directly (as if created earlier by someone else)."""
        meta = obj.setdefault("metadata", {})
        with self._lock:
            self._version += 1
            meta["resourceVersion"] = str(self._version)
            meta.setdefault("uid", str(uuid.uuid4()))
            self.store[(resource, meta["namespace"], meta["name"])] = copy.deepcopy(obj)

    # ----------------------------------------------------------------- request handling

    def handle(self, method: str, path: str, auth: str | None, raw: bytes) -> tuple[int, Any]:
        """Answer one request: (status, JSON body) or raise _Answer."""
        prefix = self.base_href.rstrip("/") + "/api/v1/"
        if not path.startswith(prefix):
            if self.ui_fallback:
                return 200, _UI_PAGE
            raise _Answer(404, "")  # outside the API: a proxy's or the UI's not-found page, not JSON
        parts = path[len(prefix) :].split("?", 1)[0].strip("/").split("/")
        if parts[0] not in _ROUTES or len(parts) not in (2, 3):
            raise _Answer(404, f"no route for {method} {path}")
        resource = _ROUTES[parts[0]]
        ns, name = parts[1], (parts[2] if len(parts) == 3 else None)
        if auth != f"Bearer {self.token}":
            raise _Answer(401, "token not valid. More info: https://argo-workflows.readthedocs.io/en/latest/faq/")
        verb = _VERBS.get(method)
        if verb is None or (verb == "create") != (name is None):
            raise _Answer(405 if verb is None else 404, f"method {method} not allowed on {path}")
        body = self._parse(raw) if method in ("POST", "PUT") else None
        with self._lock:
            self.requests.append(Recorded(method, path, copy.deepcopy(body)))
        denied = self.allowed is not None and (verb, resource) not in self.allowed
        if denied or ("*", "*") in self.forbidden or (verb, resource) in self.forbidden:
            raise _Answer(
                403,
                f'{resource}.argoproj.io is forbidden: User "system:serviceaccount:{ns}:ci" cannot {verb} '
                f'resource "{resource}" in API group "argoproj.io" in the namespace "{ns}"',
            )
        if ns not in self.namespaces:
            raise _Answer(404, f'namespaces "{ns}" not found')
        if method == "GET":
            return 200, self._get(resource, ns, name or "")
        definition, key = _BODIES[(method, resource)]
        if self.validate and (errors := schema_errors(definition, body)):
            raise _Answer(400, f"{definition}: " + "; ".join(errors[:5]))
        obj = body.get(key) if isinstance(body, dict) else None
        if not isinstance(obj, dict):
            raise _Answer(400, f"request body has no {key}")
        if method == "POST":
            return 200, self._create(resource, ns, obj)
        return 200, self._update(resource, ns, name or "", obj)

    @staticmethod
    def _parse(raw: bytes) -> Any:
        try:
            return json.loads(raw or b"null")
        except json.JSONDecodeError as exc:
            raise _Answer(400, f"body is not JSON: {exc}") from None

    def _get(self, resource: str, ns: str, name: str) -> dict[str, Any]:
        with self._lock:
            obj = self.store.get((resource, ns, name))
            if obj is None:
                raise _Answer(404, f'{resource}.argoproj.io "{name}" not found')
            obj = copy.deepcopy(obj)
            if resource == "workflows" and self.statuses:
                n = self._gets.get(name, 0)
                self._gets[name] = n + 1
                obj["status"] = copy.deepcopy(self.statuses[min(n, len(self.statuses) - 1)])
            return obj

    def _create(self, resource: str, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if meta.get("namespace") not in (None, ns):
            raise _Answer(400, f"metadata.namespace {meta['namespace']!r} does not match the request's {ns!r}")
        if not meta.get("name"):
            if resource != "workflows" or not meta.get("generateName"):
                raise _Answer(400, "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        ref = (obj.get("spec") or {}).get("workflowTemplateRef")
        if resource == "workflows" and ref and ("workflowtemplates", ns, ref.get("name")) not in self.store:
            raise _Answer(400, f'workflowtemplates.argoproj.io "{ref.get("name")}" not found')
        with self._lock:
            key = (resource, ns, meta["name"])
            if key in self.store:
                raise _Answer(409, f'{resource}.argoproj.io "{meta["name"]}" already exists')
            self._version += 1
            meta.update(
                namespace=ns, uid=str(uuid.uuid4()), resourceVersion=str(self._version), creationTimestamp=_now()
            )
            meta.setdefault("generation", 1)
            _as_stored(resource, ns, obj)
            self.store[key] = copy.deepcopy(obj)
            return obj

    def _update(self, resource: str, ns: str, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            raise _Answer(400, f"metadata.name {meta.get('name')!r} does not match the URL's {name!r}")
        with self._lock:
            current = self.store.get((resource, ns, name))
            if current is None:
                raise _Answer(404, f'{resource}.argoproj.io "{name}" not found')
            if not meta.get("resourceVersion"):
                raise _Answer(400, "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update")
            if meta["resourceVersion"] != current["metadata"]["resourceVersion"]:
                raise _Answer(
                    409,
                    f'Operation cannot be fulfilled on {resource}.argoproj.io "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            self._version += 1
            meta.update(
                namespace=ns,
                uid=current["metadata"]["uid"],
                resourceVersion=str(self._version),
                creationTimestamp=current["metadata"].get("creationTimestamp", _now()),
                generation=current["metadata"].get("generation", 1) + 1,
            )
            _as_stored(resource, ns, obj)
            self.store[(resource, ns, name)] = copy.deepcopy(obj)
            return obj


def _as_stored(resource: str, ns: str, obj: dict[str, Any]) -> None:
    """What the real server adds to a template or schedule it stores: its creator's label, and the empty
    structs Go's encoder writes for every template."""
    if resource not in ("workflowtemplates", "cronworkflows"):
        return
    obj["metadata"].setdefault("labels", {})[_CREATOR_LABEL] = f"system-serviceaccount-{ns}-ci"
    for template in (obj.get("spec") or {}).get("templates") or []:
        for empty in ("metadata", "inputs", "outputs"):
            template.setdefault(empty, {})


class _Handler(BaseHTTPRequestHandler):
    """Routes every method to FakeArgo.handle and writes its answer."""

    server_state: FakeArgo
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            status, body = self.server_state.handle(self.command, self.path, self.headers.get("Authorization"), raw)
            if body is _UI_PAGE:
                payload, ctype = body.encode(), "text/html"
            else:
                payload, ctype = json.dumps(body).encode(), "application/json"
        except _Answer as answer:
            status = answer.status
            if answer.message:
                code = _GRPC_CODES.get(status, 2)
                payload, ctype = json.dumps({"code": code, "message": answer.message}).encode(), "application/json"
            else:
                payload, ctype = HTTPStatus(status).phrase.encode(), "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read `FakeArgo.requests` instead."""


# --------------------------------------------------------------------------- status progressions


def node(
    name: str,
    phase: str,
    *,
    type_: str = "Pod",
    started: str | None = "2026-11-02T02:00:00Z",
    finished: str | None = None,
    message: str | None = None,
    workflow: str = "wf",
) -> tuple[str, dict[str, Any]]:
    """One entry of status.nodes: (node id, NodeStatus)."""
    node_id = f"{workflow}-{re.sub(r'[^a-z0-9]', '', name)}"
    status: dict[str, Any] = {
        "id": node_id,
        "name": f"{workflow}.{name}",
        "displayName": name,
        "type": type_,
        "phase": phase,
    }
    if started:
        status["startedAt"] = started
    if finished:
        status["finishedAt"] = finished
    if message:
        status["message"] = message
    return node_id, status


def workflow_status(
    phase: str, nodes: list[tuple[str, dict[str, Any]]], *, finished: str | None = None, message: str | None = None
) -> dict[str, Any]:
    """A WorkflowStatus with the given phase and nodes."""
    status: dict[str, Any] = {"phase": phase, "startedAt": "2026-11-02T02:00:00Z", "nodes": dict(nodes)}
    if finished:
        status["finishedAt"] = finished
    if message:
        status["message"] = message
    return status


@contextmanager
def running(**kwargs: Any) -> Iterator[FakeArgo]:
    """A started FakeArgo, stopped on exit; it validates bodies against the schema, so without the schemas the
    test skips (or fails, see schema_validation.require_schemas)."""
    if kwargs.get("validate", True):
        require_schemas()
    fake = FakeArgo(**kwargs)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeArgo]:
    """A running fake Argo server with ARGO_* pointing at it (and no other ARGO_* settings)."""
    with running() as server:
        for name in ("ARGO_NAMESPACE", "ARGO_BASE_HREF", "ARGO_INSECURE_SKIP_VERIFY", "ARGO_SECURE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server
