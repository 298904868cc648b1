"""Mailbox benchmark: small-op latency and big-object throughput, per backend, against the
raw call on the same store measured in the same run.

References: for S3 servers (SeaweedFS and moto, started fresh for each backend because moto
slows as it ages) the raw boto3 call that does the same thing (``put_object`` with
``IfNoneMatch="*"``, ``get_object``, a paginated ``list_objects_v2``); for the filesystem, a
plain ``open().write()``/``read()`` of the same bytes; for memory, ``bytes(data)``, a copy.
Raw and mailbox calls alternate within each repetition so drift of the server hits both.
Times are medians. Ratio = mailbox time / reference time (lower is better).

:func:`target` is every benchmark's store: a fresh mailbox per run and the raw calls on the
same store that its calls are measured against (also ``rounds`` and ``scale``).

    .venv/bin/python bench/mailbox.py [--backends memory,filesystem,seaweedfs,moto]
                                      [--reps 5] [--small 200] [--sizes 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradientmail as gm
from bench import _harness as h
from testbed import s3servers

NAME = "mailbox"
KINDS = ("memory", "filesystem", "filesystem-nofsync", "seaweedfs", "moto")


@dataclass
class Target:
    """A store: ``fresh()`` gives a new empty mailbox on it and its cleanup; the raw calls
    do the same thing without the library."""

    name: str
    fresh: Callable[[], tuple[gm.Mailbox, Callable[[], None]]]
    raw_put: Callable[[str, bytes], object]
    raw_get: Callable[[str], bytes]
    raw_list: Callable[[str], list[str]]
    raw_delete: Callable[[str], object]
    is_s3: bool = False

    def raw_put_get(self, data: bytes) -> float:
        """Seconds for a raw put + get of ``data`` (removed afterwards, untimed)."""
        key = f"raw-{uuid.uuid4().hex}"
        start = time.perf_counter()
        self.raw_put(key, data)
        body = self.raw_get(key)
        took = time.perf_counter() - start
        assert len(body) == len(data)
        self.raw_delete(key)
        return took


def _nothing() -> None:
    pass


@contextmanager
def target(kind: str, workdir: Path, prefix: str = "bench") -> Iterator[Target]:
    """The store ``kind`` (one of ``KINDS``); an S3 server is started for it and stopped
    afterwards."""
    tag = uuid.uuid4().hex[:6]
    if kind == "memory":
        store: dict[str, bytes] = {}
        yield Target(
            kind,
            lambda: (gm.MemoryMailbox(f"{prefix}-{uuid.uuid4().hex[:8]}"), _nothing),
            lambda key, data: store.__setitem__(key, bytes(data)),
            store.__getitem__,
            lambda sub: sorted(k for k in store if k.startswith(sub)),
            store.pop,
        )
    elif kind.startswith("filesystem"):
        fsync = kind == "filesystem"  # FileMailbox's default is fsync=True: so the raw write
        raw = workdir / f"raw-{tag}"
        raw.mkdir(parents=True)

        def fresh() -> tuple[gm.Mailbox, Callable[[], None]]:
            root = workdir / f"file-{uuid.uuid4().hex[:6]}"
            return gm.FileMailbox(root, fsync=fsync), lambda: shutil.rmtree(root, True)

        def raw_put(key: str, data: bytes) -> None:
            path = raw / key
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(data)
                if fsync:
                    handle.flush()
                    os.fsync(handle.fileno())

        def raw_list(sub: str) -> list[str]:
            found = [str(p.relative_to(raw)) for p in (raw / sub.rpartition("/")[0]).rglob("*")]
            return sorted(k for k in found if k.startswith(sub) and (raw / k).is_file())

        yield Target(
            "filesystem" + ("" if fsync else " (fsync=0)"),
            fresh,
            raw_put,
            lambda key: (raw / key).read_bytes(),
            raw_list,
            lambda key: (raw / key).unlink(),
        )
    else:
        start = s3servers.seaweedfs if kind == "seaweedfs" else s3servers.moto
        h.progress(f"starting {kind}")
        with start(workdir / f"{kind}-{tag}") as server:
            client, bucket, base = server.client(), server.bucket, f"{prefix}-{tag}-raw/"

            def raw_get(key: str) -> bytes:
                body: bytes = client.get_object(Bucket=bucket, Key=base + key)["Body"].read()
                return body

            def raw_list(sub: str) -> list[str]:
                pages = client.get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=base + sub
                )
                return [item["Key"] for page in pages for item in page.get("Contents", ())]

            yield Target(
                kind,
                lambda: (server.mailbox(f"{prefix}-{uuid.uuid4().hex[:8]}"), _nothing),
                lambda key, data: client.put_object(
                    Bucket=bucket, Key=base + key, Body=data, IfNoneMatch="*"
                ),
                raw_get,
                raw_list,
                lambda key: client.delete_object(Bucket=bucket, Key=base + key),
                is_s3=True,
            )


# -- the benchmark ---------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    op: str
    ref: float  # seconds (median)
    box: float
    nbytes: int = 0  # > 0: report throughput instead of latency
    target: float | None = None


def _time(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench_target(target: Target, args: argparse.Namespace) -> list[Row]:
    box, cleanup = target.fresh()
    # The targets are the S3 backend's (raw boto3 as reference); elsewhere just the ratio.
    small_goal, big_goal = (1.3, 1.1) if target.is_s3 else (None, None)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    rows: list[Row] = []
    small = os.urandom(1024)
    tag = uuid.uuid4().hex[:6]

    def box_put(key: str, data: bytes) -> bool:
        return run(box.put_if_absent(key, data))

    def box_get(key: str) -> bytes | None:
        return run(box.get(key))

    def box_list(sub: str) -> list[str]:
        return list(run(box.list(sub)))

    def add(op: str, ref: list[float], mine: list[float], nbytes: int, goal: float | None) -> None:
        rows.append(Row(target.name, op, h.median(ref), h.median(mine), nbytes, goal))

    try:
        h.progress(f"{target.name}: {args.small} x put/get 1 KiB")
        keys = [f"small-{tag}/{i:05d}" for i in range(args.small)]
        puts = [(_time(target.raw_put, k, small), _time(box_put, k, small)) for k in keys]
        gets = [(_time(target.raw_get, k), _time(box_get, k)) for k in keys]
        add("put_if_absent 1 KiB", [a for a, _ in puts], [b for _, b in puts], 0, small_goal)
        add("get 1 KiB", [a for a, _ in gets], [b for _, b in gets], 0, small_goal)

        h.progress(f"{target.name}: filling 1,000 keys for list")
        listed = f"list-{tag}/"

        async def fill() -> None:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    await box.put_if_absent(f"{listed}{i:05d}", b"x")
                    await asyncio.to_thread(target.raw_put, f"{listed}{i:05d}", b"x")

            await asyncio.gather(*(one(i) for i in range(1000)))

        run(fill())
        lists = [
            (_time(target.raw_list, listed), _time(box_list, listed)) for _ in range(args.reps * 2)
        ]
        assert len(run(box.list(listed))) == 1000 == len(target.raw_list(listed))
        add("list 1,000 keys", [a for a, _ in lists], [b for _, b in lists], 0, small_goal)

        for mib in args.sizes:
            data = os.urandom(mib * h.MIB)
            h.progress(f"{target.name}: {args.reps} x put/get {mib} MiB")
            pr, pb, gr, gb = [], [], [], []
            for rep in range(args.reps):
                key = f"big-{tag}/{mib}/{rep}"
                # Alternate who goes first, so neither side always meets a warmer server.
                for side in (0, 1) if rep % 2 == 0 else (1, 0):
                    if side == 0:
                        pr.append(_time(target.raw_put, key, data))
                        gr.append(_time(target.raw_get, key))
                    else:
                        pb.append(_time(box_put, key, data))
                        gb.append(_time(box_get, key))
            assert run(box.get(f"big-{tag}/{mib}/0")) == data
            add(f"put {mib} MiB", pr, pb, len(data), big_goal)
            add(f"get {mib} MiB", gr, gb, len(data), big_goal)
    finally:
        loop.close()
        cleanup()
    return rows


def _fmt(seconds: float, nbytes: int) -> str:
    return f"{nbytes / seconds / h.MIB:.0f} MiB/s" if nbytes else h.secs(seconds)


def run(ctx: h.Context) -> h.Report:
    """Every backend (``ctx.options["mailbox"]``: backends, reps, small, sizes)."""
    args = argparse.Namespace(
        backends=["memory", "filesystem", "seaweedfs", "moto"],
        reps=ctx.pick(8, 3),
        small=ctx.pick(200, 50),
        sizes=ctx.pick([1, 16, 64], [1, 16]),
    )
    vars(args).update({k: v for k, v in ctx.options.get(NAME, {}).items() if v is not None})
    report = h.Report(
        NAME,
        "Mailbox backends: small-op latency and big-object throughput",
        "the raw call on the same store (boto3 for S3 servers, open/read/write for files, "
        "a bytes copy for memory), alternating with the mailbox's call, in this run",
    )
    rows: list[Row] = []
    workdir = ctx.workdir / "mailbox"
    workdir.mkdir(parents=True, exist_ok=True)
    for kind in args.backends:
        with target(kind, workdir) as store:
            rows.extend(bench_target(store, args))
    table = report.table(
        f"Median over {args.reps} big / {args.small} small operations",
        ["backend", "operation", "reference", "mailbox", "ratio", "target"],
    )
    for row in rows:
        goal = "" if row.target is None else f"<= {row.target:.1f}"
        ref, box = _fmt(row.ref, row.nbytes), _fmt(row.box, row.nbytes)
        table.add(row.backend, row.op, ref, box, f"{row.box / row.ref:.2f}", goal)
    for limit in sorted({row.target for row in rows if row.target is not None}):
        worst = max((r for r in rows if r.target == limit), key=lambda r: r.box / r.ref)
        report.target(
            "S3 small operations vs raw boto3"
            if limit > 1.2
            else "S3 big-object puts and gets vs raw boto3",
            f"worst {worst.box / worst.ref:.2f}x ({worst.backend} {worst.op})",
            f"<= {limit:.1f}x",
            worst.box / worst.ref <= limit,
        )
    report.data = {"rows": [row.__dict__ for row in rows]}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="memory,filesystem,seaweedfs,moto")
    parser.add_argument("--reps", type=int, default=8, help="repetitions per big object")
    parser.add_argument("--small", type=int, default=200, help="small puts/gets per backend")
    parser.add_argument("--sizes", default="1,16,64", help="big object sizes in MiB")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.backends = [n.strip() for n in args.backends.split(",") if n.strip()]
    if set(args.backends) - set(KINDS):
        parser.error(f"unknown backends: {sorted(set(args.backends) - set(KINDS))}")
    from bench.__main__ import run_suite

    return run_suite([NAME], options={NAME: vars(args)}, json_path=None)


if __name__ == "__main__":
    sys.exit(main())
