"""Joining a run: creator election with failover, the manifest, initial commits, loading.

Shared by :class:`Session` (which joins) and :func:`align` (which only loads).

Creating a run takes three create-once steps:

1. claim the creator role: ``claims/creator`` is attempt 0, ``claims/creator-{n:04d}``
   attempt ``n`` (a sibling key, never a child: ``claims/creator`` cannot be a directory);
2. the claim's holder writes ``manifest.json``;
3. the manifest's writer stores its parameters and writes the initial commits
   ``rounds/0 .. P-1``.

A creator can die between any two of them; whoever joins next finishes the work, so a dead
creator costs about one ``lease_timeout``:

- **Claim, no manifest.** The holder writes the manifest one request after winning its
  claim, so a claim that has stood for a whole ``lease_timeout`` on the joiner's own
  monotonic clock, with no live beat of the holder under ``leases/{holder}/`` (the
  :class:`LeaseTracker` rules), is abandoned: the joiner claims the next attempt. A
  restarted holder (the same learner id) resumes its own claim at once.
- **Manifest, initial commits missing.** The manifest's writer, restarted or not, writes
  them at once. Any other joiner whose model matches the manifest writes the missing ones
  from its own parameters once nothing has moved for a whole ``lease_timeout``: no new
  initial commit, no new object under ``blobs/`` (a large upload stores a part every 16 MiB,
  so a creator that is still uploading keeps moving) and no live beat of the writer.

Judging an alive creator dead is harmless, only wasteful. Every step is create-once: two
claimants race for the one manifest and the loser reads it (and checks its model against
it); two writers race per fragment for ``rounds/{f}`` and everyone loads the winner. Each
initial commit is one writer's whole fragment, recorded before anyone can join, so every
node still starts from identical values; only the mix may come from two nodes' inits
(fragment 0 from one, fragment 1 from another), which is itself a valid init when the
model's parameters are initialised independently (or identically, e.g. from a checkpoint).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.coord.claims import HOLD, NEXT, WAIT, ClaimSeries, Verdict, judged
from gradientmail.coord.leases import DEFAULT_LEASE_TIMEOUT, LeaseTracker
from gradientmail.coord.retry import retrying
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, put_tensors

__all__ = ["LEASE_TIMEOUT", "establish"]

T = TypeVar("T")

_log = logging.getLogger("gradientmail")
_POLL = 0.2
LEASE_TIMEOUT = DEFAULT_LEASE_TIMEOUT
"""How long a creator may show no sign of life before a joiner takes over (Session's default
``lease_timeout``)."""


def _is_creator_key(key: str) -> bool:
    try:
        p.parse_creator_attempt(key)
    except ProtocolError:
        return False  # someone else's object under the same prefix: not a claim
    return True


class _Quiet:
    """How long an observed state has stood unchanged, on the observer's clock."""

    def __init__(self) -> None:
        self._state: object = None
        self._since = 0.0

    def unchanged_for(self, state: object, now: float) -> float:
        if state != self._state:
            self._state, self._since = state, now
        return now - self._since


class _Joiner:
    """One establish() call: a loop that reads the run's state and does the next step."""

    def __init__(
        self,
        box: Mailbox,
        layout: ModelLayout,
        mine: p.Manifest,
        timeout: float,
        lease_timeout: float,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        poll: float,
    ) -> None:
        self.box = box
        self.layout = layout
        self.learner = learner = mine.creator
        self.mine = mine  # the manifest this node would write, naming it as the creator
        self.clock = clock
        self.sleep = sleep
        self.poll = poll
        self.deadline = clock() + timeout
        self.tracker = LeaseTracker(lease_timeout, clock)
        self.quiet = _Quiet()
        # Judging someone else's liveness lists claims, leases and blobs: every tenth of a
        # lease is enough (a joiner waiting on a long upload costs one GET per poll).
        self.look_every = max(poll, lease_timeout / 10)
        self.next_look = float("-inf")
        # The creator claims: claims/creator, then claims/creator-NNNN (read once each).
        self.claims = ClaimSeries(
            box,
            learner,
            p.creator_key,
            record=p.encode(p.CreatorClaim(learner)),
            holder_of=self.holder,
            what="the run's creator",
            clock=clock,
            call=self.call,
        )
        self.present: set[int] = set()  # initial commits known to exist
        self.waiting_for = "the run's manifest"

    async def call(self, operation: Callable[[], Awaitable[T]]) -> T:
        return await retrying(operation, deadline=self.deadline, clock=self.clock, sleep=self.sleep)

    async def run(self) -> tuple[p.Manifest, bool]:
        manifest: p.Manifest | None = None
        while True:
            moved = False
            if manifest is None:
                data = await self.call(partial(self.box.get, p.MANIFEST))
                if data is not None:
                    manifest = self.check(p.decode_manifest(p.MANIFEST, data))
                else:
                    moved = await self.elect()
            if manifest is not None:
                if await self.initial_commits_exist(manifest):
                    if manifest.frozen_payload is not None:  # the run's, not this node's
                        frozen = await self.call(
                            partial(get_tensors, self.box, manifest.frozen_payload, manifest.frozen)
                        )
                        self.layout.load_frozen(frozen)
                    return manifest, manifest.creator == self.learner
                moved = await self.finish(manifest)
            if moved:
                continue  # this node just wrote something: take the next step at once
            if self.clock() > self.deadline:
                raise TimeoutError(f"waiting for {self.waiting_for}: it did not appear in time")
            await self.sleep(self.poll)

    def check(self, manifest: p.Manifest) -> p.Manifest:
        differences = manifest.differences(self.mine)
        if differences:
            raise ProtocolError(
                f"this node does not match the run (created by {manifest.creator}): "
                + "; ".join(differences)
            )
        return manifest

    # -- the creator claim -------------------------------------------------------------------

    async def holder(self, key: str) -> str:
        data = await self.call(partial(self.box.get, key))
        if data is None:
            raise ProtocolError(
                f"{key}: put_if_absent reported it exists (or list listed it) but it reads "
                "as missing; the store is not read-after-write consistent"
            )
        return p.decode_creator(key, data).learner

    def due(self) -> bool:
        """Whether it is time to look at others' progress again (see ``look_every``)."""
        now = self.clock()
        if now < self.next_look:
            return False
        self.next_look = now + self.look_every
        return True

    async def gone(self, learner: str, held: float) -> bool:
        """Whether ``learner`` showed no sign of life for a whole lease period: what it is
        expected to change stood still for ``held`` seconds, and no beat of its own was
        renewed."""
        beats = await self.call(partial(self.box.list, p.lease_prefix(learner)))
        self.tracker.observe(beats)
        return judged(self.tracker, learner, held) is NEXT

    async def decide(self, attempt: int, holder: str | None, held: float) -> Verdict:
        """A creator claim of our own is a previous life's: resume it. Someone else's is
        waited on until its holder shows no sign of life for a lease period."""
        if holder == self.learner:
            return HOLD
        key = p.creator_key(attempt)
        self.waiting_for = f"creator {holder} ({key}) to write {p.MANIFEST}"
        return NEXT if await self.gone(holder or "", held) else WAIT

    async def elect(self) -> bool:
        """No manifest yet: claim the creator role if free or abandoned, then write the
        manifest. True when this node wrote it."""
        if not self.due():
            return False
        keys = [k for k in await self.call(partial(self.box.list, p.CREATOR)) if _is_creator_key(k)]
        newest = p.parse_creator_attempt(keys[-1]) if keys else None  # byte order: attempts'
        # None: someone else's claim stands, another joiner took the next attempt first, or
        # a lost response hid our own write (the claim's holder tells).
        if await self.claims.take(newest, self.decide) is None:
            return False
        # The frozen parameters' payload (if any; new blobs count as signs of life of a
        # claim), then the manifest that names it.
        mine = self.mine
        frozen = self.layout.frozen_tensors()
        if frozen:
            key, _ = await self.call(partial(put_tensors, self.box, frozen))
            mine = dataclasses.replace(mine, frozen_payload=key)
        await self.call(partial(self.box.put_if_absent, p.MANIFEST, p.encode(mine)))
        return True

    # -- the initial commits -----------------------------------------------------------------

    async def initial_commits_exist(self, manifest: p.Manifest) -> bool:
        for fragment in range(manifest.num_fragments):
            if fragment not in self.present:
                key = p.round_key(fragment)
                if await self.call(partial(self.box.get, key)) is not None:
                    self.present.add(fragment)
        return len(self.present) == manifest.num_fragments

    async def finish(self, manifest: p.Manifest) -> bool:
        """Write the missing initial commits when they are this node's to write: it wrote the
        manifest (now or in a previous life), or the writer stopped moving. True if it wrote."""
        missing = [f for f in range(manifest.num_fragments) if f not in self.present]
        writer = manifest.creator
        if writer != self.learner:
            self.waiting_for = (
                f"the initial commits of creator {writer} ({p.round_key(missing[0])} missing)"
            )
            if not self.due():
                return False
            blobs = await self.call(partial(self.box.list, p.BLOBS))
            state = ("initial", frozenset(self.present), len(blobs))
            if not await self.gone(writer, self.quiet.unchanged_for(state, self.clock())):
                return False
        for n, fragment in enumerate(missing):
            key = p.round_key(fragment)
            # Another writer may have finished a fragment while this one was uploading.
            if n > 0 and await self.call(partial(self.box.get, key)) is not None:
                self.present.add(fragment)
                continue
            tensors = self.layout.outer_copy(fragment)  # in float32, as every commit
            payload, _ = await self.call(partial(put_tensors, self.box, tensors))
            commit = p.Commit(fragment, fragment, None, (), payload, None, self.learner)
            # Payloads before the records that point at them. False: another writer's
            # record won, and everyone (this node too) loads that one.
            await self.call(partial(self.box.put_if_absent, key, p.encode(commit)))
            self.present.add(fragment)
        return True


async def establish(
    box: Mailbox,
    layout: ModelLayout,
    algorithm: Algorithm,
    learner: str,
    timeout: float,
    *,
    lease_timeout: float = LEASE_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    poll: float = _POLL,
) -> tuple[p.Manifest, bool]:
    """Create the run, finish a dead creator's half-done creation, or join the run.

    Returns the manifest and whether this node is the run's creator (the manifest names
    it). Raises ``ProtocolError`` if the run's model or algorithm differ from this node's,
    ``TimeoutError`` if the run is not complete within ``timeout`` seconds. A creator that
    shows no sign of life for ``lease_timeout`` seconds is replaced (module docstring);
    ``clock``, ``sleep`` and ``poll`` (seconds between looks) are injectable for tests.
    """
    mine = layout.manifest(learner, algorithm)
    joiner = _Joiner(box, layout, mine, timeout, lease_timeout, clock, sleep, poll)
    return await joiner.run()
