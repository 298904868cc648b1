"""Rendered documents against the Kubernetes JSON schemas that ``kubernetes-validate`` ships
(offline), in strict mode (unknown fields are errors), for the oldest and newest Kubernetes
versions the chart supports. Validators are cached: many renders share their documents.
The one custom resource the chart may render, a ServiceMonitor, is checked against a
hand-written schema of the fields the chart uses (:data:`SERVICE_MONITOR`)."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema
import kubernetes_validate
from kubernetes_validate import utils
from referencing import Registry, Resource

OLDEST = "1.25"  # Chart.yaml kubeVersion: >=1.25.0-0
VERSIONS = (OLDEST, utils.latest_version())


@functools.cache
def _validator(kind: str, api_version: str, version: str) -> jsonschema.protocols.Validator:
    schema_version = [v for v in utils.all_versions() if utils.major_minor(v) <= version][-1]
    directory = f"kubernetes-json-schema/v{schema_version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = utils.schema_contents(f"{directory}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(kind, version, api_version) from None
    definitions = utils.schema_contents(f"{directory}/_definitions.json", version)
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(definitions) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {
    "type": "string",
    # The Prometheus Operator's Duration (monitoringv1.Duration).
    "pattern": (
        "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
        "(([0-9]+)ms)?)$"
    ),
}

# The Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1), which kubernetes-validate
# does not know: the fields the chart renders, strictly (an unknown or misspelt field fails),
# with the types and the duration pattern of the operator's CRD.
SERVICE_MONITOR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "maxLength": 63},
                "namespace": {"type": "string"},
                "labels": _LABELS,
                "annotations": _LABELS,
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {**_LABELS, "minProperties": 1}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR}


def errors(doc: dict[str, Any], version: str) -> list[str]:
    """Schema violations of ``doc`` for Kubernetes ``version`` (empty when valid)."""
    custom = CUSTOM.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if custom is not None:
        validator: jsonschema.protocols.Validator = jsonschema.Draft202012Validator(custom)
    else:
        validator = _validator(doc["kind"], doc["apiVersion"], version)
    found = []
    for error in validator.iter_errors(doc):
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        found.append(f"{doc['kind']}/{doc['metadata'].get('name')} at {where}: {error.message}")
    return found


def validate_all(docs: list[dict[str, Any]]) -> None:
    """Every document valid for every version in :data:`VERSIONS`; fails listing all errors."""
    problems: list[str] = []
    seen: set[str] = set()
    for doc in docs:
        key = json.dumps(doc, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        for version in VERSIONS:
            problems += [f"[k8s {version}] {e}" for e in errors(doc, version)]
    assert not problems, "invalid Kubernetes documents:\n" + "\n".join(problems)
