"""One run's reconcile pass: from its spec, pods and last mailbox observation to the pod
calls to make and the status to write. The Kubernetes calls are passed in (``kube.py`` in
the operator), so a pass runs in tests without a cluster.

- :class:`RunState` is what the operator remembers of a run between passes: the event that
  wakes its loop, its observer, the pods it created or deleted that the watch has not
  shown yet, the warnings already posted and the status it last wrote.
- :func:`run_conditions` is the table of phase × conditions (docs/operator.md).
- :func:`reconcile_pass` does one pass and returns the status fields that changed.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gradientmail.launch.runspec import GradientMailRunSpec
from gradientmail_operator import render
from gradientmail_operator.observer import Condition, Observation, Observer
from gradientmail_operator.reconcile import (
    Event,
    NodeBackoff,
    Phase,
    Plan,
    PodState,
    Reason,
    RestartBackoff,
    plan,
)
from gradientmail_operator.status import conditions_patch

INVALID = "Invalid"
PENDING_GRACE = 60.0  # seconds a pod just created counts as Pending before the watch shows it


class PodCalls(Protocol):
    async def create_pod(self, namespace: str, manifest: dict[str, Any]) -> bool: ...
    async def delete_pod(self, namespace: str, name: str) -> None: ...


Post = Callable[[str, Reason, str], None]
"""Posts an event next to the run: (type, reason, message)."""


@dataclass
class RunState:
    """What the operator keeps of one run between passes (lost on restart, by design: the
    status and the pods hold everything that must survive)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    observer: Observer = field(default_factory=Observer)
    observation: Observation | None = None
    final_requested: asyncio.Event = field(default_factory=asyncio.Event)
    final_observed: bool = False
    created: dict[int, tuple[str, float]] = field(default_factory=dict)  # index -> (pod, at)
    deleted: set[str] = field(default_factory=set)  # uids deleted, maybe still indexed
    posted: set[tuple[str, str]] = field(default_factory=set)  # (reason, cause) posted once
    written: dict[str, Any] = field(default_factory=dict)  # status fields last written


def post_once(state: RunState, post: Post, kind: str, reason: Reason, message: str) -> None:
    """Post a warning or event once per cause (the reason and its message)."""
    cause = (reason.value, hashlib.sha256(message.encode()).hexdigest()[:16])
    if cause not in state.posted:
        state.posted.add(cause)
        post(kind, reason, message)


def run_conditions(
    existing: list[dict[str, Any]],
    phase: str,
    pods: tuple[Reason, str] | None,
    observation: Observation | None,
    spec_error: str | None = None,
) -> list[dict[str, Any]]:
    """Every condition, consistent with ``phase`` (docs/operator.md's table): Complete is True iff
    the phase is Succeeded, Failed iff Failed, SpecValid False iff Invalid, Progressing True
    only while Running and rounds commit. ``pods``: the plan's reason and message."""
    c = list(existing)
    if spec_error is not None:
        c = conditions_patch(c, "SpecValid", False, Reason.INVALID_SPEC, spec_error)
        for kind in ("PodsReady", "Progressing", "Complete", "Failed"):
            c = conditions_patch(c, kind, False, Reason.INVALID_SPEC, "the spec is invalid")
        return c
    c = conditions_patch(c, "SpecValid", True, Reason.SPEC_VALID, "the spec is valid")
    reason, message = pods or (Reason.PODS_STARTING, "")
    obs = observation
    training: Condition | None = None if obs is None else obs.progressing
    if phase == Phase.SUCCEEDED.value:
        c = conditions_patch(c, "PodsReady", False, reason, message)
        c = conditions_patch(c, "Progressing", False, Reason.RUN_FINISHED, "every node finished")
        c = conditions_patch(c, "Complete", True, reason, message)
        c = conditions_patch(c, "Failed", False, Reason.RUN_FINISHED, "the run succeeded")
    elif phase == Phase.FAILED.value:
        c = conditions_patch(c, "PodsReady", False, reason, message)
        c = conditions_patch(c, "Progressing", False, Reason.RUN_FAILED, message)
        c = conditions_patch(c, "Complete", False, Reason.RUN_FAILED, message)
        c = conditions_patch(c, "Failed", True, reason, message)
    else:
        c = conditions_patch(c, "PodsReady", reason == Reason.PODS_READY, reason, message)
        if phase != Phase.RUNNING.value:
            c = conditions_patch(c, "Progressing", False, reason, "no node runs yet")
        elif training is not None:
            c = conditions_patch(c, "Progressing", *training)
        elif obs is not None and obs.reachable is None:  # mailbox status turned off
            c = conditions_patch(
                c, "Progressing", None, Reason.STATUS_DISABLED, "mailbox.pollStatus is false"
            )
        c = conditions_patch(c, "Complete", False, reason, message)
        c = conditions_patch(c, "Failed", False, reason, message)
    if obs is not None and obs.reachable is not None:
        c = conditions_patch(c, "MailboxReachable", *obs.reachable)
    if obs is not None and obs.synced is not None:
        c = conditions_patch(c, "SyncPointsContributed", *obs.synced)
    return c


def _pods_for_plan(state: RunState, pods: list[PodState], now: float) -> list[PodState]:
    """The indexed pods, with what this operator did that the watch has not shown yet: a
    pod it deleted reads as deleting (else a second pass would replace it twice and charge
    the budget twice), a pod it just created as Pending (else it would be created again)."""
    seen = {p.index for p in pods if p.uid not in state.deleted}
    state.deleted &= {p.uid for p in pods}
    result = [
        PodState(p.name, p.index, p.phase, deleting=True, uid=p.uid)
        if p.uid in state.deleted
        else p
        for p in pods
    ]
    for index, (name, at) in list(state.created.items()):
        if index in seen or now - at > PENDING_GRACE:
            del state.created[index]
        else:
            result.append(PodState(name, index, "Pending"))
    return result


def _backoff(status: Mapping[str, Any]) -> dict[int, NodeBackoff]:
    raw = status.get("backoff") or {}
    return {
        int(k): NodeBackoff.from_status(v)
        for k, v in raw.items()
        if str(k).isdigit() and isinstance(v, Mapping)
    }


async def reconcile_pass(
    *,
    state: RunState,
    body_status: Mapping[str, Any],
    generation: int | None,
    namespace: str,
    name: str,
    uid: str,
    spec: GradientMailRunSpec | None,
    spec_error: str | None,
    pods: list[PodState],
    kube: PodCalls,
    post: Post,
    policy: RestartBackoff,
    pod_labels: Mapping[str, str] | None = None,
    wall: Callable[[], float] = time.time,
) -> tuple[dict[str, Any], Plan | None]:
    """One pass; returns (the status fields to write, only those that changed; the plan)."""
    status = {**body_status, **state.written}
    phase_text = str(status.get("phase") or Phase.PENDING.value)
    desired: dict[str, Any] = {"observedGeneration": generation}
    conditions = list(status.get("conditions") or [])
    decision: Plan | None = None
    if spec is None or spec_error is not None:
        message = spec_error or "the spec is invalid"
        if phase_text not in (Phase.SUCCEEDED.value, Phase.FAILED.value):
            post_once(state, post, "Warning", Reason.INVALID_SPEC, message)
            desired["phase"] = INVALID
            desired["conditions"] = run_conditions(conditions, INVALID, None, None, message)
        return _changes(status, desired), None
    prefix = status.get("prefix") or render.run_prefix(namespace, name, uid)
    url = render.mailbox_url(spec, prefix)
    desired["prefix"], desired["mailbox"] = prefix, url  # no credentials in the URL
    phase = Phase(phase_text) if phase_text in {p.value for p in Phase} else Phase.PENDING
    obs = state.observation
    if phase.terminal:
        # Never touched again, but its last word comes from the mailbox (a final poll).
        if obs is not None:
            desired.update(obs.status)
            desired["conditions"] = run_conditions(
                conditions, phase.value, _terminal_reason(conditions, phase), obs
            )
        desired["statusFinal"] = state.final_observed
        return _changes(status, desired), None
    now = wall()
    decision = plan(
        spec,
        phase,
        int(status.get("restarts", 0)),
        _pods_for_plan(state, pods, now),
        backoff=_backoff(status),
        now=now,
        policy=policy,
    )
    by_name = {p.name: p for p in pods}
    for pod_name in decision.delete:
        await kube.delete_pod(namespace, pod_name)
        if pod_name in by_name:
            state.deleted.add(by_name[pod_name].uid)
    for index in decision.create:
        manifest = render.pod_manifest(
            spec,
            namespace=namespace,
            run=name,
            uid=uid,
            index=index,
            url=url,
            extra_labels=dict(pod_labels or {}),
        )
        await kube.create_pod(namespace, manifest)
        state.created[index] = (str(manifest["metadata"]["name"]), now)
    for event in decision.events:
        _post_event(state, post, event)
    desired["phase"] = decision.phase.value
    desired["restarts"] = decision.restarts
    desired["backoff"] = {str(i): r.to_status() for i, r in sorted(decision.backoff.items())}
    desired["nodes"] = {
        "desired": spec.nodes,
        "running": decision.ready,
        "succeeded": decision.succeeded,
        "failed": decision.failed,
    }
    if obs is not None:
        desired.update(obs.status)
        if obs.reachable is not None and not obs.reachable[0]:
            post_once(state, post, "Warning", obs.reachable[1], obs.reachable[2])
        for reason, message in obs.warnings:
            post("Warning", reason, message)
    desired["conditions"] = run_conditions(
        conditions, decision.phase.value, (decision.reason, decision.message), obs
    )
    if decision.phase.terminal:
        desired["statusFinal"] = state.final_observed
    return _changes(status, desired), decision


def _post_event(state: RunState, post: Post, event: Event) -> None:
    if event.reason in (Reason.POD_REPLACED, Reason.SCALED):
        post(event.type, event.reason, event.message)  # each is a new occurrence
    else:
        post_once(state, post, event.type, event.reason, event.message)


def _changes(status: Mapping[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``desired`` that differ from ``status`` (the caller records them in
    ``RunState.written`` once the write succeeded)."""
    return {k: v for k, v in desired.items() if status.get(k) != v}


def _terminal_reason(conditions: list[dict[str, Any]], phase: Phase) -> tuple[Reason, str]:
    kind = "Complete" if phase == Phase.SUCCEEDED else "Failed"
    known = {reason.value for reason in Reason}
    for condition in conditions:
        if condition.get("type") == kind and condition.get("reason") in known:
            return Reason(condition["reason"]), str(condition.get("message", ""))
    if phase == Phase.SUCCEEDED:
        return Reason.ALL_NODES_SUCCEEDED, "every node finished"
    return Reason.RESTART_BUDGET_EXHAUSTED, "the run failed"
