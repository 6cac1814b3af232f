"""A report people can trust, without training a model: lm-eval's standard errors and sample counts carried into the
metrics, gate rules that require significance or allow a relative regression, and the report's structure (one loss
panel per training stage, gate thresholds drawn on the metric panels, ± and n in the tables), read from figures.json
and the HTML rather than from pixels."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from spec.document import SpecError
from spec.form import check_gate_kept
from spec.loading import load_pipeline
from spec.release import GateRule
from stages.gate import apply_gate, check_rule
from stages.measures import flatten_lm_eval
from stages.report import stderr_name, write_report

# What lm_eval.simple_evaluate returned (bootstrap_iters=1000, limit=20) for the builtin ko_constitution_mc task on
# the tiny random model, trimmed to the keys evaluate reads; plus a task with a filter and a standard error that
# lm-eval could not compute ('N/A').
RECORDED = {
    "results": {
        "ko_constitution_mc": {
            "name": "ko_constitution_mc",
            "alias": "ko_constitution_mc",
            "sample_len": 20,
            "acc,none": 0.45,
            "acc_stderr,none": 0.11413288653790232,
            "acc_norm,none": 0.25,
            "acc_norm_stderr,none": 0.09933992677987828,
        },
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 1.0, "exact_match_stderr,strict-match": "N/A"},
    },
    "group_subtasks": {},
    "versions": {"ko_constitution_mc": 1.0},
    "n-shot": {"ko_constitution_mc": 0},
    "higher_is_better": {"ko_constitution_mc": {"acc": True, "acc_norm": True}},
    "n-samples": {"ko_constitution_mc": {"original": 60, "effective": 20}, "gsm8k": {"original": 1319, "effective": 1}},
}


def test_lm_eval_standard_errors_and_sample_counts_are_kept() -> None:
    metrics = flatten_lm_eval(RECORDED)
    assert metrics == {
        "ko_constitution_mc/acc": 0.45,
        "ko_constitution_mc/acc_stderr": pytest.approx(0.11413288653790232),
        "ko_constitution_mc/acc_norm": 0.25,
        "ko_constitution_mc/acc_norm_stderr": pytest.approx(0.09933992677987828),
        "ko_constitution_mc/n_samples": 20.0,
        "gsm8k/exact_match/strict-match": 1.0,  # its 'N/A' standard error is left out, not a number
        "gsm8k/n_samples": 1.0,
    }
    assert stderr_name("ko_constitution_mc/acc") in metrics
    assert stderr_name("gsm8k/exact_match/strict-match") == "gsm8k/exact_match_stderr/strict-match"


def test_lm_eval_is_asked_for_standard_errors() -> None:
    """bootstrap_iters=0 makes lm-eval report every standard error as 'N/A'."""
    import inspect

    import stages.measures as measures

    assert measures.BOOTSTRAP_ITERS > 0
    assert "bootstrap_iters=BOOTSTRAP_ITERS" in inspect.getsource(measures.run_lm_eval)  # both backends call it


# --------------------------------------------------------------------------- significance

ACC = "arc_easy/acc"


def acc(value: float, stderr: float | None = 0.02) -> dict[str, float]:
    return {ACC: value} | ({f"{ACC}_stderr": stderr} if stderr is not None else {})


def test_a_significant_improvement_passes() -> None:
    rule = GateRule(metric=ACC, min_significance=2)
    check = check_rule(rule, acc(0.70), acc(0.60), "champion v2")
    se = math.hypot(0.02, 0.02)  # the two measurements are independent
    assert check.passed and check.threshold == pytest.approx(0.60 + 2 * se)
    assert check.candidate_stderr == 0.02 and check.reference_stderr == 0.02
    assert "candidate 0.7 ± 0.02 vs champion v2 0.6 ± 0.02" in check.reason
    assert f"needed more than 2 x {se:.3g}" in check.reason and "significant" in check.reason


def test_an_improvement_within_the_noise_fails() -> None:
    """3 questions more out of 60 is +0.05 with a standard error of about 0.06 each: not significant."""
    rule = GateRule(metric=ACC, min_significance=1)
    check = check_rule(rule, acc(0.55, 0.064), acc(0.50, 0.065), "base model")
    assert not check.passed and "not significant" in check.reason and check.reason.endswith("fails")
    # Without min_significance the same numbers pass: the rule only asks for no regression.
    assert check_rule(GateRule(metric=ACC), acc(0.55, 0.064), acc(0.50, 0.065), "base model").passed


@pytest.mark.parametrize(
    ("candidate", "reference", "unknown"),
    [
        (acc(0.9, None), acc(0.5), "unknown for the candidate"),
        (acc(0.9), acc(0.5, None), "unknown for the champion v1"),
        (acc(0.9, None), acc(0.5, float("nan")), "unknown for the candidate and the champion v1"),
    ],
    ids=["candidate", "reference", "both"],
)
def test_significance_without_a_standard_error_fails_saying_so(
    candidate: dict[str, float], reference: dict[str, float], unknown: str
) -> None:
    decision, reasons, (check,) = apply_gate(
        [GateRule(metric=ACC, min_significance=2)], candidate, reference, "champion v1"
    )
    assert decision == "fail" and not check.passed
    assert f"min_significance 2 needs standard errors, {unknown} (no arc_easy/acc_stderr)" in reasons[0]


def test_significance_for_a_lower_is_better_metric() -> None:
    rule = GateRule(metric="wikitext/word_perplexity", higher_is_better=False, min_significance=1)
    better = {"wikitext/word_perplexity": 9.0, "wikitext/word_perplexity_stderr": 0.3}
    reference = {"wikitext/word_perplexity": 10.0, "wikitext/word_perplexity_stderr": 0.4}
    check = check_rule(rule, better, reference, "base model")
    assert check.passed and check.threshold == pytest.approx(10.0 - 0.5)  # sqrt(0.3² + 0.4²) = 0.5


# --------------------------------------------------------------------------- relative regression


def test_perplexity_may_regress_relatively() -> None:
    rule = GateRule(metric="perplexity", higher_is_better=False, max_regression_relative=0.05)
    reference = {"perplexity": 10.0}
    holds = check_rule(rule, {"perplexity": 10.4}, reference, "champion v3")
    assert holds.passed and holds.threshold == pytest.approx(10.5) and holds.allowed == pytest.approx(0.5)
    assert "allowed 0.5 = max(0, 0.05 x 10)" in holds.reason
    fails = check_rule(rule, {"perplexity": 10.6}, reference, "champion v3")
    assert not fails.passed and fails.reason.endswith("fails")
    # The same 5% of a perplexity of 100 allows 5: the allowance follows the scale, an absolute one would not.
    assert check_rule(rule, {"perplexity": 104.0}, {"perplexity": 100.0}, "base model").passed
    # Next to an absolute max_regression, the larger allowance applies.
    both = GateRule(metric="perplexity", higher_is_better=False, max_regression=1.0, max_regression_relative=0.05)
    assert check_rule(both, {"perplexity": 10.9}, reference, "base model").threshold == pytest.approx(11.0)


def test_existing_rules_decide_as_before() -> None:
    rule = GateRule(metric="perplexity", higher_is_better=False, max_regression=0.5)
    check = check_rule(rule, {"perplexity": 10.4}, {"perplexity": 10.0}, "base model")
    assert check.passed and check.threshold == 10.5 and check.max_regression_relative is None
    assert check.reason == (
        "perplexity: candidate 10.4 vs base model 10 (lower is better; regression 0.4, allowed 0.5): holds"
    )
    # A value on the line holds, as it did: 0.69 - 0.70 is -0.010000000000000009 in floating point.
    assert check_rule(GateRule(metric=ACC, max_regression=0.01), {ACC: 0.69}, {ACC: 0.70}, "base model").passed


# --------------------------------------------------------------------------- the spec and the form


def test_significance_on_a_metric_without_a_standard_error_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_pipeline(
            "korean-llm",
            "local",
            ["tracking.wandb_project=null", "stages.evaluate.gate=[{metric: perplexity, min_significance: 2}]"],
        )
    message = str(caught.value)
    assert "stages.evaluate.gate[0].min_significance" in message and "has no standard error" in message
    with pytest.raises(SpecError, match=r"stages\.evaluate\.gate\[0\]\.max_regression_relative"):
        load_pipeline(
            "korean-llm",
            "local",
            ["tracking.wandb_project=null", "stages.evaluate.gate=[{metric: perplexity, max_regression_relative: 2}]"],
        )


def test_a_rule_at_least_as_strict_never_passes_what_the_rule_stops() -> None:
    """The rule's two halves agree: whatever `at_least_as_strict_as` lets the form put in a rule's place passes no
    candidate the rule itself stops, over a grid of rules, candidates and references."""
    rules = [
        GateRule(metric="perplexity", higher_is_better=False, max_regression=a, max_regression_relative=r)
        for a in (0.0, 0.5, 2.0)
        for r in (None, 0.01, 0.05)
    ]
    compared = 0
    for rule in rules:
        for other in rules:
            if not other.at_least_as_strict_as(rule):
                continue
            for reference in (1.0, 10.0, 100.0):
                for value in (reference * f for f in (0.9, 1.0, 1.004, 1.02, 1.06, 1.3)):
                    compared += 1
                    assert not other.within_allowance(value, reference) or rule.within_allowance(value, reference)
    assert compared > 100
    loose = GateRule(metric="perplexity", higher_is_better=False, max_regression=2.0)
    assert not loose.at_least_as_strict_as(GateRule(metric="perplexity", higher_is_better=False))
    assert not GateRule(metric="perplexity").at_least_as_strict_as(
        GateRule(metric="perplexity", higher_is_better=False)
    )


def test_the_form_may_tighten_the_new_fields_never_relax_them() -> None:
    template = [GateRule(metric=ACC, min_significance=2), GateRule(metric="perplexity", max_regression_relative=0.05)]
    tighter = [GateRule(metric=ACC, min_significance=3), GateRule(metric="perplexity")]
    check_gate_kept(template, tighter, "form")
    for relaxed in (
        [GateRule(metric=ACC, min_significance=1), template[1]],
        [GateRule(metric=ACC), template[1]],
        [template[0], GateRule(metric="perplexity", max_regression_relative=0.2)],
    ):
        with pytest.raises(SpecError, match="never remove, relax or reverse"):
            check_gate_kept(template, relaxed, "form")
    # A relative allowance added where the pipeline file has none loosens the rule too.
    with pytest.raises(SpecError, match=r"perplexity \(higher is better, max_regression 0\)"):
        check_gate_kept(
            [GateRule(metric="perplexity")], [GateRule(metric="perplexity", max_regression_relative=0.05)], "form"
        )
    with pytest.raises(SpecError, match=r"max_regression_relative 0\.05\): the form may only tighten"):
        check_gate_kept(template, [template[0], GateRule(metric="perplexity", max_regression_relative=0.2)], "form")


# --------------------------------------------------------------------------- the report


def facts(tmp_path: Path) -> dict[str, Any]:
    """What evaluate hands the report after cpt → sft → DPO, gated on perplexity (relatively) and on accuracy
    (with significance), against a champion."""
    rules = [
        GateRule(metric="perplexity", higher_is_better=False, max_regression_relative=0.05),
        GateRule(metric="ko_constitution_mc/acc", min_significance=1),
    ]
    lm = {"ko_constitution_mc/acc_stderr": 0.064, "ko_constitution_mc/n_samples": 60.0}
    heldout = {"eval_rows": 16.0, "eval_tokens": 900.0, "eval_rows_truncated": 0.0}
    candidate = {"perplexity": 10.2, "ko_constitution_mc/acc": 0.55, **lm, **heldout}
    base = {"perplexity": 30.0, "ko_constitution_mc/acc": 0.25, **lm, **heldout}
    champion = {"perplexity": 10.0, "ko_constitution_mc/acc": 0.5, "ko_constitution_mc/acc_stderr": 0.065}
    champion |= {"ko_constitution_mc/n_samples": 40.0}
    decision, reasons, checks = apply_gate(rules, candidate, champion, "champion v4")
    curve = {"steps": [1, 2, 3], "ylabel": "cross-entropy (nats/token)", "note": "..."}
    return {
        "pipeline": "korean-llm",
        "run": "korean-llm-7",
        "gate": decision,
        "gate_reasons": reasons,
        "gate_checks": [check.__dict__ for check in checks],
        "reference": "champion v4",
        "candidate_stage": "rlhf",
        "candidate": candidate,
        "base": base,
        "champion": champion,
        "champion_version": "4",
        "champion_remeasured": {},
        "registered_model": "korean-llm",
        "base_model": "Qwen/Qwen3-8B-Base",
        "perplexity_data": "prepare/data/evaluate/eval.jsonl",
        "lm_eval_tasks": ["ko_constitution_mc"],
        "limit": None,
        "prompts": [],
        "candidate_generations": [],
        "base_generations": [],
        "errors": [],
        "loss_curves": {
            "cpt": {**curve, "losses": [7.5, 6.0, 5.1], "title": "cpt: next-token loss"},
            "sft": {**curve, "losses": [2.4, 1.9, 1.7], "title": "sft: loss on the answers"},
            "rlhf": {
                "steps": [1, 2, 3],
                "losses": [0.6931, 0.69, 0.68],
                "title": "rlhf: DPO loss",
                "ylabel": "DPO loss, -log sigmoid(beta x margin)",
                "note": "starts at ln 2",
                "baseline": {"y": math.log(2), "label": "ln 2: no preference yet"},
            },
        },
    }


def test_each_training_stage_gets_its_own_loss_panel(tmp_path: Path) -> None:
    written = write_report(tmp_path, facts(tmp_path))
    assert {p.name for p in written} == {"report.md", "report.html", "figures.json", "metrics.png", "loss_curves.png"}
    figures = json.loads((tmp_path / "figures.json").read_text(encoding="utf-8"))
    axes = figures["loss_curves"]["axes"]  # read back from the drawn figure
    assert [a["title"] for a in axes] == ["cpt: next-token loss", "sft: loss on the answers", "rlhf: DPO loss"]
    assert axes[2]["ylabel"].startswith("DPO loss") and axes[0]["ylabel"].startswith("cross-entropy")
    assert [[line["label"] for line in a["lines"]] for a in axes] == [
        ["cpt"],
        ["sft"],
        ["rlhf", "ln 2: no preference yet"],
    ]
    assert axes[2]["lines"][0]["y"] == [0.6931, 0.69, 0.68]
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<figcaption>cpt: next-token loss | sft: loss on the answers | rlhf: DPO loss</figcaption>" in page


def test_gate_thresholds_are_drawn_on_the_metric_panels(tmp_path: Path) -> None:
    written_facts = facts(tmp_path)
    write_report(tmp_path, written_facts)
    figures = json.loads((tmp_path / "figures.json").read_text(encoding="utf-8"))
    drawn = {a["title"]: a for a in figures["metrics"]["axes"]}
    assert set(drawn) == {"perplexity", "ko_constitution_mc/acc"}
    (ppl_line,) = [line for line in drawn["perplexity"]["lines"] if line["label"].startswith("gate")]
    assert ppl_line["label"] == "gate: candidate ≤ 10.5" and ppl_line["y"] == [pytest.approx(10.5)] * 2
    se = math.hypot(0.064, 0.065)
    (acc_line,) = [line for line in drawn["ko_constitution_mc/acc"]["lines"] if line["label"].startswith("gate")]
    assert acc_line["y"] == [pytest.approx(0.5 + se)] * 2
    (panel,) = [p for p in figures["metrics"]["panels"] if p["metric"] == "ko_constitution_mc/acc"]
    assert [(b["name"], b["stderr"], b["n"]) for b in panel["bars"]] == [
        ("base", 0.064, "60"),
        ("champion", 0.065, "40"),
        ("candidate", 0.064, "60"),
    ]


def test_the_tables_give_standard_errors_and_sample_counts(tmp_path: Path) -> None:
    write_report(tmp_path, facts(tmp_path))
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    gate, metrics = markdown.split("## Gate", 1)[1].split("## Metrics", 1)
    assert "| metric | better | allowed regression | threshold | candidate | reference | result |" in gate
    assert "| perplexity | lower | max(0, 0.05 x reference) = 0.5 | ≤ 10.5 | 10.2 | 10 (champion v4) | pass |" in gate
    assert "| ko_constitution_mc/acc | higher | 0; better by more than 1 se |" in gate
    assert "0.55 ± 0.064 | 0.5 ± 0.065 (champion v4) | FAIL |" in gate  # +0.05 is within the noise
    assert "| metric | n | base | champion | candidate |" in metrics
    assert "| ko_constitution_mc/acc | 60 | 0.25 ± 0.064 | 0.5 ± 0.065 (n=40) | 0.55 ± 0.064 |" in metrics
    assert "| perplexity | 16 rows, 900 tokens | 30 | 10 | 10.2 |" in metrics
    assert "_stderr" not in metrics and "n_samples" not in metrics  # companions of a metric, not rows of their own
    assert "rlhf: DPO loss, 0.6931 at step 1 to 0.68 at step 3: starts at ln 2" in markdown


def test_loss_panels_are_labelled_by_what_each_stage_optimises(tmp_path: Path) -> None:
    """The shipped korean-llm pipeline: cpt, sft and DPO, each stage's trainer history as it writes it."""
    from run.run_dir import RunDir
    from stages.report import loss_curves

    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec
    assert [s for s in ("cpt", "sft", "rlhf") if spec.stage(s).enabled] == ["cpt", "sft", "rlhf"]
    assert spec.stages.rlhf.algorithm == "dpo"
    run_dir = RunDir(tmp_path)
    for stage, losses in {"cpt": [7.1, 5.0], "sft": [2.2, 1.5], "rlhf": [0.6931, 0.61]}.items():
        logs = run_dir.stage_dir(stage) / "logs"
        logs.mkdir(parents=True)
        history = [{"step": i + 1, "loss": loss, "learning_rate": 1e-4} for i, loss in enumerate(losses)]
        (logs / "log_history.json").write_text(json.dumps([*history, {"step": 2, "train_runtime": 3.0}]))
    curves = loss_curves(run_dir, spec)
    assert {stage: (c["title"], c["losses"]) for stage, c in curves.items()} == {
        "cpt": ("cpt: next-token loss", [7.1, 5.0]),
        "sft": ("sft: loss on the answers", [2.2, 1.5]),
        "rlhf": ("rlhf: DPO loss", [0.6931, 0.61]),
    }
    assert curves["rlhf"]["baseline"]["y"] == pytest.approx(0.6931, abs=1e-4) and "ln 2" in curves["rlhf"]["note"]
    spec.stages.rlhf.algorithm = "orpo"
    assert loss_curves(run_dir, spec)["rlhf"]["title"] == "rlhf: ORPO loss"
