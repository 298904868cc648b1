"""Writing a closer's commit record, or adopting the one that won: one rule for every closer.

A record is created once. A closer writes its payloads, then its record; when the write
loses, the record that stands is read and adopted. It may be this closer's own: the
response to its write was lost and the retry found the key taken (the same closer, claim
attempt and content-addressed payloads). That counts as won. Otherwise the loser deletes
the payloads it uploaded that nothing names: the key is taken, and every later round builds
on the winner, so nothing ever will.
"""

from __future__ import annotations

import logging
from functools import partial

from gradientmail import wire as p
from gradientmail.coord.retry import retrying
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.wire.parts import blob_keys

__all__ = ["write_or_adopt"]

_log = logging.getLogger("gradientmail")


async def write_or_adopt(
    box: Mailbox, key: str, commit: p.Commit, base: p.Commit | None = None
) -> tuple[p.Commit, bool]:
    """Create record ``key`` holding ``commit`` (built on ``base``, when it has one);
    return the record that stands and whether it is this closer's."""
    if await retrying(partial(box.put_if_absent, key, p.encode(commit))):
        return commit, True
    data = await retrying(partial(box.get, key))
    if data is None:
        raise ProtocolError(
            f"{key}: put_if_absent said it exists, but it reads as missing; the store is not "
            "read-after-write consistent"
        )
    found = p.decode_commit(key, data)
    if _signature(found) == _signature(commit):
        return found, True  # our own record: the response to our write was lost
    await _discard(box, key, commit, found, base)
    return found, False


def _signature(commit: p.Commit) -> tuple[str, int, str, str | None]:
    """What only this closer's own write of this claim attempt can share."""
    return (commit.closer, commit.attempt, commit.params, commit.momentum)


async def _discard(
    box: Mailbox, key: str, ours: p.Commit, theirs: p.Commit, base: p.Commit | None
) -> None:
    """Delete the payloads a losing close uploaded that no record names (its snapshots'
    payloads and the base's stay). Best effort: a failure leaves them, as before."""
    named = {theirs.params, theirs.momentum}
    if base is not None:
        named |= {base.params, base.momentum}
    named |= {c.payload for c in (*theirs.contributors, *ours.contributors)}
    mine = {k for k in (ours.params, ours.momentum) if k and k not in named}
    if not mine:
        return
    try:
        doomed = await retrying(partial(blob_keys, box, mine))
        spared = await retrying(partial(blob_keys, box, {k for k in named if k}))
        await retrying(partial(box.delete, sorted(doomed - spared)))
    except Exception as exc:
        _log.warning("%s: could not delete a losing close's payloads: %r", key, exc)
