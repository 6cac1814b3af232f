"""No secret value in anything a run leaves: stage logs, stage.json, MLflow's database (params, tags), W&B's
offline files, TensorBoard events. A secret that a stage prints anyway is masked in its log at the source."""

from __future__ import annotations

from pathlib import Path

import pytest
from resubmitted_dag import CANARY, FAKE_SECRETS, Resubmitted
from resubmitted_dag import resubmitted_dag as run_resubmitted_dag

from run.masking import MASK, mask_secrets
from run.tracking import local_store_uri

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resubmitted_dag(tmp_path_factory: pytest.TempPathFactory) -> Resubmitted:
    return run_resubmitted_dag(tmp_path_factory)


def test_no_secret_value_in_any_file_of_the_run(resubmitted_dag: Resubmitted) -> None:
    root = resubmitted_dag.root
    # The run's folder, and the local MLflow store the runs there share (runs/mlflow.db, runs/mlartifacts/).
    store = Path(local_store_uri(root).removeprefix("sqlite:///"))
    assert store.is_file(), store
    files = [p for p in [*root.rglob("*"), store, *(store.parent / "mlartifacts").rglob("*")] if p.is_file()]
    kinds = {p.suffix for p in files} | {p.name.split(".")[0] for p in files}
    assert {".log", ".db", ".wandb", "events", "stage"} <= kinds, sorted(kinds)  # every kind of output is there
    for path in files:
        data = path.read_bytes()
        for name, value in [*FAKE_SECRETS.items(), CANARY]:
            assert value.encode() not in data, f"the value of ${name} is in {path}"


def test_a_printed_secret_is_masked_in_the_stage_log(resubmitted_dag: Resubmitted) -> None:
    log = (resubmitted_dag.root / "sft" / "logs" / "stage.log").read_text(encoding="utf-8")
    assert f"crashing on purpose; token {MASK}" in log


def test_masking_replaces_every_secret_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_API_KEY", "abcdef123456")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to mask without garbling ordinary text
    monkeypatch.setenv("PLAIN_SETTING", "abcdef123456789")
    assert mask_secrets("key=abcdef123456 tok=abc") == f"key={MASK} tok=abc"
    assert mask_secrets("plain=abcdef123456789") == f"plain={MASK}789"  # the secret inside it still goes
