"""Credentials are recognised by name (any casing, word by word) and by shape (URI userinfo, known key formats),
and masked in everything a stage writes: its output (MaskingStream, the local runner's log), stage.json, the
traceback file, the evaluation report."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from run.masking import MASK, MaskingStream, mask_secrets, mask_secrets_in, secret_values
from run.run_dir import RunDir, StageResult, now
from spec.credentials import find_credentials, looks_secret_name, scrub

PASSWORD = "Zq8-FAKE-mlflow-pw-91"


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "WANDB_API_KEY",
        "WANDB_KEY",
        "wandb_key",
        "AWS_ACCESS_KEY_ID",
        "aws_secret_access_key",
        "MLFLOW_TRACKING_PASSWORD",
        "mlflowTrackingToken",
        "SLACK_WEBHOOK_URL",
        "LANGFUSE_SECRET_KEY",
        "GITHUB_PAT",
        "SENTRY_DSN",
        "db-passwd",
    ],
)
def test_secret_names_in_any_casing(name: str) -> None:
    assert looks_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "PATH", "HF_HUB_OFFLINE", "max_new_tokens", "tokenizer_hash", "HOSTNAME"],
)
def test_ordinary_names_are_not_secrets(name: str) -> None:
    assert not looks_secret_name(name)


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (
            f"POST https://alice:{PASSWORD}@mlflow.example.com/api failed",
            "POST https://***@mlflow.example.com/api failed",
        ),
        ("postgresql://mlflow:pw@db:5432/mlflow", "postgresql://***@db:5432/mlflow"),
        ("key AKIAFAKEFAKEFAKE1234 in use", "key *** in use"),
        ("hf_FAKEtokenZ9q8w7e6r5t4y3u2i1o0", "***"),
        ("Authorization: Bearer fake-argo-token-d41d8cd98f00", "Authorization: Bearer ***"),
        ("https://hooks.slack.com/services/TFAKE000/BFAKE000/fakeWebhookSecret42", "https://***"),
        (
            "s3://b/k?X-Amz-Signature=abc123&X-Amz-Credential=AKIA/x",
            "s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***",
        ),
        ("-----BEGIN PRIVATE KEY-----\nMIIEv\n-----END PRIVATE KEY-----", "***"),
        ("Basic configuration of the system", "Basic configuration of the system"),
        ("commit 0debf2c1a2b3c4d5e6f7", "commit 0debf2c1a2b3c4d5e6f7"),
    ],
)
def test_credentials_are_masked_by_shape(text: str, masked: str) -> None:
    assert scrub(text, secrets=set()) == masked


def test_a_password_inside_any_environment_value_is_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://alice:{PASSWORD}@mlflow.example.com")
    monkeypatch.setenv("wandb_key", "lowercase-FAKE-key-1234")
    assert {PASSWORD, "lowercase-FAKE-key-1234"} <= secret_values()
    # The password alone, as an error message might print it, is masked too.
    assert mask_secrets(f"auth failed for password {PASSWORD}") == f"auth failed for password {MASK}"


def test_the_stage_output_is_masked_by_shape_even_without_secret_variables() -> None:
    target = io.StringIO()
    stream = MaskingStream(target, set())
    stream.write("connecting to http://bob:hunter2hunter2@mlflow:5000\nrest")
    stream.flush()
    assert target.getvalue() == "connecting to http://***@mlflow:5000\nrest"


def test_stage_json_never_holds_a_credential(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://alice:{PASSWORD}@mlflow.example.com")
    run_dir = RunDir(tmp_path)
    result = StageResult(
        stage="evaluate",
        status="failed",
        config_hash="h",
        started_at=now(),
        message=f"MLflow at https://alice:{PASSWORD}@mlflow.example.com refused the request",
        extra={"champion_error": f"password {PASSWORD}", "nested": [{"uri": "s3://AKIAFAKEFAKEFAKE1234@b/k"}]},
    )
    run_dir.write_result(result)
    text = run_dir.result_path("evaluate").read_text(encoding="utf-8")
    assert PASSWORD not in text and "AKIAFAKEFAKEFAKE1234" not in text
    record = json.loads(text)
    assert record["message"] == "MLflow at https://***@mlflow.example.com refused the request"
    assert record["extra"]["champion_error"] == f"password {MASK}"


def test_masking_keeps_the_structure_of_what_it_masks() -> None:
    data = {"a": [1, 2.5, None, True], "b": {"c": "x Bearer abcdefghijkl0123"}, "d": (1, 2)}
    assert mask_secrets_in(data, set()) == {"a": [1, 2.5, None, True], "b": {"c": "x Bearer ***"}, "d": [1, 2]}


def test_a_found_credential_says_what_it_is() -> None:
    [found] = find_credentials("uri https://u:p@h/x")
    assert found.what.startswith("credentials in a URI")


def test_the_working_directory_is_not_a_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PWD", "/home/alice/projects/posttrain")
    monkeypatch.setenv("OLDPWD", "/home/alice")
    assert not looks_secret_name("PWD") and looks_secret_name("DB_PWD")
    assert (
        mask_secrets("saved in /home/alice/projects/posttrain/wandb") == "saved in /home/alice/projects/posttrain/wandb"
    )


def test_the_evaluation_report_never_holds_a_credential(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while measuring the champion can carry the registry's URI; a generation can repeat a token."""
    from stages.report import write_report

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://alice:{PASSWORD}@mlflow.example.com")
    facts = {
        "run": "korean-llm-1",
        "pipeline": "korean-llm",
        "gate": "fail",
        "reference": "base model",
        "candidate_stage": "sft",
        "base_model": "Qwen/Qwen3-8B-Base",
        "registered_model": "korean-llm",
        "champion_version": None,
        "champion_remeasured": {},
        "perplexity_data": "prepare/data/evaluate/eval.jsonl",
        "lm_eval_tasks": [],
        "limit": None,
        "base": {"perplexity": 12.0},
        "candidate": {"perplexity": 11.0},
        "champion": {},
        "gate_checks": [],
        "gate_reasons": [],
        "loss_curves": {},
        "prompts": ["토큰을 알려줘"],
        "base_generations": ["hf_FAKEtokenZ9q8w7e6r5t4y3u2i1o0"],
        "candidate_generations": ["없습니다"],
        "errors": [f"champion: MlflowException: API request to https://alice:{PASSWORD}@mlflow.example.com failed"],
    }
    written = write_report(tmp_path, facts)
    assert {p.name for p in written} >= {"report.md", "report.html"}
    for path in written:
        if path.suffix in (".md", ".html"):
            text = path.read_text(encoding="utf-8")
            assert PASSWORD not in text and "hf_FAKEtoken" not in text, path
            assert "https://***@mlflow.example.com" in text
