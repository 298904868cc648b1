"""GradientMail: distributed training whose nodes never connect to each other.

Nodes meet only in a shared object store, the *mailbox*. The public surface is re-exported
here; everything else is private to its package.

Package map:

- ``errors.py``: the exception hierarchy (who is at fault, what to do).
- ``mailbox/``: the :class:`Mailbox` Protocol and its backends (memory, file, S3) and
  :func:`open_mailbox`.
- ``testing/``: the mailbox contract suite and fault injectors, for users' own tests.
- ``protocol.py``: the key layout and the records (frozen dataclasses <-> JSON).
- ``payload.py``: tensors <-> safetensors bytes named by their sha256.
- ``algorithms/``: :class:`DiLoCo` (what a contribution is, how a round combines them).
- ``session.py``: :class:`Session`, the learner; ``_closer.py`` closes rounds, ``_join.py``
  creates/joins a run and holds :func:`align`, ``_layout.py`` maps a model to fragments,
  ``_leases.py`` judges liveness, ``_retry.py`` backs off, ``_metered.py`` counts traffic.
- ``events.py``: the events and counters a Session reports.
- ``inspect.py``: a read-only view of a run (CLI, operator); ``verify.py`` recomputes commits.
- ``cli.py``: the ``gradientmail`` command.
"""

from gradientmail import events, inspect, verify
from gradientmail._join import align
from gradientmail.algorithms import DiLoCo
from gradientmail.errors import (
    MailboxConfigError,
    MailboxError,
    MailboxUnavailable,
    PayloadCorrupt,
    ProtocolError,
)
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.file import FileMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.session import Session

__all__ = [
    "DiLoCo",
    "FileMailbox",
    "Mailbox",
    "MailboxConfigError",
    "MailboxError",
    "MailboxUnavailable",
    "MemoryMailbox",
    "PayloadCorrupt",
    "ProtocolError",
    "S3Mailbox",
    "Session",
    "align",
    "events",
    "inspect",
    "open_mailbox",
    "verify",
]

__version__ = "0.1.0.dev0"
