"""The quality benchmark's run sizes, data files and in-process arms.

The data, the model (``TinyLM``), the training step and the evaluation are
``gradientmail.demo.lm``'s (the built-in node trains the same model). This module adds
:class:`Sizes` (what a worker gets as JSON), the data file every process reads, and
:func:`run_inprocess`: ``ddp`` (one model, batch N·B), ``reference`` (N copies, DiLoCo with
zero latency through ``gm.DiLoCo.combine`` itself, the library's fragment schedule),
``reference-late`` (every outer step applied ``late`` inner steps late, the local progress
kept as ``rebase`` does) and ``solo-average`` (no syncs, one average at the end), over
N = ``len(shards)`` learners.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradientmail.demo import lm
from gradientmail.demo.lm import ModelSize

__all__ = ["LEARNERS", "ModelSize", "Sizes", "learner_id", "load_data", "run_inprocess"]

LEARNERS = lm.SHARDS  # M: one learner per shard


@dataclass(frozen=True)
class Sizes:
    """Everything that sets a run's size; a worker process gets it as JSON."""

    model: ModelSize
    fast_model: ModelSize  # diloco-fast: steps of a few ms
    batch: int  # B per learner
    steps: int  # T/M local steps per learner
    fast_steps: int
    context: int = 128
    lr: float = 2e-3
    checkpoints: int = 8  # loss-curve points
    eval_windows: int = 512
    sync_every: tuple[int, ...] = (25, 100)
    fragments: tuple[int, ...] = (1, 4)
    threads: int = 1  # torch intra-op threads in every worker (the same everywhere: bitwise)
    seed: int = lm.SEED
    max_stdlib_bytes: int | None = None  # tests: read at most about this much per shard

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sizes:
        values = dict(data)
        for key in ("model", "fast_model"):
            values[key] = ModelSize(**values[key])
        for key in ("sync_every", "fragments"):
            values[key] = tuple(values[key])
        return cls(**values)

    def family(self, name: str) -> tuple[ModelSize, int]:
        """The model and local steps of a family: ``main`` or ``fast``."""
        return (self.fast_model, self.fast_steps) if name == "fast" else (self.model, self.steps)

    def checkpoint_steps(self, steps: int) -> list[int]:
        """Local steps after which the loss curve is evaluated (the last one is the end)."""
        k = max(1, min(self.checkpoints, steps))
        return sorted({max(1, round(steps * (c + 1) / k)) for c in range(k)})

    def corpus(self) -> lm.Corpus:
        """The stdlib read, cut into blocks, 5% held out, the rest sharded by package."""
        return lm.build_corpus(
            context=self.context,
            eval_windows=self.eval_windows,
            seed=self.seed,
            max_bytes=self.max_stdlib_bytes,
        )


def load_data(path: Path) -> tuple[list[torch.Tensor], torch.Tensor]:
    data = torch.load(path, weights_only=True)
    return list(data["shards"]), data["val"]


def learner_id(i: int) -> str:
    """The learner IDs of every arm (combine orders contributions by them)."""
    return f"learner-{i}"


def tail_mean(losses: Sequence[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def run_inprocess(
    arm: str,
    sizes: Sizes,
    shards: Sequence[torch.Tensor],
    val: torch.Tensor,
    *,
    family: str = "main",
    sync_every: int = 25,
    fragments: int = 1,
    late: int = 0,
    tail: bool = False,
    save: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """``ddp``, ``reference`` (``late`` = 0), ``reference-late`` (``late`` > 0) or
    ``solo-average`` over ``len(shards)`` learners on the ``family``'s model, evaluated at
    the checkpoints. ``tail``: at the end every fragment contributes its steps since its
    last sync point (what ``close()`` does). ``save``: the final parameters go there."""
    import gradientmail as gm

    if arm not in ("ddp", "reference", "reference-late", "solo-average"):
        raise ValueError(f"unknown in-process arm {arm!r}")
    size, steps = sizes.family(family)
    m = len(shards)
    checkpoints = set(sizes.checkpoint_steps(steps))
    batches = [lm.Batches(shards[i], i, sizes.batch, sizes.context, sizes.seed) for i in range(m)]
    curve: list[tuple[int, float]] = []
    losses: list[float] = []
    started = time.perf_counter()
    eval_s = 0.0  # evaluation time, left out of the arm's wall time

    def measure(model: nn.Module) -> float:
        nonlocal eval_s
        t = time.perf_counter()
        loss = lm.evaluate(model, val)
        eval_s += time.perf_counter() - t
        return loss

    copies = [
        lm.build_model(size, sizes.context, sizes.seed) for _ in range(1 if arm == "ddp" else m)
    ]
    opts = [lm.make_optimizer(c, sizes.lr) for c in copies]
    params = [dict(c.named_parameters()) for c in copies]
    sync = arm in ("reference", "reference-late")
    algorithm = gm.DiLoCo(sync_every=sync_every, fragments=fragments)
    groups: list[list[str]] = algorithm.split([(n, p.numel()) for n, p in params[0].items()])
    due = {algorithm.offset(f): f for f in range(fragments)}
    with torch.no_grad():
        globals_ = [{n: params[0][n].detach().clone() for n in g} for g in groups]
    momentum: list[dict[str, torch.Tensor] | None] = [None] * fragments
    last_sync = [0] * fragments  # local step of each fragment's last contribution
    # reference-late: (apply after local step, fragment, new global, each copy's snapshot)
    pending: list[tuple[int, int, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]] = []
    sync_points = rounds = 0
    ids = [learner_id(i) for i in range(m)]
    eval_model = lm.build_model(size, sizes.context, sizes.seed)
    eval_params = dict(eval_model.named_parameters())

    def combine(f: int, s: int) -> dict[str, torch.Tensor]:
        samples = (s - last_sync[f]) * sizes.batch
        contributions = [
            (ids[i], samples, {n: params[i][n].detach() for n in groups[f]}) for i in range(m)
        ]
        new, mom = algorithm.combine(globals_[f], momentum[f], contributions)
        globals_[f], momentum[f], last_sync[f] = new, mom, s
        return new

    def rebase(f: int, new: Mapping[str, torch.Tensor], snaps: Sequence[Any]) -> None:
        with torch.no_grad():  # param <- new global + (param - snapshot), as rebase
            for i in range(m):
                for n in groups[f]:
                    params[i][n].add_(new[n]).sub_(snaps[i][n])

    def global_model() -> nn.Module:
        if arm == "ddp":
            return copies[0]
        with torch.no_grad():
            if sync:
                for group in globals_:
                    for n, t in group.items():
                        eval_params[n].copy_(t)
            else:  # solo-average: the copies' mean
                for n, p in eval_params.items():
                    p.copy_(torch.stack([params[i][n].detach() for i in range(m)]).mean(0))
        return eval_model

    for s in range(1, steps + 1):
        lr = lm.lr_at(s, steps, sizes.lr)
        if arm == "ddp":  # the M learners' batches side by side
            tokens = torch.cat([b.next() for b in batches])
            losses.append(lm.train_step(copies[0], opts[0], tokens, lr))
        else:
            step_losses = [
                lm.train_step(copies[i], opts[i], batches[i].next(), lr) for i in range(m)
            ]
            losses.append(sum(step_losses) / m)
        if sync:
            for _, f, new, snaps in [x for x in pending if x[0] == s]:
                rebase(f, new, snaps)
            pending = [x for x in pending if x[0] != s]
            f_due = due.get(s % sync_every)
            if f_due is not None:
                sync_points += 1
                rounds += 1
                if late == 0:
                    new = combine(f_due, s)
                    with torch.no_grad():  # exact DiLoCo: every copy takes the new global
                        for i in range(m):
                            for n in groups[f_due]:
                                params[i][n].copy_(new[n])
                else:
                    with torch.no_grad():
                        snaps = [
                            {n: params[i][n].detach().clone() for n in groups[f_due]}
                            for i in range(m)
                        ]
                    pending.append((s + late, f_due, combine(f_due, s), snaps))
        if s in checkpoints:
            curve.append((s * m * sizes.batch, measure(global_model())))
            progress(f"{arm} ({m} learners): step {s}/{steps}, loss {curve[-1][1]:.4f}")
    extra: dict[str, Any] = {}
    if sync and tail:
        # close(): the commits still in flight are applied first, then every fragment
        # contributes its steps since its last sync point.
        for _, f, new, snaps in sorted(pending, key=lambda x: x[0]):
            rebase(f, new, snaps)
        for f in range(fragments):
            if last_sync[f] < steps:
                combine(f, steps)
                rounds += 1
        curve[-1] = (curve[-1][0], measure(global_model()))
        extra["tail_rounds"] = True
    wall = time.perf_counter() - started - eval_s
    final = global_model()
    if save is not None:
        torch.save({n: p.detach().clone() for n, p in final.named_parameters()}, save)
    result: dict[str, Any] = {
        "arm": arm,
        "family": family,
        "final_loss": curve[-1][1],
        "curve": curve,
        "wall_s": wall,
        "train_loss": tail_mean(losses),  # mean over the last 10% of steps
        "sync_points": sync_points,
        "rounds": rounds,
        "extra": extra,
    }
    if arm == "solo-average":  # each copy's own final model
        result["learner_losses"] = [lm.evaluate(c, val) for c in copies]
    return result
