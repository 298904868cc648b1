"""Sweeping a run's old rounds: idempotent, done by whoever commits. The one home of which
rounds are newest (:func:`newest_per_fragment`) and which are old (:func:`kept_rounds`,
:func:`horizon`, :func:`group_horizon`): the closers, ``gradientmail sweep``, ``align``
and ``verify`` all ask here.

A commit of round ``r`` makes round ``r − keep_rounds·P`` (``P`` fragments) old: its
snapshots, claims and payloads go, except payloads a kept commit still names (the same
bytes recur under the same content-addressed key). A closer killed between its commit and
its sweep leaves a round unswept; the next commit of the fragment finds it by its claims
(claims are deleted last) and sweeps it too, a bounded number of rounds per call. Deletes
are idempotent, so two closers sweeping the same round at once lose nothing more.
``gradientmail sweep`` (``cli/housekeeping.py``) plans the same from a full listing.

Round records (``rounds/…``) are never swept, only what they name. Since commits carry
their fragment's running totals (``Commit.totals``), a status (``gradientmail.inspect``)
no longer needs the old ones: it reads the newest record of each fragment. They stay all
the same: they are small (no tensors), ``verify`` checks a commit against its base's
record (``gradientmail verify`` every listed one), joiners and ``align`` fall back to an
older commit when the newest cannot be read, a run written before totals existed still
counts its status from every record, and ``gradientmail sweep`` keeps them as the run's
history. Sweeping them would be a protocol change of its own (decided against here), not
a side effect of the counters.

A learner's resume saves (``resume/{learner}/{save}``, ``Session(optimizer=...)``) are swept
by the learner itself, right after it wrote a newer one (:func:`sweep_resume`): only the
newest is ever read, so the older records and their payloads go. Their payloads are the
learner's alone (each holds its record's key, so no other record names the same bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from functools import partial

from gradientmail import wire as p
from gradientmail.coord.retry import retrying
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.wire.keys import parse_resume_key, resume_prefix
from gradientmail.wire.parts import blob_keys
from gradientmail.wire.resume import decode_resume

__all__ = [
    "SWEEP_ROUNDS",
    "group_horizon",
    "horizon",
    "is_old",
    "kept_rounds",
    "named_payloads",
    "newest_per_fragment",
    "round_numbers",
    "sweep_after",
    "sweep_resume",
]

_log = logging.getLogger("gradientmail")

SWEEP_ROUNDS = 8  # rounds one sweep deletes, at most: the horizon's and leftovers before it


def round_numbers(keys: Iterable[str]) -> list[int]:
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


def newest_per_fragment(keys: Iterable[str], fragments: int) -> dict[int, int]:
    """``{fragment: newest round}`` of a listing of ``rounds/`` (round ``r`` is of fragment
    ``r % fragments``); a fragment without a commit is absent."""
    newest: dict[int, int] = {}
    for r in round_numbers(keys):
        newest[r % fragments] = max(r, newest.get(r % fragments, -1))
    return newest


def kept_rounds(keep_rounds: int, dense_every: int = 1) -> int:
    """How many commits of each fragment keep their inputs: ``keep_rounds``, and with
    ``dense_every`` K > 1 at least K + 1 (a commit whose parameters are not stored is
    computed from the newest stored one and the rounds since: those rounds stay, for the
    newest commit and its base)."""
    return max(keep_rounds, dense_every + 1) if dense_every > 1 else keep_rounds


def horizon(newest: int, fragments: int, keep_rounds: int) -> int:
    """The newest round of ``newest``'s fragment that commit ``newest`` makes old: its
    snapshots, claims and payloads may go (negative: nothing is old yet). ``keep_rounds``:
    from :func:`kept_rounds`."""
    return newest - keep_rounds * fragments


def is_old(r: int, newest: Mapping[int, int], fragments: int, keep_rounds: int) -> bool:
    """Whether round ``r``'s inputs may go, given ``{fragment: newest round}``."""
    f = r % fragments
    return f in newest and r <= horizon(newest[f], fragments, keep_rounds)


def group_horizon(t: int, keep_rounds: int, behind: int = 0) -> int:
    """The newest group round (Moshpit) that group round ``t`` makes old, swept whole:
    ``keep_rounds`` rounds stay, and ``behind`` more whose groups may still be open (the
    learners' own sweep: ``grid_dims + 1``, since groups close apart; ``gradientmail sweep``
    counts from the newest round with a commit: 0)."""
    return t - keep_rounds - behind


def named_payloads(commit: p.Commit) -> set[str]:
    """Every payload key a commit record names: parameters, state, contributions."""
    named = {commit.params, *(c.payload for c in commit.contributors)}
    if commit.momentum:
        named.add(commit.momentum)
    return named


async def sweep_after(
    box: Mailbox,
    commit: p.Commit,
    fragments: int,
    keep_rounds: int,
    base: p.Commit | None = None,
) -> int:
    """Sweep what ``commit`` makes old: round ``commit.round − keep_rounds·fragments`` and
    older rounds of the same fragment whose own sweep never ran (they still have claims),
    oldest first, :data:`SWEEP_ROUNDS` rounds at most. ``base``: the commit ``commit`` was
    built on, when known (its payloads are spared while it is within the kept rounds).
    Returns the horizon round (negative: nothing was old yet)."""
    old = horizon(commit.round, fragments, keep_rounds)
    if old < 0:
        return old
    claims: dict[int, list[str]] = {}
    for key in await retrying(partial(box.list, p.CLAIMS)):
        x = p.claim_round(key)
        if x is not None and x <= old and (old - x) % fragments == 0:
            claims.setdefault(x, []).append(key)
    rounds = [*sorted(x for x in claims if x < old)[: SWEEP_ROUNDS - 1], old]
    doomed: set[str] = set()
    for x in rounds:
        snaps = await retrying(partial(box.list, p.snapshots_prefix(x)))
        doomed.update(snaps)
        records = await asyncio.gather(*(retrying(partial(box.get, key)) for key in snaps))
        for key, data in zip(snaps, records, strict=True):
            # A malformed record goes too; it names no payload that can be read.
            with contextlib.suppress(ProtocolError):
                doomed.add(p.decode_snapshot(key, data).payload)
        old_key = p.round_key(x)
        old_record = await retrying(partial(box.get, old_key))
        if old_record is not None:
            try:
                old_commit = p.decode_commit(old_key, old_record)
            except ProtocolError as exc:
                _log.warning("sweep: %s is unreadable; its payloads stay (%s)", old_key, exc)
            else:
                doomed.add(old_commit.params)
                if old_commit.momentum:
                    doomed.add(old_commit.momentum)
    kept = {commit.params, commit.momentum}
    if base is not None and base.round > old:  # with keep_rounds=1 the base itself goes
        kept |= {base.params, base.momentum}
    kept |= {c.payload for c in commit.contributors}
    # Payloads stored in parts: their parts go with them, except a part that a kept
    # payload names too (the same bytes under the same content-addressed key).
    payloads = {k for k in doomed if k and k.startswith(p.BLOBS)}
    doomed |= await retrying(partial(blob_keys, box, payloads))
    spared = await retrying(partial(blob_keys, box, {k for k in kept if k}))
    await retrying(partial(box.delete, sorted(k for k in doomed if k and k not in spared)))
    # Claims last: a round that still has claims may still have other objects to sweep.
    await retrying(partial(box.delete, sorted(k for x in rounds for k in claims.get(x, []))))
    return old


async def sweep_resume(box: Mailbox, newest: str, payload: str) -> list[str]:
    """Delete ``newest``'s learner's older resume saves: their payloads (parts included)
    first, then their records, so an interrupted sweep leaves records that the next one
    finds, never payloads that no record names. ``payload``: what ``newest`` names (its
    blobs are spared, should an older record name the same bytes). Idempotent; returns the
    keys deleted. Only saves numbered below ``newest`` go: a later one (written meanwhile)
    stays."""
    learner, save = parse_resume_key(newest)
    older = []
    for key in await retrying(partial(box.list, resume_prefix(learner))):
        with contextlib.suppress(ProtocolError):  # a stray key under the prefix stays
            if parse_resume_key(key)[1] < save:
                older.append(key)
    if not older:
        return []
    records = await asyncio.gather(*(retrying(partial(box.get, key)) for key in older))
    payloads = set()
    for key, data in zip(older, records, strict=True):
        if data is None:
            continue
        try:
            payloads.add(decode_resume(key, data).payload)
        except ProtocolError as exc:  # the record goes all the same; its payload cannot
            _log.warning("sweep: %s is unreadable; its payload stays (%s)", key, exc)
    doomed = await retrying(partial(blob_keys, box, payloads))
    spared = await retrying(partial(blob_keys, box, {payload}))
    blobs = sorted(doomed - spared)
    await retrying(partial(box.delete, blobs))
    await retrying(partial(box.delete, older))
    return [*blobs, *older]
