"""`--watch`: a live table of a workflow's DAG nodes, polled from the Argo server until the run ends.

`render` is deterministic (the clock is a parameter) so tests check the table without a terminal; `watch` polls
and redraws it with rich's Live display.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from hera.workflows.models import NodeStatus, Workflow

from run.durations import format_duration
from workflows.argo import ArgoClient, ArgoError

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

FINAL_PHASES = frozenset({"Succeeded", "Failed", "Error"})
"""Workflow phases after which nothing changes."""

DEFAULT_INTERVAL_S = 5.0
"""Seconds between two polls."""

MAX_CONSECUTIVE_FAILURES = 5
"""Polls in a row that may fail for a retriable reason (server briefly unreachable) before giving up."""

# Node types worth a row: the steps a user recognises, not Argo's internal grouping nodes.
_SHOWN_TYPES = frozenset({"Pod", "DAG", "Steps", "Retry", "Skipped", "Suspend", "Container", "HTTP", "Plugin"})

_PHASE_STYLE = {
    "Succeeded": "green",
    "Failed": "red",
    "Error": "red",
    "Running": "cyan",
    "Pending": "yellow",
    "Skipped": "dim",
    "Omitted": "dim",
}


@dataclass(frozen=True)
class NodeRow:
    """One line of the table."""

    name: str
    type: str
    phase: str
    started: str
    duration: str
    message: str


def _time(value: Any) -> datetime | None:
    """A Hera `Time` (or None) as an aware datetime."""
    if value is None:
        return None
    moment = getattr(value, "root", value)
    return moment if isinstance(moment, datetime) else None


def _duration(started: datetime | None, finished: datetime | None, now: datetime) -> str:
    if started is None:
        return ""
    return format_duration(((finished or now) - started).total_seconds())


def _started(started: datetime | None) -> str:
    return started.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if started else ""


def node_rows(workflow: Workflow, now: datetime) -> list[NodeRow]:
    """The rows of the table: shown nodes, by start time (not yet started last), then by name."""
    status = workflow.status
    nodes: dict[str, NodeStatus] = (status.nodes if status is not None else None) or {}
    root = workflow.metadata.name
    shown = [n for n in nodes.values() if (n.type or "") in _SHOWN_TYPES and n.name != root]
    far_future = datetime.max.replace(tzinfo=timezone.utc)

    def order(n: NodeStatus) -> tuple[datetime, str]:
        return (_time(n.started_at) or far_future, n.display_name or n.name or "")

    rows = []
    for n in sorted(shown, key=order):
        started, finished = _time(n.started_at), _time(n.finished_at)
        rows.append(
            NodeRow(
                name=n.display_name or n.name or n.id or "",
                type=n.type or "",
                phase=n.phase or "Pending",
                started=_started(started),
                duration=_duration(started, finished, now),
                message=" ".join((n.message or "").split()),
            )
        )
    return rows


def workflow_phase(workflow: Workflow) -> str:
    """The workflow's phase; 'Pending' before the controller has picked it up."""
    return (workflow.status.phase if workflow.status is not None else None) or "Pending"


def render(workflow: Workflow, now: datetime, ui_url: str | None = None) -> RenderableType:
    """The table for one poll: a title with the workflow's phase and duration, one row per node."""
    from rich.table import Table
    from rich.text import Text

    status = workflow.status
    phase = workflow_phase(workflow)
    started = _time(status.started_at) if status is not None else None
    finished = _time(status.finished_at) if status is not None else None
    title = f"{workflow.metadata.name}  {phase}"
    if started is not None:
        title += f"  {_duration(started, finished, now)}"
    caption_parts = []
    if status is not None and status.message:
        caption_parts.append(" ".join(status.message.split()))
    if ui_url:
        caption_parts.append(ui_url)
    table = Table(title=title, caption="\n".join(caption_parts) or None, title_justify="left", expand=False)
    for column in ("step", "type", "phase", "started (UTC)", "duration"):
        table.add_column(column, no_wrap=True)
    table.add_column("message", overflow="fold")
    for row in node_rows(workflow, now):
        table.add_row(
            row.name,
            row.type,
            Text(row.phase, style=_PHASE_STYLE.get(row.phase, "")),
            row.started,
            row.duration,
            row.message,
        )
    return table


def render_text(workflow: Workflow, now: datetime, ui_url: str | None = None, width: int = 160) -> str:
    """`render` as plain text (no colours, fixed width): what tests compare."""
    from io import StringIO

    from rich.console import Console

    console = Console(file=StringIO(), width=width, color_system=None, force_terminal=False, legacy_windows=False)
    console.print(render(workflow, now, ui_url))
    return console.file.getvalue()  # type: ignore[attr-defined]


def watch(
    client: ArgoClient,
    name: str,
    *,
    interval: float = DEFAULT_INTERVAL_S,
    console: Console | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
) -> int:
    """Poll workflow `name` and redraw its table until its phase is final: 0 if it Succeeded, 1 otherwise.

    A poll that fails for a retriable reason is retried (up to MAX_CONSECUTIVE_FAILURES in a row); any other
    ArgoError propagates. Ctrl-C stops watching (exit 130); the workflow keeps running.
    """
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    url = client.ui_url(name)
    failures = 0
    workflow: Workflow | None = None
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                try:
                    workflow = client.get_workflow(name)
                    failures = 0
                except ArgoError as exc:
                    failures += 1
                    if not exc.retriable or failures >= MAX_CONSECUTIVE_FAILURES:
                        raise
                    sleep(interval)
                    continue
                live.update(render(workflow, clock(), url), refresh=True)
                if workflow_phase(workflow) in FINAL_PHASES:
                    break
                sleep(interval)
    except KeyboardInterrupt:
        console.print(f"stopped watching; {name} keeps running: {url}", soft_wrap=True)
        return 130
    phase = workflow_phase(workflow)
    console.print(f"{name} {phase}: {url}", soft_wrap=True)
    return 0 if phase == "Succeeded" else 1
