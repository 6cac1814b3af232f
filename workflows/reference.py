"""The spec reference: docs/spec.md generated from the pydantic models, so the docs never drift from the code.

python -m workflows.reference > docs/spec.md
"""

from __future__ import annotations

import types
import typing
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from workflows.spec import PipelineSpec


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
        "Generated from `workflows/spec.py` by `python -m workflows.reference`; do not edit by hand.",
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


if __name__ == "__main__":
    print(render())
