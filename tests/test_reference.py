"""docs/spec.md is generated from the models and every field is documented."""

from __future__ import annotations

from pathlib import Path

from spec.pipeline import PipelineSpec
from spec.reference import _models, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "spec.md"


def test_every_field_has_a_description() -> None:
    missing = [
        f"{m.__name__}.{n}" for m in _models(PipelineSpec) for n, f in m.model_fields.items() if not f.description
    ]
    assert missing == []


def test_reference_is_up_to_date() -> None:
    assert DOC.read_text(encoding="utf-8") == render() + "\n", "regenerate: python -m spec.reference > docs/spec.md"
