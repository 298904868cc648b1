"""Render the GradientMailRun CRD from the pydantic models (``gradientmail/launch/runspec.py``).

``python -m gradientmail_operator.crd`` prints the CRD YAML; the chart's copy is generated
with it and a test fails when the two drift. The conversion makes pydantic's JSON schema
structural, as Kubernetes requires: references inlined, ``Optional`` as ``nullable``,
free-form maps as ``x-kubernetes-preserve-unknown-fields``, ``str | int`` as
``x-kubernetes-int-or-string``, exclusive bounds as OpenAPI v3.0 booleans, no
``additionalProperties: false`` (the API server prunes unknown fields itself; the operator
refuses them by name).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from gradientmail.launch.runspec import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    GradientMailRunSpec,
)

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Nodes", "type": "integer", "jsonPath": ".spec.nodes"},
    {"name": "Live", "type": "integer", "jsonPath": ".status.liveLearners"},
    {"name": "Round", "type": "integer", "jsonPath": ".status.newestRound"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP = {"title", "$defs", "additionalProperties"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    options = node.get("anyOf")
    if options is not None:
        kinds = [o for o in options if o.get("type") != "null"]
        nullable = len(kinds) < len(options)
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if {o.get("type") for o in kinds} == {"string", "integer"}:
            merged = {**rest, "x-kubernetes-int-or-string": True}
        elif len(kinds) == 1:
            merged = {**rest, **kinds[0]}
        else:
            raise ValueError(f"cannot make a structural schema of {node}")
        if nullable:
            merged["nullable"] = True
        return _structural(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _structural(v, defs) for name, v in value.items()}
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020's number form; OpenAPI v3.0 (and the API server) wants the
            # bound in minimum/maximum and a boolean flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = _structural(value, defs)
    if node.get("type") == "object" and "properties" not in node:
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _structural(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "default" in out and out["default"] is None:
        del out["default"]
    return out


def spec_schema() -> dict[str, Any]:
    raw = GradientMailRunSpec.model_json_schema(by_alias=True, mode="validation")
    schema = dict(_structural(raw, raw.get("$defs", {})))
    # No server-side default for the node image: the API server would write it into every
    # run that has a `template`, hiding the operator's configured default node image
    # (GRADIENTMAIL_OPERATOR_NODE_IMAGE, the chart's nodePods.image). The models' default
    # still applies when neither names one.
    schema["properties"]["template"]["properties"]["image"].pop("default", None)
    return schema


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["all", "gradientmail"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A GradientMail training run.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = (
    "# Generated by `python -m gradientmail_operator.crd` from "
    "gradientmail/launch/runspec.py. Do not edit.\n"
)


def render() -> str:
    return HEADER + str(yaml.safe_dump(crd(), sort_keys=False, width=100))


if __name__ == "__main__":
    sys.stdout.write(render())
