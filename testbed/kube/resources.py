"""Resource types: the built-in table, and the types a CustomResourceDefinition registers.

A :class:`ResourceType` is what discovery lists and what a URL names: group, version, plural,
kind, scope, short names, subresources and, for custom resources, printer columns. Objects of
one (group, plural) share one storage whatever version they are read in; reading an object
in another version only rewrites ``apiVersion`` (there is no conversion).

Built-in types are plain storage: no controller acts on them, except what ``store.py`` does
(garbage collection, namespace deletion, CRD registration) and what the kubelet does to pods.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BUILTIN_TYPES",
    "Column",
    "CrdError",
    "ResourceType",
    "crd_types",
    "version_priority",
]

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class Column:
    """A printer column: what a CRD's ``additionalPrinterColumns`` entry says."""

    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0
    format: str = ""


@dataclass(frozen=True)
class ResourceType:
    """One resource in one group/version, as discovery shows it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    columns: tuple[Column, ...] | None = None
    """Printer columns of a custom resource; None: the built-in rendering in ``tables.py``."""
    custom: bool = False
    preferred: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def group_resource(self) -> str:
        """``plural.group`` (``pods`` for the core group), as error messages name types."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def discovery(self) -> list[dict[str, Any]]:
        """The entries of this type in an ``APIResourceList`` (the type, then subresources)."""
        entry: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(ALL_VERBS),
        }
        if self.short_names:
            entry["shortNames"] = list(self.short_names)
        if self.categories:
            entry["categories"] = list(self.categories)
        entries = [entry]
        for sub in sorted(self.subresources):
            verbs = {"status": ["get", "patch", "update"], "log": ["get"], "binding": ["create"]}
            kind = {"log": "Pod", "binding": "Binding"}.get(sub, self.kind)
            entries.append(
                {
                    "name": f"{self.plural}/{sub}",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": kind,
                    "verbs": verbs.get(sub, ["get"]),
                }
            )
        return entries


def _t(
    group: str,
    version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool = True,
    short: tuple[str, ...] = (),
    sub: tuple[str, ...] = (),
    categories: tuple[str, ...] = (),
) -> ResourceType:
    return ResourceType(
        group=group,
        version=version,
        plural=plural,
        kind=kind,
        namespaced=namespaced,
        singular=kind.lower(),
        short_names=short,
        categories=categories,
        subresources=frozenset(sub),
    )


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _t("", "v1", "namespaces", "Namespace", namespaced=False, short=("ns",), sub=("status",)),
    _t("", "v1", "nodes", "Node", namespaced=False, short=("no",), sub=("status",)),
    _t(
        "",
        "v1",
        "pods",
        "Pod",
        short=("po",),
        sub=("status", "log", "binding"),
        categories=("all",),
    ),
    _t("", "v1", "configmaps", "ConfigMap", short=("cm",)),
    _t("", "v1", "secrets", "Secret"),
    _t("", "v1", "services", "Service", short=("svc",), sub=("status",), categories=("all",)),
    _t("", "v1", "serviceaccounts", "ServiceAccount", short=("sa",)),
    _t("", "v1", "endpoints", "Endpoints", short=("ep",)),
    _t("", "v1", "events", "Event", short=("ev",)),
    _t(
        "", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short=("pvc",), sub=("status",)
    ),
    _t("apps", "v1", "deployments", "Deployment", short=("deploy",), sub=("status",)),
    _t("apps", "v1", "statefulsets", "StatefulSet", short=("sts",), sub=("status",)),
    _t("apps", "v1", "replicasets", "ReplicaSet", short=("rs",), sub=("status",)),
    _t("apps", "v1", "daemonsets", "DaemonSet", short=("ds",), sub=("status",)),
    _t("batch", "v1", "jobs", "Job", sub=("status",)),
    _t("batch", "v1", "cronjobs", "CronJob", short=("cj",), sub=("status",)),
    _t("coordination.k8s.io", "v1", "leases", "Lease"),
    _t("events.k8s.io", "v1", "events", "Event", short=("ev",)),
    _t(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        short=("pdb",),
        sub=("status",),
    ),
    _t("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _t("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _t("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _t(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
    ),
    _t(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short=("crd", "crds"),
        sub=("status",),
    ),
)


class CrdError(ValueError):
    """A CustomResourceDefinition the emulator cannot register (HTTP 422)."""


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Kubernetes version order: v2 > v1 > v1beta2 > v1beta1 > v1alpha1 > anything else."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if match is None:
        return (-1, 0, 0, version)
    stability = {"alpha": 0, "beta": 1, None: 2}[match.group(2)]
    return (stability, int(match.group(1)), int(match.group(3) or 0), version)


def crd_types(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The types a ``apiextensions.k8s.io/v1`` CRD registers, one per served version."""
    spec = crd.get("spec") or {}
    group = spec.get("group")
    names = spec.get("names") or {}
    plural, kind = names.get("plural"), names.get("kind")
    scope = spec.get("scope")
    versions = spec.get("versions") or []
    name = (crd.get("metadata") or {}).get("name")
    missing = [
        what
        for what, value in (
            ("spec.group", group),
            ("spec.names.plural", plural),
            ("spec.names.kind", kind),
            ("spec.versions", versions),
        )
        if not value
    ]
    if missing:
        raise CrdError(f"CustomResourceDefinition {name!r}: required: {', '.join(missing)}")
    if scope not in ("Namespaced", "Cluster"):
        raise CrdError(f"spec.scope must be Namespaced or Cluster, not {scope!r}")
    if name != f"{plural}.{group}":
        raise CrdError(f"metadata.name must be spec.names.plural+'.'+spec.group: {name!r}")
    storage = [v for v in versions if v.get("storage")]
    if len(storage) != 1:
        raise CrdError("exactly one version must be marked storage: true")
    served = [v for v in versions if v.get("served", True)]
    preferred = max((v["name"] for v in served), key=version_priority, default=None)
    group, plural, kind = str(group), str(plural), str(kind)
    types = []
    for version in served:
        subresources = set((version.get("subresources") or {}).keys())
        columns = version.get("additionalPrinterColumns")
        parsed: tuple[Column, ...]
        if columns is None:
            parsed = (Column("Age", "date", ".metadata.creationTimestamp"),)
        else:
            parsed = tuple(
                Column(
                    name=c["name"],
                    type=c.get("type", "string"),
                    json_path=c["jsonPath"],
                    description=c.get("description", ""),
                    priority=int(c.get("priority", 0)),
                    format=c.get("format", ""),
                )
                for c in columns
            )
        types.append(
            ResourceType(
                group=group,
                version=version["name"],
                plural=plural,
                kind=kind,
                namespaced=scope == "Namespaced",
                singular=names.get("singular") or kind.lower(),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=frozenset(subresources & {"status", "scale"}),
                columns=parsed,
                custom=True,
                preferred=version["name"] == preferred,
            )
        )
    return types
