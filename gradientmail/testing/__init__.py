"""Public test helpers for GradientMail users and backend authors.

- ``contract.py``: the mailbox contract suite (:class:`MailboxContract` for pytest, and the
  framework-free ``check_*`` functions it is made of).
- ``faults.py``: fault injectors that wrap any mailbox (:class:`FaultyMailbox`,
  :class:`SlowMailbox`) and a deliberately broken store (:class:`CheckThenWriteMailbox`).
- ``reference.py``: the whole-tensor reference of a round (``combine``, ``weighted_sum``)
  that the streamed closer must match bit for bit; it imports torch, so this package
  does not import it.
"""

from gradientmail.testing import contract, faults
from gradientmail.testing.contract import *  # noqa: F403 (the names of contract.__all__)
from gradientmail.testing.faults import *  # noqa: F403 (the names of faults.__all__)

# ``ordering_keys`` is the suite's own helper, not a public test helper.
__all__ = sorted({*contract.__all__, *faults.__all__} - {"ordering_keys"})
