"""Key rules shared by the built-in backends, checked before any I/O.

A key is a non-empty ``/``-separated path of non-empty segments, valid UTF-8, at most
1024 bytes (S3's limit), with no ``.`` or ``..`` segment (they would escape a filesystem
root or alias another key) and no control characters. A list prefix follows the same rules
but may be empty and may end with ``/`` or in the middle of a segment.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_KEY_BYTES = 1024


def _encoded(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"mailbox {what} must be str, not {type(value).__name__}: {value!r}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"mailbox {what} {value!r} is not valid UTF-8: {exc.reason}") from None


def _check_segments(value: str, what: str, *, allow_open_end: bool) -> None:
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError(f"mailbox {what} {value!r} contains a control character")
    segments = value.split("/")
    if allow_open_end:
        # "rounds/" and "rounds/00" are fine prefixes: the last segment may be empty/partial.
        segments = segments[:-1]
    for segment in segments:
        if segment == "":
            raise ValueError(
                f"mailbox {what} {value!r} has an empty segment (leading, trailing or doubled '/')"
            )
        if segment in (".", ".."):
            raise ValueError(f"mailbox {what} {value!r} has a {segment!r} segment")


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid mailbox key, else raise ``ValueError``/``TypeError``."""
    encoded = _encoded(key, "key")
    assert isinstance(key, str)
    if not key:
        raise ValueError("mailbox key must not be empty")
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(
            f"mailbox key {key[:40]!r}... is {len(encoded)} bytes; the limit is {MAX_KEY_BYTES}"
        )
    _check_segments(key, "key", allow_open_end=False)
    return key


def check_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a valid list prefix ("" lists everything)."""
    _encoded(prefix, "list prefix")
    assert isinstance(prefix, str)
    if prefix:
        _check_segments(prefix, "list prefix", allow_open_end=True)
    return prefix


def check_after(after: object) -> str:
    """Return ``after`` if it is a str that encodes as UTF-8 (any such string is a cursor)."""
    _encoded(after, "list cursor 'after'")
    assert isinstance(after, str)
    return after


def check_keys(keys: Iterable[str]) -> tuple[str, ...]:
    """Materialise and validate an iterable of keys for ``delete``."""
    if isinstance(keys, str | bytes):
        raise TypeError("delete() takes an iterable of keys, not a single key string")
    return tuple(check_key(key) for key in keys)
