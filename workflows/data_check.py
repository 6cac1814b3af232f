"""Each stage's data checked before a run starts: `python -m stages check-data` on the spec the run will use.

`submit --local` runs it before the run directory exists, `submit --dry-run` for the data this machine can see: a
missing file, a column mapping the data does not have, a file not in its encoding are refused at once, one `error:`
line per problem, exit 2, instead of in prepare after the runner and its first stage have started. The check reads
data with the data plane's readers (stages/check_data.py), so it runs as that plane's command, in a process of its
own: the spec reaches it as a JSON file (what spec.json holds), the command is an argv list, never a shell line.
What it cannot do (it crashed, or timed out) is said as a warning, and the run goes on: prepare checks the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from run.exits import EXIT_USAGE
from run.masking import mask_secrets
from spec.data import datasets

if TYPE_CHECKING:
    from spec.pipeline import PipelineSpec

REPO_ROOT = Path(__file__).resolve().parents[1]

CHECK_TIMEOUT_S = 120.0
"""How long the check may take (it reads a few rows of each file: well under a second on the shipped pipelines)."""


NOT_HERE = ("builtin:", "hf://", "s3://", "gs://")
"""Data the check does not read on this machine: builtin data (generated, always valid) and what needs network or
credentials (prepare checks it in the cluster)."""

WILDCARDS = "*?["


def readable_here(uri: str, visible_only: bool) -> bool:
    """Whether the check may have something to read at `uri` (so that a spec without such data costs no process):
    a local path, one that exists on this machine with `visible_only` (a glob: its folder)."""
    if uri.startswith(NOT_HERE):
        return False
    if not visible_only or uri.startswith("pvc://"):  # a claim's path: the check resolves its mount
        return True
    parts = Path(uri.removeprefix("file://")).parts
    fixed = parts[: next((i for i, part in enumerate(parts) if any(c in part for c in WILDCARDS)), len(parts))]
    return Path(*fixed).exists() if fixed else True


def data_uris(spec: PipelineSpec) -> list[str]:
    """The data URI of every enabled stage that reads data."""
    sections = [spec.stage(name) for name in spec.stages.enabled()]
    return [spec.data_uri(data) for section in sections for data in datasets(getattr(section, "data", None))]


def check_command(spec_file: Path, visible_only: bool) -> list[str]:
    """The argv of the data plane's check of the spec in `spec_file`."""
    command = [sys.executable, "-m", "stages", "check-data", "--spec", str(spec_file)]
    return [*command, "--visible-only"] if visible_only else command


def _env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH, as the stages get it."""
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *rest])
    return env


def data_problems(specs: list[PipelineSpec], visible_only: bool = False) -> tuple[list[str], list[str]]:
    """(error lines, warnings) of the data of the runs of `specs` (a pipeline's, or each variant's): the `error:`
    lines of `python -m stages check-data`, each once, secrets masked."""
    errors: list[str] = []
    warnings: list[str] = []
    with tempfile.TemporaryDirectory(prefix="posttrain-check-data-") as folder:
        for number, spec in enumerate(specs):
            if not any(readable_here(uri, visible_only) for uri in data_uris(spec)):
                continue
            spec_file = Path(folder) / f"spec-{number}.json"
            spec_file.write_text(
                json.dumps(spec.model_dump(mode="json", exclude={"profiles"}), ensure_ascii=False), encoding="utf-8"
            )
            command = check_command(spec_file, visible_only)
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, env=_env(), timeout=CHECK_TIMEOUT_S, check=False
                )
            except subprocess.TimeoutExpired:
                warnings.append(f"the data check took over {CHECK_TIMEOUT_S:g} s and was stopped; prepare checks it")
                continue
            lines = [mask_secrets(line) for line in done.stderr.splitlines()]
            if done.returncode == EXIT_USAGE and any(line.startswith("error: ") for line in lines):
                errors += [line for line in lines if line.startswith("error: ") and line not in errors]
            elif done.returncode != 0:
                last = next((line for line in reversed(lines) if line.strip()), f"exit code {done.returncode}")
                warnings.append(f"the data check failed ({last.strip()}); prepare checks the data")
    return errors, warnings
