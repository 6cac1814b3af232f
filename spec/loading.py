"""Loading a pipeline spec: by name or path, with a profile and `--set` overrides, into a validated model.

Every value remembers where it came from (file and line, or the `--set` argument), so a validation error
names the file, the line and the field path the user has to fix.

YAML is read safely and strictly, in pipeline files and in override values alike: a key given twice is an error
(instead of the last one silently winning), dates stay text (`data_version: 2026-11-24`), and anchors/aliases may
expand to at most MAX_EXPANDED_NODES values (a few hundred bytes of nested aliases otherwise expand to billions).
An override of a text field takes its text as written (`--set data_version=2026-11-24`, `--set model.revision=1e3`).
No value may hold a credential (`spec.credentials`): the spec ends up in the template, readable by whoever may
submit, and in logs; credentials come from Kubernetes Secrets (`cluster.secrets`).
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from spec.document import (
    LoadedPipeline,
    Origins,
    Path_,
    SpecError,
    UnsafeYaml,
    _compose_with_lines,
    _loc_str,
    check_no_credentials,
    deep_merge,
    load_json,
    load_yaml,
)
from spec.fields import FieldError
from spec.pipeline import PipelineSpec
from spec.quoting import quoted

REPLACES_DATA = "replaces_data"
"""A profile's key that lets its `stages.<stage>.data` replace the data the pipeline file sets (see
resolve_document); without it a profile never swaps a user's data."""


PIPELINES_DIR = Path(__file__).parents[1] / "workflows" / "pipelines"  # the shipped pipelines, beside the compiler


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
        known = known_pipelines()
        close = difflib.get_close_matches(name_or_path, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}? known pipelines" if close else "; known pipelines"
        raise SpecError(f"unknown pipeline {name_or_path!r}{hint}: {', '.join(known)} (or give a path to a YAML file)")
    return shipped


# --------------------------------------------------------------------------- YAML with line numbers


# --------------------------------------------------------------------------- overlays


def _field_annotation(keys: list[str]) -> Any:
    """The type annotation of the spec field at `keys` (through nested models, mappings and lists), or None."""
    annotation: Any = PipelineSpec
    for key in keys:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(options) == 1:
            annotation = options[0]  # X | None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields = annotation.model_fields
            named = fields.get(key) or next((f for f in fields.values() if f.alias == key), None)
            if named is None:
                return None
            annotation = named.annotation
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        elif typing.get_origin(annotation) is list and key.isdigit():
            annotation = typing.get_args(annotation)[0]
        else:
            return None
    return annotation


def _text_field(keys: list[str]) -> tuple[bool, bool]:
    """(whether the field at `keys` holds text, whether it may also be null)."""
    annotation = _field_annotation(keys)
    if annotation is str:
        return True, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = set(typing.get_args(annotation))
        if options == {str, type(None)}:
            return True, True
    return False, False


def parse_override(expr: str) -> tuple[list[str], Any]:
    """Split 'a.b.c=value' into its path and value. A text field takes the text as written (quotes removed, `null`
    for an optional one); any other field reads the value as YAML (a scalar, list or mapping)."""
    if "=" not in expr:
        raise SpecError(f"--set {expr!r}: expected path.to.field=value")
    path, raw = expr.split("=", 1)
    keys = path.strip().split(".")
    if not path.strip() or any(not k for k in keys):
        raise SpecError(f"--set {path!r}: the field path is empty or has an empty part")
    if keys[0] == "profiles":
        raise SpecError(f"--set {path!r}: profiles cannot be set; use --profile")
    text, nullable = _text_field(keys)
    stripped = raw.strip()
    if text and not stripped.startswith(("'", '"')):
        # '2026-11-24', '2026', '1e3', 'on' are all text here, as the form's fields are.
        return keys, None if nullable and stripped in ("null", "~") else stripped
    try:
        value = load_yaml(raw, f"--set {path.strip()}") if stripped else ""
    except UnsafeYaml:
        raise
    except SpecError:
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


def _closest_field(loc: Path_) -> str | None:
    """The known field name closest to the unknown one at the end of `loc`, among the fields of the model(s)
    that hold it (None when nothing is close)."""
    if not loc or not isinstance(loc[-1], str):
        return None
    annotation = _field_annotation([str(part) for part in loc[:-1]])
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    names: set[str] = set()
    for model in members or (annotation,):
        if isinstance(model, type) and issubclass(model, BaseModel):
            names.update(f.alias or name for name, f in model.model_fields.items())
    matches = difflib.get_close_matches(loc[-1], sorted(names), n=1, cutoff=0.6)
    return matches[0] if matches else None


def format_validation_error(exc: ValidationError, origins: Origins, source: str) -> str:
    """One line per error: 'file:line: field.path: message'."""
    lines = []
    for err in exc.errors():
        # pydantic puts the model/union member names into loc for tagged types; keep only data keys.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):  # a rule across fields names the field that breaks it
            loc = loc + cause.loc
        where = origins.find(loc)
        if where is None:  # a rule across fields: name the file and what was applied on top of it
            where = source + (f" (with {', '.join(origins.applied)})" if origins.applied else "")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the spec reference in docs/spec.md)"
            if suggestion := _closest_field(loc):
                message = f"unknown field; did you mean {suggestion!r}? (see the spec reference in docs/spec.md)"
        lines.append(f"{quoted(where)}: {_loc_str(loc)}: {message}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- loading


def validate_document(doc: dict[str, Any], origins: Origins, source: str) -> PipelineSpec:
    """Validate a merged spec document, raising SpecError with file:line: field messages."""
    check_no_credentials(doc, origins, source)
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
        raise SpecError(f"{quoted(source)}: a pipeline file must be a mapping of fields, got {type(doc).__name__}")
    profiles = doc.get("profiles") or {}
    if profile is not None:
        if not isinstance(profiles, dict) or profile not in profiles:
            known = ", ".join(sorted(profiles)) if isinstance(profiles, dict) and profiles else "none"
            raise SpecError(f"{quoted(source)}: no profile {profile!r} (profiles: {known})")
        overlay = profiles[profile] or {}
        if not isinstance(overlay, dict):
            raise SpecError(f"{quoted(source)}: profiles.{profile} must be a mapping")
        overlay, dropped = _profile_overlay(doc, overlay, origins, source, profile)
        doc = deep_merge(doc, overlay)
        origins.applied.append(f"--profile {profile}")
        # A field set by the profile is reported at the profile's line.
        prefix = ("profiles", profile)
        for path, where in list(origins.by_path.items()):
            if path[:2] == prefix and len(path) > 2 and not any(path[2 : 2 + len(d)] == d for d in dropped):
                origins.by_path[path[2:]] = where
    for expr in overrides:
        keys, value = parse_override(expr)
        override(doc, origins, keys, value, "--set")
    return doc


def _profile_overlay(
    doc: dict[str, Any], overlay: dict[str, Any], origins: Origins, source: str, profile: str
) -> tuple[dict[str, Any], list[Path_]]:
    """The part of a profile that is merged onto the pipeline file, and the paths left out of it.

    A profile's `stages.<stage>.data` describes the profile's own data (URI, format, columns, split), so where the
    file sets that stage's `data.uri` the whole section stays out, unless the profile says `replaces_data: true`
    (the shipped `local` profiles do: they exist to run offline on built-in data). A profile's data section without
    a URI (e.g. only `max_bad_row_fraction`) is merged as any other field. `--set` is applied after the profile, so
    a URI given there is always kept."""
    overlay = dict(overlay)
    replaces = overlay.pop(REPLACES_DATA, False)
    if not isinstance(replaces, bool):
        where = origins.by_path.get(("profiles", profile, REPLACES_DATA), source)
        raise SpecError(f"{where}: profiles.{profile}.{REPLACES_DATA}: expected true or false, got {replaces!r}")
    dropped: list[Path_] = [(REPLACES_DATA,)]
    own_stages, profile_stages = doc.get("stages"), overlay.get("stages")
    if replaces or not isinstance(own_stages, dict) or not isinstance(profile_stages, dict):
        return overlay, dropped
    profile_stages = dict(profile_stages)
    for stage, section in profile_stages.items():
        own = own_stages.get(stage)
        own_data = own.get("data") if isinstance(own, dict) else None
        data = section.get("data") if isinstance(section, dict) else None
        own_uris = _data_uris(own_data)
        if any(_data_uris(data)) and own_uris and all(own_uris):
            profile_stages[stage] = {k: v for k, v in section.items() if k != "data"}
            dropped.append(("stages", stage, "data"))
            origins.data_kept[stage] = ", ".join(own_uris)
    overlay["stages"] = profile_stages
    return overlay, dropped


def _data_uris(data: Any) -> list[str]:
    """The URIs a stage's data section (one dataset or a list) names; '' for a dataset without one."""
    items = data if isinstance(data, list) else [data] if isinstance(data, dict) else []
    return [str(d.get("uri") or "") if isinstance(d, dict) else "" for d in items]


def override(doc: dict[str, Any], origins: Origins, keys: list[str], value: Any, where: str) -> None:
    """Apply one override and make it the origin of what it set, and of any section it created (so a
    misspelt key is reported at the override, not at the file line of its parent)."""
    node: Any = doc
    created = len(keys)
    path: list[str | int] = []  # the keys as the document's paths have them: list indices are numbers
    for i, key in enumerate(keys):
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            path.append(int(key))
            node = node[int(key)]
            continue
        path.append(key)
        if not isinstance(node, dict) or key not in node:
            created = i
            path.extend(keys[i + 1 :])
            break
        node = node[key]
    apply_override(doc, keys, value, where)
    origins.applied.append(f"{where} {'.'.join(keys)}" if where == "--set" else where)
    for known in [p for p in origins.by_path if p[: len(path)] == tuple(path)]:
        del origins.by_path[known]
    for n in range(min(created + 1, len(path)), len(path) + 1):
        origins.by_path[tuple(path[:n])] = where


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
        raise SpecError(f"{quoted(path)}: not UTF-8 text (byte {exc.start})") from None
    doc, origins = _compose_with_lines(text, str(path))
    doc = resolve_document(doc, origins, str(path), profile, overrides)
    from spec import variants  # it resolves variants with this module's tools
    from spec.config_files import embed_config_files

    embed_config_files(doc, origins, path)  # distributed.deepspeed_config/accelerate_config files, by content

    if profile is not None:
        variants.fold_profile(doc, origins, profile)
    spec = validate_document(doc, origins, str(path))
    loaded = LoadedPipeline(spec=spec, source=str(path), document=doc, profile=profile, origins=origins)
    variants.variant_pipelines(loaded)  # each variant validated here, its errors at their lines
    return loaded


def spec_from_json(text: str, source: str) -> PipelineSpec:
    """Validate a resolved spec stored as JSON (the run directory's spec.json)."""
    return validate_document(load_json(text, quoted(source)), Origins(), source)
