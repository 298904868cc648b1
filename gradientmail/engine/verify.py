"""Recompute a commit from its round record and the previous commit of its fragment.

Every commit names its contributors' payloads, the base commit and the outer momentum, and
a round (``engine/sums.py``, then the algorithm's ``finish``) is deterministic, so any
process can check that a closer did its job:
:func:`verify_commit` recomputes the new parameters and momentum and compares their
content-addressed keys with the record's. It only reads. It needs the round's snapshot
payloads and its base commit's payloads, which the sweep removes once ``keep_rounds - 1``
newer commits of the same fragment exist (with the default 2: as soon as the next commit
of that fragment lands), so verify commits as they land, or raise ``keep_rounds``.

A record's running totals (``totals``, when it carries them) must be its base's plus its
own round: training rounds one more, samples its contributors' more.

Only a record's ``contributors`` are combined: the snapshots it lists as ``excluded`` (the
closer could not load or verify them) are reported in :attr:`Verified.excluded`, and a
learner may not appear in both.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import from_manifest
from gradientmail.coord.retry import retrying
from gradientmail.engine.chain import commit_tensors
from gradientmail.engine.members import check_members, recompute_sums
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, payload_key, stored_key
from gradientmail.wire.records import NO_TOTALS

__all__ = ["Verified", "verify_commit", "verify_group"]


@dataclass(frozen=True)
class Verified:
    round: int
    fragment: int
    contributors: tuple[str, ...]
    samples: int
    initial: bool
    excluded: tuple[str, ...] = ()  # learners whose snapshot the closer excluded


async def _record(box: Mailbox, key: str) -> bytes | None:
    return await retrying(partial(box.get, key))


def _check_totals(key: str, commit: p.Commit, base: p.Commit, fragments: int) -> None:
    """A commit's running totals are its base's plus its own round. Optional (records from
    before they existed have none), but a record that carries them must carry these."""
    if commit.totals is None:
        return
    base_totals = base.running_totals(fragments)
    if base_totals is None:
        raise ProtocolError(
            f"{key}: carries totals, but its base {p.round_key(base.round)} has none to add to"
        )
    expected = base_totals.after(commit.samples)
    if commit.totals != expected:
        raise ProtocolError(
            f"{key}: totals {commit.totals.rounds} rounds, {commit.totals.samples} samples; "
            f"its base's plus this round make {expected.rounds} rounds, {expected.samples} samples"
        )


async def verify_commit(box: Mailbox, r: int, manifest: p.Manifest | None = None) -> Verified:
    """Check commit ``r``; raise :class:`ProtocolError` if it is not what its record implies."""
    if manifest is None:
        manifest = p.decode_manifest(p.MANIFEST, await _record(box, p.MANIFEST))
    fragments = manifest.num_fragments
    algorithm = from_manifest(manifest.algorithm)
    key = p.round_key(r)
    commit = p.decode_commit(key, await _record(box, key))
    fragment = r % fragments
    specs = manifest.fragments[fragment]
    if commit.fragment != fragment:
        raise ProtocolError(f"{key}: fragment {commit.fragment}, but round {r} carries {fragment}")
    if commit.stored:  # it decodes: that is the check (what it holds is compared below)
        await retrying(partial(get_tensors, box, commit.params, p.outer_specs(specs)))
    if r < fragments:
        if commit.contributors or commit.base is not None:
            raise ProtocolError(f"{key}: an initial commit must have no base or contributors")
        if commit.totals not in (None, NO_TOTALS):
            raise ProtocolError(
                f"{key}: an initial commit's totals must be zero, not {commit.totals}"
            )
        return Verified(r, fragment, (), 0, True)
    if commit.base != r - fragments:
        raise ProtocolError(f"{key}: base {commit.base}, expected {r - fragments}")
    learners = check_members(key, commit, "contributors")
    base_key = p.round_key(commit.base)
    base = p.decode_commit(base_key, await _record(box, base_key))
    _check_totals(key, commit, base, fragments)
    base_params = await commit_tensors(box, algorithm, specs, base)
    momentum = None
    if base.momentum is not None:
        state_specs = algorithm.state_specs(specs)
        momentum = await retrying(partial(get_tensors, box, base.momentum, state_specs))
    sums, buffers = await recompute_sums(box, algorithm, specs, key, commit)
    with torch.no_grad():
        expected_params, expected_momentum = algorithm.finish(
            base_params, momentum, sums, buffer_names=buffers
        )
    if commit.stored:
        found = await retrying(partial(stored_key, box, expected_params, commit.params))
    else:  # not stored: the record names the hash the closer computed (engine/chain.py)
        found = await asyncio.to_thread(payload_key, expected_params)
    if found != commit.params:
        raise ProtocolError(f"{key}: its parameters are not the combination its record names")
    if commit.momentum is None or (
        await retrying(partial(stored_key, box, expected_momentum, commit.momentum))
        != commit.momentum
    ):
        raise ProtocolError(f"{key}: its momentum is not the combination its record names")
    return Verified(r, fragment, learners, commit.samples, False, _excluded(commit))


async def verify_group(box: Mailbox, key: str, manifest: p.Manifest | None = None) -> Verified:
    """Check a Moshpit group commit (``group-rounds/{t}/{group}``): its parameters must be
    the sample-weighted average of its members' payloads, in learner-id order, as the
    group's closer computes it; raise :class:`ProtocolError` otherwise. Its members'
    payloads must still be stored (the sweep keeps the newest ``keep_rounds`` group rounds).
    ``Verified.round`` is the group round."""
    if manifest is None:
        manifest = p.decode_manifest(p.MANIFEST, await _record(box, p.MANIFEST))
    algorithm = from_manifest(manifest.algorithm)
    t, _ = p.parse_group_round_key(key)
    commit = p.decode_commit(key, await _record(box, key))
    if commit.base is not None or commit.momentum is not None or commit.fragment != 0:
        raise ProtocolError(f"{key}: a group commit has no base, momentum or fragment")
    learners = check_members(key, commit, "members")
    specs = manifest.fragments[0]
    # The stored parameters decode (as verify_commit checks a stored commit's): a record
    # whose key is right but whose bytes are damaged is found here, not by a reader later.
    await retrying(partial(get_tensors, box, commit.params, specs))
    sums, buffers = await recompute_sums(box, algorithm, specs, key, commit)
    like = {
        spec.name: torch.empty(0, dtype=getattr(torch, spec.dtype.removeprefix("torch.")))
        for spec in specs
    }
    with torch.no_grad():
        expected, _ = algorithm.finish(like, None, sums, buffer_names=buffers)
    found = await retrying(partial(stored_key, box, expected, commit.params))
    if found != commit.params:
        raise ProtocolError(f"{key}: its parameters are not the average of its members' payloads")
    return Verified(t, 0, learners, commit.samples, False, _excluded(commit))


def _excluded(commit: p.Commit) -> tuple[str, ...]:
    return tuple(x.learner for x in commit.excluded)
