"""The cron rule's fingerprint covers what decides a run's result (each stage's data, the model, each stage's
configuration, the project version; stages/run_inputs.py), and prepare says which part changed since the last run."""

from __future__ import annotations

from pathlib import Path

import pytest

from run.run_dir import write_json_atomic
from spec.loading import load_pipeline
from spec.pipeline import PipelineSpec
from stages import run_inputs as inputs_module
from stages.run_inputs import run_inputs, what_changed

DATA = {"cpt": "sha256:corpus", "sft": "sha256:chats"}


def _spec(*overrides: str) -> PipelineSpec:
    return load_pipeline("korean-llm", "local", list(overrides)).spec


def _previous(root: Path, spec: PipelineSpec, inputs: dict[str, str] | None) -> Path:
    """A completed run's folder as the next run reads it: its spec.json and prepare's record."""
    write_json_atomic(root / "spec.json", spec.model_dump(mode="json"))
    extra = {"fingerprint": "sha256:x", **({"inputs": inputs} if inputs is not None else {})}
    write_json_atomic(root / "prepare" / "stage.json", {"status": "succeeded", "extra": extra})
    return root


@pytest.mark.parametrize(
    ("override", "part", "said"),
    [
        ("stages.sft.training.learning_rate=3e-4", "config:sft", "stages.sft (training.learning_rate)"),
        ("stages.evaluate.max_new_tokens=7", "config:evaluate", "stages.evaluate (max_new_tokens)"),
        ("model.from_config.hidden_size=96", "model", "model (from_config.hidden_size)"),
        ("stages.cpt.data.max_samples=50", "config:cpt", "stages.cpt (data.max_samples)"),
    ],
)
def test_a_changed_setting_changes_the_fingerprint_and_is_named(
    tmp_path: Path, override: str, part: str, said: str
) -> None:
    before_spec, after_spec = _spec(), _spec(override)
    before, after = run_inputs(before_spec, DATA), run_inputs(after_spec, DATA)
    assert {name for name in before if before[name] != after[name]} == {part}
    previous = _previous(tmp_path / "earlier", before_spec, before)
    assert what_changed(after_spec, after, previous) == [said]


def test_where_and_how_long_a_stage_runs_is_not_a_change() -> None:
    base = run_inputs(_spec(), DATA)
    for override in (
        "stages.sft.resources.gpus_per_node=4",
        "stages.sft.run_policy.active_deadline_seconds=600",
        "stages.prepare.skip_if_unchanged=true",
        "stages.prepare.num_proc=3",
        "stages.cpt.data.uri=/elsewhere/corpus.jsonl",  # the same rows elsewhere: data counts by content
    ):
        assert run_inputs(_spec(override), DATA) == base, override


def test_other_data_and_another_version_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec()
    monkeypatch.setattr(inputs_module, "git_sha", lambda: "aaaa")
    before = run_inputs(spec, DATA)
    previous = _previous(tmp_path / "earlier", spec, before)
    monkeypatch.setattr(inputs_module, "git_sha", lambda: "bbbb")
    after = run_inputs(spec, {**DATA, "sft": "sha256:new-chats"})
    changes = what_changed(spec, after, previous)
    assert changes[0] == "data of sft"
    assert changes[1].startswith("project version (") and changes[1].endswith("+aaaa → 0.1.0+bbbb)")


def test_a_run_recorded_before_the_parts_were_is_a_change(tmp_path: Path) -> None:
    spec = _spec()
    previous = _previous(tmp_path / "earlier", spec, None)
    assert what_changed(spec, run_inputs(spec, DATA), previous) == [
        "run earlier recorded its data only, not its model, configuration and version"
    ]
