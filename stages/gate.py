"""The gate: whether the candidate holds up against the reference model under the spec's rules."""

from __future__ import annotations

import math
from dataclasses import dataclass

from run.release import GATE_FAIL, GATE_PASS
from spec.release import GateRule
from stages.report import plus_minus, stderr_name


@dataclass
class GateCheck:
    """One gate rule, evaluated: `threshold` is the line the candidate had to stay above (higher is better) or
    below, where it could be drawn; the standard errors are lm-eval's, where known."""

    metric: str
    higher_is_better: bool
    max_regression: float
    candidate: float | None
    reference: float | None
    reference_name: str
    passed: bool
    reason: str
    max_regression_relative: float | None = None
    min_significance: float | None = None
    allowed: float | None = None  # the regression allowed: max(max_regression, relative x |reference|)
    threshold: float | None = None
    candidate_stderr: float | None = None
    reference_stderr: float | None = None


def _finite(values: dict[str, float], key: str) -> float | None:
    value = values.get(key)
    return value if value is not None and math.isfinite(value) else None


def check_rule(rule: GateRule, candidate: dict[str, float], reference: dict[str, float], ref_name: str) -> GateCheck:
    """Whether the candidate holds up against the reference on one metric. It may fall behind by the larger of
    max_regression and max_regression_relative x |reference|; with min_significance k it must also be better by
    more than k standard errors of the difference, sqrt(se_candidate^2 + se_reference^2) (the two measurements
    are independent), a rule that fails, saying so, when either standard error is unknown."""
    value, ref = _finite(candidate, rule.metric), _finite(reference, rule.metric)
    se_c, se_r = _finite(candidate, stderr_name(rule.metric)), _finite(reference, stderr_name(rule.metric))
    sign = 1.0 if rule.higher_is_better else -1.0
    direction = "higher" if rule.higher_is_better else "lower"
    allowed = rule.allowance(ref) if ref is not None else rule.max_regression
    threshold = ref - sign * allowed if ref is not None else None

    def result(passed: bool, reason: str) -> GateCheck:
        return GateCheck(
            rule.metric,
            rule.higher_is_better,
            rule.max_regression,
            candidate.get(rule.metric),
            reference.get(rule.metric),
            ref_name,
            passed,
            reason,
            rule.max_regression_relative,
            rule.min_significance,
            allowed if ref is not None else None,
            threshold,
            se_c,
            se_r,
        )

    if value is None:
        measured = ", ".join(sorted(candidate)) or "nothing"
        return result(False, f"{rule.metric}: not measured for the candidate (measured: {measured})")
    if ref is None:
        return result(False, f"{rule.metric}: no value for the {ref_name} to compare with")
    passed = rule.within_allowance(value, ref)
    regression = sign * (ref - value)
    how = f"{allowed:.6g}"
    if rule.max_regression_relative is not None:
        how += f" = max({rule.max_regression:g}, {rule.max_regression_relative:g} x {abs(ref):.6g})"
    reason = (
        f"{rule.metric}: candidate {plus_minus(value, se_c)} vs {ref_name} {plus_minus(ref, se_r)} "
        f"({direction} is better; regression {max(regression, 0.0):.6g}, allowed {how}"
    )
    if rule.min_significance is not None:
        k = rule.min_significance
        if se_c is None or se_r is None:
            unknown = [who for who, se in (("candidate", se_c), (ref_name, se_r)) if se is None]
            passed = False
            reason += (
                f"; min_significance {k:g} needs standard errors, unknown for the {' and the '.join(unknown)} "
                f"(no {stderr_name(rule.metric)})"
            )
        else:
            se = math.hypot(se_c, se_r)
            gain = sign * (value - ref)
            significant = gain > k * se
            passed = passed and significant
            threshold = max(threshold, ref + k * se) if rule.higher_is_better else min(threshold, ref - k * se)
            reason += (
                f"; improvement {gain:.6g}, needed more than {k:g} x {se:.3g} = {k * se:.3g}, where {se:.3g} = "
                f"sqrt({se_c:.3g}^2 + {se_r:.3g}^2) is the standard error of the difference: "
                f"{'significant' if significant else 'not significant'}"
            )
    return result(passed, f"{reason}): {'holds' if passed else 'fails'}")


def apply_gate(
    rules: list[GateRule], candidate: dict[str, float], reference: dict[str, float], ref_name: str
) -> tuple[str, list[str], list[GateCheck]]:
    """('pass' or 'fail', the reasons, the checks): pass when every rule holds against the reference."""
    checks = [check_rule(rule, candidate, reference, ref_name) for rule in rules]
    decision = GATE_PASS if all(c.passed for c in checks) else GATE_FAIL
    reasons = [c.reason for c in checks]
    if not rules:
        reasons = ["no gate rules: the candidate passes"]
    return decision, reasons, checks
