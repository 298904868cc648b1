"""What every subcommand shares: opening a URL with clear errors and bounded waits, URLs
as people read them, confirmations, output, and node tracebacks folded into one line."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from gradientmail import wire as p
from gradientmail.errors import MailboxConfigError, MailboxError, MailboxUnavailable, ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.url import open_mailbox

T = TypeVar("T")

USAGE = 2  # exit status for a bad URL, flag or spec file (as argparse uses)

# The CLI's own S3 requests: each may take this long to connect and this long to answer
# (between bytes), and is tried twice, so a store that hangs fails within about twice this
# rather than minutes. ``--store-timeout`` (every subcommand) or the environment variable
# set it; connect_timeout, read_timeout and max_attempts in the URL itself win.
DEFAULT_STORE_TIMEOUT = 10.0
STORE_TIMEOUT_ENV = "GRADIENTMAIL_STORE_TIMEOUT"
STORE_ATTEMPTS = 2
_store_timeout: float | None = None  # from --store-timeout; None: the environment's or default


class CliError(Exception):
    """A failure to report in one line (no traceback), with the exit status to use."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def out() -> Console:
    """stdout; lines of text are never wrapped (commands and URLs stay whole to copy)."""
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # a file or a pipe: no need to fit 80 columns
        console = Console(highlight=False, soft_wrap=True, width=max(console.width, 120))
    return console


def plain(text: str) -> str:
    """Docstring text for ``--help``: reST literals (double backticks) unwrapped and the
    lines joined (argparse wraps them again)."""
    return " ".join(re.sub(r"``(.+?)``", r"\1", text).split())


def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def run_async(call: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await call()

    return asyncio.run(main())


def set_store_timeout(seconds: float | None) -> None:
    """``--store-timeout``, for every mailbox this process opens from now (None: unset)."""
    global _store_timeout
    if seconds is not None and not 0 < seconds < float("inf"):
        raise CliError(
            f"--store-timeout must be a positive number of seconds, not {seconds}", USAGE
        )
    _store_timeout = seconds


def store_timeout() -> float:
    """Seconds an S3 request may take to connect, and to answer: ``--store-timeout``, else
    ``$GRADIENTMAIL_STORE_TIMEOUT``, else :data:`DEFAULT_STORE_TIMEOUT`."""
    if _store_timeout is not None:
        return _store_timeout
    text = os.environ.get(STORE_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_STORE_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise CliError(f"{STORE_TIMEOUT_ENV}={text!r} is not a positive number of seconds", USAGE)
    return seconds


def s3_options() -> dict[str, float | int]:
    """The bounds the CLI opens S3 mailboxes with (see :data:`DEFAULT_STORE_TIMEOUT`)."""
    seconds = store_timeout()
    return {"connect_timeout": seconds, "read_timeout": seconds, "max_attempts": STORE_ATTEMPTS}


# Left as they are in a query value: a URL stays a URL that open_mailbox reads the same.
_QUERY_SAFE = ":/@!$'()*,;"


def readable_url(url: str) -> str:
    """``url`` with its query decoded where that changes nothing it means:
    ``?endpoint=http%3A%2F%2Fhost%3A9000`` becomes ``?endpoint=http://host:9000``
    (``&``, ``=``, ``+``, ``#`` and ``%`` stay escaped). Anything unparsable is returned
    as it is."""
    try:
        parts = urlsplit(url)
        if not parts.query or "://" not in url:
            return url
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = "&".join(
            f"{quote(name, safe=_QUERY_SAFE)}={quote(value, safe=_QUERY_SAFE)}"
            for name, value in pairs
        )
        return urlunsplit(parts._replace(query=query))
    except ValueError:
        return url


# What botocore accepts as a bucket name (S3-compatible stores may take more than AWS).
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")


def _check_bucket(url: str) -> None:
    """A bucket name botocore would refuse, in words (botocore's own message is a regex)."""
    bucket = unquote(urlsplit(url).netloc)
    if bucket and not _BUCKET.fullmatch(bucket):
        raise CliError(
            f"{url}: {bucket!r} is not a bucket name: use letters, digits, '.', '-' and '_' "
            "(AWS S3 itself takes 3 to 63 lowercase letters, digits, '.' and '-')",
            USAGE,
        )


def mailbox_for(url: str, *, create: bool = False) -> Mailbox:
    """Open ``url``; raise :class:`CliError` when it is malformed or names nothing usable.

    Without ``create`` a ``file://`` URL must name an existing directory (a read-only
    command never creates one), and ``memory://`` is refused: a fresh process holds none.
    """
    if "://" not in url:
        raise CliError(
            f"{url!r} is not a mailbox URL; use file:///abs/dir or "
            "s3://bucket/prefix?endpoint=http://host:port",
            USAGE,
        )
    scheme = urlsplit(url).scheme.lower()
    if scheme == "memory":
        raise CliError(
            f"{url}: a memory:// mailbox lives inside one process; use file:// or s3://", USAGE
        )
    if scheme == "s3":
        _check_bucket(url)
    if scheme == "file" and not create:
        parts = urlsplit(url)
        path = Path(unquote(parts.path))
        if parts.netloc in ("", "localhost") and path.is_absolute():
            if not path.exists():
                raise CliError(f"{url}: no such directory; nothing is stored there")
            if not path.is_dir():
                raise CliError(f"{url}: {path} is a file, not a mailbox directory")
            if any(path.iterdir()) and not (path / "objects").is_dir():
                raise CliError(
                    f"{url}: {path} is not a GradientMail mailbox directory (no objects/ in it)"
                )
    try:
        return open_mailbox(url, **s3_options()) if scheme == "s3" else open_mailbox(url)
    except ValueError as exc:
        raise CliError(str(exc), USAGE) from None
    except MailboxError as exc:
        raise CliError(f"{url}: {exc}") from None


def store_error(url: str, exc: MailboxError) -> CliError:
    """One line saying whose fault a store failure is."""
    if isinstance(exc, MailboxUnavailable):
        return CliError(f"cannot reach the mailbox at {url}: {exc}")
    if isinstance(exc, MailboxConfigError):
        return CliError(f"the mailbox at {url} refused: {exc}")
    if isinstance(exc, ProtocolError):
        return CliError(f"{url} holds something GradientMail did not write: {exc}")
    return CliError(f"{url}: {exc}")


class EmptyPrefix(CliError):
    """Nothing at all is stored under the URL."""


@dataclass(frozen=True)
class RunHead:
    """What the two create-once records at a prefix's root say."""

    manifest: p.Manifest | None
    creator: str | None


async def read_head(box: Mailbox, url: str) -> RunHead:
    """Read ``manifest.json`` and ``claims/creator``; raise :class:`CliError` for a prefix
    that holds no run (empty) or something else (foreign)."""
    manifest_data, creator_data = await asyncio.gather(box.get(p.MANIFEST), box.get(p.CREATOR))
    try:
        manifest = None if manifest_data is None else p.decode_manifest(p.MANIFEST, manifest_data)
        claim = None if creator_data is None else p.decode_creator(p.CREATOR, creator_data)
    except ProtocolError as exc:
        raise CliError(f"{url} is not a GradientMail run: {exc}") from None
    if manifest is None and claim is None:
        keys = await box.list("")
        if not keys:
            raise EmptyPrefix(f"no run at {url}: the prefix is empty")
        sample = ", ".join(keys[:3])
        raise CliError(
            f"{url} is not a GradientMail run: {len(keys)} object{'s' if len(keys) > 1 else ''} "
            f"({sample}"
            f"{', …' if len(keys) > 3 else ''}) but no {p.MANIFEST} or {p.CREATOR}"
        )
    creator = manifest.creator if manifest else claim.learner if claim else None
    return RunHead(manifest, creator)


async def require_manifest(box: Mailbox, url: str) -> p.Manifest:
    head = await read_head(box, url)
    if head.manifest is None:
        raise CliError(
            f"the run at {url} is being created by {head.creator}: no {p.MANIFEST} yet; "
            "try again in a moment"
        )
    return head.manifest


def confirm(question: str, assume_yes: bool) -> bool:
    """Ask on the terminal (or read a line from stdin); anything but y/yes is no."""
    if assume_yes:
        return True
    err().print(f"{question} [y/N] ", end="", markup=False)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        answer = ""
    if not answer.endswith("\n"):
        err().print()
    return answer.strip().lower() in ("y", "yes")


@contextmanager
def progress(what: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr when it is a terminal; yields ``advance(n)``."""
    console = err()
    if not enabled or not console.is_terminal or total <= 0:
        yield lambda n: None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- a node's traceback, folded --------------------------------------------------------------

_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


class TracebackFolder:
    """Folds each Python traceback in a stream of output lines into its last line.

    ``feed(line)`` returns the lines to show now: every ordinary line as it is; a traceback
    (``Traceback (most recent call last):``, its indented frames, chained ones after it)
    as one line, ``{prefix}{ExceptionType: message}{suffix}``, once its final exception
    line is known. ``flush()`` returns what is still held (at the end of the stream). The
    whole traceback stays wherever the raw output goes (a node's log file).
    """

    def __init__(self, prefix: str = "", suffix: str = "") -> None:
        self.prefix = prefix
        self.suffix = suffix
        self._inside = False  # between "Traceback ..." and its exception line
        self._pending: str | None = None  # an exception line a chained traceback may follow

    def feed(self, line: str) -> list[str]:
        if self._inside:
            if not line.strip() or line[:1].isspace():
                return []  # a frame, its source line, carets, a blank line
            self._inside = False
            self._pending = line
            return []
        if self._pending is not None:
            if not line.strip() or line.strip() in _CHAINED:
                return []
            if line.startswith("Traceback (most recent call last):"):
                self._pending = None  # the chained traceback's own line comes last
                self._inside = True
                return []
            return [*self.flush(), *self.feed(line)]
        if line.startswith("Traceback (most recent call last):"):
            self._inside = True
            return []
        return [line]

    def flush(self) -> list[str]:
        pending, self._pending = self._pending, None
        if pending is None:
            if self._inside:  # cut off before its exception line
                self._inside = False
                return [f"{self.prefix}a traceback without its last line{self.suffix}"]
            return []
        return [f"{self.prefix}{pending}{self.suffix}"]
