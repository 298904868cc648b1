"""Host memory stays bounded: payloads stream in parts, the closer's sums do not grow with
the number of contributors, and nothing grows with the number of rounds.

The sizes themselves are measured by ``bench/memory.py``; these tests check the
invariants: pieces reassemble to the same bits however a payload is cut, summing in pieces
is bitwise summing whole, a part found corrupt half-way is excluded without a trace in the
commit, the closer's buffers are the same for 2 and 8 contributors, and a long run's
allocations (the library's ledger for tensors, ``tracemalloc`` for Python objects) stop
growing once warm.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing
import os
import random
import subprocess
import sys
import tracemalloc
from typing import Any

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.algorithms.base import accumulate
from gradientmail.engine.verify import verify_commit
from gradientmail.ledger import DOWNLOAD, GLOBAL, LEDGER, MOMENTUM
from gradientmail.payload import get_tensors, put_tensors, transfer
from gradientmail.payload.buffers import BufferPool
from gradientmail.payload.stream import WINDOW, read_into
from gradientmail.testing.reference import weighted_sum
from gradientmail.wire.parts import parse_index
from tests.engine.test_closer_faults import Run, go

MIXED = {
    "a.bf16": (333,),
    "b.f32": (17, 9),
    "c.i64": (7,),
    "d.empty": (0, 4),
    "e.f64": (101,),
    "f.bool": (13,),
}
DTYPES = {
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "i64": torch.int64,
    "empty": torch.float32,
    "f64": torch.float64,
    "bool": torch.bool,
}


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in MIXED.items():
        dtype = DTYPES[name.split(".")[1]]
        values = torch.randn(shape, generator=generator) * 100
        out[name] = values.to(dtype) if dtype != torch.bool else values > 0
    return out


@pytest.fixture
def part_bytes(monkeypatch: pytest.MonkeyPatch) -> Any:
    def set_to(n: int) -> None:
        monkeypatch.setattr(transfer, "PART_BYTES", n)

    return set_to


@pytest.mark.parametrize("size", [1, 3, 7, 8, 13, 64, 255, 1000, 1 << 20])
def test_a_payload_cut_anywhere_streams_back_bit_for_bit(part_bytes: Any, size: int) -> None:
    """Parts cut tensors, elements and the header anywhere; the stream reassembles them."""
    part_bytes(size)
    tensors = _mixed(size)
    box = gm.MemoryMailbox()
    key, _ = go(put_tensors(box, tensors))
    assert p.is_parts_key(key) == (size < 4000)
    fresh = go(get_tensors(box, key))
    into = {name: torch.empty_like(value) for name, value in tensors.items()}
    go(read_into(box, key, None, into))
    for name, value in tensors.items():
        assert fresh[name].dtype == value.dtype
        assert fresh[name].shape == value.shape
        assert torch.equal(fresh[name], value), name
        assert torch.equal(into[name], value), name


def test_a_stream_holds_a_window_of_parts_not_the_payload(part_bytes: Any) -> None:
    """Downloading a payload of 64 parts charges at most WINDOW (+ the one consumed) parts
    to ``download`` at once; encoding one holds at most four parts."""
    part_bytes(4096)
    tensors = {"w": torch.randn(64 * 1024)}  # 256 KiB: 64 parts
    box = gm.MemoryMailbox()
    LEDGER.usage(reset=True)
    key, size = go(put_tensors(box, tensors))
    encoded = LEDGER.usage(reset=True)
    assert 0 < encoded.peak["encode"] <= 4 * 4096 < size
    got = go(get_tensors(box, key))
    downloaded = LEDGER.usage()
    assert torch.equal(got["w"], tensors["w"])
    assert 0 < downloaded.peak[DOWNLOAD] - downloaded.live[DOWNLOAD] <= (WINDOW + 1) * 4096
    assert downloaded.peak[DOWNLOAD] < 2 * size  # the destination and a few parts, not more


def test_summing_in_pieces_is_bitwise_summing_whole() -> None:
    """The closer adds each contribution part by part (cut at arbitrary elements); verify
    adds whole tensors. They agree bit for bit."""
    algorithm = gm.DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    rng = random.Random(0)
    like = {"w": torch.zeros(100_003), "b": torch.zeros(37, 11)}
    contributions = [
        (name, samples, {k: torch.randn(v.shape) * 3 for k, v in like.items()})
        for name, samples in (("a", 3), ("b", 5), ("c", 7))
    ]
    whole = weighted_sum(algorithm, like, contributions)
    weights, _ = algorithm.weights([(c[0], c[1]) for c in contributions], None)
    pieces = {k: torch.zeros(v.shape) for k, v in like.items()}
    for (_, _, local), weight in zip(contributions, weights, strict=True):
        for name, value in local.items():
            flat = value.reshape(-1)
            cuts = sorted({0, flat.numel(), *(rng.randrange(flat.numel()) for _ in range(20))})
            for lo, hi in itertools.pairwise(cuts):
                accumulate(pieces[name], flat[lo:hi], weight, lo)
    for name in like:
        assert torch.equal(whole[name].view(torch.int32), pieces[name].view(torch.int32))


def _corrupt_part(run: Run, tensors: dict[str, torch.Tensor]) -> str:
    """Store ``tensors`` in parts, a part half-way with a byte flipped (the first parts
    hold the header, shared by every payload of the layout); return the index key."""
    scratch = gm.MemoryMailbox()
    key, _ = go(put_tensors(scratch, tensors))
    parts = parse_index(key, go(scratch.get(key)) or b"")
    which = len(parts) // 2
    assert len(parts) > which + 1
    for i, part in enumerate(parts):
        data = go(scratch.get(part["key"])) or b""
        if i == which:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        go(run.store.put_if_absent(part["key"], data))
    go(run.store.put_if_absent(key, go(scratch.get(key)) or b""))
    return key


def test_a_part_corrupt_halfway_excludes_the_snapshot_and_the_sums_start_again(
    part_bytes: Any,
) -> None:
    """Learner ``b``'s payload is good up to a part half-way: its first parts were already
    added when the corrupt one is found. The commit must hold exactly ``a`` and ``c``."""
    part_bytes(64)
    run = Run()
    own = run.publish(1, "a")
    base = run.params[0]
    broken = {k: v + 0.01 * torch.randn(v.shape) for k, v in base.items()}
    run.publish(1, "b", payload=_corrupt_part(run, broken))
    _, local_c = run.publish(1, "c")
    expected, _ = run.algorithm.combine(
        {k: v.clone() for k, v in base.items()}, None, [("a", 3, own[1]), ("c", 3, local_c)]
    )
    outcome = run.close(run.closer("a", run.tracker("a", "b", "c")), 1, own)
    assert outcome is not None
    assert outcome.params is not None
    commit = outcome.commit
    assert [c.learner for c in commit.contributors] == ["a", "c"]
    assert [x.learner for x in commit.excluded] == ["b"]
    assert "PayloadCorrupt" in commit.excluded[0].reason
    # Summed part by part, with a restart: the same bits as whole tensors of a and c alone.
    for name, value in expected.items():
        assert torch.equal(outcome.params[name].view(torch.int32), value.view(torch.int32))
    verified = go(verify_commit(run.store, 1, run.manifest))
    assert verified.contributors == ("a", "c")


def _close_with(contributors: int) -> dict[str, int]:
    """The ledger's peaks (above what was held before) while a closer sums ``contributors``
    snapshots of a fragment stored in many parts, in its second round (momentum too)."""
    run = Run()
    learners = [f"l{i}" for i in range(contributors)]
    peaks: dict[str, int] = {}
    for r in (1, 2):
        own = run.publish(r, learners[0])
        for learner in learners[1:]:
            run.publish(r, learner)
        closer = run.closer(learners[0], run.tracker(*learners))
        if r == 2:  # a fresh closer: it downloads the momentum too
            before = LEDGER.usage(reset=True)
        outcome = run.close(closer, r, own)
        assert outcome is not None
        assert len(outcome.commit.contributors) == contributors
    after = LEDGER.usage()
    for purpose in (GLOBAL, MOMENTUM, DOWNLOAD):
        peaks[purpose] = after.peak[purpose] - before.live[purpose]
    return peaks


def test_the_closers_memory_does_not_grow_with_the_number_of_contributors(
    part_bytes: Any,
) -> None:
    part_bytes(128)
    two, eight = _close_with(2), _close_with(8)
    # One accumulator (the new parameters) and one momentum buffer, whatever the count.
    assert two[GLOBAL] == eight[GLOBAL] > 0
    assert two[MOMENTUM] == eight[MOMENTUM] > 0
    # Downloads: a window of parts at a time (the momentum streams into its buffer).
    assert 0 < eight[DOWNLOAD] <= (WINDOW + 1) * 128


def test_a_pool_keeps_one_idle_buffer_whatever_the_number_of_fragments() -> None:
    pool = BufferPool(GLOBAL, idle=1)
    like = [{"w": torch.zeros(1000 + f)} for f in range(4)]
    held = [pool.take(x) for x in like]  # four busy buffers (a learner's references)
    assert pool.idle_bytes() == 0
    for f in range(4):  # each fragment gets a new commit; the old one is released
        new = pool.take(like[f])
        held[f] = new
        assert pool.idle_bytes() <= max(b.nbytes for b in pool._buffers)
    assert pool.reused >= 3  # the buffers released by earlier fragments served later ones
    del held, new
    pool.trim()
    assert len(pool._buffers) == 1


def test_a_long_run_stops_growing_once_warm(tmp_path: Any) -> None:
    """One learner alone (it closes every round itself) on a file mailbox (the store's
    growth is on disk): from round 50 to round 210 the library's tensors held and its
    Python allocations do not grow. Each look comes after ``sync()`` (every fragment's
    commit applied), and each number is the least of three looks a few rounds apart. In a
    process of its own: threads other tests left behind would allocate in the library too."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        seen, growth = pool.apply(_long_run, (str(tmp_path),))
    # Tensors: what the library holds at a look depends on where its threads are (a pool's
    # idle buffer, a commit's buffer released a moment after it was applied): a few buffers
    # of at most a fragment each, seen varying by up to 2.6 models' bytes between looks on
    # a loaded machine. A leak of one fragment's buffer every 10 sync points would add 32.
    model_bytes = 4 * (64 * 64 + 64 + 64 * 8 + 8)
    tensors_then = min(t for t, _ in seen["then"])
    tensors_now = min(t for t, _ in seen["now"])
    assert tensors_now - tensors_then < 4 * model_bytes, (tensors_then, tensors_now)
    then, now = min(x for _, x in seen["then"]), min(x for _, x in seen["now"])
    # A leak of 30 bytes per sync point would add 9 KB over these 320 sync points.
    assert now - then < 8192, (then, now, growth)


def _long_run(directory: str) -> tuple[dict[str, list[tuple[int, int]]], list[str]]:
    algorithm = gm.DiLoCo(sync_every=2, fragments=2, outer_lr=0.7, outer_momentum=0.9)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    looks = {200: "then", 220: "then", 240: "then", 840: "now", 860: "now", 880: "now"}
    seen: dict[str, list[tuple[int, int]]] = {"then": [], "now": []}
    first: tracemalloc.Snapshot | None = None
    growth: list[str] = []
    with gm.Session(
        model,
        algorithm=algorithm,
        mailbox=gm.FileMailbox(directory),
        learner_id="solo",
        poll_interval=0.02,
    ) as session:
        tracemalloc.start()
        try:
            for step in range(1, 881):
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(0.001)
                session.step()
                if step in looks:
                    # A quiet point: every fragment contributed and its commit applied, so
                    # what a loaded machine has in flight at this moment does not count.
                    session.sync()
                    session.events.clear()  # bounded (1000), but filling up is not a leak
                    snapshot = _library_snapshot()
                    total = sum(stat.size for stat in snapshot.statistics("filename"))
                    seen[looks[step]].append((LEDGER.usage().live_total, total))
                    if first is None:
                        first = snapshot
                    elif step == 880:  # what grew most, for the failure message
                        growth = [str(s) for s in snapshot.compare_to(first, "lineno")[:5]]
        finally:
            tracemalloc.stop()
    return seen, growth


def _library_snapshot() -> tracemalloc.Snapshot:
    gc.collect()  # garbage in reference cycles waits for a collection: not held, not a leak
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/gradientmail/*")])


def test_memory_usage_is_public_and_reports_every_purpose() -> None:
    usage = gm.memory_usage()
    assert isinstance(usage, gm.MemoryUsage)
    assert (
        set(usage.live)
        == set(usage.peak)
        == {
            "global",
            "snapshots",
            "momentum",
            "encode",
            "download",
            "combine",
        }
    )


@pytest.mark.parametrize("preset", [None, "4"])
def test_glibc_arenas_are_capped_once_unless_the_user_chose(preset: str | None) -> None:
    """The first call caps the arenas (on glibc) and later ones do nothing; a
    ``MALLOC_ARENA_MAX`` in the environment is the user's choice and stands."""
    code = (
        "import platform\n"
        "from gradientmail.payload._malloc import share_arenas\n"
        "print(platform.libc_ver()[0], share_arenas(), share_arenas())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if preset is not None:
        env["MALLOC_ARENA_MAX"] = preset
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    libc, first, second = out
    assert second == "False"
    assert first == str(preset is None and libc == "glibc")


def test_blobs_that_hash_beside_their_join_encode_side_by_side() -> None:
    """A commit encodes its parameters and momentum at once; each single blob above the
    overlap size is joined on one thread while a payload worker hashes it. The joins must
    not take the workers' places, or the hashing waits forever (it did, with two
    workers)."""
    box = gm.MemoryMailbox()
    size = transfer._OVERLAP_BYTES // 4 + 1024  # float32 elements: a little over 4 MiB
    payloads = [{"w": torch.full((size,), float(i))} for i in range(4)]

    async def encode_all() -> list[tuple[str, int]]:
        return await asyncio.wait_for(
            asyncio.gather(*(put_tensors(box, x) for x in payloads)), timeout=120
        )

    keys = go(encode_all())
    assert len({key for key, _ in keys}) == 4
    assert all(not p.is_parts_key(key) for key, _ in keys)
    for (key, _), tensors in zip(keys, payloads, strict=True):
        assert torch.equal(go(get_tensors(box, key))["w"], tensors["w"])


def test_a_free_found_by_the_garbage_collector_inside_the_ledgers_lock_does_not_deadlock() -> None:
    """A tracked tensor's finalizer can run whenever the collector does, including inside
    the ledger's own locked section on the same thread (seen: the fault suite's verify hung
    for ever in ``Ledger.add``). Its free is queued and applied by the next locked section."""
    import threading

    from gradientmail.ledger import Ledger

    ledger = Ledger()
    tensor = torch.zeros(256)
    ledger.track(GLOBAL, tensor.untyped_storage(), 1024)
    assert ledger.usage().live[GLOBAL] == 1024
    done = threading.Event()

    def free_inside_the_lock() -> None:
        nonlocal tensor
        with ledger._lock:  # what a collection during add() or usage() amounts to
            del tensor  # the storage's last reference: its finalizer runs right here
            gc.collect()
        done.set()

    worker = threading.Thread(target=free_inside_the_lock, daemon=True)
    worker.start()
    assert done.wait(timeout=30), "the finalizer blocked on the ledger's lock"
    assert ledger.usage().live[GLOBAL] == 0
    ledger.add(GLOBAL, 10)
    assert ledger.usage().live[GLOBAL] == 10
