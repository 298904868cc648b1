"""Closing rounds: the close condition, closer election with failover, combine, commit, sweep.

A learner that contributed to round ``r`` checks, on every communication tick, whether the
round may close: every live learner has a snapshot in it, or ``quorum_size`` snapshots exist
and ``round_timeout`` has passed since this learner first looked. It then claims
``claims/{r}/{attempt}``; the winner combines the snapshots it listed, uploads the payloads,
and only then writes ``rounds/{r}``. If that write loses (another closer got there first),
the winner's record is adopted; a record that is this closer's own (the response to its
write was lost, the retry found the key taken) counts as won.

Fail-safe rules:

- A snapshot that cannot be loaded or verified (a malformed record, a missing or corrupt
  payload: any :class:`ProtocolError`) is excluded, listed in the record's ``excluded`` with
  the reason, and the round commits with the rest. With nothing usable left the close fails.
- A close that fails the same way ``give_up_after`` times in a row for a reason in the
  run's data (``engine/failures.py``: a payload of another dtype, a record that breaks the
  protocol), not the store's, ends the round: the closer records ``claims/{r}/failed``
  and raises :class:`~gradientmail.errors.RoundImpossible`; every closer that lists the
  round's claims next raises it too, and each learner's ``step()`` with it.
- A claim is honoured for a bounded time. Another learner claims ``attempt + 1`` once the
  holder's lease lapsed and it watched the claim for a lease period, or, live holder or
  not, once ``claim_timeout`` passed on its own monotonic clock since it first saw that
  attempt. A holder whose close failed ``give_up_after`` times in a row stops retrying
  that attempt and competes for the next one like any other learner, a lease period after
  the others when other live contributors could take over. A duplicate closer is harmless:
  the record is created once, and a loser adopts it and deletes the payloads it uploaded
  that nothing names.
- What this learner knows of a round (when it first looked, when it first saw each claim
  attempt) is kept until the round is known to be committed: ``forget(r)``, its own commit,
  or a ``try_close`` of a later round of the same fragment (whose base proves it). Other
  fragments running ahead never reset it; a cap bounds it all the same.
- Sweeping is idempotent and catches up: a sweep deletes round ``r - keep_rounds * P`` and
  older rounds of the fragment that still have claims (their own sweep never ran: the
  closer died, or the sweep failed), a bounded number per call. Claims are deleted last, so
  a round without claims has nothing else left to sweep.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.coord.claims import HOLD, NEXT, WAIT, ClaimSeries, Verdict, closer_claims, judged
from gradientmail.coord.leases import LeaseTracker
from gradientmail.coord.retry import retrying
from gradientmail.coord.sweep import kept_rounds, sweep_after
from gradientmail.engine.adopt import write_or_adopt
from gradientmail.engine.chain import commit_tensors
from gradientmail.engine.failures import FaultCount, raise_recorded, record_failure
from gradientmail.engine.layout import ModelLayout
from gradientmail.engine.members import Listed, read_members, sum_members
from gradientmail.events import Committed, Event
from gradientmail.ledger import GLOBAL, MOMENTUM
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, payload_key, put_tensors
from gradientmail.payload.buffers import BufferPool
from gradientmail.payload.stream import read_into
from gradientmail.settings import dense_every

__all__ = ["GIVE_UP_AFTER", "Outcome", "RoundCloser"]

_log = logging.getLogger("gradientmail")

GIVE_UP_AFTER = 3  # failed closes of one claim attempt before its holder stops retrying it
_MAX_WATCHES = 1024  # rounds watched at once, at most (a safety net: see _prune)
_PARTS_HELD = 4  # parts of the commit's two payloads encoded or being written at once


@dataclass(frozen=True)
class Outcome:
    commit: p.Commit
    params: dict[str, torch.Tensor] | None  # None when adopted (the syncer downloads it)


@dataclass
class _Watch:
    """What this learner knows of one round, on its own clock."""

    first_seen: float  # when it first looked at the round (round_timeout runs from here)
    claims: ClaimSeries  # its closer claims: when each was first seen, who holds it
    failures: dict[int, int] = field(default_factory=dict)  # own attempt -> failed closes
    faults: FaultCount = field(default_factory=FaultCount)  # the same data fault, in a row


class RoundCloser:
    """Closes the rounds one learner contributed to.

    ``claim_timeout``: how long a live closer's claim is honoured, from when this learner
    first saw it (default ``round_timeout + lease_timeout``). ``give_up_after``: failed
    closes of one attempt before this learner stops retrying it. ``clock`` measures every
    wait (give the tracker the same one).
    """

    def __init__(
        self,
        box: Mailbox,
        layout: ModelLayout,
        algorithm: Algorithm,
        learner: str,
        tracker: LeaseTracker,
        *,
        quorum_size: int,
        round_timeout: float,
        keep_rounds: int,
        emit: Callable[[Event], None],
        clock: Callable[[], float] = time.monotonic,
        claim_timeout: float | None = None,
        give_up_after: int = GIVE_UP_AFTER,
        global_pool: BufferPool | None = None,
    ) -> None:
        if give_up_after < 1:
            raise ValueError(f"give_up_after must be at least 1, not {give_up_after}")
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
        self.claim_timeout = (
            round_timeout + tracker.lease_timeout if claim_timeout is None else claim_timeout
        )
        self.give_up_after = give_up_after
        self._watch: dict[int, _Watch] = {}  # guarded by _lock: forget() comes from any thread
        self._lock = threading.Lock()
        self._records: dict[int, p.Commit] = {}
        self._momentum: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}
        # The sums (which become the new parameters) come from ``global_pool`` (a Session
        # shares it with its syncer's downloads: both end up as the reference).
        self._params_out = BufferPool(GLOBAL) if global_pool is None else global_pool
        self._state_pool = BufferPool(MOMENTUM)

    def _claims(self, r: int) -> ClaimSeries:
        key_of = partial(p.claim_key, r)
        return closer_claims(self.box, self.learner, key_of, what=f"round {r}", clock=self.clock)

    def forget(self, r: int) -> None:
        """Drop what this closer knows of round ``r``: call it once ``r`` is committed (from
        any thread)."""
        with self._lock:
            self._watch.pop(r, None)

    def _prune(self, r: int) -> None:
        """Forget rounds that closing ``r`` proves committed: the earlier rounds of its
        fragment (``r``'s base, ``r - P``, is committed, and so is everything before it).
        Never rounds of other fragments: one running far ahead says nothing of another."""
        count = self.layout.count
        with self._lock:
            for x in [x for x in self._watch if x < r and (r - x) % count == 0]:
                del self._watch[x]
            # A safety net for callers that never close a later round nor call forget().
            while len(self._watch) >= _MAX_WATCHES:
                del self._watch[min(self._watch)]
        for x in [x for x in self._records if x < r - count and (r - x) % count == 0]:
            del self._records[x]
        while len(self._records) >= _MAX_WATCHES:
            del self._records[min(self._records)]

    async def try_close(
        self,
        r: int,
        own_payload: str,
        own_snapshot: Mapping[str, torch.Tensor],
        base_params: Mapping[str, torch.Tensor] | None,
    ) -> Outcome | None:
        """One attempt at closing round ``r``; None when it is not (yet) this learner's to
        close. :class:`~gradientmail.errors.RoundImpossible` when nobody can close it
        (``engine/failures.py``)."""
        self._prune(r)
        with self._lock:
            watch = self._watch.get(r)
            if watch is None:
                watch = self._watch[r] = _Watch(self.clock(), self._claims(r))
        snaps = await retrying(partial(self.box.list, p.snapshots_prefix(r)))
        contributors = {key.rpartition("/")[2] for key in snaps}
        live = self.tracker.live() | {self.learner}
        waited = self.clock() - watch.first_seen
        if not (
            live <= contributors
            or (len(contributors) >= self.quorum_size and waited >= self.round_timeout)
        ):
            return None
        attempt = await self._claim(r, watch, (contributors & live) - {self.learner})
        if attempt is None:
            return None
        try:
            return await self._close(r, attempt, snaps, own_payload, own_snapshot, base_params)
        except Exception as exc:
            failures = watch.failures[attempt] = watch.failures.get(attempt, 0) + 1
            if watch.faults.add(attempt, exc) >= self.give_up_after:
                # The same fault in the run's data on every try: nobody can make this
                # round. Recorded for every learner, instead of a claim given up and
                # retaken for ever while their sync points wait in silence.
                raise await record_failure(self.box, r, self.learner, attempt, exc) from exc
            if failures == self.give_up_after:
                _log.warning(
                    "round %d: closing attempt %d failed %d times (last: %r); giving the claim up",
                    r,
                    attempt,
                    failures,
                    exc,
                )
            raise

    async def _claim(self, r: int, watch: _Watch, others: set[str]) -> int | None:
        """The claim attempt this learner holds on round ``r`` now, taking the next one over
        when the newest claim is no longer honoured; None while someone else's is.
        ``others``: the live learners besides this one that contributed to ``r`` (the ones
        that could close it instead)."""
        listed = await retrying(partial(self.box.list, p.claims_prefix(r)))
        await raise_recorded(self.box, r, listed)  # a closer found the round impossible
        claims = [key for key in listed if p.claim_round(key) == r]
        newest = p.parse_claim_attempt(claims[-1]) if claims else None

        async def decide(attempt: int, holder: str | None, held: float) -> Verdict:
            if holder == self.learner:
                if watch.failures.get(attempt, 0) < self.give_up_after:
                    return HOLD  # ours: a previous tick (or a previous life) claimed it
                # Given up: honoured like anyone's, and longer when others could take over
                # (they saw the claim about when this learner made it: theirs comes first).
                patience = self.claim_timeout
                if others:
                    patience += self.tracker.lease_timeout
                return WAIT if held < patience else NEXT
            # A live closer that has not committed within the deadline is replaced: it may
            # be failing over and over, or stuck.
            return judged(self.tracker, holder, held, deadline=self.claim_timeout)

        return await watch.claims.take(newest, decide)

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
        base_params: Mapping[str, torch.Tensor] | None,
        cached: tuple[str, dict[str, torch.Tensor]] | None,
    ) -> tuple[
        p.Commit,
        Mapping[str, torch.Tensor],
        dict[str, torch.Tensor] | None,
        list[Listed],
        list[p.Exclusion],
    ]:
        """What round ``r`` builds on: its base commit and parameters, the momentum
        (``cached`` when that is the base's; else downloaded, into a pooled buffer when it
        is updated in place), the snapshot records that name a usable contribution, and
        those excluded (unreadable, or not this round's)."""
        specs = self.layout.specs[r % self.layout.count]
        base = await self._base(r)
        if base_params is None:
            base_params = await commit_tensors(
                self.box, self.algorithm, specs, base, purpose=GLOBAL
            )
        momentum: dict[str, torch.Tensor] | None = None
        if base.momentum is not None:
            state_specs = self.algorithm.state_specs(specs)
            if cached is not None and cached[0] == base.momentum:
                momentum = cached[1]
            elif self._in_place(r % self.layout.count):
                into = self._state_pool.take(base_params)
                momentum = await read_into(self.box, base.momentum, state_specs, into)
            else:
                momentum = await retrying(
                    partial(get_tensors, self.box, base.momentum, state_specs, purpose=MOMENTUM)
                )
        usable, excluded = await read_members(self.box, snaps, r, base.round)
        return base, base_params, momentum, usable, excluded

    def _in_place(self, fragment: int) -> bool:
        """Whether the algorithm's state is shaped like the fragment's float32 globals
        (DiLoCo's momentum): then it is downloaded into, and updated in, a buffer of the
        closer's."""
        state = self.algorithm.state_specs(self.layout.specs[fragment])
        return tuple(state) == self.layout.outer_specs[fragment]

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
        # The momentum this closer computed last (it caches one fragment's: each would pin
        # a fragment-sized buffer between rounds), taken out of the cache for the whole
        # close: the outer step below overwrites it in place. That prevents the race of a
        # close that fails after the update leaving the cache naming the previous
        # momentum's key over bytes since overwritten: the retry, or the next round, would
        # silently combine with the wrong momentum. It goes back only if nothing was
        # written into it; a buffer whose upload failed is dropped, never reused (gather
        # lets the other payload's encode run on, reading it).
        # Downloaded momentum goes into a buffer of the closer's own pool and is updated
        # there. The new parameters are the accumulator of the sums, from the pool shared
        # with the syncer: they go to the training thread (staged, applied, then kept as
        # the reference and as the base of this fragment's next round), which holds
        # references the closer cannot see, so the pool reuses a buffer only once no
        # tensor anywhere still refers to it (payload/buffers.py).
        taken = self._momentum.pop(fragment, None)
        self._momentum.clear()  # another fragment's: its buffer goes back to the pool
        try:
            if taken is not None and taken[0] != (await self._base(r)).momentum:
                # Stale (another learner closed this fragment's last round): let go of it
                # before the download below, which can then reuse its buffer.
                taken = None
            base, base_params, momentum, usable, excluded = await self._inputs(
                r, snaps, base_params, taken
            )
            for x in excluded:
                _log.warning("round %d: excluded %s: %s", r, x.key, x.reason)
            sums, members = await sum_members(
                self.box,
                self.algorithm,
                self.layout.specs[fragment],
                self.layout.buffer_names(fragment),
                usable,
                excluded,
                closer=self.learner,
                own=(own_payload, own_snapshot),
                out=partial(self._params_out.take, base_params),
                what=f"round {r}",
            )
        except BaseException:
            if taken is not None:  # not written yet: it still holds what its key names
                self._momentum.setdefault(fragment, taken)
            raise
        state_out: dict[str, torch.Tensor] | None = None
        if self._in_place(fragment):
            state_out = momentum if momentum is not None else self._state_pool.take(base_params)
        params, new_momentum = await asyncio.to_thread(
            _finish,
            self.algorithm,
            base_params,
            momentum,
            sums,
            state_out,
            self.layout.buffer_names(fragment),
        )
        # Both payloads encode side by side, sharing one limit on the parts held at once.
        # A stateless algorithm with dense_every=K stores the parameters at every K-th round
        # of the fragment only; the record names their hash all the same (engine/chain.py).
        store = (r // self.layout.count) % _dense_every(self.algorithm) == 0
        limit = asyncio.Semaphore(_PARTS_HELD)
        if store:
            (params_key, _), (momentum_key, _) = await asyncio.gather(
                retrying(partial(put_tensors, self.box, params, limit=limit)),
                retrying(partial(put_tensors, self.box, new_momentum, limit=limit)),
            )
        else:
            params_key = await asyncio.to_thread(payload_key, params)
            momentum_key, _ = await retrying(
                partial(put_tensors, self.box, new_momentum, limit=limit)
            )
        # Cached whether the round record below wins or loses: they are momentum_key's
        # bytes. One fragment's only: the others' would pin a fragment each between rounds.
        self._momentum.clear()
        if state_out is not None:
            self._momentum[fragment] = (momentum_key, new_momentum)
        contributors = tuple(p.Contribution(s.learner, s.samples, s.payload) for _, s in members)
        # The fragment's running totals: the base's and this round's; unknown when the
        # base's are (a record from before totals existed): readers then count every record.
        base_totals = base.running_totals(self.layout.count)
        commit = p.Commit(
            round=r,
            fragment=fragment,
            base=base.round,
            contributors=contributors,
            params=params_key,
            momentum=momentum_key,
            closer=self.learner,
            attempt=attempt,
            excluded=tuple(sorted(excluded, key=lambda x: x.key)),
            totals=(
                None
                if base_totals is None
                else base_totals.after(sum(c.samples for c in contributors))
            ),
            stored=store,
        )
        # Payloads first, then the record that points at them.
        found, won = await write_or_adopt(self.box, p.round_key(r), commit, base)
        if won:
            self._records[r] = found
            outcome = Outcome(found, params)
        else:
            outcome = Outcome(found, None)
        self.emit(
            Committed(
                self.learner,
                round=r,
                fragment=fragment,
                contributors=tuple(c.learner for c in outcome.commit.contributors),
                adopted=not won,
                excluded=tuple(x.learner for x in outcome.commit.excluded),
            )
        )
        self.forget(r)
        return outcome

    async def sweep(self, commit: p.Commit) -> None:
        """Delete what no recent commit needs (:func:`gradientmail.coord.sweep.sweep_after`),
        then forget the records of the rounds swept."""
        base = self._records.get(commit.round - self.layout.count)
        # Unstored commits are computed from the newest stored one before them and the
        # rounds' contributions: keep every round back to it, for this commit and its base.
        keep = kept_rounds(self.keep_rounds, _dense_every(self.algorithm))
        old = await sweep_after(self.box, commit, self.layout.count, keep, base)
        for r in [r for r in self._records if r <= old]:
            del self._records[r]


def _dense_every(algorithm: Algorithm) -> int:
    """Every how many rounds of a fragment its parameters are stored (1: every round)."""
    return dense_every(algorithm.settings())  # a capability the registry declares


def _finish(
    algorithm: Algorithm,
    base: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor] | None,
    sums: dict[str, torch.Tensor],
    state_out: dict[str, torch.Tensor] | None,
    buffer_names: frozenset[str],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with torch.no_grad():
        return algorithm.finish(base, state, sums, state_out=state_out, buffer_names=buffer_names)
