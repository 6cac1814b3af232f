"""A pipeline document as read: YAML and JSON parsed safely, each value's origin, and no credential in it."""

from __future__ import annotations

import copy
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from spec.credentials import find_credentials, uri_userinfo
from spec.pipeline import PipelineSpec
from spec.quoting import quoted

MAX_EXPANDED_NODES = 20_000


"""The most YAML values a document may hold once its aliases are expanded (a shipped pipeline has a few hundred)."""


MAX_NESTING = 64


"""The deepest values may nest (mappings and lists inside one another) in a pipeline file, a `--set` or form value,
a config file or a recipe: a shipped pipeline nests 9 deep, and the readers and validators recurse, so a deeper
document would end in Python's recursion limit instead of an error line."""


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


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """`overlay` merged onto `base`: mappings merge key by key, anything else is replaced."""
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _loc_str(loc: Path_) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{quoted(part)}" if out else quoted(part))
    return out or "(top level)"


@dataclass
class LoadedPipeline:
    """A validated spec with the document it came from (for re-resolution in the cluster)."""

    spec: PipelineSpec
    source: str
    document: dict[str, Any]
    profile: str | None = None
    """The profile merged into the spec, which names its template (workflows.compile.template_name)."""
    origins: Origins = field(default_factory=Origins)
    """Where each value of `document` came from (variants are validated against it: spec.variants)."""


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
