"""The words a run's release is recorded in (the gate's outcome, the registry's aliases)."""

from __future__ import annotations

GATE_PASS, GATE_FAIL, GATE_SKIPPED = "pass", "fail", "skipped"

CHAMPION = "champion"
CHALLENGER = "challenger"
