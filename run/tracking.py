"""Where a run's tracking lives: its tracking.json, and the MLflow store it uses (a server, or the local SQLite file).

The stages log there (stages/tracking_mlflow_server.py); the local runner, the rollout and `posttrain runs` read
the same store to find a run's models and aliases.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spec.pipeline import PipelineSpec

TRACKING_FILE = "tracking.json"
"""`<run>/tracking.json`: the MLflow experiment and parent run ids shared by the stages of a run."""

LOCAL_STORE = "mlflow.db"
"""The local tracking store's database, beside the run directories (`runs/mlflow.db`, artifacts in
`runs/mlartifacts/`), shared by the local runs there so that the gate compares with the last local champion."""


def local_store_uri(run_root: Path) -> str:
    """The SQLite store a run without a tracking server uses: the one its tracking.json names (a run keeps its
    store when resumed), else `<run>/mlflow.db` when the run has one (made before the store was shared), else the
    shared `mlflow.db` in the folder that holds the run directory."""
    root = Path(run_root).absolute()
    recorded = str(read_tracking_file(root).get("mlflow", {}).get("tracking_uri") or "")
    if recorded.startswith("sqlite:///"):
        return recorded
    if (root / LOCAL_STORE).is_file():
        return f"sqlite:///{root / LOCAL_STORE}"
    return f"sqlite:///{root.parent / LOCAL_STORE}"


def resolve_tracking_uri(spec: PipelineSpec, run_root: Path) -> str:
    """spec.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else the local SQLite store
    (`local_store_uri`)."""
    return spec.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store_uri(run_root)


def read_tracking_file(run_root: Path) -> dict[str, Any]:
    """The run's tracking.json, {} when it has none (or an unreadable one)."""
    path = run_root / TRACKING_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
