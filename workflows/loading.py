"""Loading a pipeline spec: by name or path, with a profile and `--set` overrides, into a validated model.

Every value remembers where it came from (file and line, or the `--set` argument), so a validation error
names the file, the line and the field path the user has to fix.

YAML is read safely and strictly, in pipeline files and in override values alike: a key given twice is an error
(instead of the last one silently winning), dates stay text (`data_version: 2026-11-24`), and anchors/aliases may
expand to at most MAX_EXPANDED_NODES values (a few hundred bytes of nested aliases otherwise expand to billions).
An override of a text field takes its text as written (`--set data_version=2026-11-24`, `--set model.revision=1e3`).
No value may hold a credential (`workflows.credentials`): the spec ends up in the template, readable by whoever may
submit, and in logs; credentials come from Kubernetes Secrets (`cluster.secrets`).
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from workflows.credentials import find_credentials, uri_userinfo
from workflows.quoting import quoted
from workflows.spec import FieldError, PipelineSpec

REPLACES_DATA = "replaces_data"
"""A profile's key that lets its `stages.<stage>.data` replace the data the pipeline file sets (see
resolve_document); without it a profile never swaps a user's data."""

MAX_EXPANDED_NODES = 20_000
"""The most YAML values a document may hold once its aliases are expanded (a shipped pipeline has a few hundred)."""

MAX_NESTING = 64
"""The deepest values may nest (mappings and lists inside one another) in a pipeline file, a `--set` or form value,
a config file or a recipe: a shipped pipeline nests 9 deep, and the readers and validators recurse, so a deeper
document would end in Python's recursion limit instead of an error line."""

PIPELINES_DIR = Path(__file__).parent / "pipelines"

Path_ = tuple[str | int, ...]


class SpecError(Exception):
    """A pipeline spec, profile or override the user has to fix. The message says where and what."""


class UnsafeYaml(SpecError):
    """YAML that parses but is refused: a key given twice, aliases beyond the budget or containing themselves."""


class _DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping key given twice (raised while constructing, turned into UnsafeYaml)."""


class _TooDeep(yaml.composer.ComposerError):
    """Values nested deeper than MAX_NESTING (raised while composing, before the composer's recursion goes on)."""


@dataclass
class Origins:
    """Where each value of a spec document came from: field path → 'file:line' or '--set k=v'."""

    by_path: dict[Path_, str] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    """Overrides applied on top of the file (profile, --set, form parameters), for whole-spec errors."""
    data_kept: dict[str, str] = field(default_factory=dict)
    """Stage → the data URI the pipeline file set, which the profile's data for that stage left alone (the profile
    has no `replaces_data: true`)."""

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


_TIMESTAMP = "tag:yaml.org,2002:timestamp"


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader without its surprises: duplicate keys are errors and dates stay strings."""

    yaml_implicit_resolvers: typing.ClassVar[dict[Any, list[Any]]] = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag != _TIMESTAMP]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        # PyYAML composes recursively: count the levels, and stop long before Python's recursion limit.
        self.depth += 1
        try:
            if self.depth > MAX_NESTING:
                raise _TooDeep(
                    None, None, f"values nest more than {MAX_NESTING} levels deep", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise _DuplicateKey(
                    "while reading a mapping",
                    node.start_mark,
                    f"key {key!r} appears twice (first on line {seen[key].start_mark.line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node) -> int:
    """How many values `root` holds with its aliases expanded (computed once per node, so a bomb costs nothing
    to measure); ValueError for an alias that contains itself."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in active:
            raise ValueError("an alias refers to the value that contains it")
        active.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        active.discard(id(node))
        sizes[id(node)] = total
        return total

    return size(root)


def _yaml_error(exc: yaml.YAMLError, filename: str) -> SpecError:
    mark = getattr(exc, "problem_mark", None)
    where = f"{quoted(filename)}:{mark.line + 1}" if mark else quoted(filename)
    if isinstance(exc, _TooDeep):
        return UnsafeYaml(f"{where}: {exc.problem} (mappings and lists inside one another): flatten it")
    error = UnsafeYaml if isinstance(exc, _DuplicateKey) else SpecError
    return error(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}")


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]')


def load_json(text: str, where: str) -> Any:
    """A JSON document whose values nest at most MAX_NESTING deep (checked before json.loads, which recurses);
    SpecError '<where>:<line>: ...' otherwise, or for text that is not JSON."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        opener = token[0]
        if opener in "[{":
            depth += 1
            if depth > MAX_NESTING:
                line = text.count("\n", 0, token.start()) + 1
                raise SpecError(
                    f"{where}:{line}: values nest more than {MAX_NESTING} levels deep (objects and arrays inside one "
                    "another): flatten it"
                )
        elif opener in "]}":
            depth -= 1
    try:
        return json.loads(text, object_pairs_hook=_keys_once)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{where}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    except _KeyTwice as exc:
        raise SpecError(f"{where}: key {exc.args[0]!r} is given twice in one object") from None


class _KeyTwice(ValueError):
    """A JSON object that gives one key twice (json.loads would keep the last; the YAML loader refuses it too)."""


def _keys_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise _KeyTwice(next(k for i, (k, _) in enumerate(pairs) if any(k == j for j, _ in pairs[:i])))
    return value


def _compose(text: str, filename: str) -> tuple[yaml.Node | None, _SpecLoader]:
    """The document's node tree (aliases within budget) and the loader to construct it with."""
    loader = _SpecLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        loader.dispose()
        raise _yaml_error(exc, filename) from None
    if node is not None:
        try:
            expanded = _expanded_size(node)
        except ValueError as exc:
            loader.dispose()
            raise UnsafeYaml(f"{filename}: not valid YAML: {exc}") from None
        if expanded > MAX_EXPANDED_NODES:
            loader.dispose()
            raise UnsafeYaml(
                f"{filename}: its anchors and aliases expand to {expanded} values, more than the "
                f"{MAX_EXPANDED_NODES} a pipeline spec may hold"
            )
    return node, loader


def _construct(node: yaml.Node | None, loader: _SpecLoader, filename: str) -> Any:
    try:
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:  # composed fine but failed to construct (a duplicate key, a bad tag)
        raise _yaml_error(exc, filename) from None
    finally:
        loader.dispose()


def load_yaml(text: str, filename: str) -> Any:
    """A YAML document read as pipeline files are (duplicate keys refused, dates as text, aliases bounded)."""
    node, loader = _compose(text, filename)
    return _construct(node, loader, filename)


def _compose_with_lines(text: str, filename: str) -> tuple[Any, Origins]:
    node, loader = _compose(text, filename)
    origins = Origins()
    if node is None:
        loader.dispose()
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
    return _construct(node, loader, filename), origins


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


def _loc_str(loc: Path_) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{quoted(part)}" if out else quoted(part))
    return out or "(top level)"


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


@dataclass
class LoadedPipeline:
    """A validated spec with the document it came from (for re-resolution in the cluster)."""

    spec: PipelineSpec
    source: str
    document: dict[str, Any]
    profile: str | None = None
    """The profile merged into the spec, which names its template (workflows.compile.template_name)."""
    origins: Origins = field(default_factory=Origins)
    """Where each value of `document` came from (variants are validated against it: workflows.variants)."""


def _strings(node: Any, path: Path_ = ()) -> typing.Iterator[tuple[Path_, str]]:
    """Every string of a document (mapping keys too), with its path."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                yield (*path, key), key
            yield from _strings(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, (*path, i))


def _secret_hint(loc: Path_, value: str) -> str:
    """Which Secret reference replaces a credential found at `loc`."""
    dotted = ".".join(map(str, loc))
    if "mlflow" in dotted:
        return "cluster.secrets.mlflow_username and mlflow_password (or mlflow_token)"
    if value.startswith("s3://") or "aws" in dotted.lower():
        return "cluster.secrets.aws_access_key_id and aws_secret_access_key"
    if value.startswith("hf://") or "huggingface" in value or dotted.startswith("model"):
        return "cluster.secrets.hf_token"
    return "cluster.secrets"


def check_no_credentials(doc: Any, origins: Origins, source: str) -> None:
    """SpecError naming the first value of `doc` that holds a credential: the userinfo of a URI (`user:pw@`) or a
    known key format. The spec is embedded in the template (readable by whoever may submit) and in records."""
    for loc, value in _strings(doc):
        found = "credentials in its URI (user:password@)" if uri_userinfo(value) else None
        if found is None and (credentials := find_credentials(value)):
            found = credentials[0].what
        if found is None:
            continue
        where = origins.find(loc) or source
        raise SpecError(
            f"{where}: {_loc_str(loc)}: holds {found}. Credentials never go into the spec (it is stored in the "
            f"template and the run's records): put them in a Kubernetes Secret and reference it from "
            f"{_secret_hint(loc, value)}; the pods read it through secretKeyRef"
        )


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
        if isinstance(data, dict) and "uri" in data and isinstance(own_data, dict) and own_data.get("uri"):
            profile_stages[stage] = {k: v for k, v in section.items() if k != "data"}
            dropped.append(("stages", stage, "data"))
            origins.data_kept[stage] = str(own_data["uri"])
    overlay["stages"] = profile_stages
    return overlay, dropped


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
    from workflows import variants  # it resolves variants with this module's tools
    from workflows.config_files import embed_config_files

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
