"""The processes of the quality benchmark (``quality.py``), one job each:

    python -m bench._quality_worker JOB.json

``JOB.json`` names a ``mode`` and where the result goes (``out``, JSON):

- ``learner``: one GradientMail learner: joins the run through ``gm.Session`` on the given
  mailbox, waits at a ``gm.Barrier`` until all learners joined, trains its own shard, closes;
  reports its counters, the time ``step()`` held the thread, the sync points it reached and
  skipped, each commit's lag in inner steps, and its algorithm's settings (``DiLoCo(H, F)``,
  or the job's ``algorithm``: a compressed DiLoCo or SparseLoCo, see ``make_algorithm``).
- ``evaluate``: after the learners finished, as a user would: ``gm.align`` into a fresh
  model and the validation loss of that model; then the loss curve from the run's commits
  (the newest commit of each fragment at or before each checkpoint, read from ``rounds/``).
- ``inprocess``: one of the arms computed in one process (``_lm.run_inprocess``).

Every mode uses ``torch.set_num_threads(sizes.threads)`` (four learners share the cores) and
records which ``gradientmail`` it imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import _lm


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def open_box(spec: Mapping[str, Any]) -> Any:
    """A mailbox from its JSON description: ``{"kind": "file", "root": ...}`` or
    ``{"kind": "s3", "bucket", "prefix", "endpoint_url", "access_key", "secret_key"}``."""
    import gradientmail as gm

    if spec["kind"] == "file":
        return gm.FileMailbox(spec["root"])
    if spec["kind"] == "s3":
        return gm.S3Mailbox(
            spec["bucket"],
            spec["prefix"],
            endpoint_url=spec["endpoint_url"],
            aws_access_key_id=spec["access_key"],
            aws_secret_access_key=spec["secret_key"],
        )
    raise ValueError(f"unknown mailbox kind {spec['kind']!r}")


def _library() -> dict[str, Any]:
    import gradientmail as gm

    return {"gradientmail_file": gm.__file__, "gradientmail_version": gm.__version__}


def counters_json(counters: Any) -> dict[str, Any]:
    """Every field of a ``Counters`` (whatever this library version has), plus totals."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(counters) and not isinstance(counters, type):
        for f in dataclasses.fields(counters):
            out[f.name] = getattr(counters, f.name)
    else:
        for name in dir(counters):
            if not name.startswith("_") and not callable(getattr(counters, name)):
                out[name] = getattr(counters, name)
    for name in ("bytes_up", "bytes_down", "requests"):
        value = out.get(name)
        if isinstance(value, Mapping):
            out[f"{name}_total"] = int(sum(value.values()))
    plain: dict[str, Any] = json.loads(json.dumps(out, default=repr))
    return plain


# -- learner ---------------------------------------------------------------------------------


def make_algorithm(gm: Any, spec: Mapping[str, Any] | None, h_every: int, fragments: int) -> Any:
    """The learner's algorithm: ``gm.DiLoCo(sync_every=H, fragments=F)`` without ``spec``;
    else ``spec["name"]`` (``"diloco"`` or ``"sparseloco"``) with ``spec["settings"]``
    (``outer_lr``, ``error_decay``, ...) and ``spec["compression"]``, a compressor's settings
    (``{"name": "topk", "density": 0.02, "bits": 2}``, ``{"name": "cast", ...}``,
    ``{"name": "quantize", ...}``)."""
    if not spec:
        return gm.DiLoCo(sync_every=h_every, fragments=fragments)
    kwargs: dict[str, Any] = {"sync_every": h_every, "fragments": fragments}
    kwargs.update(spec.get("settings") or {})
    compression = spec.get("compression")
    if compression:
        kinds = {"topk": gm.TopK, "cast": gm.Cast, "quantize": gm.Quantize}
        fields = {k: v for k, v in compression.items() if k != "name"}
        kwargs["compression"] = kinds[compression["name"]](**fields)
    kinds = {"diloco": gm.DiLoCo, "sparseloco": gm.SparseLoCo}
    return kinds[spec.get("name", "diloco")](**kwargs)


def learner(job: Mapping[str, Any]) -> dict[str, Any]:
    import gradientmail as gm

    sizes = _lm.Sizes.from_json(job["sizes"])
    torch.set_num_threads(sizes.threads)
    index: int = job["learner"]
    family: str = job["family"]
    h_every: int = job["sync_every"]
    fragments: int = job["fragments"]
    overlap: int | None = job.get("overlap")
    size, steps = sizes.family(family)
    shards, _ = _lm.load_data(Path(job["data"]))
    model = _lm.build_model(size, sizes.context, sizes.seed)
    optimizer = _lm.make_optimizer(model, sizes.lr)
    batches = _lm.Batches(shards[index], index, sizes.batch, sizes.context, sizes.seed)
    box = open_box(job["mailbox"])
    lid = _lm.learner_id(index)
    algorithm = make_algorithm(gm, job.get("algorithm"), h_every, fragments)

    lock = threading.Lock()
    events: list[tuple[str, dict[str, Any]]] = []

    def on_event(event: Any) -> None:
        fields = {}
        if dataclasses.is_dataclass(event):
            fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        with lock:
            events.append((type(event).__name__, fields))

    kwargs: dict[str, Any] = {
        "algorithm": algorithm,
        "mailbox": box,
        "learner_id": lid,
        "quorum_size": _lm.LEARNERS,
        "keep_rounds": 1_000_000,  # nothing swept: the loss curve reads every commit
        "on_event": on_event,
    }
    if overlap is not None:
        kwargs["overlap"] = overlap
    if job.get("mixing") is not None:
        kwargs["mixing"] = float(job["mixing"])
    deadline = time.monotonic() + float(job["timeout"])
    joined_at = time.monotonic()
    session = gm.Session(model, **kwargs)
    barrier = gm.Barrier(mailbox=box, learner_id=lid, poll_interval=0.1)
    barrier.wait("joined", parties=_lm.LEARNERS, timeout=float(job.get("join_timeout", 300)))
    join_s = time.monotonic() - joined_at
    _say(f"{lid}: all {_lm.LEARNERS} joined after {join_s:.1f} s; training {steps} steps")

    due = {algorithm.offset(f): f for f in range(fragments)}
    has_rounds = hasattr(session, "rounds")
    due_steps: list[tuple[int, int, int]] = []  # (step, fragment, rounds[fragment] after)
    skipped_at: list[int] = []
    applied_at: dict[int, int] = {}  # round -> local step whose step() call applied it
    step_s = 0.0
    step_max = 0.0
    slow_calls = 0  # step() calls over 10 ms
    losses: list[float] = []
    started = time.perf_counter()
    for s in range(1, steps + 1):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{lid}: step {s} of {steps} after {job['timeout']} s")
        losses.append(
            _lm.train_step(model, optimizer, batches.next(), _lm.lr_at(s, steps, sizes.lr))
        )
        f = due.get(s % h_every)
        skipped_before = getattr(session.counters(), "skipped_syncs", 0) if f is not None else 0
        before = session.rounds if has_rounds else ()
        t = time.perf_counter()
        session.step(samples=sizes.batch)
        took = time.perf_counter() - t
        step_s += took
        step_max = max(step_max, took)
        slow_calls += took > 0.01
        after = session.rounds if has_rounds else ()
        for b, a in zip(before, after, strict=True):
            if a != b:
                applied_at.setdefault(a, s)
        if f is not None:
            skipped = getattr(session.counters(), "skipped_syncs", 0) > skipped_before
            if skipped:
                skipped_at.append(s)
            else:
                due_steps.append((s, f, after[f] if has_rounds else -1))
        if s % max(1, steps // 4) == 0:
            _say(f"{lid}: step {s}/{steps}, train loss {losses[-1]:.3f}")
    train_s = time.perf_counter() - started
    t = time.perf_counter()
    session.close(timeout=max(10.0, deadline - time.monotonic()))
    close_s = time.perf_counter() - t
    counters = session.counters()

    with lock:
        seen = list(events)
    published: dict[int, list[int]] = {}
    kinds: dict[str, int] = {}
    failures: list[str] = []
    lag_s: list[float] = []
    for kind, fields in seen:
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "Published":
            published.setdefault(int(fields["fragment"]), []).append(int(fields["round"]))
        elif kind == "Applied" and fields.get("contributed"):
            lag_s.append(float(fields.get("lag_s", float("nan"))))
        elif kind.endswith("Failed") and len(failures) < 20:
            failures.append(f"{kind}: {fields}")
    # Which round each sync point contributed to: the smallest round this learner published
    # for that fragment, among the round applied right after the call and the next one, that
    # no earlier sync point took (the library numbers a fragment's rounds applied + P).
    lags: list[int] = []
    taken: dict[int, int] = {}
    for s, f, after_f in due_steps:
        rounds_published = set(published.get(f, []))
        floor = taken.get(f, -1)
        candidates = [r for r in (after_f, after_f + fragments) if r in rounds_published]
        candidates = [r for r in candidates if r > floor]
        if not candidates:
            continue
        r = min(candidates)
        taken[f] = r
        if r in applied_at:
            lags.append(applied_at[r] - s)
    return {
        "mode": "learner",
        "learner": lid,
        "steps": steps,
        "samples": steps * sizes.batch,
        "join_s": join_s,
        "train_s": train_s,
        "close_s": close_s,
        "step_s": step_s,
        "step_max_s": step_max,
        "slow_step_calls": slow_calls,
        "sync_points": len(due_steps) + len(skipped_at),
        "skipped_at": skipped_at,
        "lag_steps": lags,
        "lag_s": lag_s,
        "counters": counters_json(counters),
        "events": kinds,
        "failures": failures,
        "train_loss": _lm.tail_mean(losses),
        "algorithm": algorithm.settings(),
        **_library(),
    }


# -- evaluate --------------------------------------------------------------------------------


def _decoders() -> tuple[Any, Any]:
    """``decode_commit`` and ``get_tensors``, wherever this library version keeps them."""
    import importlib

    decode = get = None
    for name in ("gradientmail.wire", "gradientmail.wire", "gradientmail.wire.records"):
        with contextlib.suppress(ImportError):
            decode = getattr(importlib.import_module(name), "decode_commit", None)
            if decode is not None:
                break
    for name in ("gradientmail.payload", "gradientmail.payload.tensors"):
        with contextlib.suppress(ImportError):
            get = getattr(importlib.import_module(name), "get_tensors", None)
            if get is not None:
                break
    if decode is None or get is None:
        raise ImportError("decode_commit or get_tensors not found in this gradientmail")
    return decode, get


async def _commits(box: Any) -> list[Any]:
    decode, _ = _decoders()
    keys = await box.list("rounds/")
    commits = []
    for key in keys:
        data = await box.get(key)
        commits.append(decode(key, data))
    return sorted(commits, key=lambda c: c.round)


def evaluate(job: Mapping[str, Any]) -> dict[str, Any]:
    import gradientmail as gm

    sizes = _lm.Sizes.from_json(job["sizes"])
    torch.set_num_threads(sizes.threads)
    family: str = job["family"]
    fragments: int = job["fragments"]
    size, steps = sizes.family(family)
    _, val = _lm.load_data(Path(job["data"]))
    box = open_box(job["mailbox"])
    model = _lm.build_model(size, sizes.context, sizes.seed + 1)  # not the initial values
    t = time.perf_counter()
    aligned_rounds = gm.align(model, mailbox=box)
    align_s = time.perf_counter() - t
    final = _lm.evaluate(model, val)
    aligned = {n: p.detach().clone() for n, p in model.named_parameters()}
    if job.get("save"):
        torch.save(aligned, job["save"])
    result: dict[str, Any] = {
        "mode": "evaluate",
        "final_loss": final,
        "align_s": align_s,
        "aligned_rounds": {str(k): v for k, v in dict(aligned_rounds).items()},
        **_library(),
    }
    # The loss curve: per checkpoint, the newest commit of each fragment whose samples
    # (cumulative over that fragment's rounds) are at most the samples trained by then.
    try:
        _, get_tensors = _decoders()
        commits = asyncio.run(_commits(box))
        per_fragment: dict[int, list[tuple[int, Any]]] = {}
        cumulative = [0] * fragments
        rounds = []
        for c in commits:
            f = int(c.fragment)
            samples = int(sum(x.samples for x in c.contributors))
            cumulative[f] += samples
            per_fragment.setdefault(f, []).append((cumulative[f], c))
            if c.contributors:
                rounds.append(
                    {
                        "round": int(c.round),
                        "fragment": f,
                        "contributors": len(c.contributors),
                        "samples": samples,
                    }
                )
        result["rounds"] = rounds
        result["samples_committed"] = cumulative
        cache: dict[str, dict[str, torch.Tensor]] = {}

        async def fetch(key: str) -> dict[str, torch.Tensor]:
            if key not in cache:
                cache[key] = {n: t.clone() for n, t in (await get_tensors(box, key)).items()}
            return cache[key]

        curve = []
        probe = _lm.build_model(size, sizes.context, sizes.seed)
        per_step = _lm.LEARNERS * sizes.batch
        for s in sizes.checkpoint_steps(steps):
            x = s * per_step
            for f in range(fragments):
                chosen = [c for cum, c in per_fragment.get(f, []) if cum <= x]
                if chosen:
                    _lm.load_params(probe, asyncio.run(fetch(chosen[-1].params)))
            curve.append((x, _lm.evaluate(probe, val)))
            if len(cache) > 4 * fragments:  # bounded memory: older payloads are not reused
                for key in list(cache)[: -2 * fragments]:
                    del cache[key]
        newest = {}
        for f in range(fragments):
            if per_fragment.get(f):
                newest.update(asyncio.run(fetch(per_fragment[f][-1][1].params)))
        result["align_equals_newest"] = all(
            torch.equal(aligned[n], newest[n]) for n in aligned if n in newest
        ) and set(newest) == set(aligned)
        result["curve"] = curve
    except Exception as exc:  # the final loss stands; say why the curve is missing
        result["curve"] = []
        result["curve_error"] = f"{type(exc).__name__}: {exc}"
    return result


# -- in-process arms -------------------------------------------------------------------------


def inprocess(job: Mapping[str, Any]) -> dict[str, Any]:
    sizes = _lm.Sizes.from_json(job["sizes"])
    torch.set_num_threads(sizes.threads)
    shards, val = _lm.load_data(Path(job["data"]))
    result = _lm.run_inprocess(
        job["arm"],
        sizes,
        shards,
        val,
        family=job["family"],
        sync_every=job.get("sync_every", 25),
        fragments=job.get("fragments", 1),
        late=job.get("late", 0),
        tail=job.get("tail", False),
        save=Path(job["save"]) if job.get("save") else None,
        progress=_say,
    )
    return {"mode": "inprocess", **dataclasses.asdict(result), **_library()}


MODES = {"learner": learner, "evaluate": evaluate, "inprocess": inprocess}


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    out = Path(job["out"])
    try:
        result = MODES[job["mode"]](job)
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        out.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=repr))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
