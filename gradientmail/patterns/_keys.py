"""Checking names that become one segment of a mailbox key, before any I/O."""

from __future__ import annotations

from gradientmail.mailbox._keys import MAX_KEY_BYTES


def check_segment(value: object, what: str, *, room: int = 0) -> str:
    """Return ``value`` if it can be one ``/``-free segment of a mailbox key.

    A segment is a non-empty str of valid UTF-8, without ``/`` or control characters, and
    neither ``.`` nor ``..``. ``room`` is how many bytes the longest key built from it adds
    around it, so that key stays within the mailbox's 1024-byte limit.
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}: {value!r}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} {value!r} is not valid UTF-8: {exc.reason}") from None
    if "/" in value:
        raise ValueError(f"{what} {value!r} contains '/': it must be a single key segment")
    if value in (".", ".."):
        raise ValueError(f"{what} {value!r} is not a valid key segment")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError(f"{what} {value!r} contains a control character")
    if len(encoded) + room > MAX_KEY_BYTES:
        raise ValueError(
            f"{what} {value[:40]!r}... is {len(encoded)} bytes; at most "
            f"{MAX_KEY_BYTES - room} fit in a mailbox key"
        )
    return value


def check_seconds(value: object, what: str) -> float:
    """A positive, finite number of seconds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or value == float("inf")
    ):
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")
    return float(value)


def check_timeout(value: object, what: str = "timeout") -> float | None:
    """``None`` (no limit) or a positive, finite number of seconds."""
    return None if value is None else check_seconds(value, what)


def check_count(value: object, what: str) -> int:
    """An int >= 1 (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, not {value!r}")
    return value
