"""Small training loops for in-process Session tests (threads, one per learner)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import gradientmail as gm
from gradientmail import wire as p
from tests.support.waiting import TEST_TIMEOUT

# Session options under which learners that start together train in lockstep: every round
# waits for every live learner (round_timeout), and a live learner is never judged gone
# (lease_timeout), whatever the delays on a loaded machine; both are bounds that only a
# failure reaches (a round that waits the whole round_timeout fails the test's waits).
LOCKSTEP: dict[str, Any] = {"round_timeout": TEST_TIMEOUT, "lease_timeout": TEST_TIMEOUT}


def make_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


@dataclass
class Learner:
    name: str
    steps: int
    seed: int = 0
    delay: float = 0.01
    session: gm.Session | None = None
    error: BaseException | None = None
    joined_rounds: tuple[int, ...] = ()
    model: torch.nn.Module = field(default_factory=make_model)


def train(
    learner: Learner,
    mailbox: gm.Mailbox,
    algorithm: gm.DiLoCo,
    started: threading.Event | None = None,
    start: threading.Barrier | None = None,
    **options: Any,
) -> None:
    """Join, train ``learner.steps`` steps of a tiny regression, close. With ``start``, the
    training begins once every learner of the barrier has joined."""
    options.setdefault("poll_interval", 0.05)
    options.setdefault("round_timeout", 1.0)
    options.setdefault("lease_timeout", 3.0)
    options.setdefault("keep_rounds", 10_000)  # keep everything so each commit can be verified
    generator = torch.Generator().manual_seed(1000 + learner.seed)
    try:
        optimizer = torch.optim.SGD(learner.model.parameters(), lr=0.05)
        with gm.Session(
            learner.model,
            algorithm=algorithm,
            mailbox=mailbox,
            learner_id=learner.name,
            **options,
        ) as session:
            learner.session = session
            learner.joined_rounds = session.rounds
            if started is not None:
                started.set()
            if start is not None:
                start.wait(timeout=TEST_TIMEOUT)
            for _ in range(learner.steps):
                x = torch.randn(16, 8, generator=generator)
                y = x.sum(dim=1, keepdim=True)
                loss = ((learner.model(x) - y) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                session.step(samples=16)
                time.sleep(learner.delay)
    except BaseException as exc:
        learner.error = exc
        if started is not None:
            started.set()
        if start is not None:
            start.abort()  # the others stop waiting for this learner


def run_learners(
    learners: list[Learner],
    mailbox: gm.Mailbox,
    algorithm: gm.DiLoCo,
    *,
    together: bool = False,
    **options: Any,
) -> None:
    """Train each learner on a thread of its own; ``together``: all start training once
    every one has joined (a start barrier)."""
    if together:
        options["start"] = threading.Barrier(len(learners))
    threads = [
        threading.Thread(target=train, args=(learner, mailbox, algorithm), kwargs=options)
        for learner in learners
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a learner thread is stuck"
    for learner in learners:
        assert learner.error is None, f"{learner.name} failed: {learner.error!r}"


def commits(mailbox: gm.Mailbox) -> list[p.Commit]:
    async def read() -> list[p.Commit]:
        keys = await mailbox.list(p.ROUNDS)
        return [p.decode_commit(key, await mailbox.get(key)) for key in keys]

    return asyncio.run(read())


def verify_all(mailbox: gm.Mailbox) -> list[gm.verify.Verified]:
    async def run() -> list[gm.verify.Verified]:
        keys = await mailbox.list(p.ROUNDS)
        return [await gm.verify.verify_commit(mailbox, p.parse_round_key(k)) for k in keys]

    return asyncio.run(run())


def failures(learner: Learner, kinds: tuple[type, ...] = ()) -> list[Any]:
    assert learner.session is not None
    wanted = kinds or (gm.events.PollFailed, gm.events.PublishFailed, gm.events.RoundFailed)
    return [e for e in learner.session.events if isinstance(e, wanted)]


def sync_points(algorithm: gm.DiLoCo, steps: int) -> dict[int, int]:
    """Fragment -> the sync points a learner of ``steps`` steps reaches on the plain schedule
    (phase 0): one per due step, and one at close() for a fragment with steps after its
    last one."""
    due: dict[int, list[int]] = {f: [] for f in range(algorithm.fragments)}
    for step in range(1, steps + 1):
        fragment = algorithm.due_fragment(step)
        if fragment is not None:
            due[fragment].append(step)
    return {f: len(at) + (max(at, default=0) < steps) for f, at in due.items()}


def wait_rounds(mailbox: gm.Mailbox, count: int, wait: Callable[..., Any]) -> None:
    wait(lambda: len(commits(mailbox)) >= count, f"{count} commits")
