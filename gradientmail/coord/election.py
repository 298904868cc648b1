"""Claim-with-failover: one rule for when a claim may be taken over.

Every elected role is a create-once claim, ``attempt`` 0, 1, 2, … in key order: a round's
closer (``claims/{r}/{attempt}``), the run's creator (``claims/creator``,
``claims/creator-{n}``), a Shared Queue unit (``units/{u}``, ``units-reclaims/{u}/{n}``).
The next attempt may be claimed once the newest is no longer honoured, judged by
:func:`abandoned` on the observer's own monotonic clock (never a server's):

- its holder wrote its leaving beat: at once;
- its holder's lease lapsed: after the observer watched the claim a whole lease period
  itself (it cannot know how old the claim was when first seen);
- its holder is live but the role has a ``deadline`` (a closer must commit within
  ``claim_timeout``): after the deadline, so a live holder that keeps failing is replaced.

A duplicate holder is harmless by construction: what a role writes is create-once too, so
one write wins and the other adopts it. ``coord/claims.py`` is the loop that applies this
rule to a series of claims.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

from gradientmail import wire as p
from gradientmail.coord.retry import retrying
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox

__all__ = ["NOBODY", "abandoned", "claim", "claim_holder"]

_log = logging.getLogger("gradientmail")

NOBODY = ""  # the holder of a claim whose record cannot be read: never a learner id


def abandoned(
    *,
    held: float,
    live: bool,
    lease_timeout: float,
    leaving: bool = False,
    deadline: float | None = None,
) -> bool:
    """Whether a claim watched for ``held`` seconds may be taken over (module docstring)."""
    if leaving:
        return True
    if live:
        return deadline is not None and held >= deadline
    return held >= lease_timeout


async def claim(
    box: Mailbox,
    key: str,
    record: bytes,
    me: str,
    holder_of: Callable[[str], Awaitable[str]],
) -> bool:
    """Create the claim ``key``; True when ``me`` holds it. A put that reports the key taken
    may be this learner's own earlier write whose response was lost: the claim names its
    writer, so reading it tells."""
    if await retrying(partial(box.put_if_absent, key, record)):
        return True
    return await holder_of(key) == me


async def claim_holder(box: Mailbox, key: str) -> str | None:
    """Who claim ``key`` (a :class:`~gradientmail.wire.Claim`) names: None while it cannot
    be read (listed, or reported taken, but not readable yet: read it again next time);
    :data:`NOBODY` when it cannot be decoded, which fails over like a dead holder's."""
    data = await retrying(partial(box.get, key))
    if data is None:
        return None
    try:
        return p.decode_claim(key, data).learner
    except ProtocolError as exc:
        _log.warning("%s: an unreadable claim counts as a dead claimant's (%s)", key, exc)
        return NOBODY
