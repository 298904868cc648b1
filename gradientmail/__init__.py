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

__all__ = [
    "FileMailbox",
    "Mailbox",
    "MailboxConfigError",
    "MailboxError",
    "MailboxUnavailable",
    "MemoryMailbox",
    "PayloadCorrupt",
    "ProtocolError",
    "S3Mailbox",
    "open_mailbox",
]

__version__ = "0.1.0.dev0"
