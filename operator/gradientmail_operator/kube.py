"""The few Kubernetes calls the operator makes (kubernetes client, run in threads).

Every verb on every resource the operator uses is listed here: :data:`CALLS` (this module),
:data:`FRAMEWORK_CALLS` and :data:`CLUSTER_SCANNING_CALLS` (kopf, for ``handlers.py``). The
chart's RBAC tests (``tests/charts``) check its Roles grant exactly these, and that every
request the running operator makes is among them.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from gradientmail.launch.runspec import GROUP, PLURAL
from gradientmail_operator.reconcile import PodState
from gradientmail_operator.render import LABEL_INDEX, LABEL_RUN

CALLS: dict[tuple[str, str], frozenset[str]] = {
    ("", "pods"): frozenset({"list", "create", "delete"}),
    ("", "secrets"): frozenset({"get"}),
}
"""(API group, resource) -> verbs this module calls."""

FRAMEWORK_CALLS: dict[tuple[str, str], frozenset[str]] = {
    # kopf watches the runs, and patches them: finalizer, progress annotations, status.
    (GROUP, PLURAL): frozenset({"list", "watch", "patch"}),
    (GROUP, f"{PLURAL}/status"): frozenset({"patch"}),
    # kopf.event / kopf.warn post core/v1 Events next to the run.
    ("", "events"): frozenset({"create"}),
}
"""(API group, resource) -> verbs kopf calls for ``handlers.py``, in each served namespace
(``kopf run --standalone``: no peering objects)."""

CLUSTER_SCANNING_CALLS: dict[tuple[str, str], frozenset[str]] = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): frozenset({"list", "watch"}),
}
"""Cluster-scoped calls of kopf's resource observation, made unless
``GRADIENTMAIL_OPERATOR_CLUSTER_SCANNING=0`` (which a namespaced install sets). With
``--all-namespaces`` kopf does not observe namespaces; with ``--namespace`` and scanning on it
would also list and watch ``namespaces``."""


class Kube:
    def __init__(self) -> None:
        try:
            kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
        self.core = kubernetes.client.CoreV1Api()

    async def pods(self, namespace: str, run: str) -> list[PodState]:
        listing = await asyncio.to_thread(
            self.core.list_namespaced_pod, namespace, label_selector=f"{LABEL_RUN}={run}"
        )
        states = []
        for pod in listing.items:
            meta = pod.metadata
            index = ((meta.labels if meta else None) or {}).get(LABEL_INDEX, "")
            if meta is None or not meta.name or not index.isdigit():
                continue
            states.append(
                PodState(
                    name=str(meta.name),
                    index=int(index),
                    phase=(pod.status.phase if pod.status else None) or "Pending",
                    deleting=meta.deletion_timestamp is not None,
                )
            )
        return states

    async def create_pod(self, namespace: str, manifest: dict[str, Any]) -> bool:
        try:
            body: Any = manifest  # the client accepts a plain dict as well as a V1Pod
            await asyncio.to_thread(self.core.create_namespaced_pod, namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                return False  # already there: level-triggered reconcile ran twice
            raise
        return True

    async def delete_pod(self, namespace: str, name: str) -> None:
        try:
            await asyncio.to_thread(self.core.delete_namespaced_pod, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def secret_values(self, namespace: str, name: str, keys: list[str]) -> dict[str, str]:
        """Decoded values of ``keys``; raises ``LookupError`` naming what is missing.

        The values stay in memory: they are never logged, posted or written to status.
        """
        try:
            secret = await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise LookupError(f"Secret {namespace}/{name} does not exist") from None
            raise
        data = secret.data or {}
        missing = [key for key in keys if key not in data]
        if missing:
            raise LookupError(f"Secret {namespace}/{name} has no key(s) {missing}")
        return {key: base64.b64decode(data[key]).decode() for key in keys}
