"""The exit handler: post a run's outcome (status, failed steps, duration, link) to a Slack incoming webhook.

`python -m workflows.notify --params-dir DIR` reads one file per value in DIR (Argo writes them from
`{{workflow.*}}`): workflow-name, workflow-namespace, status, failures, duration, ui-url, notify-on, note, and
optionally pipeline. The webhook URL comes from the environment (SLACK_WEBHOOK_URL, from a Secret) and is never
printed. A notification is a courtesy: a failed post is a warning and exits 0, never failing the workflow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEBHOOK_ENV = "SLACK_WEBHOOK_URL"
POST_TIMEOUT_S = 15.0
MAX_FAILURES_LISTED = 8
MAX_MESSAGE_CHARS = 300

_EMOJI = {"Succeeded": ":white_check_mark:", "Failed": ":x:", "Error": ":rotating_light:"}


@dataclass(frozen=True)
class Failure:
    """One failed node of the run, from Argo's {{workflow.failures}}."""

    step: str
    message: str
    template: str = ""


@dataclass(frozen=True)
class RunOutcome:
    """What the exit handler knows about the run."""

    workflow: str
    namespace: str
    status: str
    pipeline: str = ""
    failures: list[Failure] = field(default_factory=list)
    duration: str = ""
    ui_url: str = ""
    notify_on: tuple[str, ...] = ()
    note: str = ""
    skipped: str = ""
    """Why the run ended after prepare (unchanged data on a scheduled run); empty when it did not."""


def _read(params_dir: Path, name: str) -> str:
    path = params_dir / name
    return path.read_text(encoding="utf-8").strip() if path.is_file() else ""


def parse_failures(raw: str) -> list[Failure]:
    """Argo's failures JSON (a list of {displayName, message, templateName, phase, ...}); bad input → []."""
    if not raw or raw.startswith("{{"):
        return []
    try:
        items = json.loads(raw)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    failures = []
    seen: set[tuple[str, str]] = set()
    for item in items:
        if not isinstance(item, dict):
            continue
        step = str(item.get("displayName") or item.get("templateName") or item.get("podName") or "?")
        message = " ".join(str(item.get("message") or "").split())
        if (step, message) in seen:  # retries of a step often fail the same way
            continue
        seen.add((step, message))
        failures.append(Failure(step=step, message=message, template=str(item.get("templateName") or "")))
    return failures


def format_run_duration(raw: str) -> str:
    """Argo's {{workflow.duration}} (seconds, e.g. '754.2') as '12m34s'; anything else as given."""
    try:
        total = max(0, int(float(raw)))
    except (ValueError, OverflowError):
        return raw
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _pipeline_of(workflow: str) -> str:
    """'korean-llm-x7k2p' → 'korean-llm' (a generateName suffix is 5 characters)."""
    return re.sub(r"-[a-z0-9]{5}$", "", workflow)


def skip_reason(run_dir: Path | None) -> str:
    """Why prepare ended the run, from its stage.json in the run directory ('' when it did not, or is unknown)."""
    if run_dir is None:
        return ""
    try:
        record = json.loads((run_dir / "prepare" / "stage.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    extra = record.get("extra", {}) if isinstance(record, dict) else {}
    return str(extra.get("skip-reason", "")) if extra.get("proceed") == "false" else ""


def read_outcome(params_dir: Path, run_dir: Path | None = None) -> RunOutcome:
    """The RunOutcome from the files Argo wrote into `params_dir` (and prepare's record in `run_dir`)."""
    workflow = _read(params_dir, "workflow-name")
    ui_url = _read(params_dir, "ui-url")
    namespace = _read(params_dir, "workflow-namespace")
    if ui_url and workflow and "/workflows/" not in ui_url:
        ui_url = f"{ui_url.rstrip('/')}/workflows/{namespace}/{workflow}"
    return RunOutcome(
        workflow=workflow,
        namespace=namespace,
        status=_read(params_dir, "status"),
        pipeline=_read(params_dir, "pipeline") or _pipeline_of(workflow),
        failures=parse_failures(_read(params_dir, "failures")),
        duration=format_run_duration(_read(params_dir, "duration")),
        ui_url=ui_url,
        notify_on=tuple(s.strip() for s in _read(params_dir, "notify-on").split(",") if s.strip()),
        note=_read(params_dir, "note"),
        skipped=skip_reason(run_dir),
    )


def _clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def slack_message(outcome: RunOutcome) -> dict[str, Any]:
    """The Slack payload: a plain-text fallback and blocks (header, fields, failed steps, note, link)."""
    status = f"{outcome.status}, skipped" if outcome.skipped and outcome.status == "Succeeded" else outcome.status
    emoji = ":fast_forward:" if outcome.skipped else _EMOJI.get(outcome.status, ":grey_question:")
    headline = f"{emoji} {outcome.pipeline or outcome.workflow}: {status}"
    fields = [
        f"*Workflow*\n`{outcome.workflow}`" + (f" in `{outcome.namespace}`" if outcome.namespace else ""),
        f"*Status*\n{status}",
    ]
    if outcome.duration:
        fields.append(f"*Duration*\n{outcome.duration}")
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": _clip(headline, 150), "emoji": True}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f} for f in fields]},
    ]
    if outcome.failures:
        lines = [
            f"• *{f.step}*: {_clip(f.message) if f.message else '(no message)'}"
            for f in outcome.failures[:MAX_FAILURES_LISTED]
        ]
        if len(outcome.failures) > MAX_FAILURES_LISTED:
            lines.append(f"…and {len(outcome.failures) - MAX_FAILURES_LISTED} more")
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "*Failed steps*\n" + "\n".join(lines)}})
    if outcome.skipped:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"*Skipped*\n{_clip(outcome.skipped)}"}})
    if outcome.note:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": _clip(outcome.note)}]})
    if outcome.ui_url:
        blocks.append(
            {"type": "section", "text": {"type": "mrkdwn", "text": f"<{outcome.ui_url}|Open the run in Argo>"}}
        )
    text = headline + (f" ({outcome.duration})" if outcome.duration else "")
    if outcome.failures:
        text += " — failed: " + ", ".join(f.step for f in outcome.failures[:MAX_FAILURES_LISTED])
    if outcome.ui_url:
        text += f" {outcome.ui_url}"
    return {"text": text, "blocks": blocks}


def post(url: str, payload: dict[str, Any], timeout: float = POST_TIMEOUT_S) -> str | None:
    """POST the payload as JSON; None on success, else a reason that does not contain the URL."""
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode("utf-8"),
        headers={"Content-Type": "application/json; charset=utf-8"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            resp.read()
        return None
    except urllib.error.HTTPError as exc:
        return f"Slack answered {exc.code} {exc.reason}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"the webhook could not be reached ({type(exc).__name__}: {str(reason).replace(url, '<webhook>')})"


def notify(params_dir: Path, env: dict[str, str] | None = None, run_dir: Path | None = None) -> int:
    """Post the outcome if its status is one that notifies and a webhook is set. Always returns 0."""
    env = dict(os.environ) if env is None else env
    outcome = read_outcome(params_dir, run_dir)
    if outcome.status not in outcome.notify_on:
        print(f"not notifying: status {outcome.status or '(unknown)'} is not in notify-on {list(outcome.notify_on)}")
        return 0
    url = env.get(WEBHOOK_ENV, "").strip()
    if not url:
        print(f"not notifying: {WEBHOOK_ENV} is not set")
        return 0
    problem = post(url, slack_message(outcome))
    if problem is not None:
        print(f"warning: could not post the notification for {outcome.workflow}: {problem}", file=sys.stderr)
        return 0
    print(f"posted the {outcome.status} notification for {outcome.workflow} to Slack")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m workflows.notify", description=__doc__.splitlines()[0])
    parser.add_argument("--params-dir", type=Path, required=True, help="Directory with one file per value.")
    parser.add_argument("--run-dir", type=Path, help="The run directory, to report why a run ended early.")
    args = parser.parse_args(argv)
    if not args.params_dir.is_dir():
        print(f"warning: --params-dir {args.params_dir} is not a directory; nothing to notify", file=sys.stderr)
        return 0
    return notify(args.params_dir, run_dir=args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
