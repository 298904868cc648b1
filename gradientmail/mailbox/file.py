"""FileMailbox: objects as files in a directory shared by every process of a run.

Create-once works by hard-link staging: the bytes are written (and optionally fsynced) to a
uniquely named file under ``staging/``, then ``os.link`` puts it at the key's path under
``objects/``. ``link`` refuses an existing target, and the linked file already holds every
byte, so an object appears whole or not at all. (``O_CREAT | O_EXCL`` followed by a write
would create once too, but readers could see the file empty or half written.)

Beyond the minimal design this backend:

- fsyncs the staged file and the key's directory when ``fsync=True`` (the default), so a
  committed object survives a power loss or a kernel crash on a local filesystem;
- removes directories a delete leaves empty (a long run would otherwise leave thousands);
- sweeps staging files orphaned by a process killed between staging and linking: on
  open, a file from a dead process on this host, or older than ``staging_ttl``, goes.

Limits: tested on local filesystems with all processes on one machine. Network filesystems
(NFS, SMB) may not give read-after-write visibility or atomic ``link`` across machines. A key
cannot also be a directory of another key (``a`` and ``a/b``); GradientMail's own keys never
overlap that way.
"""

from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradientmail.errors import MailboxError, MailboxUnavailable
from gradientmail.mailbox._threaded import ThreadedMailbox

__all__ = ["FileMailbox"]

# Errors that a retry may cure; every other OSError is reported as a MailboxError.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.EIO,
        errno.ENOSPC,
        errno.ESTALE,
        errno.ETIMEDOUT,
        errno.EDQUOT,
        errno.EBUSY,
    }
)
_LINK_ATTEMPTS = 64


def _host_tag() -> str:
    return socket.gethostname().replace(".", "_") or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileMailbox(ThreadedMailbox):
    """Objects as files under ``root/objects``; the slashes of a key are directories."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = True,
        staging_ttl: float = 3600.0,
    ) -> None:
        self.root = Path(root).absolute()
        self.fsync = fsync
        self.staging_ttl = staging_ttl
        self._objects = self.root / "objects"
        self._staging = self.root / "staging"
        self._host = _host_tag()
        try:
            self._objects.mkdir(parents=True, exist_ok=True)
            self._staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _os_error(exc, f"cannot create the mailbox directory {self.root}") from exc
        self.sweep_staging()

    @property
    def url(self) -> str:
        query = "" if self.fsync else "?fsync=0"
        return f"{self.root.as_uri()}{query}"

    def __repr__(self) -> str:
        return f"FileMailbox({str(self.root)!r}, fsync={self.fsync})"

    def __reduce__(self) -> Any:
        return (_reopen, (str(self.root), self.fsync, self.staging_ttl))

    # -- blocking implementations ----------------------------------------------------------

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._objects / key
        staged = self._staging / f"{self._host}.{os.getpid()}.{uuid.uuid4().hex}"
        try:
            self._stage(staged, data)
            try:
                return self._link(staged, target, key)
            finally:
                staged.unlink(missing_ok=True)
        except MailboxError:
            raise
        except OSError as exc:
            raise _os_error(exc, f"put_if_absent({key!r}) in {self.root}") from exc

    def _stage(self, staged: Path, data: bytes) -> None:
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _link(self, staged: Path, target: Path, key: str) -> bool:
        for _ in range(_LINK_ATTEMPTS):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise _collision(key) from None  # a parent directory is some key's file
            try:
                os.link(staged, target)
            except FileExistsError:
                if target.is_dir():
                    raise _collision(key) from None
                return False
            except FileNotFoundError:
                # Race: a concurrent delete removed the (then empty) parent directory between
                # our mkdir and our link. Recreate it and try again.
                continue
            except NotADirectoryError:
                raise _collision(key) from None
            if self.fsync:
                _fsync_dir(target.parent)
            return True
        raise MailboxUnavailable(
            f"put_if_absent({key!r}): its directory in {self.root} kept disappearing "
            f"({_LINK_ATTEMPTS} attempts); is something deleting the mailbox?"
        )

    def _get(self, key: str) -> bytes | None:
        try:
            return (self._objects / key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as exc:
            raise _os_error(exc, f"get({key!r}) in {self.root}") from exc

    def _list(self, prefix: str, after: str) -> Sequence[str]:
        # Walk only the deepest directory the prefix names, then sort whole keys: a walk's
        # order is not byte order ("a-c" < "a/b" < "a0" in bytes).
        base = prefix.rpartition("/")[0]
        start = self._objects / base if base else self._objects
        found: list[str] = []
        root_len = len(str(self._objects)) + 1
        try:
            for directory, _dirs, names in os.walk(start):
                rel_dir = directory[root_len:]
                for name in names:
                    key = f"{rel_dir}/{name}" if rel_dir else name
                    if key.startswith(prefix) and key > after:
                        found.append(key)
        except OSError as exc:
            raise _os_error(exc, f"list({prefix!r}) in {self.root}") from exc
        found.sort()
        return found

    def _delete(self, keys: Sequence[str]) -> None:
        parents: set[Path] = set()
        try:
            for key in keys:
                path = self._objects / key
                try:
                    path.unlink()
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except IsADirectoryError:
                    continue  # "a" names a directory of other keys, not an object
                parents.add(path.parent)
        except OSError as exc:
            raise _os_error(exc, f"delete() in {self.root}") from exc
        self._prune(parents)

    def _prune(self, directories: set[Path]) -> None:
        """Remove directories that deletes left empty, deepest first, up to ``objects/``.

        A concurrent put may find its fresh directory removed before it links; ``_link``
        recreates it and retries.
        """
        for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
            while directory != self._objects:
                try:
                    directory.rmdir()
                except OSError:
                    break  # not empty, already gone, or in use: stop climbing
                directory = directory.parent

    def sweep_staging(self) -> int:
        """Remove staging files orphaned by crashed writers; return how many went.

        A staging file is orphaned when its writer (named in the file name) was on this host
        and is no longer running, or when it is older than ``staging_ttl`` seconds, which no
        single write takes.
        """
        removed = 0
        now = time.time()
        try:
            entries = list(os.scandir(self._staging))
        except OSError:
            return 0
        for entry in entries:
            host, _, rest = entry.name.partition(".")
            pid_text = rest.partition(".")[0]
            orphaned = host == self._host and pid_text.isdigit() and not _pid_alive(int(pid_text))
            try:
                if not orphaned:
                    orphaned = now - entry.stat().st_mtime > self.staging_ttl
                if orphaned:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                continue
        return removed


def _reopen(root: str, fsync: bool, staging_ttl: float) -> FileMailbox:
    return FileMailbox(root, fsync=fsync, staging_ttl=staging_ttl)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _collision(key: str) -> MailboxError:
    return MailboxError(
        f"key {key!r} collides with another key: FileMailbox stores keys as paths, so a key "
        "cannot also be a directory of another key (like 'a' and 'a/b')"
    )


def _os_error(exc: OSError, what: str) -> MailboxError:
    if exc.errno in _TRANSIENT_ERRNOS:
        return MailboxUnavailable(f"{what}: {exc.strerror or exc}")
    return MailboxError(f"{what}: {exc.strerror or exc}")
