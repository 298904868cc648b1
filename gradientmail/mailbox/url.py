"""open_mailbox(): a mailbox from a URL, the form every CLI flag and pod env var uses.

- ``s3://bucket/prefix?endpoint=http://host:9000&region=us-east-1`` → :class:`S3Mailbox`
  (credentials from boto3's standard chain; ``endpoint`` may also come from
  ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, which botocore reads itself);
  also ``connect_timeout``, ``read_timeout``, ``max_attempts``.
- ``file:///absolute/dir?fsync=0`` → :class:`FileMailbox`.
- ``memory://name`` → the process-wide :class:`MemoryMailbox` of that name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.file import FileMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.s3 import S3Mailbox

__all__ = ["open_mailbox"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(url: str, name: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"mailbox URL {url!r}: {name}={value!r} is not a boolean (use 1 or 0)")


def _number(url: str, name: str, value: str, kind: Callable[[str], Any]) -> Any:
    try:
        number = kind(value)
    except ValueError:
        raise ValueError(f"mailbox URL {url!r}: {name}={value!r} is not a number") from None
    if number <= 0:
        raise ValueError(f"mailbox URL {url!r}: {name} must be positive, not {value!r}")
    return number


def _query(url: str, query: str, allowed: set[str]) -> dict[str, str]:
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise ValueError(f"mailbox URL {url!r}: unknown option {name!r} (known: {known})")
        if name in params:
            raise ValueError(f"mailbox URL {url!r}: option {name!r} given twice")
        params[name] = value
    return params


def open_mailbox(url: str, **s3_options: Any) -> Mailbox:
    """Open the mailbox a URL names; raise ``ValueError`` naming what is wrong with it.

    ``s3_options`` go to :class:`S3Mailbox` (e.g. ``aws_access_key_id=``,
    ``aws_secret_access_key=`` read from a Secret by the operator); other schemes take none.
    """
    if s3_options and not str(url).startswith("s3://"):
        raise ValueError(f"mailbox URL {url!r}: options {sorted(s3_options)} are for s3:// only")
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(
            f"mailbox URL {url!r} has no scheme; use s3://bucket/prefix, file:///dir "
            "or memory://name"
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        return _open_s3(url, parts.netloc, parts.path, parts.query, s3_options)
    if scheme == "file":
        params = _query(url, parts.query, {"fsync"})
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"mailbox URL {url!r}: file URLs name a local directory (file:///abs/dir); "
                f"host {parts.netloc!r} is not supported"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"mailbox URL {url!r}: the directory must be an absolute path")
        fsync = _flag(url, "fsync", params["fsync"]) if "fsync" in params else True
        return FileMailbox(Path(path), fsync=fsync)
    if scheme == "memory":
        _query(url, parts.query, set())
        name = unquote(parts.netloc + parts.path)
        if not name:
            raise ValueError(f"mailbox URL {url!r}: memory mailboxes need a name (memory://run)")
        return MemoryMailbox.named(name)
    raise ValueError(
        f"mailbox URL {url!r}: unsupported scheme {parts.scheme!r}; use s3://, file:// or memory://"
    )


def _open_s3(url: str, bucket: str, path: str, query: str, extra: dict[str, Any]) -> Mailbox:
    params = _query(
        url, query, {"endpoint", "region", "connect_timeout", "read_timeout", "max_attempts"}
    )
    if not bucket:
        raise ValueError(f"mailbox URL {url!r}: no bucket (s3://bucket/prefix)")
    endpoint = params.get("endpoint") or None
    if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https"):
        raise ValueError(
            f"mailbox URL {url!r}: endpoint={endpoint!r} must be an http:// or https:// URL"
        )
    options: dict[str, Any] = dict(extra)
    for name in ("connect_timeout", "read_timeout"):
        if name in params:
            options[name] = _number(url, name, params[name], float)
    if "max_attempts" in params:
        options["max_attempts"] = _number(url, "max_attempts", params["max_attempts"], int)
    return S3Mailbox(
        bucket,
        unquote(path).strip("/"),
        endpoint_url=endpoint,
        region_name=params.get("region") or None,
        **options,
    )
