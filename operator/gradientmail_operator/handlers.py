"""kopf handlers: event-driven reconcile of each run, its mailbox status apart.

Run with ``kopf run -m gradientmail_operator.handlers --all-namespaces`` (or
``--namespace``). Per run, two daemons:

- **pods** (:func:`run_pods_loop`): reconciles when woken (a change of the run, or of one of
  its pods, which the operator watches and indexes by run) and otherwise every
  ``RECONCILE_INTERVAL`` seconds as a safety net; it writes the status, and only the fields
  that changed, never for a finished run once its last word is written.
- **status** (:func:`run_status_loop`): polls the mailbox every ``STATUS_INTERVAL`` seconds on
  a loop and threads of its own (``observer.py``) with a time budget per poll, hands what it
  saw to the pods loop, and makes one final poll when the run ends.

Settings come from the environment:

- ``GRADIENTMAIL_OPERATOR_RECONCILE_INTERVAL``: seconds between safety reconciles (60).
- ``GRADIENTMAIL_OPERATOR_STATUS_INTERVAL``: seconds between mailbox polls per run (10).
- ``GRADIENTMAIL_OPERATOR_POLL_BUDGET``: seconds one poll may take before the status says
  so (30); the poll goes on in the background, no second one starts.
- ``GRADIENTMAIL_OPERATOR_SECRET_CHECK``: seconds between checks of a run's Secret for a
  rotation (60); a failed authentication re-reads it at once.
- ``GRADIENTMAIL_OPERATOR_RESTART_BACKOFF``: ``base,cap`` seconds of the per-node restart
  backoff (``10,300``).
- ``GRADIENTMAIL_OPERATOR_NODE_IMAGE``: image for runs that name none;
  ``…_NODE_IMAGE_PULL_POLICY`` and ``…_NODE_IMAGE_PULL_SECRETS`` (comma-separated names)
  likewise, for runs that set neither.
- ``GRADIENTMAIL_OPERATOR_METRICS_PORT``: Prometheus metrics port (8081; 0 turns it off).
- ``GRADIENTMAIL_OPERATOR_POD_LABELS``: extra pod labels, ``k=v,k2=v2``.
- ``GRADIENTMAIL_OPERATOR_FILE_MAILBOXES``: ``shared`` accepts ``file://`` mailboxes without a
  claim behind them (a single-node cluster whose pods share one filesystem).
- ``GRADIENTMAIL_OPERATOR_CLUSTER_SCANNING``: ``0`` turns off kopf's cluster-wide observation
  of CRDs and namespaces (``settings.scanning.disabled``), for namespaced installs whose
  RBAC grants nothing cluster-wide (``1``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import kopf
from pydantic import ValidationError

import gradientmail as gm
from gradientmail.launch.runspec import GROUP, PLURAL, VERSION, GradientMailRunSpec
from gradientmail_operator import metrics, render
from gradientmail_operator.kube import Credentials, Kube
from gradientmail_operator.observer import Observer
from gradientmail_operator.reconcile import Phase, PodState, Reason, RestartBackoff
from gradientmail_operator.runs import RunState, reconcile_pass


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: give a number of seconds") from None
    if value <= 0:
        raise SystemExit(f"{name}={raw!r}: must be positive")
    return value


def _backoff_policy() -> RestartBackoff:
    raw = os.environ.get("GRADIENTMAIL_OPERATOR_RESTART_BACKOFF", "10,300")
    try:
        base, cap = (float(x) for x in raw.split(","))
    except ValueError:
        raise SystemExit(
            f"GRADIENTMAIL_OPERATOR_RESTART_BACKOFF={raw!r}: give 'base,cap' in seconds"
        ) from None
    return RestartBackoff(base=base, cap=cap)


RECONCILE_INTERVAL = _seconds("GRADIENTMAIL_OPERATOR_RECONCILE_INTERVAL", 60.0)
STATUS_INTERVAL = _seconds("GRADIENTMAIL_OPERATOR_STATUS_INTERVAL", 10.0)
POLL_BUDGET = _seconds("GRADIENTMAIL_OPERATOR_POLL_BUDGET", 30.0)
SECRET_CHECK = _seconds("GRADIENTMAIL_OPERATOR_SECRET_CHECK", 60.0)
BACKOFF = _backoff_policy()
NODE_IMAGE = os.environ.get("GRADIENTMAIL_OPERATOR_NODE_IMAGE", "")
NODE_PULL_POLICY = os.environ.get("GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_POLICY", "")
NODE_PULL_SECRETS = [
    name
    for name in os.environ.get("GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_SECRETS", "").split(",")
    if name.strip()
]
POD_LABELS = dict(
    item.split("=", 1)
    for item in os.environ.get("GRADIENTMAIL_OPERATOR_POD_LABELS", "").split(",")
    if "=" in item
)
SHARED_FILES = os.environ.get("GRADIENTMAIL_OPERATOR_FILE_MAILBOXES", "") == "shared"
CLUSTER_SCANNING = os.environ.get("GRADIENTMAIL_OPERATOR_CLUSTER_SCANNING", "1") != "0"

_log = logging.getLogger("gradientmail.operator")
_kube: Kube | None = None
RUNS: dict[tuple[str, str], RunState] = {}
"""(namespace, run name) -> what this operator keeps of the run between passes."""


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


def _state(namespace: str, name: str) -> RunState:
    key = (namespace, name)
    if key not in RUNS:
        RUNS[key] = RunState(observer=Observer(budget=POLL_BUDGET, secret_check=SECRET_CHECK))
    return RUNS[key]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.posting.level = logging.WARNING
    # Each watch is re-opened when it times out: per operator, not per run, but on a quiet
    # cluster with one run it is most of the traffic.
    settings.watching.server_timeout = 600
    settings.scanning.disabled = not CLUSTER_SCANNING
    kube()
    metrics.serve(metrics.port_from_env())


# -- the pods, watched and indexed by run -------------------------------------------------------


def _run_of(meta: kopf.Meta, labels: kopf.Labels) -> str:
    # A long run name is hashed into the label; the annotation keeps it whole.
    annotations = meta.get("annotations") or {}
    return str(annotations.get(f"{GROUP}/run-name") or labels.get(render.LABEL_RUN, ""))


@kopf.index("", "v1", "pods", labels={render.LABEL_MANAGED: render.MANAGER})
def run_pods(
    namespace: str | None, meta: kopf.Meta, labels: kopf.Labels, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], PodState]:
    index = str(labels.get(render.LABEL_INDEX, ""))
    run = _run_of(meta, labels)
    if not run or not index.isdigit():
        return {}
    return {
        (str(namespace), run): PodState(
            name=str(meta.get("name")),
            index=int(index),
            phase=str(status.get("phase") or "Pending"),
            deleting=meta.get("deletionTimestamp") is not None,
            uid=str(meta.get("uid", "")),
        )
    }


@kopf.on.event("", "v1", "pods", labels={render.LABEL_MANAGED: render.MANAGER})
def pod_changed(namespace: str | None, meta: kopf.Meta, labels: kopf.Labels, **_: Any) -> None:
    state = RUNS.get((str(namespace), _run_of(meta, labels)))
    if state is not None:
        state.wake.set()


@kopf.on.event(GROUP, VERSION, PLURAL)
def run_changed(namespace: str | None, name: str, **_: Any) -> None:
    state = RUNS.get((str(namespace), name))
    if state is not None:
        state.wake.set()


# -- the spec ----------------------------------------------------------------------------------


def _spec(body: kopf.Body) -> tuple[GradientMailRunSpec | None, str | None]:
    raw = dict(body.get("spec", {}))
    defaults: dict[str, Any] = {}
    if NODE_IMAGE:
        defaults["image"] = NODE_IMAGE
    if NODE_PULL_POLICY:
        defaults["imagePullPolicy"] = NODE_PULL_POLICY
    if NODE_PULL_SECRETS:
        defaults["imagePullSecrets"] = [{"name": n.strip()} for n in NODE_PULL_SECRETS]
    if defaults:  # the operator's defaults; a run's own settings win
        raw["template"] = {**defaults, **dict(raw.get("template") or {})}
    try:
        spec = GradientMailRunSpec.model_validate(raw)
    except ValidationError as exc:
        return None, _describe(exc)
    problems = render.launch_problems(spec)
    problems += [] if SHARED_FILES else render.cluster_problems(spec)
    if problems:
        return None, "; ".join(problems)
    return spec, None


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(x) for x in item["loc"]) or "spec"
        parts.append(f"spec.{where}: {item['msg']}")
    return "; ".join(parts)


def _credentials(spec: GradientMailRunSpec, namespace: str) -> Callable[[], Any]:
    async def read() -> Credentials | None:
        secret = spec.mailbox.credentials_secret
        if secret is None:
            return None
        read = await kube().secret_values(
            namespace, secret.name, [secret.access_key_id_key, secret.secret_access_key_key]
        )
        values = {
            "aws_access_key_id": read.values[secret.access_key_id_key],
            "aws_secret_access_key": read.values[secret.secret_access_key_key],
        }
        return Credentials(values, read.version)

    return read


def _terminal(status: dict[str, Any]) -> bool:
    return status.get("phase") in (Phase.SUCCEEDED.value, Phase.FAILED.value)


def _live(status: kopf.Status, **_: Any) -> bool:
    """A run whose daemons run: not finished, or finished without its last word written
    (a final status poll; also for runs that ended under an older operator)."""
    return not (_terminal(dict(status)) and status.get("statusFinal"))


async def _sleep(event: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Sleep until ``event`` is set, the daemon is stopped, or ``seconds`` pass."""

    async def until_stopped() -> None:
        await stopped.wait()

    tasks = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(until_stopped())}
    try:
        await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _pause(state: RunState, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Sleep until woken, stopped, or ``seconds`` pass; the wake is consumed."""
    await _sleep(state.wake, stopped, seconds)
    state.wake.clear()


# -- the daemons ------------------------------------------------------------------------------


@kopf.daemon(GROUP, VERSION, PLURAL, when=_live, cancellation_timeout=10.0)
async def run_pods_loop(body: kopf.Body, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    index: kopf.Index[tuple[str, str], PodState] = kwargs["run_pods"]  # the index above
    namespace, name = str(body.metadata.namespace), str(body.metadata.name)
    uid = str(body.metadata.uid)
    state = _state(namespace, name)

    def post(kind: str, reason: Reason, message: str) -> None:
        kopf.event(body, type=kind, reason=reason.value, message=message)

    while not stopped:
        spec, error = _spec(body)
        pods = list(index.get((namespace, name), []))
        try:
            changes, decision = await reconcile_pass(
                state=state,
                body_status=dict(body.get("status") or {}),
                generation=body.metadata.get("generation"),
                namespace=namespace,
                name=name,
                uid=uid,
                spec=spec,
                spec_error=error,
                pods=pods,
                kube=kube(),
                post=post,
                policy=BACKOFF,
                pod_labels=POD_LABELS,
            )
            if changes:
                await kube().patch_status(namespace, name, changes)
                state.written.update(changes)
            metrics.reconciled("ok")
            metrics.observe_run(
                namespace, name, {**dict(body.get("status") or {}), **state.written}
            )
        except Exception as exc:  # an API error: logged, retried on the next pass
            metrics.reconciled("error")
            _log.warning("run %s/%s: reconcile failed: %s", namespace, name, exc)
            await _pause(state, stopped, min(RECONCILE_INTERVAL, 5.0))
            continue
        status = {**dict(body.get("status") or {}), **state.written}
        if _terminal(status):
            if status.get("statusFinal"):
                return  # the last word is written: nothing more for this run
            state.final_requested.set()
        wait = RECONCILE_INTERVAL
        if decision is not None and decision.wake_in is not None:
            wait = min(wait, max(decision.wake_in, 0.05))
        await _pause(state, stopped, wait)


@kopf.daemon(GROUP, VERSION, PLURAL, when=_live, cancellation_timeout=10.0)
async def run_status_loop(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
    namespace, name = str(body.metadata.namespace), str(body.metadata.name)
    state = _state(namespace, name)
    while not stopped:
        spec, _error = _spec(body)
        status = {**dict(body.get("status") or {}), **state.written}
        final = _terminal(status) or state.final_requested.is_set()
        url = status.get("mailbox")
        if spec is not None and url:
            started = time.monotonic()
            state.observation = seen = await state.observer.observe(
                spec, str(url), _credentials(spec, namespace)
            )
            if seen.reachable is not None:
                outcome = "ok" if seen.reachable[0] else seen.reachable[1].value
                metrics.poll_done(namespace, name, outcome, time.monotonic() - started)
        if final:
            state.final_observed = True
            state.wake.set()
            return
        state.wake.set()
        # The next poll comes early when the pods' loop asks for the final one.
        await _sleep(state.final_requested, stopped, STATUS_INTERVAL)


# -- deletion --------------------------------------------------------------------------------


@kopf.on.delete(
    GROUP, VERSION, PLURAL, when=lambda spec, **_: spec.get("cleanupPolicy") == "Delete"
)
async def cleanup(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """cleanupPolicy: Delete removes every object under the run's prefix (pods go by GC)."""
    status = body.get("status") or {}
    url = status.get("mailbox")
    namespace, name = str(body.metadata.namespace), str(body.metadata.name)
    RUNS.pop((namespace, name), None)
    if not url:
        return  # never reconciled: nothing was written
    spec, error = _spec(body)
    if spec is None:
        logger.warning(f"cannot clean up {url}: {error}; the prefix is kept")
        return
    try:
        read = await _credentials(spec, namespace)()
    except LookupError as exc:
        logger.warning(f"cannot clean up {url}: {exc}; the prefix is kept")
        return
    # Stop the nodes first: a node still running would write into the prefix after the wipe.
    label = render.run_label(name)
    for pod in await kube().pods(namespace, label):
        await kube().delete_pod(namespace, pod.name)
    for _attempt in range(120):
        if not await kube().pods(namespace, label):
            break
        await asyncio.sleep(0.5)
    else:
        raise kopf.TemporaryError("node pods are still terminating", delay=5)
    box = gm.open_mailbox(url, **({} if read is None else read.values))
    keys = await box.list("")
    await box.delete(keys)
    logger.info(f"deleted {len(keys)} objects under {url}")


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(namespace: str | None, name: str, **_: Any) -> None:
    """A deleted run's state goes (the daemons are stopped by kopf)."""
    RUNS.pop((str(namespace), name), None)
    metrics.forget_run(str(namespace), name)
