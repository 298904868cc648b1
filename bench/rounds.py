"""Benchmark 3 — round cost per learner: bytes, requests and commit latency per committed
round, against the byte lower bound and the raw transfer of the same bytes on the same store,
measured in the same run.

Learners (threads, each its own ``gm.Session``; ``_fleet.py``) train a model of ``--params``
float32 parameters with a cheap fake step (noise, then a short sleep), so the run is
communication-bound, on SeaweedFS (started fresh, a prefix per configuration) or
``gm.FileMailbox``. After ``--warmup`` rounds, ``--rounds`` committed rounds are measured
(twice as many with P > 1 fragments). Per learner and committed round: bytes up + down
against one fragment up and one down; requests; commit latency (``Applied.lag_s``) against a
raw put + get of one fragment on the same store; time inside ``step()`` against a bare
training step of a 1M-parameter MLP; and, from a recording mailbox (``_recorder.py``), bytes
by what they carried and latency by phase. Targets: <= 1.2x the byte lower bound, <= 2x the
raw transfer time.

With ``--compression`` (or ``--compression-table``: every setting of ``DEFAULT_SETTINGS``)
it measures instead the bytes per learner per committed round of dense float32 DiLoCo (the
reference) and of DiLoCo with a compressor and SparseLoCo, on the same store, model and
learners, and the codecs' time against a bare training step measured interleaved. No targets.

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
from bench._fleet import Result, Run, phase_table
from bench._workload import BATCH, MlpTrainer, build_model
from bench.mailbox import target
from gradientmail.algorithms.base import accumulate

NAME = "rounds"
CLOSER_WORK = ("put params", "put momentum", "get snapshot", "get momentum", "get params (by")
CONTRIBUTOR_WORK = ("put snapshot", "get params (sync)")


def _purpose_order(label: str) -> tuple[int, str]:
    order = ("put snapshot", "put params", "put momentum", "get snapshot", "get params")
    for i, prefix in enumerate((*order, "get momentum")):
        if label.startswith(prefix) and "(records)" not in label:
            return (i, label)
    return (len(order) + 1, label)


def _config(r: Result) -> str:
    return f"{r.backend} L={r.learners} P={r.fragments} {r.params / 1e6:.0f}M"


def _rounds(r: Result) -> str:
    return f"{r.rounds}{'*' if r.partial else ''}"


def _partial(args: argparse.Namespace, partial: bool) -> str:
    return f" `*`: stopped at --max-seconds={args.max_seconds:g} before --rounds." * partial


def star_floor(learners: int) -> float:
    """Bytes per learner per round, in fragments, of a round closed by one learner with no
    momentum blob: each uploads its snapshot; the closer downloads the L-1 others and uploads
    the result; the L-1 others download it: (L + 1 + 2(L-1)) / L = 3 - 1/L."""
    return 3 - 1 / learners


def _bytes_ratio(r: Result) -> float:
    return r.up_down / (2 * r.fragment_bytes)


def _lag_ratio(r: Result) -> float:
    return h.median(r.lag) / r.raw


MAIN_COLUMNS: list[tuple[str, Any]] = [
    ("backend", lambda r: r.backend),
    ("L", lambda r: r.learners),
    ("P", lambda r: r.fragments),
    ("params", lambda r: f"{r.params / 1e6:.1f}M"),
    ("rounds", _rounds),
    ("up+down / learner / round", lambda r: h.size(r.up_down)),
    ("lower bound", lambda r: h.size(2 * r.fragment_bytes)),
    ("ratio (<= 1.2)", lambda r: h.ratio(r.up_down, 2 * r.fragment_bytes)),
    ("floor of 1 closer", lambda r: f"{star_floor(r.learners) / 2:.2f}x"),
    ("requests / round", lambda r: f"{r.requests:.1f}"),
    ("commit latency (median)", lambda r: h.secs(h.median(r.lag))),
    ("raw put+get", lambda r: h.secs(r.raw)),
    ("ratio (<= 2)", lambda r: h.ratio(h.median(r.lag), r.raw, 1)),
    ("closes / round", lambda r: f"{r.closes:.2f}"),
]


def _steps(kind: str) -> Any:
    return lambda r: f"{len(r.steps.get(kind, []))}, {h.secs(h.median(r.steps.get(kind, [])))}"


def _every(r: Result) -> float:
    return h.mean([v for values in r.steps.values() for v in values])


def _record(r: Result) -> dict[str, Any]:
    lag = h.median(r.lag)
    return {
        "config": _config(r),
        **h.fields(r, "backend learners fragments params rounds partial"),
        "bytes_per_learner_round": r.up_down,
        "bytes_ratio": _bytes_ratio(r),
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


def build_report(results: list[Result], args: argparse.Namespace) -> h.Report:
    report = h.Report(
        NAME,
        "3. Round cost per learner: bytes, requests, commit latency",
        "the byte lower bound (one fragment up + one down per learner per round) and a raw "
        "put + get of one fragment on the same store, measured in this run",
    )
    h.spec_table(
        report,
        f"Per learner per committed round (sync_every={args.sync_every}, poll_interval="
        f"{args.poll_interval} s, fake step {args.step_ms:g} ms)",
        MAIN_COLUMNS,
        results,
        "Lower bound: one fragment up + one down (fragment = parameter bytes / fragments). "
        "Floor of 1 closer: what any protocol in which one learner downloads the others' "
        "snapshots and uploads the result moves, averaged over learners, without a "
        "momentum blob: (3 - 1/L)/2 x the bound. Raw put+get: one fragment, boto3 "
        "put_object + get_object (SeaweedFS) or write + fsync + read (filesystem), median "
        "of --reps. `closes / round`: puts of the `rounds/` record per committed round."
        + _partial(args, any(r.partial for r in results)),
    )
    pooled = [t for r in results for t in r.ref_step]
    ref = h.median(pooled)
    h.spec_table(
        report,
        f"step() on the training thread (fake training), against a bare step of the 1M-param "
        f"MLP (batch {BATCH}, CPU): median {h.secs(ref)} over {len(pooled)} steps",
        [
            ("config", _config),
            *(
                (f"{kind} calls (n, median)", _steps(kind))
                for kind in ("snapshot", "apply", "plain")
            ),
            ("mean, all calls", lambda r: h.secs(_every(r))),
            ("vs bare step", lambda r: h.pct(_every(r), ref)),
        ],
        results,
        "Learners are threads of one process here, so calls also wait for the GIL; "
        "benchmark 4 measures step() in processes of their own.",
    )
    configs = [_config(r) for r in results]
    table = report.table(
        "Where the bytes go: per learner per committed round, in fragments "
        "(lower bound: 1.00 up + 1.00 down = 2.00)",
        ["what (direction)", *configs],
        note=(
            "snapshot blobs: each learner's contribution (up) and the closer reading the "
            "others' (down). params / momentum blobs: the closer's commit (up); read back by "
            "the other learners' syncers (`get params (sync)`), by a closer for its own round "
            "(`by its closer`), and momentum by a closer whose cache does not hold the base "
            "round's momentum."
        ),
    )

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        table.add(label, *(fmt.format(value(r)) for r in results))

    for label in sorted({k for r in results for k in r.purposes}, key=_purpose_order):
        if any(r.purposes.get(label, 0.0) / r.fragment_bytes >= 0.005 for r in results):
            row(label, lambda r, k=label: r.purposes.get(k, 0.0) / r.fragment_bytes)
    row("JSON records, all kinds", lambda r: records(r.purposes) / r.fragment_bytes, "{:.3f}")

    def role(r: Result, prefixes: Sequence[str]) -> float:
        return (
            sum(v for k, v in r.purposes.items() if k.startswith(tuple(prefixes)))
            / r.fragment_bytes
        )

    row("= closer's work", lambda r: role(r, CLOSER_WORK))
    row("= every contributor's work", lambda r: role(r, CONTRIBUTOR_WORK))
    row("total", lambda r: sum(r.purposes.values()) / r.fragment_bytes)
    row("(recorder / counters)", lambda r: r.recorder_total / max(r.counters_total, 1), "{:.3f}")
    table = report.table(
        "Requests per learner per committed round, by operation and key kind",
        ["request", *configs],
    )
    for k in sorted({k for r in results for k in r.requests_by}):
        table.add(k, *(f"{r.requests_by.get(k, 0):.2f}" for r in results))
    table.add("total", *(f"{r.requests:.1f}" for r in results))
    table = phase_table(
        report,
        results,
        configs,
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
        report.notes.extend(f"ERROR {_config(r)}: {error}" for error in r.errors)

    for backend in dict.fromkeys(r.backend for r in results):
        mine = [r for r in results if r.backend == backend]
        worst = max(mine, key=_bytes_ratio)
        best_floor = min(star_floor(r.learners) / 2 for r in mine)
        report.target(
            f"bytes per learner per round vs the lower bound, {backend}",
            f"{_bytes_ratio(worst):.2f}x at worst ({_config(worst)}); best "
            f"{min(map(_bytes_ratio, mine)):.2f}x",
            "<= 1.2x",
            _bytes_ratio(worst) <= 1.2,
            "Averaged over learners, a round closed by one learner cannot go below "
            f"(3 - 1/L)/2 x the bound ({best_floor:.2f}x at L={min(r.learners for r in mine)}"
            "): the closer downloads L-1 snapshots and uploads the result, the others "
            "download it. On top: the momentum blob (1/L fragment up per learner) and "
            "momentum downloads by a closer whose cache misses (see the bytes table). A "
            "contributor that does not close moves exactly the bound (1 up, 1 down)",
        )
        worst = max(mine, key=_lag_ratio)
        sees = [h.median(r.phases.get("syncer: sees the record", [])) for r in mine]
        report.target(
            f"commit latency vs raw put+get of one fragment, {backend}",
            f"{_lag_ratio(worst):.1f}x at worst ({_config(worst)}: {h.secs(h.median(worst.lag))} "
            f"vs {h.secs(worst.raw)}); best {min(map(_lag_ratio, mine)):.1f}x",
            "<= 2x",
            _lag_ratio(worst) <= 2,
            "See the phase table: the syncer learns of a commit by polling every "
            f"poll_interval={args.poll_interval} s (median wait until it sees the record: "
            f"{h.secs(h.median(sees))}), and the closer downloads, combines, encodes and "
            "uploads (params and momentum) one after another",
        )
    report.data = {"args": vars(args), "configs": [_record(r) for r in results]}
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
            label = f"SparseLoCo {_describe(compression)} (default)"
            return Setting(text, label, True, compression)
        if name in ("topk", "sparseloco") and len(fields) in (2, 3):
            chunk = int(fields[2]) if len(fields) == 3 else TOPK_CHUNK
            density = fields[0]
            fraction = float(density[:-1]) / 100 if density.endswith("%") else float(density)
            compression = gm.TopK(density=fraction, bits=int(fields[1]), chunk=chunk)
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
    label = f"{'SparseLoCo' if sparse else 'DiLoCo'} {_describe(compression)}"
    return Setting(text, label, sparse, compression)


def parse_settings(text: str | Sequence[str]) -> list[Setting]:
    """A comma-separated list of :func:`parse_setting` specs, or ``all`` (``DEFAULT_SETTINGS``);
    the dense reference first (added when missing), each algorithm once."""
    specs = text.split(",") if isinstance(text, str) else list(text)
    specs = [x.strip() for x in specs if x.strip()]
    if [x.lower() for x in specs] in (["all"], ["default"]):
        specs = list(DEFAULT_SETTINGS)
    settings: list[Setting] = []
    for setting in map(parse_setting, specs):
        same = (setting.sparse, setting.compression, setting.dense_every)
        if all((s.sparse, s.compression, s.dense_every) != same for s in settings):
            settings.append(setting)
    dense = [s for s in settings if s.compression is None]
    rest = [s for s in settings if s.compression is not None]
    return (dense or [parse_setting("dense")]) + rest


def commit_upload(purposes: Mapping[str, float]) -> float:
    """The closer's dense commit upload (params and state payloads, the part a future
    ``dense_every`` would remove) among the recorder's bytes by purpose."""
    return sum(
        v
        for k, v in purposes.items()
        if k.startswith(("put params", "put momentum")) and k.endswith("[up]")
    )


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
    """``encode`` and ``add_decoded`` (weight 1/learners) of each setting's compressor on one
    random float32 tensor of ``numel`` elements, a dense ``accumulate`` for the reference,
    and ``steps`` bare training steps (``MlpTrainer``), taking turns; medians over ``reps``."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(numel)
    trainer = MlpTrainer()
    for _ in range(20):  # warm up
        trainer.step()

    def bare() -> None:
        for _ in range(steps):
            trainer.step()

    fns: dict[str, Any] = {"step": bare}
    for setting in settings:
        key, compression = _codec_key(setting), setting.compression
        if compression is None:
            fns[f"decode {key}"] = functools.partial(accumulate, out, values, 1.0 / learners)
        elif f"decode {key}" not in fns:
            parts = compression.encode(values)
            fns[f"encode {key}"] = functools.partial(compression.encode, values)
            fns[f"decode {key}"] = functools.partial(
                compression.add_decoded, out, parts, 1.0 / learners, where="bench"
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
        with target(backend, workdir, NAME) as store:
            for params, learners, fragments in sizes:
                numels = [x.numel() for x in build_model(params, fragments).parameters()]
                for s in settings:
                    algorithm = s.algorithm(args.sync_every, fragments)
                    run = Run(
                        args, store, learners, fragments, params, algorithm=algorithm, label=s.label
                    )
                    runs.append(CompressionRun(s, run.execute(), numels))
    return build_compression_report(runs, codecs, args)


def _ratios(value: h.Stats, reference: h.Stats) -> str:
    """``median / median (min / min)``."""
    return f"{h.ratio(value.median, reference.median)} ({h.ratio(value.min, reference.min)})"


def _measured(x: CompressionRun) -> float:
    r = x.result
    return r.purposes.get("put snapshot [up]", 0.0) / (r.params / r.fragments)


def _setting_tables(
    report: h.Report, args: argparse.Namespace, config: str, mine: list[CompressionRun]
) -> list[dict[str, Any]]:
    """The two tables of one (backend, learners, fragments, params); its JSON rows."""
    ref = next((x.result for x in mine if x.setting.compression is None), None)
    ref_total = ref.up + ref.down if ref else float("nan")
    ref_rest = ref_total - commit_upload(ref.purposes) if ref else float("nan")

    def total(x: CompressionRun) -> float:
        return x.result.up + x.result.down

    def rest(x: CompressionRun) -> float:
        return total(x) - commit_upload(x.result.purposes)

    h.spec_table(
        report,
        f"Per learner per committed round, {config} (sync_every={args.sync_every}, "
        f"fake step {args.step_ms:g} ms)",
        [
            ("setting", lambda x: x.setting.label),
            ("B/elem analytic", lambda x: f"{x.setting.bytes_per_element(x.numels):.4f}"),
            ("B/elem measured", lambda x: f"{_measured(x):.4f}"),
            ("up", lambda x: h.size(x.result.up)),
            ("down", lambda x: h.size(x.result.down)),
            ("up+down", lambda x: h.size(total(x))),
            ("dense / this", lambda x: h.ratio(ref_total, total(x))),
            ("commit upload", lambda x: h.size(commit_upload(x.result.purposes))),
            ("without commit upload", lambda x: h.size(rest(x))),
            ("dense / this (without)", lambda x: h.ratio(ref_rest, rest(x))),
            (
                "computed / applied",
                lambda x: f"{x.result.computed:.2f} / {x.result.applied:.2f}",
            ),
            ("rounds", lambda x: _rounds(x.result)),
        ],
        mine,
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
        + _partial(args, any(x.result.partial for x in mine)),
    )
    rows: list[dict[str, Any]] = []
    for x in mine:
        r = x.result
        commit = commit_upload(r.purposes)
        rows.append(
            {
                "setting": x.setting.spec,
                "label": x.setting.label,
                "algorithm": x.setting.algorithm(args.sync_every, r.fragments).settings(),
                **h.fields(r, "backend learners fragments params rounds seconds partial"),
                "bytes_per_element_analytic": x.setting.bytes_per_element(x.numels),
                "bytes_per_element_measured": _measured(x),
                **h.fields(r, "up down up_by_kind down_by_kind"),
                "commit_upload": commit,
                "without_commit_upload": rest(x),
                "dense_over_this": ref_total / total(x) if total(x) else None,
                "dense_over_this_without_commit": ref_rest / rest(x) if rest(x) > 0 else None,
                "computed": r.computed,
                "applied": r.applied,
                "bytes_by_purpose": r.purposes,
                "skipped_syncs": r.skipped,
                "errors": r.errors,
            }
        )

    def sized(*prefixes: str) -> Any:
        return lambda y: h.size(
            sum(v for k, v in y.result.purposes.items() if k.startswith(prefixes))
        )

    h.spec_table(
        report,
        f"Where the bytes go, {config}: per learner per committed round (recorder)",
        [
            ("setting", lambda x: x.setting.label),
            ("contribution up", sized("put snapshot [up]")),
            ("contributions down", sized("get snapshot [down]")),
            ("params up", sized("put params [up]")),
            ("state up", sized("put momentum [up]")),
            ("params down", sized("get params")),
            ("state down", sized("get momentum")),
            ("records (up+down)", lambda x: h.size(records(x.result.purposes))),
        ],
        mine,
        "What each byte carried (`_recorder.py`): contributions (snapshots: dense "
        "parameters or compressed pseudo-gradients), the closer's commit (params and "
        "state payloads) and its downloads by the other learners, and the JSON records "
        "(snapshots, claims, rounds, leases, manifest).",
    )
    return rows


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
        rows_json += _setting_tables(report, args, config, mine)

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
        for setting in {x.setting.label: x.setting for x in runs}.values():  # once per setting
            key = _codec_key(setting)
            enc, dec = times.encode.get(key), times.decode[key]
            if enc is None:
                per_round = dec.scaled(learners)
            else:
                per_round = h.Stats(
                    enc.median + (learners + 1) * dec.median,
                    enc.min + (learners + 1) * dec.min,
                    enc.max + (learners + 1) * dec.max,
                    min(enc.n, dec.n),
                )
            compression = setting.compression
            table.add(
                setting.label,
                h.size(
                    4 * times.numel
                    if compression is None
                    else compression.encoded_bytes(times.numel)
                ),
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
        report.notes.extend(f"ERROR {r.backend} {x.setting.label}: {e}" for e in r.errors)
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
    workdir = ctx.workdir / f"rounds-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    if getattr(args, "compression", None):
        return run_compression(args, workdir)
    results: list[Result] = []
    for backend in args.backends:
        with target(backend, workdir, NAME) as store:
            for params, learners, fragments in itertools.product(
                args.params, args.learners, args.fragments
            ):
                results.append(Run(args, store, learners, fragments, params).execute())
    return build_report(results, args)


# The command line: flag, type, help; its default in the suite's default preset and with
# --compression.
OPTIONS: list[tuple[str, Any, str, Any, Any]] = [
    ("backends", str, "seaweedfs, filesystem", "seaweedfs,filesystem", "filesystem"),
    ("learners", str, "learner counts", "2,4", "3"),
    ("fragments", str, "fragment counts", "1,4", "1"),
    ("params", str, "model sizes, e.g. 10M,100M", "10M", "3M"),
    ("rounds", int, "committed rounds measured", 8, 12),
    ("warmup", int, "training rounds before measuring", 2, 1),
    # --compression: no raw put+get (the table compares bytes), the bare step is timed
    # beside the codecs instead
    ("reps", int, "raw put+get repetitions", 5, 0),
    ("ref_steps", int, "reference training steps", 100, 0),
    ("max_seconds", float, "per configuration, then report partial", 60.0, 45.0),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, kind, text, classic, compressed in OPTIONS:
        help_ = f"{text}: default {classic}; with --compression {compressed}"
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind, default=None, help=help_)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--poll-interval", type=float, default=0.5, help="Session default: 0.5")
    parser.add_argument("--step-ms", type=float, default=5.0, help="sleep per fake step")
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
    for key, _, _, classic, compressed in OPTIONS:
        if getattr(args, key) is None:
            setattr(args, key, compressed if args.compression else classic)
    if args.compression:
        try:
            args.compression = [s.spec for s in parse_settings(args.compression)]
        except ValueError as exc:
            parser.error(str(exc))
    else:
        del args.compression, args.codec_reps  # the default run's record stays as it was
    args.params = [h.count(x) for x in args.params.split(",") if x.strip()]
    args.learners = [int(x) for x in args.learners.split(",") if x.strip()]
    args.fragments = [int(x) for x in args.fragments.split(",") if x.strip()]
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
