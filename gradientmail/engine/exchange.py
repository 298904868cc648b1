"""How a learner's contributions are exchanged: the :class:`Exchange` protocol a Session's
communication thread drives, and the records it hands back and forth.

A Session holds ONE exchange, chosen once from its algorithm (``engine/exchanges.py``):
run-wide rounds (``exchange_rounds.py``: one closer combines every learner's contribution,
a syncer thread fetches the commits of rounds this learner did not close) or Moshpit groups
(``exchange_groups.py``: each group closed by one of its members, no syncer). Per
contribution, the communication thread calls :meth:`Exchange.publish` once and then
:meth:`Exchange.close` on every tick until the contribution's commit is staged; a syncer
thread, where :attr:`Exchange.syncer` says there is one, calls :meth:`Exchange.poll`.

The exchange reaches the learner only through its :class:`Host`: the state the Session's
threads share (``session/_state.py``), with ONE staging path (:meth:`Host.stage`) for every
commit, whoever found it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.coord.leases import LeaseTracker
from gradientmail.engine.layout import ModelLayout
from gradientmail.events import Event
from gradientmail.mailbox import Mailbox
from gradientmail.payload.buffers import BufferPool

__all__ = ["Exchange", "ExchangeContext", "Host", "Offer", "Pending", "Placed", "mine_of"]

Tensors = dict[str, torch.Tensor]
Counter = Literal["closed", "computed", "missed_groups"]


@dataclass(eq=False)
class Pending:
    """A contribution handed from the training thread to the communication thread:
    fragment copy, samples, round (the hand-off; fields change under the Host's lock)."""

    round: int
    fragment: int
    base: int
    snapshot: Tensors
    base_params: Tensors
    samples: int
    step: int  # the local step at which it was handed over
    handed_at: float = field(default_factory=time.monotonic)  # when (the sync point)
    # Training thread only: a wait for its commit gave up; the next wait for it is at the
    # fragment's next sync point, not at every step until then.
    gave_up: bool = False
    payload: str | None = None
    published_at: float | None = None
    cancelled: bool = False
    # A compressing algorithm's (algorithms/contribution.py), set when it is published: the
    # payload's tensors (a closer sums its own from these), and the error feedback this
    # learner keeps once the contribution is in a commit.
    compressed: Tensors | None = None
    residual: Tensors | None = None
    group: str | None = None  # Moshpit: the group it was published to (round: its round)
    # Set by the communication thread when nobody can make its round (a RoundImpossible):
    # the training thread raises it from step(), sync() or close().
    failure: Exception | None = None


@dataclass(frozen=True)
class Offer:
    """What :meth:`Exchange.publish` stores: a :class:`Pending`'s fields, read under the
    lock before the upload (applying its round meanwhile lets go of the pending's
    tensors), and the fragment's error feedback for a compressing algorithm."""

    round: int
    fragment: int
    base: int
    samples: int
    snapshot: Tensors
    base_params: Tensors
    residual: Tensors | None


@dataclass(frozen=True)
class Placed:
    """Where :meth:`Exchange.publish` put a contribution: its round (and group), payload
    key and size, and what a compressing algorithm encoded."""

    round: int
    payload: str
    nbytes: int
    group: str | None = None
    compressed: Tensors | None = None
    residual: Tensors | None = None


@dataclass(frozen=True)
class ExchangeContext:
    """What an exchange is built from: the learner it serves, its mailbox, model layout,
    algorithm and lease tracker, the pool commit parameters come from, and the Session's
    settings (validated by the Session)."""

    host: Host
    box: Mailbox
    layout: ModelLayout
    algorithm: Algorithm
    tracker: LeaseTracker
    global_pool: BufferPool
    quorum_size: int
    round_timeout: float
    claim_timeout: float
    keep_rounds: int


class Host(Protocol):
    """What an exchange needs of the learner it serves (the state its threads share)."""

    @property
    def learner_id(self) -> str: ...

    @property
    def stop(self) -> threading.Event: ...

    @property
    def lock(self) -> threading.Lock: ...

    @property
    def inflight(self) -> dict[int, Pending]: ...

    @property
    def known(self) -> list[int]: ...

    @property
    def ref(self) -> list[Tensors]: ...

    def emit(self, event: Event) -> None:
        """Record and report ``event`` (any thread)."""

    def count(self, counter: Counter) -> None:
        """Add one to ``counter`` of the learner's counters."""

    def stage(
        self, commit: p.Commit, params: Tensors, mine: frozenset[tuple[int, str]] | None = None
    ) -> bool:
        """Hand a verified commit to the training thread; False when it is not newer than
        what is already known for its fragment. ``mine``: the (round, payload) of this
        learner's contributions it holds (default: read from ``commit``)."""

    def wake_syncer(self) -> None:
        """A record was written or a contribution published: the syncer looks now."""


class Exchange(Protocol):
    """One way of exchanging a round (module docstring)."""

    @property
    def syncer(self) -> bool:
        """Whether other learners' commits come through a syncer thread (:meth:`poll`); an
        exchange without one finds its commits in :meth:`close`."""

    async def joined(self, rounds: dict[int, int], tensors: dict[int, Tensors]) -> None:
        """At join, after the newest commits were read: take this learner's place and
        change, in place, what it starts from (``{fragment: round}``, parameters)."""

    async def publish(self, offer: Offer) -> Placed:
        """Store one contribution. Raises on failure; the caller reports it."""

    async def close(self, pending: Pending) -> None:
        """One look at the published ``pending``'s round: close it when this learner may,
        stage its commit when there is one. Failures are reported, never raised (but
        :class:`~gradientmail.coord.retry.Stopped`); a round nobody can make
        (:class:`~gradientmail.errors.RoundImpossible`) is set as ``pending.failure``, for
        the training thread to raise."""

    async def poll(self) -> None:
        """The syncer's look for new commits (only where :attr:`syncer`)."""


def mine_of(commits: Iterable[p.Commit], learner: str) -> frozenset[tuple[int, str]]:
    """The (round, payload) of ``learner``'s contributions in ``commits``."""
    return frozenset(
        (c.round, x.payload) for c in commits for x in c.contributors if x.learner == learner
    )
