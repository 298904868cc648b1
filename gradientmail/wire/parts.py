"""Payloads stored in parts: the index format, read without torch (sweeping needs it).

A part index is a JSON blob, ``blobs/{sha256 of the index}.parts``, naming the consecutive
byte ranges (parts) of one safetensors stream, each a blob ``blobs/{sha256 of the part}``.
Writers store every part before the index; readers verify the index, then each part.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import TypedDict

from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.wire.keys import blob_sha, is_parts_key

PARTS_FORMAT = "gradientmail.parts/1"
MAX_PARTS = 1 << 16


class PartWire(TypedDict):
    key: str
    size: int


class IndexWire(TypedDict):
    format: str
    size: int
    parts: list[PartWire]


def verify_blob(key: str, data: bytes) -> None:
    sha = blob_sha(key)
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha:
        raise PayloadCorrupt(
            f"{key}: the {len(data)} bytes read hash to {actual[:16]}…; the object is "
            "corrupt or truncated"
        )


def parse_index(key: str, data: bytes) -> list[PartWire]:
    """The parts a verified index names, validated."""
    verify_blob(key, data)
    try:
        wire = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{key}: the part index is not JSON ({exc})") from exc
    if not isinstance(wire, dict) or wire.get("format") != PARTS_FORMAT:
        raise ProtocolError(f"{key}: not a part index of format {PARTS_FORMAT!r}")
    parts = wire.get("parts")
    size = wire.get("size")
    if not isinstance(parts, list) or not 1 <= len(parts) <= MAX_PARTS:
        raise ProtocolError(f"{key}: the part index names no parts, or too many")
    checked: list[PartWire] = []
    for part in parts:
        if (
            not isinstance(part, dict)
            or not isinstance(part.get("key"), str)
            or type(part.get("size")) is not int
            or part["size"] < 1
            or is_parts_key(part["key"])
        ):
            raise ProtocolError(f"{key}: bad part entry {part!r}")
        blob_sha(part["key"])
        checked.append({"key": part["key"], "size": part["size"]})
    if type(size) is not int or size != sum(part["size"] for part in checked):
        raise ProtocolError(f"{key}: the part sizes do not add up to {size!r}")
    return checked


async def blob_keys(box: Mailbox, keys: Iterable[str]) -> set[str]:
    """Every blob the payloads named by ``keys`` occupy: the keys themselves and, for part
    indexes that can still be read, the parts they name (for sweeping: a part shared by a
    kept payload must be spared too)."""
    found: set[str] = set()
    for key in keys:
        found.add(key)
        if not is_parts_key(key):
            continue
        data = await box.get(key)
        if data is None:
            continue
        try:
            found.update(part["key"] for part in parse_index(key, data))
        except (ProtocolError, PayloadCorrupt):
            continue  # not ours to interpret: the index key alone
    return found
