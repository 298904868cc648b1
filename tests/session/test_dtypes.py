"""Models in any floating dtype sync exactly: bfloat16, float16 and mixed models through
Session, the closer, verify and align.

The outer state (the outer momentum) is kept in float32 whatever the parameters' dtype (a
bfloat16 pseudo-gradient of small steps rounds to zero); a commit's parameters are stored
in the model's own dtypes, rounded from the float32 outer step by ``Tensor.to`` (round to
nearest even), so ``verify`` recomputes them bit for bit.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import gradientmail as gm
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


def _train(
    name: str,
    model: torch.nn.Module,
    box: gm.Mailbox,
    start: threading.Barrier,
    sessions: dict[str, gm.Session],
    errors: list[BaseException],
) -> None:
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(hash(name) % 1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        with gm.Session(
            model,
            algorithm=ALGORITHM,
            mailbox=box,
            learner_id=name,
            poll_interval=0.02,
            round_timeout=30.0,
            wait_timeout=60.0,
            keep_rounds=10_000,
        ) as session:
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
    errors: list[BaseException] = []
    start = threading.Barrier(len(models))
    threads = [
        threading.Thread(target=_train, args=(name, model, box, start, sessions, errors))
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
    # The commits hold the model's own dtypes; both learners end on the newest commits.
    aligned = _model(DTYPES[kind], seed=5)
    gm.align(aligned, mailbox=box)
    want = {n: p.dtype for n, p in models["l0"].named_parameters()}
    assert {n: p.dtype for n, p in aligned.named_parameters()} == want
    for model in models.values():
        for (name, mine), theirs in zip(
            model.named_parameters(), aligned.parameters(), strict=True
        ):
            assert torch.equal(mine.detach(), theirs.detach()), name


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
