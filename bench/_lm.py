"""The quality benchmark's run sizes, data files and in-process arms.

The data, the model (``TinyLM``), the training step and the evaluation are
``gradientmail.demo.lm``'s (the built-in node trains the same model). This module adds
:class:`Sizes` (what a worker gets as JSON), the data file every process reads, and
:func:`run_inprocess`: ``ddp`` (one model, batch N·B), ``reference`` (N copies, DiLoCo with
zero latency through ``gm.DiLoCo.combine`` itself, the library's fragment schedule),
``reference-late`` (every outer step applied ``late`` inner steps late, the local progress
kept as ``rebase`` does) and ``solo-average`` (no syncs, one average at the end), over
N = ``len(shards)`` learners; the model in any floating dtype (:func:`build_model`: a
bfloat16 learner's arms), its learners of one rank or of several (:func:`ranks_train_step`:
what DDP ranks compute, in one process).

A learner of P ranks (the ``diloco-ddp`` arm) draws the batch a learner of one rank draws
and each rank trains on its slice of it (:func:`rank_slice`), so the learner sees the same
samples; :func:`join_ranks` forms its process group (gloo, rendezvous on a free loopback
port per learner).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradientmail.demo import lm
from gradientmail.demo.lm import ModelSize

__all__ = [
    "LEARNERS",
    "ModelSize",
    "Sizes",
    "build_model",
    "join_ranks",
    "learner_id",
    "load_data",
    "params_digest",
    "rank_slice",
    "ranks_train_step",
    "run_inprocess",
]

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


def build_model(size: ModelSize, sizes: Sizes, dtype: str = "float32", seed: int = 0) -> nn.Module:
    """The arms' model (``lm.build_model``, seeded ``sizes.seed + seed``) with its parameters
    in ``dtype`` (``"bfloat16"``: rounded from the float32 initial values)."""
    model = lm.build_model(size, sizes.context, sizes.seed + seed)
    return model if dtype == "float32" else model.to(dtype=getattr(torch, dtype))


# -- learners of many ranks ------------------------------------------------------------------


def rank_slice(tokens: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank ``rank`` of ``ranks``'s part of a learner's batch: its ``batch / ranks`` rows, in
    rank order (every rank draws the whole batch from the learner's generator)."""
    if tokens.shape[0] % ranks:
        raise ValueError(f"batch {tokens.shape[0]} does not split over {ranks} ranks")
    part = tokens.shape[0] // ranks
    return tokens[rank * part : (rank + 1) * part]


def ranks_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, lr: float, ranks: int
) -> float:
    """``lm.train_step`` as a learner of ``ranks`` DDP ranks takes it, in one process: each
    rank's loss on its :func:`rank_slice`, its gradient times ``1 / ranks`` (DDP's reducer
    scales each rank's gradient so while copying it into the bucket), those summed over the
    ranks (the all_reduce), then the optimizer step. Bitwise what 2 gloo ranks compute (a
    sum of two is the same in either order); with more ranks gloo's ring adds in another
    order. The loss returned is the ranks' mean."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    params = [p for p in model.parameters() if p.requires_grad]
    total: list[torch.Tensor | None] = [None] * len(params)
    losses = []
    for rank in range(ranks):
        part = rank_slice(tokens, rank, ranks)
        logits = model(part[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, lm.VOCAB), part[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        for k, p in enumerate(params):
            assert p.grad is not None
            scaled = p.grad * (1 / ranks)
            before = total[k]
            total[k] = scaled if before is None else before + scaled
        losses.append(float(loss.detach()))
    for p, g in zip(params, total, strict=True):
        p.grad = g
    optimizer.step()
    return sum(losses) / ranks


def join_ranks(rank: int, ranks: int, port: int, timeout_s: float) -> None:
    """This process as rank ``rank`` of a learner of ``ranks``: torchrun's variables as
    ``gradientmail run`` gives them (``launch.ranks.rank_environ``), a gloo group formed
    on the loopback port the bench chose for this learner."""
    import datetime

    import torch.distributed as dist

    from gradientmail.launch.ranks import rank_environ

    os.environ.update(rank_environ(rank, ranks, port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


def params_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes in order: the ranks of a learner compare theirs."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
    dtype: str = "float32",
    ranks: int = 1,
    tail: bool = False,
    save: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """``ddp``, ``reference`` (``late`` = 0), ``reference-late`` (``late`` > 0) or
    ``solo-average`` over ``len(shards)`` learners on the ``family``'s model, evaluated at
    the checkpoints. ``tail``: at the end every fragment contributes its steps since its
    last sync point (what ``close()`` does). ``save``: the final parameters go there.

    ``dtype``: the model's parameters (``bfloat16``); the outer state, globals and momentum,
    stays float32 as in a run, and what the copies load is the float32 global rounded by
    ``copy_`` (``Tensor.to``'s rule, as ``ModelLayout.load``). ``ranks``: each learner of
    that many DDP ranks (:func:`ranks_train_step`)."""
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

    copies = [build_model(size, sizes, dtype) for _ in range(1 if arm == "ddp" else m)]
    opts = [lm.make_optimizer(c, sizes.lr) for c in copies]
    params = [dict(c.named_parameters()) for c in copies]
    sync = arm in ("reference", "reference-late")
    algorithm = gm.DiLoCo(sync_every=sync_every, fragments=fragments)
    groups: list[list[str]] = algorithm.split([(n, p.numel()) for n, p in params[0].items()])
    due = {algorithm.offset(f): f for f in range(fragments)}
    with torch.no_grad():  # float32 outer state whatever the model's dtype (wire.OUTER_DTYPE)
        globals_ = [
            {n: params[0][n].detach().to(dtype=torch.float32, copy=True) for n in g} for g in groups
        ]
    momentum: list[dict[str, torch.Tensor] | None] = [None] * fragments
    last_sync = [0] * fragments  # local step of each fragment's last contribution
    # reference-late: (apply after local step, fragment, new global, each copy's snapshot)
    pending: list[tuple[int, int, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]] = []
    sync_points = rounds = 0
    ids = [learner_id(i) for i in range(m)]
    eval_model = build_model(size, sizes, dtype)
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
                    p = params[i][n]
                    if p.dtype == new[n].dtype:
                        p.add_(new[n]).sub_(snaps[i][n])
                    else:  # float32 arithmetic, one rounding (ModelLayout.rebase)
                        p.copy_(p.to(dtype=new[n].dtype).sub_(snaps[i][n]).add_(new[n]))

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
                lm.train_step(copies[i], opts[i], batches[i].next(), lr)
                if ranks == 1
                else ranks_train_step(copies[i], opts[i], batches[i].next(), lr, ranks)
                for i in range(m)
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
