"""The processes of the quality benchmark (``quality.py``), one job each:

    python -m bench._quality_worker JOB.json

``JOB.json`` names a ``mode`` and where the result goes (``out``, JSON):

- ``learner``: one GradientMail learner: joins the run through ``gm.Session`` on the given
  mailbox, waits at a ``gm.Barrier`` until all learners joined, trains its own shard, closes;
  reports its counters, the time ``step()`` held the thread, the sync points it reached and
  skipped, each commit's lag in inner steps, and its algorithm's settings (``DiLoCo(H, F)``,
  or the job's ``algorithm``: a compressed DiLoCo, SparseLoCo or Moshpit, see
  ``make_algorithm``). ``learners`` (default :data:`_lm.LEARNERS`) is the run's size (the
  barrier's parties, the quorum); ``save_params`` keeps its own final model there.
- ``evaluate``: after the learners finished, as a user would: ``gm.align`` into a fresh
  model and the validation loss of that model; then the loss curve from the run's commits
  (the newest commit of each fragment at or before each checkpoint, read from ``rounds/``;
  a Moshpit run's from its group rounds instead, see ``group_rounds``), and the losses of
  the learners' own final models (``learner_params``).
- ``inprocess``: one of the arms computed in one process (``_lm.run_inprocess``; with
  ``learners``, ``ddp`` or ``solo-average`` over that many shards: ``inprocess_n``).

Every mode uses ``torch.set_num_threads(sizes.threads)`` (four learners share the cores) and
records which ``gradientmail`` it imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
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
    ``{"name": "quantize", ...}``); or ``"moshpit"``: ``gm.Moshpit(sync_every=H, **settings)``
    (``group_size``, ``grid_dims``; no fragments, no compression)."""
    if not spec:
        return gm.DiLoCo(sync_every=h_every, fragments=fragments)
    if spec.get("name") == "moshpit":
        if spec.get("compression"):
            raise ValueError("Moshpit takes no compression")
        return gm.Moshpit(sync_every=h_every, **dict(spec.get("settings") or {}))
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
    learners = int(job.get("learners", _lm.LEARNERS))
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
        "quorum_size": learners,
        "keep_rounds": 1_000_000,  # nothing swept: the loss curve reads every commit
        "on_event": on_event,
    }
    for name in ("round_timeout", "lease_timeout", "poll_interval"):
        if job.get(name) is not None:
            kwargs[name] = float(job[name])
    if overlap is not None:
        kwargs["overlap"] = overlap
    if job.get("mixing") is not None:
        kwargs["mixing"] = float(job["mixing"])
    deadline = time.monotonic() + float(job["timeout"])
    joined_at = time.monotonic()
    session = gm.Session(model, **kwargs)
    barrier = gm.Barrier(mailbox=box, learner_id=lid, poll_interval=0.1)
    barrier.wait("joined", parties=learners, timeout=float(job.get("join_timeout", 300)))
    join_s = time.monotonic() - joined_at
    _say(f"{lid}: all {learners} joined after {join_s:.1f} s; training {steps} steps")

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
    if job.get("save_params"):  # its own final model (Moshpit learners hold different ones)
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, job["save_params"])

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
    learners = int(job.get("learners", _lm.LEARNERS))
    size, steps = sizes.family(family)
    _, val = _lm.load_data(Path(job["data"]))
    box = open_box(job["mailbox"])
    model = _lm.build_model(size, sizes.context, sizes.seed + 1)  # not the initial values
    said = _AlignLog()
    log = logging.getLogger("gradientmail")
    log.addHandler(said)
    level = log.level
    if not log.isEnabledFor(logging.INFO):
        log.setLevel(logging.INFO)
    try:
        t = time.perf_counter()
        aligned_rounds = gm.align(model, mailbox=box)
        align_s = time.perf_counter() - t
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    final = _lm.evaluate(model, val)
    aligned = {n: p.detach().clone() for n, p in model.named_parameters()}
    if job.get("save"):
        torch.save(aligned, job["save"])
    result: dict[str, Any] = {
        "mode": "evaluate",
        "final_loss": final,
        "align_s": align_s,
        "aligned_rounds": {str(k): v for k, v in dict(aligned_rounds).items()},
        "align_log": said.messages,
        **_library(),
    }
    own = job.get("learner_params") or []
    if own:  # each learner's own final model (the spread of a Moshpit run's models)
        probe = _lm.build_model(size, sizes.context, sizes.seed)
        losses = []
        for path in own:
            _lm.load_params(probe, torch.load(path, weights_only=True))
            losses.append(_lm.evaluate(probe, val))
        result["learner_losses"] = losses
    if job.get("groups"):
        try:
            result.update(group_rounds(job, box, aligned, val, learners))
        except Exception as exc:  # the final loss stands; say why the rest is missing
            result["curve"] = []
            result["curve_error"] = f"{type(exc).__name__}: {exc}"
        return result
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
        per_step = learners * sizes.batch
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


class _AlignLog(logging.Handler):
    """What ``gm.align`` logs (for Moshpit: which group commits it loaded)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("align"):
            self.messages.append(message)


async def _group_commits(box: Any) -> dict[int, list[Any]]:
    """Every group commit of a Moshpit run, by group round (none swept: keep_rounds)."""
    from gradientmail import wire as p

    out: dict[int, list[Any]] = {}
    for key in await box.list(p.GROUP_ROUNDS):
        data = await box.get(key)
        if data is None:
            continue
        commit = p.decode_commit(key, data)
        out.setdefault(int(commit.round), []).append(commit)
    for commits in out.values():
        commits.sort(key=lambda c: c.group or "")
    return out


def group_rounds(
    job: Mapping[str, Any],
    box: Any,
    aligned: Mapping[str, torch.Tensor],
    val: torch.Tensor,
    learners: int,
) -> dict[str, Any]:
    """A Moshpit run's group rounds from its mailbox: each round's groups (members, closer,
    exclusions), and the loss curve: at each checkpoint, the sample-weighted average of the
    group commits of the newest group round at or before it (the round of local step ``s``
    is ``s // H``; before the first, the initial model), which is what ``gm.align`` loads
    at the end; ``align_matches_groups``: whether it did."""
    _, get_tensors = _decoders()
    sizes = _lm.Sizes.from_json(job["sizes"])
    size, steps = sizes.family(job["family"])
    h_every = int(job["sync_every"])
    by_round = asyncio.run(_group_commits(box))
    rounds = [
        {
            "round": t,
            "groups": [
                {
                    "group": c.group,
                    "members": [x.learner for x in c.contributors],
                    "samples": int(sum(x.samples for x in c.contributors)),
                    "closer": c.closer,
                    "attempt": int(c.attempt),
                    "excluded": [x.learner for x in c.excluded],
                }
                for c in commits
            ],
        }
        for t, commits in sorted(by_round.items())
    ]

    def average(t: int) -> dict[str, torch.Tensor]:
        commits = by_round[t]
        weights = [float(sum(x.samples for x in c.contributors)) for c in commits]
        total = sum(weights) or 1.0
        out: dict[str, torch.Tensor] = {}
        for c, w in zip(commits, weights, strict=True):
            tensors = asyncio.run(get_tensors(box, c.params))
            for name, value in tensors.items():
                term = value.float() * (w / total)
                out[name] = term if name not in out else out[name] + term
        return out

    probe = _lm.build_model(size, sizes.context, sizes.seed)
    initial = {n: q.detach().clone() for n, q in probe.named_parameters()}
    curve = []
    for s in sizes.checkpoint_steps(steps):
        done = [t for t in by_round if t <= s // h_every]
        _lm.load_params(probe, average(max(done)) if done else initial)
        curve.append((s * learners * sizes.batch, _lm.evaluate(probe, val)))
    result: dict[str, Any] = {"group_rounds": rounds, "curve": curve, "rounds": []}
    if by_round:
        newest = average(max(by_round))
        diff = max(
            float((aligned[n].float() - newest[n]).abs().max()) for n in aligned if n in newest
        )
        result["align_vs_groups_max_abs_diff"] = diff
        result["align_matches_groups"] = set(newest) == set(aligned) and diff <= 1e-5
    return result


# -- in-process arms -------------------------------------------------------------------------


def inprocess_n(
    arm: str,
    sizes: _lm.Sizes,
    shards: list[torch.Tensor],
    val: torch.Tensor,
    save: Path | None = None,
) -> dict[str, Any]:
    """``ddp`` (one model, batch N·B, the N learners' batches side by side) or
    ``solo-average`` (N copies that never sync, averaged at the end) over ``N =
    len(shards)`` learners (``_lm.run_inprocess`` has :data:`_lm.LEARNERS`), on the main
    model, evaluated at the checkpoints; ``solo-average`` also reports each copy's own
    final loss (``learner_losses``)."""
    n = len(shards)
    size, steps = sizes.family("main")
    checkpoints = set(sizes.checkpoint_steps(steps))
    batches = [_lm.Batches(shards[i], i, sizes.batch, sizes.context, sizes.seed) for i in range(n)]
    if arm == "ddp":
        copies = [_lm.build_model(size, sizes.context, sizes.seed)]
    elif arm == "solo-average":
        copies = [_lm.build_model(size, sizes.context, sizes.seed) for _ in range(n)]
    else:
        raise ValueError(f"unknown in-process arm {arm!r} for {n} learners")
    opts = [_lm.make_optimizer(c, sizes.lr) for c in copies]
    probe = _lm.build_model(size, sizes.context, sizes.seed)
    curve: list[tuple[int, float]] = []
    losses: list[float] = []
    eval_s = 0.0
    started = time.perf_counter()

    def averaged() -> torch.nn.Module:
        if len(copies) == 1:
            return copies[0]
        with torch.no_grad():
            for name, q in probe.named_parameters():
                q.copy_(torch.stack([dict(c.named_parameters())[name] for c in copies]).mean(0))
        return probe

    for s in range(1, steps + 1):
        lr = _lm.lr_at(s, steps, sizes.lr)
        if arm == "ddp":
            tokens = torch.cat([b.next() for b in batches])
            losses.append(_lm.train_step(copies[0], opts[0], tokens, lr))
        else:
            pairs = zip(copies, opts, batches, strict=True)
            losses.append(sum(_lm.train_step(c, o, b.next(), lr) for c, o, b in pairs) / n)
        if s in checkpoints:
            t = time.perf_counter()
            curve.append((s * n * sizes.batch, _lm.evaluate(averaged(), val)))
            eval_s += time.perf_counter() - t
            _say(f"{arm} ({n} learners): step {s}/{steps}, loss {curve[-1][1]:.4f}")
    wall = time.perf_counter() - started - eval_s
    final = averaged()
    if save is not None:
        torch.save({k: q.detach().clone() for k, q in final.named_parameters()}, save)
    result: dict[str, Any] = {
        "arm": arm,
        "family": "main",
        "learners": n,
        "final_loss": curve[-1][1],
        "curve": curve,
        "wall_s": wall,
        "train_loss": _lm.tail_mean(losses),
        "sync_points": 0,
        "rounds": 0,
        "extra": {},
    }
    if arm == "solo-average":
        result["learner_losses"] = [_lm.evaluate(c, val) for c in copies]
    return result


def inprocess(job: Mapping[str, Any]) -> dict[str, Any]:
    sizes = _lm.Sizes.from_json(job["sizes"])
    torch.set_num_threads(sizes.threads)
    shards, val = _lm.load_data(Path(job["data"]))
    if job.get("learners") is not None:
        save = Path(job["save"]) if job.get("save") else None
        assert len(shards) == int(job["learners"]), "one shard per learner"
        out = inprocess_n(job["arm"], sizes, shards, val, save)
        return {"mode": "inprocess", **out, **_library()}
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
