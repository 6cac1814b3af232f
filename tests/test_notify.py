"""The exit handler against a local HTTP server standing in for the Slack webhook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from workflows.notify import format_run_duration, notify, parse_failures

REPO = Path(__file__).resolve().parent.parent
SECRET_PATH = "/services/T0000/B0000/xoxSECRETxox"

FAILURES = json.dumps(
    [
        {
            "displayName": "sft",
            "message": "OOMKilled (exit code 137)",
            "templateName": "sft",
            "phase": "Failed",
            "podName": "korean-llm-x7k2p-sft-1",
            "finishedAt": "2026-11-02T05:00:00Z",
        },
        {"displayName": "sft", "message": "OOMKilled (exit code 137)", "templateName": "sft", "phase": "Failed"},
        {"displayName": "evaluate", "message": "gate failed: perplexity", "templateName": "evaluate"},
    ]
)


class Webhook:
    """A local webhook that records JSON posts and answers with `status`."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.status = 200
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                webhook.posts.append({"path": self.path, "body": json.loads(self.rfile.read(length))})
                self.send_response(webhook.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}{SECRET_PATH}"


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.server.shutdown()
    hook.server.server_close()


def _params(tmp_path: Path, **values: str) -> Path:
    defaults = {
        "workflow-name": "korean-llm-x7k2p",
        "workflow-namespace": "llm-training",
        "status": "Failed",
        "failures": FAILURES,
        "duration": "9754.3",
        "ui-url": "https://argo.example.internal",
        "notify-on": "Succeeded,Failed,Error",
        "note": "ping @ml-oncall",
    }
    defaults.update({k.replace("_", "-"): v for k, v in values.items()})
    params = tmp_path / "params"
    params.mkdir(exist_ok=True)
    for name, value in defaults.items():
        (params / name).write_text(value, encoding="utf-8")
    return params


def _all_text(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False)


def test_a_failed_run_posts_status_failed_steps_duration_and_link(
    tmp_path: Path, webhook: Webhook, capsys: pytest.CaptureFixture[str]
) -> None:
    assert notify(_params(tmp_path), {"SLACK_WEBHOOK_URL": webhook.url}) == 0
    assert len(webhook.posts) == 1
    assert webhook.posts[0]["path"] == SECRET_PATH
    payload = webhook.posts[0]["body"]
    assert payload["text"].startswith(":x: korean-llm: Failed (2h42m34s)")
    text = _all_text(payload)
    assert "OOMKilled (exit code 137)" in text and "gate failed: perplexity" in text
    assert text.count("OOMKilled") == 1  # the retry that failed the same way is listed once
    assert "https://argo.example.internal/workflows/llm-training/korean-llm-x7k2p" in text
    assert "ping @ml-oncall" in text
    assert "korean-llm-x7k2p" in text
    out = capsys.readouterr()
    assert "posted the Failed notification" in out.out
    assert "xoxSECRETxox" not in out.out + out.err


def test_a_succeeded_run_has_no_failed_steps(tmp_path: Path, webhook: Webhook) -> None:
    notify(_params(tmp_path, status="Succeeded", failures="null", ui_url=""), {"SLACK_WEBHOOK_URL": webhook.url})
    payload = webhook.posts[0]["body"]
    assert payload["text"] == ":white_check_mark: korean-llm: Succeeded (2h42m34s)"
    assert "Failed steps" not in _all_text(payload)
    assert "Open the run" not in _all_text(payload)


def test_status_not_in_notify_on_posts_nothing(
    tmp_path: Path, webhook: Webhook, capsys: pytest.CaptureFixture[str]
) -> None:
    params = _params(tmp_path, status="Succeeded", notify_on="Failed,Error")
    assert notify(params, {"SLACK_WEBHOOK_URL": webhook.url}) == 0
    assert webhook.posts == []
    assert "status Succeeded is not in notify-on" in capsys.readouterr().out


def test_no_webhook_url_posts_nothing_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert notify(_params(tmp_path), {}) == 0
    assert "SLACK_WEBHOOK_URL is not set" in capsys.readouterr().out


def test_a_rejected_post_is_a_warning_without_the_url(
    tmp_path: Path, webhook: Webhook, capsys: pytest.CaptureFixture[str]
) -> None:
    webhook.status = 500
    assert notify(_params(tmp_path), {"SLACK_WEBHOOK_URL": webhook.url}) == 0
    out = capsys.readouterr()
    assert "warning: could not post the notification for korean-llm-x7k2p: Slack answered 500" in out.err
    assert "xoxSECRETxox" not in out.out + out.err


def test_an_unreachable_webhook_is_a_warning_without_the_url(
    tmp_path: Path, webhook: Webhook, capsys: pytest.CaptureFixture[str]
) -> None:
    url = webhook.url
    webhook.server.shutdown()
    webhook.server.server_close()
    assert notify(_params(tmp_path), {"SLACK_WEBHOOK_URL": url}) == 0
    out = capsys.readouterr()
    assert "the webhook could not be reached" in out.err
    assert "xoxSECRETxox" not in out.out + out.err


@pytest.mark.parametrize("raw", ["", "{{workflow.failures}}", "not json", '{"a": 1}', "[1, 2]"])
def test_unreadable_failures_mean_no_failed_steps(raw: str) -> None:
    assert parse_failures(raw) == []


def test_failures_are_deduplicated_across_retries() -> None:
    assert [(f.step, f.message) for f in parse_failures(FAILURES)] == [
        ("sft", "OOMKilled (exit code 137)"),
        ("evaluate", "gate failed: perplexity"),
    ]


def test_duration_formatting() -> None:
    assert [format_run_duration(d) for d in ("12", "754.9", "9754.3", "", "soon")] == [
        "12s",
        "12m34s",
        "2h42m34s",
        "",
        "soon",
    ]


def test_the_module_runs_as_the_exit_handler_step(tmp_path: Path, webhook: Webhook) -> None:
    env = {**os.environ, "SLACK_WEBHOOK_URL": webhook.url}
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.notify", "--params-dir", str(_params(tmp_path, status="Error"))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert webhook.posts[0]["body"]["text"].startswith(":rotating_light: korean-llm: Error")
    assert "xoxSECRETxox" not in proc.stdout + proc.stderr
