"""Benchmark 1 — the payload pipeline: tensors -> bytes -> sha256 -> store, and back into the
model's existing memory, on the filesystem mailbox.

Measured, for a model of ``--params`` float32 parameters (default 100M = 400 MB; ``--quick``
25M), median and min–max over repetitions, as GB/s of payload bytes:

- the library as a Session uses it: ``payload.put_tensors`` (a payload above ``PART_BYTES``
  goes in parts, joined and hashed on worker threads, stored 4 at a time), then
  ``payload.get_tensors`` (parts fetched 4 at a time, verified on worker threads, zero-copy
  views) and the copy into the receiving model's parameters (``ModelLayout.load``); end to
  end = send + receive, timed as one sequence; with fsync on (the default) and off;
- the same library with the payload as one blob (what every payload up to ``PART_BYTES``
  takes), stage by stage: ``payload.encode`` (one copy, sha256 overlapped on a helper
  thread), ``FileMailbox.put_if_absent`` (staging file, fsync, hard link),
  ``FileMailbox.get``, ``payload.decode`` (sha256 verification, views), the copy into the
  model;
- references measured in the same run on the same bytes: memcpy into existing memory
  (``Tensor.copy_``, the ratio column's denominator), a copy into fresh memory
  (``clone``), sha256 on one thread and split over two, a raw file write + fsync, a read
  into fresh memory and into a reused buffer, and ``safetensors.torch.save``/``load``;
- a prototype (bench code, not the library): one blob encoded into a reused buffer and
  written while a helper thread hashes; read into a reused buffer while a helper hashes,
  then copied into the model: what reusing buffers would add.

Target: >= 1 GB/s end to end on the filesystem mailbox, with receive buffers reused and
hashing parallelised.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import struct
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import gradientmail as gm
from bench import _harness as h
from bench._workload import build_model
from gradientmail.engine.layout import ModelLayout
from gradientmail.payload import transfer as payload

NAME = "payload"
CHUNK = 16 * h.MIB


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _as_bytes(t: torch.Tensor) -> memoryview:
    return t.contiguous().view(-1).view(torch.uint8).numpy().data.cast("B")


# -- the prototype (proposed) pipeline -------------------------------------------------------


class _Hasher:
    """One sha256 over chunks handed to it in order, on a helper thread, while the caller
    does I/O."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.digest = hashlib.sha256()
        self.last: Future[None] | None = None

    def feed(self, chunk: memoryview) -> None:
        previous = self.last

        def update(c: memoryview = chunk, before: Future[None] | None = previous) -> None:
            if before is not None:
                before.result()
            self.digest.update(c)

        self.last = self.pool.submit(update)

    def hexdigest(self) -> str:
        if self.last is not None:
            self.last.result()
        return self.digest.hexdigest()


class Prototype:
    """Send and receive with reused buffers and hashing overlapped with the I/O."""

    def __init__(self, tensors: dict[str, torch.Tensor], root: Path) -> None:
        self.root = root
        (root / "staging").mkdir(parents=True, exist_ok=True)
        (root / "objects").mkdir(parents=True, exist_ok=True)
        self.pool = ThreadPoolExecutor(max_workers=1)
        header: dict[str, object] = {}
        offset = 0
        for name in sorted(tensors):
            n = tensors[name].numel() * tensors[name].element_size()
            header[name] = {
                "dtype": "F32",
                "shape": list(tensors[name].shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.start = 8 + len(text)
        self.size = self.start + offset
        self.header = header
        self.send_buf = bytearray(self.size)  # reused across sends
        self.recv_buf = bytearray(self.size)  # reused across receives
        self.send_buf[: self.start] = struct.pack("<Q", len(text)) + text

    def send(self, tensors: dict[str, torch.Tensor]) -> str:
        hasher = _Hasher(self.pool)
        view = memoryview(self.send_buf)
        staged = self.root / "staging" / uuid.uuid4().hex
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            target = torch.frombuffer(self.send_buf, dtype=torch.uint8)
            for name in sorted(tensors):
                begin, end = self.header[name]["data_offsets"]  # type: ignore[index]
                target[self.start + begin : self.start + end].copy_(
                    tensors[name].detach().reshape(-1).view(torch.uint8)
                )
            for pos in range(0, self.size, CHUNK):
                chunk = view[pos : pos + CHUNK]
                hasher.feed(chunk)
                while chunk:
                    chunk = chunk[os.write(fd, chunk) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        key = f"blobs/{hasher.hexdigest()}"
        path = self.root / "objects" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        os.link(staged, path)
        staged.unlink()
        return key

    def receive(self, key: str, into: dict[str, torch.Tensor]) -> None:
        hasher = _Hasher(self.pool)
        view = memoryview(self.recv_buf)
        with open(self.root / "objects" / key, "rb", buffering=0) as f:
            pos = 0
            while pos < self.size:
                n = f.readinto(view[pos : pos + CHUNK])
                if not n:
                    raise OSError("short read")
                hasher.feed(view[pos : pos + n])
                pos += n
        if f"blobs/{hasher.hexdigest()}" != key:
            raise ValueError("hash mismatch")
        source = torch.frombuffer(self.recv_buf, dtype=torch.uint8)
        with torch.no_grad():
            for name, param in into.items():
                begin, end = self.header[name]["data_offsets"]  # type: ignore[index]
                param.view(-1).view(torch.uint8).copy_(
                    source[self.start + begin : self.start + end]
                )

    def close(self) -> None:
        self.pool.shutdown()


# -- the benchmark ---------------------------------------------------------------------------


def run(ctx: h.Context) -> h.Report:
    opts = ctx.options.get(NAME, {})
    params = opts.get("params") or ctx.pick(100_000_000, 25_000_000, 250_000_000)
    reps = opts.get("reps") or ctx.pick(5, 3)
    report = h.Report(
        NAME,
        "1. Payload pipeline: tensors -> bytes -> sha256 -> filesystem mailbox -> model memory",
        "memcpy of the same bytes into existing memory (Tensor.copy_), measured in this run",
    )
    sender = build_model(params, seed=0)
    receiver = build_model(params, seed=1)
    tensors = _tensors(sender)
    into = _tensors(receiver)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    layout = ModelLayout(receiver, gm.DiLoCo(sync_every=1))
    specs = layout.specs[0]
    h.progress(f"payload: {nbytes / h.MIB:.0f} MiB in {len(tensors)} tensors, {reps} reps")

    rows: list[tuple[str, str, h.Stats]] = []  # (group, name, seconds)

    def add(group: str, name: str, stats: h.Stats) -> h.Stats:
        rows.append((group, name, stats))
        return stats

    # References.
    def memcpy() -> None:
        for name, t in tensors.items():
            into[name].copy_(t)

    with torch.no_grad():
        ref = add("reference", "memcpy into existing memory (copy_)", h.measure(memcpy, reps))
        add(
            "reference",
            "copy into fresh memory (clone)",
            h.measure(lambda: [t.clone() for t in tensors.values()], reps),
        )
    flat = [_as_bytes(t) for t in tensors.values()]

    def sha1() -> None:
        d = hashlib.sha256()
        for v in flat:
            d.update(v)

    add("reference", "sha256, one thread", h.measure(sha1, reps))
    pool = ThreadPoolExecutor(max_workers=2)

    def sha2() -> None:  # two halves of the stream on two threads (not one digest)
        joined = [v[i : i + CHUNK] for v in flat for i in range(0, len(v), CHUNK)]
        half = len(joined) // 2

        def run_part(part: list[memoryview]) -> bytes:
            d = hashlib.sha256()
            for v in part:
                d.update(v)
            return d.digest()

        a = pool.submit(run_part, joined[:half])
        b = pool.submit(run_part, joined[half:])
        a.result(), b.result()

    add("reference", "sha256, split over two threads", h.measure(sha2, reps))
    raw_dir = ctx.workdir / "payload-raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    raw_path = raw_dir / "blob"
    blob = b"".join(flat)

    def raw_write() -> None:
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    add(
        "reference",
        "file write + fsync (a new file)",
        h.measure(raw_write, reps, setup=lambda: raw_path.unlink(missing_ok=True)),
    )
    add("reference", "file read into fresh memory", h.measure(raw_path.read_bytes, reps))
    reused = bytearray(len(blob))

    def raw_readinto() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            f.readinto(reused)

    add("reference", "file read into a reused buffer", h.measure(raw_readinto, reps))
    raw_path.unlink()
    try:
        import safetensors.torch as st

        st_data = st.save(tensors)
        add(
            "reference",
            "safetensors.torch.save (to bytes)",
            h.measure(lambda: st.save(tensors), reps),
        )
        add(
            "reference",
            "safetensors.torch.load (from bytes)",
            h.measure(lambda: st.load(st_data), reps),
        )
    except ImportError:
        report.notes.append("safetensors is not installed: its reference rows are missing")

    # The library: as a Session sends and receives (put_tensors / get_tensors + load), with
    # payloads in parts (the default), then with the whole payload as one blob, stage by stage.
    loop = asyncio.new_event_loop()
    stage_times: dict[str, dict[str, list[float]]] = {}
    parts = -(-nbytes // payload.PART_BYTES)
    try:
        for fsync in (True, False):
            label = "fsync on (default)" if fsync else "fsync=0"
            box = gm.FileMailbox(ctx.workdir / f"payload-parts-{int(fsync)}", fsync=fsync)
            times: dict[str, list[float]] = {k: [] for k in ("send", "receive", "e2e")}
            h.progress(f"payload: library, {parts} parts, {label}")
            for i in range(reps + 1):
                t0 = _now()
                key, _ = loop.run_until_complete(payload.put_tensors(box, tensors))
                t1 = _now()
                loop.run_until_complete(payload.get_tensors(box, key, specs, into=into))
                t2 = _now()
                loop.run_until_complete(box.delete(sorted(_all_keys(loop, box))))
                if i == 0:
                    continue  # warm-up
                for name, took in (("send", t1 - t0), ("receive", t2 - t1), ("e2e", t2 - t0)):
                    times[name].append(took)
            assert all(torch.equal(into[n], t) for n, t in tensors.items()), "wrong bytes"
            stage_times[f"parts, {label}"] = times
            group = f"library, {parts} parts of {payload.PART_BYTES // h.MIB} MiB, {label}"
            if fsync:
                add(
                    group,
                    "send = put_tensors (parts encoded on workers)",
                    h.Stats.of(times["send"]),
                )
                add(
                    group,
                    "receive = get_tensors(into=the model's tensors)",
                    h.Stats.of(times["receive"]),
                )
            add(group, "END TO END (send + receive)", h.Stats.of(times["e2e"]))

        box = gm.FileMailbox(ctx.workdir / "payload-blob")
        times = {
            k: [] for k in ("encode", "put", "get", "decode", "load", "send", "receive", "e2e")
        }
        h.progress("payload: library, one blob, fsync on")
        for i in range(reps + 1):
            t0 = _now()
            key, data = payload.encode(tensors)
            t1 = _now()
            loop.run_until_complete(box.put_if_absent(key, data))
            t2 = _now()
            del data
            got = loop.run_until_complete(box.get(key))
            t3 = _now()
            assert got is not None
            decoded = payload.decode(key, got, specs)
            t4 = _now()
            layout.load(0, decoded)
            t5 = _now()
            del decoded, got
            loop.run_until_complete(box.delete([key]))
            if i == 0:
                continue  # warm-up
            for name, took in (
                ("encode", t1 - t0),
                ("put", t2 - t1),
                ("get", t3 - t2),
                ("decode", t4 - t3),
                ("load", t5 - t4),
                ("send", t2 - t0),
                ("receive", t5 - t2),
                ("e2e", t5 - t0),
            ):
                times[name].append(took)
        stage_times["one blob"] = times
        group = f"library, one blob (as up to {payload.PART_BYTES // h.MIB} MiB), fsync on"
        add(group, "payload.encode (copy + overlapped sha256)", h.Stats.of(times["encode"]))
        add(group, "FileMailbox.put_if_absent", h.Stats.of(times["put"]))
        add(group, "FileMailbox.get", h.Stats.of(times["get"]))
        add(group, "payload.decode (sha256 verify, views)", h.Stats.of(times["decode"]))
        add(group, "copy into the model (ModelLayout.load)", h.Stats.of(times["load"]))
        add(group, "END TO END (send + receive)", h.Stats.of(times["e2e"]))
    finally:
        loop.close()

    # The prototype: one blob, written from and read into reused buffers with the hashing
    # overlapped with the I/O (what reusing buffers would add; bench code, not the library).
    proto = Prototype(tensors, ctx.workdir / "payload-proto")
    label = "prototype: one blob, reused buffers"
    h.progress(f"payload: {label}")
    send_t: list[float] = []
    recv_t: list[float] = []
    e2e_t: list[float] = []
    try:
        for i in range(reps + 1):
            t0 = _now()
            key = proto.send(tensors)
            t1 = _now()
            proto.receive(key, into)
            t2 = _now()
            if i:
                send_t.append(t1 - t0)
                recv_t.append(t2 - t1)
                e2e_t.append(t2 - t0)
        assert key == payload.encode(tensors)[0], "the prototype must write the same blob"
    finally:
        proto.close()
    add(label, "send: reused buffer, write while hashing", h.Stats.of(send_t))
    add(label, "receive: read into reused buffer while hashing, copy", h.Stats.of(recv_t))
    proto_e2e = add(label, "END TO END (send + receive)", h.Stats.of(e2e_t))
    pool.shutdown()

    table = report.table(
        f"Payload of {nbytes / 1e6:.0f} MB ({params / 1e6:.0f}M float32 parameters, "
        f"{len(tensors)} tensors); {reps} repetitions",
        ["group", "stage", "time, median (min–max)", "throughput", "vs memcpy"],
        note=(
            "Throughput = payload bytes / time (min–max from the max–min times). "
            "`vs memcpy`: the stage's throughput as a fraction of memcpy's, measured above. "
            f"The library stores a payload above {payload.PART_BYTES // h.MIB} MiB in parts, "
            "hashed on worker "
            "threads and moved 4 at a time; `one blob` is the same library with the payload "
            f"whole (what any payload up to {payload.PART_BYTES // h.MIB} MiB takes). The "
            "prototype rows are bench code: "
            "one blob from and into reused buffers, hashing overlapped with the I/O (it "
            "writes the very blob payload.encode writes)."
        ),
    )
    ref_rate = ref.rate(nbytes).median
    for group, name, st in rows:
        rate = st.rate(nbytes)
        table.add(group, name, h.secs_range(st), h.gbps(rate), h.pct(rate.median, ref_rate))

    sha_rate = next(st for g, n, st in rows if n == "sha256, one thread").rate(nbytes).median
    e2e = h.Stats.of(stage_times["parts, fsync on (default)"]["e2e"]).rate(nbytes)
    e2e0 = h.Stats.of(stage_times["parts, fsync=0"]["e2e"]).rate(nbytes)
    blob_rate = h.Stats.of(stage_times["one blob"]["e2e"]).rate(nbytes)
    best = proto_e2e.rate(nbytes)
    report.target(
        "end-to-end payload throughput, filesystem mailbox (fsync on)",
        f"{e2e.median / h.GB:.2f} GB/s ({e2e0.median / h.GB:.2f} GB/s with fsync=0; "
        f"{blob_rate.median / h.GB:.2f} GB/s as one blob)",
        ">= 1 GB/s",
        e2e.median >= h.GB,
        (
            "Per byte, the pipeline must copy it in (encode), hash it, write and fsync it, "
            "read it, hash it again and copy it into the model: about "
            f"{2 / sha_rate * h.GB + 4 / ref_rate * h.GB:.2f} s of CPU per GB for the "
            "hashing and copies alone (two sha256 passes at "
            f"{sha_rate / h.GB:.2f} GB/s, four copies at memcpy speed), before the file "
            "write + fsync and the page faults of fresh buffers (see the reference rows: a "
            "copy into fresh memory runs at a fraction of memcpy). Parts spread the hashing "
            "over both cores; the rest is bounded by 2 cores. Reusing buffers (the "
            f"prototype rows, one blob) reaches {best.median / h.GB:.2f} GB/s; see the "
            "profile (python -m bench.profile payload) for the split"
        ),
    )
    report.data = {
        "params": params,
        "bytes": nbytes,
        "reps": reps,
        "stages": {
            f"{g} | {n}": {"median_s": s.median, "min_s": s.min, "max_s": s.max} for g, n, s in rows
        },
        "e2e_gbps": e2e.median / h.GB,
        "e2e_fsync0_gbps": e2e0.median / h.GB,
        "one_blob_e2e_gbps": blob_rate.median / h.GB,
        "prototype_e2e_gbps": best.median / h.GB,
        "parts": parts,
        "memcpy_gbps": ref_rate / h.GB,
    }
    return report


def _all_keys(loop: asyncio.AbstractEventLoop, box: gm.Mailbox) -> list[str]:
    return list(loop.run_until_complete(box.list("")))


def _now() -> float:
    return time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default=None, help="e.g. 100M")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from bench.__main__ import run_suite

    options = {NAME: {"params": h.count(args.params) if args.params else None, "reps": args.reps}}
    return run_suite([NAME], quick=args.quick, options=options)


if __name__ == "__main__":
    sys.exit(main())
