"""The spec reference: docs/spec.md and docs/pipeline.schema.json generated from the pydantic models, so the docs
and editors never drift from the code.

python -m spec.reference > docs/spec.md
python -m spec.reference --json-schema > docs/pipeline.schema.json

The JSON Schema lets an editor complete and check pipeline files: with VS Code's YAML extension (redhat.vscode-yaml)
a pipeline file's first line `# yaml-language-server: $schema=<path or URL of docs/pipeline.schema.json>` is enough.
It checks each field's type and the unknown fields; the rules across fields are checked by loading the file.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from spec.pipeline import PipelineSpec


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
        return "required" if value is PydanticUndefined else f"`{value!r}`" if not isinstance(value, BaseModel) else ""
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return ""
        return "" if isinstance(value, BaseModel) else f"`{value!r}`"
    return "**required**"


def _models(root: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in seen:
            seen.append(annotation)
            for f in annotation.model_fields.values():
                visit(f.annotation)
        for arg in get_args(annotation):
            visit(arg)

    visit(root)
    return seen


def render() -> str:
    """Markdown for every model reachable from PipelineSpec."""
    out = [
        "# Pipeline spec reference",
        "",
        "Generated from `spec/` by `python -m spec.reference`; do not edit by hand.",
        "Unknown fields are errors. Override any field with `--set path.to.field=value`.",
        "",
    ]
    for model in _models(PipelineSpec):
        out += [f"## {model.__name__}", "", (model.__doc__ or "").strip(), ""]
        out += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        out.append("")
    return "\n".join(out)


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a pipeline file, from PipelineSpec."""
    schema = PipelineSpec.model_json_schema(mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "posttrain pipeline",
        **{key: value for key, value in schema.items() if key != "title"},
    }


def render_json_schema() -> str:
    """docs/pipeline.schema.json's text."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--json-schema"]:
        sys.stdout.write(render_json_schema())
    elif sys.argv[1:]:
        print("usage: python -m spec.reference [--json-schema]", file=sys.stderr)
        sys.exit(2)
    else:
        print(render())
