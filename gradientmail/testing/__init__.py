"""Public test helpers for GradientMail users and backend authors.

- ``contract.py``: the mailbox contract suite (:class:`MailboxContract` for pytest, and the
  framework-free ``check_*`` functions it is made of).
- ``faults.py``: fault injectors that wrap any mailbox (:class:`FaultyMailbox`,
  :class:`SlowMailbox`) and a deliberately broken store (:class:`CheckThenWriteMailbox`).
"""

from gradientmail.testing.contract import (
    MailboxContract,
    check_byte_order_listing,
    check_create_once,
    check_create_once_race_processes,
    check_create_once_race_threads,
    check_delete_idempotent,
    check_get_missing,
    check_list_after,
    check_lost_response_retry,
    check_many_event_loops,
    check_read_after_write,
    check_whole_objects,
)
from gradientmail.testing.faults import (
    CheckThenWriteMailbox,
    FaultyMailbox,
    Injection,
    SlowMailbox,
)

__all__ = [
    "CheckThenWriteMailbox",
    "FaultyMailbox",
    "Injection",
    "MailboxContract",
    "SlowMailbox",
    "check_byte_order_listing",
    "check_create_once",
    "check_create_once_race_processes",
    "check_create_once_race_threads",
    "check_delete_idempotent",
    "check_get_missing",
    "check_list_after",
    "check_lost_response_retry",
    "check_many_event_loops",
    "check_read_after_write",
    "check_whole_objects",
]
