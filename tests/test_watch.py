"""--watch: the table's rows and text, and the polling loop's exit codes against the fake server."""

from __future__ import annotations

from datetime import datetime, timezone
from io import StringIO
from typing import Any

import pytest
from fake_argo import node, running, workflow_status
from hera.workflows.models import Workflow
from rich.console import Console

from spec.loading import load_pipeline
from workflows.argo import ArgoClient, ArgoConfig, ArgoError
from workflows.compile import compile_pipeline
from workflows.watch import format_duration, node_rows, render_text, watch

NOW = datetime(2026, 11, 2, 2, 30, 0, tzinfo=timezone.utc)


def _workflow(status: dict[str, Any], name: str = "korean-llm-abcde") -> Workflow:
    meta = {"name": name, "namespace": "llm-training"}
    return Workflow.model_validate({"metadata": meta, "spec": {}, "status": status})


def _running_status() -> dict[str, Any]:
    return workflow_status(
        "Running",
        [
            ("root", {"id": "root", "name": "korean-llm-abcde", "displayName": "korean-llm-abcde", "type": "DAG"}),
            node("sft", "Running", started="2026-11-02T02:10:00Z"),
            node("prepare", "Succeeded", finished="2026-11-02T02:01:05Z"),
            node("rlhf", "Pending", started=None),
            node("cpt", "Failed", started="2026-11-02T02:01:10Z", finished="2026-11-02T02:09:00Z", message="OOM\n"),
            node("group", "Running", type_="TaskGroup"),
        ],
    )


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 12, 754, 7384, -3)] == ["0s", "12s", "12m34s", "2h03m04s", "0s"]


def test_rows_are_ordered_by_start_and_skip_the_root_and_groups() -> None:
    rows = node_rows(_workflow(_running_status()), NOW)
    assert [r.name for r in rows] == ["prepare", "cpt", "sft", "rlhf"]
    prepare, cpt, sft, rlhf = rows
    assert (prepare.phase, prepare.started, prepare.duration) == ("Succeeded", "2026-11-02 02:00:00", "1m05s")
    assert (cpt.duration, cpt.message) == ("7m50s", "OOM")
    assert sft.duration == "20m00s"  # still running: up to now
    assert (rlhf.started, rlhf.duration, rlhf.phase) == ("", "", "Pending")


def test_rendered_text_has_the_title_columns_and_link() -> None:
    text = render_text(_workflow(_running_status()), NOW, ui_url="https://argo/workflows/ns/korean-llm-abcde")
    lines = text.splitlines()
    assert lines[0].strip() == "korean-llm-abcde  Running  30m00s"
    assert all(col in text for col in ("step", "type", "phase", "started (UTC)", "duration", "message"))
    cpt_line = next(line for line in lines if " cpt " in line)
    assert "Failed" in cpt_line and "7m50s" in cpt_line and "OOM" in cpt_line
    assert "https://argo/workflows/ns/korean-llm-abcde" in text
    assert render_text(_workflow(_running_status()), NOW) == render_text(_workflow(_running_status()), NOW)


def test_a_workflow_without_status_renders_as_pending() -> None:
    text = render_text(Workflow.model_validate({"metadata": {"name": "w"}, "spec": {}}), NOW)
    assert text.splitlines()[0].strip() == "w  Pending"


# --------------------------------------------------------------------------- the loop


def _submitted(fake: Any) -> tuple[ArgoClient, str]:
    compiled = compile_pipeline(load_pipeline("korean-llm").spec)
    client = ArgoClient(ArgoConfig.from_env("llm-training", fake.env()))
    client.ensure_workflow_template(compiled.template)
    return client, client.submit_workflow(compiled.workflow)


@pytest.mark.parametrize(("final", "code"), [("Succeeded", 0), ("Failed", 1), ("Error", 1)])
def test_watch_polls_until_final_and_returns_the_exit_code(final: str, code: int) -> None:
    with running() as fake:
        fake.statuses = [
            workflow_status("Pending", []),
            workflow_status("Running", [node("prepare", "Running")]),
            workflow_status(final, [node("prepare", final, finished="2026-11-02T02:05:00Z", message="boom")]),
            workflow_status("Running", []),  # never reached: watching stops at the final phase
        ]
        client, name = _submitted(fake)
        out = StringIO()
        sleeps: list[float] = []
        result = watch(
            client, name, interval=7, console=Console(file=out, width=160), sleep=sleeps.append, clock=lambda: NOW
        )
        gets = [r for r in fake.requests if r.method == "GET" and r.path.endswith(name)]
    assert result == code
    assert len(gets) == 3
    assert sleeps == [7, 7]
    assert f"{name} {final}: {client.ui_url(name)}" in out.getvalue()
    assert "prepare" in out.getvalue()


class _FlakyClient:
    """Raises the given errors on the first polls, then returns a Succeeded workflow."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors
        self.calls = 0

    def ui_url(self, name: str) -> str:
        return f"https://argo/workflows/ns/{name}"

    def get_workflow(self, name: str) -> Workflow:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return _workflow(workflow_status("Succeeded", []), name)


def _watch(client: _FlakyClient, out: StringIO | None = None) -> int:
    console = Console(file=out or StringIO(), width=120)
    return watch(client, "w", interval=0, console=console, sleep=lambda _: None, clock=lambda: NOW)  # type: ignore[arg-type]


def test_watch_rides_out_a_briefly_unreachable_server() -> None:
    client = _FlakyClient([ArgoError("cannot reach", retriable=True), ArgoError("cannot reach", retriable=True)])
    assert _watch(client) == 0
    assert client.calls == 3


def test_watch_gives_up_on_a_non_retriable_error() -> None:
    client = _FlakyClient([ArgoError("403", status=403)])
    with pytest.raises(ArgoError, match="403"):
        _watch(client)
    assert client.calls == 1


def test_watch_gives_up_after_too_many_failures_in_a_row() -> None:
    client = _FlakyClient([ArgoError("down", retriable=True) for _ in range(10)])
    with pytest.raises(ArgoError, match="down"):
        _watch(client)
    assert client.calls == 5


def test_ctrl_c_stops_watching_but_not_the_workflow() -> None:
    out = StringIO()
    assert _watch(_FlakyClient([KeyboardInterrupt()]), out) == 130
    assert "keeps running: https://argo/workflows/ns/w" in out.getvalue()
