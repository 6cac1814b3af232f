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

from workflows.notify import format_run_duration, notify, parse_failures, read_outcome, slack_message

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
    assert payload["text"].startswith(":x: korean-llm: Failed at sft (2h42m34s)")  # the failed node's template
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


# --------------------------------------------------------------------------- what the run did


def _stage(run: Path, stage: str, status: str, message: str = "", **extra: Any) -> None:
    """A stage.json as stages/contract.py writes it (the fields notify reads, and the others it must ignore)."""
    record = {
        "stage": stage,
        "status": status,
        "config_hash": "c0ffee",
        "started_at": "2026-11-02T03:00:00+00:00",
        "ended_at": "2026-11-02T05:00:00+00:00",
        "attempts": 1,
        "message": message,
        "host": "korean-llm-x7k2p-evaluate-1",
        "extra": extra,
    }
    (run / stage).mkdir(parents=True, exist_ok=True)
    (run / stage / "stage.json").write_text(json.dumps(record), encoding="utf-8")


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "korean-llm-x7k2p"
    _stage(run, "prepare", "succeeded", proceed="true")
    _stage(run, "sft", "succeeded")
    (run / "tracking.json").write_text(
        json.dumps({"mlflow": {"experiment_id": "12", "parent_run_id": "a1b2c3"}}), encoding="utf-8"
    )
    return run


GATE_CHECKS = [
    {
        "metric": "heldout_perplexity",
        "passed": True,
        "reason": "heldout_perplexity: candidate 8.1 vs champion 8.3 "
        "(lower is better; regression 0, allowed 0.2): holds",
    },
    {
        "metric": "kmmlu",
        "passed": False,
        "reason": "kmmlu: candidate 0.41 vs champion 0.45 (higher is better; regression 0.04, allowed 0.01): fails",
    },
]


def _outcome(tmp_path: Path, run: Path, **values: str) -> dict[str, Any]:
    values = {"status": "Succeeded", "failures": "null", **values}
    return slack_message(read_outcome(_params(tmp_path, **values), run))


def test_a_promoted_model_is_named_with_its_version(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _stage(run, "evaluate", "succeeded", gate="pass", gate_checks=GATE_CHECKS[:1], gate_reasons=["..."])
    _stage(
        run, "deploy", "succeeded", "registered korean-llm v7 as champion (gate passed)",
        registered_model="korean-llm", model_version="7", aliases=["challenger", "champion"], promoted="true",
    )  # fmt: skip
    payload = _outcome(tmp_path, run)
    assert payload["text"].startswith(":white_check_mark: korean-llm: Succeeded, promoted korean-llm v7 (champion)")
    assert "the champion alias moved to it" in _all_text(payload)
    assert "Gate failed" not in _all_text(payload)


def test_a_failed_gate_is_not_a_plain_success(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _stage(run, "evaluate", "succeeded", gate="fail", gate_checks=GATE_CHECKS, gate_reasons=["a", "b"])
    payload = _outcome(tmp_path, run)
    assert payload["text"].startswith(":warning: korean-llm: Succeeded, gate failed: nothing promoted")
    text = _all_text(payload)
    assert "kmmlu: candidate 0.41 vs champion 0.45" in text  # the failed rule
    assert "heldout_perplexity: candidate" not in text  # a rule that held is not a reason
    assert "Promoted" not in text


def test_a_gate_failed_by_the_registry_gives_its_reason(tmp_path: Path) -> None:
    run = _run(tmp_path)
    reasons = ["the model registry could not be read: 503 Service Unavailable", GATE_CHECKS[0]["reason"]]
    _stage(run, "evaluate", "succeeded", gate="fail", gate_checks=GATE_CHECKS[:1], gate_reasons=reasons)
    assert "503 Service Unavailable" in _all_text(_outcome(tmp_path, run))


def test_a_skipped_run_says_why(tmp_path: Path) -> None:
    run = _run(tmp_path)
    reason = "the data is unchanged since korean-llm-abcde (fingerprint 9f86d0)"
    _stage(run, "prepare", "succeeded", proceed="false", **{"skip-reason": reason})
    payload = _outcome(tmp_path, run)
    assert payload["text"].startswith(":fast_forward: korean-llm: Succeeded, skipped")
    assert reason in _all_text(payload)


def test_an_evaluate_skip_is_reported_too(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _stage(run, "evaluate", "skipped", "nothing was trained: every training stage is off", gate="skipped")
    payload = _outcome(tmp_path, run)
    assert payload["text"].startswith(":fast_forward: korean-llm: Succeeded, skipped")
    assert "nothing was trained" in _all_text(payload)


def test_a_failed_stage_gives_its_error_line(tmp_path: Path) -> None:
    run = _run(tmp_path)
    _stage(run, "sft", "failed", "CUDA out of memory: lower train.micro_batch_size\nTraceback (most recent...")
    failures = json.dumps(
        [
            {"displayName": "wait(0)", "message": "main: Error (exit code 1): failure condition 'status.conditions."
             "2.type == Failed' evaluated true", "templateName": "sft-wait", "phase": "Failed"},
            {"displayName": "sft", "message": "No more retries left", "templateName": "sft", "phase": "Failed"},
            {"displayName": "pipeline", "message": "child 'korean-llm-x7k2p-123' failed", "templateName": "pipeline"},
        ]
    )  # fmt: skip
    payload = _outcome(tmp_path, run, status="Failed", failures=failures)
    assert payload["text"].startswith(
        ":x: korean-llm: Failed at sft (2h42m34s) — sft: CUDA out of memory: lower train.micro_batch_size"
    )
    text = _all_text(payload)
    assert "Traceback" not in text  # one line
    assert "failure condition" in text  # Argo's own word on the step
    assert "No more retries left" not in text and "child '" not in text  # roll-ups of the same failure


def test_links_to_argo_mlflow_and_grafana_without_credentials(tmp_path: Path) -> None:
    run = _run(tmp_path)
    payload = _outcome(
        tmp_path,
        run,
        mlflow_uri="https://bot:hunter2@mlflow.example.com/",
        grafana_url="https://grafana.example.com",
    )
    text = _all_text(payload)
    assert "<https://argo.example.internal/workflows/llm-training/korean-llm-x7k2p|Argo>" in text
    assert "<https://mlflow.example.com/#/experiments/12/runs/a1b2c3|MLflow>" in text
    assert "<https://grafana.example.com/d/posttrain-run?var-run=korean-llm-x7k2p|Grafana>" in text
    assert "hunter2" not in text and "bot" not in text


@pytest.mark.parametrize("uri", ["", "sqlite:////mnt/checkpoints/runs/x/mlflow.db", "file:///tmp/mlruns"])
def test_no_mlflow_link_without_an_http_server(tmp_path: Path, uri: str) -> None:
    assert "MLflow>" not in _all_text(_outcome(tmp_path, _run(tmp_path), mlflow_uri=uri))
