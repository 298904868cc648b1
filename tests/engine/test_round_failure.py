"""A round that nobody can make ends in a recorded failure every learner raises, never in a
claim given up and retaken for ever (``engine/failures.py``).

The fault is injected in the run's data, as the bfloat16 wedge of issue 26 was: an
algorithm that reads the outer momentum back in the parameters' dtype (the wedge's own
bug, ``state_specs`` in the model's dtypes) while it is stored in float32. Every closer's
payload check then fails with the same ``ProtocolError`` on every try.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.engine.failures import FaultCount, is_data_fault
from gradientmail.errors import MailboxUnavailable, ObjectMissing, RoundImpossible
from tests.support.waiting import TEST_TIMEOUT

STEPS = 40  # sync points enough for today's wait-and-give-up to outlast the test's bound
WAIT = 2.0  # each learner's wait_timeout: a wedged round costs this much per sync point


@dataclass(frozen=True)
class _MomentumInModelDtypes(gm.DiLoCo):
    """DiLoCo that reads its momentum back in the parameters' dtypes (the wedge's bug)."""

    def state_specs(self, specs: Sequence[p.TensorSpec]) -> tuple[p.TensorSpec, ...]:
        return tuple(specs)


ALGORITHM = _MomentumInModelDtypes(sync_every=2, fragments=1)


def _learner(
    name: str, box: gm.Mailbox, start: threading.Barrier, outcome: dict[str, object]
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = gm.Session(
        model,
        algorithm=ALGORITHM,
        mailbox=box,
        learner_id=name,
        poll_interval=0.02,
        round_timeout=60.0,
        wait_timeout=WAIT,
        claim_timeout=3.0,
    )
    try:
        start.wait(timeout=TEST_TIMEOUT)
        for step in range(STEPS):
            loss = model(torch.ones(8, 4, dtype=torch.bfloat16)).float().pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(samples=8)
            outcome[name] = step + 1
    except RoundImpossible as exc:
        outcome[name] = exc
        outcome[name + "_at"] = time.monotonic()
        session.__exit__(type(exc), exc, None)  # leave without contributing (as `with` does)
        return
    session.close()


def test_a_round_impossible_for_everyone_is_raised_from_every_learners_step() -> None:
    box = gm.MemoryMailbox()
    outcome: dict[str, object] = {}
    start = threading.Barrier(2)
    # Daemons: on a release that retries for ever, they would outlive the failed test.
    threads = [
        threading.Thread(target=_learner, args=(name, box, start, outcome), daemon=True)
        for name in "ab"
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    bound = started + TEST_TIMEOUT
    for thread in threads:
        thread.join(timeout=max(0.0, bound - time.monotonic()))
    # Before: the closers gave the claim up and retook it for ever, and each learner waited
    # out wait_timeout at every sync point, STEPS / 2 of them: no error, well past the bound.
    assert not any(t.is_alive() for t in threads), f"no learner raised in time: {outcome}"
    for name in "ab":
        error = outcome.get(name)
        assert isinstance(error, RoundImpossible), (name, error)
        message = str(error)
        assert "round 2 cannot be made by any learner" in message, message
        assert "the manifest says torch.bfloat16" in message, message  # the reason, by name
    # One record says why, once, beside the round's claims; no commit was made of round 2.
    failure = p.decode_failure(p.failure_key(2), asyncio.run(box.get(p.failure_key(2))))
    assert failure.round == 2, failure
    assert "torch.float32" in failure.reason, failure
    assert asyncio.run(box.get(p.round_key(2))) is None
    claims = [k for k in asyncio.run(box.list(p.claims_prefix(2))) if p.claim_round(k) == 2]
    assert len(claims) == 1, claims  # recorded by the first claim's holder, never retaken


def test_only_the_same_data_fault_in_a_row_counts() -> None:
    count = FaultCount()
    bad = gm.ProtocolError("blobs/x: w is torch.float32[2], the manifest says torch.bfloat16[2]")
    assert count.add(0, bad) == 1
    assert count.add(0, bad) == 2
    # The store's faults, and a payload swept meanwhile, are retried: the count restarts.
    assert not is_data_fault(MailboxUnavailable("timed out"))
    assert not is_data_fault(ObjectMissing("blobs/x: the payload is missing"))
    assert count.add(0, MailboxUnavailable("timed out")) == 0
    assert count.add(0, bad) == 1
    assert count.add(0, gm.ProtocolError("another reason")) == 1
    assert count.add(1, gm.ProtocolError("another reason")) == 1  # another claim attempt
    assert is_data_fault(ValueError("shapes differ"))
    assert not is_data_fault(MemoryError())


@pytest.mark.parametrize("wire", ['{"format":1,"round":2}', "not json"])
def test_a_malformed_failure_record_is_a_protocol_error_naming_it(wire: str) -> None:
    with pytest.raises(gm.ProtocolError, match=r"claims/0000000002/failed"):
        p.decode_failure(p.failure_key(2), wire.encode())
