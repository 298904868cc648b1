"""Moshpit group rounds over the mailbox: slots, group keys, closing a group, sweeping.

A Moshpit run (``algorithms/moshpit.py``) keeps its initial commit under ``rounds/`` as
every run does; its averaging happens in *group rounds* ``t = 1, 2, …``, each a set of
small groups that close independently (keys in ``wire/keys.py``):

- **Slots.** A joining learner claims ``grid/{slot}``, the smallest free number (a restart
  finds its own again): its first grid index is that slot's cell.
- **Publishing.** At a sync point a learner uploads its parameters and writes
  ``group-snapshots/{t}/{group}/{learner}`` (its grid index in the record); ``group`` is
  :func:`~gradientmail.algorithms.moshpit.group_key` of its index in round ``t``.
- **Closing.** A member closes its group once every member it expects has published (the
  live slot holders whose cell lies on the group's line: with dense slots that is the whole
  group), or ``round_timeout`` after it published, with whoever came (the paper's variable
  group sizes). It claims ``group-claims/{t}/{group}/{attempt}`` with the run's
  claim-with-failover rule (``coord/election.py``); the winner sums the members' payloads
  (``engine/sums.py``, sample-weighted, learner-id order), uploads the average and writes
  ``group-rounds/{t}/{group}``, a :class:`~gradientmail.wire.Commit` with ``group`` set. A
  member that finds the record applies it; a learner that is not in it (it came late)
  keeps its own parameters and moves on to the newest round under way. A group of one
  commits its member's own payload: nothing is uploaded or downloaded.
- **Sweeping.** One closer of round ``t`` (its group is the line through cell 0) deletes
  round ``t - keep_rounds - grid_dims - 1`` and older ones left unswept, whole (records,
  claims, payloads no newer record or snapshot names), the way ``coord/sweep.py`` does
  for ``rounds/``; the newest group commits stay for ``align`` and late joiners. Groups
  close apart, so learners can be up to ``grid_dims`` rounds behind the sweeper with
  their groups open: those rounds are kept. A learner that fell further behind (its group
  closed without it by ``round_timeout``) finds its own snapshot swept, and a member that
  finds its group's record unreadable can never read it: both move on as from a missed
  group (:class:`GroupLost`).

Which round a learner publishes to: the one after the group round it last took part in;
after a round it missed, the newest round anyone has published to (so a learner that fell
behind catches up instead of arriving late for ever).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.moshpit import Moshpit, group_key, initial_index, next_index
from gradientmail.coord.election import abandoned, claim, read_holder
from gradientmail.coord.leases import LeaseTracker
from gradientmail.coord.retry import retrying
from gradientmail.engine.layout import ModelLayout
from gradientmail.engine.sums import Member, Unusable, weighted_sums
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, put_tensors
from gradientmail.wire.parts import blob_keys

__all__ = [
    "GroupLost",
    "GroupOutcome",
    "GroupRounds",
    "aligned",
    "average_of",
    "describe_alignment",
    "newest_group_round",
]

_log = logging.getLogger("gradientmail")

_MAX_ATTEMPT = 10**4 - 1
_SLOT_TRIES = 64  # slots tried in one pass of a join (others may be claiming the same)
_MAX_WATCHES = 256
_SWEEP_ROUNDS = 8  # group rounds one sweep deletes, at most (the newest old one, leftovers)


class GroupLost(ProtocolError):
    """The group round a learner published to cannot give it a commit any more: it was
    swept before the learner saw the group's commit (it fell behind by more than the rounds
    kept), or the group's record cannot be read (create-once: retrying cannot mend it). Its
    contribution is lost, its parameters stay as they were, and it moves on."""


@dataclass(frozen=True)
class GroupOutcome:
    """A group round's record as this learner found it. ``params``: the new parameters
    when this learner has them already (it closed the group, or was alone in it); None when
    they are to be downloaded. ``member``: whether this learner is in the record."""

    commit: p.Commit
    params: dict[str, torch.Tensor] | None
    member: bool


@dataclass
class _Watch:
    first_seen: float
    claim_seen: dict[int, float] = field(default_factory=dict)
    holders: dict[int, str] = field(default_factory=dict)


class GroupRounds:
    """One learner's side of the group rounds (module docstring); the communication thread
    of a Session calls it. ``clock`` measures every wait."""

    def __init__(
        self,
        box: Mailbox,
        layout: ModelLayout,
        algorithm: Moshpit,
        learner: str,
        tracker: LeaseTracker,
        *,
        round_timeout: float,
        claim_timeout: float,
        keep_rounds: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.box = box
        self.layout = layout
        self.algorithm = algorithm
        self.learner = learner
        self.tracker = tracker
        self.round_timeout = round_timeout
        self.claim_timeout = claim_timeout
        self.keep_rounds = keep_rounds
        self.clock = clock
        self.slot: int | None = None
        self.index: tuple[int, ...] = ()
        self.last_round = 0  # the newest group round this learner took part in (or loaded)
        self.missed = False  # its last contribution came after its group closed
        self._slots: dict[int, str] = {}  # slot -> learner, as read (slots are create-once)
        self._watch: dict[tuple[int, str], _Watch] = {}

    # -- joining -----------------------------------------------------------------------------

    async def join(self) -> int:
        """Claim this learner's slot (or find the one an earlier life claimed); its grid
        index starts at the slot's cell. Returns the slot."""
        for _ in range(1 + 10**6 // _SLOT_TRIES):
            await self._read_slots()
            mine = [slot for slot, learner in self._slots.items() if learner == self.learner]
            if mine:
                self.slot = min(mine)
                break
            free = next(s for s in range(len(self._slots) + 1) if s not in self._slots)
            won = await claim(
                self.box,
                p.grid_key(free),
                p.encode(p.Claim(self.learner)),
                self.learner,
                self._slot_holder,
            )
            if won:
                self._slots[free] = self.learner
                self.slot = free
                break
        if self.slot is None:  # pragma: no cover - a million slots taken
            raise ProtocolError("no free grid slot below 10**6")
        a = self.algorithm
        self.index = initial_index(self.slot, a.group_size, a.grid_dims)
        return self.slot

    async def _slot_holder(self, key: str) -> str:
        data = await retrying(partial(self.box.get, key))
        return "" if data is None else p.decode_claim(key, data).learner

    async def _read_slots(self) -> None:
        """Learn the slots claimed since the last look (each record is read once)."""
        # The whole listing (a slot can appear after a greater one: two learners raced for
        # it and the loser took the next); only the records not read yet are read.
        keys = await retrying(partial(self.box.list, p.GRID))
        for key in keys:
            try:
                slot = p.parse_grid_key(key)
            except ProtocolError:
                continue
            if slot in self._slots:
                continue
            data = await retrying(partial(self.box.get, key))
            if data is None:
                continue
            try:
                self._slots[slot] = p.decode_claim(key, data).learner
            except ProtocolError as exc:
                _log.warning("%s: an unreadable slot claim is nobody's (%s)", key, exc)
                self._slots[slot] = ""

    # -- publishing --------------------------------------------------------------------------

    async def next_round(self) -> int:
        """The group round this learner's next contribution goes to (module docstring)."""
        t = self.last_round + 1
        if self.missed:
            keys = await retrying(
                partial(self.box.list, p.GROUP_SNAPSHOTS, after=p.group_snapshots_prefix(t))
            )
            rounds = [r for r in map(p.group_round_of, keys) if r is not None]
            t = max([t, *rounds])
        return t

    def group(self, t: int) -> str:
        return group_key(self.index, t)

    # -- closing -----------------------------------------------------------------------------

    def _expected(self, t: int, group: str) -> set[str]:
        a = self.algorithm
        cells = {
            learner
            for slot, learner in self._slots.items()
            if learner and group_key(initial_index(slot, a.group_size, a.grid_dims), t) == group
        }
        return {learner for learner in cells if self.tracker.is_live(learner)} | {self.learner}

    async def try_close(
        self, t: int, group: str, own_payload: str, own: Mapping[str, torch.Tensor]
    ) -> GroupOutcome | None:
        """One look at group ``group`` of round ``t``, which this learner published to: its
        record when there is one (closing it first when this learner may); None while the
        group is still open or someone else's claim holds it."""
        key = p.group_round_key(t, group)
        watch = self._watch.get((t, group))
        if watch is None:
            watch = self._watch[(t, group)] = _Watch(self.clock())
            while len(self._watch) > _MAX_WATCHES:
                del self._watch[min(self._watch)]
        found = await self._record(key, own)
        if found is not None:
            return found
        snaps = await retrying(partial(self.box.list, p.group_snapshots_prefix(t, group)))
        members = {k.rpartition("/")[2] for k in snaps}
        if self.learner not in members:
            # Its own snapshot is gone: the round was swept while this learner was behind
            # (its group closed without it, by round_timeout, and the others went on).
            # Nothing of it can commit now; the caller moves on as from a missed group.
            self._lost(t, group)
            raise GroupLost(f"group {group} of round {t} was swept before it closed")
        await self._read_slots()
        waited = self.clock() - watch.first_seen
        if not (self._expected(t, group) <= members or waited >= self.round_timeout):
            return None
        attempt = await self._claim(t, group, watch)
        if attempt is None:
            return None
        return await self._close(t, group, attempt, snaps, own_payload, own)

    async def _record(self, key: str, own: Mapping[str, torch.Tensor]) -> GroupOutcome | None:
        data = await retrying(partial(self.box.get, key))
        if data is None:
            return None
        try:
            commit = p.decode_commit(key, data)
        except ProtocolError as exc:
            t, group = p.parse_group_round_key(key)
            self._lost(t, group)
            raise GroupLost(
                f"group {group} of round {t}: its record cannot be read ({exc})"
            ) from exc
        self._watch.pop((commit.round, commit.group or ""), None)
        return self._outcome(commit, None)

    def _lost(self, t: int, group: str) -> None:
        """Group round ``t`` will never give this learner a commit: it moves on."""
        self.last_round = max(self.last_round, t)
        self.missed = True
        self._watch.pop((t, group), None)

    def _outcome(self, commit: p.Commit, params: dict[str, torch.Tensor] | None) -> GroupOutcome:
        """Record what a group round means for this learner: a member moves its grid index
        on (:func:`next_index`, from the members' indices in the record) and its round; a
        learner left out catches up from the next round (``missed``)."""
        member = any(c.learner == self.learner for c in commit.contributors)
        self.last_round = max(self.last_round, commit.round)
        self.missed = not member
        if member:
            members = [(c.learner, c.grid) for c in commit.contributors if c.grid is not None]
            if any(learner == self.learner for learner, _ in members):
                self.index = next_index(
                    self.index, commit.round, members, self.learner, self.algorithm.group_size
                )
        return GroupOutcome(commit, params, member)

    async def _claim(self, t: int, group: str, watch: _Watch) -> int | None:
        listed = await retrying(partial(self.box.list, p.group_claims_prefix(t, group)))
        attempt = 0
        if listed:
            newest = listed[-1]
            attempt = p.parse_claim_attempt(newest)
            holder = await self._holder(watch, newest, attempt)
            now = self.clock()
            held = now - watch.claim_seen.setdefault(attempt, now)
            if holder == self.learner:
                return attempt
            if not abandoned(
                held=held,
                live=self.tracker.is_live(holder),
                lease_timeout=self.tracker.lease_timeout,
                deadline=self.claim_timeout,
            ):
                return None
            attempt += 1
            if attempt > _MAX_ATTEMPT:
                raise ProtocolError(f"group {group} of round {t}: every claim attempt is used")
            _log.warning(
                "group %s of round %d: claim %d of %s not honoured any longer (%.1f s); "
                "claiming %d",
                group,
                t,
                attempt - 1,
                holder or "an unreadable claim",
                held,
                attempt,
            )
        won = await claim(
            self.box,
            p.group_claim_key(t, group, attempt),
            p.encode(p.Claim(self.learner)),
            self.learner,
            partial(self._holder, watch, attempt=attempt),
        )
        watch.claim_seen.setdefault(attempt, self.clock())
        if won:
            watch.holders[attempt] = self.learner
            return attempt
        return None

    async def _holder(self, watch: _Watch, key: str, attempt: int) -> str:
        return await read_holder(self.box, key, watch.holders, attempt)

    async def _close(
        self,
        t: int,
        group: str,
        attempt: int,
        snaps: Sequence[str],
        own_payload: str,
        own: Mapping[str, torch.Tensor],
    ) -> GroupOutcome:
        usable, excluded = await read_members(self.box, t, group, snaps)
        params, listed, more = await average_of(
            self.box, self.algorithm, self.layout, usable, self.learner, own_payload, own
        )
        excluded += more
        mine: dict[str, torch.Tensor] | None = params
        if len(listed) == 1 and listed[0].learner == self.learner:
            key = own_payload  # alone: its own payload is the average (recomputes to it)
            mine = None
        else:
            key, _ = await retrying(partial(put_tensors, self.box, params))
        commit = p.Commit(
            round=t,
            fragment=0,
            base=None,
            contributors=tuple(listed),
            params=key,
            momentum=None,
            closer=self.learner,
            attempt=attempt,
            excluded=tuple(excluded),
            group=group,
        )
        record = p.group_round_key(t, group)
        if not await retrying(partial(self.box.put_if_absent, record, p.encode(commit))):
            existing = p.decode_commit(record, await retrying(partial(self.box.get, record)))
            if existing != commit:
                # Another closer committed first: adopt its record, drop our upload.
                if key != own_payload and key not in {c.payload for c in existing.contributors}:
                    with contextlib.suppress(Exception):
                        if key != existing.params:
                            await self.box.delete([key])
                return self._outcome(existing, None)
        self._watch.pop((t, group), None)
        return self._outcome(commit, mine)

    # -- sweeping ----------------------------------------------------------------------------

    async def sweep(self, t: int, group: str) -> list[int]:
        """Delete old group rounds (module docstring) after closing ``group`` of round ``t``;
        the rounds swept. One closer per round sweeps, the one whose group is the line
        through cell 0 (every closer of a round repeating it would make each learner's
        requests grow with N); it also sweeps older rounds left unswept (claims are
        deleted last, so a round with claims is not swept yet), a bounded number per call.

        Groups run apart: a learner in round ``t`` proves only that the learners it met in
        the ``grid_dims`` rounds before are near; others can be up to ``grid_dims`` rounds
        behind with their groups still open. So round ``t - keep_rounds - grid_dims - 1``
        is the newest one swept. Payloads are content-addressed: one that a newer record or
        snapshot also names (a learner that did not train between two rounds sends the
        same bytes) is kept."""
        a = self.algorithm
        if group != group_key((0,) * a.grid_dims, t):
            return []
        old = t - self.keep_rounds - a.grid_dims - 1
        if old < 1:
            return []
        claimed = await retrying(partial(self.box.list, p.GROUP_CLAIMS))
        doomed = sorted({r for r in map(p.group_round_of, claimed) if r is not None and r <= old})
        doomed = doomed[:_SWEEP_ROUNDS]
        if not doomed:
            return []
        # What newer rounds name: their records and their snapshots (open groups too).
        newer = await retrying(
            partial(self.box.list, p.GROUP_ROUNDS, after=p.group_round_prefix(doomed[-1] + 1))
        )
        newer_snaps = await retrying(
            partial(
                self.box.list,
                p.GROUP_SNAPSHOTS,
                after=p.group_snapshots_prefix(doomed[-1] + 1),
            )
        )
        kept = await self._payloads_named(
            [k for k in newer if (p.group_round_of(k) or 0) > doomed[-1]],
            [k for k in newer_snaps if (p.group_round_of(k) or 0) > doomed[-1]],
        )
        for r in doomed:
            records = await retrying(partial(self.box.list, p.group_round_prefix(r)))
            snaps = await retrying(partial(self.box.list, p.group_snapshots_prefix(r)))
            named = await self._payloads_named(records, snaps)
            blobs = await blob_keys(self.box, named - kept) - await blob_keys(self.box, kept)
            claims = await retrying(partial(self.box.list, p.group_claims_prefix(r)))
            # Payloads first, records after, claims last: a record never names a deleted
            # payload for longer than the sweep takes, and a round with claims left is
            # known unswept.
            for batch in (sorted(blobs), snaps, records, claims):
                if batch:
                    await retrying(partial(self.box.delete, list(batch)))
        return doomed

    async def _payloads_named(self, records: Sequence[str], snaps: Sequence[str]) -> set[str]:
        """The payload keys that group records and group snapshots name."""
        named: set[str] = set()
        for key in [*records, *snaps]:
            data = await retrying(partial(self.box.get, key))
            if data is None:
                continue
            with contextlib.suppress(ProtocolError):
                if key.startswith(p.GROUP_ROUNDS):
                    named |= _named(p.decode_commit(key, data))
                else:
                    named.add(p.decode_snapshot(key, data).payload)
        return named


def _named(commit: p.Commit) -> set[str]:
    return {commit.params, *(c.payload for c in commit.contributors)}


async def read_members(
    box: Mailbox, t: int, group: str, snaps: Sequence[str]
) -> tuple[list[p.Snapshot], list[p.Exclusion]]:
    """The group's snapshot records that name a usable contribution, and those excluded."""
    records = await asyncio.gather(*(retrying(partial(box.get, key)) for key in snaps))
    usable: list[p.Snapshot] = []
    excluded: list[p.Exclusion] = []
    for key, data in zip(snaps, records, strict=True):
        try:
            snap = p.decode_snapshot(key, data)
            if snap.learner != key.rpartition("/")[2]:
                raise ProtocolError(f"{key}: the record names learner {snap.learner!r}")
            if snap.round != t:
                raise ProtocolError(f"{key}: the record says round {snap.round}")
        except ProtocolError as exc:
            excluded.append(p.Exclusion(key.rpartition("/")[2], key, f"{exc}"[:300]))
            continue
        usable.append(snap)
    return usable, excluded


async def average_of(
    box: Mailbox,
    algorithm: Moshpit,
    layout: ModelLayout,
    members: Sequence[p.Snapshot],
    closer: str | None,
    own_payload: str | None = None,
    own: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], list[p.Contribution], list[p.Exclusion]]:
    """The members' sample-weighted average (learner-id order, float32 sums, then the
    parameters' dtypes), the contributions it holds and the members excluded because their
    payload failed (the average is taken again without them)."""
    specs = layout.specs[0]
    buffers = layout.buffer_names(0)
    ordered = sorted(members, key=lambda s: s.learner)
    excluded: list[p.Exclusion] = []
    like = {
        spec.name: torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype.split(".")[-1]))
        for spec in specs
    }
    for _ in range(len(ordered) + 1):
        if not ordered:
            raise ProtocolError(
                "no usable member in the group" + "".join(f"; {x.reason}" for x in excluded)
            )
        sums = {
            spec.name: torch.zeros(spec.shape, dtype=torch.float32).contiguous() for spec in specs
        }
        listed = [
            Member(
                s.learner,
                s.samples,
                s.payload,
                own if s.learner == closer and s.payload == own_payload else None,
            )
            for s in ordered
        ]
        try:
            await weighted_sums(box, algorithm, specs, buffers, listed, closer, sums)
        except Unusable as failed:
            bad = ordered[failed.index]
            excluded.append(p.Exclusion(bad.learner, bad.payload, f"{failed.cause}"[:300]))
            _log.warning("group member %s excluded: %s", bad.learner, failed.cause)
            ordered = [s for s in ordered if s is not bad]
            continue
        with torch.no_grad():
            params, _ = algorithm.finish(like, None, sums, buffer_names=buffers)
        listed_ = [p.Contribution(s.learner, s.samples, s.payload, s.grid) for s in ordered]
        return params, listed_, excluded
    raise AssertionError("unreachable: every pass excludes one member")


async def newest_group_round(box: Mailbox) -> list[p.Commit]:
    """The commits of the newest group round that has any (empty when none)."""
    keys = await retrying(partial(box.list, p.GROUP_ROUNDS))
    rounds = sorted({t for t in map(p.group_round_of, keys) if t is not None})
    for t in reversed(rounds[-4:]):
        commits = []
        for key in (k for k in keys if p.group_round_of(k) == t):
            data = await retrying(partial(box.get, key))
            if data is None:
                continue
            with contextlib.suppress(ProtocolError):
                commits.append(p.decode_commit(key, data))
        if commits:
            return commits
    return []


async def download_average(
    box: Mailbox, algorithm: Moshpit, layout: ModelLayout, commits: Sequence[p.Commit]
) -> dict[str, torch.Tensor]:
    """The sample-weighted average of group commits' parameters (``align``'s and a late
    joiner's model): each commit weighs as the samples of its members."""
    members = [
        p.Snapshot(c.round, f"g{i:04d}", max(1, c.samples), c.params, 0)
        for i, c in enumerate(sorted(commits, key=lambda c: c.group or ""))
    ]
    if len(members) == 1:
        return await retrying(partial(get_tensors, box, members[0].payload, layout.specs[0]))
    params, _, excluded = await average_of(box, algorithm, layout, members, None)
    if excluded:
        raise ProtocolError("a group commit's payload cannot be read: " + excluded[0].reason)
    return params


def describe_alignment(commits: Sequence[p.Commit]) -> str:
    """What :func:`aligned` loads from ``commits`` (one group round's), in words."""
    if not commits:
        return "the initial commit (no group round has committed yet)"
    t = commits[0].round
    members = sum(len(c.contributors) for c in commits)
    if len({c.params for c in commits}) == 1:
        return (
            f"group round {t}'s commit, which all its {len(commits)} groups ({members} "
            "learners) share: the global average"
        )
    return (
        f"the sample-weighted average of group round {t}'s {len(commits)} group commits "
        f"({members} learners)"
    )


async def aligned(
    box: Mailbox, algorithm: Moshpit, layout: ModelLayout
) -> tuple[list[p.Commit], dict[str, torch.Tensor] | None]:
    """A Moshpit run's aligned model: the newest group round's commits and their
    sample-weighted average, or their shared parameters when every group of the round
    committed the same (the grid has averaged everyone: the global average, loaded as it
    is); ``([], None)`` before the first group round."""
    commits = await newest_group_round(box)
    if not commits:
        return [], None
    if len({c.params for c in commits}) == 1:
        params = await retrying(partial(get_tensors, box, commits[0].params, layout.specs[0]))
        return commits, params
    return commits, await download_average(box, algorithm, layout, commits)
