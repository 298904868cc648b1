"""One reconcile pass without a cluster: restart backoff, budget waves, writes only what
changed, warnings once per cause, and the table of phase × conditions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gradientmail.launch.runspec import GradientMailRunSpec
from gradientmail_operator.observer import Observation
from gradientmail_operator.reconcile import (
    NO_BACKOFF,
    NodeBackoff,
    Phase,
    PodState,
    Reason,
    RestartBackoff,
    plan,
)
from gradientmail_operator.runs import INVALID, RunState, reconcile_pass, run_conditions


def spec(**overrides: object) -> GradientMailRunSpec:
    raw: dict[str, object] = {
        "nodes": 3,
        "mailbox": {"endpoint": "http://minio:9000", "bucket": "runs"},
        "maxRestarts": 2,
    }
    raw.update(overrides)
    return GradientMailRunSpec.model_validate(raw)


def pods(*phases: str, uid: str = "u") -> list[PodState]:
    return [PodState(f"exp-node-{i}", i, phase, uid=f"{uid}{i}") for i, phase in enumerate(phases)]


class Calls:
    def __init__(self) -> None:
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.events: list[tuple[str, Reason, str]] = []

    async def create_pod(self, namespace: str, manifest: dict[str, Any]) -> bool:
        self.created.append(manifest["metadata"]["name"])
        return True

    async def delete_pod(self, namespace: str, name: str) -> None:
        self.deleted.append(name)

    def post(self, kind: str, reason: Reason, message: str) -> None:
        self.events.append((kind, reason, message))


class Run:
    """A run driven pass by pass, its status kept as the API server would."""

    def __init__(self, s: GradientMailRunSpec | None = None, error: str | None = None) -> None:
        self.spec, self.error = (s if s is not None or error else spec()), error
        self.state = RunState()
        self.status: dict[str, Any] = {}
        self.calls = Calls()
        self.writes: list[dict[str, Any]] = []
        self.now = 1000.0

    def step(self, current: list[PodState], policy: RestartBackoff = NO_BACKOFF) -> Any:
        changes, decision = asyncio.run(
            reconcile_pass(
                state=self.state,
                body_status=self.status,
                generation=1,
                namespace="team",
                name="exp",
                uid="uid-1",
                spec=self.spec,
                spec_error=self.error,
                pods=current,
                kube=self.calls,
                post=self.calls.post,
                policy=policy,
                wall=lambda: self.now,
            )
        )
        if changes:
            self.writes.append(changes)
            self.status.update(changes)
        return decision


def test_a_failed_node_waits_out_its_backoff_then_is_replaced_once() -> None:
    run = Run()
    policy = RestartBackoff(base=10, cap=40)
    run.step([])
    assert run.calls.created == ["exp-node-0", "exp-node-1", "exp-node-2"]
    failed = pods("Running", "Failed", "Running")
    first = run.step(failed, policy)
    assert run.calls.deleted == []  # kept (its logs readable) until the delay ends
    assert first.wake_in == pytest.approx(10)
    assert run.status["restarts"] == 0
    assert run.status["backoff"]["1"]["failures"] == 1
    assert any(c["reason"] == "BackingOff" for c in run.status["conditions"])
    run.now += 10
    run.step(failed, policy)
    assert run.calls.deleted == ["exp-node-1"]
    assert run.status["restarts"] == 1
    # The watch has not shown the deletion yet: a second pass neither deletes nor charges.
    run.step(failed, policy)
    assert run.calls.deleted == ["exp-node-1"]
    assert run.status["restarts"] == 1
    gone = [p for p in failed if p.index != 1]
    run.step(gone, policy)
    assert run.calls.created[-1] == "exp-node-1"
    # It fails again: the next delay doubles.
    again = [*gone, PodState("exp-node-1", 1, "Failed", uid="second")]
    second = run.step(again, policy)
    assert second.wake_in == pytest.approx(20)
    assert run.status["backoff"]["1"]["failures"] == 2


def test_nodes_failing_together_cost_one_restart() -> None:
    run = Run(spec(maxRestarts=1))
    run.step([])
    run.step(pods("Failed", "Failed", "Failed"), RestartBackoff(base=5, cap=5))
    run.now += 5
    run.step(pods("Failed", "Failed", "Failed"), RestartBackoff(base=5, cap=5))
    assert sorted(run.calls.deleted) == ["exp-node-0", "exp-node-1", "exp-node-2"]
    assert run.status["restarts"] == 1
    assert run.status["phase"] != Phase.FAILED.value
    replaced = [e for e in run.calls.events if e[1] == Reason.POD_REPLACED]
    assert len(replaced) == 1


def test_a_failure_with_the_budget_spent_fails_the_run_at_once() -> None:
    decision = plan(
        spec(maxRestarts=1),
        Phase.RUNNING,
        1,
        pods("Running", "Failed", "Running"),
        backoff={1: NodeBackoff(1, 9e9, "other")},
        now=0.0,
        policy=RestartBackoff(),
    )
    assert decision.phase == Phase.FAILED
    assert set(decision.delete) == {"exp-node-0", "exp-node-2"}


def test_only_changed_fields_are_written_and_a_quiet_pass_writes_nothing() -> None:
    run = Run()
    run.step([])
    running = pods("Running", "Running", "Running")
    run.step(running)
    assert run.status["phase"] == "Running"
    before = len(run.writes)
    run.step(running)
    run.step(running)
    assert len(run.writes) == before, run.writes[before:]
    run.state.observation = Observation(
        status={"roundsCommitted": 4},
        reachable=(True, Reason.MAILBOX_REACHABLE, "listing works"),
    )
    run.step(running)
    assert set(run.writes[-1]) == {"roundsCommitted", "conditions"}


def test_warnings_are_posted_once_per_cause() -> None:
    run = Run(error="spec.nodes: too small")
    for _ in range(3):
        run.step([])
    assert [e[1] for e in run.calls.events] == [Reason.INVALID_SPEC]
    assert run.status["phase"] == INVALID
    run.state.observation = Observation(
        reachable=(False, Reason.SECRET_MISSING, "Secret team/s does not exist")
    )
    run.spec, run.error = spec(), None
    for _ in range(3):
        run.step([])
    reasons = [e[1] for e in run.calls.events]
    assert reasons.count(Reason.SECRET_MISSING) == 1
    assert run.status["phase"] == Phase.PENDING.value  # a condition, not a phase
    reachable = [c for c in run.status["conditions"] if c["type"] == "MailboxReachable"]
    assert reachable[0]["reason"] == "SecretMissing"


def test_a_finished_run_gets_its_final_word_then_nothing() -> None:
    run = Run()
    run.step([])
    run.step(pods("Succeeded", "Succeeded", "Succeeded"))
    assert run.status["phase"] == "Succeeded"
    assert run.status["statusFinal"] is False
    run.state.observation = Observation(
        status={"roundsCommitted": 25, "newestRound": 27},
        reachable=(True, Reason.MAILBOX_REACHABLE, "listing works"),
    )
    run.state.final_observed = True
    run.step([])
    assert (run.status["roundsCommitted"], run.status["statusFinal"]) == (25, True)
    complete = next(c for c in run.status["conditions"] if c["type"] == "Complete")
    assert (complete["status"], complete["reason"]) == ("True", "AllNodesSucceeded")
    count = len(run.writes)
    run.step([])
    assert len(run.writes) == count
    assert run.calls.created == ["exp-node-0", "exp-node-1", "exp-node-2"]


def _by_type(conditions: list[dict[str, Any]]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in conditions}


TRAINING = Observation(
    reachable=(True, Reason.MAILBOX_REACHABLE, "ok"),
    progressing=(True, Reason.TRAINING, "3 rounds"),
)


@pytest.mark.parametrize(
    ("phase", "pods_reason", "expected"),
    [
        (
            "Pending",
            Reason.PODS_STARTING,
            {"SpecValid": "True", "PodsReady": "False", "Progressing": "False"},
        ),
        (
            "Running",
            Reason.PODS_READY,
            {"SpecValid": "True", "PodsReady": "True", "Progressing": "True"},
        ),
        (
            "Running",
            Reason.BACKING_OFF,
            {"PodsReady": "False", "Progressing": "True", "Failed": "False"},
        ),
        (
            "Succeeded",
            Reason.ALL_NODES_SUCCEEDED,
            {"PodsReady": "False", "Progressing": "False", "Complete": "True", "Failed": "False"},
        ),
        (
            "Failed",
            Reason.RESTART_BUDGET_EXHAUSTED,
            {"PodsReady": "False", "Progressing": "False", "Complete": "False", "Failed": "True"},
        ),
    ],
)
def test_conditions_agree_with_the_phase(
    phase: str, pods_reason: Reason, expected: dict[str, str]
) -> None:
    # From a run that was training: nothing of an earlier phase may linger.
    earlier = run_conditions([], "Running", (Reason.PODS_READY, "3 running"), TRAINING)
    got = _by_type(run_conditions(earlier, phase, (pods_reason, "m"), TRAINING))
    assert {k: got[k] for k in expected} == expected
    assert (got["Complete"] == "True") == (phase == "Succeeded")
    assert (got["Failed"] == "True") == (phase == "Failed")
    assert got["SpecValid"] == "True"
    assert got["MailboxReachable"] == "True"


def test_an_invalid_spec_sets_every_condition_false() -> None:
    got = run_conditions([], INVALID, None, None, "spec.nodes: too small")
    assert set(_by_type(got).values()) == {"False"}
    spec_valid = next(c for c in got if c["type"] == "SpecValid")
    assert spec_valid["reason"] == "InvalidSpec"


def test_a_file_mailbox_without_a_shared_claim_is_an_invalid_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradientmail_operator import handlers

    body = {"spec": {"nodes": 2, "mailbox": {"url": "file:///data/box"}}}
    monkeypatch.setattr(handlers, "SHARED_FILES", False)
    s, error = handlers._spec(body)  # type: ignore[arg-type]
    assert s is None
    assert error is not None
    assert "persistentVolumeClaim" in error or "ReadWriteMany" in error, error
    # A single-node cluster whose pods share a filesystem says so to the operator.
    monkeypatch.setattr(handlers, "SHARED_FILES", True)
    s, error = handlers._spec(body)  # type: ignore[arg-type]
    assert (s is not None, error) == (True, None)
