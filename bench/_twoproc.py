"""Two learner processes in one run, for ``step`` (4) and ``sync`` (5): each a spawned
process with its own ``gm.Session`` on a mailbox shared only through the store.

- ``sync``: ``params`` float32 parameters in one fragment. Before each round both perturb
  their parameters, meet at a barrier and make the due ``step()`` call together; then each
  calls ``step()`` between 1 ms sleeps (standing in for training) until the commit is
  applied. Recorded per round and process: when the due call began and how long it held the
  thread, when ``Published`` fired, when the applying call began and how long it took.
- ``train``: the 1M-parameter MLP trained for real with ``DiLoCo()`` defaults; every
  ``step()`` call and training step timed, after bare steps measured before joining.

``time.monotonic`` is one clock for the processes of a machine: the parent lines them up.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

import gradientmail as gm
from bench import _harness as h
from bench import _procs
from bench._workload import MlpTrainer, build_model, mlp_1m, reference_step
from gradientmail import events as ev


@dataclass(frozen=True)
class Config:
    mode: str  # "sync" or "train"
    params: int = 10_000_000
    rounds: int = 8
    warmup: int = 2
    steps: int = 3000  # train mode
    poll_interval: float = 0.5
    timeout: float = 60.0
    threads: int = 1  # torch intra-op threads per process


def _learner(index: int, box: gm.Mailbox, config: Config, barrier: Any, queue: Any) -> None:
    h.guarded(index, barrier, queue, lambda: _learn(index, box, config, barrier))


def _learn(index: int, box: gm.Mailbox, config: Config, barrier: Any) -> dict[str, Any]:
    # One intra-op thread each: OpenMP threads of two processes spinning on two cores slow
    # both down by an order of magnitude.
    torch.set_num_threads(config.threads)
    events = _procs.Events()
    bare: list[float] = []
    if config.mode == "train":
        barrier.wait(timeout=120)  # both measure their bare steps at the same time
        bare = reference_step(200)
        model = mlp_1m()
        algorithm = gm.DiLoCo()  # the defaults: sync_every=100, one fragment
    else:
        model = build_model(config.params)
        algorithm = gm.DiLoCo(sync_every=20_000, fragments=1)
    session = gm.Session(
        model,
        algorithm=algorithm,
        mailbox=box,
        learner_id=f"proc-{index}",
        poll_interval=config.poll_interval,
        on_event=events,
    )
    result: dict[str, Any] = {"index": index, "bare_step_s": bare}
    barrier.wait(timeout=120)  # both joined
    try:
        if config.mode == "train":
            result |= _train(session, model, config)
        else:
            result |= _sync_rounds(index, session, config, barrier)
    finally:
        session.close(timeout=60)
    counters = session.counters()
    return result | {
        "published": {e.round: t for t, e in events.of(ev.Published)},
        "committed": {e.round: t for t, e in events.of(ev.Committed) if not e.adopted},
        "applied": {e.round: (t, e.contributed) for t, e in events.of(ev.Applied)},
        "failures": events.failures(),
        "skipped_syncs": counters.skipped_syncs,
        "requests": sum(counters.requests.values()),
    }


def _timed(session: gm.Session, **kwargs: Any) -> float:
    t = time.perf_counter()
    session.step(**kwargs)
    return time.perf_counter() - t


def _sync_rounds(index: int, session: gm.Session, config: Config, barrier: Any) -> dict[str, Any]:
    noise = torch.randn(4096, generator=torch.Generator().manual_seed(index)) * 1e-4
    due = session.algorithm.sync_every
    rounds = []
    plain: list[float] = []
    for _ in range(config.warmup + config.rounds):
        while (session.steps + 1) % due:  # plain calls up to the one before the due call
            plain.append(_timed(session))
        with torch.no_grad():  # local progress, different on each learner
            for p in session.model.parameters():
                n = min(p.numel(), noise.numel())
                p.view(-1)[:n].add_(noise[:n])
        before = session.rounds
        barrier.wait(timeout=120)
        due_at = time.monotonic()
        snapshot_s = _timed(session)
        deadline = time.monotonic() + config.timeout
        apply_at = apply_s = float("nan")
        while time.monotonic() < deadline:
            time.sleep(0.001)  # "training"
            at = time.monotonic()
            took = _timed(session)
            if session.rounds != before:
                apply_at, apply_s = at, took
                break
            plain.append(took)
        rounds.append(
            {
                "round": session.rounds[0],
                "due_at": due_at,
                "snapshot_s": snapshot_s,
                "apply_at": apply_at,
                "apply_s": apply_s,
            }
        )
    return {"rounds": rounds, "plain_s": plain}


def _train(session: gm.Session, model: torch.nn.Module, config: Config) -> dict[str, Any]:
    trainer = MlpTrainer(model)
    train_s: list[float] = []
    calls: list[tuple[str, float]] = []
    for _ in range(config.steps):
        before_rounds, before_skipped = session.rounds, session.counters().skipped_syncs
        t = time.perf_counter()
        trainer.step()
        train_s.append(time.perf_counter() - t)
        took = _timed(session, samples=32)
        due = session.algorithm.due_fragment(session.steps) is not None
        if due and session.counters().skipped_syncs == before_skipped:
            kind = "snapshot"
        else:
            kind = "apply" if session.rounds != before_rounds else "plain"
        calls.append((kind, took))
    return {"train_s": train_s, "calls": calls}


# -- the parent side -------------------------------------------------------------------------


def run(ctx: h.Context, backend: str, config: Config) -> dict[str, Any]:
    """Run (or reuse from ``ctx.cache``) two learner processes; return both results."""
    key = f"twoproc {backend} {config}"
    if key not in ctx.cache:
        if config.mode == "sync":
            what = f"{config.warmup} + {config.rounds} rounds of {config.params / 1e6:.0f}M params"
        else:
            what = f"the 1M-param MLP, {config.steps} training steps"
        h.progress(f"two learner processes on {backend}: {what}")
        os.sync()  # earlier runs' dirty pages written back first: they would slow our fsyncs
        with _procs.store(backend, ctx.workdir, "twoproc") as box:
            procs, queue, _ = _procs.spawn(_learner, 2, (box, config), "twoproc")
            limit = 60 + config.timeout * (config.rounds + config.warmup + 2)
            results, errors = _procs.gather(procs, queue, 2, "twoproc", limit_s=limit)
        if errors or len(results) < 2:
            raise RuntimeError(f"learner processes failed: {errors or 'no result'}")
        ctx.cache[key] = {"backend": backend, "config": config.__dict__, "learners": results}
    return dict(ctx.cache[key])


def sync_rounds(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per measured round: both due -> both published -> both applied, and the per-process
    step() times at the due call and at the applying call."""
    a, b = result["learners"]
    warmup = result["config"]["warmup"]
    out = []
    for ra, rb in zip(a["rounds"][warmup:], b["rounds"][warmup:], strict=True):
        if ra["round"] != rb["round"]:
            continue  # not the same commit (should not happen)
        r = ra["round"]
        pa, pb = a["published"].get(r), b["published"].get(r)
        both_due = max(ra["due_at"], rb["due_at"])
        both_applied = max(ra["apply_at"], rb["apply_at"])
        both_published = max(pa, pb) if pa is not None and pb is not None else float("nan")
        committed = a["committed"].get(r, b["committed"].get(r, float("nan")))
        out.append(
            {
                "round": r,
                "from_due_s": both_applied - both_due,
                "from_published_s": both_applied - both_published,
                "publish_s": both_published - both_due,
                "close_s": committed - both_published,  # close detection + the closer's work
                "apply_after_commit_s": both_applied - committed,  # polling, download, apply
                "snapshot_s": [ra["snapshot_s"], rb["snapshot_s"]],
                "apply_s": [ra["apply_s"], rb["apply_s"]],
            }
        )
    return out
