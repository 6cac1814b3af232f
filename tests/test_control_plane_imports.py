"""The control plane stays light: no module of `workflows`, nor of the `spec` and `run` it reads, imports a training
library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINING_LIBRARIES = (
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "mlflow",
    "wandb",
    "lm_eval",
    "deepspeed",
)

_PROBE = """
import importlib, json, pkgutil, sys
import run, spec, workflows
modules = [m.name for p in (spec, run, workflows) for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({"modules": modules, "loaded": sorted(sys.modules)}))
"""


def test_no_workflows_module_imports_a_training_library() -> None:
    """In a fresh interpreter (the test process itself has loaded them), import every module of `workflows`,
    `spec` and `run`."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert {"spec.pipeline", "spec.loading", "run.durations", "workflows.compile", "workflows.submit"} <= set(
        result["modules"]
    )
    heavy = sorted(name for name in result["loaded"] if name.split(".")[0] in TRAINING_LIBRARIES)
    assert not heavy, f"workflows imports training libraries: {heavy[:10]}"
