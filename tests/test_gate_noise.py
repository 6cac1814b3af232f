"""Each shipped local gate sits between the noise of its metric and a candidate that learned nothing, as measured
by bench/gate_noise.py (bench/results/2026-11-28-gate-noise-cpu.json, and 2026-12-03-gate-noise-qwen-72b-cpu.json
for qwen-72b since its stand-in trains its embedding and head; docs/gates.md): a candidate trained with
another seed passes against the champion of any seed, and the untrained candidate fails against every one. A gate
tightened below the noise or loosened past the untrained candidate fails here; tests/test_shipped_pipelines.py,
tests/test_local_dag.py and tests/test_variants.py train the untrained candidate and watch the gate stop it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spec.loading import load_pipeline
from spec.release import GateRule
from spec.variants import variant_specs

RESULTS = Path(__file__).parent.parent / "bench" / "results"
MEASURED = {
    **json.loads((RESULTS / "2026-11-28-gate-noise-cpu.json").read_text())["runs"],
    **json.loads((RESULTS / "2026-12-03-gate-noise-qwen-72b-cpu.json").read_text())["runs"],
}

CASES = [
    ("korean-llm", None, "korean-llm"),
    ("qwen3-30b-a3b", None, "qwen3-30b-a3b"),
    ("qwen-multi", "qwen-7b", "qwen-multi qwen-7b"),
    ("qwen-multi", "qwen-72b", "qwen-multi qwen-72b, embedding and head trained whole in cpt (lora.modules_to_save)"),
    ("llama3-dolly", None, "llama3-dolly, evaluate on sft's held-out rows (stages.evaluate.data=null)"),
]


def perplexity_rule(pipeline: str, variant: str | None) -> GateRule:
    spec = load_pipeline(pipeline, profile="local").spec
    if variant is not None:
        spec = variant_specs(spec)[variant]
    (rule,) = [r for r in spec.stages.evaluate.gate if r.metric == "perplexity"]
    return rule


@pytest.mark.parametrize(("pipeline", "variant", "measured"), CASES, ids=[c[1] or c[0] for c in CASES])
def test_each_local_gate_passes_another_seed_and_stops_an_untrained_candidate(
    pipeline: str, variant: str | None, measured: str
) -> None:
    rule = perplexity_rule(pipeline, variant)
    seeds, untrained = MEASURED[measured]["perplexity"]["values"], MEASURED[measured]["perplexity"]["untrained"]
    assert rule.within_allowance(max(seeds), min(seeds)), f"{rule}: the worst seed fails against the best"
    assert not any(rule.within_allowance(untrained, champion) for champion in seeds), f"{rule}: untrained passes"


def test_the_held_out_text_did_not_tell_llama3_dollys_untrained_candidate_apart() -> None:
    """Why llama3-dolly's evaluate scores sft's held-out rows: on the Korean text it never trains on, the untrained
    candidate scored better than every trained seed."""
    before = MEASURED["llama3-dolly, evaluate on korean-heldout text (before)"]["perplexity"]
    assert before["untrained"] < min(before["values"])
    assert load_pipeline("llama3-dolly", profile="local").spec.stages.evaluate.data is None


def test_qwen_72bs_stand_in_did_not_learn_measurably_with_adapters_alone() -> None:
    """Why qwen-72b's local cpt trains the stand-in's embedding and head whole: with LoRA adapters alone, the
    candidate that learned nothing scored within the trained seeds."""
    before = MEASURED["qwen-multi qwen-72b"]["perplexity"]
    assert min(before["values"]) <= before["untrained"] <= max(before["values"]) * 1.01
    spec = variant_specs(load_pipeline("qwen-multi", profile="local").spec)["qwen-72b"]
    assert spec.stages.cpt.lora.modules_to_save == ["embed_tokens", "lm_head"]
