"""Resume (``Session(optimizer=...)``): a restarted learner continues its optimizer state and
its counters from its newest save in the mailbox, over every mailbox of the suite.

One learner per run (a run of its own, so every round holds it alone): its commits are its
parameters, so a restart's model equals the closed one's bit for bit, and the continuation
can be compared with training that never stopped.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import safetensors.torch
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.payload import decode, encode
from gradientmail.session._optstate import RESUME_ID, decode_state, encode_state
from gradientmail.wire.keys import resume_key, resume_prefix
from gradientmail.wire.resume import decode_resume
from tests.conftest import MAILBOXES
from tests.support.waiting import wait_until
from tests.training import make_model

ALGORITHM = gm.DiLoCo(sync_every=5, fragments=2)
BATCH = 16
STORES = [name for name, _ in MAILBOXES]

Factory = Callable[[torch.nn.Module], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9),
}


def _batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(BATCH, 8, generator=generator)
        yield x, x.sum(dim=1, keepdim=True)


def _train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]
) -> None:
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _session(
    box: gm.Mailbox, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any
) -> gm.Session:
    options.setdefault("poll_interval", 0.05)
    return gm.Session(
        model, algorithm=ALGORITHM, mailbox=box, learner_id="a", optimizer=optimizer, **options
    )


def _train(
    session: gm.Session,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
) -> list[int]:
    """``steps`` steps; the step numbers at which a sync point was reached."""
    reached = []
    for _ in range(steps):
        _train_step(model, optimizer, next(batches))
        before = session.counters().sync_points
        session.step(samples=BATCH)
        if session.counters().sync_points > before:
            reached.append(session.steps)
    return reached


def _same(a: Any, b: Any) -> bool:
    """Equal value for value and type for type (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _keys(box: gm.Mailbox, prefix: str) -> list[str]:
    return list(asyncio.run(box.list(prefix)))


def _get(box: gm.Mailbox, key: str) -> bytes:
    data = asyncio.run(box.get(key))
    assert data is not None, key
    return data


def _of(session: gm.Session, kind: type[gm.events.Event]) -> list[Any]:
    return [event for event in list(session.events) if isinstance(event, kind)]


def _strict_json(data: bytes) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(data, parse_constant=refuse)


# -- the codec ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*OPTIMIZERS, "sgd"])
def test_state_round_trips_exactly_and_continues_bit_identically(name: str) -> None:
    factory = OPTIMIZERS.get(name, lambda m: torch.optim.SGD(m.parameters(), lr=0.05))
    model = make_model(seed=1)
    optimizer = factory(model)
    # Values plain JSON would lose: a tuple, an infinity, a nan, int keys.
    optimizer.param_groups[0]["extra"] = (1, "x", float("inf"), float("nan"), None, [2.5])
    batches = _batches(seed=3)
    for _ in range(4):
        _train_step(model, optimizer, next(batches))
    before = optimizer.state_dict()
    tagged, tensors = encode_state(before)
    key, data = encode(tensors)  # the payload codec: safetensors bytes named by their hash
    record = json.dumps(tagged, allow_nan=False)  # strict JSON: no nan, no pickle
    twin = copy.deepcopy(model)
    restored = factory(twin)
    restored.load_state_dict(decode_state("k", json.loads(record), decode(key, data)))
    assert _same(restored.state_dict(), before)
    batch = next(batches)
    _train_step(model, optimizer, batch)
    _train_step(twin, restored, batch)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_state_that_cannot_be_stored_without_pickle_is_refused() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["hook"] = print
    with pytest.raises(TypeError, match=r"param_groups\.0\.hook is a builtin_function"):
        _session(gm.MemoryMailbox(), model, optimizer)


# -- saving and restoring through the mailbox ------------------------------------------------------


# Every store with one optimizer, every optimizer on one store: what the store holds is bytes
# (a record and a safetensors payload) whatever the optimizer, and how each optimizer's state
# is encoded and restored is the codec's, the same over every store (each optimizer's codec
# round trip is checked above); the full cross product repeated the S3 rejoins three times.
REJOINS = [
    *((store, "adam") for store in STORES),
    *(("memory", name) for name in OPTIMIZERS if name != "adam"),
]


@pytest.mark.parametrize(("mailbox", "name"), REJOINS, indirect=["mailbox"])
def test_rejoin_restores_the_state_and_continues_bit_identically(
    mailbox: gm.Mailbox, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    factory = OPTIMIZERS[name]
    model = make_model(seed=1)
    optimizer = factory(model)
    batches = _batches(seed=4)
    with _session(mailbox, model, optimizer) as session:
        first_life = _train(session, model, optimizer, batches, 23)
    before = copy.deepcopy(optimizer.state_dict())
    counted = session.counters()
    # Another process would start from its own initial values and a fresh optimizer, with
    # other hyperparameters even: the join loads the parameters, the resume the rest.
    twin = make_model(seed=7)
    fresh = factory(twin)
    fresh.param_groups[0]["lr"] = 0.5
    with caplog.at_level(logging.INFO, logger="gradientmail"):
        again = _session(mailbox, twin, fresh)
    try:
        assert _same(fresh.state_dict(), before)
        assert again.steps == 23
        restored = again.counters()
        assert (restored.sync_points, restored.published) == (
            counted.sync_points,
            counted.published,
        )
        (resumed,) = _of(again, gm.events.Resumed)
        assert (resumed.step, resumed.samples) == (23, 23 * BATCH)
        assert resumed.rounds == session.rounds
        assert f"resumed from {resumed.key}" in caplog.text
        assert "at step 23" in caplog.text
        for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        # The next step, uninterrupted and restored: the same parameters, bit for bit.
        batch = next(batches)
        _train_step(model, optimizer, batch)
        _train_step(twin, fresh, batch)
        for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        again.step(samples=BATCH)
        assert again.steps == 24
        # The sync schedule starts as a fresh learner's would, from the count it resumed:
        # its first contribution goes to the fragment whose next round comes first, as
        # many steps after the join as the first life's did after its own.
        reached = _train(again, twin, fresh, batches, ALGORITHM.sync_every)
        assert reached[0] - 23 == first_life[0], (reached, first_life)
        (published, *_) = _of(again, gm.events.Published)
        (joined_event,) = _of(again, gm.events.Joined)
        joined = joined_event.rounds
        assert published.fragment == min(range(ALGORITHM.fragments), key=lambda f: joined[f])
    finally:
        again.close()


def test_a_save_restores_the_same_state_every_time(mailbox: gm.Mailbox) -> None:
    """The restored optimizer updates its state in place: in memory of its own, never in
    the bytes read from the mailbox (a store may hand out the object it keeps)."""
    model = make_model(seed=1)
    optimizer = OPTIMIZERS["adam"](model)
    batches = _batches(seed=10)
    with _session(mailbox, model, optimizer) as session:
        _train(session, model, optimizer, batches, 9)
    saved = copy.deepcopy(optimizer.state_dict())
    for _ in range(2):
        twin = make_model(seed=3)
        fresh = OPTIMIZERS["adam"](twin)
        with _session(mailbox, twin, fresh) as again:
            assert _same(fresh.state_dict(), saved)
            for _ in range(3):  # optimizer steps only: no sync point, nothing saved
                _train_step(twin, fresh, next(batches))
            assert again.steps == 9
    assert len(_of(session, gm.events.ResumeSaved)) >= 1
    assert len(_keys(mailbox, resume_prefix("a"))) == 1


def test_saves_every_k_sync_points_and_keeps_only_the_newest(mailbox: gm.Mailbox) -> None:
    model = make_model(seed=1)
    optimizer = OPTIMIZERS["adam"](model)
    every = 3
    with _session(mailbox, model, optimizer, optimizer_every=every) as session:
        reached = _train(session, model, optimizer, _batches(seed=5), 42)
    captures = len(reached) // every
    assert captures >= 3, reached  # the test means something: several periodic saves
    saved = _of(session, gm.events.ResumeSaved)
    periodic = [event.step for event in saved[:-1]]
    # Every periodic save was taken at a K-th sync point (a copy not yet uploaded when the
    # next was taken would be replaced by it, never stored late); close() saved the end.
    assert set(periodic) <= set(reached[every - 1 :: every]), (periodic, reached)
    assert saved[-1].step == session.steps == 42
    # Numbered in the order taken: the periodic copies, then close()'s.
    assert saved[-1].key == resume_key("a", captures)
    assert _keys(mailbox, resume_prefix("a")) == [saved[-1].key]
    record = decode_resume(saved[-1].key, _get(mailbox, saved[-1].key))
    assert record.save == captures
    # Of the payloads, only the newest save's is left.
    resume_payloads = []
    for key in _keys(mailbox, p.BLOBS):
        data = _get(mailbox, key)
        if p.is_parts_key(key):
            continue
        if RESUME_ID in decode(key, data):
            resume_payloads.append(key)
    assert resume_payloads == [record.payload]


def test_sweeping_orphans_keeps_the_newest_save(mailbox: gm.Mailbox) -> None:
    """``gradientmail sweep --orphans`` deletes payloads no record names: a resume record
    names its payload, so the newest save stays readable (and a restart resumes from it)."""
    from gradientmail.cli.housekeeping import plan_sweep

    model = make_model(seed=1)
    optimizer = OPTIMIZERS["adam"](model)
    with _session(mailbox, model, optimizer) as session:
        _train(session, model, optimizer, _batches(seed=5), 12)
    (key,) = _keys(mailbox, resume_prefix("a"))
    payload = decode_resume(key, _get(mailbox, key)).payload
    plan = asyncio.run(plan_sweep(mailbox, "mailbox", keep_rounds=1, orphans=True))
    doomed = plan.keys()
    assert p.blob_key(payload) not in doomed
    assert plan.payloads  # the sweep does delete orphans: old rounds' payloads
    asyncio.run(mailbox.delete(doomed))
    twin = make_model(seed=3)
    fresh = OPTIMIZERS["adam"](twin)
    with _session(mailbox, twin, fresh) as again:
        assert again.steps == session.steps == 12
        assert _same(fresh.state_dict(), optimizer.state_dict())


def test_a_crash_restores_the_newest_periodic_save(mailbox: gm.Mailbox) -> None:
    model = make_model(seed=1)
    optimizer = OPTIMIZERS["sgd-momentum"](model)
    batches = _batches(seed=6)
    session = _session(mailbox, model, optimizer, optimizer_every=1)
    reached: list[int] = []
    expected: dict[str, Any] = {}

    def train_then_crash() -> None:
        with session:
            reached.extend(_train(session, model, optimizer, batches, 12))
            wait_until(
                lambda: any(e.step == reached[-1] for e in _of(session, gm.events.ResumeSaved)),
                "the newest periodic save to be stored",
            )
            # The state at the last sync point (no step since).
            expected.update(copy.deepcopy(optimizer.state_dict()))
            assert session.steps == reached[-1]
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train_then_crash()  # leaves without close(): nothing saved at the end
    assert not [e for e in _of(session, gm.events.ResumeSaved) if e.step > reached[-1]]
    twin = make_model(seed=9)
    fresh = OPTIMIZERS["sgd-momentum"](twin)
    with _session(mailbox, twin, fresh) as again:
        joined = again.rounds
        assert again.steps == reached[-1]
        assert _same(fresh.state_dict(), expected)
        _train(again, twin, fresh, batches, 10)
    # The restarted life's contributions carry its own samples, each once per fragment (not
    # the samples counted before the crash again).
    after = [0] * ALGORITHM.fragments
    for key in _keys(mailbox, p.ROUNDS):
        commit = p.decode_commit(key, _get(mailbox, key))
        if commit.round > joined[commit.fragment]:
            after[commit.fragment] += commit.samples
    assert after == [10 * BATCH] * ALGORITHM.fragments


@pytest.mark.parametrize("damage", ["payload", "record"])
def test_a_save_that_cannot_be_read_starts_fresh_with_a_warning(
    mailbox: gm.Mailbox, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_model(seed=1)
    optimizer = OPTIMIZERS["adam"](model)
    batches = _batches(seed=7)
    with _session(mailbox, model, optimizer) as session:
        _train(session, model, optimizer, batches, 8)
    (key,) = _keys(mailbox, resume_prefix("a"))
    record = decode_resume(key, _get(mailbox, key))
    target = record.payload if damage == "payload" else key
    asyncio.run(mailbox.delete([target]))
    assert asyncio.run(mailbox.put_if_absent(target, b"\x00not what was stored"))
    twin = make_model(seed=2)
    fresh = OPTIMIZERS["adam"](twin)
    with caplog.at_level(logging.WARNING, logger="gradientmail"):
        again = _session(mailbox, twin, fresh)
    with again:
        (failed,) = _of(again, gm.events.ResumeFailed)
        assert failed.key == key
        assert ("corrupt" if damage == "payload" else "unreadable") in failed.error
        assert f"could not resume from {key}" in caplog.text
        assert not _of(again, gm.events.Resumed)
        assert fresh.state_dict()["state"] == {}  # nothing loaded, not even in part
        assert again.steps == 0
        _train(again, twin, fresh, batches, 6)  # trains on: never wedged
    # Its next save numbers on past the unreadable one, and the sweep took that away.
    (newest,) = _keys(mailbox, resume_prefix("a"))
    assert decode_resume(newest, _get(mailbox, newest)).save == record.save + 1
    if damage == "payload":
        assert asyncio.run(mailbox.get(record.payload)) is None


def test_an_optimizer_that_does_not_match_is_refused_naming_the_difference(
    mailbox: gm.Mailbox,
) -> None:
    model = make_model(seed=1)
    optimizer = OPTIMIZERS["adam"](model)
    with _session(mailbox, model, optimizer) as session:
        _train(session, model, optimizer, _batches(seed=8), 6)
    twin = make_model(seed=1)
    other = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"torch\.optim\.adam\.Adam, this optimizer is a "):
        _session(mailbox, twin, other)
    assert other.state_dict()["state"] == {}
    weights, biases = list(twin.parameters())[0::2], list(twin.parameters())[1::2]
    grouped = torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 0.1}])
    with pytest.raises(ValueError, match=r"1 parameter group\(s\), this optimizer 2"):
        _session(mailbox, twin, grouped)
    reordered = torch.optim.Adam(list(reversed(list(twin.parameters()))))
    with pytest.raises(ValueError, match="parameter 0 of group 0 is"):
        _session(mailbox, twin, reordered)
    # Refused before it went live: the right optimizer joins at once, and resumes.
    right = OPTIMIZERS["adam"](twin)
    with _session(mailbox, twin, right) as again:
        assert again.steps == 6


def test_nothing_is_pickled(mailbox: gm.Mailbox, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickled")

    for module, name in ((torch, "save"), (torch, "load"), (pickle, "dumps"), (pickle, "loads")):
        monkeypatch.setattr(module, name, refuse)
    model = make_model(seed=1)
    optimizer = OPTIMIZERS["adam"](model)
    with _session(mailbox, model, optimizer) as session:
        _train(session, model, optimizer, _batches(seed=9), 7)
    (key,) = _keys(mailbox, resume_prefix("a"))
    wire = _strict_json(_get(mailbox, key))
    assert wire["optimizer"] == "torch.optim.adam.Adam"
    assert wire["step"] == 7
    payload = _get(mailbox, wire["payload"])
    assert not payload.startswith(b"\x80")  # no pickle protocol header
    tensors = safetensors.torch.load(payload)  # plain safetensors
    assert bytes(tensors[RESUME_ID].tolist()) == key.encode()
    state = optimizer.state_dict()["state"]
    for index, values in state.items():
        for name, value in values.items():
            assert torch.equal(tensors[f"state.{index}.{name}"], value)
    twin = make_model(seed=2)
    fresh = OPTIMIZERS["adam"](twin)
    with _session(mailbox, twin, fresh):
        assert _same(fresh.state_dict(), optimizer.state_dict())
    assert session.steps == 7


def test_settings_are_checked() -> None:
    model = make_model()
    box = gm.MemoryMailbox()
    with pytest.raises(ValueError, match="optimizer_every must be an int >= 1"):
        _session(box, model, OPTIMIZERS["adam"](model), optimizer_every=0)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        _session(box, model, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not the model's"):
        _session(box, model, OPTIMIZERS["adam"](make_model()))
    assert _keys(box, "") == []  # refused before anything was written
