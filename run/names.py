"""The names a run is known by outside its code: its folder on the volume, labels, environment variables, Katib's
parameter names."""

from __future__ import annotations

RUN_ROOT = "runs"
PART_OF = "posttrain"
STAGE_LABEL = "posttrain.dev/stage"
PIPELINE_LABEL = "posttrain.dev/pipeline"
METRICS_PORT_ENV = "POSTTRAIN_METRICS_PORT"  # where stages/metrics.py serves, when set


def katib_parameter_name(path: str) -> str:
    """Katib's name for a search parameter path (Katib names allow no dots or underscores)."""
    return path.replace(".", "-").replace("_", "-")
