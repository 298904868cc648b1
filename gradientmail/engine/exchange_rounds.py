"""Run-wide rounds (DiLoCo, SparseLoCo): one closer combines every learner's contribution.

- **publish**: a compressing algorithm's contribution is encoded here, never on the
  training thread; then the payload and the ``snapshots/{r}/{learner}`` record naming it.
- **close**: :class:`~gradientmail.engine.closer.RoundCloser`; a round this learner closes
  is staged at once, before its events and its sweep, without a download.
- **poll** (the syncer thread): new records under ``rounds/``, record by record and
  fragment by fragment: one unreadable record is reported once and skipped, one failed
  download holds no other fragment back. Compressed, stateless rounds (SparseLoCo) are
  computed from their contributions and the previous commit (``_replay``), as their
  closers did; the parameters are downloaded only when that cannot be done.
"""

from __future__ import annotations

import asyncio
import threading
from functools import partial

from gradientmail import wire as p
from gradientmail.algorithms.contribution import compression_of, encode_contribution
from gradientmail.coord.retry import Stopped, retrying
from gradientmail.engine.chain import commit_tensors, step_from_contributions
from gradientmail.engine.closer import RoundCloser
from gradientmail.engine.exchange import (
    ExchangeContext,
    Offer,
    Pending,
    Placed,
    Tensors,
    mine_of,
)
from gradientmail.errors import ProtocolError, RoundImpossible
from gradientmail.events import Event, PollFailed, RoundFailed
from gradientmail.ledger import GLOBAL
from gradientmail.payload import get_tensors, put_tensors
from gradientmail.payload.stream import read_into

__all__ = ["RoundsExchange"]


class RoundsExchange:
    """Run-wide rounds for one learner (module docstring)."""

    syncer = True

    def __init__(self, context: ExchangeContext) -> None:
        self.host = host = context.host
        self.box = context.box
        self.layout = layout = context.layout
        self.algorithm = algorithm = context.algorithm
        self.globals = context.global_pool
        # The closer's events wait until its commit is staged: a slow on_event must not
        # delay the hand-over of the new parameters (the syncer would download them).
        self._closer_events: list[Event] = []
        self.closer = RoundCloser(
            context.box,
            layout,
            algorithm,
            host.learner_id,
            context.tracker,
            quorum_size=context.quorum_size,
            round_timeout=context.round_timeout,
            keep_rounds=context.keep_rounds,
            claim_timeout=context.claim_timeout,
            emit=self._closer_events.append,
            global_pool=context.global_pool,
        )
        # A compressing algorithm's encoder (algorithms/contribution.py), if any.
        self._compression = compression_of(algorithm)
        # Stateless compressed rounds (SparseLoCo) are computed from their contributions
        # by a learner that has the previous commit: it downloads no dense parameters.
        self._delta_downloads = self._compression is not None and not any(
            algorithm.state_specs(specs) for specs in layout.specs
        )
        # The last commit staged per fragment (round, parameters), to replay from; its own
        # lock: the communication thread and the syncer both stage.
        self._last_lock = threading.Lock()
        self._last_commit: list[tuple[int, Tensors]] = [(0, {}) for _ in range(layout.count)]
        self._bad: set[str] = set()  # round records reported unreadable (reported once)

    async def joined(self, rounds: dict[int, int], tensors: dict[int, Tensors]) -> None:
        for fragment, values in tensors.items():
            self._remember(fragment, rounds[fragment], values)

    def _remember(self, fragment: int, r: int, params: Tensors) -> None:
        """``params`` (round ``r`` of ``fragment``) were staged: replays start from them.
        Never an older round: the two threads stage in either order."""
        if not self._delta_downloads:
            return
        with self._last_lock:
            if r >= self._last_commit[fragment][0]:
                self._last_commit[fragment] = (r, params)

    def _stage(self, commit: p.Commit, params: Tensors, mine: frozenset[tuple[int, str]]) -> bool:
        if not self.host.stage(commit, params, mine):
            return False
        self._remember(commit.fragment, commit.round, params)
        return True

    # -- the communication thread -------------------------------------------------------------

    async def publish(self, offer: Offer) -> Placed:
        snapshot, compressed, kept = offer.snapshot, None, None
        if self._compression is not None:
            # The residual this learner keeps changes only when the commit holding this
            # contribution is applied (session/_training.py): a contribution that misses
            # its round leaves it as it was.
            compression, decay = self._compression
            snapshot, kept = await asyncio.to_thread(
                encode_contribution,
                compression,
                decay,
                snapshot,
                offer.base_params,
                offer.residual,
                self.layout.buffer_names(offer.fragment),
            )
            compressed = snapshot
        stop = self.host.stop
        key, nbytes = await retrying(partial(put_tensors, self.box, snapshot), stop=stop)
        learner = self.host.learner_id
        record = p.Snapshot(offer.round, learner, offer.samples, key, offer.base)
        await retrying(
            partial(self.box.put_if_absent, p.snapshot_key(offer.round, learner), p.encode(record)),
            stop=stop,
        )
        return Placed(offer.round, key, nbytes, compressed=compressed, residual=kept)

    async def close(self, pending: Pending) -> None:
        host = self.host
        with host.lock:
            if (
                pending.cancelled
                or pending.failure is not None
                or pending.round <= host.known[pending.fragment]
            ):
                return
            # Held here: applying the round lets go of them (under the lock) meanwhile.
            # A compressed contribution is summed from its payload's tensors, as the others'.
            snapshot, base_params = pending.compressed or pending.snapshot, pending.base_params
        assert pending.payload is not None
        failure: Exception | None = None
        outcome = None
        try:
            outcome = await self.closer.try_close(
                pending.round, pending.payload, snapshot, base_params
            )
        except Stopped:
            raise
        except RoundImpossible as exc:
            # Nobody can make this round: the training thread raises it (the emit below
            # wakes a wait in progress).
            with host.lock:
                pending.failure = exc
            failure = exc
        except Exception as exc:
            failure = exc
        if outcome is not None:
            host.count("closed")
            if outcome.params is not None:
                # Staged here, before the sweep, the events and without a download: the
                # training thread (perhaps waiting at the sync point) applies it at once.
                # Staging marks the round known: neither the next tick nor the syncer
                # closes or fetches it again.
                commit = outcome.commit
                self._stage(commit, outcome.params, mine_of([commit], host.learner_id))
            host.wake_syncer()  # the record is written: the syncer looks now
        events, self._closer_events[:] = list(self._closer_events), []
        for event in events:
            host.emit(event)
        if failure is not None:
            host.emit(RoundFailed(host.learner_id, round=pending.round, error=repr(failure)))
        if outcome is None or outcome.params is None:
            return
        try:
            await self.closer.sweep(outcome.commit)
        except Stopped:
            raise
        except Exception as exc:  # sweeping is housekeeping; the round is committed
            host.emit(RoundFailed(host.learner_id, round=pending.round, error=f"sweep: {exc!r}"))

    # -- the syncer thread --------------------------------------------------------------------

    async def poll(self) -> None:
        host = self.host
        # Rounds of different fragments can commit out of order; listing after the oldest
        # per-fragment cursor never skips one.
        with host.lock:
            cursor = p.round_key(min(host.known))
        keys = await retrying(partial(self.box.list, p.ROUNDS, after=cursor), stop=host.stop)
        fresh: dict[int, list[p.Commit]] = {}
        for key in keys:
            if key in self._bad:
                continue
            # Record by record: one unreadable record (or a stray key under rounds/, a
            # tool's temporary file, a console's folder marker) is reported once and
            # skipped; it must not stop this poll, or every later one, for every fragment.
            try:
                r = p.parse_round_key(key)
            except ProtocolError as exc:
                self._bad.add(key)
                host.emit(PollFailed(host.learner_id, error=f"skipping a key: {exc}"))
                continue
            fragment = r % self.layout.count
            with host.lock:
                if r <= host.known[fragment]:
                    continue
            try:
                data = await retrying(partial(self.box.get, key), stop=host.stop)
                commit = p.decode_commit(key, data)
                if commit.fragment != fragment:
                    raise ProtocolError(f"{key}: fragment {commit.fragment}, expected {fragment}")
            except ProtocolError as exc:
                self._bad.add(key)
                host.emit(PollFailed(host.learner_id, error=f"skipping round record: {exc}"))
                continue
            fresh.setdefault(fragment, []).append(commit)
        for fragment, commits in fresh.items():
            # Fragment by fragment: a failed download of one holds no other back.
            try:
                await self._fetch(fragment, commits)
            except Stopped:
                raise
            except Exception as exc:
                host.emit(
                    PollFailed(
                        host.learner_id,
                        error=f"round {commits[-1].round} (fragment {fragment}): {exc!r}",
                    )
                )

    async def _fetch(self, fragment: int, commits: list[p.Commit]) -> None:
        """Download the newest of ``commits`` (one fragment's, oldest first) and stage it,
        remembering which of them held this learner's contributions; with delta downloads
        computed from the contributions instead, where it can be."""
        host = self.host
        newest = commits[-1]
        specs = self.layout.specs[fragment]
        like = host.ref[fragment]
        params = await self._replay(fragment, commits) if self._delta_downloads else None
        if params is not None:
            host.count("computed")
        elif not newest.stored:  # computed along its chain (engine/chain.py)
            params = await commit_tensors(self.box, self.algorithm, specs, newest, purpose=GLOBAL)
        elif like.keys() == {spec.name for spec in specs}:
            # Streamed part by part into a pooled buffer: the download holds a few parts,
            # and the buffer a previous commit of any fragment released.
            into = self.globals.take(like)  # float32, as the commit stores it
            stored = self.layout.outer_specs[fragment]
            params = await read_into(self.box, newest.params, stored, into, stop=host.stop)
        else:
            stored = self.layout.outer_specs[fragment]
            params = await retrying(
                partial(get_tensors, self.box, newest.params, stored, purpose=GLOBAL),
                stop=host.stop,
            )
        if not self._stage(newest, params, mine_of(commits, host.learner_id)):
            return  # staged meanwhile by this learner's own close
        for c in commits:
            self.closer.forget(c.round)

    async def _replay(self, fragment: int, commits: list[p.Commit]) -> Tensors | None:
        """The newest of ``commits`` computed from their rounds' compressed contributions,
        starting from the last commit of ``fragment`` this learner staged (each round must
        build on the one before); None when that is not possible here (a gap, a payload
        that fails, a result whose hash is not the record's: all reported, then the
        parameters are downloaded)."""
        host = self.host
        with self._last_lock:
            known, params = self._last_commit[fragment]
        specs = self.layout.specs[fragment]
        for commit in commits:
            if commit.round <= known:
                continue
            if commit.base != known or not params:
                return None  # this learner missed a round (it joined, or was away)
            with host.lock:
                pending = host.inflight.get(fragment)
                own = (
                    (pending.payload, pending.compressed)
                    if pending is not None
                    and pending.payload is not None
                    and pending.compressed is not None
                    else None
                )
            try:
                params = await retrying(
                    partial(
                        step_from_contributions,
                        self.box,
                        self.algorithm,
                        specs,
                        commit,
                        params,
                        own,
                        self.globals.take(params),
                    ),
                    stop=host.stop,
                )
            except ProtocolError as exc:
                host.emit(
                    PollFailed(
                        host.learner_id,
                        error=f"round {commit.round}: cannot compute it from its "
                        f"contributions ({exc}); loading its parameters instead",
                    )
                )
                return None
            known = commit.round
        return params if known == commits[-1].round else None
