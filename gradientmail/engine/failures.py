"""A round that nobody can make: telling a data fault from a store fault, recording it once,
raising it everywhere.

A closer's failed close is retried (``engine/closer.py``: by the same closer, then by the
next claim attempt's) because most failures pass: the store was unreachable, a payload was
swept meanwhile. Some never pass: a payload whose dtype or shape is not the run's, a record
that breaks the protocol. Every closer then fails the same way, and without this module the
claim would be given up and retaken for ever while every learner's sync points wait out
their bound in silence.

- :class:`FaultCount` counts one claim attempt's failures that are *data faults*
  (:func:`is_data_fault`) with the same message, in a row; a store fault, or another
  message, starts the count again.
- When a closer's count reaches its give-up bound, :func:`record_failure` creates
  ``claims/{r}/failed`` (:class:`~gradientmail.wire.RoundFailure`, create-once: the first
  closer's reason stands) and raises :class:`~gradientmail.errors.RoundImpossible`.
- Every closer lists the round's claims before claiming (it does anyway), so it finds the
  record at no extra request and raises the same error (:func:`raise_recorded`); the
  exchange hands it to the learner's training thread, which raises it from ``step()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from gradientmail import wire as p
from gradientmail.coord.retry import retrying
from gradientmail.errors import ObjectMissing, ProtocolError, RoundImpossible, RoundMissing
from gradientmail.mailbox import Mailbox

__all__ = ["FaultCount", "is_data_fault", "raise_recorded", "record_failure"]


def is_data_fault(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the run's data, so that every closer would fail the same
    way: a :class:`ProtocolError` (a record or payload that breaks the protocol's rules,
    a dtype or shape that is not the run's) other than an object a live run swept
    (:class:`ObjectMissing`, :class:`RoundMissing`: list again), or a ``ValueError`` /
    ``TypeError`` out of the combine (tensors that do not fit each other). Anything else
    (the store unreachable, memory) is the store's or this machine's: retried."""
    if isinstance(exc, ObjectMissing | RoundMissing):
        return False
    return isinstance(exc, ProtocolError | ValueError | TypeError)


@dataclass
class FaultCount:
    """One claim attempt's data faults with the same message, in a row."""

    attempt: int = -1
    message: str = ""
    count: int = 0

    def add(self, attempt: int, exc: BaseException) -> int:
        """Count ``exc`` (a failed close of ``attempt``); the count so far."""
        if not is_data_fault(exc):
            self.count = 0
            return 0
        message = str(exc) or repr(exc)
        if (attempt, message) != (self.attempt, self.message):
            self.attempt, self.message, self.count = attempt, message, 0
        self.count += 1
        return self.count


def _error(failure: p.RoundFailure) -> RoundImpossible:
    return RoundImpossible(
        f"round {failure.round} cannot be made by any learner: its closer {failure.closer} "
        f"failed the same way on every try (claim attempt {failure.attempt}): "
        f"{failure.reason}. Retrying will not help: fix the cause and start a new run"
    )


async def record_failure(
    box: Mailbox, r: int, closer: str, attempt: int, exc: BaseException
) -> RoundImpossible:
    """Create round ``r``'s failure record (or read the one that stands: the first
    closer's reason) and return the error every learner raises."""
    key = p.failure_key(r)
    failure = p.RoundFailure(r, closer, attempt, str(exc) or repr(exc))
    if not await retrying(partial(box.put_if_absent, key, p.encode(failure))):
        data = await retrying(partial(box.get, key))
        if data is not None:
            failure = p.decode_failure(key, data)
    return _error(failure)


async def raise_recorded(box: Mailbox, r: int, listed: Sequence[str]) -> None:
    """Raise round ``r``'s :class:`RoundImpossible` when ``listed`` (its claims' listing)
    holds its failure record."""
    key = p.failure_key(r)
    if key not in listed:
        return
    data = await retrying(partial(box.get, key))
    if data is None:  # listed, then gone: only a person deletes it
        return
    raise _error(p.decode_failure(key, data))
