"""Benchmark 3 — round cost per learner: bytes, requests and commit latency per committed
round, against the byte lower bound and the raw transfer of the same bytes on the same store,
measured in the same run.

Several learners (threads of this process, each with its own model copy and its own
``gm.Session``) train a model of ``--params`` float32 parameters with a cheap fake step (a
little noise added to every tensor, then a short sleep standing in for accelerator time), so
the run is communication-bound. One mailbox per configuration: SeaweedFS (started fresh by
this benchmark, one prefix per configuration) or ``gm.FileMailbox`` in a temporary
directory. After ``--warmup`` training rounds, ``--rounds`` committed rounds are measured
(twice as many with P > 1 fragments: a round of P fragments carries 1/P of the model).

Measured, per learner and committed round (window deltas of ``session.counters()``):

1. bytes up + down, against the lower bound of one fragment up and one fragment down
   (fragment bytes = parameter bytes / fragments);
2. requests;
3. commit latency: ``Applied.lag_s`` (from this learner's ``Published`` to its ``Applied``),
   median, against a raw put + get of one fragment's bytes on the same store (a plain
   ``boto3`` ``put_object`` + ``get_object`` on SeaweedFS; a file write + fsync + read for the
   filesystem), measured in the same run;
4. time inside ``session.step()`` on the training thread, for calls that snapshot a
   fragment, calls that apply a commit, and plain calls, against a bare training step
   (forward + backward + SGD) of a 1M-parameter MLP at batch 32 on the CPU.

A recording wrapper under each session's mailbox (``_recorder.py``) attributes every byte
to what it carried (snapshot / params / momentum payloads, JSON records) and every round's
latency to its phases (waiting for the other learners, close detection, closer work,
syncer).

Targets: <= 1.2x the byte lower bound, <= 2x the raw transfer time.

The learners, mailboxes and analysis are in ``_fleet.py`` (shared with benchmark 7, ``scale``);
this module builds the report.

With ``--compression`` (or ``--compression-table``: every setting of ``DEFAULT_SETTINGS``)
it measures instead, in one run, the bytes per learner per committed round of dense float32
DiLoCo (the reference) and of DiLoCo with a compressor (``gm.TopK``, ``gm.Cast``,
``gm.Quantize``) and SparseLoCo, on the same store, model and learners (default: the
filesystem, 3 learners, 3M params, 1 fragment): up, down, the closer's dense commit upload
split out, the ratio of the reference to each, a contribution's bytes per element (measured
and the compressor's ``encoded_bytes``), and the compressor's ``encode`` and ``add_decoded``
time on a tensor of the fragment's size against a bare training step measured interleaved.
No targets.

    .venv/bin/python -m bench rounds [--quick | --large]
    .venv/bin/python bench/rounds.py [--backends seaweedfs,filesystem] [--learners 2,4]
        [--fragments 1,4] [--params 10M] [--rounds 8] [--warmup 2] [--sync-every 8]
        [--poll-interval 0.5] [--step-ms 5] [--max-seconds 60]
    .venv/bin/python bench/rounds.py --compression-table [--backends filesystem,seaweedfs]
    .venv/bin/python bench/rounds.py --compression dense,topk:0.01:2,sparseloco [--params 3M]
        [--learners 3] [--rounds 12] [--codec-reps 15]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: import bench as a package, and not bench/profile.py as the standard
    # library's `profile` (torch imports cProfile, which imports it).
    _here = Path(__file__).resolve().parent
    sys.path[:] = [x for x in sys.path if Path(x or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import torch

import gradientmail as gm
from bench import _harness as h
from bench._fleet import Result, Run, file_target, phase_table, seaweedfs_target
from bench._workload import BATCH, MlpTrainer, build_model
from gradientmail.algorithms.base import accumulate

NAME = "rounds"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# -- the report ------------------------------------------------------------------------------


def _purpose_order(label: str) -> tuple[int, str]:
    order = ("put snapshot", "put params", "put momentum", "get snapshot", "get params")
    for i, prefix in enumerate((*order, "get momentum")):
        if label.startswith(prefix) and "(records)" not in label:
            return (i, label)
    return (len(order) + 1, label)


def _config(r: Result) -> str:
    return f"{r.backend} L={r.learners} P={r.fragments} {r.params / 1e6:.0f}M"


CLOSER_WORK = ("put params", "put momentum", "get snapshot", "get momentum", "get params (by")
CONTRIBUTOR_WORK = ("put snapshot", "get params (sync)")


def star_floor(learners: int) -> float:
    """Bytes per learner per round, in fragments, of a round closed by one learner with no
    momentum blob: each uploads its snapshot; the closer downloads the L-1 others and uploads
    the result; the L-1 others download it: (L + 1 + 2(L-1)) / L = 3 - 1/L."""
    return 3 - 1 / learners


def build_report(results: list[Result], args: argparse.Namespace) -> h.Report:
    report = h.Report(
        NAME,
        "3. Round cost per learner: bytes, requests, commit latency",
        "the byte lower bound (one fragment up + one down per learner per round) and a raw "
        "put + get of one fragment on the same store, measured in this run",
    )
    table = report.table(
        f"Per learner per committed round (sync_every={args.sync_every}, poll_interval="
        f"{args.poll_interval} s, fake step {args.step_ms:g} ms)",
        [
            "backend",
            "L",
            "P",
            "params",
            "rounds",
            "up+down / learner / round",
            "lower bound",
            "ratio (<= 1.2)",
            "floor of 1 closer",
            "requests / round",
            "commit latency (median)",
            "raw put+get",
            "ratio (<= 2)",
            "closes / round",
        ],
        note=(
            "Lower bound: one fragment up + one down (fragment = parameter bytes / fragments). "
            "Floor of 1 closer: what any protocol in which one learner downloads the others' "
            "snapshots and uploads the result moves, averaged over learners, without a "
            "momentum blob: (3 - 1/L)/2 x the bound. Raw put+get: one fragment, boto3 "
            "put_object + get_object (SeaweedFS) or write + fsync + read (filesystem), median "
            "of --reps. `closes / round`: puts of the `rounds/` record per committed round."
            + (
                f" `*`: stopped at --max-seconds={args.max_seconds:g} before --rounds."
                if any(r.partial for r in results)
                else ""
            )
        ),
    )
    rows_json = []
    for r in results:
        bound = 2 * r.fragment_bytes
        lag = h.median(r.lag)
        table.add(
            r.backend,
            r.learners,
            r.fragments,
            f"{r.params / 1e6:.1f}M",
            f"{r.rounds}{'*' if r.partial else ''}",
            h.size(r.up_down),
            h.size(bound),
            h.ratio(r.up_down, bound),
            f"{star_floor(r.learners) / 2:.2f}x",
            f"{r.requests:.1f}",
            h.secs(lag),
            h.secs(r.raw),
            h.ratio(lag, r.raw, 1),
            f"{r.closes:.2f}",
        )
        rows_json.append(
            {
                "config": _config(r),
                "backend": r.backend,
                "learners": r.learners,
                "fragments": r.fragments,
                "params": r.params,
                "rounds": r.rounds,
                "partial": r.partial,
                "bytes_per_learner_round": r.up_down,
                "bytes_ratio": r.up_down / bound,
                "requests_per_learner_round": r.requests,
                "latency_median_s": lag,
                "latency_s": h.Stats.of(r.lag).__dict__,
                "raw_put_get_s": r.raw,
                "latency_ratio": lag / r.raw,
                "closes_per_round": r.closes,
                "bytes_by_purpose": r.purposes,
                "requests_by": r.requests_by,
                "phases_median_s": {k: h.median(v) for k, v in r.phases.items()},
                "step_s": {k: h.Stats.of(v).__dict__ for k, v in r.steps.items()},
                "skipped_syncs": r.skipped,
                "errors": r.errors,
            }
        )

    pooled = [t for r in results for t in r.ref_step]
    ref = h.median(pooled)
    table = report.table(
        f"step() on the training thread (fake training), against a bare step of the 1M-param "
        f"MLP (batch {BATCH}, CPU): median {h.secs(ref)} over {len(pooled)} steps",
        [
            "config",
            "snapshot calls (n, median)",
            "apply calls (n, median)",
            "plain calls (n, median)",
            "mean, all calls",
            "vs bare step",
        ],
        note=(
            "Learners are threads of one process here, so calls also wait for the GIL; "
            "benchmark 4 measures step() in processes of their own."
        ),
    )
    for r in results:
        cells = [
            f"{len(r.steps.get(k, []))}, {h.secs(h.median(r.steps.get(k, [])))}"
            for k in ("snapshot", "apply", "plain")
        ]
        every = [v for values in r.steps.values() for v in values]
        table.add(_config(r), *cells, h.secs(h.mean(every)), h.pct(h.mean(every), ref))

    labels = sorted({k for r in results for k in r.purposes}, key=_purpose_order)
    table = report.table(
        "Where the bytes go: per learner per committed round, in fragments "
        "(lower bound: 1.00 up + 1.00 down = 2.00)",
        ["what (direction)", *(_config(r) for r in results)],
        note=(
            "snapshot blobs: each learner's contribution (up) and the closer reading the "
            "others' (down). params / momentum blobs: the closer's commit (up); read back by "
            "the other learners' syncers (`get params (sync)`), by a closer for its own round "
            "(`by its closer`), and momentum by a closer whose cache does not hold the base "
            "round's momentum."
        ),
    )
    for label in labels:
        if all(r.purposes.get(label, 0.0) / r.fragment_bytes < 0.005 for r in results):
            continue
        table.add(label, *(f"{r.purposes.get(label, 0.0) / r.fragment_bytes:.2f}" for r in results))
    small = [
        sum(v for k, v in r.purposes.items() if "(records)" in k) / r.fragment_bytes
        for r in results
    ]
    table.add("JSON records, all kinds", *(f"{v:.3f}" for v in small))

    def role(r: Result, prefixes: Sequence[str]) -> float:
        picked = sum(v for k, v in r.purposes.items() if k.startswith(tuple(prefixes)))
        return picked / r.fragment_bytes

    table.add("= closer's work", *(f"{role(r, CLOSER_WORK):.2f}" for r in results))
    table.add("= every contributor's work", *(f"{role(r, CONTRIBUTOR_WORK):.2f}" for r in results))
    table.add("total", *(f"{sum(r.purposes.values()) / r.fragment_bytes:.2f}" for r in results))
    table.add(
        "(recorder / counters)",
        *(f"{r.recorder_total / max(r.counters_total, 1):.3f}" for r in results),
    )

    kinds = sorted({k for r in results for k in r.requests_by})
    table = report.table(
        "Requests per learner per committed round, by operation and key kind",
        ["request", *(_config(r) for r in results)],
    )
    for k in kinds:
        table.add(k, *(f"{r.requests_by.get(k, 0):.2f}" for r in results))
    table.add("total", *(f"{r.requests:.1f}" for r in results))

    table = phase_table(
        report,
        results,
        [_config(r) for r in results],
        "commit latency (Applied.lag_s)",
        "From this learner's snapshot record (Published) on: until the last contributor's "
        "snapshot record; until the closer's claim; the closer's blob gets/puts, then the "
        "rest until its `rounds/` record is written; until each syncer reads that record; "
        "its params download (non-closers); until the training thread applied the commit.",
    )
    table.add("raw put+get of one fragment", *(h.secs(r.raw) for r in results))

    for r in results:
        report.notes.append(
            f"{_config(r)}: {r.rounds} rounds in {r.seconds:.1f} s "
            f"({r.seconds / r.rounds:.2f} s/round), {r.skipped} due syncs skipped "
            "(fragment still in flight)"
        )
        for error in r.errors:
            report.notes.append(f"ERROR {_config(r)}: {error}")

    for backend in dict.fromkeys(r.backend for r in results):
        mine = [r for r in results if r.backend == backend]
        worst_bytes = max(mine, key=lambda r: r.up_down / (2 * r.fragment_bytes))
        b_ratio = worst_bytes.up_down / (2 * worst_bytes.fragment_bytes)
        best_floor = min(star_floor(r.learners) / 2 for r in mine)
        report.target(
            f"bytes per learner per round vs the lower bound, {backend}",
            f"{b_ratio:.2f}x at worst ({_config(worst_bytes)}); best "
            f"{min(r.up_down / (2 * r.fragment_bytes) for r in mine):.2f}x",
            "<= 1.2x",
            b_ratio <= 1.2,
            (
                "Averaged over learners, a round closed by one learner cannot go below "
                f"(3 - 1/L)/2 x the bound ({best_floor:.2f}x at L={min(r.learners for r in mine)}"
                "): the closer downloads L-1 snapshots and uploads the result, the others "
                "download it. On top: the momentum blob (1/L fragment up per learner) and "
                "momentum downloads by a closer whose cache misses (see the bytes table). A "
                "contributor that does not close moves exactly the bound (1 up, 1 down)"
            ),
        )
        worst_lag = max(mine, key=lambda r: h.median(r.lag) / r.raw)
        l_ratio = h.median(worst_lag.lag) / worst_lag.raw
        sees = [h.median(r.phases.get("syncer: sees the record", [])) for r in mine]
        report.target(
            f"commit latency vs raw put+get of one fragment, {backend}",
            f"{l_ratio:.1f}x at worst ({_config(worst_lag)}: {h.secs(h.median(worst_lag.lag))} "
            f"vs {h.secs(worst_lag.raw)}); best "
            f"{min(h.median(r.lag) / r.raw for r in mine):.1f}x",
            "<= 2x",
            l_ratio <= 2,
            (
                "See the phase table: the syncer learns of a commit by polling every "
                f"poll_interval={args.poll_interval} s (median wait until it sees the record: "
                f"{h.secs(h.median(sees))}), and the closer downloads, combines, encodes and "
                "uploads (params and momentum) one after another"
            ),
        )
    report.data = {"args": vars(args), "configs": rows_json}
    return report


# -- compression mode: bytes per learner per round, dense vs compressed contributions --------

DEFAULT_SETTINGS = (
    "dense",
    *(f"topk:{d}:{b}" for d in ("0.01", "0.02", "0.05") for b in (2, 4, 8)),
    "cast:bfloat16",
    "quantize:8",
    "sparseloco",
    "sparseloco:0.01:2",
    "sparseloco@4",
    "sparseloco:0.01:2@4",
)
"""``--compression all``: the reference, DiLoCo with each compressor, and SparseLoCo (also
with its parameters stored every 4th round, ``@4``: ``SparseLoCo(dense_every=4)``)."""

TOPK_CHUNK = 4096  # gm.TopK's and gm.Quantize's default chunk


@dataclass(frozen=True)
class Setting:
    """One algorithm of the compression table: DiLoCo or SparseLoCo and its compressor."""

    spec: str  # as written on the command line, e.g. "topk:0.01:2"
    label: str  # e.g. "DiLoCo TopK 1% 2b"
    sparse: bool  # SparseLoCo (else DiLoCo)
    compression: gm.Compression | None  # None: dense float32 parameters (the reference)
    dense_every: int = 1  # SparseLoCo: parameters stored every this many rounds

    def algorithm(self, sync_every: int, fragments: int) -> gm.Algorithm:
        if self.sparse:
            assert self.compression is not None
            return gm.SparseLoCo(
                sync_every=sync_every,
                fragments=fragments,
                compression=self.compression,
                dense_every=self.dense_every,
            )
        return gm.DiLoCo(sync_every=sync_every, fragments=fragments, compression=self.compression)

    def bytes_per_element(self, numels: Sequence[int]) -> float:
        """A contribution's bytes per parameter element, from the compressor's
        ``encoded_bytes`` of each tensor (no payload header): 4 for dense float32."""
        total = sum(numels)
        if self.compression is None or total == 0:
            return 4.0
        encoded: int = sum(self.compression.encoded_bytes(n) for n in numels)
        return encoded / total


def _describe(compression: gm.Compression) -> str:
    if isinstance(compression, gm.TopK):
        text = f"TopK {compression.density * 100:g}% {compression.bits}b"
    elif isinstance(compression, gm.Quantize):
        text = f"Quantize {compression.bits}b"
    elif isinstance(compression, gm.Cast):
        return f"Cast {compression.dtype}"
    else:  # pragma: no cover - a compressor of another kind
        return repr(compression)
    chunk = getattr(compression, "chunk", TOPK_CHUNK)
    return text if chunk == TOPK_CHUNK else f"{text} chunk {chunk}"


def _fraction(text: str) -> float:
    """``0.01`` or ``1%``."""
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def parse_setting(spec: str) -> Setting:
    """``dense`` | ``topk:DENSITY:BITS[:CHUNK]`` | ``cast[:bfloat16|float16]`` |
    ``quantize[:BITS[:CHUNK]]`` (DiLoCo with that compressor) | ``sparseloco`` (its default
    TopK) | ``sparseloco:DENSITY:BITS[:CHUNK]``, each SparseLoCo one optionally ``@K``
    (``dense_every=K``). DENSITY: ``0.01`` or ``1%``."""
    text = spec.strip().lower()
    body, at, every = text.partition("@")
    if at:
        if not body.startswith("sparseloco") or not every.isdigit() or int(every) < 1:
            raise ValueError(f"compression setting {spec!r}: @K (dense_every) is SparseLoCo's")
        setting = parse_setting(body)
        label = f"{setting.label.removesuffix(' (default)')} dense every {every}"
        return Setting(text, label, True, setting.compression, int(every))
    name, *fields = text.split(":")
    compression: gm.Compression | None = None
    try:
        if name == "dense" and not fields:
            return Setting(text, "DiLoCo dense float32", False, None)
        if name == "sparseloco" and not fields:
            compression = gm.SparseLoCo().compression
            assert compression is not None
            return Setting(
                text, f"SparseLoCo {_describe(compression)} (default)", True, compression
            )
        if name in ("topk", "sparseloco") and len(fields) in (2, 3):
            chunk = int(fields[2]) if len(fields) == 3 else TOPK_CHUNK
            compression = gm.TopK(density=_fraction(fields[0]), bits=int(fields[1]), chunk=chunk)
        elif name == "cast" and len(fields) <= 1:
            compression = gm.Cast(fields[0] if fields else "bfloat16")
        elif name == "quantize" and len(fields) <= 2:
            bits = int(fields[0]) if fields else 8
            chunk = int(fields[1]) if len(fields) == 2 else TOPK_CHUNK
            compression = gm.Quantize(bits=bits, chunk=chunk)
    except ValueError as exc:
        raise ValueError(f"compression setting {spec!r}: {exc}") from None
    if compression is None:
        raise ValueError(
            f"unknown compression setting {spec!r}; expected dense, topk:DENSITY:BITS[:CHUNK], "
            "cast[:DTYPE], quantize[:BITS[:CHUNK]], sparseloco[:DENSITY:BITS[:CHUNK]]"
        )
    sparse = name == "sparseloco"
    return Setting(
        text,
        f"{'SparseLoCo' if sparse else 'DiLoCo'} {_describe(compression)}",
        sparse,
        compression,
    )


def parse_settings(text: str | Sequence[str]) -> list[Setting]:
    """A comma-separated list of :func:`parse_setting` specs, or ``all`` (``DEFAULT_SETTINGS``);
    the dense reference first (added when missing), each algorithm once."""
    specs = text.split(",") if isinstance(text, str) else list(text)
    specs = [x.strip() for x in specs if x.strip()]
    if [x.lower() for x in specs] in (["all"], ["default"]):
        specs = list(DEFAULT_SETTINGS)
    settings: list[Setting] = []
    for spec in specs:
        setting = parse_setting(spec)
        if all(
            (s.sparse, s.compression, s.dense_every)
            != (setting.sparse, setting.compression, setting.dense_every)
            for s in settings
        ):
            settings.append(setting)
    dense = [s for s in settings if s.compression is None]
    rest = [s for s in settings if s.compression is not None]
    return (dense or [parse_setting("dense")]) + rest


COMMIT_UPLOAD = ("put params", "put momentum")


def commit_upload(purposes: Mapping[str, float]) -> float:
    """The closer's dense commit upload (params and state payloads, the part a future
    ``dense_every`` would remove) among the recorder's bytes by purpose."""
    return sum(v for k, v in purposes.items() if k.startswith(COMMIT_UPLOAD) and k.endswith("[up]"))


def records(purposes: Mapping[str, float]) -> float:
    """The JSON records' bytes (up and down) among the recorder's bytes by purpose."""
    return sum(v for k, v in purposes.items() if "(records)" in k)


@dataclass
class CodecTimes:
    """Seconds per call on a flat float32 tensor of ``numel`` elements (the fragment), and of
    a bare training step, measured interleaved."""

    numel: int
    step: h.Stats
    encode: dict[str, h.Stats]  # by _codec_key; dense: absent
    decode: dict[str, h.Stats]  # add_decoded of one contribution; dense: accumulate


def _codec_key(setting: Setting) -> str:
    return "dense" if setting.compression is None else repr(setting.compression)


def time_codecs(
    settings: Sequence[Setting], numel: int, learners: int, reps: int, steps: int = 10
) -> CodecTimes:
    """``compression.encode`` and ``add_decoded`` (weight 1/learners) of each setting's
    compressor on one random float32 tensor of ``numel`` elements, a dense ``accumulate`` for
    the reference, and ``steps`` bare training steps (``_workload.MlpTrainer``: the 1M-param
    MLP at batch 32), taking turns within each repetition; medians over ``reps``."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(numel)
    weight = 1.0 / learners
    trainer = MlpTrainer()
    for _ in range(20):  # warm up
        trainer.step()

    def bare() -> None:
        for _ in range(steps):
            trainer.step()

    fns: dict[str, Any] = {"step": bare}
    for setting in settings:
        key, compression = _codec_key(setting), setting.compression
        if f"decode {key}" in fns:
            continue
        if compression is None:
            fns[f"decode {key}"] = functools.partial(accumulate, out, values, weight)
            continue
        parts = compression.encode(values)
        fns[f"encode {key}"] = functools.partial(compression.encode, values)
        fns[f"decode {key}"] = functools.partial(
            compression.add_decoded, out, parts, weight, where="bench"
        )
    stats = h.measure_interleaved(fns, reps, warmup=1)
    return CodecTimes(
        numel,
        stats.pop("step").scaled(1 / steps),
        {k.removeprefix("encode "): v for k, v in stats.items() if k.startswith("encode ")},
        {k.removeprefix("decode "): v for k, v in stats.items() if k.startswith("decode ")},
    )


@dataclass
class CompressionRun:
    setting: Setting
    result: Result
    numels: list[int]  # the model's parameter tensors' sizes


def run_compression(args: argparse.Namespace, workdir: Path) -> h.Report:
    """Every setting of ``args.compression`` on each backend and (params, learners,
    fragments), one after another; the codec timings first, once per size."""
    settings = parse_settings(args.compression)
    runs: list[CompressionRun] = []
    codecs: dict[tuple[int, int, int], CodecTimes] = {}
    sizes = list(itertools.product(args.params, args.learners, args.fragments))
    for params, learners, fragments in sizes:
        numel = sum(x.numel() for x in build_model(params, fragments).parameters()) // fragments
        h.progress(f"compression: timing encode/decode on {numel / 1e6:.2f}M elements")
        codecs[(params, learners, fragments)] = time_codecs(
            settings, numel, learners, args.codec_reps
        )
    for backend in args.backends:
        opener: Any = seaweedfs_target(workdir) if backend == "seaweedfs" else file_target(workdir)
        with opener as target:
            for params, learners, fragments in sizes:
                numels = [x.numel() for x in build_model(params, fragments).parameters()]
                for setting in settings:
                    algorithm = setting.algorithm(args.sync_every, fragments)
                    run = Run(
                        args,
                        target,
                        learners,
                        fragments,
                        params,
                        algorithm=algorithm,
                        label=setting.label,
                    )
                    runs.append(CompressionRun(setting, run.execute(), numels))
    return build_compression_report(runs, codecs, args)


def _ratios(value: h.Stats, reference: h.Stats) -> str:
    """``median / median (min / min)``."""
    return f"{h.ratio(value.median, reference.median)} ({h.ratio(value.min, reference.min)})"


def build_compression_report(
    runs: list[CompressionRun],
    codecs: Mapping[tuple[int, int, int], CodecTimes],
    args: argparse.Namespace,
) -> h.Report:
    report = h.Report(
        NAME,
        "3c. Bytes per learner per round: dense vs compressed contributions",
        "dense float32 DiLoCo (no compression) measured in this run, on the same store, "
        "model and learners; for codec time, a bare training step measured interleaved",
    )
    rows_json: list[dict[str, Any]] = []
    groups: dict[tuple[str, int, int, int], list[CompressionRun]] = {}
    for x in runs:
        r = x.result
        groups.setdefault((r.backend, r.learners, r.fragments, r.params), []).append(x)
    for (backend, learners, fragments, params), mine in groups.items():
        config = f"{backend} L={learners} P={fragments} {params / 1e6:.2f}M params"
        ref = next((x.result for x in mine if x.setting.compression is None), None)
        ref_total = ref.up + ref.down if ref else float("nan")
        ref_rest = ref_total - commit_upload(ref.purposes) if ref else float("nan")
        table = report.table(
            f"Per learner per committed round, {config} (sync_every={args.sync_every}, "
            f"fake step {args.step_ms:g} ms)",
            [
                "setting",
                "B/elem analytic",
                "B/elem measured",
                "up",
                "down",
                "up+down",
                "dense / this",
                "commit upload",
                "without commit upload",
                "dense / this (without)",
                "computed / applied",
                "rounds",
            ],
            note=(
                "Bytes from `session.counters()` deltas over the measured window, every key "
                "kind (blobs and JSON records), divided by learners x committed rounds. B/elem: "
                "a contribution's bytes per parameter element; analytic: the compressor's "
                "`encoded_bytes` over the model's tensors (dense: 4); measured: `put snapshot` "
                "bytes per learner per round (one contribution each) / parameters per fragment, "
                "payload header included. Commit upload: the closer's dense params + state "
                "(momentum; empty for SparseLoCo) payloads (recorder), averaged over learners: "
                "the part a `dense_every` would remove. `dense / this`: the dense reference's "
                "bytes over this setting's (higher is smaller). computed / applied: commits "
                "per learner per round computed from the contributions (SparseLoCo) / applied."
                + (
                    f" `*`: stopped at --max-seconds={args.max_seconds:g} before --rounds."
                    if any(x.result.partial for x in mine)
                    else ""
                )
            ),
        )
        for x in mine:
            r = x.result
            total = r.up + r.down
            commit = commit_upload(r.purposes)
            fragment_numel = r.params / r.fragments
            analytic = x.setting.bytes_per_element(x.numels)
            measured = r.purposes.get("put snapshot [up]", 0.0) / fragment_numel
            table.add(
                x.setting.label,
                f"{analytic:.4f}",
                f"{measured:.4f}",
                h.size(r.up),
                h.size(r.down),
                h.size(total),
                h.ratio(ref_total, total),
                h.size(commit),
                h.size(total - commit),
                h.ratio(ref_rest, total - commit),
                f"{r.computed:.2f} / {r.applied:.2f}",
                f"{r.rounds}{'*' if r.partial else ''}",
            )
            rows_json.append(
                {
                    "setting": x.setting.spec,
                    "label": x.setting.label,
                    "algorithm": x.setting.algorithm(args.sync_every, r.fragments).settings(),
                    "backend": r.backend,
                    "learners": r.learners,
                    "fragments": r.fragments,
                    "params": r.params,
                    "rounds": r.rounds,
                    "seconds": r.seconds,
                    "partial": r.partial,
                    "bytes_per_element_analytic": analytic,
                    "bytes_per_element_measured": measured,
                    "up": r.up,
                    "down": r.down,
                    "up_by_kind": r.up_by_kind,
                    "down_by_kind": r.down_by_kind,
                    "commit_upload": commit,
                    "without_commit_upload": total - commit,
                    "dense_over_this": ref_total / total if total else None,
                    "dense_over_this_without_commit": (
                        ref_rest / (total - commit) if total > commit else None
                    ),
                    "computed": r.computed,
                    "applied": r.applied,
                    "bytes_by_purpose": r.purposes,
                    "skipped_syncs": r.skipped,
                    "errors": r.errors,
                }
            )

        columns = {
            "put snapshot [up]": "contribution up",
            "get snapshot [down]": "contributions down",
            "put params [up]": "params up",
            "put momentum [up]": "state up",
        }
        table = report.table(
            f"Where the bytes go, {config}: per learner per committed round (recorder)",
            ["setting", *columns.values(), "params down", "state down", "records (up+down)"],
            note=(
                "What each byte carried (`_recorder.py`): contributions (snapshots: dense "
                "parameters or compressed pseudo-gradients), the closer's commit (params and "
                "state payloads) and its downloads by the other learners, and the JSON records "
                "(snapshots, claims, rounds, leases, manifest)."
            ),
        )
        for x in mine:
            p = x.result.purposes
            table.add(
                x.setting.label,
                *(h.size(p.get(k, 0.0)) for k in columns),
                h.size(sum(v for k, v in p.items() if k.startswith("get params"))),
                h.size(sum(v for k, v in p.items() if k.startswith("get momentum"))),
                h.size(records(p)),
            )

    for (params, learners, fragments), times in codecs.items():
        bare = times.step
        table = report.table(
            f"Codec time per round on the communication thread, {times.numel / 1e6:.2f}M "
            f"elements (one fragment of {params / 1e6:.2f}M params, P={fragments}), L="
            f"{learners}, against a bare training step: {h.secs_range(bare)}",
            [
                "setting",
                "encoded",
                "encode",
                "decode (1 contribution)",
                "encode / bare step",
                "decode / bare step",
                "per round / bare step",
                f"per round / {args.sync_every} bare steps",
            ],
            note=(
                "Median (min–max) of --codec-reps repetitions on one random flat float32 tensor "
                "of the fragment's size, taking turns with the bare step: `encode`, and "
                "`add_decoded` of one contribution at weight 1/L (dense: `accumulate`, what a "
                f"closer does per snapshot). Bare step: the 1M-param MLP, batch {BATCH}, CPU "
                "(`_workload.MlpTrainer`), timed 10 steps at a time. Ratios: of the medians, "
                "and in brackets of the minima (the least disturbed by the machine's load). Per "
                "round: a compressing learner encodes and subtracts its own decoded "
                "contribution (error feedback), and its closer (and every SparseLoCo learner "
                "computing the commit) adds L decoded contributions: encode + (L+1) decodes; a "
                f"dense closer: L accumulates. A round spans sync_every={args.sync_every} "
                "training steps."
            ),
        )

        labels: set[str] = set()
        for x in runs:
            if x.setting.label in labels:  # one row per setting (not per backend)
                continue
            labels.add(x.setting.label)
            key = _codec_key(x.setting)
            enc = times.encode.get(key)
            dec = times.decode[key]
            if enc is None:
                per_round = dec.scaled(learners)
            else:
                per_round = h.Stats(
                    enc.median + (learners + 1) * dec.median,
                    enc.min + (learners + 1) * dec.min,
                    enc.max + (learners + 1) * dec.max,
                    min(enc.n, dec.n),
                )
            encoded = (
                4 * times.numel
                if x.setting.compression is None
                else x.setting.compression.encoded_bytes(times.numel)
            )
            table.add(
                x.setting.label,
                h.size(encoded),
                h.secs_range(enc) if enc else "-",
                h.secs_range(dec),
                _ratios(enc, bare) if enc else "-",
                _ratios(dec, bare),
                _ratios(per_round, bare),
                _ratios(per_round, bare.scaled(args.sync_every)),
            )
        for row in rows_json:
            if (row["params"], row["learners"], row["fragments"]) == (params, learners, fragments):
                key = _codec_key(parse_setting(row["setting"]))
                row["codec_s"] = {
                    "numel": times.numel,
                    "bare_step": times.step.__dict__,
                    "encode": times.encode[key].__dict__ if key in times.encode else None,
                    "decode": times.decode[key].__dict__,
                }

    for x in runs:
        r = x.result
        report.notes.append(
            f"{r.backend} {x.setting.label}: {r.rounds} rounds in {r.seconds:.1f} s, "
            f"{r.skipped} due syncs skipped"
        )
        for error in r.errors:
            report.notes.append(f"ERROR {r.backend} {x.setting.label}: {error}")
    report.data = {"args": vars(args), "settings": rows_json}
    return report


# -- running ---------------------------------------------------------------------------------


def defaults(ctx: h.Context) -> argparse.Namespace:
    """The preset's arguments (``--quick``: one learner count, fewer rounds)."""
    return argparse.Namespace(
        backends=["seaweedfs", "filesystem"],
        learners=ctx.pick([2, 4], [2], [2, 4, 8]),
        fragments=[1, 4],
        params=ctx.pick([10_000_000], [10_000_000], [10_000_000, 100_000_000]),
        rounds=ctx.pick(8, 3, 12),
        warmup=ctx.pick(2, 1, 3),
        sync_every=8,
        poll_interval=0.5,
        step_ms=5.0,
        reps=ctx.pick(5, 3),
        ref_steps=ctx.pick(100, 50),
        max_seconds=ctx.pick(60.0, 20.0, 150.0),
    )


def run(ctx: h.Context) -> h.Report:
    args = ctx.options.get(NAME, {}).get("args") or defaults(ctx)
    results: list[Result] = []
    workdir = ctx.workdir / f"rounds-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    if getattr(args, "compression", None):
        return run_compression(args, workdir)
    for backend in args.backends:
        opener: Any = seaweedfs_target(workdir) if backend == "seaweedfs" else file_target(workdir)
        with opener as target:
            for params, learners, fragments in itertools.product(
                args.params, args.learners, args.fragments
            ):
                results.append(Run(args, target, learners, fragments, params).execute())

    return build_report(results, args)


# The command line's defaults: the suite's default preset, and the compression table's.
CLASSIC = {
    "backends": "seaweedfs,filesystem",
    "learners": "2,4",
    "fragments": "1,4",
    "params": "10M",
    "rounds": 8,
    "warmup": 2,
    "reps": 5,
    "ref_steps": 100,
    "max_seconds": 60.0,
}
COMPRESSION = {
    "backends": "filesystem",
    "learners": "3",
    "fragments": "1",
    "params": "3M",
    "rounds": 12,
    "warmup": 1,
    "reps": 0,  # no raw put+get: the table compares bytes
    "ref_steps": 0,  # the bare step is timed beside the codecs instead
    "max_seconds": 45.0,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def both(key: str) -> str:
        return f"default {CLASSIC[key]}; with --compression {COMPRESSION[key]}"

    parser.add_argument("--backends", default=None, help=both("backends"))
    parser.add_argument("--learners", default=None, help="learner counts: " + both("learners"))
    parser.add_argument("--fragments", default=None, help="fragment counts: " + both("fragments"))
    parser.add_argument(
        "--params", default=None, help="model sizes, e.g. 10M,100M: " + both("params")
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="committed rounds measured: " + both("rounds")
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="training rounds before measuring: " + both("warmup"),
    )
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--poll-interval", type=float, default=0.5, help="Session default: 0.5")
    parser.add_argument("--step-ms", type=float, default=5.0, help="sleep per fake step")
    parser.add_argument(
        "--reps", type=int, default=None, help="raw put+get repetitions: " + both("reps")
    )
    parser.add_argument(
        "--ref-steps", type=int, default=None, help="reference training steps: " + both("ref_steps")
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="per configuration, then report partial: " + both("max_seconds"),
    )
    parser.add_argument(
        "--compression",
        default=None,
        help="measure bytes per learner per round for these algorithms instead (comma-separated: "
        "dense, topk:DENSITY:BITS[:CHUNK], cast[:DTYPE], quantize[:BITS[:CHUNK]], "
        "sparseloco[:DENSITY:BITS[:CHUNK]]; 'all': " + ",".join(DEFAULT_SETTINGS) + "); the "
        "dense reference is added when missing",
    )
    parser.add_argument(
        "--compression-table", action="store_true", help="the same as --compression all"
    )
    parser.add_argument(
        "--codec-reps", type=int, default=15, help="with --compression: encode/decode repetitions"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON record")
    args = parser.parse_args()
    if args.compression_table and not args.compression:
        args.compression = "all"
    del args.compression_table
    preset = COMPRESSION if args.compression else CLASSIC
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compression:
        try:
            args.compression = [s.spec for s in parse_settings(args.compression)]
        except ValueError as exc:
            parser.error(str(exc))
    else:
        del args.compression, args.codec_reps  # the default run's record stays as it was
    args.params = [h.count(x) for x in args.params.split(",") if x.strip()]
    args.learners = _ints(args.learners)
    args.fragments = _ints(args.fragments)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - {"seaweedfs", "filesystem"}
    if unknown:
        parser.error(f"unknown backends: {sorted(unknown)}")
    json_path = args.json
    del args.json
    from bench.__main__ import run_suite

    return run_suite([NAME], options={NAME: {"args": args}}, json_path=json_path)


if __name__ == "__main__":
    sys.exit(main())
