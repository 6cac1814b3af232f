"""The score cache's model identities (by content, known before a model loads) and its entries."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from spec.model import ModelSpec
from stages.scores import ScoreCache, base_identity, champion_identity, hub_identity

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_a_model_built_from_config_is_known_by_its_config() -> None:
    tiny = {"architecture": "qwen3", "hidden_size": 64, "num_hidden_layers": 2}
    one = base_identity(ModelSpec(name_or_path="tiny", from_config=tiny))
    assert one is not None and one.startswith("from_config:sha256:")
    assert base_identity(ModelSpec(name_or_path="other-name", from_config=tiny)) == one
    assert base_identity(ModelSpec(name_or_path="tiny", from_config={**tiny, "seed": 7})) != one


def test_a_model_folder_is_known_by_its_content(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"weights")
    before = base_identity(ModelSpec(name_or_path=str(folder)))
    assert before is not None and before.startswith("folder:sha256:")
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert base_identity(ModelSpec(name_or_path=str(folder))) != before


def test_a_folder_fingerprint_is_read_again_only_when_a_file_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages import modeling

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"weights")
    reads: list[Path] = []
    fingerprint = modeling.model_fingerprint
    monkeypatch.setattr(modeling, "model_fingerprint", lambda path: reads.append(path) or fingerprint(path))
    cache = ScoreCache(tmp_path / "runs")
    spec = ModelSpec(name_or_path=str(folder))

    first = base_identity(spec, cache)
    assert base_identity(spec, cache) == first and len(reads) == 1  # the files stat as they did: not read again
    # Rewritten with the same size and its old modification time put back: its change time still moved.
    stat = (folder / "model.safetensors").stat()
    (folder / "model.safetensors").write_bytes(b"WEIGHTS")
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    while (folder / "model.safetensors").stat().st_ctime_ns == stat.st_ctime_ns:  # a coarse clock: let it tick
        time.sleep(0.01)
        os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = base_identity(spec, cache)
    assert second != first and len(reads) == 2
    (folder / "tokenizer.json").write_text("{}", encoding="utf-8")  # a file added
    assert base_identity(spec, cache) not in (first, second) and len(reads) == 3
    assert base_identity(spec) == base_identity(spec, cache) and len(reads) == 4  # no cache: always read


def test_a_hub_model_is_known_by_the_commit_of_its_cached_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--LGAI-EXAONE--EXAONE-4.0-1.2B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT, encoding="utf-8")
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text("{}", encoding="utf-8")

    expected = f"hub:LGAI-EXAONE/EXAONE-4.0-1.2B@{COMMIT}"
    assert hub_identity("LGAI-EXAONE/EXAONE-4.0-1.2B", None) == expected
    assert hub_identity("LGAI-EXAONE/EXAONE-4.0-1.2B", COMMIT) == expected
    assert base_identity(ModelSpec(name_or_path="LGAI-EXAONE/EXAONE-4.0-1.2B")) == expected
    # Not downloaded here yet: no identity before it loads (it is measured, then filed).
    assert hub_identity("LGAI-EXAONE/EXAONE-4.0-1.2B", "v2") is None
    assert hub_identity("Qwen/Qwen3-8B", None) is None


def test_the_champion_is_known_by_the_fingerprint_deploy_tagged() -> None:
    assert champion_identity({"posttrain.model_fingerprint": "sha256:abc"}) == "sha256:abc"
    assert champion_identity({"posttrain.model_fingerprint": ""}) is None
    assert champion_identity({}) is None


def test_an_entry_is_read_back_only_for_its_model_part_and_key(tmp_path: Path) -> None:
    cache = ScoreCache(tmp_path)
    key = {"rows": "sha256:1", "tasks": ["kobest_boolq"], "limit": None}
    path = cache.store("sha256:model", "heldout", key, {"perplexity": 12.5}, "run-1")
    assert path.parent == tmp_path / ".scores"
    entry = cache.lookup("sha256:model", "heldout", dict(key))
    assert entry is not None and entry.value == {"perplexity": 12.5} and entry.run == "run-1" and entry.measured_at
    assert cache.lookup("sha256:other", "heldout", key) is None
    assert cache.lookup("sha256:model", "lm_eval", key) is None
    assert cache.lookup("sha256:model", "heldout", {**key, "limit": 8}) is None

    stored = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**stored, "model": "sha256:other"}), encoding="utf-8")  # filed for another model
    assert cache.lookup("sha256:model", "heldout", key) is None
    path.write_text("{torn", encoding="utf-8")
    assert cache.lookup("sha256:model", "heldout", key) is None


def test_a_task_folder_is_known_by_its_content_wherever_it_lies(tmp_path: Path) -> None:
    """prepare's builtin task YAMLs name their data file by absolute path, inside each run's directory."""
    from stages.measures import task_folder_fingerprint

    def tasks(folder: Path, answer: str) -> Path:
        folder.mkdir(parents=True)
        (folder / "ko.jsonl").write_text(f'{{"answer": {answer}}}\n', encoding="utf-8")
        (folder / "ko.yaml").write_text(f"dataset_kwargs:\n  data_files:\n    test: {folder}/ko.jsonl\n")
        return folder

    one = task_folder_fingerprint(tasks(tmp_path / "run-1" / "lm_eval", "0"))
    assert task_folder_fingerprint(tasks(tmp_path / "run-2" / "lm_eval", "0")) == one
    assert task_folder_fingerprint(tasks(tmp_path / "run-3" / "lm_eval", "1")) != one  # other data
    (tmp_path / "run-2" / "lm_eval" / "ko.yaml").write_text("dataset_kwargs: {}\n")
    assert task_folder_fingerprint(tmp_path / "run-2" / "lm_eval") != one  # another task definition
