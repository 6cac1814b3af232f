"""Generates the strict JSON schema of the prometheus-operator kinds manifests/components/monitoring ships.

The source is prometheus-operator's own CRD files, at a release tag, from the repository's
example/prometheus-operator-crd/ folder (the files its Helm chart and kube-prometheus-stack install):

    TAG=v0.93.0
    for f in podmonitors servicemonitors prometheusrules alertmanagerconfigs; do
      curl -sLO https://raw.githubusercontent.com/prometheus-operator/prometheus-operator/$TAG/example/prometheus-operator-crd/monitoring.coreos.com_$f.yaml
    done
    .venv/bin/python tests/schemas/generate_prometheus_operator.py --version $TAG monitoring.coreos.com_*.yaml

writes tests/schemas/prometheus-operator-<TAG>.json: a draft 2020-12 schema whose `$defs` hold each kind's
openAPIV3Schema (the served version's), descriptions dropped, every object schema that lists `properties` closed
with `additionalProperties: false` unless marked `x-kubernetes-preserve-unknown-fields` (as the API server prunes
and `kubectl --validate=strict` reports unknown fields), metadata typed as a client writes it, and apiVersion, kind,
metadata and spec required, and RE2's group-scoped `(?i)` rewritten as Python's `(?i:...)`. The sha256 of each
source file is in the output's `$comment`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DRAFT = "https://json-schema.org/draft/2020-12/schema"
SOURCE = "https://github.com/prometheus-operator/prometheus-operator/tree/{tag}/example/prometheus-operator-crd"

KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"}

OBJECT_META: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
"""ObjectMeta as a client writes it when creating an object (the CRDs leave `metadata` untyped)."""


class CrdLoader(yaml.SafeLoader):
    """YAML 1.1's loader, reading a lone `=` (an enum value in the AlertmanagerConfig CRD) as the string it is."""


CrdLoader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def python_pattern(pattern: str) -> str:
    """A Go (RE2) pattern as Python's `re` reads it: RE2 lets `(?i)` start any group, where it holds to the group's
    end; Python takes flags at the start only, so it becomes the scoped `(?i:...)`."""
    while (start := pattern.find("(?i)")) >= 0:
        depth, end = 0, len(pattern)
        for index in range(start + 4, len(pattern)):
            if pattern[index] == "(" and pattern[index - 1] != "\\":
                depth += 1
            elif pattern[index] == ")" and pattern[index - 1] != "\\":
                if depth == 0:
                    end = index
                    break
                depth -= 1
        pattern = f"{pattern[:start]}(?i:{pattern[start + 4 : end]}){pattern[end:]}"
    return pattern


def strict(node: Any) -> Any:
    """`node` without descriptions, each object schema with `properties` closed, patterns in Python's syntax."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items() if key != "description"}
    if isinstance(node.get("pattern"), str):
        out["pattern"] = python_pattern(node["pattern"])
    if "properties" in node and isinstance(node["properties"], dict):
        # `properties` maps field names to schemas: a field may be called "description".
        out["properties"] = {name: strict(schema) for name, schema in node["properties"].items()}
        if (
            "additionalProperties" not in node
            and "patternProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
    return out


def kind_schema(crd: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(kind, schema) of a CRD's served storage version."""
    names, group = crd["spec"]["names"], crd["spec"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
    schema["properties"]["kind"] = {"const": names["kind"]}
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return names["kind"], schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", required=True, help="the release tag the files come from, e.g. v0.93.0")
    parser.add_argument("crds", nargs="+", type=Path, help="monitoring.coreos.com_<plural>.yaml files")
    parser.add_argument("--output", type=Path, help="default: tests/schemas/prometheus-operator-<version>.json")
    args = parser.parse_args()
    defs: dict[str, Any] = {}
    digests = []
    for path in sorted(args.crds):
        data = path.read_bytes()
        kind, schema = kind_schema(yaml.load(data, Loader=CrdLoader))
        if kind in KINDS:
            defs[kind] = schema
            digests.append(f"{path.name} sha256 {hashlib.sha256(data).hexdigest()}")
    if missing := KINDS - set(defs):
        parser.error(f"no CRD file for {', '.join(sorted(missing))}")
    comment = (
        f"Generated by `python tests/schemas/generate_prometheus_operator.py --version {args.version}` from "
        f"prometheus-operator's CRD files at {SOURCE.format(tag=args.version)} ({'; '.join(digests)}). "
        "Descriptions dropped, objects closed. Do not edit: regenerate."
    )
    entries = ",\n".join(f"  {json.dumps(kind)}: {json.dumps(defs[kind], sort_keys=True)}" for kind in sorted(defs))
    text = f'{{\n "$comment": {json.dumps(comment)},\n "$schema": "{DRAFT}",\n "$defs": {{\n{entries}\n }}\n}}\n'
    output = args.output or HERE / f"prometheus-operator-{args.version}.json"
    output.write_text(text, encoding="utf-8")
    print(f"wrote {output} ({len(defs)} kinds)")


if __name__ == "__main__":
    main()
