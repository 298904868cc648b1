"""Closing rounds: the close condition, closer election with failover, combine, commit, sweep.

A learner that contributed to round ``r`` checks, on every communication tick, whether the
round may close: every live learner has a snapshot in it, or ``quorum_size`` snapshots exist
and ``round_timeout`` has passed since this learner first looked. It then claims
``claims/{r}/{attempt}``; the winner combines the snapshots it listed, uploads the payloads,
and only then writes ``rounds/{r}``. If that write loses (another closer got there first),
the winner's record is adopted. If the claimant's lease lapses before the record appears,
the next learner claims ``attempt + 1``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from gradientmail import protocol as p
from gradientmail._buffers import BufferPool
from gradientmail._layout import ModelLayout
from gradientmail._leases import LeaseTracker
from gradientmail._parts import blob_keys
from gradientmail._retry import retrying
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ProtocolError
from gradientmail.events import Committed, Event
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, put_tensors

__all__ = ["Outcome", "RoundCloser"]


@dataclass(frozen=True)
class Outcome:
    commit: p.Commit
    params: dict[str, torch.Tensor] | None  # None when adopted (the syncer downloads it)


@dataclass
class _Watch:
    first_seen: float
    claim_seen: dict[int, float] = field(default_factory=dict)


class RoundCloser:
    def __init__(
        self,
        box: Mailbox,
        layout: ModelLayout,
        algorithm: DiLoCo,
        learner: str,
        tracker: LeaseTracker,
        *,
        quorum_size: int,
        round_timeout: float,
        keep_rounds: int,
        emit: Callable[[Event], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.box = box
        self.layout = layout
        self.algorithm = algorithm
        self.learner = learner
        self.tracker = tracker
        self.quorum_size = quorum_size
        self.round_timeout = round_timeout
        self.keep_rounds = keep_rounds
        self.emit = emit
        self.clock = clock
        self._watch: dict[int, _Watch] = {}
        self._records: dict[int, p.Commit] = {}
        self._momentum: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}
        self._params_out = BufferPool()
        self._claims: dict[str, str] = {}

    def forget(self, r: int) -> None:
        self._watch.pop(r, None)

    async def try_close(
        self,
        r: int,
        own_payload: str,
        own_snapshot: Mapping[str, torch.Tensor],
        base_params: Mapping[str, torch.Tensor] | None,
    ) -> Outcome | None:
        """One attempt at closing round ``r``; None when it is not (yet) this learner's to close."""
        # Rounds far behind this one were closed by someone: forget what we knew of them.
        horizon = r - 4 * self.layout.count
        for stale in [x for x in self._watch if x < horizon]:
            del self._watch[stale]
        for stale in [x for x in self._records if x < horizon]:
            del self._records[stale]
        stale_claims = [k for k in self._claims if k < p.claims_prefix(max(horizon, 0))]
        for key in stale_claims:
            del self._claims[key]
        watch = self._watch.setdefault(r, _Watch(self.clock()))
        snaps = await retrying(partial(self.box.list, p.snapshots_prefix(r)))
        contributors = {key.rpartition("/")[2] for key in snaps}
        live = self.tracker.live() | {self.learner}
        waited = self.clock() - watch.first_seen
        if not (
            live <= contributors
            or (len(contributors) >= self.quorum_size and waited >= self.round_timeout)
        ):
            return None
        attempt = await self._claim(r, watch)
        if attempt is None:
            return None
        return await self._close(r, attempt, snaps, own_payload, own_snapshot, base_params)

    async def _claim(self, r: int, watch: _Watch) -> int | None:
        claims = await retrying(partial(self.box.list, p.claims_prefix(r)))
        attempt = 0
        if claims:
            newest = claims[-1]
            attempt = p.parse_claim_attempt(newest)
            holder = await self._holder(newest)
            if holder == self.learner:
                return attempt  # ours: a previous tick (or a previous life) claimed it
            seen = watch.claim_seen.setdefault(attempt, self.clock())
            # Fail over only when the claimant's lease has lapsed on our clock, and we have
            # watched this claim for a whole lease period ourselves.
            if self.tracker.is_live(holder) or self.clock() - seen < self.tracker.lease_timeout:
                return None
            attempt += 1
        record = p.encode(p.Claim(self.learner))
        key = p.claim_key(r, attempt)
        if await retrying(partial(self.box.put_if_absent, key, record)):
            return attempt
        holder = await self._holder(key)
        return attempt if holder == self.learner else None

    async def _holder(self, key: str) -> str:
        """Who holds a claim; claims are created once, so each is read at most once."""
        if key not in self._claims:
            data = await retrying(partial(self.box.get, key))
            self._claims[key] = p.decode_claim(key, data).learner
        return self._claims[key]

    async def _base(self, r: int) -> p.Commit:
        base_round = r - self.layout.count
        if base_round not in self._records:
            key = p.round_key(base_round)
            self._records[base_round] = p.decode_commit(
                key, await retrying(partial(self.box.get, key))
            )
        return self._records[base_round]

    async def _inputs(
        self,
        r: int,
        snaps: Sequence[str],
        own_payload: str,
        own_snapshot: Mapping[str, torch.Tensor],
        base_params: Mapping[str, torch.Tensor] | None,
        cached: tuple[str, dict[str, torch.Tensor]] | None,
    ) -> tuple[
        p.Commit,
        Mapping[str, torch.Tensor],
        dict[str, torch.Tensor] | None,
        list[tuple[str, int, Mapping[str, torch.Tensor]]],
        list[p.Contribution],
    ]:
        """What round ``r`` combines: its base commit and parameters, the momentum (``cached``
        when that is the base's), the usable snapshots and what the record lists of them."""
        specs = self.layout.specs[r % self.layout.count]
        base = await self._base(r)
        if base_params is None:
            base_params = await retrying(partial(get_tensors, self.box, base.params, specs))
        momentum: dict[str, torch.Tensor] | None = None
        if base.momentum is not None:
            if cached is not None and cached[0] == base.momentum:
                momentum = cached[1]
            else:
                momentum = await retrying(partial(get_tensors, self.box, base.momentum, specs))
        records = await asyncio.gather(*(retrying(partial(self.box.get, key)) for key in snaps))
        usable: list[p.Snapshot] = []
        for key, data in zip(snaps, records, strict=True):
            snap = p.decode_snapshot(key, data)
            if snap.round == r and snap.base == base.round:
                usable.append(snap)  # others were not built on this round's base

        async def local(snap: p.Snapshot) -> Mapping[str, torch.Tensor]:
            if snap.learner == self.learner and snap.payload == own_payload:
                return own_snapshot  # no need to download our own
            return await retrying(partial(get_tensors, self.box, snap.payload, specs))

        # The downloads overlap; with several contributors this is most of a round's latency.
        tensors = await asyncio.gather(*(local(snap) for snap in usable))
        contributions = [
            (snap.learner, snap.samples, values)
            for snap, values in zip(usable, tensors, strict=True)
        ]
        listed = [p.Contribution(snap.learner, snap.samples, snap.payload) for snap in usable]
        if not contributions:
            raise ProtocolError(f"round {r}: no usable snapshot among {len(snaps)} listed")
        return base, base_params, momentum, contributions, listed

    async def _close(
        self,
        r: int,
        attempt: int,
        snaps: Sequence[str],
        own_payload: str,
        own_snapshot: Mapping[str, torch.Tensor],
        base_params: Mapping[str, torch.Tensor] | None,
    ) -> Outcome:
        fragment = r % self.layout.count
        # The momentum this closer computed last for this fragment, taken out of the cache
        # for the whole close: the combine below overwrites it (see the comment there).
        taken = self._momentum.pop(fragment, None)
        try:
            base, base_params, momentum, contributions, listed = await self._inputs(
                r, snaps, own_payload, own_snapshot, base_params, taken
            )
        except BaseException:
            if taken is not None:  # not written yet: it still holds what its key names
                self._momentum.setdefault(fragment, taken)
            raise
        # Buffer reuse, momentum only: the new momentum is written over the closer's previous
        # momentum of this fragment (in place when that is this round's input, which combine
        # allows: the update is element-wise), saving a fresh fragment-sized allocation and
        # its page faults per round. Those buffers are the closer's alone: combine's output,
        # cached only once both payloads were stored (their encodes had copied the bytes),
        # never handed out. Keeping them out of the cache until this close has stored its
        # payloads prevents the race of a close that fails after the combine leaving the
        # cache naming the previous momentum's key over bytes since overwritten: the retry,
        # or the next round, would silently combine with the wrong momentum. A buffer whose
        # upload failed is dropped, never reused: gather lets the other payload's encode run
        # on, reading it. Downloaded momentum is never written (a read-only view of the
        # mailbox's bytes). The new parameters go to the training thread (staged, applied,
        # then kept as the reference and as the base of this fragment's next round), which
        # holds references the closer cannot see: they come from a pool that reuses a
        # buffer only once no tensor anywhere still refers to its storage (_buffers.py).
        params_out = self._params_out.take(fragment, base_params)
        if taken is not None:
            out = (params_out, taken[1])
        else:
            out = (params_out, {name: torch.empty_like(t) for name, t in params_out.items()})
        params, new_momentum = self.algorithm.combine(base_params, momentum, contributions, out=out)
        (params_key, _), (momentum_key, _) = await asyncio.gather(
            retrying(partial(put_tensors, self.box, params)),
            retrying(partial(put_tensors, self.box, new_momentum)),
        )
        # Cached whether the round record below wins or loses: they are momentum_key's bytes.
        self._momentum[fragment] = (momentum_key, new_momentum)
        commit = p.Commit(
            round=r,
            fragment=fragment,
            base=base.round,
            contributors=tuple(sorted(listed, key=lambda c: c.learner)),
            params=params_key,
            momentum=momentum_key,
            closer=self.learner,
            attempt=attempt,
        )
        key = p.round_key(r)
        # Payloads first, then the record that points at them.
        won = await retrying(partial(self.box.put_if_absent, key, p.encode(commit)))
        if won:
            self._records[r] = commit
            outcome = Outcome(commit, params)
        else:
            data = await retrying(partial(self.box.get, key))
            if data is None:
                raise ProtocolError(f"{key}: put_if_absent said it exists, but it reads as missing")
            outcome = Outcome(p.decode_commit(key, data), None)
        self.emit(
            Committed(
                self.learner,
                round=r,
                fragment=fragment,
                contributors=tuple(c.learner for c in outcome.commit.contributors),
                adopted=not won,
            )
        )
        self.forget(r)
        return outcome

    async def sweep(self, commit: p.Commit) -> None:
        """Delete what no recent commit needs: the snapshots, claims and payloads of round
        ``r - keep_rounds * P``. Payload keys still named by a kept commit are spared (the
        same bytes can recur under the same content-addressed key)."""
        old = commit.round - self.keep_rounds * self.layout.count
        if old < 0:
            return
        snaps = await retrying(partial(self.box.list, p.snapshots_prefix(old)))
        claims = await retrying(partial(self.box.list, p.claims_prefix(old)))
        doomed: set[str] = set(snaps) | set(claims)
        for key in snaps:
            data = await retrying(partial(self.box.get, key))
            if data is not None:
                doomed.add(p.decode_snapshot(key, data).payload)
        old_key = p.round_key(old)
        old_record = await retrying(partial(self.box.get, old_key))
        if old_record is not None:
            old_commit = p.decode_commit(old_key, old_record)
            doomed.add(old_commit.params)
            if old_commit.momentum:
                doomed.add(old_commit.momentum)
        kept = {commit.params, commit.momentum}
        base = self._records.get(commit.round - self.layout.count)
        if base is not None and base.round > old:  # with keep_rounds=1 the base itself goes
            kept |= {base.params, base.momentum}
        kept |= {c.payload for c in commit.contributors}
        # Payloads stored in parts: their parts go with them, except a part that a kept
        # payload names too (the same bytes under the same content-addressed key).
        payloads = {k for k in doomed if k and k.startswith(p.BLOBS)}
        doomed |= await retrying(partial(blob_keys, self.box, payloads))
        spared = await retrying(partial(blob_keys, self.box, {k for k in kept if k}))
        await retrying(partial(self.box.delete, sorted(k for k in doomed if k and k not in spared)))
        for r in [r for r in self._records if r <= old]:
            del self._records[r]
