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
from urllib.parse import parse_qs

import pytest
from fake_kube import matches
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
# Request body definition of each workflow action (PUT /api/v1/workflows/{ns}/{name}/{action}).
_ACTION_BODIES = {
    "stop": "io.argoproj.workflow.v1alpha1.WorkflowStopRequest",
    "terminate": "io.argoproj.workflow.v1alpha1.WorkflowTerminateRequest",
    "retry": "io.argoproj.workflow.v1alpha1.WorkflowRetryRequest",
}
_PHASE_LABEL = "workflows.argoproj.io/phase"
_COMPLETED_LABEL = "workflows.argoproj.io/completed"
_ROUTES = {"workflow-templates": "workflowtemplates", "cron-workflows": "cronworkflows", "workflows": "workflows"}
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "DELETE": "delete"}
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
    names = [name for name, _ in _BODIES.values()] + list(_ACTION_BODIES.values())
    return {name: Draft202012Validator({"$ref": f"#/definitions/{name}", "definitions": definitions}) for name in names}


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
class PodLog:
    """The log of one container of a workflow's pod, served by the log route."""

    namespace: str
    workflow: str
    pod: str
    lines: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    """The pod's labels, which the route's `selector` matches."""
    container: str = "main"


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
    pod_logs: list[PodLog] = field(default_factory=list)
    """What the log route serves."""

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
        route, _, raw_query = path[len(prefix) :].partition("?")
        query = {k: v[-1] for k, v in parse_qs(raw_query).items()}
        parts = route.strip("/").split("/")
        action = parts[3] if len(parts) == 4 else None
        if parts[0] not in _ROUTES or len(parts) not in (2, 3, 4):
            raise _Answer(404, f"no route for {method} {path}")
        resource = _ROUTES[parts[0]]
        ns, name = parts[1], (parts[2] if len(parts) >= 3 else None)
        if action is not None and (resource != "workflows" or (method, action) not in _ACTIONS):
            raise _Answer(404, f"no route for {method} {path}")
        if auth != f"Bearer {self.token}":
            raise _Answer(401, "token not valid. More info: https://argo-workflows.readthedocs.io/en/latest/faq/")
        verb = _VERBS.get(method)
        if verb == "get" and name is None:
            verb = "list"
        if verb is None or (verb == "create") != (name is None and method == "POST"):
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
        if action is not None:
            return 200, _ACTIONS[(method, action)](self, ns, name or "", body, query)
        if method == "GET":
            return 200, self._list(resource, ns, query) if name is None else self._get(resource, ns, name)
        if method == "DELETE":
            return 200, self._delete(resource, ns, name or "")
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

    def _list(self, resource: str, ns: str, query: dict[str, str]) -> dict[str, Any]:
        """The objects of a namespace matching `listOptions.labelSelector`; `items: null` when none, as the real
        server answers."""
        selector = query.get("listOptions.labelSelector")
        with self._lock:
            items = [
                _as_read(resource, copy.deepcopy(o))
                for (r, n, _), o in sorted(self.store.items())
                if r == resource and n == ns
            ]
        try:
            items = [o for o in items if matches(selector, (o.get("metadata") or {}).get("labels") or {})]
        except ValueError as exc:
            raise _Answer(400, str(exc)) from None
        return {"metadata": {"resourceVersion": str(self._version)}, "items": items or None}

    def _delete(self, resource: str, ns: str, name: str) -> dict[str, Any]:
        with self._lock:
            if self.store.pop((resource, ns, name), None) is None:
                raise _Answer(404, f'{resource}.argoproj.io "{name}" not found')
        return {}

    def _stored_workflow(self, ns: str, name: str) -> dict[str, Any]:
        obj = self.store.get(("workflows", ns, name))
        if obj is None:
            raise _Answer(404, f'workflows.argoproj.io "{name}" not found')
        return obj

    def _validated(self, action: str, body: Any, ns: str, name: str) -> dict[str, Any]:
        definition = _ACTION_BODIES[action]
        if self.validate and (errors := schema_errors(definition, body)):
            raise _Answer(400, f"{definition}: " + "; ".join(errors[:5]))
        named = (body.get("name"), body.get("namespace")) if isinstance(body, dict) else ("?", "?")
        if named[0] not in (None, name) or named[1] not in (None, ns):
            raise _Answer(400, f"the request body names another workflow than {ns}/{name}")
        return body

    def _shutdown(self, ns: str, name: str, body: Any, strategy: str) -> dict[str, Any]:
        """Stop or Terminate, with what the controller does next: running nodes and the workflow end Failed."""
        request = self._validated(strategy.lower(), body, ns, name)
        with self._lock:
            wf = self._stored_workflow(ns, name)
            status = wf.setdefault("status", {})
            if status.get("phase") in ("Succeeded", "Failed", "Error"):
                raise _Answer(400, "cannot shutdown a completed workflow")
            wf.setdefault("spec", {})["shutdown"] = strategy
            message = f"Stopped with strategy '{strategy}'"
            if request.get("message"):
                message += f": {request['message']}"
            for node in (status.get("nodes") or {}).values():
                if node.get("phase") in ("Running", "Pending"):
                    node.update(phase="Failed", message=message, finishedAt=_now())
            status.update(phase="Failed", message=message, finishedAt=_now())
            return _as_read("workflows", copy.deepcopy(wf))

    def _stop(self, ns: str, name: str, body: Any, _query: dict[str, str]) -> dict[str, Any]:
        return self._shutdown(ns, name, body, "Stop")

    def _terminate(self, ns: str, name: str, body: Any, _query: dict[str, str]) -> dict[str, Any]:
        return self._shutdown(ns, name, body, "Terminate")

    def _retry(self, ns: str, name: str, body: Any, _query: dict[str, str]) -> dict[str, Any]:
        """Retry: the failed nodes (and the succeeded ones the selector names, with restartSuccessful) are
        removed, and the workflow runs again."""
        request = self._validated("retry", body, ns, name)
        with self._lock:
            wf = self._stored_workflow(ns, name)
            status = wf.setdefault("status", {})
            if status.get("phase") not in ("Failed", "Error"):
                raise _Answer(400, f"Workflow must be Failed/Error to retry (it is {status.get('phase') or 'Pending'})")
            selector = request.get("nodeFieldSelector") or ""
            restart = {
                node_id
                for node_id, node in (status.get("nodes") or {}).items()
                if request.get("restartSuccessful")
                and node.get("phase") == "Succeeded"
                and selector
                and f"displayName={node.get('displayName')}" in selector.split(",")
            }
            status["nodes"] = {
                node_id: node
                for node_id, node in (status.get("nodes") or {}).items()
                if node.get("phase") not in ("Failed", "Error") and node_id not in restart
            }
            status["phase"] = "Running"
            for key in ("message", "finishedAt"):
                status.pop(key, None)
            wf.get("spec", {}).pop("shutdown", None)
            return _as_read("workflows", copy.deepcopy(wf))

    def _log(self, ns: str, name: str, _body: Any, query: dict[str, str]) -> Iterator[dict[str, Any]]:
        """The log route: one {"result": {"content", "podName"}} per line, of the pods the selector matches."""
        with self._lock:
            self._stored_workflow(ns, name)
            logs = [copy.deepcopy(log) for log in self.pod_logs if (log.namespace, log.workflow) == (ns, name)]
        container = query.get("logOptions.container", "main")
        pod = query.get("podName")
        tail = int(query["logOptions.tailLines"]) if "logOptions.tailLines" in query else None
        entries = []
        for log in logs:
            if log.container != container or (pod and log.pod != pod):
                continue
            try:
                if not matches(query.get("selector"), log.labels):
                    continue
            except ValueError as exc:
                raise _Answer(400, str(exc)) from None
            lines = log.lines[-tail:] if tail else ([] if tail == 0 else log.lines)
            entries += [{"result": {"content": line, "podName": log.pod}} for line in lines]
        return iter(entries)

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


_ACTIONS = {
    ("PUT", "stop"): FakeArgo._stop,
    ("PUT", "terminate"): FakeArgo._terminate,
    ("PUT", "retry"): FakeArgo._retry,
    ("GET", "log"): FakeArgo._log,
}
"""The workflow actions, by (method, last path segment)."""


def _as_read(resource: str, obj: dict[str, Any]) -> dict[str, Any]:
    """A workflow as the controller labels it: its phase, and whether it completed (what list selectors match)."""
    phase = (obj.get("status") or {}).get("phase")
    if resource == "workflows" and phase:
        labels = obj.setdefault("metadata", {}).setdefault("labels", {})
        labels[_PHASE_LABEL] = phase
        labels[_COMPLETED_LABEL] = str(phase in ("Succeeded", "Failed", "Error")).lower()
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
            if isinstance(body, Iterator):  # a log: newline-delimited JSON, as grpc-gateway streams it
                self._stream(status, body)
                return
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

    def _stream(self, status: int, entries: Iterator[dict[str, Any]]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for entry in entries:
            data = json.dumps(entry).encode() + b"\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

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
