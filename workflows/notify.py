"""The exit handler's notification: post a run's outcome to a Slack incoming webhook.

`python -m workflows.notify --params-dir DIR --run-dir RUN` reads one file per value in DIR (Argo writes them from
`{{workflow.*}}` and the spec): workflow-name, workflow-namespace, status, failures, duration, ui-url, grafana-url,
mlflow-uri, notify-on, note, and optionally pipeline. The run directory (read-only) says what the run did: the model
version deploy promoted (champion moved), the gate rules evaluate found failing (nothing promoted), why prepare or
evaluate skipped the rest, the failed stage's error line, and the run's MLflow run. Links: the Argo UI, MLflow (only
an http(s) tracking URI, without its credentials) and Grafana's run dashboard. The webhook URL comes from the
environment (SLACK_WEBHOOK_URL, from a Secret) and is never printed. A notification is a courtesy: a failed post is
a warning and exits 0, never failing the workflow.
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
from urllib.parse import urlsplit

from spec.credentials import scrub
from spec.fields import STAGE_ORDER

WEBHOOK_ENV = "SLACK_WEBHOOK_URL"
POST_TIMEOUT_S = 15.0
MAX_FAILURES_LISTED = 8
MAX_MESSAGE_CHARS = 300

_EMOJI = {"Succeeded": ":white_check_mark:", "Failed": ":x:", "Error": ":rotating_light:"}
_ROLLUP = re.compile(r"^(child '[^']*' failed|No more retries left)$")
_STEP_TEMPLATE = re.compile(r"-(create|wait|cleanup)$")
"""The templates of one training stage's attempt (workflows/training_steps.py training_templates) end so."""
GRAFANA_DASHBOARD = "posttrain-run"
"""The uid of the run dashboard (manifests/components/monitoring); its variable `run` is the workflow's name."""


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
    """Why the run ended early (prepare found the data unchanged, evaluate had nothing to evaluate); or empty."""
    record: RunRecord = field(default_factory=lambda: RunRecord())
    """What the run directory says the run did."""
    mlflow_url: str = ""
    """The pipeline's MLflow run; empty without an http(s) tracking server or a run."""
    grafana_url: str = ""
    """The run's Grafana dashboard; empty when cluster.grafana_url is not set."""


@dataclass(frozen=True)
class RunRecord:
    """What the stages recorded in the run directory: promotion, gate, failure, MLflow run."""

    promoted: str = ""
    """'<registered model> v<version>' when deploy moved the champion alias to it."""
    registered: str = ""
    """deploy's own line when it registered a version without promoting it (a challenger only)."""
    gate_failed: tuple[str, ...] = ()
    """The gate rules that failed (evaluate's gate_checks), when the gate said fail."""
    failed_stage: str = ""
    error: str = ""
    """The failed stage's message from its stage.json (its error line)."""
    mlflow_run: str = ""
    """The pipeline's MLflow run as '<experiment id>/<run id>' (tracking.json), or empty."""


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
        if _ROLLUP.match(message):  # a DAG, steps or retry node repeating its child's failure
            continue
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


def _stage_record(run_dir: Path | None, stage: str) -> dict[str, Any]:
    """A stage's stage.json as a dict ({} when missing or unreadable)."""
    if run_dir is None:
        return {}
    try:
        record = json.loads((run_dir / stage / "stage.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _extra(record: dict[str, Any]) -> dict[str, Any]:
    extra = record.get("extra")
    return extra if isinstance(extra, dict) else {}


def skip_reason(run_dir: Path | None) -> str:
    """Why the run ended early: prepare's reason (unchanged data), else evaluate's when it skipped ('' when
    neither did, or it is unknown)."""
    extra = _extra(_stage_record(run_dir, "prepare"))
    if extra.get("proceed") == "false":
        return str(extra.get("skip-reason", ""))
    evaluate = _stage_record(run_dir, "evaluate")
    if evaluate.get("status") == "skipped" or _extra(evaluate).get("gate") == "skipped":
        return str(evaluate.get("message") or "evaluate had nothing to evaluate")
    return ""


def _one_line(text: str) -> str:
    """The first non-empty line of a message, credential-shaped spans masked."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return scrub(line, ())


def read_run_record(run_dir: Path | None) -> RunRecord:
    """What the stages of `run_dir` recorded (an empty record without a run directory)."""
    deploy = _stage_record(run_dir, "deploy")
    promoted = registered = ""
    if deploy.get("status") == "succeeded":
        extra = _extra(deploy)
        if extra.get("promoted") == "true":
            promoted = f"{extra.get('registered_model', '?')} v{extra.get('model_version', '?')}"
        elif extra.get("model_version"):
            registered = _one_line(deploy.get("message", ""))
    gate_failed: tuple[str, ...] = ()
    evaluate = _extra(_stage_record(run_dir, "evaluate"))
    if evaluate.get("gate") == "fail":
        checks = [c for c in evaluate.get("gate_checks") or [] if isinstance(c, dict) and not c.get("passed")]
        reasons = [str(c.get("reason", c.get("metric", "?"))) for c in checks]
        # A registry error fails the gate without a failing rule: the reasons then say why.
        gate_failed = tuple(reasons or [str(r) for r in evaluate.get("gate_reasons") or []])
    failed_stage = error = ""
    for stage in STAGE_ORDER:
        record = _stage_record(run_dir, stage)
        if record.get("status") == "failed":
            failed_stage, error = stage, _one_line(record.get("message", ""))
            break
    mlflow: dict[str, Any] = {}
    if run_dir is not None:
        try:
            mlflow = json.loads((run_dir / "tracking.json").read_text(encoding="utf-8")).get("mlflow") or {}
        except (OSError, ValueError, AttributeError):
            mlflow = {}
    experiment, run = mlflow.get("experiment_id"), mlflow.get("parent_run_id")
    return RunRecord(
        promoted=promoted,
        registered=registered,
        gate_failed=gate_failed,
        failed_stage=failed_stage,
        error=error,
        mlflow_run=f"{experiment}/{run}" if experiment and run else "",
    )


def mlflow_url(tracking_uri: str, run: str) -> str:
    """The MLflow UI's page of `run` ('<experiment>/<run id>') on an http(s) tracking server, without any
    credential the URI holds; '' for any other URI (SQLite, a file path) or no run."""
    if not run or not re.match(r"^https?://", tracking_uri):
        return ""
    parts = urlsplit(tracking_uri)
    host = parts.hostname or ""
    if not host:
        return ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    base = scrub(f"{parts.scheme}://{netloc}{parts.path}".rstrip("/"), ())
    experiment, run_id = run.split("/", 1)
    return f"{base}/#/experiments/{experiment}/runs/{run_id}"


def grafana_dashboard_url(grafana_url: str, workflow: str) -> str:
    """The run's Grafana dashboard (uid GRAFANA_DASHBOARD, variable `run`); '' without a Grafana URL."""
    if not grafana_url or not workflow:
        return ""
    return f"{grafana_url.rstrip('/')}/d/{GRAFANA_DASHBOARD}?var-run={workflow}"


def read_outcome(params_dir: Path, run_dir: Path | None = None) -> RunOutcome:
    """The RunOutcome from the files Argo wrote into `params_dir` (and prepare's record in `run_dir`)."""
    workflow = _read(params_dir, "workflow-name")
    ui_url = _read(params_dir, "ui-url")
    namespace = _read(params_dir, "workflow-namespace")
    if ui_url and workflow and "/workflows/" not in ui_url:
        ui_url = f"{ui_url.rstrip('/')}/workflows/{namespace}/{workflow}"
    record = read_run_record(run_dir)
    mlflow = mlflow_url(_read(params_dir, "mlflow-uri"), record.mlflow_run)
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
        record=record,
        mlflow_url=mlflow,
        grafana_url=grafana_dashboard_url(_read(params_dir, "grafana-url"), workflow),
    )


def _clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def failed_step(failures: list[Failure]) -> str:
    """The pipeline step a failure belongs to (a stage, or serve), from the failed nodes' templates."""
    for failure in failures:
        step = _STEP_TEMPLATE.sub("", failure.template)
        if step in (*STAGE_ORDER, "serve"):
            return step
    return ""


def outcome_line(outcome: RunOutcome) -> tuple[str, str]:
    """(emoji, status text) that state what the run did: promoted, gate failed, skipped, or where it failed."""
    record, status = outcome.record, outcome.status
    if status == "Succeeded":
        if outcome.skipped:
            return ":fast_forward:", "Succeeded, skipped"
        if record.promoted:
            return _EMOJI[status], f"Succeeded, promoted {record.promoted} (champion)"
        if record.gate_failed:
            return ":warning:", "Succeeded, gate failed: nothing promoted"
        return _EMOJI[status], status
    emoji = _EMOJI.get(status, ":grey_question:")
    stage = record.failed_stage or failed_step(outcome.failures)
    return emoji, f"{status} at {stage}" if stage and status in ("Failed", "Error") else status


def _details(outcome: RunOutcome) -> list[str]:
    """The outcome's sections (mrkdwn): what was promoted, the failed rules, the failed stage's error."""
    record = outcome.record
    sections = []
    if record.promoted:
        sections.append(f"*Promoted*\n`{record.promoted}`: the champion alias moved to it")
    elif record.registered:
        sections.append(f"*Registered*\n{_clip(record.registered)}")
    if record.gate_failed:
        rules = [f"• {_clip(r)}" for r in record.gate_failed[:MAX_FAILURES_LISTED]]
        sections.append("*Gate failed* (the champion stays)\n" + "\n".join(rules))
    if record.failed_stage and outcome.status != "Succeeded":
        sections.append(f"*{record.failed_stage} failed*\n{_clip(record.error) if record.error else '(no message)'}")
    return sections


def _links(outcome: RunOutcome) -> list[str]:
    links = [(outcome.ui_url, "Argo"), (outcome.mlflow_url, "MLflow"), (outcome.grafana_url, "Grafana")]
    return [f"<{url}|{name}>" for url, name in links if url]


def slack_message(outcome: RunOutcome) -> dict[str, Any]:
    """The Slack payload: a plain-text fallback and blocks (header, fields, outcome, failed steps, note, links)."""
    emoji, status = outcome_line(outcome)
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
    blocks += [{"type": "section", "text": {"type": "mrkdwn", "text": d}} for d in _details(outcome)]
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
    links = _links(outcome)
    if links:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "Open the run in " + " · ".join(links)}})
    text = headline + (f" ({outcome.duration})" if outcome.duration else "")
    if outcome.record.failed_stage and outcome.record.error and outcome.status != "Succeeded":
        text += f" — {outcome.record.failed_stage}: {_clip(outcome.record.error, 150)}"
    elif outcome.failures:
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
