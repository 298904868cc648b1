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
    **options: Any,
) -> None:
    """Join, train ``learner.steps`` steps of a tiny regression, close."""
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


def run_learners(
    learners: list[Learner], mailbox: gm.Mailbox, algorithm: gm.DiLoCo, **options: Any
) -> None:
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


def wait_rounds(mailbox: gm.Mailbox, count: int, wait: Callable[..., Any]) -> None:
    wait(lambda: len(commits(mailbox)) >= count, f"{count} commits")
