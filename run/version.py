"""The project's version as both planes report it: the installed package's version and the source commit."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGE = "posttrain"
"""The distribution name in pyproject.toml."""


def package_version() -> str:
    """The installed package's version ('unknown' when the project is not installed, e.g. a bare checkout)."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def git_sha() -> str | None:
    """The source commit: $POSTTRAIN_GIT_SHA or $GIT_SHA, else `git rev-parse HEAD` when in a checkout."""
    for name in ("POSTTRAIN_GIT_SHA", "GIT_SHA"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None
