"""Shared Queue: claims under units/, exactly-once units, prefetch, errors, crashes.

Nodes are threads sharing one mailbox object (over every backend) or, on a file mailbox,
real processes started from this module (``node_main``), one of them killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import gradientmail as gm
from gradientmail.patterns.barrier import Barrier
from gradientmail.patterns.shared_queue import (
    DONE,
    QUEUE_LEASES,
    RECLAIMS,
    UNITS,
    SharedQueue,
    claim,
    claim_key,
    done_key,
    shared_queue,
)
from gradientmail.testing import CheckThenWriteMailbox, FaultyMailbox
from tests.support.waiting import TEST_TIMEOUT, wait_until

REPO = Path(__file__).resolve().parents[2]
Batch = tuple[str, int]


def _keys(box: gm.Mailbox, prefix: str = "") -> list[str]:
    return list(asyncio.run(box.list(prefix)))


def _get(box: gm.Mailbox, key: str) -> bytes | None:
    return asyncio.run(box.get(key))


def _put(box: gm.Mailbox, key: str, data: bytes) -> None:
    assert asyncio.run(box.put_if_absent(key, data))


def _done(box: gm.Mailbox) -> dict[str, dict[str, object]]:
    """unit -> its done marker."""
    return {key[len(DONE) :]: json.loads(_get(box, key) or b"null") for key in _keys(box, DONE)}


def _units(count: int) -> list[str]:
    return [f"shard-{i:03d}" for i in range(count)]


@dataclass
class Node:
    """One node of a thread-based run: what it loaded and what its loop received."""

    name: str
    loads: list[str] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    queue: SharedQueue[Batch] | None = None
    error: BaseException | None = None


def _loader(node: Node, batches: int, delay: float = 0.0):  # type: ignore[no-untyped-def]
    def load(unit: str) -> Iterator[Batch]:
        node.loads.append(unit)
        for i in range(batches):
            if delay:
                time.sleep(delay)
            yield (unit, i)

    return load


def _run(
    box: gm.Mailbox,
    names: list[str],
    units: list[str],
    *,
    batches: int = 3,
    step: float = 0.0,
    clock: Callable[[], float] | None = None,
    **options: float,
) -> list[Node]:
    """``clock``: the nodes' observer clock, for judging the others' leases."""
    nodes = [Node(name) for name in names]
    options.setdefault("poll_interval", 0.05)

    def run(node: Node) -> None:
        try:
            node.queue = shared_queue(
                units, mailbox=box, learner_id=node.name, load=_loader(node, batches), **options
            )
            if clock is not None:
                node.queue._worker.clock = clock
            for batch in node.queue:
                node.batches.append(batch)
                if step:
                    time.sleep(step)
        except BaseException as exc:
            node.error = exc

    threads = [threading.Thread(target=run, args=(node,)) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TEST_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a queue never ended"
    for node in nodes:
        assert node.error is None, f"{node.name}: {node.error!r}"
    return nodes


def _drain(queue: Iterator[Batch], into: list[Batch]) -> None:
    for batch in queue:
        into.append(batch)


def _expected(units: list[str], batches: int) -> list[Batch]:
    return [(unit, i) for unit in units for i in range(batches)]


def test_every_unit_is_loaded_exactly_once_across_nodes(mailbox: gm.Mailbox) -> None:
    units = _units(24)
    nodes = _run(mailbox, ["n0", "n1", "n2"], units, batches=3)
    loads = Counter(unit for node in nodes for unit in node.loads)
    assert loads == Counter(units), "a unit was loaded twice or never"
    for node in nodes:
        # Each node's batches: its units in claim order, each unit's batches in load order.
        assert node.batches == _expected(node.loads, 3)
        assert node.loads == sorted(node.loads)  # every node walks the units in order
        assert node.queue is not None
        assert tuple(node.queue.loaded) == tuple(node.loads)
        assert tuple(node.queue.completed) == tuple(node.loads)
        assert node.queue.reclaimed == ()
        for unit in node.loads:
            assert _get(mailbox, claim_key(unit)) == node.name.encode()
    assert sorted(b for node in nodes for b in node.batches) == _expected(units, 3)
    done = _done(mailbox)
    assert sorted(done) == units
    owner = {unit: node.name for node in nodes for unit in node.loads}
    assert all(done[unit] == {"learner": owner[unit], "attempt": 0} for unit in units)
    assert _keys(mailbox, RECLAIMS) == []
    assert len(_keys(mailbox, UNITS)) == len(units)


def test_the_claim_expression_needs_atomic_create_once(mailbox: gm.Mailbox) -> None:
    """Spec 004: on a check-then-write store both claims win; on a real store one does."""

    async def race(box: gm.Mailbox, unit: str) -> list[bool]:
        return list(await asyncio.gather(claim(box, unit, "a"), claim(box, unit, "b")))

    racy = CheckThenWriteMailbox(pause=0.01)
    assert asyncio.run(race(racy, "u")) == [True, True]
    assert asyncio.run(racy.get("units/u")) in (b"a", b"b")  # the later write replaced one

    # Real backends: threads, each with its own event loop, race on every unit.
    wins: Counter[str] = Counter()
    units = _units(8)
    start = threading.Barrier(4)
    lock = threading.Lock()

    def contender(name: str) -> None:
        start.wait(timeout=TEST_TIMEOUT)
        for unit in units:
            if asyncio.run(claim(mailbox, unit, name)):
                with lock:
                    wins[unit] += 1

    threads = [threading.Thread(target=contender, args=(f"c{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TEST_TIMEOUT)
    assert wins == Counter(units), f"some unit had two winners: {wins}"
    assert asyncio.run(race(mailbox, "u")).count(True) == 1


def test_a_mailbox_error_surfaces_after_the_buffered_batches(mailbox: gm.Mailbox) -> None:
    # put_if_absent calls: 1 is the lease beat, 2-4 claim u0-u2, 5 (claiming u3) fails.
    faulty = FaultyMailbox(mailbox).fail_before("put_if_absent", 5)
    units = [f"u{i}" for i in range(10)]
    node = Node("a")
    queue = shared_queue(units, mailbox=faulty, learner_id="a", load=_loader(node, 2), prefetch=50)
    received = [next(queue)]
    wait_until(lambda: faulty.injected, "the injected failure")
    with pytest.raises(gm.MailboxUnavailable, match="injected: put_if_absent"):
        _drain(queue, received)
    assert received == _expected(["u0", "u1", "u2"], 2)
    assert next(queue, None) is None  # the queue stays ended
    assert [(i.call, i.key) for i in faulty.injected] == [(5, claim_key("u3"))]
    assert _keys(mailbox, UNITS) == [claim_key(u) for u in ("u0", "u1", "u2")]
    # The units whose batches were all taken are done; the loop finished each of them.
    assert sorted(_done(mailbox)) == ["u0", "u1", "u2"]


def test_a_failed_done_marker_ends_the_queue_after_the_buffered_batches(
    mailbox: gm.Mailbox,
) -> None:
    # 1: lease beat, 2-4: claims of u0-u2, 5: u0's done marker (fails).
    faulty = FaultyMailbox(mailbox).fail_before("put_if_absent", 5)
    node = Node("a")
    queue = shared_queue(
        ["u0", "u1", "u2"], mailbox=faulty, learner_id="a", load=_loader(node, 2), prefetch=50
    )
    received = [next(queue)]
    # Let the loader buffer everything first, so the failure comes after the last batch.
    producer = queue._worker._producer
    wait_until(lambda: producer is not None and not producer.is_alive(), "every unit loaded")
    with pytest.raises(gm.MailboxUnavailable, match="injected: put_if_absent"):
        _drain(queue, received)
    assert received == _expected(["u0", "u1", "u2"], 2)
    assert [(i.call, i.key) for i in faulty.injected] == [(5, done_key("u0"))]
    assert sorted(_done(mailbox)) == ["u1", "u2"]


def test_an_error_in_load_surfaces_after_the_buffered_batches() -> None:
    box = gm.MemoryMailbox()

    def load(unit: str) -> Iterator[Batch]:
        yield (unit, 0)
        if unit == "u2":
            raise OSError(f"cannot read {unit}")
        yield (unit, 1)

    received: list[Batch] = []
    queue = shared_queue(["u0", "u1", "u2", "u3"], mailbox=box, learner_id="a", load=load)
    with pytest.raises(OSError, match="cannot read u2"):
        _drain(queue, received)
    assert received == [("u0", 0), ("u0", 1), ("u1", 0), ("u1", 1), ("u2", 0)]
    assert sorted(_done(box)) == ["u0", "u1"]
    assert _keys(box, UNITS) == [claim_key(u) for u in ("u0", "u1", "u2")]


def test_units_of_a_crashed_node_are_reclaimed_after_its_lease_lapses(
    mailbox: gm.Mailbox,
) -> None:
    """A ghost claimed six units, finished three, and stopped beating."""
    units = _units(10)
    for unit in units[:6]:
        _put(mailbox, claim_key(unit), b"ghost")
    for unit in units[:3]:
        _put(mailbox, done_key(unit), b'{"attempt":0,"learner":"ghost"}')
    _put(mailbox, "units-leases/ghost/0000000007", b"ghost")
    lease = 0.6
    clock = _BeatClock(mailbox, ["a", "b"], lease)
    stepping = threading.Thread(target=clock.run, daemon=True)
    stepping.start()
    try:
        nodes = _run(mailbox, ["a", "b"], units, batches=2, lease_timeout=lease, clock=clock)
    finally:
        clock.stop.set()
        stepping.join(timeout=TEST_TIMEOUT)
    assert clock.error is None, clock.error
    assert clock.now >= lease, "units were taken over before the ghost's lease could lapse"
    loads = Counter(unit for node in nodes for unit in node.loads)
    assert loads == Counter(units[3:]), "a done unit was reloaded, or a unit twice"
    reclaimed = sorted(u for node in nodes for u in node.queue.reclaimed)  # type: ignore[union-attr]
    assert reclaimed == units[3:6]
    assert sorted(_keys(mailbox, RECLAIMS)) == [claim_key(u, 1) for u in units[3:6]]
    done = _done(mailbox)
    assert sorted(done) == units
    for unit in units[3:6]:
        assert done[unit]["attempt"] == 1
        assert _get(mailbox, claim_key(unit, 1)) == str(done[unit]["learner"]).encode()


class _BeatClock:
    """The live nodes' observer clock: it moves a third of a lease each time every node
    that still runs has beaten again, so a node that beats is never judged gone however
    late its beats come on a loaded machine, and one that stopped (a ghost) is after three
    steps. It starts once every node has beaten."""

    def __init__(self, box: gm.Mailbox, names: list[str], lease: float) -> None:
        self.box, self.names, self.lease = box, names, lease
        self.now = 0.0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def __call__(self) -> float:
        return self.now

    def _newest(self) -> dict[str, str]:
        beats = _keys(self.box, "units-leases/")
        return {n: max((k for k in beats if k.startswith(f"units-leases/{n}/")), default="")
                for n in self.names}  # fmt: skip

    def run(self) -> None:
        leaving = f"{10**10 - 1:010d}"
        try:
            while not self.stop.is_set():
                seen = self._newest()
                if not all(seen.values()):
                    self.stop.wait(0.02)  # not every node has started: the clock waits
                    continue
                running = [n for n in self.names if not seen[n].endswith(leaving)]
                if not running:
                    return
                wait_until(
                    lambda seen=seen, running=running: (
                        self.stop.is_set() or all(self._newest()[n] != seen[n] for n in running)
                    ),
                    "a new beat of every running node",
                )
                self.now += self.lease / 3
        except BaseException as exc:
            self.error = exc


class _StepClock:
    """An observer's clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _SeenBeatsMove(gm.Mailbox):
    """The waiting node's view of the store: its clock moves by a third of the lease for
    each new beat of ``node`` that one of its own listings shows, and only then. A clock
    moved by beats the test saw instead would race the observer's polling: on a loaded
    machine three beats can land between two of its listings, and the lease it judges
    would age by a whole ``lease`` without it having seen any of them."""

    def __init__(self, inner: gm.Mailbox, clock: _StepClock, node: str, lease: float) -> None:
        self.inner, self.clock, self.lease = inner, clock, lease
        self.prefix = f"{QUEUE_LEASES}{node}/"
        self.newest = -1

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def delete(self, keys: Iterable[str]) -> None:
        await self.inner.delete(keys)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        keys = await self.inner.list(prefix, after=after)
        beats = [int(k[len(self.prefix) :]) for k in keys if k.startswith(self.prefix)]
        running = [b for b in beats if b < 10**10 - 1]  # not the leaving beat
        if running and max(running) > self.newest:
            if self.newest >= 0:  # the first look starts the watch; later beats move it
                self.clock.now += (max(running) - self.newest) * self.lease / 3
            self.newest = max(running)
        return keys


def test_a_slow_but_live_node_keeps_its_unit(mailbox: gm.Mailbox) -> None:
    """The queue renews its lease while the loop works: a waiting node never steals.

    The waiting node judges leases on a clock of its own that moves by a third of the lease
    for each new beat of the slow node its own listings show (:class:`_SeenBeatsMove`),
    three leases in all while it waits for u0: a live node is never judged gone, whatever
    the real delays on a loaded machine; a node that stopped beating while its loop works
    fails the wait for its next beat.
    """
    lease_timeout = 1.5
    slow, fast = Node("slow"), Node("fast")
    options = {"lease_timeout": lease_timeout, "poll_interval": 0.05}
    queue = shared_queue(
        ["u0", "u1"],
        mailbox=mailbox,
        learner_id="slow",
        load=_loader(slow, 10),
        prefetch=1,  # so that it claims u1 only after u0's last batch went into the buffer
        **options,
    )
    clock = _StepClock()
    observed = _SeenBeatsMove(mailbox, clock, "slow", lease_timeout)
    waiting = shared_queue(
        ["u0", "u1"], mailbox=observed, learner_id="fast", load=_loader(fast, 4), **options
    )
    waiting._worker.clock = clock

    with queue:
        first = next(queue)
        thread = threading.Thread(target=lambda: fast.batches.extend(waiting))
        thread.start()
        # The fast node has done u1 and now waits on u0, whose owner is busy.
        wait_until(lambda: _get(mailbox, done_key("u1")), "the fast node to finish u1")
        rest = []
        for batch in queue:
            rest.append(batch)
            before = clock.now
            wait_until(
                lambda before=before: clock.now > before,  # type: ignore[misc]
                "the waiting node to see the slow node's next lease beat while its loop works",
            )
        thread.join(timeout=TEST_TIMEOUT)
    assert clock.now >= 3 * lease_timeout, "the waiting node watched for less than 3 leases"
    assert [first, *rest] == _expected(["u0"], 10)
    assert fast.batches == _expected(["u1"], 4)
    assert _keys(mailbox, RECLAIMS) == []
    assert {u: m["learner"] for u, m in _done(mailbox).items()} == {"u0": "slow", "u1": "fast"}


def test_a_restarted_node_reowns_its_unfinished_claims_at_once(mailbox: gm.Mailbox) -> None:
    units = _units(7)
    for unit in units[:4]:
        _put(mailbox, claim_key(unit), b"a")  # a's earlier life claimed four units
    for unit in units[:2]:
        _put(mailbox, done_key(unit), b'{"attempt":0,"learner":"a"}')  # and finished two
    # A unit of a's earlier life that another node took over and finished.
    _put(mailbox, claim_key(units[6]), b"a")
    _put(mailbox, claim_key(units[6], 1), b"c")
    _put(mailbox, done_key(units[6]), b'{"attempt":1,"learner":"c"}')
    # On a clock that never moves no lease can lapse: a node that waited for one would
    # never end (_run fails after TEST_TIMEOUT).
    [node] = _run(mailbox, ["a"], units, batches=2, lease_timeout=60, clock=_StepClock())
    assert node.loads == units[2:6]
    assert node.queue is not None
    assert node.queue.reclaimed == tuple(units[2:4])
    # Re-owning is itself a claim of the next attempt, so no other node can race it.
    assert _get(mailbox, claim_key(units[2], 1)) == b"a"
    assert _get(mailbox, claim_key(units[3], 1)) == b"a"
    assert sorted(_done(mailbox)) == units


def test_a_node_that_closes_early_leaves_its_units_to_the_others(mailbox: gm.Mailbox) -> None:
    units = _units(6)
    quitter = Node("q")
    with shared_queue(
        units, mailbox=mailbox, learner_id="q", load=_loader(quitter, 3), prefetch=2
    ) as queue:
        taken = [next(queue) for _ in range(4)]  # all of the first unit, one batch of the next
    assert taken == [(units[0], 0), (units[0], 1), (units[0], 2), (units[1], 0)]
    assert queue.completed == (units[0],)  # done markers are written before leaving
    assert next(queue, None) is None
    # q's leaving beat lets s take q's unfinished units at once, not after its lease: on a
    # clock that never moves no lease can lapse (_run fails after TEST_TIMEOUT if s waits).
    [stayer] = _run(mailbox, ["s"], units, batches=3, lease_timeout=60, clock=_StepClock())
    assert sorted(stayer.loads) == units[1:]
    assert stayer.queue is not None
    claimed_by_q = {u for u in units if _get(mailbox, claim_key(u)) == b"q"}
    assert units[1] in claimed_by_q
    assert set(stayer.queue.reclaimed) == claimed_by_q - {units[0]}
    done = _done(mailbox)
    assert sorted(done) == units
    assert done[units[0]]["learner"] == "q"
    assert all(done[u]["learner"] == "s" for u in units[1:])


def test_a_dropped_queue_closes_itself() -> None:
    box = gm.MemoryMailbox()
    units = _units(3)
    node = Node("a")
    for batch in shared_queue(units, mailbox=box, learner_id="a", load=_loader(node, 2)):
        if batch == (units[1], 0):
            break  # no with-block, no close(): the dropped iterator is finalized
    gc.collect()
    wait_until(lambda: "units-leases/a/9999999999" in _keys(box), "the leaving beat")
    assert sorted(_done(box)) == units[:1]
    [other] = _run(box, ["b"], units, batches=2, lease_timeout=60)
    assert sorted(other.loads) == units[1:]
    assert other.queue is not None
    claimed_by_a = {u for u in units if _get(box, claim_key(u)) == b"a"}
    assert set(other.queue.reclaimed) == claimed_by_a - {units[0]}
    assert sorted(_done(box)) == units


def test_prefetch_bounds_the_batches_loaded_ahead() -> None:
    box = gm.MemoryMailbox()
    produced: list[Batch] = []

    def load(unit: str) -> Iterator[Batch]:
        for i in range(100):
            produced.append((unit, i))
            yield (unit, i)

    with shared_queue(["big"], mailbox=box, learner_id="a", load=load, prefetch=5) as queue:
        assert next(queue) == ("big", 0)
        # Five batches wait in the buffer and the loader holds the next one.
        wait_until(lambda: len(produced) == 7, "the buffer to fill")
        time.sleep(0.2)
        assert len(produced) == 7
        assert [next(queue) for _ in range(3)] == [("big", 1), ("big", 2), ("big", 3)]
        wait_until(lambda: len(produced) == 10, "the loader to refill the buffer")


def test_nothing_is_claimed_before_iteration_starts() -> None:
    box = gm.MemoryMailbox()
    queue = shared_queue(["u0"], mailbox=box, learner_id="a", load=lambda unit: [unit])
    assert _keys(box) == []
    assert list(queue) == ["u0"]
    assert _keys(box, UNITS) == ["units/u0"]
    empty = shared_queue([], mailbox=box, learner_id="a", load=lambda unit: [unit])
    assert list(empty) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"units": ["a/b"]}, ValueError, "contains '/'"),
        ({"units": [""]}, ValueError, "must not be empty"),
        ({"units": [".."]}, ValueError, "not a valid key segment"),
        ({"units": ["x\n"]}, ValueError, "control character"),
        ({"units": ["u" * 1010]}, ValueError, "fit in a mailbox key"),
        ({"units": [3]}, TypeError, "must be a str"),
        ({"units": ["u1", "u2", "u1"]}, ValueError, "appears twice"),
        ({"units": "u1"}, TypeError, "not a single string"),
        ({"learner_id": "a/b"}, ValueError, "not a valid key segment"),
        ({"learner_id": ""}, ValueError, "not a valid key segment"),
        ({"prefetch": 0}, ValueError, "prefetch must be an int >= 1"),
        ({"prefetch": True}, ValueError, "prefetch"),
        ({"poll_interval": 0}, ValueError, "poll_interval"),
        ({"lease_timeout": -1}, ValueError, "lease_timeout"),
        ({"load": "not callable"}, TypeError, "load must be callable"),
        ({"mailbox": object()}, TypeError, "must implement gm.Mailbox"),
    ],
)
def test_bad_arguments_fail_before_any_io(kwargs: dict, error: type, message: str) -> None:
    box = FaultyMailbox(gm.MemoryMailbox())
    arguments = {
        "units": ["u1", "u2"],
        "mailbox": box,
        "learner_id": "a",
        "load": lambda unit: [unit],
    } | kwargs
    with pytest.raises(error, match=message):
        shared_queue(**arguments)
    assert sum(box.calls.values()) == 0


# -- real processes on a file mailbox --------------------------------------------------------


def node_main(argv: list[str]) -> None:
    """One node process: line up with the others, then consume the queue, logging as it goes.

    argv: root learner nodes units batches step lease_timeout log
    """
    root, learner, nodes, count, batches, step, lease, log_path = argv
    box = gm.FileMailbox(root)
    with open(log_path, "a", buffering=1) as log:

        def note(**entry: object) -> None:
            log.write(json.dumps(entry) + "\n")

        def load(unit: str) -> Iterator[Batch]:
            note(event="load", unit=unit)
            for i in range(int(batches)):
                yield (unit, i)

        Barrier(mailbox=box, learner_id=learner, poll_interval=0.02).wait(
            "start", parties=int(nodes), timeout=60
        )
        queue = shared_queue(
            _units(int(count)),
            mailbox=box,
            learner_id=learner,
            load=load,
            prefetch=2,
            poll_interval=0.05,
            lease_timeout=float(lease),
        )
        for unit, i in queue:
            note(event="batch", unit=unit, i=i)
            time.sleep(float(step))
        note(event="end", reclaimed=list(queue.reclaimed))


def _spawn(
    root: str,
    learner: str,
    nodes: int,
    units: int,
    batches: int,
    step: float,
    lease: float,
    log: Path,
) -> subprocess.Popen[bytes]:
    code = (
        "import sys; from tests.patterns.test_shared_queue import node_main; "
        "node_main(sys.argv[1:])"
    )
    args = [root, learner, nodes, units, batches, step, lease, log]
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)], cwd=REPO, stderr=subprocess.PIPE
    )


def _log(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _finish(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=TEST_TIMEOUT + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        assert proc.returncode == 0, f"{name} exited {proc.returncode}: {err.decode()[-3000:]}"


@pytest.fixture
def shared_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="gm-queue-") as root:
        yield root


def test_node_processes_share_a_file_mailbox(shared_dir: str, tmp_path: Path) -> None:
    names = ["p0", "p1", "p2"]
    units = _units(30)
    logs = {name: tmp_path / f"{name}.jsonl" for name in names}
    procs = {
        name: _spawn(shared_dir, name, len(names), len(units), 3, 0.002, 5.0, logs[name])
        for name in names
    }
    _finish(procs)
    loads: Counter[str] = Counter()
    for name in names:
        entries = _log(logs[name])
        mine = [str(e["unit"]) for e in entries if e["event"] == "load"]
        loads.update(mine)
        got = [(str(e["unit"]), int(e["i"])) for e in entries if e["event"] == "batch"]  # type: ignore[call-overload]
        assert got == _expected(mine, 3), f"{name}: batches out of order"
        assert entries[-1] == {"event": "end", "reclaimed": []}
    assert loads == Counter(units)
    box = gm.FileMailbox(shared_dir)
    assert sorted(_done(box)) == units
    assert sum(loads.values()) == len(units)


def test_a_killed_node_s_units_are_finished_by_the_others(shared_dir: str, tmp_path: Path) -> None:
    names = ["victim", "s1", "s2"]
    units = _units(30)
    # Long enough that a live survivor's beats seldom lag a whole lease on a loaded machine
    # (the checks below allow it: the other takes its unit over and loads it again).
    lease = 3.0
    logs = {name: tmp_path / f"{name}.jsonl" for name in names}
    procs = {
        name: _spawn(shared_dir, name, len(names), len(units), 4, 0.03, lease, logs[name])
        for name in names
    }
    box = gm.FileMailbox(shared_dir)

    def victim_done() -> int:
        return sum(1 for marker in _done(box).values() if marker["learner"] == "victim")

    try:
        wait_until(lambda: victim_done() >= 2, "the victim to finish two units")
    finally:
        procs["victim"].send_signal(signal.SIGKILL)
    procs["victim"].wait(timeout=TEST_TIMEOUT)
    assert procs["victim"].returncode == -signal.SIGKILL
    survivors = {name: proc for name, proc in procs.items() if name != "victim"}
    _finish(survivors)

    done = _done(box)
    assert sorted(done) == units, "a unit was never done"
    by_victim = {u for u, marker in done.items() if marker["learner"] == "victim"}
    claimed_by_victim = {u for u in units if _get(box, claim_key(u)) == b"victim"}
    abandoned = claimed_by_victim - by_victim
    assert abandoned, "the victim held no unfinished unit when it was killed"
    survivor_loads: Counter[str] = Counter()
    reclaimed: list[str] = []
    for name in survivors:
        entries = _log(logs[name])
        survivor_loads.update(str(e["unit"]) for e in entries if e["event"] == "load")
        reclaimed += entries[-1]["reclaimed"]  # type: ignore[operator]
    # Every unit the victim did not finish was loaded by a survivor, and the ones it held
    # only after being re-claimed; nothing the victim finished was loaded again. A unit
    # loaded twice must have been re-claimed: on a loaded machine a live survivor's beats
    # can lag a whole lease, and then the other takes its unit over (at least once, never
    # lost); the run's reclaim keys and the survivors' own reports name the same units.
    assert set(survivor_loads) == set(units) - by_victim
    reclaim_keys = {key.split("/")[1] for key in _keys(box, RECLAIMS)}
    assert abandoned <= set(reclaimed) == reclaim_keys
    assert {unit for unit, n in survivor_loads.items() if n > 1} <= reclaim_keys
    for unit in abandoned:
        assert int(done[unit]["attempt"]) >= 1  # type: ignore[call-overload]
        assert done[unit]["learner"] in survivors
