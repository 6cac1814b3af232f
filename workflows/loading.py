"""Loading a pipeline spec: by name or path, with a profile and `--set` overrides, into a validated model.

Every value remembers where it came from (file and line, or the `--set` argument), so a validation error
names the file, the line and the field path the user has to fix.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from workflows.spec import PipelineSpec

PIPELINES_DIR = Path(__file__).parent / "pipelines"

Path_ = tuple[str | int, ...]


class SpecError(Exception):
    """A pipeline spec, profile or override the user has to fix. The message says where and what."""


@dataclass
class Origins:
    """Where each value of a spec document came from: field path → 'file:line' or '--set k=v'."""

    by_path: dict[Path_, str] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    """Overrides applied on top of the file (profile, --set, form parameters), for whole-spec errors."""

    def find(self, loc: Path_) -> str | None:
        """The origin of the deepest known path that is a prefix of `loc` (None for the document as a whole)."""
        for n in range(len(loc), 0, -1):
            if (origin := self.by_path.get(tuple(loc[:n]))) is not None:
                return origin
        return None


def known_pipelines() -> list[str]:
    """Names of the pipelines shipped in workflows/pipelines/."""
    return sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml"))


def pipeline_path(name_or_path: str) -> Path:
    """The YAML file for a pipeline given by name (shipped) or by path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if not candidate.is_file():
            raise SpecError(f"pipeline file {name_or_path} does not exist")
        return candidate
    shipped = PIPELINES_DIR / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise SpecError(
            f"unknown pipeline {name_or_path!r}; known pipelines: {', '.join(known_pipelines())} "
            "(or give a path to a YAML file)"
        )
    return shipped


# --------------------------------------------------------------------------- YAML with line numbers


class _LineLoader(yaml.SafeLoader):
    """A safe loader that also records the line of every mapping key and sequence item."""


def _compose_with_lines(text: str, filename: str) -> tuple[Any, Origins]:
    loader = _LineLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}" if mark else filename
        raise SpecError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    finally:
        loader.dispose()
    origins = Origins()
    if node is None:
        return {}, origins

    def walk(n: yaml.Node, path: Path_) -> None:
        origins.by_path.setdefault(path, f"{filename}:{n.start_mark.line + 1}")
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                key = key_node.value
                origins.by_path[(*path, key)] = f"{filename}:{key_node.start_mark.line + 1}"
                walk(value_node, (*path, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                origins.by_path[(*path, i)] = f"{filename}:{item.start_mark.line + 1}"
                walk(item, (*path, i))

    walk(node, ())
    try:
        data = yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:  # composed fine but failed to construct (e.g. bad tag)
        raise SpecError(f"{filename}: not valid YAML: {exc}") from None
    return data, origins


# --------------------------------------------------------------------------- overlays


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """`overlay` merged onto `base`: mappings merge key by key, anything else is replaced."""
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_override(expr: str) -> tuple[list[str], Any]:
    """Split 'a.b.c=value' into its path and value (a YAML scalar, list or mapping)."""
    if "=" not in expr:
        raise SpecError(f"--set {expr!r}: expected path.to.field=value")
    path, raw = expr.split("=", 1)
    keys = path.strip().split(".")
    if not path.strip() or any(not k for k in keys):
        raise SpecError(f"--set {path!r}: the field path is empty or has an empty part")
    if keys[0] == "profiles":
        raise SpecError(f"--set {path!r}: profiles cannot be set; use --profile")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: take it as a plain string
    return keys, value


def apply_override(doc: dict[str, Any], keys: list[str], value: Any, where: str) -> None:
    """Set doc[keys...] = value, creating mappings on the way; lists are indexed by number.

    `where` names the override in errors (e.g. "--set a.b=1").
    """
    node: Any = doc
    for i, key in enumerate(keys[:-1]):
        nxt = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise SpecError(f"{where}: {'.'.join(keys[: i + 1])} is not an index of the list")
            nxt = node[int(key)]
        elif nxt is None:
            nxt = node[key] = {}
        if not isinstance(nxt, dict | list):
            raise SpecError(f"{where}: {'.'.join(keys[: i + 1])} is a value, not a section")
        node = nxt
    last = keys[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise SpecError(f"{where}: {last!r} is not an index of the list")
        node[int(last)] = value
    else:
        node[last] = value


# --------------------------------------------------------------------------- errors


def _loc_str(loc: Path_) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def format_validation_error(exc: ValidationError, origins: Origins, source: str) -> str:
    """One line per error: 'file:line: field.path: message'."""
    lines = []
    for err in exc.errors():
        # pydantic puts the model/union member names into loc for tagged types; keep only data keys.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
        where = origins.find(loc)
        if where is None:  # a rule across fields: name the file and what was applied on top of it
            where = source + (f" (with {', '.join(origins.applied)})" if origins.applied else "")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the spec reference in docs/spec.md)"
        lines.append(f"{where}: {_loc_str(loc)}: {message}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- loading


@dataclass
class LoadedPipeline:
    """A validated spec with the document it came from (for re-resolution in the cluster)."""

    spec: PipelineSpec
    source: str
    document: dict[str, Any]
    profile: str | None = None
    """The profile merged into the spec, which names its template (workflows.compile.template_name)."""


def validate_document(doc: dict[str, Any], origins: Origins, source: str) -> PipelineSpec:
    """Validate a merged spec document, raising SpecError with file:line: field messages."""
    try:
        return PipelineSpec.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, origins, source)) from None


def resolve_document(
    doc: dict[str, Any],
    origins: Origins,
    source: str,
    profile: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Apply a profile and `--set` overrides to a spec document; record their origins."""
    if not isinstance(doc, dict):
        raise SpecError(f"{source}: a pipeline file must be a mapping of fields, got {type(doc).__name__}")
    profiles = doc.get("profiles") or {}
    if profile is not None:
        if not isinstance(profiles, dict) or profile not in profiles:
            known = ", ".join(sorted(profiles)) if isinstance(profiles, dict) and profiles else "none"
            raise SpecError(f"{source}: no profile {profile!r} (profiles: {known})")
        overlay = profiles[profile] or {}
        if not isinstance(overlay, dict):
            raise SpecError(f"{source}: profiles.{profile} must be a mapping")
        doc = deep_merge(doc, overlay)
        origins.applied.append(f"--profile {profile}")
        # A field set by the profile is reported at the profile's line.
        prefix = ("profiles", profile)
        for path, where in list(origins.by_path.items()):
            if path[:2] == prefix and len(path) > 2:
                origins.by_path[path[2:]] = where
    for expr in overrides:
        keys, value = parse_override(expr)
        override(doc, origins, keys, value, "--set")
    return doc


def override(doc: dict[str, Any], origins: Origins, keys: list[str], value: Any, where: str) -> None:
    """Apply one override and make it the origin of what it set, and of any section it created (so a
    misspelt key is reported at the override, not at the file line of its parent)."""
    node: Any = doc
    created = len(keys)
    for i, key in enumerate(keys):
        if not isinstance(node, dict) or key not in node:
            created = i
            break
        node = node[key]
    apply_override(doc, keys, value, where)
    origins.applied.append(f"{where} {'.'.join(keys)}" if where == "--set" else where)
    for path in [p for p in origins.by_path if p[: len(keys)] == tuple(keys)]:
        del origins.by_path[path]
    for n in range(min(created + 1, len(keys)), len(keys) + 1):
        origins.by_path[tuple(keys[:n])] = where


def load_pipeline(
    name_or_path: str,
    profile: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> LoadedPipeline:
    """Load, overlay and validate a pipeline. Raises SpecError with a message fit for the user."""
    path = pipeline_path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    doc, origins = _compose_with_lines(text, str(path))
    doc = resolve_document(doc, origins, str(path), profile, overrides)
    spec = validate_document(doc, origins, str(path))
    return LoadedPipeline(spec=spec, source=str(path), document=doc, profile=profile)


def spec_from_json(text: str, source: str) -> PipelineSpec:
    """Validate a resolved spec stored as JSON (the run directory's spec.json)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{source}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    return validate_document(doc, Origins(), source)
