"""Benchmark 2 — combine: the closer's sample-weighted average of N snapshots plus the outer
Nesterov step (``DiLoCo.combine``), for N = 2, 4, 8 snapshots of one fragment.

Measured, for a fragment of ``--params`` float32 parameters (default 100M = 400 MB;
``--quick`` 10M) and each N, median and min–max over repetitions:

- throughput in input bytes per second: (N snapshots + the base parameters + the momentum)
  / time, against memcpy of the same input bytes into existing memory (``Tensor.copy_``)
  measured in the same run;
- memory: bytes of fresh tensor storage each call allocates (counted by a
  ``TorchDispatchMode``), in fragments: the two outputs (new parameters, new momentum) are
  2.00; everything beyond them is temporaries;
- a prototype of the proposed combine (bench code): the same element-wise operations in the
  same order (bitwise the same result, checked), writing into the two outputs and one
  accumulator that becomes the new parameters; with outputs allocated per call, and with
  outputs reused across calls (the closer would keep them per fragment).

Target: >= 50% of memcpy bandwidth, no full-size temporaries beyond one accumulator.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gradientmail as gm
from bench import _harness as h
from bench._workload import build_model

NAME = "combine"

Contribution = tuple[str, int, Mapping[str, torch.Tensor]]


class AllocationCounter(TorchDispatchMode):
    """Counts the bytes of fresh storage that tensor operations return, and the peak of
    those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = 0
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs or {}))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                if nbytes:
                    inputs.add(t.untyped_storage().data_ptr())
                    self.allocated += nbytes
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._freed, nbytes)
        return out


def combine_prototype(
    algorithm: gm.DiLoCo,
    base: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    contributions: Sequence[Contribution],
    out: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``DiLoCo.combine`` with the same operations in the same order, into the outputs.

    The accumulator is the new-parameters output: average -> delta -> update -> new params,
    each in place; the momentum is computed into its output. No other storage is allocated.
    ``out``: buffers to reuse (new params, new momentum) instead of allocating them.
    """
    ordered = sorted(contributions, key=lambda c: c[0])
    total = float(sum(samples for _, samples, _ in ordered))
    beta = algorithm.outer_momentum
    new_params: dict[str, torch.Tensor] = {}
    new_momentum: dict[str, torch.Tensor] = {}
    for name, global_value in base.items():
        g = global_value.to(torch.float32)
        acc = torch.empty_like(g) if out is None else out[0][name]
        m = torch.empty_like(g) if out is None else out[1][name]
        acc.zero_()
        for _, samples, local in ordered:
            acc.add_(local[name].to(torch.float32), alpha=samples / total)
        torch.sub(g, acc, out=acc)  # delta = g - average
        if momentum is None:
            m.copy_(acc)
        else:
            torch.mul(momentum[name].to(torch.float32), beta, out=m).add_(acc)
        if algorithm.nesterov:
            acc.add_(m, alpha=beta)  # update = delta + beta * m
        else:
            acc.copy_(m)
        torch.sub(g, acc, alpha=algorithm.outer_lr, out=acc)  # g - lr * update
        new_params[name] = acc.to(global_value.dtype)
        new_momentum[name] = m
    return new_params, new_momentum


def run(ctx: h.Context) -> h.Report:
    opts = ctx.options.get(NAME, {})
    params = opts.get("params") or ctx.pick(100_000_000, 10_000_000)
    reps = opts.get("reps") or ctx.pick(3, 3)
    counts: list[int] = opts.get("n") or [2, 4, 8]
    report = h.Report(
        NAME,
        "2. Combine: weighted average of N snapshots + outer Nesterov step (DiLoCo.combine)",
        "memcpy of the same input bytes into existing memory (Tensor.copy_), in this run",
    )
    algorithm = gm.DiLoCo(sync_every=100, fragments=1)
    model = build_model(params)
    with torch.no_grad():
        base = {k: v.detach().clone() for k, v in model.named_parameters()}
    del model
    frag = sum(v.numel() * v.element_size() for v in base.values())
    h.progress(f"combine: fragment {frag / h.MIB:.0f} MiB, building {max(counts)} snapshots")
    generator = torch.Generator().manual_seed(0)
    momentum = {k: torch.randn(v.shape, generator=generator) * 1e-3 for k, v in base.items()}
    snapshots: list[dict[str, torch.Tensor]] = []
    for i in range(max(counts)):
        snapshots.append({k: v + 1e-3 * (i + 1) for k, v in base.items()})
    scratch = {k: torch.empty_like(v) for k, v in base.items()}
    reused = (
        {k: torch.empty_like(v) for k, v in base.items()},
        {k: torch.empty_like(v) for k, v in base.items()},
    )

    table = report.table(
        f"Combine of one {frag / 1e6:.0f} MB fragment ({params / 1e6:.0f}M float32 "
        f"parameters); {reps} repetitions; input = N snapshots + base + momentum",
        [
            "N",
            "variant",
            "time, median (min–max)",
            "input throughput",
            "vs memcpy",
            "allocated / call",
            "beyond the 2 outputs",
            "peak live",
        ],
        note=(
            "Allocated: fresh tensor storage per call, in fragments (1.00 = "
            f"{frag / 1e6:.0f} MB); the outputs are 2.00. The prototype's results are "
            "checked bitwise equal to DiLoCo.combine's."
        ),
    )
    results: dict[str, Any] = {}
    for n in counts:
        contributions: list[Contribution] = [
            (f"learner-{i}", 100 + 7 * i, snapshots[i]) for i in range(n)
        ]
        inputs = [base, momentum, *snapshots[:n]]
        in_bytes = frag * (n + 2)
        h.progress(f"combine: N={n} ({in_bytes / 1e9:.1f} GB input)")

        def memcpy(inputs: list[dict[str, torch.Tensor]] = inputs) -> None:
            for tensors in inputs:
                for k, v in tensors.items():
                    scratch[k].copy_(v)

        def library(contributions: list[Contribution] = contributions) -> None:
            algorithm.combine(base, momentum, contributions)

        def proto(contributions: list[Contribution] = contributions) -> None:
            combine_prototype(algorithm, base, momentum, contributions)

        def proto_reused(contributions: list[Contribution] = contributions) -> None:
            combine_prototype(algorithm, base, momentum, contributions, out=reused)

        expect = algorithm.combine(base, momentum, contributions)
        got = combine_prototype(algorithm, base, momentum, contributions, out=reused)
        for a, b in zip(expect, got, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a), "prototype differs from combine"
        del expect, got
        variants = {
            "DiLoCo.combine (library)": library,
            "prototype, outputs allocated": proto,
            "prototype, outputs reused": proto_reused,
        }
        stats = h.measure_interleaved({"memcpy": memcpy, **variants}, reps)
        ref = stats["memcpy"]
        ref_rate = ref.rate(in_bytes).median
        table.add(
            n,
            "memcpy of the inputs",
            h.secs_range(ref),
            h.gbps(ref.rate(in_bytes)),
            "100.0%",
            "-",
            "-",
            "-",
        )
        for label, fn in variants.items():
            st = stats[label]
            counter = AllocationCounter()
            with counter:
                fn()
            rate = st.rate(in_bytes)
            table.add(
                n,
                label,
                h.secs_range(st),
                h.gbps(rate),
                h.pct(rate.median, ref_rate),
                f"{counter.allocated / frag:.2f}",
                f"{max(counter.allocated / frag - 2, 0):.2f}",
                f"{counter.peak / frag:.2f}",
            )
            results[f"N={n} {label}"] = {
                "median_s": st.median,
                "min_s": st.min,
                "max_s": st.max,
                "input_gbps": rate.median / h.GB,
                "vs_memcpy": rate.median / ref_rate,
                "allocated_fragments": counter.allocated / frag,
                "peak_fragments": counter.peak / frag,
            }
        results[f"N={n} memcpy"] = {"median_s": ref.median, "input_gbps": ref_rate / h.GB}

    worst = min(results[f"N={n} DiLoCo.combine (library)"]["vs_memcpy"] for n in counts)
    temps = max(results[f"N={n} DiLoCo.combine (library)"]["allocated_fragments"] for n in counts)
    proto_worst = min(results[f"N={n} prototype, outputs allocated"]["vs_memcpy"] for n in counts)
    reuse_worst = min(results[f"N={n} prototype, outputs reused"]["vs_memcpy"] for n in counts)
    report.target(
        "combine input bandwidth, worst N",
        f"{100 * worst:.0f}% of memcpy",
        ">= 50% of memcpy",
        worst >= 0.5,
        (
            f"The prototype (same bits, no temporaries) reaches {100 * proto_worst:.0f}% with "
            f"fresh outputs and {100 * reuse_worst:.0f}% with reused outputs: fresh storage "
            "(page faults on first touch) costs more than the arithmetic"
        ),
    )
    report.target(
        "temporaries per combine",
        f"{temps - 2:.2f} fragments of temporaries beyond the 2 outputs "
        f"({temps:.2f} allocated per call)",
        "<= 1 fragment (one accumulator)",
        temps - 2 <= 1.0 + 1e-6,
        (
            f"DiLoCo.combine allocates {temps:.2f} fragments of fresh storage per call "
            "(per tensor, so the live peak is lower); every allocation is fresh memory that "
            "page-faults on first touch. Making the accumulator the new-parameters output "
            "(prototype) leaves the two outputs only"
        ),
    )
    report.data = {"params": params, "fragment_bytes": frag, "reps": reps, "results": results}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default=None, help="e.g. 100M")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--n", default=None, help="comma-separated snapshot counts")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from bench.__main__ import run_suite

    options = {
        NAME: {
            "params": h.count(args.params) if args.params else None,
            "reps": args.reps,
            "n": [int(x) for x in args.n.split(",")] if args.n else None,
        }
    }
    return run_suite([NAME], quick=args.quick, options=options)


if __name__ == "__main__":
    sys.exit(main())
