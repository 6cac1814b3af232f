"""Config files a pipeline names (a DeepSpeed JSON, an accelerate YAML): read when the pipeline is loaded and
embedded into the spec document, so the spec alone carries them to the local runner and to the pods.

A relative path is relative to the pipeline file's folder, or to the current directory when it came from `--set`.
An unreadable or malformed file is a SpecError naming the pipeline line (or `--set`) and the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spec.document import Origins, SpecError, load_json, load_yaml
from spec.quoting import quoted

CONFIG_FILE_FIELDS: dict[str, str] = {"deepspeed_config": "json", "accelerate_config": "yaml"}
"""Fields of a stage's `distributed` section that may name a file: field → the file's format."""


def _read(path: Path, kind: str, where: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{where}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{where}: cannot read {path}: {exc}") from None
    value = load_json(text, f"{where}: {quoted(path)}") if kind == "json" else load_yaml(text, str(path))
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
