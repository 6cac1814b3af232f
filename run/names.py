"""The names a run is known by outside its code: its folder on the volume, its labels, its environment variables."""

from __future__ import annotations

RUN_ROOT = "runs"
PART_OF = "posttrain"
STAGE_LABEL = "posttrain.dev/stage"
PIPELINE_LABEL = "posttrain.dev/pipeline"
METRICS_PORT_ENV = "POSTTRAIN_METRICS_PORT"  # where stages/metrics.py serves, when set
