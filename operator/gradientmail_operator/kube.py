"""The few Kubernetes calls the operator makes (kubernetes client, on threads of its own).

The calls run on a pool of their own, never on the event loop's default executor: a slow or
hanging object store (whose client also runs in threads) cannot delay pod replacement.

Every verb on every resource the operator uses is listed here: :data:`CALLS` (this module),
:data:`FRAMEWORK_CALLS` and :data:`CLUSTER_SCANNING_CALLS` (kopf, for ``handlers.py``). The
chart's RBAC tests (``tests/charts``) check its Roles grant exactly these, and that every
request the running operator makes is among them.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import kubernetes
from kubernetes.client.exceptions import ApiException

from gradientmail.launch.runspec import GROUP, PLURAL, VERSION
from gradientmail_operator.reconcile import PodState
from gradientmail_operator.render import LABEL_INDEX, LABEL_RUN

CALLS: dict[tuple[str, str], frozenset[str]] = {
    # list: only when a run with cleanupPolicy Delete goes (pods are otherwise watched).
    ("", "pods"): frozenset({"list", "create", "delete"}),
    # get: only when a run's mailbox watcher is (re)built, and to notice a rotation.
    ("", "secrets"): frozenset({"get"}),
    # A run's status, written only when it changed.
    (GROUP, f"{PLURAL}/status"): frozenset({"patch"}),
}
"""(API group, resource) -> verbs this module calls."""

FRAMEWORK_CALLS: dict[tuple[str, str], frozenset[str]] = {
    # kopf watches the runs, and patches them: finalizer, progress annotations, status.
    (GROUP, PLURAL): frozenset({"list", "watch", "patch"}),
    (GROUP, f"{PLURAL}/status"): frozenset({"patch"}),
    # The pods the operator owns, watched (an index by run, and events that wake the run).
    ("", "pods"): frozenset({"list", "watch"}),
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


T = TypeVar("T")


@dataclass(frozen=True)
class Credentials:
    """S3 keys read from a run's Secret, with the Secret's resourceVersion (a rotation
    changes it). The values stay in memory: never logged, posted or written to status."""

    values: dict[str, str]
    version: str

    def __repr__(self) -> str:
        return f"Credentials(version={self.version!r})"


class Kube:
    def __init__(self) -> None:
        try:
            kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
        self.core = kubernetes.client.CoreV1Api()
        self.custom = kubernetes.client.CustomObjectsApi()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gm-kube")

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def pods(self, namespace: str, run_label: str) -> list[PodState]:
        listing = await self._call(
            self.core.list_namespaced_pod, namespace, label_selector=f"{LABEL_RUN}={run_label}"
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

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the run's status (``None`` values remove keys)."""
        await self._call(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": status},
        )

    async def create_pod(self, namespace: str, manifest: dict[str, Any]) -> bool:
        try:
            body: Any = manifest  # the client accepts a plain dict as well as a V1Pod
            await self._call(self.core.create_namespaced_pod, namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                return False  # already there: level-triggered reconcile ran twice
            raise
        return True

    async def delete_pod(self, namespace: str, name: str) -> None:
        try:
            await self._call(self.core.delete_namespaced_pod, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def secret_values(self, namespace: str, name: str, keys: list[str]) -> Credentials:
        """Decoded values of ``keys``; raises ``LookupError`` naming what is missing.

        The values stay in memory: they are never logged, posted or written to status.
        """
        try:
            secret = await self._call(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise LookupError(f"Secret {namespace}/{name} does not exist") from None
            raise
        data = secret.data or {}
        missing = [key for key in keys if key not in data]
        if missing:
            raise LookupError(f"Secret {namespace}/{name} has no key(s) {missing}")
        version = str((secret.metadata.resource_version if secret.metadata else None) or "")
        return Credentials(
            {key: base64.b64decode(data[key]).decode() for key in keys}, version=version
        )
