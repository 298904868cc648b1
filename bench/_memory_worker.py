"""The processes of ``bench/memory.py``: learners (a ``gm.Session`` each) and the "training
alone" reference (the same model and loop, no Session, gradientmail never imported: only
the standard library and torch are imported at the top).

Both measure their resident set alike: a thread reads ``/proc/self/statm`` every
``sample_s`` and keeps the maxima (overall, since a start, per window); at the end the peak
is the larger of that and the kernel's ``VmHWM``, which also sees spikes shorter than a
sample. The training step: the ``_workload.build_model`` stack, forward + backward of an MSE
loss on a fixed random batch (distinct per learner), plain SGD (lr 1e-4, no momentum: no
optimizer state, so training's memory is parameters + gradients + activations).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import sys
import threading
import time
from typing import Any

import torch

from bench import _harness as h
from bench._workload import build_model

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """The process's resident set now, in bytes."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def proc_bytes(path: str, field: str) -> int:
    """A ``kB`` field of a /proc file (``VmHWM`` of ``/proc/<pid>/status``, ``MemAvailable``
    of ``/proc/meminfo``), in bytes; 0 when missing (the process gone)."""
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    return proc_bytes("/proc/meminfo", "MemAvailable")


class Sampler:
    """Samples the resident set on a daemon thread: the maximum overall (``peak``), since the
    last :meth:`restart` (``since``) and since the last :meth:`window`."""

    def __init__(self, interval: float) -> None:
        self.samples = 0
        self._lock = threading.Lock()
        self.peak = self._window = self.since = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    def sample(self) -> int:
        now = rss()
        with self._lock:
            self.samples += 1
            self.peak = max(self.peak, now)
            self._window = max(self._window, now)
            self.since = max(self.since, now)
        return now

    def window(self) -> tuple[int, int]:
        """(the maximum since the previous call, the resident set now); starts a new window."""
        now = self.sample()
        with self._lock:
            peak, self._window = self._window, now
        return peak, now

    def restart(self) -> int:
        """Start the "since" maximum (and a window) from now; returns the resident set."""
        now = self.sample()
        with self._lock:
            self.since = self._window = now
        return now

    def finish(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
        hwm = proc_bytes("/proc/self/status", "VmHWM")
        peak = self.peak
        return {
            "peak": max(hwm, peak),
            "peak_sampled": peak,
            "vm_hwm": hwm,
            "samples": self.samples,
        }


class Trainer:
    """Forward + backward + plain SGD of the Linear stack on a fixed random batch."""

    def __init__(self, spec: dict[str, Any], seed: int) -> None:
        self.model = build_model(spec["params"], spec["fragments"])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        width = self.model[0].in_features
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(spec["batch"], width, generator=generator)
        self.y = torch.randn(spec["batch"], width, generator=generator)
        self.model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.optimizer.step()


def _usage(gm: Any) -> dict[str, Any] | None:
    """``gm.memory_usage()`` as plain data; None on a checkout without it."""
    if getattr(gm, "memory_usage", None) is None:
        return None
    u = gm.memory_usage()
    return {
        "live": {k: int(v) for k, v in u.live.items()},
        "peak": {k: int(v) for k, v in u.peak.items()},
        "live_total": int(u.live_total),
        "peak_total": int(u.peak_total),
        "idle": int(getattr(u, "idle", 0)),
    }


def alone(_: int, spec: dict[str, Any], queue: Any) -> None:
    """Training alone, in a process of its own (no barrier: nothing to meet)."""
    h.guarded(-1, None, queue, lambda: _alone(spec, queue))


def _alone(spec: dict[str, Any], queue: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    sampler = Sampler(spec["sample_s"])
    before = sampler.restart()  # torch imported, nothing built
    trainer = Trainer(spec, seed=1000)
    trainer.step()
    gc.collect()
    after_one = sampler.restart()
    periods = []
    for period in range(spec["periods"]):
        for _ in range(spec["sync_every"]):
            trainer.step()
        peak, now = sampler.window()
        periods.append({"peak": peak, "rss": now})
        queue.put({"progress": f"training alone: period {period + 1}/{spec['periods']}"})
    return {
        "index": -1,
        "role": "alone",
        "model_bytes": trainer.model_bytes,
        "rss_before": before,
        "rss_base": after_one,
        "periods": periods,
        "gradientmail_imported": "gradientmail" in sys.modules,
    } | sampler.finish()


def learner(index: int, spec: dict[str, Any], mailbox: Any, barrier: Any, queue: Any) -> None:
    h.guarded(index, barrier, queue, lambda: _learn(index, spec, mailbox, barrier, queue))


def _learn(
    index: int, spec: dict[str, Any], mailbox: Any, barrier: Any, queue: Any
) -> dict[str, Any]:
    torch.set_num_threads(1)  # many processes on few cores
    sampler = Sampler(spec["sample_s"])
    # gradientmail is already imported here: unpickling the mailbox argument imported it.
    rss_start = sampler.restart()
    import gradientmail as gm

    trainer = Trainer(spec, seed=index)
    trainer.step()
    gc.collect()
    base = sampler.restart()  # model + optimizer + one training step, before the Session
    n = spec["learners"]
    # A hang (a round that never closes) prints every thread's stack to stderr.
    faulthandler.dump_traceback_later(0.8 * spec["stall_s"], exit=False)
    barrier.wait(timeout=spec["timeout"])
    learner_id = f"learner-{index}"
    failures = [0]

    def on_event(event: object) -> None:  # failures reported as they happen (a few)
        if type(event).__name__.endswith("Failed") and failures[0] < 5:
            failures[0] += 1
            queue.put({"beat": index, "failure": repr(event)[:400]})

    t0 = time.monotonic()
    session = gm.Session(
        trainer.model,
        algorithm=gm.DiLoCo(sync_every=spec["sync_every"], fragments=spec["fragments"]),
        mailbox=mailbox,
        learner_id=learner_id,
        quorum_size=n,
        round_timeout=spec["round_timeout"],
        poll_interval=spec["poll_interval"],
        on_event=on_event,
    )
    join_s = time.monotonic() - t0
    rss_joined = rss()
    queue.put({"beat": index, "progress": "joined"})
    periods: list[dict[str, int]] = []
    try:
        # Every round has every learner: nobody trains before all have joined.
        gm.Barrier(mailbox=mailbox, learner_id=learner_id, poll_interval=0.05).wait(
            "memory-start", parties=n, timeout=spec["timeout"]
        )
        sampler.window()
        loop_from = time.monotonic()
        for period in range(spec["periods"]):
            faulthandler.dump_traceback_later(0.8 * spec["stall_s"], exit=False)
            for _ in range(spec["sync_every"]):
                trainer.step()
                session.step(samples=spec["batch"])
            peak, now = sampler.window()
            periods.append({"peak": peak, "rss": now, "rounds": sum(session.rounds)})
            news = f"period {period + 1}/{spec['periods']}, rounds {session.rounds}"
            queue.put({"beat": index, "progress": news})
        loop_s = time.monotonic() - loop_from
        usage_loop = _usage(gm)
        t0 = time.monotonic()
        session.close(timeout=spec["timeout"])
        close_s = time.monotonic() - t0
        faulthandler.cancel_dump_traceback_later()
    except BaseException:
        with contextlib.suppress(Exception):
            session.close(timeout=10)
        raise
    since = sampler.since
    counters = session.counters()
    rounds = session.rounds
    del session
    gc.collect()
    return {
        "index": index,
        "role": "learner",
        "gradientmail_file": gm.__file__,
        "model_bytes": trainer.model_bytes,
        "rss_start": rss_start,
        "rss_base": base,
        "rss_joined": rss_joined,
        "peak_since_base": since,
        "periods": periods,
        "closed": counters.closed,
        "published": counters.published,
        "applied": counters.applied,
        "rounds": list(rounds),
        "waited_s": counters.waited_s,
        "join_s": join_s,
        "loop_s": loop_s,
        "close_s": close_s,
        "usage": usage_loop,
        "usage_after_close": _usage(gm),
    } | sampler.finish()
