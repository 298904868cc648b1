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
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TypeVar

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm, from_manifest
from gradientmail.coord.election import abandoned
from gradientmail.coord.leases import DEFAULT_LEASE_TIMEOUT, LeaseTracker
from gradientmail.coord.retry import retrying
from gradientmail.engine.chain import commit_tensors
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.ledger import GLOBAL
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, put_tensors

__all__ = ["LEASE_TIMEOUT", "establish", "load_newest", "newest_per_fragment"]

T = TypeVar("T")

_log = logging.getLogger("gradientmail")
_FALLBACK = 8  # older commits of a fragment tried when its newest cannot be loaded
_POLL = 0.2
LEASE_TIMEOUT = DEFAULT_LEASE_TIMEOUT
"""How long a creator may show no sign of life before a joiner takes over (Session's default
``lease_timeout``)."""


async def _wait_for(
    box: Mailbox,
    key: str,
    deadline: float,
    what: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bytes:
    while True:
        data = await retrying(lambda: box.get(key), deadline=deadline, clock=clock, sleep=sleep)
        if data is not None:
            return data
        if clock() > deadline:
            raise TimeoutError(f"{what}: {key} did not appear in time")
        await sleep(_POLL)


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
        algorithm: Algorithm,
        learner: str,
        timeout: float,
        lease_timeout: float,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        poll: float,
    ) -> None:
        self.box = box
        self.layout = layout
        self.learner = learner
        self.mine = layout.manifest(learner, algorithm)
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
        self.holders: dict[str, str] = {}  # creator claim key -> learner (read once each)
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
        if key not in self.holders:
            data = await self.call(partial(self.box.get, key))
            if data is None:
                raise ProtocolError(
                    f"{key}: put_if_absent reported it exists (or list listed it) but it reads "
                    "as missing; the store is not read-after-write consistent"
                )
            self.holders[key] = p.decode_creator(key, data).learner
        return self.holders[key]

    def due(self) -> bool:
        """Whether it is time to look at others' progress again (see ``look_every``)."""
        now = self.clock()
        if now < self.next_look:
            return False
        self.next_look = now + self.look_every
        return True

    async def gone(self, learner: str, state: object) -> bool:
        """Whether ``learner`` showed no sign of life for a whole lease period: ``state`` (what
        it is expected to change) stood still, and no beat of its own was renewed."""
        beats = await self.call(partial(self.box.list, p.lease_prefix(learner)))
        self.tracker.observe(beats)
        return abandoned(
            held=self.quiet.unchanged_for(state, self.clock()),
            live=self.tracker.is_live(learner),
            lease_timeout=self.tracker.lease_timeout,
        )

    async def elect(self) -> bool:
        """No manifest yet: claim the creator role if free or abandoned, then write the
        manifest. True when this node wrote it."""
        if not self.due():
            return False
        keys = [k for k in await self.call(partial(self.box.list, p.CREATOR)) if _is_creator_key(k)]
        attempt = 0
        if keys:
            newest = keys[-1]  # byte order is attempt order
            attempt = p.parse_creator_attempt(newest)
            holder = await self.holder(newest)
            # A claim of our own is a previous life's: resume it. Someone else's is waited
            # on until its holder shows no sign of life for a lease period.
            if holder != self.learner:
                self.waiting_for = f"creator {holder} ({newest}) to write {p.MANIFEST}"
                if not await self.gone(holder, ("claim", newest)):
                    return False
                attempt += 1
                key = p.creator_key(attempt)
                claim = p.encode(p.CreatorClaim(self.learner))
                if await self.call(partial(self.box.put_if_absent, key, claim)):
                    self.holders[key] = self.learner
                # False: another joiner took it first, or a lost response hid our own write.
                if await self.holder(key) != self.learner:
                    return False
        else:
            claim = p.encode(p.CreatorClaim(self.learner))
            if await self.call(partial(self.box.put_if_absent, p.CREATOR, claim)):
                self.holders[p.CREATOR] = self.learner
            if await self.holder(p.CREATOR) != self.learner:
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
            if not await self.gone(writer, ("initial", frozenset(self.present), len(blobs))):
                return False
        for n, fragment in enumerate(missing):
            key = p.round_key(fragment)
            # Another writer may have finished a fragment while this one was uploading.
            if n > 0 and await self.call(partial(self.box.get, key)) is not None:
                self.present.add(fragment)
                continue
            tensors = self.layout.copy_out(fragment)
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
    joiner = _Joiner(box, layout, algorithm, learner, timeout, lease_timeout, clock, sleep, poll)
    return await joiner.run()


def round_keys(keys: Sequence[str]) -> list[int]:
    """The round numbers of a listing of ``rounds/``, ascending; keys there that are not
    round keys (a tool's temporary file, a console's folder marker) are left out, with a
    warning."""
    found: list[int] = []
    for key in keys:
        try:
            found.append(p.parse_round_key(key))
        except ProtocolError as exc:
            _log.warning("ignoring %s: %s", key, exc)
    return sorted(found)


def newest_per_fragment(keys: Sequence[str], fragments: int) -> dict[int, int]:
    newest: dict[int, int] = {}
    for r in round_keys(keys):
        newest[r % fragments] = max(r, newest.get(r % fragments, -1))
    return newest


async def load_newest(
    box: Mailbox,
    layout: ModelLayout,
    deadline: float | None = None,
    *,
    algorithm: Algorithm | None = None,
) -> tuple[dict[int, int], dict[int, dict[str, torch.Tensor]]]:
    """Download the newest readable commit of every fragment (computed along its chain when
    its parameters are not stored: ``engine/chain.py``); return rounds and verified
    tensors. A newest record that cannot be read (truncated, malformed) is reported and the
    one before it is used: one bad object must not keep every joiner (and align) out.
    ``algorithm``: the run's (default: read from its manifest when a commit's parameters
    must be computed)."""
    keys = await retrying(lambda: box.list(p.ROUNDS), deadline=deadline)
    by_fragment: dict[int, list[int]] = {}
    for r in sorted(round_keys(keys)):
        by_fragment.setdefault(r % layout.count, []).append(r)
    missing = [f for f in range(layout.count) if f not in by_fragment]
    if missing:
        raise ProtocolError(f"fragments {missing} have no commit yet; has the run been created?")
    newest: dict[int, int] = {}
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for fragment, rounds in sorted(by_fragment.items()):
        failures: list[str] = []
        for r in reversed(rounds[-_FALLBACK:]):
            key = p.round_key(r)
            try:
                data = await retrying(partial(box.get, key), deadline=deadline)
                commit = p.decode_commit(key, data)
                if algorithm is None and not commit.stored:
                    data = await retrying(partial(box.get, p.MANIFEST), deadline=deadline)
                    algorithm = from_manifest(p.decode_manifest(p.MANIFEST, data).algorithm)
                values = await commit_tensors(
                    box,
                    algorithm,
                    layout.specs[fragment],
                    commit,
                    purpose=GLOBAL,
                    deadline=deadline,
                )
            except (ProtocolError, PayloadCorrupt) as exc:
                _log.warning("%s cannot be loaded (%s); trying the commit before it", key, exc)
                failures.append(f"{key}: {exc}")
                continue
            newest[fragment], tensors[fragment] = r, values
            break
        else:
            raise ProtocolError(
                f"fragment {fragment}: none of its newest {len(failures)} commits can be "
                "loaded: " + "; ".join(failures)
            )
    return newest, tensors
