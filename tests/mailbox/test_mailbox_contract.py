"""The mailbox contract, run against every store in ``MAILBOXES`` (tests/conftest.py)."""

from gradientmail.testing import MailboxContract


class TestMailboxContract(MailboxContract):
    """Every contract check, once per backend: memory, filesystem, spec-filesystem, s3-*."""
