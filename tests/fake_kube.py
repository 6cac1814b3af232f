"""A fake Kubernetes API server for tests: a real HTTP server on 127.0.0.1 speaking the routes the clients call.

The official `kubernetes` client talks to it through a `kubernetes.client.Configuration(host=...)` (see
`FakeKube.configuration` and `FakeKube.api_client`). It holds:

- custom objects by (group, version, plural, namespace, name): list (with `labelSelector`), get, delete (the
  DeleteOptions body is validated strictly against the Kubernetes schema); a missing object's 404 names it in its
  `details`, as the API server's does, and a resource in `unserved` (its CRD not installed) answers every request
  with the API server's 404 for an unknown resource, which names nothing;
- pods by (namespace, name): list (with `labelSelector`), and their logs per container:
  `/api/v1/namespaces/{ns}/pods/{name}/log` with `container`, `tailLines` and `follow` (a followed log streams
  until the pod is marked finished with `finish_pod`, as the kubelet ends the stream when the container exits).

It checks the bearer token (401), can be told to answer 403 per (verb, resource), records every request, and
answers errors as the API server does (a `Status` object). Routes live in `_ROUTES`: a pattern and a method each.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from jsonschema import Draft202012Validator

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"


@cache
def _delete_options_validator() -> Draft202012Validator:
    """kubernetes-validate's strict schema of meta/v1 DeleteOptions (what a DELETE body may hold)."""
    from schema_validation import _core_validator

    return _core_validator("DeleteOptions", "meta/v1")  # type: ignore[return-value]


class _Answer(Exception):
    """An error answer: status, reason and message of a Kubernetes `Status`."""

    def __init__(self, status: int, reason: str, message: str, details: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.details = status, reason, message, details


@dataclass
class Recorded:
    """One authenticated request."""

    method: str
    path: str
    query: dict[str, str]
    body: Any


# --------------------------------------------------------------------------- label selectors

_REQUIREMENT = re.compile(
    r"\s*(?:(?P<not>!)(?P<absent>[^\s,=!()]+)"
    r"|(?P<key>[^\s,=!()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s,()]*)"
    r"|\s+(?P<set>in|notin)\s*\((?P<values>[^)]*)\))?)\s*(?:,|$)"
)


def matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Whether `labels` satisfy a Kubernetes label selector (=, ==, !=, in, notin, key, !key); ValueError when
    the selector does not parse."""
    if not selector:
        return True
    pos = 0
    while pos < len(selector):
        m = _REQUIREMENT.match(selector, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"unable to parse requirement: {selector[pos:]!r}")
        pos = m.end()
        if m["absent"]:
            if m["absent"] in labels:
                return False
            continue
        key = m["key"]
        if m["op"] in ("=", "=="):
            ok = labels.get(key) == m["value"]
        elif m["op"] == "!=":
            ok = labels.get(key) != m["value"]
        elif m["set"]:
            values = {v.strip() for v in m["values"].split(",")}
            ok = (labels.get(key) in values) if m["set"] == "in" else (labels.get(key) not in values)
        else:
            ok = key in labels
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------- the server


@dataclass
class FakeKube:
    """The fake API server. Use as a context manager, or start()/stop()."""

    token: str = "fake-kube-token"
    """The only bearer token accepted."""
    objects: dict[tuple[str, str, str, str, str], dict[str, Any]] = field(default_factory=dict)
    """(group, version, plural, namespace, name) → custom object."""
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """(namespace, name) → Pod."""
    logs: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    """(namespace, pod, container) → log lines (without newlines)."""
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    """(verb, resource) pairs answered with 403, e.g. ('delete', 'pytorchjobs'), ('list', 'pods')."""
    unserved: set[str] = field(default_factory=set)
    """Custom resources (plurals, e.g. 'trainjobs') whose CRD is not installed: every request answers 404."""
    requests: list[Recorded] = field(default_factory=list)
    """Every authenticated request, in order."""

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        self._finished: set[tuple[str, str]] = set()
        self._server: ThreadingHTTPServer | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> FakeKube:
        """Listen on a random port of 127.0.0.1 in a background thread."""
        _delete_options_validator()
        fake = self

        class Handler(_Handler):
            server_state = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fake-kube", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening; followed log streams end."""
        with self._lock:
            self._finished.update(self.pods)
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the server first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def configuration(self) -> Any:
        """A kubernetes.client.Configuration pointing at this server with its token."""
        from kubernetes import client

        configuration = client.Configuration(host=self.url)
        configuration.api_key = {"authorization": self.token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        return configuration

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient for this server."""
        from kubernetes import client

        return client.ApiClient(self.configuration())

    # ----------------------------------------------------------------- test helpers

    def put(self, group: str, version: str, plural: str, obj: dict[str, Any]) -> None:
        """Store a custom object (as if created earlier)."""
        meta = obj["metadata"]
        with self._lock:
            self.objects[(group, version, plural, meta["namespace"], meta["name"])] = copy.deepcopy(obj)

    def custom(self, group: str, plural: str) -> dict[tuple[str, str], dict[str, Any]]:
        """(namespace, name) → object of one custom resource."""
        with self._lock:
            return {(k[3], k[4]): copy.deepcopy(o) for k, o in self.objects.items() if k[0] == group and k[2] == plural}

    def add_pod(
        self,
        namespace: str,
        name: str,
        labels: dict[str, str],
        logs: dict[str, list[str]] | None = None,
        finished: bool = True,
    ) -> None:
        """A pod with labels and per-container log lines; `finished` ends a followed stream after its lines."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {"containers": [{"name": c, "image": "trainer"} for c in (logs or {"main": []})]},
            "status": {"phase": "Succeeded" if finished else "Running"},
        }
        with self._lock:
            self.pods[(namespace, name)] = pod
            for container, lines in (logs or {}).items():
                self.logs[(namespace, name, container)] = list(lines)
            if finished:
                self._finished.add((namespace, name))
            else:
                self._finished.discard((namespace, name))

    def append_log(self, namespace: str, pod: str, container: str, *lines: str) -> None:
        """More lines of a running pod's log (a followed stream sends them)."""
        with self._lock:
            self.logs.setdefault((namespace, pod, container), []).extend(lines)
            self._lock.notify_all()

    def finish_pod(self, namespace: str, pod: str) -> None:
        """The pod's containers exited: a followed log stream ends after its last line."""
        with self._lock:
            self._finished.add((namespace, pod))
            self.pods[(namespace, pod)]["status"]["phase"] = "Succeeded"
            self._lock.notify_all()

    # ----------------------------------------------------------------- request handling

    def handle(self, method: str, target: str, auth: str | None, raw: bytes) -> tuple[int, Any]:
        """Answer one request: (status, JSON body or a line iterator for a log) or raise _Answer."""
        parts = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        for pattern, verb_of, handler in _ROUTES:
            m = pattern.fullmatch(parts.path)
            if m is None or method not in verb_of:
                continue
            if auth != f"Bearer {self.token}":
                raise _Answer(401, "Unauthorized", "Unauthorized")
            body = json.loads(raw) if raw else None
            with self._lock:
                self.requests.append(Recorded(method, parts.path, query, copy.deepcopy(body)))
            args = m.groupdict()
            verb, resource = verb_of[method], args.get("plural") or args.get("resource", "pods")
            if args.get("plural") in self.unserved:
                raise _Answer(404, "NotFound", "the server could not find the requested resource")
            if (verb, resource) in self.forbidden:
                raise _Answer(
                    403,
                    "Forbidden",
                    f'{resource} is forbidden: User "system:serviceaccount:{args["ns"]}:test" cannot {verb} '
                    f'resource "{resource}" in the namespace "{args["ns"]}"',
                )
            try:
                return handler(self, args, query, body)
            except ValueError as exc:  # a selector that does not parse
                raise _Answer(400, "BadRequest", str(exc)) from None
        raise _Answer(404, "NotFound", f"the server could not find the requested resource ({method} {parts.path})")

    def _list_custom(self, a: dict[str, str], q: dict[str, str], _: Any) -> tuple[int, Any]:
        with self._lock:
            items = [
                copy.deepcopy(o)
                for (g, v, p, ns, _n), o in sorted(self.objects.items())
                if (g, v, p, ns) == (a["group"], a["version"], a["plural"], a["ns"])
                and matches(q.get("labelSelector"), o["metadata"].get("labels") or {})
            ]
        kind = (items[0]["kind"] if items else a["plural"].rstrip("s").capitalize()) + "List"
        return 200, {"apiVersion": f"{a['group']}/{a['version']}", "kind": kind, "metadata": {}, "items": items}

    def _custom_key(self, a: dict[str, str]) -> tuple[str, str, str, str, str]:
        return a["group"], a["version"], a["plural"], a["ns"], a["name"]

    @staticmethod
    def _not_found(a: dict[str, str]) -> _Answer:
        """The API server's 404 for a missing object: its details name the object, its group and resource."""
        details = {"name": a["name"], "group": a["group"], "kind": a["plural"]}
        return _Answer(404, "NotFound", f'{a["plural"]}.{a["group"]} "{a["name"]}" not found', details)

    def _get_custom(self, a: dict[str, str], _q: dict[str, str], _b: Any) -> tuple[int, Any]:
        with self._lock:
            obj = self.objects.get(self._custom_key(a))
        if obj is None:
            raise self._not_found(a)
        return 200, copy.deepcopy(obj)

    def _delete_custom(self, a: dict[str, str], _q: dict[str, str], body: Any) -> tuple[int, Any]:
        if body is not None:
            errors = [e.message for e in _delete_options_validator().iter_errors(body)]
            if errors:
                raise _Answer(400, "BadRequest", "DeleteOptions: " + "; ".join(errors))
        with self._lock:
            obj = self.objects.pop(self._custom_key(a), None)
        if obj is None:
            raise self._not_found(a)
        return 200, _status(200, "Success", "", details={"name": a["name"], "kind": a["plural"]}, success=True)

    def _list_pods(self, a: dict[str, str], q: dict[str, str], _: Any) -> tuple[int, Any]:
        with self._lock:
            items = [
                copy.deepcopy(p)
                for (ns, _n), p in sorted(self.pods.items())
                if ns == a["ns"] and matches(q.get("labelSelector"), p["metadata"]["labels"])
            ]
        return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}

    def _pod_log(self, a: dict[str, str], q: dict[str, str], _: Any) -> tuple[int, Any]:
        key = (a["ns"], a["name"])
        with self._lock:
            pod = self.pods.get(key)
        if pod is None:
            raise _Answer(404, "NotFound", f'pods "{a["name"]}" not found')
        containers = [c["name"] for c in pod["spec"]["containers"]]
        container = q.get("container")
        if container is None:
            if len(containers) > 1:
                raise _Answer(
                    400,
                    "BadRequest",
                    f"a container name must be specified for pod {a['name']}, choose one of: {containers}",
                )
            container = containers[0]
        if container not in containers:
            raise _Answer(400, "BadRequest", f"container {container} is not valid for pod {a['name']}")
        tail = int(q["tailLines"]) if "tailLines" in q else None
        follow = q.get("follow", "").lower() == "true"
        return 200, self._log_lines(key, container, tail, follow)

    def _log_lines(self, key: tuple[str, str], container: str, tail: int | None, follow: bool) -> Iterator[str]:
        ns, pod = key
        with self._lock:
            lines = list(self.logs.get((ns, pod, container), []))
        start = max(len(lines) - tail, 0) if tail is not None else 0
        yield from lines[start:]
        sent = len(lines)

        def more() -> bool:
            return len(self.logs.get((ns, pod, container), [])) > sent or key in self._finished

        while follow:
            with self._lock:
                self._lock.wait_for(more, timeout=30)
                lines = list(self.logs.get((ns, pod, container), []))
                done = key in self._finished
            yield from lines[sent:]
            sent = len(lines)
            if done:
                return


def _status(code: int, reason: str, message: str, details: Any = None, success: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if success else "Failure",
        "code": code,
    }
    if message:
        status["message"] = message
    if reason and not success:
        status["reason"] = reason
    if details:
        status["details"] = details
    return status


_Handler_t = Callable[[FakeKube, dict[str, str], dict[str, str], Any], tuple[int, Any]]
_CUSTOM = r"/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
_ROUTES: list[tuple[re.Pattern[str], dict[str, str], _Handler_t]] = [
    (re.compile(_CUSTOM), {"GET": "list"}, FakeKube._list_custom),
    (re.compile(_CUSTOM + r"/(?P<name>[^/]+)"), {"GET": "get"}, FakeKube._get_custom),
    (re.compile(_CUSTOM + r"/(?P<name>[^/]+)"), {"DELETE": "delete"}, FakeKube._delete_custom),
    (re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods"), {"GET": "list"}, FakeKube._list_pods),
    (
        re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log"),
        {"GET": "get"},
        lambda fake, a, q, b: FakeKube._pod_log(fake, {**a, "resource": "pods/log"}, q, b),
    ),
]
"""(path pattern, method → RBAC verb, handler). The resource checked against `forbidden` is the route's
`plural` (custom objects), else its `resource` ('pods/log'), else 'pods'."""


class _Handler(BaseHTTPRequestHandler):
    """Routes every method to FakeKube.handle; a log is sent as it comes (chunked), everything else as JSON."""

    server_state: FakeKube
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            status, body = self.server_state.handle(self.command, self.path, self.headers.get("Authorization"), raw)
        except _Answer as answer:
            status, body = answer.status, _status(answer.status, answer.reason, answer.message, answer.details)
        except json.JSONDecodeError as exc:
            status, body = 400, _status(400, "BadRequest", f"body is not JSON: {exc}")
        if isinstance(body, Iterator):
            self._stream(status, body)
            return
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _stream(self, status: int, lines: Iterator[str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for line in lines:
                data = (line + "\n").encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading (Ctrl-C on a followed log)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read `FakeKube.requests` instead."""


@contextmanager
def running(**kwargs: Any) -> Iterator[FakeKube]:
    """A started FakeKube, stopped on exit."""
    fake = FakeKube(**kwargs)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def pytorchjob(
    namespace: str, name: str, workflow: str, pipeline: str, stage: str, finished: str | None = None
) -> dict[str, Any]:
    """A PyTorchJob as the operator shows it: labels of workflows/pytorchjob.py, conditions Created, Running and
    (when `finished` is 'Succeeded' or 'Failed') that one appended last."""
    conditions = [
        {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
        {"type": "Running", "status": "False" if finished else "True", "reason": "PyTorchJobRunning"},
    ]
    if finished:
        conditions.append({"type": finished, "status": "True", "reason": f"PyTorchJob{finished}"})
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/part-of": "posttrain",
                "posttrain.dev/pipeline": pipeline,
                "posttrain.dev/stage": stage,
                "workflows.argoproj.io/workflow": workflow,
            },
        },
        "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "restartPolicy": "Never", "template": {}}}},
        "status": {"conditions": conditions},
    }
