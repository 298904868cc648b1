"""Reconcile decisions: from the run's spec, status and pods to a plan. Pure, no I/O.

Level-triggered: the plan depends only on what exists now, so running it twice, or after
an operator restart, does the same thing. A run in a terminal phase (Succeeded, Failed)
is never touched again.
"""

from __future__ import annotations

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
    """Condition and event reasons a user can look up in the README's troubleshooting."""

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


@dataclass(frozen=True)
class PodState:
    name: str
    index: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    deleting: bool = False


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


def plan(
    spec: GradientMailRunSpec,
    phase: Phase,
    restarts: int,
    pods: list[PodState],
) -> Plan:
    if phase.terminal:
        return Plan(phase=phase, restarts=restarts, message="terminal: nothing to do")
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
    budget = spec.max_restarts - restarts
    if len(failed) > budget:
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
                    f"{names} failed with {budget} of maxRestarts={spec.max_restarts} left; "
                    "the run is Failed",
                ),
            ),
            failed=len(failed),
            reason=Reason.RESTART_BUDGET_EXHAUSTED,
            message=f"nodes failed: {names}",
        )
    for index in failed:
        # Replace: delete now, create on the next pass once it is gone. The new pod keeps
        # the learner id, so the node rejoins the run where it left it.
        delete.append(by_index.pop(index).name)
        restarts += 1
        events.append(
            Event(
                "Warning",
                Reason.POD_REPLACED,
                f"node {index} failed; replacing it ({restarts} of {spec.max_restarts} "
                "restarts used)",
            )
        )
    create = tuple(
        i for i in range(spec.nodes) if i not in by_index and i not in deleting and i not in failed
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
        )
    all_up = not create and running + succeeded == spec.nodes
    return Plan(
        phase=Phase.RUNNING if running else Phase.PENDING,
        create=create,
        delete=tuple(delete),
        restarts=restarts,
        events=tuple(events),
        ready=running,
        succeeded=succeeded,
        reason=Reason.PODS_READY if all_up else Reason.PODS_STARTING,
        message=f"{running} running, {succeeded} succeeded of {spec.nodes}",
    )
