"""The Argo server client: create-or-update templates, submit and read workflows, with errors a user can act on.

Built on Hera's `WorkflowsService`. Configuration comes from the environment, as for the `argo` CLI:

- `ARGO_SERVER`: `host:port` or a URL (`https://` unless a scheme is given; `ARGO_SECURE=false` picks `http://`).
- `ARGO_TOKEN`: the bearer token, with or without the `Bearer ` prefix (`argo auth token` prints it with).
- `ARGO_NAMESPACE`: the namespace; default: the spec's `cluster.namespace`. Objects are never moved to another
  namespace than the one they were compiled for.
- `ARGO_INSECURE_SKIP_VERIFY`: `true` to accept a self-signed certificate.
- `ARGO_BASE_HREF`: the path the server is served under (e.g. `/argo/`), for the API and the UI links.

The token is never part of a message, a repr or a log line.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, TypeVar
from urllib.parse import quote, urlsplit

import requests
from hera.workflows import CronWorkflow as HeraCronWorkflow
from hera.workflows import Workflow as HeraWorkflow
from hera.workflows import WorkflowTemplate as HeraWorkflowTemplate
from hera.workflows.models import (
    CreateCronWorkflowRequest,
    UpdateCronWorkflowRequest,
    Workflow,
    WorkflowCreateRequest,
    WorkflowRetryRequest,
    WorkflowStopRequest,
    WorkflowTemplateCreateRequest,
    WorkflowTemplateUpdateRequest,
    WorkflowTerminateRequest,
)
from hera.workflows.models import CronWorkflow as CronWorkflowModel
from hera.workflows.models import WorkflowTemplate as WorkflowTemplateModel
from hera.workflows.service import WorkflowsService
from pydantic import ValidationError

DEFAULT_TIMEOUT_S = 30.0
"""Seconds to wait for the server to connect and to answer one request."""

_UPDATE_ATTEMPTS = 3
"""Get-and-update attempts when another writer changes the object in between (409 on update)."""

_SERVER_LABELS = frozenset(
    f"workflows.argoproj.io/{key}"
    for key in (
        "creator",
        "creator-email",
        "creator-preferred-username",
        "actor",
        "actor-email",
        "actor-preferred-username",
        "action",
    )
)
"""Labels the Argo server adds to record who wrote an object."""
_SERVER_ANNOTATIONS = frozenset({"kubectl.kubernetes.io/last-applied-configuration"})
"""Annotations written by other tools than ours (`kubectl apply` of a rendered template)."""

T = TypeVar("T")


class ArgoError(Exception):
    """A failure talking to the Argo server; the message says what to set or fix.

    `status` is the HTTP status the server answered (None when there was no answer), and `retriable` says
    whether trying again later can help (unreachable server, 5xx).
    """

    def __init__(self, message: str, status: int | None = None, retriable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retriable = retriable


class StaleObject(ArgoError):
    """The server's copy of an object is missing or differs from the compiled one, and the identity behind
    ARGO_TOKEN may not write it (403): someone allowed to has to register the pipeline.

    The message is the server's refusal with the RBAC it lacks; `summary` says what is wrong with the server's copy.
    """

    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message, 403)
        self.summary = summary


# --------------------------------------------------------------------------- configuration


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ArgoError(f"{name}={raw!r} is not a boolean: set it to true or false")


def _normalise_base_href(raw: str) -> str:
    """'/argo', 'argo/', '' → '/argo/', '/argo/', '/'."""
    path = "/" + raw.strip().strip("/")
    return path if path == "/" else path + "/"


@dataclass(frozen=True)
class ArgoConfig:
    """Where the Argo server is and how to authenticate to it."""

    server: str
    """Scheme, host and port, no path and no trailing slash: 'https://argo.example.com:2746'."""
    namespace: str
    """Namespace the workflows are created in."""
    base_href: str = "/"
    """Path prefix of the API and the UI, with leading and trailing slash."""
    token: str | None = field(default=None, repr=False)
    """The bearer token without its 'Bearer ' prefix; never printed."""
    verify_tls: bool = True
    """Verify the server's TLS certificate."""

    @classmethod
    def from_env(cls, default_namespace: str, env: Mapping[str, str] | None = None) -> ArgoConfig:
        """The configuration from ARGO_* variables; `default_namespace` (the spec's) when ARGO_NAMESPACE is unset."""
        env = os.environ if env is None else env
        raw_server = env.get("ARGO_SERVER", "").strip()
        if not raw_server:
            raise ArgoError(
                "ARGO_SERVER is not set: set it to the Argo server's host:port or URL, e.g. "
                "ARGO_SERVER=localhost:2746 after `kubectl -n argo port-forward svc/argo-server 2746:2746` "
                "(or use --render DIR to write the manifests, or --local to run on this machine)"
            )
        if "://" not in raw_server:
            secure = _parse_bool("ARGO_SECURE", env.get("ARGO_SECURE", "true"))
            raw_server = ("https://" if secure else "http://") + raw_server
        parts = urlsplit(raw_server)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ArgoError(
                f"ARGO_SERVER={raw_server!r} is not a server address: set it to host:port, "
                "https://host:port or http://host:port"
            )
        base_href = env.get("ARGO_BASE_HREF")
        base_href = _normalise_base_href(base_href if base_href is not None else parts.path)
        token = env.get("ARGO_TOKEN", "").strip()
        if token.lower().startswith("bearer "):
            token = token[len("bearer ") :].strip()
        return cls(
            server=f"{parts.scheme}://{parts.netloc}",
            namespace=env.get("ARGO_NAMESPACE", "").strip() or default_namespace,
            base_href=base_href,
            token=token or None,
            verify_tls=not _parse_bool("ARGO_INSECURE_SKIP_VERIFY", env.get("ARGO_INSECURE_SKIP_VERIFY", "false")),
        )

    @property
    def api_root(self) -> str:
        """The URL Hera joins API paths onto; it must end in '/' or urljoin drops the base href."""
        return self.server + self.base_href

    def ui_url(self, name: str, namespace: str | None = None) -> str:
        """The Argo UI page of workflow `name`."""
        ns = namespace or self.namespace
        return f"{self.server}{self.base_href}workflows/{quote(ns)}/{quote(name)}"

    def require_namespace(self, compiled: str) -> None:
        """Refuse objects compiled for another namespace than this one: the PyTorchJobs and InferenceService
        inside them are created in the compiled one, and owner references cannot cross namespaces."""
        if compiled != self.namespace:
            raise ArgoError(
                f"ARGO_NAMESPACE is {self.namespace!r} but the pipeline's cluster.namespace is {compiled!r}: "
                f"unset ARGO_NAMESPACE, or set cluster.namespace to {self.namespace!r} in the pipeline file or a "
                "profile (the namespace is part of the shared template)"
            )


# --------------------------------------------------------------------------- errors


class _ServerAnswer(Exception):
    """A non-2xx answer, raised before Hera turns it into its own (less precise) exception."""

    def __init__(self, status: int, message: str, is_json: bool) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.is_json = is_json


def _answer_message(resp: requests.Response) -> tuple[str, bool]:
    """The server's error message ('message' of the JSON body, else the text) and whether it was JSON."""
    try:
        body = resp.json()
    except ValueError:
        return " ".join(resp.text.split())[:300] or resp.reason or "", False
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"], True
    return json.dumps(body)[:300], True


class _Service(WorkflowsService):
    """Hera's service with a request timeout, and non-2xx answers raised with their status and message."""

    def __init__(self, config: ArgoConfig, timeout: float) -> None:
        super().__init__(
            host=config.api_root,
            verify_ssl=config.verify_tls,
            token=config.token,
            namespace=config.namespace,
        )
        self.timeout = timeout

    def _request(self, method: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout)
        resp = self.session.request(method, **kwargs)
        if not resp.ok:
            message, is_json = _answer_message(resp)
            raise _ServerAnswer(resp.status_code, message, is_json)
        return resp


Verb = Literal["create", "get", "list", "update", "delete"]

_GRPC_HTTP = {3: 400, 5: 404, 7: 403, 16: 401, 9: 400, 13: 500, 14: 503}
"""HTTP status of a grpc code, for an error inside a streamed answer."""


@dataclass(frozen=True)
class _Call:
    """What a request was doing, for the error message."""

    verb: Verb
    """The RBAC verb the request needs."""
    resource: str
    """Plural Kubernetes resource: workflowtemplates, cronworkflows, workflows."""
    namespace: str
    name: str | None = None
    action: str | None = None
    """What the user asked for when it is not the verb itself ('stop', 'retry', 'read the logs of')."""

    @property
    def kind(self) -> str:
        kinds = {"workflowtemplates": "WorkflowTemplate", "cronworkflows": "CronWorkflow", "workflows": "Workflow"}
        return kinds.get(self.resource, self.resource)

    @property
    def what(self) -> str:
        target = f"{self.namespace}/{self.name}" if self.name else f"in namespace {self.namespace}"
        if self.verb == "list" and not self.name:
            return f"list {self.kind}s {target}"
        return f"{self.action or self.verb} {self.kind} {target}"


# --------------------------------------------------------------------------- client


@dataclass(frozen=True)
class Applied:
    """The outcome of a create-or-update."""

    kind: str
    namespace: str
    name: str
    action: Literal["created", "updated", "unchanged"]

    def __str__(self) -> str:
        if self.action == "unchanged":
            return f"{self.kind} {self.namespace}/{self.name} is up to date"
        return f"{self.action} {self.kind} {self.namespace}/{self.name}"


class ArgoClient:
    """Talks to one Argo server, in one namespace. Every failure is an ArgoError with an actionable message."""

    def __init__(self, config: ArgoConfig, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.config = config
        self._service = _Service(config, timeout)

    @classmethod
    def from_env(cls, default_namespace: str) -> ArgoClient:
        """A client configured from ARGO_* environment variables."""
        return cls(ArgoConfig.from_env(default_namespace))

    def close(self) -> None:
        """Close the HTTP session."""
        self._service.close()

    def __enter__(self) -> ArgoClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def namespace(self) -> str:
        """The namespace every call goes to."""
        return self.config.namespace

    def ui_url(self, name: str) -> str:
        """The Argo UI page of workflow `name`."""
        return self.config.ui_url(name)

    # ----------------------------------------------------------------- operations

    def ensure_workflow_template(self, template: HeraWorkflowTemplate) -> Applied:
        """Create the WorkflowTemplate, or update it in place when it exists and differs; an identical one is left
        alone, so an identity that may only read templates can submit an unchanged pipeline."""
        model: WorkflowTemplateModel = template.build()
        ns, name = self.namespace, model.metadata.name
        svc = self._service
        return self._create_or_update(
            "WorkflowTemplate",
            "workflowtemplates",
            model,
            create=lambda: svc.create_workflow_template(
                WorkflowTemplateCreateRequest(namespace=ns, template=model), namespace=ns
            ),
            get=lambda: svc.get_workflow_template(name, namespace=ns),
            update=lambda: svc.update_workflow_template(
                name, WorkflowTemplateUpdateRequest(namespace=ns, name=name, template=model), namespace=ns
            ),
        )

    def ensure_cron_workflow(self, cron: HeraCronWorkflow) -> Applied:
        """Create the CronWorkflow, or update it in place when it exists and differs."""
        model: CronWorkflowModel = cron.build()
        ns, name = self.namespace, model.metadata.name
        svc = self._service
        return self._create_or_update(
            "CronWorkflow",
            "cronworkflows",
            model,
            create=lambda: svc.create_cron_workflow(
                CreateCronWorkflowRequest(namespace=ns, cron_workflow=model), namespace=ns
            ),
            get=lambda: svc.get_cron_workflow(name, namespace=ns),
            update=lambda: svc.update_cron_workflow(
                name, UpdateCronWorkflowRequest(namespace=ns, name=name, cron_workflow=model), namespace=ns
            ),
        )

    def _create_or_update(
        self,
        kind: str,
        resource: str,
        model: Any,
        create: Callable[[], Any],
        get: Callable[[], Any],
        update: Callable[[], Any],
    ) -> Applied:
        """Get; create when missing, leave alone when equal, else update with the server's resourceVersion
        (retrying a lost race). A 403 on the write is a StaleObject: the server's copy is missing or out of date."""
        self._claim_namespace(model)
        ns, name = self.namespace, model.metadata.name
        for attempt in range(_UPDATE_ATTEMPTS):
            try:
                current = self._run(_Call("get", resource, ns, name), get)
            except ArgoError as exc:
                if exc.status != 404:
                    raise
                try:
                    self._write(_Call("create", resource, ns, name), create, "does not exist on the Argo server")
                    return Applied(kind, ns, name, "created")
                except ArgoError as exc:
                    if exc.status != 409 or attempt == _UPDATE_ATTEMPTS - 1:
                        raise
                    continue  # created by someone else in between: compare with theirs
            if comparable(current) == comparable(model):
                return Applied(kind, ns, name, "unchanged")
            model.metadata.resource_version = current.metadata.resource_version
            try:
                self._write(
                    _Call("update", resource, ns, name),
                    update,
                    "on the Argo server is out of date (it differs from the compiled pipeline)",
                )
                return Applied(kind, ns, name, "updated")
            except ArgoError as exc:
                if exc.status != 409 or attempt == _UPDATE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _write(self, call: _Call, fn: Callable[[], Any], state: str) -> None:
        """Create or update; a 403 becomes a StaleObject saying what is wrong with the server's copy (`state`)."""
        try:
            self._run(call, fn)
        except ArgoError as exc:
            if exc.status != 403:
                raise
            summary = (
                f"{call.kind} {call.namespace}/{call.name} {state}, and the identity behind ARGO_TOKEN may not "
                f"{call.verb} it (403 Forbidden)"
            )
            raise StaleObject(str(exc), summary) from None

    def _claim_namespace(self, model: Any) -> None:
        """Put `model` in this client's namespace, which must be the one it was compiled for (when it names one)."""
        if model.metadata.namespace:
            self.config.require_namespace(model.metadata.namespace)
        model.metadata.namespace = self.namespace

    def get_cron_workflow(self, name: str) -> CronWorkflowModel | None:
        """The CronWorkflow called `name`, or None when there is none."""
        try:
            return self._run(
                _Call("get", "cronworkflows", self.namespace, name),
                lambda: self._service.get_cron_workflow(name, namespace=self.namespace),
            )
        except ArgoError as exc:
            if exc.status == 404:
                return None
            raise

    def submit_workflow(self, workflow: HeraWorkflow) -> str:
        """Create the Workflow (usually named by generateName); returns the name the server gave it."""
        model: Workflow = workflow.build()
        self._claim_namespace(model)
        ns = self.namespace
        created = self._run(
            _Call("create", "workflows", ns),
            lambda: self._service.create_workflow(WorkflowCreateRequest(namespace=ns, workflow=model), namespace=ns),
        )
        if not created.metadata.name:
            raise ArgoError(f"the Argo server at {self.config.api_root} created a workflow but returned no name")
        return created.metadata.name

    def get_workflow(self, name: str) -> Workflow:
        """The Workflow called `name`, with its status (phase and nodes)."""
        return self._run(
            _Call("get", "workflows", self.namespace, name),
            lambda: self._service.get_workflow(name, namespace=self.namespace),
        )

    def list_workflows(self, label_selector: str | None = None) -> list[Workflow]:
        """The workflows of the namespace matching `label_selector`, newest first (by creation time)."""
        listed = self._run(
            _Call("list", "workflows", self.namespace),
            lambda: self._service.list_workflows(namespace=self.namespace, label_selector=label_selector),
        )
        items = list(listed.items or [])  # the server answers `items: null` for none

        def created(wf: Workflow) -> str:
            stamp = wf.metadata.creation_timestamp
            return str(getattr(stamp, "root", stamp) or "")

        return sorted(items, key=lambda wf: (created(wf), wf.metadata.name or ""), reverse=True)

    def stop_workflow(self, name: str, message: str | None = None) -> Workflow:
        """Stop: running steps get SIGTERM, no new step starts, the exit handler runs."""
        ns = self.namespace
        return self._run(
            _Call("update", "workflows", ns, name, "stop"),
            lambda: self._service.stop_workflow(
                name, WorkflowStopRequest(name=name, namespace=ns, message=message), namespace=ns
            ),
        )

    def terminate_workflow(self, name: str) -> Workflow:
        """Terminate: like stop, but Argo runs no exit handler."""
        ns = self.namespace
        return self._run(
            _Call("update", "workflows", ns, name, "terminate"),
            lambda: self._service.terminate_workflow(
                name, WorkflowTerminateRequest(name=name, namespace=ns), namespace=ns
            ),
        )

    def retry_workflow(
        self, name: str, restart_successful: bool = False, node_field_selector: str | None = None
    ) -> Workflow:
        """Retry a Failed or Errored workflow from its failed nodes (and, with `restart_successful`, the succeeded
        nodes `node_field_selector` matches)."""
        ns = self.namespace
        request = WorkflowRetryRequest(
            name=name,
            namespace=ns,
            restart_successful=restart_successful or None,
            node_field_selector=node_field_selector,
        )
        return self._run(
            _Call("update", "workflows", ns, name, "retry"),
            lambda: self._service.retry_workflow(name, request, namespace=ns),
        )

    def delete_workflow(self, name: str) -> None:
        """Delete the workflow (its pods, and the jobs it owns, go with it)."""
        self._run(
            _Call("delete", "workflows", self.namespace, name),
            lambda: self._service.delete_workflow(name, namespace=self.namespace),
        )

    def workflow_logs(
        self,
        name: str,
        *,
        selector: str | None = None,
        container: str = "main",
        follow: bool = False,
        tail_lines: int | None = None,
    ) -> Iterator[tuple[str, str]]:
        """(pod name, line) of the logs of the workflow's pods that match the label `selector`, through the
        server's log route (newline-delimited JSON, streamed). Hera's `workflow_logs` reads one entry only."""
        ns = self.namespace
        call = _Call("get", "workflows", ns, name, "read the logs of")
        params: dict[str, str] = {"logOptions.container": container}
        if selector:
            params["selector"] = selector
        if follow:
            params["logOptions.follow"] = "true"
        if tail_lines is not None:
            params["logOptions.tailLines"] = str(tail_lines)
        svc = self._service
        url = f"{self.config.api_root}api/v1/workflows/{quote(ns)}/{quote(name)}/log"
        with self._translating(call):
            resp = svc._request(
                "get",
                url=url,
                params=params,
                headers={"Authorization": svc.token} if svc.token else {},
                verify=svc.verify_ssl,
                stream=True,
                timeout=(svc.timeout, None) if follow else svc.timeout,  # a followed log may be quiet
            )
        with resp, self._translating(call):
            for raw in resp.iter_lines():
                if not raw:
                    continue
                entry = json.loads(raw)
                if "error" in entry:  # grpc-gateway ends a failed stream with its error
                    error = entry["error"] or {}
                    status = _GRPC_HTTP.get(error.get("code"), 500)
                    raise _ServerAnswer(status, str(error.get("message", "")), True)
                result = entry.get("result") or {}
                yield str(result.get("podName", "")), str(result.get("content", ""))

    # ----------------------------------------------------------------- error mapping

    def _run(self, call: _Call, fn: Callable[[], T]) -> T:
        with self._translating(call):
            return fn()

    @contextmanager
    def _translating(self, call: _Call) -> Iterator[None]:
        """Turn transport failures and non-2xx answers into ArgoError messages that say what to fix."""
        where = self.config.api_root
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=DeprecationWarning, module="hera")
                yield
        except _ServerAnswer as answer:
            raise self._answer_error(call, answer) from None
        except (requests.exceptions.JSONDecodeError, ValidationError):
            # A 2xx answer that is not an Argo object: usually the UI's index page, i.e. a wrong path.
            raise ArgoError(
                f"the server at {where} answered {call.what} with something that is not an Argo API response: "
                "check ARGO_SERVER and ARGO_BASE_HREF (the path prefix the Argo server is served under)"
            ) from None
        except requests.exceptions.SSLError:
            raise ArgoError(
                f"cannot reach the Argo server at {where}: the TLS handshake failed "
                "(certificate not trusted, or the server does not speak TLS): set ARGO_INSECURE_SKIP_VERIFY=true "
                "for a self-signed cert, or ARGO_SERVER=http://HOST:PORT if the server serves plain HTTP",
                retriable=True,
            ) from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            reason = "timed out" if isinstance(exc, requests.exceptions.Timeout) else "connection failed"
            raise ArgoError(
                f"cannot reach the Argo server at {where} ({reason}): set ARGO_SERVER to the server's host:port "
                "(e.g. localhost:2746 with `kubectl -n argo port-forward svc/argo-server 2746:2746`), "
                "and ARGO_INSECURE_SKIP_VERIFY=true for a self-signed cert",
                retriable=True,
            ) from None
        except requests.exceptions.RequestException as exc:
            raise ArgoError(
                f"cannot talk to the Argo server at {where} ({type(exc).__name__}): check ARGO_SERVER "
                "and ARGO_BASE_HREF",
                retriable=True,
            ) from None

    def _answer_error(self, call: _Call, answer: _ServerAnswer) -> ArgoError:
        status, said = answer.status, answer.message
        where = self.config.api_root
        if status == 401:
            hint = (
                "ARGO_TOKEN is not set: set ARGO_TOKEN"
                if self.config.token is None
                else "the token in ARGO_TOKEN was rejected: set ARGO_TOKEN to a valid token"
            )
            return ArgoError(
                f"the Argo server at {where} refused to {call.what} (401 Unauthorized): {hint} "
                '(e.g. `export ARGO_TOKEN="$(argo auth token)"`, or a ServiceAccount token)',
                status,
            )
        if status == 403:
            return ArgoError(
                f"the Argo server refused to {call.what} (403 Forbidden): the identity behind ARGO_TOKEN lacks "
                f"the RBAC verb '{call.verb}' on resource '{call.resource}' (API group argoproj.io) in namespace "
                f"'{call.namespace}': bind it to the role that grants it (manifests/base/rbac.yaml: "
                "posttrain-submitter submits and follows runs, posttrain-registrar registers templates and "
                f"schedules). Server said: {said}",
                status,
            )
        if status == 404:
            if not answer.is_json:
                return ArgoError(
                    f"the server at {where} has no Argo API there (404 for {call.what}): check ARGO_SERVER and "
                    "ARGO_BASE_HREF (the path prefix the Argo server is served under, e.g. /argo/)",
                    status,
                )
            if "namespace" in said.lower() and call.namespace in said:
                return ArgoError(
                    f"namespace '{call.namespace}' was not found (404 for {call.what}): set ARGO_NAMESPACE, or "
                    "cluster.namespace in the spec, to a namespace that exists and that Argo manages. "
                    f"Server said: {said}",
                    status,
                )
            return ArgoError(f"not found: cannot {call.what} (404). Server said: {said}", status)
        if status == 409:
            return ArgoError(
                f"conflict: cannot {call.what} (409): another client changed or created it at the same time; "
                f"run the command again. Server said: {said}",
                status,
            )
        if status in (400, 422):
            return ArgoError(
                f"the Argo server rejected the request to {call.what} ({status}): {said}. If the message names "
                "a field of the manifest, check the pipeline spec; `--render DIR` writes the manifests to inspect",
                status,
            )
        return ArgoError(
            f"the Argo server at {where} failed to {call.what} ({status}): {said}. Try again, or check the "
            "argo-server logs",
            status,
            retriable=status >= 500,
        )


# --------------------------------------------------------------------------- comparing with the server's copy


def comparable(model: Any) -> dict[str, Any]:
    """What decides whether the server's copy of an object equals ours: name, our labels and annotations, and
    spec, with what a round trip through the server changes taken out (empty values the Go encoder drops or adds,
    quantities it rewrites in canonical form). Server-set metadata (uid, resourceVersion, creator labels) is ignored.
    """
    doc = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    meta = doc.get("metadata") or {}
    return _without_empty(
        {
            "name": meta.get("name"),
            "labels": {k: v for k, v in (meta.get("labels") or {}).items() if k not in _SERVER_LABELS},
            "annotations": {k: v for k, v in (meta.get("annotations") or {}).items() if k not in _SERVER_ANNOTATIONS},
            "spec": doc.get("spec"),
        }
    )


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$")
_QUANTITY_FACTORS = {
    None: Decimal(1),
    "m": Decimal("0.001"),
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
}


def _quantity(value: Any) -> Any:
    """A Kubernetes quantity as its number ('2048Mi' and '2Gi' alike); anything else unchanged."""
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    if match is None:
        return value
    return str((Decimal(match[1]) * _QUANTITY_FACTORS[match[2]]).normalize())


def _without_empty(node: Any, key: str = "") -> Any:
    """`node` without None, '', False, {} and [] values, which the server's Go encoder drops (or adds, for empty
    structs); quantities of `requests`, `limits` and `sizeLimit` as numbers."""
    if isinstance(node, dict):
        quantities = key in ("requests", "limits")
        out = {}
        for k, v in node.items():
            v = _quantity(v) if quantities or k == "sizeLimit" else _without_empty(v, k)
            if not (v is None or v is False or (isinstance(v, (str, dict, list)) and not v)):
                out[k] = v
        return out
    if isinstance(node, list):
        return [_without_empty(v, key) for v in node]
    return node
