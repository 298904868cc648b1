"""Waiting for conditions in tests, bounded in time (never a bare sleep).

``GRADIENTMAIL_TEST_TIMEOUT`` (seconds, default 30) raises the limit for slow stores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TEST_TIMEOUT = float(os.environ.get("GRADIENTMAIL_TEST_TIMEOUT", "30"))


def wait_until(
    predicate: Callable[[], T], what: str, timeout: float = TEST_TIMEOUT, every: float = 0.02
) -> T:
    """Return the first truthy value of ``predicate()``; fail naming ``what`` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
