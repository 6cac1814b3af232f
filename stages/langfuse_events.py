"""Stage lifecycle events in Langfuse: start, checkpoint, end and error of every stage, one trace per pipeline run.

Sent with the Langfuse SDK (`langfuse.Langfuse.create_event`, OpenTelemetry spans to the server's OTLP endpoint),
only when a server and both keys are known: the server from spec.tracking.langfuse_host, else $LANGFUSE_HOST; the
keys from LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY (in the cluster from the Secret keys named in
cluster.secrets). The trace id is derived from the run directory, so every stage and every attempt of a run lands
in the same trace. Event names are `<stage>.<event>`; metadata holds the stage, its config hash and what the event
knows (attempt, step, checkpoint, status).

A Langfuse outage never fails a stage: each event is flushed at once (an export gives up after TIMEOUT_SECONDS)
and a failed export is one warning, after which events are skipped for a while (the tracker's breaker).
Everything sent goes through the caller's masking first. The SDK gets a TracerProvider of its own, so no other
OpenTelemetry instrumentation in the process (MLflow tracing) sends to Langfuse, and Langfuse's spans go nowhere
else.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http"
"""Where the OTLP exporter the SDK uses reports a failed export (it does not raise)."""
TIMEOUT_SECONDS = 5
"""How long one export may take, retries included."""

_clients: dict[tuple[str, str], Any] = {}


class _ExportFailures(logging.Handler):
    """Collects the exporter's error records, instead of letting its retry warnings flood the stage log."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or not self.errors:
            self.errors.append(record.getMessage())


def _client(host: str, public_key: str, secret_key: str) -> Any:
    """One SDK client per server and key in a process (the SDK keeps one set of resources per public key)."""
    key = (host, public_key)
    if key not in _clients:
        from langfuse import Langfuse
        from opentelemetry.sdk.trace import TracerProvider

        _clients[key] = Langfuse(
            public_key=public_key,
            secret_key=secret_key,
            base_url=host,
            timeout=TIMEOUT_SECONDS,
            tracer_provider=TracerProvider(),
        )
    return _clients[key]


class LangfuseEvents:
    """The events of one stage attempt; `enabled` is False (and every call a no-op) without a server and keys."""

    def __init__(
        self,
        run_root: str,
        pipeline: str,
        stage: str,
        base_metadata: dict[str, Any],
        host: str | None,
        mask: Callable[[Any], Any],
        breaker: Any,
    ) -> None:
        self.host = (host or os.environ.get("LANGFUSE_HOST", "")).rstrip("/")
        self.public_key = os.environ.get("LANGFUSE_PUBLIC_KEY", "")
        self.secret_key = os.environ.get("LANGFUSE_SECRET_KEY", "")
        self.enabled = bool(self.host and self.public_key and self.secret_key)
        self.run_root = run_root
        self.pipeline = pipeline
        self.stage = stage
        self.base_metadata = base_metadata
        self.mask = mask
        self.breaker = breaker
        """Has `ready()` (False for a while after a failure: the event is skipped) and `failed(what, exc)`."""
        self.trace_id = ""
        if self.enabled:
            from langfuse import Langfuse

            self.trace_id = Langfuse.create_trace_id(seed=run_root)

    def event(
        self, name: str, level: str = "DEFAULT", message: str = "", metadata: dict[str, Any] | None = None
    ) -> None:
        """Send `<stage>.<name>` now (level DEFAULT, WARNING or ERROR); a failure calls `failed`, never raises."""
        if not self.enabled or not self.breaker.ready():
            return
        exporter = logging.getLogger(EXPORTER_LOGGER)
        failures = _ExportFailures()
        exporter.addHandler(failures)
        propagate, exporter.propagate = exporter.propagate, False
        try:
            from langfuse import propagate_attributes

            client = _client(self.host, self.public_key, self.secret_key)
            run = os.path.basename(self.run_root)
            # The trace is named after the run and tagged with the pipeline, whichever stage's event comes first.
            with propagate_attributes(trace_name=run, tags=[self.pipeline]):
                client.create_event(
                    trace_context={"trace_id": self.trace_id},
                    name=f"{self.stage}.{name}",
                    level=level,
                    status_message=self.mask(message[:1000]) or None,
                    metadata=self.mask(
                        {"pipeline": self.pipeline, "run": run, **self.base_metadata} | (metadata or {})
                    ),
                )
            client.flush()
        except Exception as exc:
            self.breaker.failed(f"sending the {name} event", exc)
            return
        finally:
            exporter.removeHandler(failures)
            exporter.propagate = propagate
        if failures.errors:
            self.breaker.failed(f"sending the {name} event", ConnectionError(failures.errors[0]))
