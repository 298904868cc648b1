"""Reconcile decisions: from the run's spec, status and pods to a plan. Pure, no I/O.

Level-triggered: the plan depends only on what exists now (and the backoff state the run's
status keeps), so running it twice, or after an operator restart, does the same thing. A
run in a terminal phase (Succeeded, Failed) is never touched again.

Restarts back off per node: a failed pod is kept (its logs readable) and replaced only once
its node's delay has passed, ``base · 2^(failures − 1)`` capped at ``cap``. The run-wide
budget (``maxRestarts``) is charged once per replacement *wave*: nodes whose delays end
together (all of them failing on one unreachable endpoint, say) cost one restart, so one
outage cannot burn the whole budget in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gradientmail.launch.runspec import GradientMailRunSpec


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class Reason(StrEnum):
    """Condition and event reasons a user can look up in docs/operator.md's troubleshooting."""

    PODS_READY = "PodsReady"
    PODS_STARTING = "PodsStarting"
    POD_REPLACED = "PodReplaced"
    RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
    ALL_NODES_SUCCEEDED = "AllNodesSucceeded"
    SCALED = "Scaled"
    INVALID_SPEC = "InvalidSpec"
    SECRET_MISSING = "SecretMissing"
    MAILBOX_REACHABLE = "MailboxReachable"
    MAILBOX_UNREACHABLE = "MailboxUnreachable"
    MAILBOX_MISCONFIGURED = "MailboxMisconfigured"
    TRAINING = "Training"
    WAITING_FOR_ROUNDS = "WaitingForRounds"
    ALL_SYNC_POINTS_CONTRIBUTED = "AllSyncPointsContributed"
    SYNC_POINTS_SKIPPED = "SyncPointsSkipped"
    WAITING_AT_SYNC_POINTS = "WaitingAtSyncPoints"
    SPEC_VALID = "SpecValid"
    BACKING_OFF = "BackingOff"
    RUN_FINISHED = "RunFinished"
    RUN_FAILED = "RunFailed"
    STATUS_DISABLED = "StatusDisabled"
    POLL_TIMED_OUT = "PollTimedOut"


@dataclass(frozen=True)
class PodState:
    name: str
    index: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    deleting: bool = False
    uid: str = ""


@dataclass(frozen=True)
class RestartBackoff:
    """Delay before a failed node's pod is replaced: ``base · 2^(failures − 1)``, capped."""

    base: float = 10.0
    cap: float = 300.0

    def delay(self, failures: int) -> float:
        if failures <= 0 or self.base <= 0:
            return 0.0
        return float(min(self.cap, self.base * 2 ** min(failures - 1, 30)))


NO_BACKOFF = RestartBackoff(base=0.0, cap=0.0)


@dataclass(frozen=True)
class NodeBackoff:
    """One node's failures so far, and when its failed pod ``pod_uid`` may be replaced
    (wall-clock seconds: the status keeps it across operator restarts)."""

    failures: int
    retry_at: float
    pod_uid: str

    def to_status(self) -> dict[str, object]:
        return {"failures": self.failures, "retryAt": round(self.retry_at, 3), "pod": self.pod_uid}

    @classmethod
    def from_status(cls, raw: Mapping[str, object]) -> NodeBackoff:
        failures, retry_at = raw.get("failures", 0), raw.get("retryAt", 0.0)
        return cls(
            failures=int(failures) if isinstance(failures, int | float) else 0,
            retry_at=float(retry_at) if isinstance(retry_at, int | float) else 0.0,
            pod_uid=str(raw.get("pod", "")),
        )


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: Reason
    message: str


@dataclass(frozen=True)
class Plan:
    phase: Phase
    create: tuple[int, ...] = ()
    delete: tuple[str, ...] = ()
    restarts: int = 0
    events: tuple[Event, ...] = ()
    ready: int = 0
    succeeded: int = 0
    failed: int = 0
    message: str = ""
    reason: Reason = Reason.PODS_STARTING
    notes: tuple[str, ...] = field(default=())
    backoff: Mapping[int, NodeBackoff] = field(default_factory=dict)
    wake_in: float | None = None  # seconds until a backoff ends: reconcile again then


def plan(
    spec: GradientMailRunSpec,
    phase: Phase,
    restarts: int,
    pods: list[PodState],
    *,
    backoff: Mapping[int, NodeBackoff] | None = None,
    now: float = 0.0,
    policy: RestartBackoff = NO_BACKOFF,
) -> Plan:
    """What to do now. ``backoff``: each node's failure record from the status; ``now``:
    wall-clock seconds; ``policy``: the delays (the operator passes its configured one)."""
    if phase.terminal:
        return Plan(
            phase=phase,
            restarts=restarts,
            message="terminal: nothing to do",
            backoff=dict(backoff or {}),
        )
    records = dict(backoff or {})
    by_index: dict[int, PodState] = {}
    delete: list[str] = []
    events: list[Event] = []
    for pod in pods:
        if pod.deleting:
            continue
        if pod.index >= spec.nodes or pod.index in by_index:
            delete.append(pod.name)  # scaled down (or a stray duplicate)
            events.append(
                Event("Normal", Reason.SCALED, f"deleting {pod.name}: nodes={spec.nodes}")
            )
            continue
        by_index[pod.index] = pod
    deleting = {pod.index for pod in pods if pod.deleting}
    failed = sorted(i for i, pod in by_index.items() if pod.phase == "Failed")
    for index in failed:
        # A failure not seen before (a new pod uid) starts this node's next delay.
        pod, record = by_index[index], records.get(index)
        if record is None or record.pod_uid != pod.uid:
            failures = (record.failures if record else 0) + 1
            records[index] = NodeBackoff(failures, now + policy.delay(failures), pod.uid)
    due = [i for i in failed if records[i].retry_at <= now]
    if failed and restarts >= spec.max_restarts:
        names = ", ".join(by_index[i].name for i in failed)
        live = [p.name for p in by_index.values() if p.phase in ("Pending", "Running")]
        return Plan(
            phase=Phase.FAILED,
            delete=tuple(delete + live),
            restarts=restarts,
            events=(
                *events,
                Event(
                    "Warning",
                    Reason.RESTART_BUDGET_EXHAUSTED,
                    f"{names} failed with all {spec.max_restarts} restarts (maxRestarts) "
                    "used; the run is Failed",
                ),
            ),
            failed=len(failed),
            reason=Reason.RESTART_BUDGET_EXHAUSTED,
            message=f"nodes failed: {names}",
            backoff=records,
        )
    if due:
        # One wave: every node whose delay has ended is replaced now, for one restart.
        # Delete now, create on the next pass once the old pod is gone. The new pod keeps
        # the learner id, so the node rejoins the run where it left it.
        restarts += 1
        for index in due:
            delete.append(by_index.pop(index).name)
        events.append(
            Event(
                "Warning",
                Reason.POD_REPLACED,
                f"node(s) {', '.join(map(str, due))} failed; replacing them ({restarts} of "
                f"{spec.max_restarts} restarts used)",
            )
        )
    waiting = [i for i in failed if i not in due]
    wake_in = min((records[i].retry_at - now for i in waiting), default=None)
    create = tuple(
        i for i in range(spec.nodes) if i not in by_index and i not in deleting and i not in due
    )
    succeeded = sum(1 for p in by_index.values() if p.phase == "Succeeded")
    running = sum(1 for p in by_index.values() if p.phase == "Running")
    if succeeded == spec.nodes:
        return Plan(
            phase=Phase.SUCCEEDED,
            delete=tuple(delete),
            restarts=restarts,
            events=(*events, Event("Normal", Reason.ALL_NODES_SUCCEEDED, "every node finished")),
            succeeded=succeeded,
            reason=Reason.ALL_NODES_SUCCEEDED,
            message=f"all {spec.nodes} nodes succeeded",
            backoff=records,
        )
    all_up = not create and running + succeeded == spec.nodes
    reason = Reason.PODS_READY if all_up else Reason.PODS_STARTING
    message = f"{running} running, {succeeded} succeeded of {spec.nodes}"
    if waiting and wake_in is not None:
        reason = Reason.BACKING_OFF
        message += (
            f"; node(s) {', '.join(map(str, waiting))} failed, replaced in {wake_in:.0f} s "
            "(restarts back off)"
        )
    return Plan(
        phase=Phase.RUNNING if running else Phase.PENDING,
        create=create,
        delete=tuple(delete),
        restarts=restarts,
        events=tuple(events),
        ready=running,
        succeeded=succeeded,
        failed=len(waiting),
        reason=reason,
        message=message,
        backoff=records,
        wake_in=wake_in,
    )
