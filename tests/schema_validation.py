"""Strict schema validators for what the compiler renders.

- Argo Workflows: the project's JSON schema (`definitions`, draft 2020-12).
- Kubeflow PyTorchJob: the CRD's openAPIV3Schema (the API server validates created jobs against it).
- Kubernetes core objects: kubernetes-validate's strict schemas for the newest Kubernetes it ships.

"Strict" means an unknown field is an error (as `kubectl --validate=strict` and server-side field validation
report it), so a misspelt or misplaced key fails a test instead of being dropped by the API server. Every
object schema that lists `properties` and says nothing about `additionalProperties` gets
`additionalProperties: false`; schemas marked `x-kubernetes-preserve-unknown-fields` stay open, and
int-or-string / quantity types accept both JSON forms the API server accepts.

The schema files live outside the repository, in `<repo>/../shared/schemas`, or in
`$POSTTRAIN_SHARED_DIR/schemas`; a test that needs them skips without them, or fails when
`POSTTRAIN_REQUIRE_SCHEMAS=1` (as in CI). Compiled validators are cached: building them is the slow part.
"""

from __future__ import annotations

import copy
import json
import os
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

ARGO_SCHEMA_FILE = "argo-workflows-v4.1.2-schema.json"
PYTORCHJOB_CRD_FILE = "kubeflow.org_pytorchjobs.v1.9.4.yaml"

ARGO_KINDS = ("WorkflowTemplate", "Workflow", "CronWorkflow", "ClusterWorkflowTemplate")

_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"

# ObjectMeta as a client may write it when creating an object (the CRD leaves `metadata` untyped).
_OBJECT_META: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
        # Read-only fields a document fetched from the API server carries.
        "uid": {"type": "string"},
        "resourceVersion": {"type": "string"},
        "generation": {"type": "integer"},
        "creationTimestamp": {"type": ["string", "null"]},
    },
}


class SchemaViolation(AssertionError):
    """A document that does not validate; the message lists each error with its path in the document."""


def shared_schemas_dir() -> Path:
    """Where the schema files are: $POSTTRAIN_SHARED_DIR/schemas, else <repo>/../shared/schemas."""
    if override := os.environ.get("POSTTRAIN_SHARED_DIR"):
        return Path(override) / "schemas"
    return Path(__file__).resolve().parents[2] / "shared" / "schemas"


def schemas_missing() -> str | None:
    """Why the Argo and PyTorchJob schemas cannot be used, or None when both are there."""
    directory = shared_schemas_dir()
    missing = [f for f in (ARGO_SCHEMA_FILE, PYTORCHJOB_CRD_FILE) if not (directory / f).is_file()]
    if missing:
        return f"schemas {', '.join(missing)} not found in {directory} (set POSTTRAIN_SHARED_DIR)"
    return None


def require_schemas() -> Path:
    """The schema directory; without the schemas the calling test is skipped, or failed with the same reason
    when POSTTRAIN_REQUIRE_SCHEMAS is set (CI has them, so a skip there would hide a broken setup)."""
    if (reason := schemas_missing()) is not None:
        if os.environ.get("POSTTRAIN_REQUIRE_SCHEMAS", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}; POSTTRAIN_REQUIRE_SCHEMAS is set, so this is an error", pytrace=False)
        pytest.skip(reason)
    return shared_schemas_dir()


# --------------------------------------------------------------------------- making schemas strict


def make_strict(schema: Any) -> Any:
    """A copy of `schema` where every object schema with `properties` forbids other properties."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and isinstance(node["properties"], dict)
                and "additionalProperties" not in node
                and "patternProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _path(error: jsonschema.ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def _check(validator: jsonschema.protocols.Validator, doc: Any, what: str) -> None:
    errors = sorted(validator.iter_errors(doc), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    if errors:
        lines = [f"{_path(e)}: {e.message[:300]}" for e in errors[:20]]
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise SchemaViolation(f"{what} is not valid:\n  " + "\n  ".join(lines) + more)


# --------------------------------------------------------------------------- Argo


@lru_cache(maxsize=1)
def _argo_definitions() -> dict[str, Any]:
    path = shared_schemas_dir() / ARGO_SCHEMA_FILE
    definitions = make_strict(json.loads(path.read_text(encoding="utf-8"))["definitions"])
    # Both JSON forms are accepted by the API server for these string-typed types.
    definitions[_INT_OR_STRING] = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    definitions[_QUANTITY] = {"anyOf": [{"type": "number"}, {"type": "string"}]}
    return definitions


@cache
def _argo_validator(kind: str) -> jsonschema.protocols.Validator:
    schema = {"$ref": f"#/definitions/io.argoproj.workflow.v1alpha1.{kind}", "definitions": _argo_definitions()}
    return jsonschema.Draft202012Validator(schema)


def validate_argo(doc: dict[str, Any]) -> None:
    """Validate an Argo resource (by its `kind`) strictly; raises SchemaViolation."""
    kind = doc.get("kind")
    if kind not in ARGO_KINDS:
        raise SchemaViolation(f"not an Argo resource kind: {kind!r}")
    _check(_argo_validator(kind), doc, f"{kind} {doc.get('metadata', {}).get('name', '')}".strip())


# --------------------------------------------------------------------------- PyTorchJob


@lru_cache(maxsize=1)
def _pytorchjob_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((shared_schemas_dir() / PYTORCHJOB_CRD_FILE).read_text(encoding="utf-8"))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = make_strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = make_strict(_OBJECT_META)
    schema["properties"]["apiVersion"] = {"const": "kubeflow.org/v1"}
    schema["properties"]["kind"] = {"const": "PyTorchJob"}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return jsonschema.Draft202012Validator(schema)


def validate_pytorchjob(doc: dict[str, Any]) -> None:
    """Validate a PyTorchJob (spec and, if present, status) against the CRD, strictly."""
    _check(_pytorchjob_validator(), doc, "PyTorchJob")


# --------------------------------------------------------------------------- Kubernetes core


@lru_cache(maxsize=1)
def _core_schemas() -> tuple[Path, Registry]:
    import kubernetes_validate.utils as kv

    version = kv.latest_version()
    directory = Path(
        str(resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict")
    )
    definitions = json.loads((directory / "_definitions.json").read_text(encoding="utf-8"))
    registry: Registry = Resource.from_contents(definitions) @ Registry()
    return directory, registry


@cache
def _core_validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    directory, registry = _core_schemas()
    group_version = api_version.split(".", 1)[0] if "/" not in api_version else None
    if group_version is None:
        group, version = api_version.split("/", 1)
        group_version = f"{group.split('.', 1)[0]}-{version}"
    path = directory / f"{kind.lower()}-{group_version}.json"
    if not path.is_file():
        raise SchemaViolation(f"kubernetes-validate has no schema for {api_version} {kind}")
    schema = json.loads(path.read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_core(doc: dict[str, Any]) -> None:
    """Validate a built-in Kubernetes object (Pod, PodTemplate, Secret...) strictly with kubernetes-validate."""
    _check(_core_validator(doc["kind"], doc["apiVersion"]), doc, f"{doc['apiVersion']} {doc['kind']}")


def pod_template_object(template: dict[str, Any], name: str = "check") -> dict[str, Any]:
    """A core/v1 PodTemplate wrapping a pod template spec, so validate_core can check it."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
