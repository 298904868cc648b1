"""What every subcommand shares: opening a URL with clear errors, confirmations, output."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlsplit

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

# Bounds for the CLI's own S3 requests, so an unreachable endpoint fails in seconds rather
# than minutes; options in the URL itself win.
S3_OPTIONS = {"connect_timeout": 3.0, "read_timeout": 30.0, "max_attempts": 2}
USAGE = 2  # exit status for a bad URL, flag or spec file (as argparse uses)


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


def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def run_async(call: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await call()

    return asyncio.run(main())


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
        return open_mailbox(url, **S3_OPTIONS) if scheme == "s3" else open_mailbox(url)
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
