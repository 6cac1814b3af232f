"""A candidate that learned nothing: the --set arguments that train one, for the tests that watch a local gate
stop it (tests/test_shipped_pipelines.py, tests/test_variants.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def untrained_overrides(spec: dict[str, Any]) -> list[str]:
    """--set arguments that train each training stage one step at its learning rate / 10,000 (a search is switched
    off: it would choose the learning rate again). The stages all run, as in the pipeline, and learn nothing: more
    steps at that rate only cost the suite time (korean-llm's perplexity 2,071.85 after its 80 steps, 2,072.10 after
    3)."""
    sets = []
    for stage in ("cpt", "sft", "rlhf"):
        section = spec["stages"].get(stage)
        if section and section.get("enabled", True):
            sets += ["--set", f"stages.{stage}.training.learning_rate={section['training']['learning_rate'] / 1e4:g}"]
            sets += ["--set", f"stages.{stage}.training.max_steps=1"]
            if section.get("hpo"):
                sets += ["--set", f"stages.{stage}.hpo=null"]
    return sets


def assert_the_gate_stopped_it(run_root: Path) -> None:
    """The untrained candidate's run: its gate failed against the champion an earlier run promoted, on
    perplexity, and deploy did not succeed."""
    evaluate = json.loads((run_root / "evaluate" / "stage.json").read_text())["extra"]
    assert evaluate["gate"] == "fail" and evaluate["reference"].startswith("champion v"), evaluate["gate_reasons"]
    assert any("perplexity" in reason and reason.endswith("fails") for reason in evaluate["gate_reasons"])
    record = run_root / "deploy" / "stage.json"
    assert not record.is_file() or json.loads(record.read_text())["status"] != "succeeded"
