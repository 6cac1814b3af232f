"""The lm-eval task names a spec may ask for: the installed harness's registry plus the tasks of the include path.

`stages.evaluate.lm_eval_tasks` is checked against them before anything trains: by `workflows.submit` and
`workflows.register` on the submitter's machine when lm-eval is installed there, and by prepare in the pod (the
trainer image has it), so a misspelt task fails the run at its first step instead of after hours of training.

Indexing the harness's task YAMLs takes about ten seconds, so the registry's names are cached per lm-eval version
(`$XDG_CACHE_HOME/posttrain/lm-eval-<version>-tasks.json`, else under ~/.cache; nothing is cached where neither is
writable). An include path's own tasks are read each time; `builtin:<name>` folders are known by name.
"""

from __future__ import annotations

import difflib
import json
import os
from importlib import metadata
from pathlib import Path

from spec.pipeline import PipelineSpec

LM_EVAL_TASKS = "korean-lm-eval"
"""The builtin task folder: `stages.evaluate.lm_eval_include_path: builtin:korean-lm-eval` (prepare writes it,
stages/builtin_data.py)."""

BUILTIN_TASK_NAMES = ("ko_constitution_mc",)
"""The tasks of the builtin folder (stages.builtin_data.BUILTIN_LM_EVAL_TASKS makes each one)."""


def _cache_file(version: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "posttrain" / f"lm-eval-{version}-tasks.json"


def registry_tasks() -> set[str]:
    """Every task, group and tag name the installed lm-eval defines (cached per version)."""
    version = metadata.version("lm_eval")
    cache = _cache_file(version)
    try:
        return set(json.loads(cache.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pass
    from lm_eval.tasks import TaskManager

    names = set(TaskManager().all_tasks)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(names)), encoding="utf-8")
        tmp.replace(cache)
    except OSError:
        pass  # a read-only home: index again next time
    return names


def include_path_tasks(include_path: str) -> set[str] | None:
    """The tasks an include path defines: a builtin folder's by name, a local directory's from its YAMLs; None
    when the path cannot be read here (a volume of the cluster, seen from the submitter's machine)."""
    if include_path.startswith("builtin:"):
        return set(BUILTIN_TASK_NAMES) if include_path == f"builtin:{LM_EVAL_TASKS}" else set()
    if not Path(include_path).is_dir():
        return None
    from lm_eval.tasks import TaskManager

    return set(TaskManager(include_path=include_path, include_defaults=False).all_tasks)


def unknown_tasks(spec: PipelineSpec, include_path: str | None = None) -> list[str]:
    """One message per task of `stages.evaluate.lm_eval_tasks` that neither the registry nor the include path
    (`include_path` overrides the spec's, e.g. the resolved local folder) defines, with close names suggested.
    Empty when every task is known, or when the include path cannot be read here (it may define the rest)."""
    section = spec.stages.evaluate
    if not section.enabled or not section.lm_eval_tasks:
        return []
    known = registry_tasks()
    path = include_path or section.lm_eval_include_path
    if path is not None:
        local = include_path_tasks(path)
        if local is None:
            return []
        known |= local
    problems = []
    for i, task in enumerate(section.lm_eval_tasks):
        if task in known:
            continue
        close = difflib.get_close_matches(task, known, n=3, cutoff=0.75)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" or in {path}" if path else ""
        problems.append(
            f"stages.evaluate.lm_eval_tasks[{i}]: {task!r} is not a task of lm-eval {metadata.version('lm_eval')}"
            f"{where}{hint}"
        )
    return problems
