"""Config files a pipeline names (a DeepSpeed JSON, an accelerate YAML): read when the pipeline is loaded and
embedded into the spec document, so the spec alone carries them to the local runner and to the pods.

A relative path is relative to the pipeline file's folder, or to the current directory when it came from `--set`.
An unreadable or malformed file is a SpecError naming the pipeline line (or `--set`) and the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workflows.loading import Origins, SpecError, load_yaml
from workflows.quoting import quoted

CONFIG_FILE_FIELDS: dict[str, str] = {"deepspeed_config": "json", "accelerate_config": "yaml"}
"""Fields of a stage's `distributed` section that may name a file: field → the file's format."""


class _KeyTwice(ValueError):
    """A JSON object that gives one key twice (json.loads would keep the last; the YAML loader refuses it too)."""


def _keys_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise _KeyTwice(next(k for i, (k, _) in enumerate(pairs) if any(k == j for j, _ in pairs[:i])))
    return value


def _read(path: Path, kind: str, where: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{where}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{where}: cannot read {path}: {exc}") from None
    if kind == "json":
        try:
            value = json.loads(text, object_pairs_hook=_keys_once)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{where}: {quoted(path)}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        except _KeyTwice as exc:
            raise SpecError(f"{where}: {quoted(path)}: key {exc.args[0]!r} is given twice in one object") from None
    else:
        value = load_yaml(text, str(path))
    if not isinstance(value, dict):
        raise SpecError(f"{where}: {path} must hold a mapping of settings, not {type(value).__name__}")
    return value


def embed_config_files(doc: dict[str, Any], origins: Origins, pipeline_file: Path) -> None:
    """Replace each `stages.<stage>.distributed.<field>` that is a path by the content of that file."""
    stages = doc.get("stages")
    if not isinstance(stages, dict):
        return
    for stage, section in stages.items():
        distributed = section.get("distributed") if isinstance(section, dict) else None
        if not isinstance(distributed, dict):
            continue
        for name, kind in CONFIG_FILE_FIELDS.items():
            value = distributed.get(name)
            if not isinstance(value, str):
                continue
            loc = ("stages", stage, "distributed", name)
            origin = origins.find(loc) or str(pipeline_file)
            base = Path.cwd() if origin.startswith("--set") else pipeline_file.parent
            path = Path(value).expanduser()
            path = path if path.is_absolute() else base / path
            distributed[name] = _read(path, kind, f"{origin}: {'.'.join(loc)}")
