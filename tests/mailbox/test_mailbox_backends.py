"""Behaviour of the built-in backends beyond the shared contract: bad input, the file
backend's housekeeping, the memory registry, and the deliberately broken store."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import gradientmail as gm
from gradientmail.testing import CheckThenWriteMailbox, check_create_once_race_threads

BAD_KEYS = [
    ("", "empty"),
    ("/rounds/1", "empty segment"),
    ("rounds//1", "empty segment"),
    ("rounds/", "empty segment"),
    ("rounds/../manifest.json", "'..' segment"),
    ("../escape", "'..' segment"),
    ("rounds/./1", "'.' segment"),
    ("bad\udcffkey", "not valid UTF-8"),
    ("ctl\x00key", "control character"),
    ("x" * 1025, "limit is 1024"),
]

# An S3 endpoint nothing listens on: if validation did any I/O the error would be
# MailboxUnavailable, not ValueError.
DEAD_ENDPOINT = "http://127.0.0.1:9"


def _builtin(kind: str, root: Path) -> gm.Mailbox:
    if kind == "memory":
        return gm.MemoryMailbox()
    if kind == "file":
        return gm.FileMailbox(root)
    return gm.S3Mailbox("bucket", "run", endpoint_url=DEAD_ENDPOINT, max_attempts=1)


@pytest.mark.parametrize("kind", ["memory", "file", "s3"])
@pytest.mark.parametrize(("key", "reason"), BAD_KEYS)
def test_bad_keys_rejected_before_io(kind: str, key: str, reason: str, tmp_path: Path) -> None:
    box = _builtin(kind, tmp_path)
    for call in (
        lambda: box.put_if_absent(key, b"x"),
        lambda: box.get(key),
        lambda: box.delete(["fine", key]),
    ):
        with pytest.raises(ValueError, match=reason):
            asyncio.run(call())
    if kind == "file":
        assert list((tmp_path / "objects").iterdir()) == []
        assert list((tmp_path / "staging").iterdir()) == []


@pytest.mark.parametrize("kind", ["memory", "file", "s3"])
def test_bad_list_arguments_rejected(kind: str, tmp_path: Path) -> None:
    box = _builtin(kind, tmp_path)
    for prefix in ("/x", "a//b", "../", "a/../b"):
        with pytest.raises(ValueError, match="list prefix"):
            asyncio.run(box.list(prefix))
    with pytest.raises(ValueError, match="not valid UTF-8"):
        asyncio.run(box.list("a/", after="\udcff"))
    with pytest.raises(TypeError, match="not a single key"):
        asyncio.run(box.delete("rounds/1"))
    with pytest.raises(TypeError, match="must be str"):
        asyncio.run(box.get(b"bytes-key"))  # type: ignore[arg-type]


def test_check_then_write_store_is_caught() -> None:
    """The race check must fail on a store that checks, then writes."""
    with pytest.raises(AssertionError, match="put_if_absent calls returned True"):
        check_create_once_race_threads(CheckThenWriteMailbox(pause=0.005), workers=8, keys=16)


def test_check_then_write_claims_both_succeed() -> None:
    """The spec's Shared Queue scenario: two claimants of one unit both get True."""
    box = CheckThenWriteMailbox(pause=0.01)

    async def claim(learner: str) -> bool:
        return await box.put_if_absent("units/0001", learner.encode())

    async def both() -> list[bool]:
        return list(await asyncio.gather(claim("a"), claim("b")))

    assert asyncio.run(both()) == [True, True]
    assert asyncio.run(gm.MemoryMailbox().put_if_absent("units/0001", b"a"))


def test_memory_mailbox_is_per_process_and_named() -> None:
    box = gm.MemoryMailbox.named("shared-run")
    assert gm.MemoryMailbox.named("shared-run") is box
    assert gm.open_mailbox("memory://shared-run") is box
    assert gm.open_mailbox("memory://other-run") is not box
    with pytest.raises(TypeError, match="cannot be sent to another"):
        pickle.dumps(box)


# -- FileMailbox housekeeping -----------------------------------------------------------------


def test_file_delete_prunes_empty_directories(tmp_path: Path) -> None:
    box = gm.FileMailbox(tmp_path, fsync=False)

    async def run() -> None:
        for key in ("a/b/c/1", "a/b/c/2", "a/b/d/1", "a/e/1"):
            assert await box.put_if_absent(key, b"x")
        await box.delete(["a/b/c/1", "a/b/c/2", "a/b/d/1"])

    asyncio.run(run())
    objects = tmp_path / "objects"
    remaining = sorted(p.relative_to(objects).as_posix() for p in objects.rglob("*"))
    assert remaining == ["a", "a/e", "a/e/1"]


def test_file_put_survives_concurrent_pruning(tmp_path: Path) -> None:
    """Deletes that empty a directory race puts into it; no put may fail or be lost."""
    box = gm.FileMailbox(tmp_path, fsync=False)
    stop = threading.Event()

    def churn() -> None:
        async def loop() -> None:
            i = 0
            while not stop.is_set() and i < 5000:
                key = f"hot/dir/churn-{i}"
                await box.put_if_absent(key, b"c")
                await box.delete([key])
                i += 1

        asyncio.run(loop())

    thread = threading.Thread(target=churn)
    thread.start()
    try:

        async def writes() -> list[bool]:
            return [await box.put_if_absent(f"hot/dir/keep-{i}", b"k") for i in range(300)]

        results = asyncio.run(writes())
    finally:
        stop.set()
        thread.join(timeout=60)
    assert all(results)
    assert len(asyncio.run(box.list("hot/dir/keep-"))) == 300


def test_file_sweeps_orphaned_staging_files(tmp_path: Path) -> None:
    gm.FileMailbox(tmp_path)
    staging = tmp_path / "staging"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host = os.uname().nodename.replace(".", "_")
    orphan_dead = staging / f"{host}.{int(dead.stdout)}.deadbeef"
    orphan_old = staging / "otherhost.1234.cafe"
    live = staging / f"{host}.{os.getpid()}.inflight"
    fresh_foreign = staging / "otherhost.99.fresh"
    for path in (orphan_dead, orphan_old, live, fresh_foreign):
        path.write_bytes(b"partial")
    an_hour_ago = time.time() - 3700
    os.utime(orphan_old, (an_hour_ago, an_hour_ago))

    gm.FileMailbox(tmp_path)

    assert sorted(p.name for p in staging.iterdir()) == sorted([live.name, fresh_foreign.name])


def test_file_fsync_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd))[1])
    asyncio.run(gm.FileMailbox(tmp_path / "durable").put_if_absent("k/1", b"x"))
    assert len(calls) == 2, "fsync=True syncs the staged file and the key's directory"
    calls.clear()
    asyncio.run(gm.FileMailbox(tmp_path / "fast", fsync=False).put_if_absent("k/1", b"x"))
    assert calls == []


def test_file_key_collision_is_a_clear_error(tmp_path: Path) -> None:
    box = gm.FileMailbox(tmp_path)
    asyncio.run(box.put_if_absent("a", b"x"))
    with pytest.raises(gm.MailboxError, match="cannot also be a directory"):
        asyncio.run(box.put_if_absent("a/b", b"y"))
    asyncio.run(box.put_if_absent("c/d", b"x"))
    with pytest.raises(gm.MailboxError, match="cannot also be a directory"):
        asyncio.run(box.put_if_absent("c", b"y"))
    assert asyncio.run(box.get("c")) is None


def test_file_unwritable_root_names_the_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(gm.MailboxError, match=str(blocker)):
        gm.FileMailbox(blocker / "run")


# -- open_mailbox -----------------------------------------------------------------------------


def test_open_file_and_roundtrip_url(tmp_path: Path) -> None:
    box = gm.open_mailbox(f"file://{tmp_path}/run?fsync=0")
    assert isinstance(box, gm.FileMailbox)
    assert box.fsync is False
    assert box.root == tmp_path / "run"
    again = gm.open_mailbox(box.url)
    assert isinstance(again, gm.FileMailbox)
    assert (again.root, again.fsync) == (box.root, box.fsync)
    default = gm.open_mailbox(f"file://{tmp_path}/other")
    assert isinstance(default, gm.FileMailbox)
    assert default.fsync is True


def test_open_s3_url() -> None:
    box = gm.open_mailbox(
        "s3://my-bucket/runs/exp%201?endpoint=http://127.0.0.1:9000&region=eu-west-1"
        "&read_timeout=7.5&max_attempts=2"
    )
    assert isinstance(box, gm.S3Mailbox)
    assert (box.bucket, box.prefix, box.endpoint_url) == (
        "my-bucket",
        "runs/exp 1",
        "http://127.0.0.1:9000",
    )
    again = gm.open_mailbox(box.url)
    assert isinstance(again, gm.S3Mailbox)
    assert (again.bucket, again.prefix, again.endpoint_url) == (
        box.bucket,
        box.prefix,
        box.endpoint_url,
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("bucket/prefix", "has no scheme"),
        ("ftp://host/x", "unsupported scheme 'ftp'"),
        ("file://server/share", "host 'server' is not supported"),
        ("file://localhost", "absolute path"),
        ("file:///tmp/x?fsync=maybe", "not a boolean"),
        ("file:///tmp/x?sync=1", "unknown option 'sync'"),
        ("s3:///prefix", "no bucket"),
        ("s3://b/p?endpoint=127.0.0.1:9000", "must be an http:// or https:// URL"),
        ("s3://b/p?read_timeout=-1", "must be positive"),
        ("s3://b/p?max_attempts=two", "not a number"),
        ("s3://b/p?region=a&region=b", "given twice"),
        ("s3://b/p/../q", "'..' segment"),
        ("memory://", "need a name"),
    ],
)
def test_open_mailbox_rejects_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gm.open_mailbox(url)


def test_s3_repr_and_pickle_hide_nothing_secret() -> None:
    box = gm.S3Mailbox(
        "b",
        "p",
        endpoint_url=DEAD_ENDPOINT,
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="very-secret-value",
    )
    assert "very-secret-value" not in repr(box)
    assert "very-secret-value" not in box.url
    clone: Callable[[], object] = lambda: pickle.loads(pickle.dumps(box))  # noqa: E731
    copy = clone()
    assert isinstance(copy, gm.S3Mailbox)
    assert copy.endpoint_url == box.endpoint_url
