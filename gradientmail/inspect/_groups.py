"""The Moshpit part of :mod:`gradientmail.inspect`: a run's group rounds, read-only.

A Moshpit run (manifest algorithm ``moshpit``, ``algorithms/moshpit.py``) has no run-wide
rounds after its initial commit. :class:`GroupWatcher` reads what it has instead and
:class:`GroupsView` (``RunView.groups``) shows it: the newest group rounds with a commit,
how many groups committed in each and their sizes, the newest group round each learner
published a snapshot to (its version) and their spread, groups still open, grid slots.

A poll lists ``group-rounds/`` and ``group-snapshots/`` from a few rounds behind the newest
seen (:data:`GROUP_WINDOW`) and ``grid/``, and reads each new group commit record of the
newest rounds once (small records: no payload is read). Memory stays bounded: the records
of the newest ``2 * GROUP_WINDOW`` rounds are kept. Like the rest of the view it only
reads (``get`` and ``list``) and imports no torch.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gradientmail import wire as p
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.settings import exchange_kind

__all__ = ["GROUP_WINDOW", "GroupRoundView", "GroupWatcher", "GroupsView", "is_moshpit"]

# The newest this many group rounds (with a commit) are shown, and each poll lists again
# from this many rounds behind the newest seen (a group of an older round may still close
# late; a learner that fell behind may still publish to one).
GROUP_WINDOW = 4
_GROUP_MEMORY = 2 * GROUP_WINDOW  # group rounds whose records the watcher keeps in memory


def is_moshpit(manifest: p.Manifest | None) -> bool:
    """Whether the run exchanges its rounds in Moshpit groups rather than run-wide rounds
    (the settings registry says, :func:`gradientmail.settings.exchange_kind`); False before
    there is a manifest, and for an algorithm this release does not know (its rounds are
    read as run-wide ones)."""
    return manifest is not None and exchange_kind(manifest.algorithm.get("name")) == "groups"


@dataclass(frozen=True)
class GroupRoundView:
    """One group round of a Moshpit run, from its group commits (``group-rounds/{t}/``)
    the watcher read: how many groups committed, their sizes (members each, ascending),
    and the samples they hold."""

    round: int
    sizes: tuple[int, ...]  # members of each group commit, ascending
    samples: int  # the commits' samples, summed

    @property
    def groups(self) -> int:
        return len(self.sizes)

    @property
    def learners(self) -> int:
        """Learners that were in a group of this round (each is in at most one)."""
        return sum(self.sizes)

    @property
    def min_size(self) -> int:
        return min(self.sizes, default=0)

    @property
    def max_size(self) -> int:
        return max(self.sizes, default=0)

    @property
    def median_size(self) -> float:
        return float(statistics.median(self.sizes)) if self.sizes else 0.0


@dataclass(frozen=True)
class GroupsView:
    """A Moshpit run's group rounds (``algorithms/moshpit.py``), read by listing keys and
    reading the small group commit records of the newest rounds (never a payload).

    ``versions``: each learner's newest group round it published a snapshot to, as the
    listings of ``group-snapshots/`` showed them (a round the sweep removed before this
    watcher listed it is not seen). ``spread``: among the live learners with a version,
    the newest minus the oldest (0 when they are all in the same round; None when no live
    learner has published yet). ``open_groups``: of the recent rounds (the newest
    GROUP_WINDOW seen, and any newer one under way), the groups that have snapshots but no
    commit yet: still open, or closed by nobody."""

    group_size: int
    grid_dims: int
    slots: int  # grid slots claimed (grid/): learners that ever joined, restarts not counted
    newest_round: int | None  # the newest group round with a commit
    rounds: tuple[GroupRoundView, ...]  # the newest GROUP_WINDOW rounds with commits, oldest first
    versions: Mapping[str, int]
    spread: int | None
    open_groups: Mapping[int, tuple[str, ...]]

    @property
    def newest(self) -> GroupRoundView | None:
        return self.rounds[-1] if self.rounds else None

    @property
    def grid_cells(self) -> int:
        return int(self.group_size**self.grid_dims)

    def describe(self) -> str:
        """One line: ``round 12, 4 groups of 2–4 (median 4), versions spread 1``."""
        newest = self.newest
        if newest is None:
            return "no group round committed yet"
        sizes = (
            str(newest.min_size)
            if newest.min_size == newest.max_size
            else f"{newest.min_size}–{newest.max_size} (median {newest.median_size:g})"
        )
        spread = "—" if self.spread is None else str(self.spread)
        plural = "group" if newest.groups == 1 else "groups"
        return (
            f"round {newest.round}, {newest.groups} {plural} of {sizes}, versions spread {spread}"
        )


def _forget_before(rounds: dict[int, Any], newest: int | None) -> None:
    """Drop the rounds of ``rounds`` more than _GROUP_MEMORY behind ``newest``."""
    if newest is not None:
        for t in [t for t in rounds if t <= newest - _GROUP_MEMORY]:
            del rounds[t]


def _setting(manifest: p.Manifest, name: str) -> int:
    value = manifest.algorithm.get(name)
    return value if isinstance(value, int) else 0


class GroupWatcher:
    """What :class:`gradientmail.inspect.RunWatcher` reads of a Moshpit run's group rounds,
    kept between polls. One poll at a time (the RunWatcher's).

    ``decode`` turns a group commit's key and bytes into the record, naming the key in
    any failure (:class:`ProtocolError`); ``batch`` records are read concurrently.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        clock: Callable[[], float],
        decode: Callable[[str, bytes | None], p.Commit],
        batch: int,
    ) -> None:
        self._mailbox = mailbox
        self._clock = clock
        self._decode = decode
        self._batch = batch
        # round -> group -> (its members, its samples), of the group commits read
        self._commits: dict[int, dict[str, tuple[tuple[str, ...], int]]] = {}
        self._newest: int | None = None  # newest group round with a commit read
        self._snaps: dict[int, set[str]] = {}  # round -> groups with snapshots listed
        self._snap_newest: int | None = None  # newest group round with a snapshot listed
        self._versions: dict[str, int] = {}  # learner -> newest group round it published to
        self._slots = 0

    async def poll(self) -> float | None:
        """Read the group commit records not read yet of the newest rounds (each once),
        and list snapshots and slots (keys only). Each listing starts GROUP_WINDOW rounds
        behind the newest seen, so a poll lists what is new and what may still change; a
        first poll lists everything stored (the learners' sweep keeps a few rounds) and
        reads the records of the newest rounds.

        Returns the clock when this poll first saw the newest group round's commit (None
        when it saw no newer round than before)."""
        seen_at = await self._read_commits()
        await self._list_snapshots()
        slots = 0
        for key in await self._mailbox.list(p.GRID):
            try:
                p.parse_grid_key(key)
            except ProtocolError:
                continue  # not a slot claim (someone else's object): ignore it
            slots += 1
        self._slots = slots
        # Memory stays bounded: the newest _GROUP_MEMORY rounds of each.
        _forget_before(self._commits, self._newest)
        _forget_before(self._snaps, self._snap_newest)
        return seen_at

    async def _read_commits(self) -> float | None:
        newest = self._newest
        after = "" if newest is None else p.group_round_prefix(max(1, newest - GROUP_WINDOW + 1))
        found: dict[int, list[str]] = {}
        for key in await self._mailbox.list(p.GROUP_ROUNDS, after=after):
            try:
                t, group = p.parse_group_round_key(key)
            except ProtocolError:
                continue  # not a group commit (someone else's object): ignore it
            if group not in self._commits.get(t, {}):
                found.setdefault(t, []).append(key)
        if not found:
            return None
        seen_at = None
        top = max(found) if newest is None else max(newest, *found)
        keys = [k for t, ks in sorted(found.items()) if t > top - _GROUP_MEMORY for k in ks]
        for start in range(0, len(keys), self._batch):
            batch = keys[start : start + self._batch]
            records = await asyncio.gather(*(self._mailbox.get(key) for key in batch))
            seen = self._clock()
            for key, data in zip(batch, records, strict=True):
                if data is None:
                    continue  # swept since the listing
                commit = self._decode(key, data)  # checks the key against the record
                members = tuple(c.learner for c in commit.contributors)
                t = commit.round
                self._commits.setdefault(t, {})[commit.group or ""] = (members, commit.samples)
                if self._newest is None or t > self._newest:
                    self._newest, seen_at = t, seen
        return seen_at

    async def _list_snapshots(self) -> None:
        top = self._snap_newest
        after = "" if top is None else p.group_snapshots_prefix(max(1, top - GROUP_WINDOW + 1))
        for key in await self._mailbox.list(p.GROUP_SNAPSHOTS, after=after):
            try:
                t, group, learner = p.parse_group_snapshot_key(key)
            except ProtocolError:
                continue
            self._versions[learner] = max(t, self._versions.get(learner, 0))
            self._snaps.setdefault(t, set()).add(group)
            if self._snap_newest is None or t > self._snap_newest:
                self._snap_newest = t

    def members(self, t: int | None) -> tuple[str, ...]:
        """The learners in the groups of round ``t`` that committed, sorted."""
        groups = self._commits.get(t or 0, {}).values()
        return tuple(sorted(learner for members, _ in groups for learner in members))

    def view(self, manifest: p.Manifest, live: set[str]) -> GroupsView:
        """The view of what was read; ``live``: the learners live now (for the spread)."""
        committed = sorted(self._commits)[-GROUP_WINDOW:]
        rounds = tuple(
            GroupRoundView(
                round=t,
                sizes=tuple(sorted(len(m) for m, _ in self._commits[t].values())),
                samples=sum(samples for _, samples in self._commits[t].values()),
            )
            for t in committed
        )
        oldest = committed[0] if committed else 1
        open_groups = {
            t: tuple(sorted(groups - set(self._commits.get(t, {}))))
            for t, groups in sorted(self._snaps.items())
            if t >= oldest and groups - set(self._commits.get(t, {}))
        }
        known = [t for learner, t in self._versions.items() if learner in live]
        return GroupsView(
            group_size=_setting(manifest, "group_size"),
            grid_dims=_setting(manifest, "grid_dims"),
            slots=self._slots,
            newest_round=self._newest,
            rounds=rounds,
            versions=MappingProxyType(dict(sorted(self._versions.items()))),
            spread=max(known) - min(known) if known else None,
            open_groups=MappingProxyType(open_groups),
        )
