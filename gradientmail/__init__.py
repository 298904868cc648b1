"""GradientMail: distributed training whose nodes never connect to each other.

Nodes meet only in a shared object store, the *mailbox*. The public surface is re-exported
here; everything else is private to its package.

Package map:

- ``errors.py``: the exception hierarchy (who is at fault, what to do).
- ``mailbox/``: the :class:`Mailbox` Protocol and its backends (memory, file, S3) and
  :func:`open_mailbox`.
- ``testing/``: the mailbox contract suite and fault injectors, for users' own tests.
- ``cli.py``: the ``gradientmail`` command.
"""

from gradientmail import events
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
    "open_mailbox",
]

__version__ = "0.1.0.dev0"
