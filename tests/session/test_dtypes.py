"""Models in any floating dtype sync exactly: bfloat16, float16 and mixed models through
Session, the closer, verify, align and resume.

The outer state (a commit's global parameters and the outer momentum) is kept in float32
whatever the parameters' dtype (a bfloat16 global rounds small outer steps away); what a
learner loads is the float32 global rounded to its parameter's dtype by ``Tensor.to``
(round to nearest, ties to even), so ``verify`` recomputes every commit bit for bit. A
float32 model's commits are the bytes they were before float32 outer state existed.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.algorithms.contribution import encode_contribution
from gradientmail.engine.layout import ModelLayout
from gradientmail.payload import get_tensors, payload_key
from tests.support.waiting import TEST_TIMEOUT
from tests.training import commits, verify_all

ALGORITHM = gm.DiLoCo(sync_every=5, fragments=2)
STEPS = 20


def _model(dtypes: tuple[torch.dtype, torch.dtype], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    first, second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
    return torch.nn.Sequential(first.to(dtypes[0]), _Cast(dtypes[1]), second.to(dtypes[1]))


class _Cast(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).to(self.dtype)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)  # state to resume


def _session(
    name: str, model: torch.nn.Module, box: gm.Mailbox, optimizer: torch.optim.Optimizer
) -> gm.Session:
    return gm.Session(
        model,
        algorithm=ALGORITHM,
        mailbox=box,
        learner_id=name,
        poll_interval=0.02,
        round_timeout=30.0,
        wait_timeout=60.0,
        keep_rounds=10_000,
        optimizer=optimizer,
    )


def _train(
    name: str,
    model: torch.nn.Module,
    box: gm.Mailbox,
    start: threading.Barrier,
    sessions: dict[str, gm.Session],
    optimizers: dict[str, torch.optim.Optimizer],
    errors: list[BaseException],
) -> None:
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(hash(name) % 1000)
    optimizers[name] = optimizer = _optimizer(model)
    try:
        with _session(name, model, box, optimizer) as session:
            sessions[name] = session
            start.wait(timeout=TEST_TIMEOUT)
            for _ in range(STEPS):
                x = torch.randn(16, 8, generator=generator)
                y = x.sum(dim=1, keepdim=True)
                out = model(x.to(dtype))
                loss = ((out.float() - y) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                session.step(samples=16)
    except BaseException as exc:
        errors.append(exc)
        start.abort()


DTYPES = {
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "mixed": (torch.bfloat16, torch.float32),
}


@pytest.mark.parametrize("kind", list(DTYPES))
def test_two_learners_of_a_low_precision_model_sync_every_sync_point(kind: str) -> None:
    box = gm.MemoryMailbox()
    models = {f"l{i}": _model(DTYPES[kind], seed=i) for i in range(2)}
    sessions: dict[str, gm.Session] = {}
    optimizers: dict[str, torch.optim.Optimizer] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(models))
    threads = [
        threading.Thread(
            target=_train, args=(name, model, box, start, sessions, optimizers, errors)
        )
        for name, model in models.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TEST_TIMEOUT * 4)
    assert not any(t.is_alive() for t in threads), "a learner is stuck"
    assert not errors, errors
    for name, session in sessions.items():
        c = session.counters()
        # Every sync point of the 20 steps (4 per learner, close()'s too) was contributed
        # and waited for: none gave up, none was skipped.
        assert c.wait_timeouts == 0, (name, c)
        assert c.skipped_syncs == 0, (name, c)
    history = commits(box)
    training = [c for c in history if c.base is not None]
    assert len(training) >= STEPS // ALGORITHM.sync_every, [c.round for c in history]
    verified = verify_all(box)  # raises on a commit that does not recompute bit for bit
    assert [v.round for v in verified] == [c.round for c in history]
    assert not any(v.excluded for v in verified), verified
    # The status names the dtypes the rounds carry.
    view = asyncio.run(gm.inspect.inspect_run(box))
    assert view.dtypes == tuple(sorted({str(d).removeprefix("torch.") for d in DTYPES[kind]}))
    assert view.compression == f"none ({', '.join(view.dtypes)})"
    # Every commit stores float32 globals (the model's dtypes are the manifest's), and the
    # manifest says so; a training round's globals are finer than the model's dtype.
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(box.get(p.MANIFEST)))
    assert manifest.to_wire()["outer_dtype"] == "torch.float32"
    newest: dict[str, torch.Tensor] = {}
    for c in history:
        stored = asyncio.run(get_tensors(box, c.params))
        assert {str(t.dtype) for t in stored.values()} == {"torch.float32"}, c.round
        newest.update(stored)
    low = [n for n, q in models["l0"].named_parameters() if q.dtype != torch.float32]
    assert any(not torch.equal(newest[n], newest[n].to(dtype=DTYPES[kind][0]).float()) for n in low)
    # align loads the models' own dtypes: the float32 globals rounded by Tensor.to; both
    # learners end on the newest commits, rounded the same way.
    aligned = _model(DTYPES[kind], seed=5)
    gm.align(aligned, mailbox=box)
    want = {n: q.dtype for n, q in models["l0"].named_parameters()}
    assert {n: q.dtype for n, q in aligned.named_parameters()} == want
    for name, value in aligned.named_parameters():
        assert torch.equal(value.detach(), newest[name].to(dtype=value.dtype)), name
    for model in models.values():
        for (name, mine), theirs in zip(
            model.named_parameters(), aligned.parameters(), strict=True
        ):
            assert torch.equal(mine.detach(), theirs.detach()), name
    # Resume: a restarted l0 (a fresh model and optimizer) loads the rounded globals and
    # its optimizer's state, in the model's dtypes.
    twin = _model(DTYPES[kind], seed=9)
    fresh = _optimizer(twin)
    with _session("l0", twin, box, fresh) as again:
        assert [type(e) for e in again.events if isinstance(e, gm.events.Resumed)]
        assert again.steps == STEPS
    for (name, mine), theirs in zip(twin.named_parameters(), aligned.parameters(), strict=True):
        assert torch.equal(mine.detach(), theirs.detach()), name
    saved = optimizers["l0"].state_dict()["state"]
    for index, state in fresh.state_dict()["state"].items():
        before = saved[index]["momentum_buffer"]
        assert torch.equal(state["momentum_buffer"], before), index
        assert state["momentum_buffer"].dtype == before.dtype


def test_a_learner_whose_dtypes_differ_from_the_run_is_refused_naming_the_tensor() -> None:
    box = gm.MemoryMailbox()
    with gm.Session(
        _model((torch.bfloat16, torch.float32)), algorithm=ALGORITHM, mailbox=box, learner_id="a"
    ):
        with pytest.raises(gm.ProtocolError, match=r"2\.weight: run has torch\.float32"):
            gm.Session(
                _model((torch.bfloat16, torch.bfloat16)),
                algorithm=ALGORITHM,
                mailbox=box,
                learner_id="b",
            )


ULP = 2.0**-7  # bfloat16's spacing in [1, 2): every value 1 + k·ULP there is exact
STALL = gm.DiLoCo(sync_every=1, fragments=1, outer_lr=0.1, outer_momentum=0.0, nesterov=False)
ROUNDS = 12


def _reference(dtype: torch.dtype, outer: torch.dtype) -> dict[str, torch.Tensor]:
    """The in-process reference of the run below, with the globals kept in ``outer`` (the
    rule of this release: float32; of the releases before it: the model's ``dtype``): the
    learner loads the global rounded to ``dtype``, steps every weight up by one ULP and
    contributes; the last globals."""
    globals_ = {n: torch.ones(s, dtype=outer) for n, s in (("weight", (1, 4)), ("bias", (1,)))}
    momentum = None
    for _ in range(ROUNDS):
        local = {n: g.to(dtype=dtype).add(ULP) for n, g in globals_.items()}
        globals_, momentum = STALL.combine(globals_, momentum, [("a", 1, local)])
    return globals_


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_small_outer_steps_move_float32_globals_where_model_dtype_globals_stall(
    dtype: torch.dtype,
) -> None:
    # One learner whose every inner step moves each weight up by one bfloat16 ULP; the outer
    # step (outer_lr 0.1) moves the global a tenth of that per round.
    box = gm.MemoryMailbox()
    model = torch.nn.Linear(4, 1).to(dtype)
    with torch.no_grad():
        for value in model.parameters():
            value.fill_(1.0)
    with gm.Session(
        model, algorithm=STALL, mailbox=box, learner_id="a", poll_interval=0.02, keep_rounds=10_000
    ) as session:
        for _ in range(ROUNDS):
            with torch.no_grad():
                for value in model.parameters():
                    value.add_(ULP)
            session.step(samples=1)
    history = commits(box)
    assert len(history) == ROUNDS + 1, [c.round for c in history]
    verify_all(box)
    got = asyncio.run(get_tensors(box, history[-1].params))
    new, old = _reference(dtype, torch.float32), _reference(dtype, dtype)
    # The run's newest commit is the reference's float32 globals, byte for byte.
    assert history[-1].params == payload_key(new)
    assert all(torch.equal(got[n], new[n]) for n in new)
    if dtype == torch.float32:
        # Nothing changed for a float32 model: the globals stored in the model's dtype
        # (the rule before float32 outer state) are the same bytes.
        assert payload_key(old) == payload_key(new)
        return
    # bfloat16 globals round every outer step (a tenth of a ULP) back to 1.0: they never
    # move. The float32 globals accumulate the steps, and the model moved with them.
    assert all(torch.equal(t, torch.ones_like(t)) for t in old.values()), old
    assert all(bool((t > 1.0 + ULP / 2).all()) for t in new.values()), new
    for name, value in model.named_parameters():
        assert bool((value > 1.0).all()), name
    # Loaded as the rule says: what the learner holds after its last commit (it made no
    # step since) is the float32 global rounded to bfloat16.
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), new[name].to(dtype=dtype)), name


def _manifest(dtype: str) -> p.Manifest:
    spec = p.TensorSpec("w", (2,), dtype)
    return p.Manifest("a", ALGORITHM.settings(), ((spec,),))


def test_the_manifest_says_commits_are_float32_and_refuses_a_run_of_the_old_rule() -> None:
    # A float32 model's manifest is what it was (its commits are the same bytes).
    plain = _manifest("torch.float32")
    assert "outer_dtype" not in plain.to_wire()
    assert p.decode_manifest(p.MANIFEST, p.encode(plain)) == plain
    # A bfloat16 model's says so, and reads back.
    low = _manifest("torch.bfloat16")
    assert low.to_wire()["outer_dtype"] == "torch.float32"
    assert p.decode_manifest(p.MANIFEST, p.encode(low)) == low
    # Without it, the run was created by a release that stored its commits in the model's
    # dtypes: refused by name, never misread.
    old = dict(low.to_wire())
    del old["outer_dtype"]
    with pytest.raises(gm.ProtocolError, match=r"stored commits in the model's dtypes \(torch"):
        p.decode_manifest(p.MANIFEST, json.dumps(old).encode())
    other = {**low.to_wire(), "outer_dtype": "torch.float64"}
    with pytest.raises(gm.ProtocolError, match=r"commits store torch\.float64"):
        p.decode_manifest(p.MANIFEST, json.dumps(other).encode())


def test_the_reference_sums_a_compressed_round_of_low_precision_buffers_on_float32_globals() -> (
    None
):
    # The reference's globals are float32 while a bfloat16 buffer travels dense in bfloat16.
    algorithm = gm.DiLoCo(compression=gm.Cast("bfloat16"), outer_lr=1.0, outer_momentum=0.0)
    base = {"w": torch.zeros(4), "mean": torch.zeros(4)}
    local = {
        "w": torch.full((4,), 0.5, dtype=torch.bfloat16),
        "mean": torch.ones(4, dtype=torch.bfloat16),
    }
    payload, _ = encode_contribution(algorithm.compression, 1.0, local, base, None, {"mean"})
    params, _ = algorithm.combine(base, None, [("a", 1, payload)], buffer_names={"mean"})
    assert torch.equal(params["w"], torch.full((4,), 0.5))  # float32 globals, stepped
    assert torch.equal(params["mean"], torch.ones(4))
    assert {t.dtype for t in params.values()} == {torch.float32}


def test_a_rebase_or_mix_onto_float32_globals_rounds_once() -> None:
    model = torch.nn.Linear(2, 1).to(torch.bfloat16)
    layout = ModelLayout(model, gm.DiLoCo(sync_every=2, fragments=1))
    with torch.no_grad():
        for value in model.parameters():
            value.fill_(1.0)
    anchor = {n: t.clone() for n, t in layout.copy_out(0).items()}
    new = {n: torch.full(t.shape, 1.0 + 0.6 * ULP) for n, t in anchor.items()}
    # No local progress since the anchor: the learner holds the global rounded by the rule
    # (in bfloat16 steps, 1 + (1 + 0.6 ULP) would round to 2 first, then back to 1).
    layout.rebase(0, new, anchor)
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), new[name].to(dtype=torch.bfloat16)), name
        assert bool((value > 1.0).all()), name
    layout.mix(0, new, 0.0)  # all the global's: the rounded global again
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), new[name].to(dtype=torch.bfloat16)), name
