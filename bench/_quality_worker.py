"""The quality benchmark's processes, one JSON job each: ``python -m bench._quality_worker
JOB.json`` (``mode``; the result goes to ``out``, JSON):

- ``learner``: one learner through ``gm.Session`` on the given mailbox (a ``gm.Barrier``
  until all ``learners`` joined, the quorum), training its own shard, then ``close()``; its
  counters, time in ``step()``, sync points reached and skipped, each commit's lag in inner
  steps, its algorithm's settings (``make_algorithm``); ``save_params`` keeps its own model.
  ``dtype``: the model's parameters (``bfloat16``). ``ranks`` > 1: this process is rank
  ``rank`` of a learner of that many (a gloo group on ``port``, the model in
  ``DistributedDataParallel``, its slice of the learner's batch; the Session on every rank,
  the barrier on rank 0 only), and reports the digest of its final parameters.
- ``evaluate``: as a user would, after the learners finished: ``gm.align`` into a fresh model
  and its validation loss; the loss curve from the run's commits (a Moshpit run's from its
  group rounds: :func:`group_rounds`); the learners' own final models (``learner_params``).
- ``inprocess``: an arm computed in one process (``_lm.run_inprocess``).

Every mode runs ``torch.set_num_threads(sizes.threads)`` and records which ``gradientmail``
it imported. ``torch._dynamo`` is imported with this module, so once in the job server that
preloads it (``bench._procs``): the first optimizer a process makes imports it (~800
modules, ~1.2 CPU-s), which each of a run's jobs paid again before (it starts no thread, so
nothing crosses the server's forks).
"""

from __future__ import annotations

import asyncio
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
import torch._dynamo

from bench import _lm
from gradientmail.demo import lm
from gradientmail.payload import get_tensors
from gradientmail.wire import GROUP_ROUNDS, decode_commit


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
    """Every field of a ``Counters``, plus the totals of ``bytes_up``, ``bytes_down`` and
    ``requests`` (summed over key kinds)."""
    out = dataclasses.asdict(counters)
    for name in ("bytes_up", "bytes_down", "requests"):
        out[f"{name}_total"] = int(sum(out[name].values()))
    plain: dict[str, Any] = json.loads(json.dumps(out, default=repr))
    return plain


# -- learner ---------------------------------------------------------------------------------


def make_algorithm(gm: Any, spec: Mapping[str, Any] | None, h_every: int, fragments: int) -> Any:
    """The learner's algorithm: ``gm.DiLoCo(sync_every=H, fragments=F)`` without ``spec``; else
    ``spec["name"]`` (diloco, sparseloco, moshpit: no fragments) with ``spec["settings"]`` and
    ``spec["compression"]`` (a compressor's settings: ``{"name": "topk", "density": 0.02}``),
    read as a manifest's settings are."""
    from gradientmail.algorithms.base import from_manifest

    spec = spec or {}
    name = spec.get("name", "diloco")
    if name == "moshpit" and spec.get("compression"):
        raise ValueError("Moshpit takes no compression")
    values = {"name": name, "sync_every": h_every, **(spec.get("settings") or {})}
    if name != "moshpit":
        values["fragments"] = fragments
    if spec.get("compression"):
        values["compression"] = spec["compression"]
    return from_manifest(values)


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
    model = _lm.build_model(size, sizes, job.get("dtype") or "float32")
    optimizer = lm.make_optimizer(model, sizes.lr)
    batches = lm.Batches(shards[index], index, sizes.batch, sizes.context, sizes.seed)
    rank, ranks = int(job.get("rank", 0)), int(job.get("ranks", 1))
    trained: torch.nn.Module = model
    if ranks > 1:  # one rank of a DDP learner: its slice of the learner's batch
        from torch.nn.parallel import DistributedDataParallel

        _lm.join_ranks(rank, ranks, int(job["port"]), float(job["timeout"]))
        trained = DistributedDataParallel(model)
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
    session = gm.Session(trained, **kwargs)  # every rank: rank 0 talks to the mailbox
    if rank == 0:  # the other ranks wait in their first collective
        barrier = gm.Barrier(mailbox=box, learner_id=lid, poll_interval=0.1)
        barrier.wait("joined", parties=learners, timeout=float(job.get("join_timeout", 300)))
    join_s = time.monotonic() - joined_at
    _say(f"{lid}: all {learners} joined after {join_s:.1f} s; training {steps} steps")

    due = {algorithm.offset(f): f for f in range(fragments)}
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
        tokens = _lm.rank_slice(batches.next(), rank, ranks)
        losses.append(lm.train_step(trained, optimizer, tokens, lm.lr_at(s, steps, sizes.lr)))
        f = due.get(s % h_every)
        skipped_before = session.counters().skipped_syncs if f is not None else 0
        before = session.rounds
        t = time.perf_counter()
        session.step(samples=len(tokens))  # this rank's: the learner counts all ranks'
        took = time.perf_counter() - t
        step_s += took
        step_max = max(step_max, took)
        slow_calls += took > 0.01
        after = session.rounds
        for b, a in zip(before, after, strict=True):
            if a != b:
                applied_at.setdefault(a, s)
        if f is not None:
            if session.counters().skipped_syncs > skipped_before:
                skipped_at.append(s)
            else:
                due_steps.append((s, f, after[f]))
        if s % max(1, steps // 4) == 0:
            _say(f"{lid}: step {s}/{steps}, train loss {losses[-1]:.3f}")
    train_s = time.perf_counter() - started
    t = time.perf_counter()
    session.close(timeout=max(10.0, deadline - time.monotonic()))
    close_s = time.perf_counter() - t
    counters = session.counters()
    if job.get("save_params"):  # its own final model (Moshpit learners hold different ones)
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, job["save_params"])
    digest = _lm.params_digest(model) if ranks > 1 else None
    if ranks > 1:
        import torch.distributed as dist

        dist.destroy_process_group()

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
        "rank": rank,
        "ranks": ranks,
        "params_digest": digest,
        "steps": steps,
        "samples": steps * sizes.batch,  # the learner's, over all its ranks
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


def evaluate(job: Mapping[str, Any]) -> dict[str, Any]:
    import gradientmail as gm

    sizes = _lm.Sizes.from_json(job["sizes"])
    torch.set_num_threads(sizes.threads)
    size, _ = sizes.family(job["family"])
    _, val = _lm.load_data(Path(job["data"]))
    box = open_box(job["mailbox"])
    model = _lm.build_model(size, sizes, job.get("dtype") or "float32", 1)  # not the initial
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
    aligned = {n: p.detach().clone() for n, p in model.named_parameters()}
    if job.get("save"):
        torch.save(aligned, job["save"])
    result: dict[str, Any] = {
        "mode": "evaluate",
        "final_loss": lm.evaluate(model, val),
        "align_s": align_s,
        "aligned_rounds": {str(k): v for k, v in dict(aligned_rounds).items()},
        "align_log": said.messages,
        **_library(),
    }
    own = job.get("learner_params") or []
    if own:  # each learner's own final model (the spread of a Moshpit run's models)
        probe = _lm.build_model(size, sizes, job.get("dtype") or "float32")
        losses = []
        for path in own:
            lm.load_params(probe, torch.load(path, weights_only=True))
            losses.append(lm.evaluate(probe, val))
        result["learner_losses"] = losses
    try:
        curve = group_rounds if job.get("groups") else commit_curve
        result.update(curve(job, box, aligned, val))
    except Exception as exc:  # the final loss stands; say why the curve is missing
        result["curve"] = []
        result["curve_error"] = f"{type(exc).__name__}: {exc}"
    return result


def commit_curve(
    job: Mapping[str, Any], box: Any, aligned: Mapping[str, torch.Tensor], val: torch.Tensor
) -> dict[str, Any]:
    """The run's rounds (``rounds/``, none swept) and the loss curve: per checkpoint, the
    newest commit of each fragment whose samples (cumulative over that fragment's rounds)
    are at most the samples trained by then; whether ``gm.align`` loaded the newest."""
    sizes = _lm.Sizes.from_json(job["sizes"])
    size, steps = sizes.family(job["family"])
    fragments: int = job["fragments"]
    learners = int(job.get("learners", _lm.LEARNERS))

    async def commits() -> list[Any]:
        keys = await box.list("rounds/")
        return sorted([decode_commit(k, await box.get(k)) for k in keys], key=lambda c: c.round)

    per_fragment: dict[int, list[tuple[int, Any]]] = {}
    cumulative = [0] * fragments
    rounds = []
    for c in asyncio.run(commits()):
        f = int(c.fragment)
        samples = int(sum(x.samples for x in c.contributors))
        cumulative[f] += samples
        per_fragment.setdefault(f, []).append((cumulative[f], c))
        if c.contributors:
            info = {"round": int(c.round), "fragment": f, "contributors": len(c.contributors)}
            rounds.append(info | {"samples": samples})
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def fetch(key: str) -> dict[str, torch.Tensor]:
        if key not in cache:
            cache[key] = {n: t.clone() for n, t in asyncio.run(get_tensors(box, key)).items()}
        return cache[key]

    curve = []
    probe = _lm.build_model(size, sizes, job.get("dtype") or "float32")  # loads round
    for s in sizes.checkpoint_steps(steps):
        x = s * learners * sizes.batch
        for f in range(fragments):
            chosen = [c for cum, c in per_fragment.get(f, []) if cum <= x]
            if chosen:
                lm.load_params(probe, fetch(chosen[-1].params))
        curve.append((x, lm.evaluate(probe, val)))
        if len(cache) > 4 * fragments:  # bounded memory: older payloads are not reused
            for key in list(cache)[: -2 * fragments]:
                del cache[key]
    newest: dict[str, torch.Tensor] = {}
    for f in range(fragments):
        if per_fragment.get(f):
            newest.update(fetch(per_fragment[f][-1][1].params))
    # A commit's globals are float32; what align loads is them rounded to the model's dtype.
    same = all(
        torch.equal(aligned[n], newest[n].to(aligned[n].dtype)) for n in aligned if n in newest
    )
    return {
        "rounds": rounds,
        "samples_committed": cumulative,
        "align_equals_newest": same and set(newest) == set(aligned),
        "curve": curve,
    }


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
    out: dict[int, list[Any]] = {}
    for key in await box.list(GROUP_ROUNDS):
        data = await box.get(key)
        if data is None:
            continue
        commit = decode_commit(key, data)
        out.setdefault(int(commit.round), []).append(commit)
    for commits in out.values():
        commits.sort(key=lambda c: c.group or "")
    return out


def group_rounds(
    job: Mapping[str, Any], box: Any, aligned: Mapping[str, torch.Tensor], val: torch.Tensor
) -> dict[str, Any]:
    """A Moshpit run's group rounds from its mailbox: each round's groups (members, closer,
    exclusions), and the loss curve: at each checkpoint, the sample-weighted average of the
    group commits of the newest group round at or before it (the round of local step ``s``
    is ``s // H``; before the first, the initial model), which is what ``gm.align`` loads
    at the end; ``align_matches_groups``: whether it did."""
    sizes = _lm.Sizes.from_json(job["sizes"])
    size, steps = sizes.family(job["family"])
    h_every = int(job["sync_every"])
    learners = int(job.get("learners", _lm.LEARNERS))
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

    probe = lm.build_model(size, sizes.context, sizes.seed)
    initial = {n: q.detach().clone() for n, q in probe.named_parameters()}
    curve = []
    for s in sizes.checkpoint_steps(steps):
        done = [t for t in by_round if t <= s // h_every]
        lm.load_params(probe, average(max(done)) if done else initial)
        curve.append((s * learners * sizes.batch, lm.evaluate(probe, val)))
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
        dtype=job.get("dtype") or "float32",
        ranks=job.get("ranks", 1),
        tail=job.get("tail", False),
        save=Path(job["save"]) if job.get("save") else None,
        progress=_say,
    )
    return {"mode": "inprocess", **result, **_library()}


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
