"""Mailbox benchmark: small-op latency and big-object throughput, per backend, against the
raw call on the same store measured in the same run.

References: for S3 servers (SeaweedFS and moto, started fresh for each backend because moto
slows as it ages) the raw boto3 call that does the same thing (``put_object`` with
``IfNoneMatch="*"``, ``get_object``, a paginated ``list_objects_v2``) from a plain
``boto3.client``; for the filesystem, a plain ``open().write()``/``read()`` of the same bytes;
for memory, ``bytes(data)``, a copy.

Raw and mailbox calls alternate within each repetition so drift of the server hits both.
Times are medians. Ratio = mailbox time / reference time (lower is better).

    .venv/bin/python bench/mailbox.py [--backends memory,filesystem,seaweedfs,moto]
                                      [--reps 5] [--small 200] [--sizes 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradientmail as gm
from bench import _harness as h
from testbed import s3servers

NAME = "mailbox"

MIB = 1024 * 1024


@dataclass
class Row:
    backend: str
    op: str
    ref: float  # seconds (median)
    box: float
    nbytes: int = 0  # > 0: report throughput instead of latency
    target: float | None = None


@dataclass
class Target:
    name: str
    box: gm.Mailbox
    raw_put: Callable[[str, bytes], object]
    raw_get: Callable[[str], bytes]
    raw_list: Callable[[str], list[str]]
    is_s3: bool = False


_progress = h.progress


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextmanager
def memory_target() -> Iterator[Target]:
    store: dict[str, bytes] = {}

    def raw_put(key: str, data: bytes) -> None:
        store[key] = bytes(data)

    yield Target(
        "memory",
        gm.MemoryMailbox(),
        raw_put,
        lambda key: store[key],
        lambda prefix: sorted(k for k in store if k.startswith(prefix)),
    )


@contextmanager
def file_target(workdir: Path, fsync: bool) -> Iterator[Target]:
    root = workdir / f"file-{uuid.uuid4().hex[:6]}"
    raw = workdir / f"raw-{uuid.uuid4().hex[:6]}"
    raw.mkdir(parents=True)

    def raw_put(key: str, data: bytes) -> None:
        path = raw / key
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())

    def raw_list(prefix: str) -> list[str]:
        base = raw / prefix.rpartition("/")[0]
        found = [str(p.relative_to(raw)) for p in base.rglob("*") if p.is_file()]
        return sorted(k for k in found if k.startswith(prefix))

    yield Target(
        "filesystem" + ("" if fsync else " (fsync=0)"),
        gm.FileMailbox(root, fsync=fsync),
        raw_put,
        lambda key: (raw / key).read_bytes(),
        raw_list,
    )


@contextmanager
def s3_target(kind: str, workdir: Path) -> Iterator[Target]:
    start = s3servers.seaweedfs if kind == "seaweedfs" else s3servers.moto
    with start(workdir / kind) as server:
        client = server.client()
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        box = server.mailbox(prefix)

        def raw_put(key: str, data: bytes) -> None:
            client.put_object(
                Bucket=server.bucket, Key=f"{prefix}-raw/{key}", Body=data, IfNoneMatch="*"
            )

        def raw_get(key: str) -> bytes:
            body: bytes = client.get_object(Bucket=server.bucket, Key=f"{prefix}-raw/{key}")[
                "Body"
            ].read()
            return body

        def raw_list(sub: str) -> list[str]:
            keys: list[str] = []
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=server.bucket, Prefix=f"{prefix}-raw/{sub}"
            )
            for page in pages:
                keys.extend(item["Key"] for item in page.get("Contents", ()))
            return keys

        yield Target(kind, box, raw_put, raw_get, raw_list, is_s3=True)


def bench_target(target: Target, args: argparse.Namespace) -> list[Row]:
    box = target.box
    # The targets are the S3 backend's (raw boto3 as reference); elsewhere just the ratio.
    small_target = 1.3 if target.is_s3 else None
    big_target = 1.1 if target.is_s3 else None
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    rows: list[Row] = []
    small = os.urandom(1024)
    run_id = uuid.uuid4().hex[:6]
    try:
        # -- small ops --------------------------------------------------------------------
        _progress(f"{target.name}: {args.small} x put/get 1 KiB")
        put_ref, put_box, get_ref, get_box = [], [], [], []
        for i in range(args.small):
            key = f"small-{run_id}/{i:05d}"
            put_ref.append(_time(lambda k=key: target.raw_put(k, small)))
            put_box.append(_time(lambda k=key: run(box.put_if_absent(k, small))))
        for i in range(args.small):
            key = f"small-{run_id}/{i:05d}"
            get_ref.append(_time(lambda k=key: target.raw_get(k)))
            get_box.append(_time(lambda k=key: run(box.get(k))))
        rows.append(
            Row(
                target.name,
                "put_if_absent 1 KiB",
                h.median(put_ref),
                h.median(put_box),
                target=small_target,
            )
        )
        rows.append(
            Row(target.name, "get 1 KiB", h.median(get_ref), h.median(get_box), target=small_target)
        )

        _progress(f"{target.name}: filling 1,000 keys for list")
        listed = f"list-{run_id}/"

        async def fill() -> None:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    await box.put_if_absent(f"{listed}{i:05d}", b"x")
                    await asyncio.to_thread(target.raw_put, f"{listed}{i:05d}", b"x")

            await asyncio.gather(*(one(i) for i in range(1000)))

        run(fill())
        list_ref, list_box = [], []
        for _ in range(args.reps * 2):
            list_ref.append(_time(lambda: target.raw_list(listed)))
            list_box.append(_time(lambda: run(box.list(listed))))
        assert len(run(box.list(listed))) == 1000 == len(target.raw_list(listed))
        rows.append(
            Row(
                target.name,
                "list 1,000 keys",
                h.median(list_ref),
                h.median(list_box),
                target=small_target,
            )
        )

        # -- big objects ------------------------------------------------------------------
        for mib in args.sizes:
            data = os.urandom(mib * MIB)
            _progress(f"{target.name}: {args.reps} x put/get {mib} MiB")
            pr, pb, gr, gb = [], [], [], []
            for rep in range(args.reps):
                key = f"big-{run_id}/{mib}/{rep}"
                # Alternate who goes first, so neither side always meets a warmer server.
                for side in (0, 1) if rep % 2 == 0 else (1, 0):
                    if side == 0:
                        pr.append(_time(lambda k=key, d=data: target.raw_put(k, d)))
                        gr.append(_time(lambda k=key: target.raw_get(k)))
                    else:
                        pb.append(_time(lambda k=key, d=data: run(box.put_if_absent(k, d))))
                        gb.append(_time(lambda k=key: run(box.get(k))))
            assert run(box.get(f"big-{run_id}/{mib}/0")) == data
            rows.append(
                Row(
                    target.name,
                    f"put {mib} MiB",
                    h.median(pr),
                    h.median(pb),
                    len(data),
                    target=big_target,
                )
            )
            rows.append(
                Row(
                    target.name,
                    f"get {mib} MiB",
                    h.median(gr),
                    h.median(gb),
                    len(data),
                    target=big_target,
                )
            )
    finally:
        loop.close()
    return rows


def _fmt(seconds: float, nbytes: int) -> str:
    if nbytes:
        return f"{nbytes / seconds / MIB:9.0f} MiB/s"
    if seconds < 1e-3:
        return f"{seconds * 1e6:9.1f} us   "
    return f"{seconds * 1e3:9.2f} ms   "


def print_table(rows: list[Row]) -> None:
    header = (
        f"| {'backend':<20} | {'operation':<20} | {'reference':>15} | {'mailbox':>15} "
        "| ratio | target |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|")
    for row in rows:
        ratio = row.box / row.ref
        target = "" if row.target is None else f"<= {row.target:.1f}"
        ok = "" if row.target is None else (" ok" if ratio <= row.target else " MISS")
        print(
            f"| {row.backend:<20} | {row.op:<20} | {_fmt(row.ref, row.nbytes):>15} | "
            f"{_fmt(row.box, row.nbytes):>15} | {ratio:5.2f} | {target + ok:<6} |"
        )


def run(ctx: h.Context) -> h.Report:
    """The suite's entry: every backend, the preset's sizes."""
    args = argparse.Namespace(
        reps=ctx.pick(8, 3), small=ctx.pick(200, 50), sizes=ctx.pick([1, 16, 64], [1, 16])
    )
    report = h.Report(
        NAME,
        "Mailbox backends: small-op latency and big-object throughput",
        "the raw call on the same store (boto3 for S3 servers, open/read/write for files, "
        "a bytes copy for memory), alternating with the mailbox's call, in this run",
    )
    rows: list[Row] = []
    workdir = ctx.workdir / "mailbox"
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("memory", "filesystem", "seaweedfs", "moto"):
        opener: Any
        if name == "memory":
            opener = memory_target()
        elif name == "filesystem":
            opener = file_target(workdir, fsync=True)
        else:
            opener = s3_target(name, workdir)
        with opener as target:
            rows.extend(bench_target(target, args))
    table = report.table(
        f"Median over {args.reps} big / {args.small} small operations",
        ["backend", "operation", "reference", "mailbox", "ratio", "target"],
    )
    for row in rows:
        r = row.box / row.ref
        goal = "" if row.target is None else f"<= {row.target:.1f}"
        table.add(
            row.backend,
            row.op,
            _fmt(row.ref, row.nbytes).strip(),
            _fmt(row.box, row.nbytes).strip(),
            f"{r:.2f}",
            goal,
        )
    for target in sorted({row.target for row in rows if row.target is not None}):
        mine = [row for row in rows if row.target == target]
        worst = max(mine, key=lambda row: row.box / row.ref)
        report.target(
            "S3 small operations vs raw boto3"
            if target > 1.2
            else "S3 big-object puts and gets vs raw boto3",
            f"worst {worst.box / worst.ref:.2f}x ({worst.backend} {worst.op})",
            f"<= {target:.1f}x",
            worst.box / worst.ref <= target,
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
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = set(names) - {"memory", "filesystem", "filesystem-nofsync", "seaweedfs", "moto"}
    if unknown:
        parser.error(f"unknown backends: {sorted(unknown)}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gm-bench-") as tmp:
        workdir = Path(tmp)
        for name in names:
            opener: Any
            if name == "memory":
                opener = memory_target()
            elif name.startswith("filesystem"):
                opener = file_target(workdir, fsync=name == "filesystem")
            else:
                opener = s3_target(name, workdir)
            with opener as target:
                rows.extend(bench_target(target, args))
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
