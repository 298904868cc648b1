"""A compressor's settings as one line of text, for an environment variable:
``topk:density=0.05,bits=4`` (unset fields keep their defaults), ``none`` (no compressor)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradientmail.settings._catalog import COMPRESSORS

__all__ = ["compression_from_text", "compression_to_text"]


def compression_to_text(settings: Mapping[str, Any] | None) -> str:
    """``settings`` (a compressor's ``settings()`` dict, or None) as one line."""
    if settings is None:
        return "none"
    items = ",".join(f"{k}={v}" for k, v in settings.items() if k != "name")
    return f"{settings['name']}:{items}" if items else str(settings["name"])


def compression_from_text(text: str) -> dict[str, Any] | None:
    """The settings dict a line of :func:`compression_to_text` stands for; ``ValueError``
    naming an unknown compressor, a field it does not have, or a malformed value."""
    name, _, rest = text.strip().partition(":")
    if name == "none" and not rest:
        return None
    info = COMPRESSORS.get(name)
    if info is None:
        raise ValueError(
            f"compression {name!r} is unknown (known: none, {', '.join(sorted(COMPRESSORS))})"
        )
    settings: dict[str, Any] = {"name": name}
    for item in (part.strip() for part in rest.split(",") if part.strip()):
        key, sep, raw = (s.strip() for s in item.partition("="))
        known = [f.name for f in info.fields]
        if not sep or key not in known:
            raise ValueError(
                f"compression {name}: {item!r} is not key=value with a key among "
                + ", ".join(known)
            )
        setting = info.field(key)
        value = setting.parse(raw)
        setting.check(info.title, value)
        settings[key] = value
    return settings
