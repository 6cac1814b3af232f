"""`python -m workflows.import llamafactory|axolotl RECIPE.yaml [-o pipeline.yaml]`: a recipe of another trainer
as a pipeline file (the mapping lives in workflows/importers.py)."""

from __future__ import annotations

import sys

from workflows.importers import main

if __name__ == "__main__":
    sys.exit(main())
