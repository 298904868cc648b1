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
- ``patterns/``: :class:`Barrier` (``barrier.py``) and the Shared Queue (``shared_queue.py``).
- ``cli/``: the ``gradientmail`` command (``run``, ``status``, ``align``, ``verify``, ``sweep``,
  ``rm``, ``demo``).
"""

from typing import TYPE_CHECKING, Any

from gradientmail import events, inspect
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
from gradientmail.patterns.barrier import Barrier
from gradientmail.patterns.shared_queue import SharedQueue, shared_queue

if TYPE_CHECKING:
    from gradientmail.algorithms import DiLoCo
    from gradientmail.engine import verify
    from gradientmail.session import Session, align

__all__ = [
    "Barrier",
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
    "SharedQueue",
    "align",
    "events",
    "inspect",
    "open_mailbox",
    "shared_queue",
    "verify",
]

# The training side needs torch; the mailbox, the patterns and the inspector do not (the
# operator image has no torch). Those names load on first use.
_TORCH_NAMES = {
    "Session": ("gradientmail.session", "Session"),
    "DiLoCo": ("gradientmail.algorithms", "DiLoCo"),
    "align": ("gradientmail.session", "align"),
    "verify": ("gradientmail.engine.verify", None),
}


def __getattr__(name: str) -> Any:
    if name not in _TORCH_NAMES:
        raise AttributeError(f"module 'gradientmail' has no attribute {name!r}")
    import importlib

    module_name, attribute = _TORCH_NAMES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name in ("torch", "safetensors", "numpy"):
            raise ImportError(
                f"gradientmail.{name} needs {exc.name}: pip install 'gradientmail[torch]'"
            ) from exc
        raise
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__version__ = "0.1.0.dev0"
