"""kopf handlers: every event, and a timer, run the same level-triggered reconcile.

Run with ``kopf run -m gradientmail_operator.handlers --all-namespaces`` (or
``--namespace``). Settings come from the environment:

- ``GRADIENTMAIL_OPERATOR_RECONCILE_INTERVAL``: seconds between reconciles of a run (2).
- ``GRADIENTMAIL_OPERATOR_STATUS_INTERVAL``: seconds between mailbox polls per run (10).
- ``GRADIENTMAIL_OPERATOR_NODE_IMAGE``: image for runs that name none.
- ``GRADIENTMAIL_OPERATOR_POD_LABELS``: extra pod labels, ``k=v,k2=v2``.
- ``GRADIENTMAIL_OPERATOR_CLUSTER_SCANNING``: ``0`` turns off kopf's cluster-wide observation
  of CRDs and namespaces (``settings.scanning.disabled``), for namespaced installs whose
  RBAC grants nothing cluster-wide (``1``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import kopf
from pydantic import ValidationError

import gradientmail as gm
from gradientmail.inspect import RunView, RunWatcher
from gradientmail.launch.runspec import GROUP, PLURAL, VERSION, GradientMailRunSpec
from gradientmail_operator import render
from gradientmail_operator.kube import Kube
from gradientmail_operator.reconcile import Phase, Reason, plan
from gradientmail_operator.status import (
    conditions_patch,
    sync_condition,
    sync_warnings,
    view_status,
)

RECONCILE_INTERVAL = float(os.environ.get("GRADIENTMAIL_OPERATOR_RECONCILE_INTERVAL", "2"))
STATUS_INTERVAL = float(os.environ.get("GRADIENTMAIL_OPERATOR_STATUS_INTERVAL", "10"))
NODE_IMAGE = os.environ.get("GRADIENTMAIL_OPERATOR_NODE_IMAGE", "")
POD_LABELS = dict(
    item.split("=", 1)
    for item in os.environ.get("GRADIENTMAIL_OPERATOR_POD_LABELS", "").split(",")
    if "=" in item
)
CLUSTER_SCANNING = os.environ.get("GRADIENTMAIL_OPERATOR_CLUSTER_SCANNING", "1") != "0"

_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 120
    settings.scanning.disabled = not CLUSTER_SCANNING
    kube()


def _spec(body: kopf.Body) -> GradientMailRunSpec:
    raw = dict(body.get("spec", {}))
    if NODE_IMAGE:
        template = dict(raw.get("template") or {})
        template.setdefault("image", NODE_IMAGE)
        raw["template"] = template
    return GradientMailRunSpec.model_validate(raw)


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(x) for x in item["loc"]) or "spec"
        parts.append(f"spec.{where}: {item['msg']}")
    return "; ".join(parts)


async def _credentials(spec: GradientMailRunSpec, namespace: str) -> dict[str, str]:
    secret = spec.mailbox.credentials_secret
    if secret is None:
        return {}
    values = await kube().secret_values(
        namespace, secret.name, [secret.access_key_id_key, secret.secret_access_key_key]
    )
    return {
        "aws_access_key_id": values[secret.access_key_id_key],
        "aws_secret_access_key": values[secret.secret_access_key_key],
    }


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(body, patch, memo)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RECONCILE_INTERVAL, initial_delay=RECONCILE_INTERVAL)
async def on_timer(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(body, patch, memo)


async def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo) -> None:
    namespace = str(body.metadata.namespace)
    name, uid = str(body.metadata.name), str(body.metadata.uid)
    status = dict(body.get("status") or {})
    conditions = list(status.get("conditions") or [])
    patch.status["observedGeneration"] = body.metadata.get("generation")
    phase_text = status.get("phase") or Phase.PENDING.value
    if phase_text in (Phase.SUCCEEDED.value, Phase.FAILED.value):
        return  # terminal: a finished or failed run is never re-created
    try:
        spec = _spec(body)
    except ValidationError as exc:
        message = _describe(exc)
        if status.get("phase") != "Invalid" or _condition(conditions, "SpecValid") != message:
            kopf.warn(body, reason=Reason.INVALID_SPEC.value, message=message)
        patch.status["phase"] = "Invalid"
        patch.status["conditions"] = conditions_patch(
            conditions, "SpecValid", False, Reason.INVALID_SPEC, message
        )
        return
    conditions = conditions_patch(conditions, "SpecValid", True, Reason.PODS_STARTING, "ok")
    prefix = status.get("prefix") or render.run_prefix(namespace, name, uid)
    url = render.mailbox_url(spec, prefix)
    patch.status["prefix"] = prefix
    patch.status["mailbox"] = url  # no credentials in it: those stay in the Secret
    try:
        credentials = await _credentials(spec, namespace)
    except LookupError as exc:
        if _condition(conditions, "PodsReady") != str(exc):
            kopf.warn(body, reason=Reason.SECRET_MISSING.value, message=str(exc))
        patch.status["phase"] = Phase.PENDING.value
        patch.status["conditions"] = conditions_patch(
            conditions, "PodsReady", False, Reason.SECRET_MISSING, str(exc)
        )
        return
    pods = await kube().pods(namespace, name)
    decision = plan(
        spec,
        Phase(phase_text if phase_text != "Invalid" else "Pending"),
        int(status.get("restarts", 0)),
        pods,
    )
    for pod_name in decision.delete:
        await kube().delete_pod(namespace, pod_name)
    for index in decision.create:
        manifest = render.pod_manifest(
            spec,
            namespace=namespace,
            run=name,
            uid=uid,
            index=index,
            url=url,
            extra_labels=POD_LABELS,
        )
        await kube().create_pod(namespace, manifest)
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason.value, message=event.message)
    patch.status["phase"] = decision.phase.value
    patch.status["restarts"] = decision.restarts
    patch.status["nodes"] = {
        "desired": spec.nodes,
        "running": decision.ready,
        "succeeded": decision.succeeded,
        "failed": decision.failed,
    }
    conditions = conditions_patch(
        conditions,
        "PodsReady",
        decision.reason == Reason.PODS_READY,
        decision.reason,
        decision.message,
    )
    conditions = conditions_patch(
        conditions,
        "Complete",
        decision.phase == Phase.SUCCEEDED,
        decision.reason,
        decision.message,
    )
    conditions = conditions_patch(
        conditions, "Failed", decision.phase == Phase.FAILED, decision.reason, decision.message
    )
    conditions = await _observe(body, memo, url, credentials, conditions, patch)
    patch.status["conditions"] = conditions


def _condition(conditions: list[dict[str, Any]], kind: str) -> str | None:
    for condition in conditions:
        if condition.get("type") == kind:
            return str(condition.get("message"))
    return None


async def _observe(
    body: kopf.Body,
    memo: kopf.Memo,
    url: str,
    credentials: dict[str, str],
    conditions: list[dict[str, Any]],
    patch: kopf.Patch,
) -> list[dict[str, Any]]:
    """Poll the mailbox (at most every STATUS_INTERVAL s) and fold it into the status."""
    now = time.monotonic()
    if now - memo.get("polled_at", -1e9) < STATUS_INTERVAL:
        return conditions
    memo["polled_at"] = now
    watcher: RunWatcher | None = memo.get("watcher")
    if watcher is None or memo.get("watcher_url") != url:
        try:
            box = gm.open_mailbox(url, **credentials)
        except ValueError as exc:
            return conditions_patch(
                conditions, "MailboxReachable", False, Reason.MAILBOX_MISCONFIGURED, str(exc)
            )
        watcher = RunWatcher(box)
        memo["watcher"], memo["watcher_url"] = watcher, url
    try:
        view: RunView = await watcher.poll()
    except gm.MailboxConfigError as exc:
        _warn_once(body, memo, Reason.MAILBOX_MISCONFIGURED, str(exc))
        return conditions_patch(
            conditions, "MailboxReachable", False, Reason.MAILBOX_MISCONFIGURED, str(exc)
        )
    except gm.MailboxError as exc:
        _warn_once(body, memo, Reason.MAILBOX_UNREACHABLE, str(exc))
        return conditions_patch(
            conditions, "MailboxReachable", False, Reason.MAILBOX_UNREACHABLE, str(exc)
        )
    memo.pop("warned", None)
    patch.status.update(view_status(view))
    conditions = conditions_patch(
        conditions, "MailboxReachable", True, Reason.MAILBOX_REACHABLE, "listing works"
    )
    training = view.rounds_committed > 0
    conditions = conditions_patch(
        conditions,
        "Progressing",
        training,
        Reason.TRAINING if training else Reason.WAITING_FOR_ROUNDS,
        f"{view.rounds_committed} rounds committed, {view.live_learners} learners live",
    )
    warned: set[tuple[Reason, str]] = memo.setdefault("sync_warned", set())
    for reason, message in sync_warnings(view, warned):
        kopf.warn(body, reason=reason.value, message=message)
    ok, reason, message = sync_condition(view)
    return conditions_patch(conditions, "SyncPointsContributed", ok, reason, message)


def _warn_once(body: kopf.Body, memo: kopf.Memo, reason: Reason, message: str) -> None:
    if memo.get("warned") != reason:
        memo["warned"] = reason
        kopf.warn(body, reason=reason.value, message=message)


@kopf.on.delete(
    GROUP, VERSION, PLURAL, when=lambda spec, **_: spec.get("cleanupPolicy") == "Delete"
)
async def cleanup(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """cleanupPolicy: Delete removes every object under the run's prefix (pods go by GC)."""
    status = body.get("status") or {}
    url = status.get("mailbox")
    if not url:
        return  # never reconciled: nothing was written
    try:
        spec = _spec(body)
        credentials = await _credentials(spec, str(body.metadata.namespace))
    except (ValidationError, LookupError) as exc:
        logger.warning(f"cannot clean up {url}: {exc}; the prefix is kept")
        return
    # Stop the nodes first: a node still running would write into the prefix after the wipe.
    namespace, name = str(body.metadata.namespace), str(body.metadata.name)
    for pod in await kube().pods(namespace, name):
        await kube().delete_pod(namespace, pod.name)
    for _attempt in range(120):
        if not await kube().pods(namespace, name):
            break
        await asyncio.sleep(0.5)
    else:
        raise kopf.TemporaryError("node pods are still terminating", delay=5)
    box = gm.open_mailbox(url, **credentials)
    keys = await box.list("")
    await box.delete(keys)
    logger.info(f"deleted {len(keys)} objects under {url}")
