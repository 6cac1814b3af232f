"""Generates the strict JSON schema of KServe's InferenceService (v1beta1) and ServingRuntime (v1alpha1).

KServe's CRD files are not published as a package, but its Python SDK wheel ships the OpenAPI-generated model
classes (kserve/models/*.py) of the same Go types: `openapi_types` gives each field's type, `attribute_map` its
JSON name, and a setter that refuses None marks a required field. The Kubernetes types they embed (V1Container,
V1Volume, ...) come from the installed kubernetes client's models, which have the same form. Both are read as
source with `ast`; nothing from the wheel is imported.

    pip download --no-deps kserve==0.21.0 -d /tmp/kserve
    .venv/bin/python tests/schemas/generate_kserve.py /tmp/kserve/kserve-0.21.0-py3-none-any.whl

writes tests/schemas/kserve-v0.21.0.json: a draft 2020-12 schema whose `$defs` hold `InferenceService`,
`ServingRuntime` and every type reachable from them, each object closed with `additionalProperties: false`.
Quantity and int-or-string fields take the form controller-gen gives them in KServe's CRDs (integer or string,
a quantity string matching the API server's pattern), since the API server validates these kinds against those.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DRAFT = "https://json-schema.org/draft/2020-12/schema"

ROOTS = {
    "InferenceService": ("V1beta1InferenceService", "serving.kserve.io/v1beta1"),
    "ServingRuntime": ("V1alpha1ServingRuntime", "serving.kserve.io/v1alpha1"),
}

QUANTITY = "Quantity"
INT_OR_STRING = "IntOrString"
# controller-gen's rendering of resource.Quantity and intstr.IntOrString in a CRD.
QUANTITY_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": (
        r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
        r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
    ),
}
INT_OR_STRING_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string"}]}

QUANTITY_TYPES = {"ResourceQuantity", "V1beta1MetricQuantity"}
"""KServe's names for resource.Quantity (the SDK has no model class for either)."""

QUANTITY_FIELDS = {
    ("V1ResourceRequirements", "limits"),
    ("V1ResourceRequirements", "requests"),
    ("V1VolumeResourceRequirements", "limits"),
    ("V1VolumeResourceRequirements", "requests"),
    ("V1EmptyDirVolumeSource", "size_limit"),
    ("V1ResourceFieldSelector", "divisor"),
    ("V1PodSpec", "overhead"),
    ("V1PersistentVolumeSpec", "capacity"),
    ("V2MetricTarget", "value"),
    ("V2MetricTarget", "average_value"),
    ("V2HPAScalingRules", "tolerance"),
}
"""Kubernetes fields of type Quantity (or map of Quantity), which the kubernetes client types as plain `str`: every
such field reachable from the roots, as the Kubernetes OpenAPI types them (kubernetes client 35.0.0)."""

INT_OR_STRING_FIELDS = {
    ("V1HTTPGetAction", "port"),
    ("V1TCPSocketAction", "port"),
    ("V1RollingUpdateDeployment", "max_surge"),
    ("V1RollingUpdateDeployment", "max_unavailable"),
}
"""Kubernetes fields of type IntOrString: the kubernetes client types them as `object`, like truly open fields."""

OPEN_FIELDS = {("V1beta1InferenceService", "status")}
"""Left open: the controller writes the status, and the SDK's models of the Knative URL and time types in it
are objects where the JSON holds strings."""

ALIASES = {
    "K8sIoApiAppsV1DeploymentStrategy": "V1DeploymentStrategy",
    "K8sIoApiAutoscalingV2HorizontalPodAutoscalerBehavior": "V2HorizontalPodAutoscalerBehavior",
}
"""KServe's names for Kubernetes types, as the kubernetes client names them."""

PRIMITIVES: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "datetime": {"type": "string", "format": "date-time"},
    "date": {"type": "string", "format": "date"},
    "object": {},
}


@dataclass(frozen=True)
class Model:
    """One generated model class: JSON name and type string of each field, and the required fields."""

    types: dict[str, str]
    json_names: dict[str, str]
    required: frozenset[str]


def parse_models(source: str) -> dict[str, Model]:
    """The model classes defined in one generated module's source."""
    models = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        assigned = {
            s.targets[0].id: ast.literal_eval(s.value)
            for s in node.body
            if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name)
        }
        if "openapi_types" not in assigned:
            continue
        required = set()
        for f in node.body:
            setter = isinstance(f, ast.FunctionDef) and any(
                isinstance(d, ast.Attribute) and d.attr == "setter" for d in f.decorator_list
            )
            if setter and any(
                isinstance(c, ast.Constant) and isinstance(c.value, str) and "must not be `None`" in c.value
                for c in ast.walk(f)
            ):
                required.add(f.name)
        models[node.name] = Model(assigned["openapi_types"], assigned["attribute_map"], frozenset(required))
    return models


def kserve_models(wheel: Path) -> dict[str, Model]:
    """Every model class in the wheel's kserve/models package."""
    models: dict[str, Model] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            if re.fullmatch(r"kserve/models/[a-z0-9_]+\.py", name) and not name.endswith("__init__.py"):
                models |= parse_models(archive.read(name).decode("utf-8"))
    return models


def kubernetes_models() -> dict[str, Model]:
    """Every model class of the installed kubernetes client (read as source, not imported)."""
    spec = importlib.util.find_spec("kubernetes")
    assert spec is not None and spec.submodule_search_locations, "the kubernetes package is not installed"
    directory = Path(next(iter(spec.submodule_search_locations))) / "client" / "models"
    models: dict[str, Model] = {}
    for path in sorted(directory.glob("*.py")):
        if path.name != "__init__.py":
            models |= parse_models(path.read_text(encoding="utf-8"))
    return models


class SchemaBuilder:
    """Turns model classes into `$defs` entries, following references from the roots."""

    def __init__(self, kserve: dict[str, Model], kubernetes: dict[str, Model]) -> None:
        self.kserve, self.kubernetes = kserve, kubernetes
        self.defs: dict[str, Any] = {}
        self.open_types: set[str] = set()
        self.pending: list[str] = []

    def model(self, name: str) -> Model | None:
        return self.kserve.get(name) or self.kubernetes.get(ALIASES.get(name, name))

    def field(self, type_string: str, owner: str, attr: str) -> dict[str, Any]:
        if (owner, attr) in OPEN_FIELDS:
            return {"type": "object"}
        if (owner, attr) in QUANTITY_FIELDS:
            type_string = {"str": QUANTITY, "dict(str, str)": f"dict(str, {QUANTITY})"}.get(type_string, type_string)
        if (owner, attr) in INT_OR_STRING_FIELDS and type_string == "object":
            type_string = INT_OR_STRING
        if type_string.startswith("list[") and type_string.endswith("]"):
            return {"type": "array", "items": self.field(type_string[5:-1], owner, attr)}
        if type_string.startswith("dict(str, ") and type_string.endswith(")"):
            return {"type": "object", "additionalProperties": self.field(type_string[10:-1], owner, attr)}
        if type_string in PRIMITIVES:
            return dict(PRIMITIVES[type_string])
        if type_string in QUANTITY_TYPES or type_string == QUANTITY:
            return self.ref(QUANTITY)
        if type_string == INT_OR_STRING:
            return self.ref(INT_OR_STRING)
        if self.model(type_string) is None:
            # Neither source models it (a Kubernetes type newer than the client, one the SDK omits): left open,
            # and named in the file's $comment.
            self.open_types.add(type_string)
            return {"type": "object"}
        if type_string not in self.defs and type_string not in self.pending:
            self.pending.append(type_string)
        return self.ref(type_string)

    @staticmethod
    def ref(name: str) -> dict[str, Any]:
        return {"$ref": f"#/$defs/{name}"}

    def object_schema(self, name: str) -> dict[str, Any]:
        model = self.model(name)
        assert model is not None
        properties = {model.json_names[a]: self.field(t, ALIASES.get(name, name), a) for a, t in model.types.items()}
        schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
        if model.required:
            schema["required"] = sorted(model.json_names[a] for a in model.required)
        return schema

    def build(self) -> dict[str, Any]:
        self.defs[QUANTITY] = QUANTITY_SCHEMA
        self.defs[INT_OR_STRING] = INT_OR_STRING_SCHEMA
        for root, (name, api_version) in ROOTS.items():
            self.defs[root] = {
                "$ref": f"#/$defs/{name}",
                "properties": {"apiVersion": {"const": api_version}, "kind": {"const": root}},
                # The API server needs apiVersion, kind and metadata; neither kind means anything without a spec.
                "required": ["apiVersion", "kind", "metadata", "spec"],
            }
            self.pending.append(name)
        while self.pending:
            name = self.pending.pop(0)
            self.defs[name] = self.object_schema(name)
        return dict(sorted(self.defs.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path, help="the kserve wheel (pip download --no-deps kserve==VERSION)")
    parser.add_argument("--output", type=Path, help="default: tests/schemas/kserve-v<VERSION>.json")
    args = parser.parse_args()
    match = re.fullmatch(r"kserve-([0-9][^-]*)-py3-none-any\.whl", args.wheel.name)
    if match is None:
        parser.error(f"{args.wheel.name} is not a kserve wheel file name")
    version = match.group(1)
    digest = hashlib.sha256(args.wheel.read_bytes()).hexdigest()
    builder = SchemaBuilder(kserve_models(args.wheel), kubernetes_models())
    defs = builder.build()
    kubernetes_version = importlib.metadata.version("kubernetes")
    comment = (
        f"Generated by `python tests/schemas/generate_kserve.py kserve-{version}-py3-none-any.whl` (the wheel from "
        f"`pip download --no-deps kserve=={version}`, sha256 {digest}) from the model classes in its kserve/models "
        f"and in the kubernetes {kubernetes_version} client's models. Do not edit: regenerate. Types without a "
        f"model in either source are left open: {', '.join(sorted(builder.open_types)) or 'none'}."
    )
    # One definition a line: the file stays small and a regeneration's diff names the types that changed.
    entries = ",\n".join(f"  {json.dumps(name)}: {json.dumps(schema)}" for name, schema in defs.items())
    text = f'{{\n "$comment": {json.dumps(comment)},\n "$schema": "{DRAFT}",\n "$defs": {{\n{entries}\n }}\n}}\n'
    output = args.output or HERE / f"kserve-v{version}.json"
    output.write_text(text, encoding="utf-8")
    print(f"wrote {output} ({len(defs)} definitions)")


if __name__ == "__main__":
    main()
