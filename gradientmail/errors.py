"""The exceptions GradientMail raises, each saying whose fault a failure is and what to do.

``MailboxError`` is the base of everything that comes from talking to the mailbox:

- :class:`MailboxUnavailable`: transient; the store could not be reached or answered with a
  retryable failure, or the outcome of a write is unknown. Retry the same call later; the
  protocol does so itself with backoff.
- :class:`MailboxConfigError`: the caller's configuration is wrong (no such bucket, bad
  credentials, access denied). Retrying will not help; fix the configuration.
- :class:`ProtocolError`: the mailbox holds something the protocol cannot accept (a malformed
  or truncated record, a key reported as existing that then reads as missing, a model that
  does not match the run's manifest).
- :class:`PayloadCorrupt`: a payload's bytes do not match the sha256 in its key.
- :class:`ObjectMissing`: an object a record names is not in the mailbox (a live run's sweep
  took it since it was listed, or it was written to another store). A reader of a live
  run lists again; a reader of a finished run has lost that object.
- :class:`RoundMissing`: a fragment of the run has no commit yet (the run is still being
  created, or its creator died half-way and nobody joined since).
- :class:`RoundImpossible`: a round cannot be made by anyone, for a reason in the run's
  data (its closer failed the same way on every try); ``step()`` raises it in every
  learner of that round. Retrying will not help: fix the cause, start a new run.
- :class:`RanksFailed`: not the mailbox: another rank of this learner (a node of several
  processes) died or stopped calling the Session; restart the whole node.

Programming errors (a malformed key, an unknown URL scheme) are plain ``ValueError`` /
``TypeError``, raised before any I/O.
"""

from __future__ import annotations

__all__ = [
    "MailboxConfigError",
    "MailboxError",
    "MailboxUnavailable",
    "ObjectMissing",
    "PayloadCorrupt",
    "ProtocolError",
    "RanksFailed",
    "RoundImpossible",
    "RoundMissing",
]


class MailboxError(Exception):
    """Base class of every failure that involves the mailbox."""


class MailboxUnavailable(MailboxError):
    """A transient failure: the store is unreachable, overloaded or timed out.

    Raised as well when a write's outcome is unknown (its response was lost). Retrying the
    same operation is always safe: every mailbox object is created once, so a retried
    ``put_if_absent`` that finds its key taken returns ``False`` and the protocol treats that
    as its own earlier write.
    """


class MailboxConfigError(MailboxError):
    """The mailbox is misconfigured: missing bucket, bad credentials, access denied.

    Not transient: the operator of the run must fix the URL, bucket or credentials.
    """


class ProtocolError(MailboxError):
    """The mailbox holds data that breaks the protocol's rules.

    Examples: a truncated or malformed JSON record, a key that ``put_if_absent`` reported as
    existing but that ``get`` then returns as missing (the store is not read-after-write
    consistent), a node whose model or algorithm does not match the run's manifest.
    """


class PayloadCorrupt(ProtocolError):
    """A payload's bytes do not hash to the sha256 named in its key."""


class ObjectMissing(ProtocolError):
    """An object that a record names (a payload, a part, a record) reads as missing.

    In a live run the sweep deletes what old commits named, so a reader that listed before
    the sweep ran finds it gone: list again and read the newer commits. In a finished run
    (or a different store) the object is lost; the message names its key.
    """


class RoundMissing(ProtocolError):
    """A fragment of the run has no commit yet, so there is no model to load: the run is
    still being created (wait, or join it), or its creator died before writing the initial
    commits (a joining node finishes them)."""


class RoundImpossible(ProtocolError):
    """A round cannot be made by anyone: its closer failed the same way on every try for a
    reason in the run's data (a payload of another dtype or shape than the run's, a record
    that breaks the protocol), not the store's, and recorded it (``claims/{r}/failed``).
    Every learner of the round raises it from ``step()`` (or ``sync()``, ``close()``),
    naming the round and the reason: the run cannot go on as it is. Fix the cause (the
    message names it) and start a new run, or resume this one with a release that reads
    its data."""


class RanksFailed(RuntimeError):
    """A collective among the ranks of one learner failed: another rank of it died, left,
    or stopped calling the Session past the process group's timeout. Not the mailbox's
    fault: the learner leaves the run (its leaving beat is written, or its lease lapses);
    restart the whole node (``gradientmail run`` and the operator do)."""
