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
  claim-with-failover loop (``coord/claims.py``); the winner sums the members' payloads
  (``engine/members.py``, sample-weighted, learner-id order), uploads the average and writes
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

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.moshpit import Moshpit, group_key, initial_index, next_index
from gradientmail.coord.claims import HOLD, ClaimSeries, Verdict, closer_claims, judged
from gradientmail.coord.election import claim
from gradientmail.coord.leases import LeaseTracker
from gradientmail.coord.retry import retrying
from gradientmail.coord.sweep import group_horizon
from gradientmail.engine.adopt import write_or_adopt
from gradientmail.engine.layout import ModelLayout
from gradientmail.engine.members import Listed, read_members, sum_members
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.payload import put_tensors
from gradientmail.wire.parts import blob_keys

__all__ = [
    "GroupLost",
    "GroupOutcome",
    "GroupRounds",
    "average_of",
]

_log = logging.getLogger("gradientmail")

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


@dataclass(frozen=True)
class _Watch:
    first_seen: float
    claims: ClaimSeries  # the group's closer claims, as this learner watched them


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
            claims = closer_claims(
                self.box,
                self.learner,
                partial(p.group_claim_key, t, group),
                what=f"group {group} of round {t}",
                clock=self.clock,
            )
            watch = self._watch[(t, group)] = _Watch(self.clock(), claims)
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
        newest = p.parse_claim_attempt(listed[-1]) if listed else None

        async def decide(attempt: int, holder: str | None, held: float) -> Verdict:
            if holder == self.learner:
                return HOLD
            return judged(self.tracker, holder, held, deadline=self.claim_timeout)

        return await watch.claims.take(newest, decide)

    async def _close(
        self,
        t: int,
        group: str,
        attempt: int,
        snaps: Sequence[str],
        own_payload: str,
        own: Mapping[str, torch.Tensor],
    ) -> GroupOutcome:
        usable, excluded = await read_members(self.box, snaps, t)
        params, listed = await _average(
            self.box,
            self.algorithm,
            self.layout,
            usable,
            excluded,
            self.learner,
            (own_payload, own),
            f"group {group} of round {t}",
        )
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
        found, won = await write_or_adopt(self.box, p.group_round_key(t, group), commit)
        if not won:  # another closer committed first: adopt its record
            return self._outcome(found, None)
        self._watch.pop((t, group), None)
        return self._outcome(found, mine)

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
        old = group_horizon(t, self.keep_rounds, behind=a.grid_dims + 1)
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


async def average_of(
    box: Mailbox,
    algorithm: Moshpit,
    layout: ModelLayout,
    members: Sequence[p.Snapshot],
    closer: str | None,
) -> tuple[dict[str, torch.Tensor], list[p.Contribution], list[p.Exclusion]]:
    """The members' sample-weighted average (learner-id order, float32 sums, then the
    parameters' dtypes), the contributions it holds and the members excluded because their
    payload failed (each listed under its payload key; the average is taken again without
    them)."""
    excluded: list[p.Exclusion] = []
    listed = [(s.payload, s) for s in members]
    params, contributions = await _average(
        box, algorithm, layout, listed, excluded, closer, None, "the group"
    )
    return params, contributions, excluded


async def _average(
    box: Mailbox,
    algorithm: Moshpit,
    layout: ModelLayout,
    usable: Sequence[Listed],
    excluded: list[p.Exclusion],
    closer: str | None,
    own: tuple[str, Mapping[str, torch.Tensor]] | None,
    what: str,
) -> tuple[dict[str, torch.Tensor], list[p.Contribution]]:
    """:func:`average_of` of members read with their snapshot keys (its exclusions are
    added to ``excluded``)."""
    specs = layout.specs[0]
    buffers = layout.buffer_names(0)
    sums, ordered = await sum_members(
        box,
        algorithm,
        specs,
        buffers,
        usable,
        excluded,
        closer=closer,
        own=own,
        out=partial(_zeros, specs, torch.float32),
        what=what,
    )
    with torch.no_grad():
        params, _ = algorithm.finish(_zeros(specs), None, sums, buffer_names=buffers)
    return params, [p.Contribution(s.learner, s.samples, s.payload, s.grid) for _, s in ordered]


def _zeros(
    specs: Sequence[p.TensorSpec], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Zeros shaped as ``specs``, in ``dtype`` (default: each spec's own), contiguous."""
    return {
        spec.name: torch.zeros(
            spec.shape, dtype=dtype or getattr(torch, spec.dtype.split(".")[-1])
        ).contiguous()
        for spec in specs
    }
