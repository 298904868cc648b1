"""A round's members: reading and validating their snapshots, excluding the unusable ones,
summing with retry, and checking a record's member list. One home for what a round closer,
a group closer and ``verify`` share.

- :func:`read_members`: the snapshot records listed for a round (or a group), those that
  name a usable contribution and the :class:`~gradientmail.wire.Exclusion` of each other.
- :func:`sum_members`: their weighted sums (``engine/sums.py``), streamed; a member whose
  payload fails part-way is excluded and the sums start again without it, so a round
  commits exactly the contributions it lists.
- :func:`check_members` and :func:`recompute_sums`: ``verify``'s side, the same sums from
  a record's member list, with no retry (a record naming an unusable payload is wrong).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.coord.retry import retrying
from gradientmail.engine.sums import Member, Unusable, weighted_sums
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox

__all__ = [
    "Listed",
    "check_members",
    "exclusion",
    "read_members",
    "recompute_sums",
    "sum_members",
]

_log = logging.getLogger("gradientmail")

REASON_CHARS = 300  # of an exclusion's reason, kept in the record

Listed = tuple[str, p.Snapshot]  # a member: its snapshot key and record


def exclusion(key: str, exc: Exception, learner: str | None = None) -> p.Exclusion:
    """The record's entry for snapshot ``key`` (of ``learner``; default: the key's last
    segment), excluded because of ``exc``."""
    reason = f"{type(exc).__name__}: {exc}"
    if len(reason) > REASON_CHARS:
        reason = reason[: REASON_CHARS - 3] + "..."
    return p.Exclusion(key.rpartition("/")[2] if learner is None else learner, key, reason)


async def read_members(
    box: Mailbox, keys: Sequence[str], round: int, base: int | None = None
) -> tuple[list[Listed], list[p.Exclusion]]:
    """The snapshot records under ``keys`` that name a usable contribution to ``round``
    (built on ``base``, when given), and the exclusion of each other one (unreadable, not
    its key's learner's, another round's, built on another base)."""
    records = await asyncio.gather(*(retrying(partial(box.get, key)) for key in keys))
    usable: list[Listed] = []
    excluded: list[p.Exclusion] = []
    for key, data in zip(keys, records, strict=True):
        try:
            snap = p.decode_snapshot(key, data)
            if snap.learner != key.rpartition("/")[2]:
                raise ProtocolError(f"{key}: the record names learner {snap.learner!r}")
            if snap.round != round:
                raise ProtocolError(f"{key}: the record says round {snap.round}")
            if base is not None and snap.base != base:
                raise ProtocolError(f"{key}: built on round {snap.base}, not {base}")
        except ProtocolError as exc:
            excluded.append(exclusion(key, exc))
            continue
        usable.append((key, snap))
    return usable, excluded


async def sum_members(
    box: Mailbox,
    algorithm: Algorithm,
    specs: Sequence[p.TensorSpec],
    buffer_names: frozenset[str],
    usable: Sequence[Listed],
    excluded: list[p.Exclusion],
    *,
    closer: str | None,
    own: tuple[str, Mapping[str, torch.Tensor]] | None,
    out: Callable[[], dict[str, torch.Tensor]],
    what: str,
) -> tuple[dict[str, torch.Tensor], list[Listed]]:
    """The usable members' weighted sums (the algorithm's weights, learner-id order,
    float32) into a fresh ``out()``, and the members they hold. ``own``: the closer's own
    payload key and tensors (its own snapshot is not downloaded). A member found unusable
    part-way is added to ``excluded`` and the sums start again without it; raises
    :class:`ProtocolError` naming ``what`` when nothing usable is left."""
    ordered = sorted(usable, key=lambda item: item[1].learner)
    for _ in range(len(ordered) + 1):
        if not ordered:
            raise ProtocolError(
                f"{what}: no usable snapshot among the {len(usable) + len(excluded)} listed"
                + "".join(f"; {x.reason}" for x in excluded)
            )
        members = [
            Member(
                snap.learner,
                snap.samples,
                snap.payload,
                own[1]
                if own is not None and (snap.learner, snap.payload) == (closer, own[0])
                else None,
            )
            for _, snap in ordered
        ]
        sums = out()
        try:
            await weighted_sums(box, algorithm, specs, buffer_names, members, closer, sums)
        except Unusable as failed:
            bad, snap = ordered[failed.index]
            excluded.append(exclusion(bad, failed.cause, snap.learner))
            _log.warning("%s: excluded %s: %s; summing again without it", what, bad, failed.cause)
            ordered = [item for item in ordered if item[0] != bad]
            continue
        return sums, ordered
    raise AssertionError("unreachable: every pass excludes one snapshot")


def check_members(key: str, commit: p.Commit, word: str) -> tuple[str, ...]:
    """The learners of ``commit``'s member list (``word``: "contributors", "members"):
    at least one, none twice, none also excluded; :class:`ProtocolError` otherwise."""
    if not commit.contributors:
        raise ProtocolError(f"{key}: a commit without {word}")
    learners = tuple(c.learner for c in commit.contributors)
    if len(set(learners)) != len(learners):
        raise ProtocolError(f"{key}: a learner is listed twice among the {word}")
    if both := sorted(set(learners) & {x.learner for x in commit.excluded}):
        raise ProtocolError(f"{key}: {both} are listed as {word} and as excluded")
    return learners


async def recompute_sums(
    box: Mailbox, algorithm: Algorithm, specs: Sequence[p.TensorSpec], key: str, commit: p.Commit
) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """The weighted sums of the contributions record ``key`` lists, streamed as its closer
    summed them (one accumulator, whatever their number), and the buffers' names (kind
    "buffer": averaged or the closer's copy, not outer-stepped). A contribution that
    cannot be read is the record's fault: :class:`ProtocolError`."""
    buffers = frozenset(spec.name for spec in specs if spec.kind == p.BUFFER)
    members = [
        Member(c.learner, c.samples, c.payload)
        for c in sorted(commit.contributors, key=lambda c: c.learner)
    ]
    sums = {spec.name: torch.empty(spec.shape, dtype=torch.float32) for spec in specs}
    try:
        await weighted_sums(box, algorithm, specs, buffers, members, commit.closer, sums)
    except Unusable as exc:
        raise ProtocolError(f"{key}: {exc.cause}") from exc
    return sums, buffers
