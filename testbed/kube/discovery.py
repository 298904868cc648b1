"""Discovery documents: ``/version``, ``/apis`` groups and ``APIResourceList``s (the legacy,
non-aggregated form, which kubectl falls back to and kopf reads), and skeleton OpenAPI
documents that let kubectl and helm skip client-side validation."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from testbed.kube.errors import ApiError
from testbed.kube.resources import ResourceType, version_priority

__all__ = [
    "KUBERNETES_VERSION",
    "group_list",
    "openapi_v3_document",
    "openapi_v3_root",
    "resource_list",
    "version_info",
]

Obj = dict[str, Any]

KUBERNETES_VERSION = ("1", "33")


def version_info() -> Obj:
    """``/version``."""
    major, minor = KUBERNETES_VERSION
    return {
        "major": major,
        "minor": minor,
        "gitVersion": f"v{major}.{minor}.0+gradientmail-emulator",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def group_list(types: Iterable[ResourceType]) -> list[Obj]:
    """The groups of ``/apis``, each with its versions, the preferred first."""
    versions: dict[str, set[str]] = {}
    for rt in types:
        if rt.group:
            versions.setdefault(rt.group, set()).add(rt.version)
    groups = []
    for group, found in versions.items():
        ordered = sorted(found, key=version_priority, reverse=True)
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in ordered]
        groups.append({"name": group, "versions": entries, "preferredVersion": entries[0]})
    return groups


def resource_list(types: Iterable[ResourceType], group: str, version: str) -> Obj:
    """The ``APIResourceList`` of one group/version (404 when it has no types)."""
    found = [rt for rt in types if (rt.group, rt.version) == (group, version)]
    if not found:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    resources = [entry for rt in found for entry in rt.discovery()]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _hash(types: Iterable[ResourceType]) -> str:
    text = ",".join(sorted(f"{rt.plural}:{rt.kind}:{rt.namespaced}" for rt in types))
    return hashlib.sha256(text.encode()).hexdigest()[:16].upper()


def openapi_v3_root(types: Iterable[ResourceType]) -> Obj:
    """``/openapi/v3``: one document per group/version (their URLs carry a content hash)."""
    by_gv: dict[tuple[str, str], list[ResourceType]] = {}
    for rt in types:
        by_gv.setdefault((rt.group, rt.version), []).append(rt)
    return {
        "paths": {
            _gv_path(*gv): {"serverRelativeURL": f"/openapi/v3/{_gv_path(*gv)}?hash={_hash(found)}"}
            for gv, found in by_gv.items()
        }
    }


def openapi_v3_document(types: Iterable[ResourceType], group: str, version: str) -> Obj:
    """A group/version's OpenAPI v3 document, reduced to what kubectl and helm read from it:
    each type's PATCH operation with its group/version/kind and the ``fieldValidation``
    parameter, so that they leave validation to the server (which does none) instead of
    validating against schemas. There are no schemas (``kubectl explain`` finds nothing)."""
    found = [rt for rt in types if (rt.group, rt.version) == (group, version)]
    if not found:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    paths: Obj = {}
    for rt in found:
        scope = "namespaces/{namespace}/" if rt.namespaced else ""
        paths[f"/{_gv_path(group, version)}/{scope}{rt.plural}/{{name}}"] = {
            "patch": {
                "operationId": f"patch{rt.kind}",
                "parameters": [
                    {"name": name, "in": "query", "schema": {"type": "string"}}
                    for name in ("dryRun", "fieldManager", "fieldValidation", "force")
                ],
                "responses": {"200": {"description": "OK"}},
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": {
                    "group": rt.group,
                    "version": rt.version,
                    "kind": rt.kind,
                },
            }
        }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (gradientmail emulator)", "version": "v1.33.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }
