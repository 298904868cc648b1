"""What the operator calls, as API requests, and whether an RBAC setup allows them.

The operator's calls are listed in code next to the calls themselves:
``gradientmail_operator.kube.CALLS`` (its own kubernetes-client calls),
``FRAMEWORK_CALLS`` (kopf, for ``handlers.py``) and ``CLUSTER_SCANNING_CALLS`` (kopf's
cluster-wide observation of CRDs, off in namespaced installs). :class:`Rbac` evaluates Roles,
ClusterRoles and their bindings (rendered by helm, or read back from an API server) the way
the API server's RBAC authorizer does, for one ServiceAccount.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gradientmail_operator.kube import CALLS, CLUSTER_SCANNING_CALLS, FRAMEWORK_CALLS

ANY_NAMESPACE = "some-team"  # stands for "every namespace" in cluster-wide mode


@dataclass(frozen=True, order=True)
class Request:
    """One API request as RBAC sees it: ``resource`` may be ``plural/subresource``;
    ``namespace`` None is a cluster-scoped request."""

    verb: str
    group: str
    resource: str
    namespace: str | None

    def __str__(self) -> str:
        where = f"in {self.namespace}" if self.namespace else "cluster-wide"
        return f"{self.verb} {self.group or 'core'}/{self.resource} {where}"


def operator_calls(*, cluster_scanning: bool) -> dict[tuple[str, str], frozenset[str]]:
    """(group, resource) → verbs, everything the operator may call, namespaced and not."""
    calls: dict[tuple[str, str], frozenset[str]] = {}
    sources = [CALLS, FRAMEWORK_CALLS, *([CLUSTER_SCANNING_CALLS] if cluster_scanning else [])]
    for source in sources:
        for key, verbs in source.items():
            calls[key] = calls.get(key, frozenset()) | verbs
    return calls


CLUSTER_SCOPED = {key for key in CLUSTER_SCANNING_CALLS}


def required(watch_namespaces: Sequence[str]) -> set[Request]:
    """Every request the operator may make, installed for ``watch_namespaces`` (empty: all)."""
    namespaced_mode = bool(watch_namespaces)
    namespaces = list(dict.fromkeys(watch_namespaces)) or [ANY_NAMESPACE]
    requests = set()
    for (group, resource), verbs in operator_calls(cluster_scanning=not namespaced_mode).items():
        for verb in verbs:
            if (group, resource) in CLUSTER_SCOPED:
                requests.add(Request(verb, group, resource, None))
            else:
                requests.update(Request(verb, group, resource, ns) for ns in namespaces)
    return requests


def _matches(rule: dict[str, Any], request: Request) -> bool:
    groups, resources, verbs = (
        rule.get("apiGroups") or [],
        rule.get("resources") or [],
        rule.get("verbs") or [],
    )
    if rule.get("resourceNames"):
        return False  # the operator's requests are by collection, or by arbitrary name
    base = request.resource.split("/", 1)[0]
    resource_ok = (
        "*" in resources
        or request.resource in resources
        or ("/" in request.resource and f"{base}/*" in resources)
    )
    return (
        ("*" in groups or request.group in groups)
        and resource_ok
        and ("*" in verbs or request.verb in verbs)
    )


class Rbac:
    """The rules bound to one ServiceAccount by the Roles and bindings in ``docs``."""

    def __init__(self, docs: Iterable[dict[str, Any]], namespace: str, name: str) -> None:
        docs = list(docs)
        self.subject = (namespace, name)
        roles = {
            (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
            for d in docs
            if d.get("kind") in ("Role", "ClusterRole")
        }
        self.cluster_rules: list[dict[str, Any]] = []  # via ClusterRoleBindings
        self.namespace_rules: dict[str, list[dict[str, Any]]] = {}  # via RoleBindings
        self.bindings: list[dict[str, Any]] = []
        for doc in docs:
            if doc.get("kind") not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(self._is_subject(s) for s in doc.get("subjects") or []):
                continue
            self.bindings.append(doc)
            ref = doc["roleRef"]
            bound_ns = doc["metadata"].get("namespace")
            key = (ref["kind"], bound_ns if ref["kind"] == "Role" else None, ref["name"])
            rules = list((roles.get(key) or {}).get("rules") or [])
            if doc["kind"] == "ClusterRoleBinding":
                self.cluster_rules += rules
            else:
                self.namespace_rules.setdefault(bound_ns, []).extend(rules)

    def _is_subject(self, subject: dict[str, Any]) -> bool:
        return (
            subject.get("kind") == "ServiceAccount"
            and (subject.get("namespace"), subject.get("name")) == self.subject
        )

    def allows(self, request: Request) -> bool:
        rules = list(self.cluster_rules)
        if request.namespace is not None:
            rules += self.namespace_rules.get(request.namespace, [])
        return any(_matches(rule, request) for rule in rules)

    def rules(self) -> list[dict[str, Any]]:
        return self.cluster_rules + [r for rs in self.namespace_rules.values() for r in rs]

    def granted(self, namespaces: Sequence[str]) -> set[Request]:
        """Every request the rules allow (rules must not use wildcards), spelled out for
        ``namespaces`` (cluster-wide rules: every namespace is like :data:`ANY_NAMESPACE`)."""
        out: set[Request] = set()
        cluster_wide = [(None, r) for r in self.cluster_rules]
        scoped = [(ns, r) for ns, rs in self.namespace_rules.items() for r in rs]
        for namespace, rule in cluster_wide + scoped:
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    for verb in rule.get("verbs") or []:
                        key = (group, resource)
                        if key in CLUSTER_SCOPED:
                            out.add(Request(verb, group, resource, None))
                        elif namespace is None:
                            out.update(
                                Request(verb, group, resource, ns)
                                for ns in [ANY_NAMESPACE, *namespaces]
                            )
                        else:
                            out.add(Request(verb, group, resource, namespace))
        return out
