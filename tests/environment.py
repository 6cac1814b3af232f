"""The environment every test starts with: taken before collection, put back before and after each test.

Imports and libraries in the test process set variables as they go (torch's inductor its cache directory, MLflow its
telemetry session, W&B its service, tokenizers its parallelism): left in place, each would make the stage children
of every later test differ from the worker's warm-start server, whose environment is this one (tests/
training_fixtures.py), and start them as fresh processes. A test's own changes (monkeypatch) end with the test.
"""

from __future__ import annotations

import os

_baseline: dict[str, str] = {}

PYTEST_OWN = "PYTEST_CURRENT_TEST"
"""pytest sets and removes it around every phase of a test: never touched here."""


def baseline() -> dict[str, str]:
    """The environment tests start with (taken at the first call)."""
    if not _baseline:
        _baseline.update((k, v) for k, v in os.environ.items() if k != PYTEST_OWN)
    return _baseline


def restore() -> None:
    """Put the environment back to the baseline: variables set since are removed, changed ones reset."""
    expected = baseline()
    for name in [name for name in os.environ if name not in expected and name != PYTEST_OWN]:
        del os.environ[name]
    for name, value in expected.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
