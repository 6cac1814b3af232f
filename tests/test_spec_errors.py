"""Invalid specs, profiles and overrides are rejected with a message that names where and what to fix.

File errors read 'file:line: field.path: message', override errors '--set...: field.path: message'.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from spec.document import SpecError
from spec.loading import known_pipelines, load_pipeline

BASE = textwrap.dedent(
    """\
    name: demo
    model:
      name_or_path: Qwen/Qwen3-0.6B
    stages:
      sft:
        data:
          uri: /mnt/datasets/sft.jsonl
          format: messages
        training:
          learning_rate: 1.0e-4
    profiles:
      local:
        model: {name_or_path: tiny}
      hot:
        stages:
          sft:
            training: {learning_rate: 5}
    """
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _line_of(text: str, needle: str) -> int:
    """The 1-based line of the first occurrence of `needle` in `text`."""
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


def _error(path: str, profile: str | None = None, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(SpecError) as info:
        load_pipeline(path, profile, overrides)
    return str(info.value)


def test_the_base_spec_is_valid(tmp_path: Path) -> None:
    """Guard: every case below breaks exactly one thing in a spec that otherwise loads."""
    path = _write(tmp_path, BASE)
    assert load_pipeline(str(path)).spec.name == "demo"
    assert load_pipeline(str(path), "local").spec.model.name_or_path == "tiny"


# --------------------------------------------------------------------------- errors in the file


@dataclass(frozen=True)
class FileCase:
    """A broken pipeline file: the text, the line the error must point at, and what it must say."""

    id: str
    text: str
    at: str  # a fragment of the line the error must be reported at
    fragments: tuple[str, ...]


FILE_CASES = [
    FileCase(
        "unknown-field", BASE.replace("name: demo", "name: demo\nmodle: {}"), "modle:", ("modle", "unknown field")
    ),
    FileCase(
        "typo-in-nested-section",
        BASE.replace("learning_rate: 1.0e-4", "learning_rat: 1.0e-4"),
        "learning_rat:",
        ("stages.sft.training.learning_rat", "unknown field"),
    ),
    FileCase(
        "negative-learning-rate",
        BASE.replace("learning_rate: 1.0e-4", "learning_rate: -1.0e-4"),
        "learning_rate: -1",
        ("stages.sft.training.learning_rate", "greater than 0"),
    ),
    FileCase(
        "bad-namespace",
        BASE + "cluster:\n  namespace: Team_A\n",
        "namespace: Team_A",
        ("cluster.namespace", "DNS-1123", "Team_A"),
    ),
    FileCase(
        "bad-cron",
        BASE + "schedule:\n  cron: ['0 2 * *']\n",
        "cron:",
        ("schedule.cron", "5 fields"),
    ),
    FileCase(
        "cron-with-odd-characters",
        BASE + "schedule:\n  cron: ['0 2 * * 1;rm']\n",
        "cron:",
        ("schedule.cron", "characters cron does not use"),
    ),
    FileCase(
        "bad-timezone",
        BASE + "schedule:\n  cron: ['0 2 * * 1']\n  timezone: Mars/Olympus\n",
        "timezone:",
        ("schedule.timezone", "unknown timezone 'Mars/Olympus'"),
    ),
    FileCase(
        "wrong-type-string-for-int",
        BASE.replace("learning_rate: 1.0e-4", "max_steps: lots"),
        "max_steps:",
        ("stages.sft.training.max_steps", "valid integer"),
    ),
    FileCase(
        "wrong-type-list-for-string",
        BASE.replace("name: demo", "name: demo\ndescription: [a, b]"),
        "description:",
        ("description", "valid string"),
    ),
    FileCase(
        "sft-with-preference-data",
        BASE.replace("format: messages", "format: preference"),
        "format: preference",
        ("stages.sft.data.format", "sft reads messages, alpaca or sharegpt: 'preference'"),
    ),
    FileCase(
        "bad-storage-uri",
        BASE.replace("profiles:\n", "  deploy:\n    storage_uri: http://models.example.com/x\nprofiles:\n"),
        "storage_uri:",
        ("storage_uri", "gs://, s3:// or pvc://"),
    ),
    FileCase(
        "bad-data-uri-scheme",
        BASE.replace("uri: /mnt/datasets/sft.jsonl", "uri: ftp://host/sft.jsonl"),
        "uri: ftp",
        ("stages.sft.data.uri", "unsupported URI scheme 'ftp'"),
    ),
    FileCase(
        "bad-quantity",
        BASE.replace("    training:\n", "    resources: {memory: lots}\n    training:\n"),
        "resources:",
        ("stages.sft.resources.memory", "pattern"),
    ),
    FileCase(
        "unknown-toleration-field",
        BASE.replace(
            "    training:\n",
            "    resources:\n      tolerations:\n        - {key: a, operater: Exists}\n    training:\n",
        ),
        "operater",
        ("stages.sft.resources.tolerations[0].operater", "unknown field"),
    ),
    FileCase(
        "relative-mount-path",
        BASE + "cluster:\n  checkpoints: {claim_name: ckpt, mount_path: ckpt}\n",
        "checkpoints:",
        ("cluster.checkpoints.mount_path", "absolute path"),
    ),
    FileCase(
        "pipeline-name-not-a-dns-label",
        BASE.replace("name: demo", "name: Demo_Pipeline"),
        "name: Demo_Pipeline",
        ("name", "DNS-1123", "Demo_Pipeline"),
    ),
]


@pytest.mark.parametrize("case", FILE_CASES, ids=[c.id for c in FILE_CASES])
def test_file_error_names_file_line_and_field(case: FileCase, tmp_path: Path) -> None:
    path = _write(tmp_path, case.text)
    message = _error(str(path))
    assert message.startswith(f"{path}:{_line_of(case.text, case.at)}: "), message
    for fragment in case.fragments:
        assert fragment in message, message


def test_every_error_is_reported_at_once(tmp_path: Path) -> None:
    text = BASE.replace("learning_rate: 1.0e-4", "learning_rate: -1\n      max_steps: lots")
    path = _write(tmp_path, text)
    lines = _error(str(path)).splitlines()
    assert len(lines) == 2
    assert any("stages.sft.training.learning_rate" in line for line in lines)
    assert any("stages.sft.training.max_steps" in line for line in lines)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("name: demo\nmodel: [unclosed\nstages: {}\n", ("not valid YAML",)),
        ("name: demo\nmodel:\n  name_or_path: x\n  revision: main\n    bad: indent\n", ("not valid YAML",)),
    ],
    ids=["unclosed-bracket", "bad-indentation"],
)
def test_invalid_yaml_names_the_line(text: str, fragments: tuple[str, ...], tmp_path: Path) -> None:
    path = _write(tmp_path, text)
    message = _error(str(path))
    expected_line = {"[unclosed": 3, "bad: indent": 5}
    line = next(v for k, v in expected_line.items() if k in text)
    assert message.startswith(f"{path}:{line}: "), message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"], ids=["list", "string", "number"])
def test_document_must_be_a_mapping(text: str, tmp_path: Path) -> None:
    path = _write(tmp_path, text)
    message = _error(str(path))
    assert message.startswith(f"{path}: ") and "must be a mapping" in message, message


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_bytes(b"name: demo\n\xff\xfe\n")
    assert _error(str(path)) == f"{path}: not UTF-8 text (byte 11)"


# --------------------------------------------------------------------------- cross-field rules

_DPO = ("stages.rlhf.enabled=true", "stages.rlhf.data.uri=/p.jsonl", "stages.rlhf.data.format=preference")
_GRPO = (
    "stages.rlhf.enabled=true",
    "stages.rlhf.algorithm=grpo",
    "stages.rlhf.data.uri=/p.jsonl",
    "stages.rlhf.data.format=messages",
    "stages.rlhf.reward_functions=[{name: length}]",
)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (("stages.sft.method=qlora", "stages.sft.distributed.strategy=deepspeed_zero3"), ("stages.sft", "qlora")),
        (("stages.cpt.enabled=true",), ("stages.cpt", "needs 'data'")),
        (
            ("stages.cpt.data.uri=/mnt/datasets/chat.jsonl", "stages.cpt.data.format=messages"),
            ("stages.cpt.data.format", "cpt trains on raw text: the format must be 'text'"),
        ),
        (("stages.evaluate.enabled=false",), ("stages.deploy needs stages.evaluate",)),
        (("stages.sft.enabled=false",), ("stages.evaluate needs at least one training stage",)),
        (("notifications.slack=true",), ("notifications.slack needs cluster.secrets.slack_webhook",)),
        (
            (
                "stages.rlhf.enabled=true",
                "stages.rlhf.algorithm=grpo",
                "stages.rlhf.data.uri=/p.jsonl",
                "stages.rlhf.data.format=messages",
            ),
            ("stages.rlhf", "grpo needs at least one entry in reward_functions"),
        ),
        (
            (*_DPO, "stages.rlhf.beta=0"),
            ("stages.rlhf", "beta must be greater than 0 for dpo"),
        ),
        (
            (*_DPO, "stages.rlhf.algorithm=orpo", "stages.rlhf.beta=0"),
            ("stages.rlhf", "beta must be greater than 0 for orpo"),
        ),
        (
            ("stages.sft.method=lora", "stages.sft.lora.target_modules=[q_proj, lm_head]"),
            ("stages.sft.lora.target_modules", "refuses an adapter on lm_head", "remove 'lm_head'"),
        ),
    ],
    ids=[
        "qlora-with-zero3",
        "enabled-stage-without-data",
        "cpt-with-non-text-data",
        "deploy-without-evaluate",
        "evaluate-without-training",
        "slack-without-webhook-secret",
        "grpo-without-rewards",
        "dpo-with-zero-beta",
        "orpo-with-zero-beta",
        "sft-adapter-on-lm-head",
    ],
)
def test_cross_field_rules(overrides: tuple[str, ...], fragments: tuple[str, ...], tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    message = _error(str(path), overrides=overrides)
    # A rule on one section is reported there; a rule across sections names the file and the overrides applied.
    where = rf"--set|{re.escape(str(path))}:\d+|{re.escape(str(path))} \(with --set [^)]*\)"
    assert re.match(rf"^({where}): ", message), message
    for fragment in fragments:
        assert fragment in message, message


def test_a_cpt_adapter_on_lm_head_is_refused_only_where_trl_continues_it() -> None:
    cpt = ("stages.cpt.method=lora", "stages.cpt.lora.target_modules=[q_proj, lm_head]")
    message = _error("korean-llm", overrides=cpt)  # its sft continues cpt's adapter
    assert "stages.cpt.lora.target_modules: sft continues cpt's adapter with TRL" in message, message
    assert "merge_after: true" in message
    load_pipeline("korean-llm", None, (*cpt, "stages.cpt.lora.merge_after=true"))  # merged: sft starts anew


# --------------------------------------------------------------------------- --set overrides


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("stages.sft.training.learning_rate=-0.5", ("--set", "stages.sft.training.learning_rate", "greater than 0")),
        ("stages.sft.training.lerning_rate=1e-4", ("--set", "stages.sft.training.lerning_rate", "unknown field")),
        ("stages.sft.training.max_steps=many", ("--set", "stages.sft.training.max_steps", "valid integer")),
        ("stages.sft.training.packing=maybe", ("--set", "stages.sft.training.packing", "valid boolean")),
        ("stages.sft.env.HF_TOKEN=hf_abc", ("--set", "stages.sft.env", "HF_TOKEN looks like a secret")),
        ("cluster.env.MY_API_KEY=k", ("--set", "cluster.env", "MY_API_KEY looks like a secret")),
        ("stages.sft.env.1BAD=x", ("--set", "stages.sft.env", "'1BAD' is not valid")),
        ("stages.sft.resources.memory=lots", ("--set", "stages.sft.resources.memory", "pattern")),
        ("stages.sft.resources.nodes=0", ("--set", "stages.sft.resources.nodes", "greater than or equal to 1")),
        ("stages.deploy.storage_uri=http://x/y", ("--set", "stages.deploy.storage_uri", "gs://, s3:// or pvc://")),
        ("stages.sft.data.uri=ftp://host/x", ("--set", "stages.sft.data.uri", "unsupported URI scheme 'ftp'")),
        ("cluster.namespace=Bad_NS", ("--set", "cluster.namespace", "DNS-1123")),
        ("schedule.timezone=Asia/Nowhere", ("--set", "schedule.timezone", "unknown timezone")),
        ("data_version=a/b", ("--set", "data_version", "letters, digits")),
        ("name=" + "a" * 25, ("--set", "name", "at most 24 characters", "63-character DNS label")),
        ("name=9lives", ("--set", "name", "must start with a letter")),
        ("stages.sft.run_policy.retry_backoff=soon", ("--set", "stages.sft.run_policy.retry_backoff", "Go duration")),
        ("stages.sft.run_policy.retry_backoff=2 m", ("--set", "stages.sft.run_policy.retry_backoff", "'2 m'")),
        ("stages.sft.run_policy.retry_backoff=-1m", ("--set", "stages.sft.run_policy.retry_backoff", "'-1m'")),
        ("stages.deploy.storage_uri=pvc://ckpt", ("--set", "stages.deploy.storage_uri", "root of the claim")),
        ("stages.deploy.storage_uri=pvc://ckpt/", ("--set", "stages.deploy.storage_uri", "root of the claim")),
        ("stages.deploy.storage_uri=pvc://ckpt/m/../../x", ("--set", "stages.deploy.storage_uri", "no '..'")),
        (
            "stages.deploy.storage_uri=pvc://Bad_Claim/m",
            ("--set", "stages.deploy.storage_uri", "PersistentVolumeClaim"),
        ),
        ("stages.rlhf.beta=-0.1", ("--set", "stages.rlhf.beta", "greater than or equal to 0")),
        (
            "stages.sft.run_policy.active_deadline_seconds=null",
            (
                "--set",
                "stages.sft.run_policy.active_deadline_seconds",
            ),
        ),
        ("cluster.secrets.hf_token={name: Bad_Name, key: t}", ("--set", "cluster.secrets.hf_token.name", "Bad_Name")),
        (
            "stages.sft.resources.tolerations=[{key: a, operater: Exists}]",
            ("--set", "stages.sft.resources.tolerations[0].operater", "unknown field"),
        ),
        ("stages.sft.training.learning_rate", ("--set", "stages.sft.training.learning_rate", "path.to.field=value")),
        ("=1", ("--set", "field path is empty")),
        ("stages..sft=1", ("--set", "empty part")),
        ("name.sub=1", ("--set", "name is a value, not a section")),
        ("stages.sft.training.learning_rate.x=1", ("--set", "stages.sft.training.learning_rate is a value")),
        ("profiles.local.model=x", ("--set", "profiles cannot be set; use --profile")),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_override_errors_name_the_override_and_field(override: str, fragments: tuple[str, ...], tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    message = _error(str(path), overrides=(override,))
    assert message.startswith("--set"), message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("backoff", ["120", "90s", "2m", "1h30m", "1.5h", "500ms"])
def test_retry_backoff_takes_seconds_or_a_go_duration(backoff: str, tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    spec = load_pipeline(str(path), overrides=(f"stages.sft.run_policy.retry_backoff={backoff}",)).spec
    assert spec.stages.sft.run_policy.retry_backoff == backoff


@pytest.mark.parametrize("uri", ["pvc://ckpt/models", "pvc://ckpt/models/demo/", "gs://bucket", "s3://bucket/p"])
def test_storage_uris_that_name_a_place(uri: str, tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    assert load_pipeline(str(path), overrides=(f"stages.deploy.storage_uri={uri}",)).spec.stages.deploy.storage_uri


def test_grpo_accepts_beta_zero(tmp_path: Path) -> None:
    """TRL's GRPO default: no KL term, no reference model."""
    path = _write(tmp_path, BASE)
    spec = load_pipeline(str(path), overrides=(*_GRPO, "stages.rlhf.beta=0")).spec
    assert spec.stages.rlhf.beta == 0


def test_override_errors_do_not_blame_the_file(tmp_path: Path) -> None:
    """A value that came from --set is reported at --set, not at the file line it replaced."""
    path = _write(tmp_path, BASE)
    message = _error(str(path), overrides=("stages.sft.training.learning_rate=2",))
    assert str(path) not in message
    assert message == "--set: stages.sft.training.learning_rate: Input should be less than 1"


# --------------------------------------------------------------------------- profiles and names


def test_unknown_profile_lists_the_known_ones(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    assert _error(str(path), profile="nope") == f"{path}: no profile 'nope' (profiles: hot, local)"


def test_profile_without_profiles(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE.split("profiles:")[0])
    assert _error(str(path), profile="local") == f"{path}: no profile 'local' (profiles: none)"


def test_profile_error_points_into_the_profile(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    message = _error(str(path), profile="hot")
    assert message.startswith(f"{path}:{_line_of(BASE, 'learning_rate: 5')}: "), message
    assert "stages.sft.training.learning_rate" in message and "less than 1" in message


def test_unknown_pipeline_lists_known_ones() -> None:
    message = _error("no-such-pipeline")
    assert "unknown pipeline 'no-such-pipeline'" in message
    for name in known_pipelines():
        assert name in message
    assert known_pipelines(), "no shipped pipelines"


def test_missing_pipeline_file(tmp_path: Path) -> None:
    missing = tmp_path / "nothere.yaml"
    assert _error(str(missing)) == f"pipeline file {missing} does not exist"
