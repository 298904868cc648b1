"""A read-only view of a run, built from its mailbox alone (``gradientmail status``, operator).

What it shows: whether the run exists, its creator, fragments and algorithm (the manifest);
training rounds committed, the newest round overall and per fragment, who contributed to
the newest one and the samples committed (each trained sample counted once, see
:attr:`RunView.samples_committed`); every learner with its newest beat, liveness,
steps and samples, and its sync-point counters (reached, contributed, skipped, seconds
waited) with the share of the observer's recent time it spent waiting; rounds that have
snapshots but no commit yet; the age of the newest commit and the sample throughput. Ages
and rates use the observer's own monotonic clock: no server timestamp is read, as
everywhere in the protocol. So an age is known only for what the watcher saw appear: a
beat or commit already there at its first poll (a finished run looked at later) is at
least that old (:attr:`LearnerView.beat_age_known`, :attr:`RunView.commit_age_known`).
:attr:`LearnerView.skipping` and :attr:`LearnerView.stalling` are the flags the table,
``status --json`` and the operator all show.

It only reads: ``get`` and ``list``, never ``put_if_absent`` or ``delete``.
:class:`RunWatcher` keeps a per-fragment cursor over ``rounds/`` and a beat
cache, so a poll reads only the commit records and beats that are new since the last one.
Of the new commit records it reads the newest of each fragment: the running totals it
carries (:class:`gradientmail.wire.records.Totals`) stand for every record before it, so
a first poll (a new watcher, an operator just restarted) reads one record per fragment
however long the run. A fragment whose newest record carries none (written before totals
existed) has every new record read and counted, as before.

A Moshpit run (manifest algorithm ``moshpit``) has no run-wide rounds after its initial
commit: :attr:`RunView.groups` (a :class:`GroupsView`, read by ``_inspect_groups.py``)
shows its group rounds, the newest group round stands for the rounds committed, and the
samples are the learners' own (their beats).

A malformed record raises :class:`ProtocolError` naming its key; :class:`MailboxUnavailable`
propagates (state read before the failure is kept, so the next poll goes on from there).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, TypeVar

from gradientmail.coord.leases import LeaseTracker
from gradientmail.errors import ProtocolError
from gradientmail.inspect._groups import (
    GroupsView,
    GroupWatcher,
    is_moshpit,
)
from gradientmail.inspect._traffic import (
    Traffic,
    describe_compression,
    model_bytes,
    model_dtypes,
)
from gradientmail.mailbox import Mailbox
from gradientmail.wire import (
    CREATOR,
    LEASES,
    MANIFEST,
    ROUNDS,
    SNAPSHOTS,
    Beat,
    Commit,
    CreatorClaim,
    Manifest,
    beat_key,
    decode_beat,
    decode_commit,
    decode_creator,
    decode_manifest,
    parse_round_key,
    round_key,
    snapshot_key,
)
from gradientmail.wire.records import NO_TOTALS, Totals

__all__ = [
    "STALLING_FRACTION",
    "LearnerView",
    "RunView",
    "RunWatcher",
    "SyncTotals",
    "inspect_run",
]

_BATCH = 64  # records read concurrently; the cursor advances after each batch
# A live learner whose step() waited at sync points for at least this share of the recent
# time (the watcher's window) is flagged as stalling: the store or a closer holds it back.
STALLING_FRACTION = 0.25
T = TypeVar("T")


def _decode(decode: Callable[[str, bytes | None], T], key: str, data: bytes | None) -> T:
    """``decode(key, data)``, with ``key`` named in every failure.

    Some checks the decoders call (blob keys, learner ids) raise without the record's key,
    or raise ``ValueError``; both become a :class:`ProtocolError` that names it.
    """
    try:
        return decode(key, data)
    except (ProtocolError, ValueError) as exc:
        if isinstance(exc, ProtocolError) and str(exc).startswith(key):
            raise
        raise ProtocolError(f"{key}: {exc}") from exc


@dataclass(frozen=True)
class LearnerView:
    learner: str
    live: bool
    beat: int
    leaving: bool
    steps: int | None  # from the newest Beat record (None if it could not be read)
    samples: int | None
    seconds_since_beat: float  # observer's clock since the newest beat key last changed
    # Sync-point counters from the newest Beat record (None if it could not be read; 0 from
    # a learner that predates them): reached, contributed, skipped, seconds step() waited.
    sync_points: int | None = None
    contributed: int | None = None
    waited_s: float | None = None
    skipped: int | None = None
    # Bytes it moved to and from the mailbox, every kind (None without a beat record).
    bytes_up: int | None = None
    bytes_down: int | None = None
    # Share of the observer's time step() waited, over the watcher's window (None until two
    # beats with counters were seen a second or more apart, and for a learner not live).
    waiting_fraction: float | None = None
    # Whether this watcher saw the newest beat key appear, so that seconds_since_beat is
    # its age. False for a beat already there when the watcher first listed the learner
    # (a finished run watched later): its age is then seconds_since_beat or more.
    beat_age_known: bool = False

    @property
    def skipping(self) -> bool:
        """It let sync points pass without contributing (those steps went into a later,
        longer contribution)."""
        return bool(self.skipped)

    @property
    def stalling(self) -> bool:
        """Live, and waiting at sync points for STALLING_FRACTION of the time or more."""
        return (
            self.live
            and self.waiting_fraction is not None
            and self.waiting_fraction >= STALLING_FRACTION
        )


@dataclass(frozen=True)
class SyncTotals:
    """The sync-point counters summed over every learner the mailbox knows, live or not (a
    finished run keeps its totals), and who is skipping or stalling now."""

    sync_points: int
    contributed: int
    waited_s: float
    skipped: int
    skipping: tuple[str, ...]  # learners with skipped > 0
    stalling: tuple[str, ...]  # live learners waiting STALLING_FRACTION of the time or more


@dataclass(frozen=True)
class RunView:
    exists: bool  # False while the prefix holds neither claims/creator nor the manifest
    creator: str | None
    fragments: int | None  # None before the manifest exists
    algorithm: Mapping[str, Any] | None
    rounds_committed: int  # training commits (round >= fragments), every fragment's
    newest_round: int | None  # newest training round
    newest_per_fragment: Mapping[int, int]  # fragment -> newest round, initial ones included
    last_contributors: tuple[str, ...]  # learners of the newest training commit
    # Samples trained and committed, each counted once: every trained sample goes into one
    # round of each fragment, so this is the fragments' committed samples summed, divided
    # by the number of fragments (their mean, rounded down). samples_per_second is its rate.
    samples_committed: int
    learners: tuple[LearnerView, ...]  # sorted by learner id
    live_learners: int
    open_rounds: Mapping[int, tuple[str, ...]]  # snapshotted, uncommitted rounds -> learners
    seconds_since_commit: float | None  # observer's clock since the newest commit was seen
    samples_per_second: float | None  # between the last two polls that changed the samples
    # Whether this watcher saw the newest commit appear (after its first poll), so that
    # seconds_since_commit is its age; False when the commit was there at the first poll:
    # its age is then seconds_since_commit or more (0.0 on a first poll).
    commit_age_known: bool = False
    # The bytes of what one round of every fragment carries, dense (the manifest's params
    # and buffers; None before the manifest exists).
    model_bytes: int | None = None
    # The dtypes of the tensors rounds carry, sorted (empty before the manifest exists).
    dtypes: tuple[str, ...] = ()
    # A Moshpit run's group rounds (None for any other run, and before the manifest).
    # For such a run rounds_committed and newest_round are the newest group round (group
    # rounds are numbered 1, 2, … and each has commits), last_contributors the members of
    # that round's groups, and samples_committed the samples the learners' newest beats
    # report, summed: there is no run-wide commit, and every trained sample goes into its
    # learner's next group contribution.
    groups: GroupsView | None = None

    @property
    def compression(self) -> str:
        """How contributions travel, in words (:func:`describe_compression`)."""
        return describe_compression(self.algorithm, self.dtypes)

    @property
    def traffic(self) -> Traffic:
        """Bytes the learners moved and, when contributions are compressed, the least
        dense float32 rounds would move for the same contributions (one fragment up and one
        down each; a closer moves more), so the ratio understates the saving."""
        up = sum(v.bytes_up or 0 for v in self.learners)
        down = sum(v.bytes_down or 0 for v in self.learners)
        dense = None
        compressed = self.algorithm is not None and "compression" in self.algorithm
        if compressed and self.model_bytes is not None and self.fragments:
            contributed = sum(v.contributed or 0 for v in self.learners)
            dense = 2 * contributed * self.model_bytes // self.fragments
        return Traffic(up, down, dense)

    @property
    def sync(self) -> SyncTotals:
        """The learners' sync-point counters, summed (see :class:`SyncTotals`)."""
        return SyncTotals(
            sync_points=sum(v.sync_points or 0 for v in self.learners),
            contributed=sum(v.contributed or 0 for v in self.learners),
            waited_s=sum(v.waited_s or 0.0 for v in self.learners),
            skipped=sum(v.skipped or 0 for v in self.learners),
            skipping=tuple(v.learner for v in self.learners if v.skipping),
            stalling=tuple(v.learner for v in self.learners if v.stalling),
        )


class RunWatcher:
    """Polls one run's mailbox and keeps what it read, so each poll reads only what is new.

    One poll at a time per watcher. ``clock`` must be monotonic; tests inject a fake one.
    A learner's ``waiting_fraction`` is measured over the last ``wait_window`` seconds of
    the beats this watcher saw (at least two of them).
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        lease_timeout: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        wait_window: float = 30.0,
    ) -> None:
        self._mailbox = mailbox
        self._clock = clock
        self._wait_window = wait_window
        # learner -> (observer clock, waited_s) at each new beat record, over the window
        self._waits: dict[str, deque[tuple[float, float]]] = {}
        self._leases = LeaseTracker(lease_timeout, clock)
        self._claim: CreatorClaim | None = None
        self._manifest: Manifest | None = None
        self._newest: int | None = None  # newest committed round, initial ones included
        self._per_fragment: dict[int, int] = {}
        self._totals: dict[int, Totals] = {}  # fragment -> its running totals, as read
        self._last_training: Commit | None = None
        self._commit_seen_at: float | None = None
        self._beats: dict[str, tuple[int, Beat | None]] = {}  # learner -> (beat, its record)
        self._reported_samples = 0
        self._changes: list[tuple[float, int]] = []  # last two (clock, samples) changes
        self._polling = False
        self._polls = 0  # polls started before the current one
        self._commit_seen_poll: int | None = None  # the poll that saw the newest commit
        self._first_beats: dict[str, int | None] = {}  # learner -> its beat at the first poll
        # A Moshpit run's group rounds (read only when the manifest names moshpit).
        self._groups = GroupWatcher(
            mailbox, clock=clock, decode=partial(_decode, decode_commit), batch=_BATCH
        )

    async def poll(self) -> RunView:
        """Read what is new in the mailbox and return the whole view."""
        if self._polling:
            raise RuntimeError("RunWatcher.poll is already running: poll one at a time")
        self._polling = True
        try:
            await self._read_heads()
            if self._manifest is not None:
                await self._read_rounds(self._manifest.num_fragments)
            if is_moshpit(self._manifest):
                seen = await self._groups.poll()
                if seen is not None:  # a newer group round: its commit's age starts now
                    self._commit_seen_at, self._commit_seen_poll = seen, self._polls
            self._leases.observe(await self._mailbox.list(LEASES))
            for learner, lease in self._leases.known().items():
                # A learner listed at the first poll: its beat's age is unknown until the
                # beat changes. One that appears later was seen arriving (None).
                self._first_beats.setdefault(learner, lease.beat if self._polls == 0 else None)
            await self._read_beats()
            snapshots = await self._mailbox.list(SNAPSHOTS)
            return self._view(snapshots, self._clock())
        finally:
            self._polls += 1
            self._polling = False

    async def _read_all(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self._mailbox.get(key) for key in keys)))

    async def _read_heads(self) -> None:
        # Both are created once and never change: read each until it exists, then never.
        if self._manifest is None:
            data = await self._mailbox.get(MANIFEST)
            if data is not None:
                self._manifest = _decode(decode_manifest, MANIFEST, data)
        if self._manifest is None and self._claim is None:
            data = await self._mailbox.get(CREATOR)
            if data is not None:
                self._claim = _decode(decode_creator, CREATOR, data)

    async def _read_rounds(self, fragments: int) -> None:
        # Rounds of different fragments may commit out of order (round 9 before round 8), so
        # the listing resumes after the oldest per-fragment newest commit, never after the
        # newest key seen, and skips what it already read.
        cursor = ""
        if len(self._per_fragment) == fragments:
            cursor = round_key(min(self._per_fragment.values()))
        new: dict[int, list[str]] = {}  # fragment -> its new keys, oldest first
        for key in await self._mailbox.list(ROUNDS, after=cursor):
            r = parse_round_key(key)
            if r > self._per_fragment.get(r % fragments, -1):
                new.setdefault(r % fragments, []).append(key)
        # The newest record of each fragment first: its totals stand for all before it.
        newest = [keys[-1] for keys in new.values()]
        untotalled: list[Commit] = []  # newest records without totals, applied last
        for start in range(0, len(newest), _BATCH):
            batch = newest[start : start + _BATCH]
            records = await self._read_all(batch)
            seen = self._clock()
            for key, data in zip(batch, records, strict=True):
                commit = self._decode_commit(key, data, fragments)
                if commit.running_totals(fragments) is None:
                    untotalled.append(commit)
                else:
                    self._apply(commit, fragments, seen)
        # A fragment whose newest record carries no totals (a run from before them): every
        # new record is read and counted, oldest first; the newest (already read) last.
        older = [key for commit in untotalled for key in new[commit.fragment][:-1]]
        for start in range(0, len(older), _BATCH):
            batch = older[start : start + _BATCH]
            records = await self._read_all(batch)
            seen = self._clock()
            for key, data in zip(batch, records, strict=True):
                self._apply(self._decode_commit(key, data, fragments), fragments, seen)
        seen = self._clock()
        for commit in untotalled:
            self._apply(commit, fragments, seen)

    @staticmethod
    def _decode_commit(key: str, data: bytes | None, fragments: int) -> Commit:
        commit = _decode(decode_commit, key, data)
        r = parse_round_key(key)
        if commit.fragment != r % fragments:
            raise ProtocolError(
                f"{key}: the record says fragment {commit.fragment}, but with "
                f"{fragments} fragments round {r} carries fragment {r % fragments}"
            )
        return commit

    def _apply(self, commit: Commit, fragments: int, seen: float) -> None:
        """Take ``commit`` in: the newest of its fragment read so far."""
        r = commit.round
        totals = commit.running_totals(fragments)
        if totals is None:  # a record from before totals: add it to the fragment's count
            totals = self._totals.get(commit.fragment, NO_TOTALS).after(commit.samples)
        self._totals[commit.fragment] = totals
        self._per_fragment[commit.fragment] = r
        if self._newest is None or r > self._newest:
            self._newest, self._commit_seen_at = r, seen
            self._commit_seen_poll = self._polls
        if r >= fragments and (self._last_training is None or r > self._last_training.round):
            self._last_training = commit  # commits may land out of order

    async def _read_beats(self) -> None:
        changed = [
            (lease.learner, lease.beat)
            for lease in self._leases.known().values()
            if self._beats.get(lease.learner, (None,))[0] != lease.beat
        ]
        keys = [beat_key(learner, beat) for learner, beat in changed]
        records = await self._read_all(keys)
        seen = self._clock()
        for (learner, beat), key, data in zip(changed, keys, records, strict=True):
            # A beat swept between the listing and this read leaves steps and samples unknown.
            record = None if data is None else _decode(decode_beat, key, data)
            if record is not None and record.learner != learner:
                raise ProtocolError(f"{key}: the record names learner {record.learner!r}")
            self._beats[learner] = (beat, record)
            if record is not None:
                self._note_wait(learner, seen, record.waited_s)

    def _note_wait(self, learner: str, seen: float, waited: float) -> None:
        points = self._waits.setdefault(learner, deque())
        if points and waited < points[-1][1]:
            points.clear()  # the counter went back: the learner restarted under its id
        points.append((seen, waited))
        while len(points) > 2 and seen - points[1][0] >= self._wait_window:
            points.popleft()

    def _waiting_fraction(self, learner: str) -> float | None:
        points = self._waits.get(learner)
        if not points or len(points) < 2:
            return None
        (t0, w0), (t1, w1) = points[0], points[-1]
        if t1 - t0 < 1.0:  # too short to tell (both beats seen by one or two close polls)
            return None
        return min(1.0, max(0.0, (w1 - w0) / (t1 - t0)))

    def _open_rounds(self, snapshots: Sequence[str]) -> dict[int, tuple[str, ...]]:
        found: dict[int, list[str]] = {}
        for key in snapshots:
            number, _, learner = key.removeprefix(SNAPSHOTS).partition("/")
            if not number.isdigit() or snapshot_key(int(number), learner) != key:
                continue  # not a snapshot (someone else's object): ignore rather than fail
            r = int(number)
            if self._newest is None or r > self._newest:  # commits are one ordered sequence
                found.setdefault(r, []).append(learner)
        return {r: tuple(learners) for r, learners in found.items()}

    def _view(self, snapshots: Sequence[str], now: float) -> RunView:
        live = self._leases.live()
        learners = []
        for learner, lease in sorted(self._leases.known().items()):
            beat = self._beats.get(learner, (None, None))[1]
            leaving = lease.leaving or (beat is not None and beat.leaving)
            is_live = learner in live and not leaving
            learners.append(
                LearnerView(
                    learner=learner,
                    live=is_live,
                    beat=lease.beat,
                    leaving=leaving,
                    steps=None if beat is None else beat.steps,
                    samples=None if beat is None else beat.samples,
                    seconds_since_beat=max(0.0, now - lease.changed_at),
                    sync_points=None if beat is None else beat.sync_points,
                    contributed=None if beat is None else beat.contributed,
                    waited_s=None if beat is None else beat.waited_s,
                    skipped=None if beat is None else beat.skipped,
                    bytes_up=None if beat is None else beat.bytes_up,
                    bytes_down=None if beat is None else beat.bytes_down,
                    waiting_fraction=self._waiting_fraction(learner) if is_live else None,
                    beat_age_known=self._first_beats.get(learner) != lease.beat,
                )
            )
        manifest, last = self._manifest, self._last_training
        # Each sample is in one round of every fragment: counted once, it is the mean.
        per = manifest.num_fragments if manifest else 1
        samples = sum(t.samples for t in self._totals.values()) // per
        if is_moshpit(manifest):  # no run-wide commit: what the learners' beats report
            samples = sum(v.samples or 0 for v in learners)
        if samples != self._reported_samples:
            self._changes = [*self._changes[-1:], (now, samples)]
            self._reported_samples = samples
        rate = None
        if len(self._changes) == 2:
            (t0, s0), (t1, s1) = self._changes
            rate = (s1 - s0) / (t1 - t0) if t1 > t0 else None
        creator = manifest.creator if manifest else self._claim.learner if self._claim else None
        rounds_committed = sum(t.rounds for t in self._totals.values())
        newest_round = last.round if last else None
        contributors = tuple(c.learner for c in last.contributors) if last else ()
        groups = None
        if manifest is not None and is_moshpit(manifest):
            groups = self._groups.view(manifest, {v.learner for v in learners if v.live})
            rounds_committed = groups.newest_round or 0
            newest_round = groups.newest_round
            contributors = self._groups.members(groups.newest_round)
        return RunView(
            exists=manifest is not None or self._claim is not None,
            creator=creator,
            fragments=manifest.num_fragments if manifest else None,
            algorithm=MappingProxyType(dict(manifest.algorithm)) if manifest else None,
            rounds_committed=rounds_committed,
            newest_round=newest_round,
            newest_per_fragment=MappingProxyType(dict(self._per_fragment)),
            last_contributors=contributors,
            samples_committed=samples,
            learners=tuple(learners),
            live_learners=sum(view.live for view in learners),
            open_rounds=MappingProxyType(self._open_rounds(snapshots)),
            seconds_since_commit=(
                None if self._commit_seen_at is None else max(0.0, now - self._commit_seen_at)
            ),
            samples_per_second=rate,
            commit_age_known=bool(self._commit_seen_poll),
            model_bytes=model_bytes(manifest),
            dtypes=model_dtypes(manifest),
            groups=groups,
        )


async def inspect_run(mailbox: Mailbox, *, lease_timeout: float = 15.0) -> RunView:
    """One-shot view of the run in ``mailbox`` (a fresh :class:`RunWatcher`, one poll).

    With a single poll, ``seconds_since_commit`` is 0.0 once any commit exists and
    ``samples_per_second`` is None: both need an observer that has watched for a while.
    """
    return await RunWatcher(mailbox, lease_timeout=lease_timeout).poll()
