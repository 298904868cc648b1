"""The mailbox contract suite: what every backend must guarantee, as runnable checks.

Two layers, usable without each other:

- ``check_*`` functions take a mailbox and raise ``AssertionError`` naming the broken
  guarantee. They run their own event loops, so they work from any test framework.
- :class:`MailboxContract` turns them into pytest tests. Subclass it in a module of your
  tests under a ``Test*`` name and provide a ``mailbox`` fixture that yields a fresh, empty
  store for each test::

      import pytest
      from gradientmail.testing import MailboxContract

      @pytest.fixture
      def mailbox(tmp_path):
          yield MyMailbox(tmp_path)

      class TestMyMailbox(MailboxContract):
          pass

The create-once race also runs across processes: the mailbox is pickled into spawned
children, which must reach the same store. A backend that lives in one process (like
:class:`MemoryMailbox`) must refuse to be pickled with ``TypeError`` instead, so it can
never silently split into two stores.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import pickle
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox import Mailbox
from gradientmail.testing.faults import FaultyMailbox

__all__ = [
    "MailboxContract",
    "check_byte_order_listing",
    "check_create_once",
    "check_create_once_race_processes",
    "check_create_once_race_threads",
    "check_delete_idempotent",
    "check_get_missing",
    "check_list_after",
    "check_lost_response_retry",
    "check_many_event_loops",
    "check_read_after_write",
    "check_whole_objects",
    "ordering_keys",
]

T = TypeVar("T")
LISTING_SIZE = 1001  # one more than an S3 listing page or DeleteObjects batch


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _bounded(jobs: Iterable[Callable[[], Awaitable[T]]], limit: int = 16) -> list[T]:
    semaphore = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with semaphore:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


async def _put_all(box: Mailbox, items: dict[str, bytes]) -> None:
    def job(key: str, data: bytes) -> Callable[[], Awaitable[bool]]:
        return lambda: box.put_if_absent(key, data)

    created = await _bounded(job(key, data) for key, data in items.items())
    assert all(created), "put_if_absent on fresh keys must return True"


def ordering_keys(root: str = "order/", count: int = LISTING_SIZE) -> list[str]:
    """``count`` keys under ``root`` whose byte order differs from case-folded order,
    from UTF-16 order, and from a directory walk's order."""
    special = [
        "B",
        "a",
        "Z",
        "_",
        "~",
        "é",
        "z",  # 'B' < 'Z' < '_' < 'a' in bytes; not when folded
        "\uff5e",
        "\U0001f600",  # U+FF5E < U+1F600 in UTF-8; reversed in UTF-16
        "x-c",
        "x/b",
        "x0",  # '-' < '/' < '0': a walk of x/ would not interleave these
    ]
    numbered = [f"n{i:05d}" for i in range(count - len(special))]
    return [root + name for name in special + numbered]


def _body(worker: int, index: int, size: int) -> bytes:
    head = f"worker={worker} key={index};".encode()
    return (head * (size // len(head) + 1))[:size]


# -- single-client guarantees ----------------------------------------------------------------


def check_create_once(box: Mailbox) -> None:
    async def run() -> None:
        assert await box.put_if_absent("once/a", b"first") is True
        assert await box.put_if_absent("once/a", b"second") is False, "second create succeeded"
        assert await box.get("once/a") == b"first", "a failed put_if_absent replaced the object"

    _run(run())


def check_get_missing(box: Mailbox) -> None:
    async def run() -> None:
        assert await box.get("missing/key") is None
        await box.put_if_absent("missing/other", b"x")
        assert await box.get("missing/key") is None
        assert await box.list("missing/key") == [], "list of a missing key must be empty"

    _run(run())


def check_whole_objects(box: Mailbox) -> None:
    """Empty, binary and multi-MiB bodies come back byte for byte; odd keys round-trip."""
    blobs = {
        "whole/empty": b"",
        "whole/binary": bytes(range(256)) * 4,
        "whole/large": _body(0, 0, 3 * 1024 * 1024 + 7),
        "whole/sp ace+plus%25?q=1#frag": b"url-special",
        "whole/é/\U0001f600": b"unicode",
    }

    async def run() -> None:
        await _put_all(box, blobs)
        for key, data in blobs.items():
            got = await box.get(key)
            assert got == data, f"{key!r}: got {None if got is None else len(got)} bytes back"
        assert list(await box.list("whole/")) == sorted(blobs)

    _run(run())


def check_byte_order_listing(box: Mailbox) -> None:
    """1,001 keys listed completely, in UTF-8 byte order, scoped to the prefix."""
    keys = ordering_keys()
    expected = sorted(keys, key=lambda k: k.encode("utf-8"))
    neighbours = {"orde/0": b"n", "orderly/0": b"n", "p/0": b"n", "order-": b"n"}

    async def run() -> None:
        await _put_all(box, {k: b"v" for k in keys} | neighbours)
        listed = list(await box.list("order/"))
        assert len(listed) == len(keys), f"listed {len(listed)} of {len(keys)} keys"
        assert listed == expected, "listing is not in UTF-8 byte order"
        partial = list(await box.list("order"))
        assert partial == sorted(["order-", "orderly/0", *keys], key=lambda k: k.encode()), (
            "a prefix that ends mid-segment must match every key starting with it"
        )
        assert list(await box.list("order/x")) == [k for k in expected if k.startswith("order/x")]

    _run(run())


def check_list_after(box: Mailbox) -> None:
    keys = [f"after/{i:04d}" for i in range(LISTING_SIZE)]

    async def run() -> None:
        await _put_all(box, {k: b"v" for k in keys})
        assert list(await box.list("after/", after="after/0499")) == keys[500:]
        assert list(await box.list("after/", after="after/0499x")) == keys[500:]
        assert list(await box.list("after/", after="after/9999")) == []
        assert list(await box.list("after/", after="a")) == keys, "a cursor before the prefix"
        assert list(await box.list("after/", after="")) == keys
        assert list(await box.list("after/", after=keys[-2])) == keys[-1:]

    _run(run())


def check_delete_idempotent(box: Mailbox) -> None:
    keys = [f"del/{i:04d}" for i in range(LISTING_SIZE)]
    missing = [f"del/missing-{i}" for i in range(20)]

    async def run() -> None:
        await _put_all(box, {k: b"v" for k in keys} | {"keep/1": b"k"})
        await box.delete(keys[:10])
        await box.delete(keys + missing)  # some already gone, some never existed
        assert list(await box.list("del/")) == []
        assert await box.get(keys[0]) is None
        assert await box.get(keys[-1]) is None
        await box.delete(keys)  # everything missing
        await box.delete([])
        assert await box.get("keep/1") == b"k", "delete removed a key it was not given"
        assert await box.put_if_absent(keys[3], b"again") is True, "a deleted key is free again"

    _run(run())


def check_read_after_write(box: Mailbox) -> None:
    """A write that returned is visible to get and list from another thread at once."""

    def observe(key: str) -> tuple[bytes | None, Sequence[str]]:
        async def look() -> tuple[bytes | None, Sequence[str]]:
            return await box.get(key), await box.list("raw/", after="")

        return asyncio.run(look())

    async def run() -> None:
        for i in range(20):
            key = f"raw/{i:03d}"
            await box.put_if_absent(key, key.encode())
            data, listed = await asyncio.to_thread(observe, key)
            assert data == key.encode(), f"get({key!r}) right after its write returned {data!r}"
            assert key in listed, f"list right after writing {key!r} did not show it"

    _run(run())


def check_many_event_loops(box: Mailbox, threads: int = 4, ops: int = 20) -> None:
    """One instance used concurrently from several event loops on several threads."""
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def worker(n: int) -> None:
        async def work() -> None:
            async def one(i: int) -> None:
                key = f"loops/{n}/{i:03d}"
                assert await box.put_if_absent(key, key.encode()) is True
                assert await box.get(key) == key.encode()

            start.wait(timeout=30)
            await asyncio.gather(*(one(i) for i in range(ops)))
            listed = await box.list(f"loops/{n}/")
            assert len(listed) == ops, f"thread {n} listed {len(listed)} of {ops} keys"

        try:
            asyncio.run(work())
        except BaseException as exc:  # reported below, with the thread it came from
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in pool), "a thread is stuck using the mailbox"
    assert not errors, f"errors on other event loops: {errors!r}"
    # ...and a fresh loop after all those loops have closed still works.
    assert _run(box.get("loops/0/000")) == b"loops/0/000"


def check_lost_response_retry(box: Mailbox) -> None:
    """A put whose response is lost was applied; its retry must find the key taken."""
    faulty = FaultyMailbox(box).lose_response("put_if_absent", 1).fail_before("get", 1)

    async def run() -> None:
        try:
            await faulty.put_if_absent("lost/1", b"payload")
        except MailboxUnavailable:
            pass
        else:
            raise AssertionError("the injected lost response did not raise")
        assert await faulty.put_if_absent("lost/1", b"payload") is False
        try:
            await faulty.get("lost/1")
        except MailboxUnavailable:
            pass
        else:
            raise AssertionError("the injected failure did not raise")
        assert await faulty.get("lost/1") == b"payload"
        assert [i.kind for i in faulty.injected] == ["lost", "before"]

    _run(run())


# -- create-once under a race ------------------------------------------------------------------


@dataclass(frozen=True)
class _Attempt:
    worker: int
    key: str
    won: bool
    read_back: str  # sha256 hex of what the worker read right after its attempt ("" = None)
    length: int


def _digest(data: bytes | None) -> str:
    return "" if data is None else hashlib.sha256(data).hexdigest()


async def _race(box: Mailbox, worker: int, keys: Sequence[str], size: int) -> list[_Attempt]:
    attempts = []
    for index, key in enumerate(keys):
        won = await box.put_if_absent(key, _body(worker, index, size))
        data = await box.get(key)
        attempts.append(_Attempt(worker, key, won, _digest(data), len(data or b"")))
    return attempts


def _verify_race(box: Mailbox, keys: Sequence[str], attempts: list[_Attempt], size: int) -> None:
    for index, key in enumerate(keys):
        mine = [a for a in attempts if a.key == key]
        winners = [a.worker for a in mine if a.won]
        assert len(winners) == 1, f"{key!r}: {len(winners)} put_if_absent calls returned True"
        expected = _digest(_body(winners[0], index, size))
        for attempt in mine:
            assert attempt.read_back == expected, (
                f"{key!r}: worker {attempt.worker} read {attempt.length} bytes that are not "
                f"the winner's {size}-byte body (partial object or replaced winner)"
            )
        stored = _run(box.get(key))
        assert _digest(stored) == expected, f"{key!r}: the stored body is not the winner's"


def _race_keys(count: int) -> list[str]:
    return [f"race/{i:04d}" for i in range(count)]


def check_create_once_race_threads(
    box: Mailbox, *, workers: int = 8, keys: int = 64, size: int = 64 * 1024
) -> None:
    """``workers`` threads, each on its own event loop, create the same keys at once."""
    names = _race_keys(keys)
    start = threading.Barrier(workers)
    results: list[list[_Attempt]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        try:
            start.wait(timeout=30)
            results[worker] = asyncio.run(_race(box, worker, names, size))
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=300)
    assert not errors, f"racing threads failed: {errors!r}"
    _verify_race(box, names, [a for r in results for a in r], size)


def _process_worker(
    blob: bytes, worker: int, names: list[str], size: int, start: Any, out: Any
) -> None:
    box = pickle.loads(blob)
    start.wait(60)
    try:
        out.put((worker, asyncio.run(_race(box, worker, names, size)), None))
    except BaseException as exc:
        out.put((worker, [], repr(exc)))


def check_create_once_race_processes(
    box: Mailbox, *, workers: int = 4, keys: int = 32, size: int = 64 * 1024
) -> None:
    """``workers`` spawned processes, each opening the same store, create the same keys.

    A process-local backend must instead refuse pickling with ``TypeError``.
    """
    try:
        blob = pickle.dumps(box)
    except TypeError:
        return  # one-process backend: it refused to be shared, which is the contract
    names = _race_keys(keys)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(workers)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_process_worker, args=(blob, w, names, size, start, out))
        for w in range(workers)
    ]
    for proc in procs:
        proc.start()
    attempts: list[_Attempt] = []
    try:
        for _ in procs:
            worker, got, error = out.get(timeout=300)
            assert error is None, f"racing process {worker} failed: {error}"
            attempts.extend(got)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    _verify_race(box, names, attempts, size)


# -- pytest adapter ------------------------------------------------------------------------------


class MailboxContract:
    """pytest tests for the mailbox contract; subclass and provide a ``mailbox`` fixture."""

    def test_create_once(self, mailbox: Mailbox) -> None:
        check_create_once(mailbox)

    def test_create_once_race_threads(self, mailbox: Mailbox) -> None:
        check_create_once_race_threads(mailbox)

    def test_create_once_race_processes(self, mailbox: Mailbox) -> None:
        check_create_once_race_processes(mailbox)

    def test_get_missing(self, mailbox: Mailbox) -> None:
        check_get_missing(mailbox)

    def test_whole_objects(self, mailbox: Mailbox) -> None:
        check_whole_objects(mailbox)

    def test_byte_order_listing(self, mailbox: Mailbox) -> None:
        check_byte_order_listing(mailbox)

    def test_list_after(self, mailbox: Mailbox) -> None:
        check_list_after(mailbox)

    def test_delete_idempotent(self, mailbox: Mailbox) -> None:
        check_delete_idempotent(mailbox)

    def test_read_after_write(self, mailbox: Mailbox) -> None:
        check_read_after_write(mailbox)

    def test_many_event_loops(self, mailbox: Mailbox) -> None:
        check_many_event_loops(mailbox)

    def test_lost_response_retry(self, mailbox: Mailbox) -> None:
        check_lost_response_retry(mailbox)
