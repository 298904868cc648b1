"""Compressed contributions through the round engine (``algorithms/contribution.py``).

- every commit of a compressed run recomputes bit for bit (``verify``), for each kind of
  compressor, with DiLoCo's momentum and with SparseLoCo;
- each learner's model is the newest commit exactly, and SparseLoCo's learners compute the
  commits they did not close from the contributions instead of downloading parameters;
- error feedback conserves what was not sent; a corrupt contribution is excluded naming
  its key; the settings live in the manifest and a joiner that differs is refused;
- a restarted learner gets its error feedback back with its optimizer state.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.algorithms import from_manifest
from gradientmail.algorithms.contribution import add_contribution, encode_contribution
from gradientmail.cli.table import view_json
from gradientmail.engine.sums import Member, Unusable, weighted_sums
from gradientmail.errors import PayloadCorrupt
from gradientmail.inspect import RunWatcher
from gradientmail.payload import get_tensors, put_tensors
from tests.training import Learner, commits, failures, make_model, run_learners, verify_all

ALGORITHMS = {
    "sparseloco-topk": gm.SparseLoCo(
        sync_every=5, compression=gm.TopK(density=0.1, bits=2, chunk=64)
    ),
    "sparseloco-int8-2f": gm.SparseLoCo(sync_every=6, fragments=2, compression=gm.Quantize(bits=8)),
    "diloco-topk-2f": gm.DiLoCo(
        sync_every=6, fragments=2, compression=gm.TopK(density=0.1, bits=4, chunk=64)
    ),
    "diloco-bf16": gm.DiLoCo(sync_every=5, compression=gm.Cast("bfloat16")),
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_compressed_commits_verify_and_every_learner_holds_them(name: str) -> None:
    algorithm = ALGORITHMS[name]
    box = gm.MemoryMailbox()
    learners = [Learner(x, 30, seed=i) for i, x in enumerate("abc")]
    run_learners(learners, box, algorithm, together=True)
    found = commits(box)
    assert len(found) > algorithm.fragments  # training rounds committed
    assert len(verify_all(box)) == len(found)  # every one recomputes bit for bit
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(box.get(p.MANIFEST)))
    assert manifest.algorithm == algorithm.settings()
    for learner in learners:
        assert not failures(learner), failures(learner)
    # Each learner's model is the commit it applied last, bit for bit: whether it closed
    # the round, downloaded it, or computed it from the round's contributions.
    for learner in learners:
        assert learner.session is not None
        params = dict(learner.model.named_parameters())
        for fragment, r in enumerate(learner.session.rounds):
            commit = next(c for c in found if c.round == r)
            stored = asyncio.run(get_tensors(box, commit.params, manifest.fragments[fragment]))
            for tensor_name, tensor in stored.items():
                assert torch.equal(params[tensor_name], tensor), (learner.name, r, tensor_name)
    computed = sum(learner.session.counters().computed for learner in learners if learner.session)
    if isinstance(algorithm, gm.SparseLoCo):
        # Every commit a learner did not close itself reached it as contributions.
        assert computed >= 1
    else:
        assert computed == 0  # DiLoCo's momentum is dense: its commits are downloaded


def test_contributions_are_compressed_payloads_not_parameters() -> None:
    algorithm = ALGORITHMS["sparseloco-topk"]
    box = gm.MemoryMailbox()
    run_learners([Learner("a", 20, seed=1), Learner("b", 20, seed=2)], box, algorithm)
    training = [c for c in commits(box) if c.contributors]
    payload = asyncio.run(get_tensors(box, training[-1].contributors[0].payload))
    suffixes = {name.rpartition("#")[2] for name in payload}
    assert suffixes == {"idx", "val", "scale"}
    assert payload["0.weight#idx"].dtype == torch.int16
    # 10% of each 64-entry chunk of the 16x8 weight: 7 of 64, twice.
    assert payload["0.weight#idx"].numel() == 2 * round(0.1 * 64)


def test_error_feedback_conserves_what_was_not_sent() -> None:
    compression = gm.TopK(density=0.05, bits=2, chunk=32)
    torch.manual_seed(0)
    base = {"w": torch.randn(10, 20)}
    residual: dict[str, torch.Tensor] | None = None
    sent = torch.zeros(200)
    deltas = torch.zeros(200)
    for _ in range(6):
        local = {"w": base["w"] - 0.1 * torch.randn(10, 20)}
        delta = (base["w"] - local["w"]).reshape(-1)
        payload, residual = encode_contribution(compression, 1.0, local, base, residual, ())
        parts = {k.rpartition("#")[2]: v for k, v in payload.items()}
        sent += compression.decode(parts, 200, where="w")
        deltas += delta
        # Everything computed so far is either sent or still waiting in the residual.
        torch.testing.assert_close(sent + residual["w"], deltas, rtol=0, atol=1e-5)
    # With a decay, the residual carries decay·(what was left) into the next contribution.
    local = {"w": base["w"].clone()}  # no progress: the contribution is the residual alone
    before = residual["w"].clone()
    payload, after = encode_contribution(compression, 0.5, local, base, residual, ())
    parts = {k.rpartition("#")[2]: v for k, v in payload.items()}
    again = compression.decode(parts, 200, where="w")
    torch.testing.assert_close(again + after["w"], 0.5 * before, rtol=0, atol=1e-6)
    assert torch.equal(residual["w"], before)  # the old residual is left as it was


def test_a_corrupt_compressed_contribution_is_unusable_naming_its_key() -> None:
    compression = gm.TopK(density=0.1, bits=2, chunk=64)
    algorithm = gm.SparseLoCo(sync_every=5, compression=compression)
    spec = p.TensorSpec("w", (128,), "torch.float32")
    good, _ = encode_contribution(
        compression, 1.0, {"w": torch.randn(128)}, {"w": torch.zeros(128)}, None, ()
    )
    bad = dict(good)
    bad["w#idx"] = torch.full_like(good["w#idx"], 64)  # past the end of its chunk
    box = gm.MemoryMailbox()

    async def run() -> tuple[str, Unusable]:
        good_key, _ = await put_tensors(box, good)
        bad_key, _ = await put_tensors(box, bad)
        sums = {"w": torch.empty(128)}
        members = [Member("a", 1, good_key), Member("b", 1, bad_key)]
        with pytest.raises(Unusable) as caught:
            await weighted_sums(box, algorithm, [spec], frozenset(), members, "a", sums)
        return bad_key, caught.value

    bad_key, failed = asyncio.run(run())
    assert failed.index == 1
    assert isinstance(failed.cause, PayloadCorrupt)
    assert bad_key in str(failed.cause)
    assert "idx" in str(failed.cause)


def test_a_payload_with_the_wrong_tensors_names_them() -> None:
    compression = gm.TopK(density=0.1, bits=2, chunk=64)
    specs = [p.TensorSpec("w", (128,), "torch.float32")]
    payload, _ = encode_contribution(
        compression, 1.0, {"w": torch.randn(128)}, {"w": torch.zeros(128)}, None, ()
    )
    out = {"w": torch.zeros(128)}
    cases = {
        "missing": ({}, "'w' is missing"),
        "stray": ({**payload, "v#idx": payload["w#idx"]}, "not in this fragment"),
        "dense": ({"w": torch.zeros(128)}, "dense, not compressed"),
    }
    for label, (tensors, message) in cases.items():
        with pytest.raises(PayloadCorrupt, match=message):
            add_contribution(compression, out, tensors, {"w": 1.0}, specs, (), where=label)
        assert torch.equal(out["w"], torch.zeros(128)), label  # nothing was added


def test_a_joiner_with_other_compression_settings_is_refused() -> None:
    box = gm.MemoryMailbox()
    first = gm.SparseLoCo(sync_every=5, compression=gm.TopK(density=0.02, bits=2))
    other = gm.SparseLoCo(sync_every=5, compression=gm.TopK(density=0.05, bits=2))
    with gm.Session(make_model(), algorithm=first, mailbox=box, learner_id="a", join_timeout=10):
        with pytest.raises(gm.ProtocolError, match="density"):
            gm.Session(make_model(), algorithm=other, mailbox=box, learner_id="b", join_timeout=10)
        with pytest.raises(gm.ProtocolError, match="compression"):
            gm.Session(
                make_model(),
                algorithm=gm.DiLoCo(sync_every=5),
                mailbox=box,
                learner_id="c",
                join_timeout=10,
            )


def test_settings_round_trip_and_bad_settings_are_named() -> None:
    for algorithm in ALGORITHMS.values():
        assert type(algorithm).from_settings(algorithm.settings()) == algorithm
        assert from_manifest(algorithm.settings()) == algorithm
    with pytest.raises(ValueError, match="compression"):
        gm.DiLoCo(compression="topk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outer momentum"):
        gm.SparseLoCo(outer_momentum=0.9)
    with pytest.raises(ValueError, match="error_decay"):
        gm.SparseLoCo(error_decay=0.0)


def test_a_restarted_learner_gets_its_error_feedback_back() -> None:
    algorithm = gm.SparseLoCo(sync_every=4, compression=gm.TopK(density=0.1, bits=2, chunk=64))
    box = gm.MemoryMailbox()
    model = make_model(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(3)
    session = gm.Session(
        model, algorithm=algorithm, mailbox=box, learner_id="a", optimizer=optimizer,
        poll_interval=0.05,
    )  # fmt: skip
    for _ in range(12):
        x = torch.randn(16, 8, generator=generator)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        session.step(samples=16)
    session.close()
    kept = session._shared.residual[0]
    assert kept is not None
    assert any(t.abs().sum() > 0 for t in kept.values())
    again_model = make_model(1)
    again = gm.Session(
        again_model,
        algorithm=algorithm,
        mailbox=box,
        learner_id="a",
        optimizer=torch.optim.SGD(again_model.parameters(), lr=0.05),
    )
    try:
        restored = again._shared.residual[0]
        assert restored is not None
        assert restored.keys() == kept.keys()
        for name, tensor in kept.items():
            assert torch.equal(restored[name], tensor), name
    finally:
        again.close()


def test_status_shows_the_compression_and_the_bytes_moved() -> None:
    algorithm = ALGORITHMS["sparseloco-topk"]
    box = gm.MemoryMailbox()
    learners = [Learner("a", 20, seed=1), Learner("b", 20, seed=2)]
    run_learners(learners, box, algorithm)
    view = asyncio.run(RunWatcher(box).poll())
    shown = view_json("memory://", view)
    assert shown["compression"] == "top-10% of 64, 2-bit"
    counted = [learner.session.counters() for learner in learners if learner.session]
    traffic = shown["traffic"]
    # The leaving beats carry each learner's bytes up to that beat (not its own write).
    assert 0 < traffic["bytes_up"] <= sum(sum(c.bytes_up.values()) for c in counted)
    assert 0 < traffic["bytes_down"] <= sum(sum(c.bytes_down.values()) for c in counted)
    model_bytes = sum(t.numel() * 4 for t in make_model().parameters())
    contributed = sum(v["contributed"] for v in shown["learners"])
    assert traffic["dense_estimate"] == 2 * contributed * model_bytes
    assert traffic["times_fewer_than_dense"] == traffic["dense_estimate"] / (
        traffic["bytes_up"] + traffic["bytes_down"]
    )
    dense = gm.MemoryMailbox()
    run_learners([Learner("a", 10, seed=1)], dense, gm.DiLoCo(sync_every=5))
    plain = view_json("memory://", asyncio.run(RunWatcher(dense).poll()))
    assert plain["compression"] == "none (float32)"
    assert plain["traffic"]["dense_estimate"] is None


def test_the_compression_page_snippet_runs_as_printed() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "compression.md").read_text()
    section = page.split("# Compression\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in docs/compression.md"
    built: dict[str, object] = {"gm": gm}
    exec(match.group(1), built)
    assert built["algorithm"] == gm.DiLoCo(sync_every=100, compression=gm.Quantize(bits=8))


def test_dense_every_stores_parameters_every_k_rounds_and_readers_compute_the_rest() -> None:
    algorithm = gm.SparseLoCo(
        sync_every=5,
        fragments=2,
        dense_every=3,
        compression=gm.TopK(density=0.1, bits=2, chunk=64),
    )
    box = gm.MemoryMailbox()
    learners = [Learner(x, 40, seed=i) for i, x in enumerate("abc")]
    # The default keep_rounds (2): the closers keep the chains back to a stored commit.
    run_learners(learners, box, algorithm, together=True, keep_rounds=2)
    found = {c.round: c for c in commits(box)}
    assert all(c.stored == ((r // 2) % 3 == 0) for r, c in found.items())
    unstored = [c for c in found.values() if not c.stored]
    assert unstored
    # Not stored, only named by their hash.
    assert all(asyncio.run(box.get(c.params)) is None for c in unstored)
    for learner in learners:
        # A learner that fell more than K + 1 rounds behind (a loaded machine, rounds that
        # closed on their timeout without it) finds those rounds swept, says so and loads
        # the newest commit along its chain instead: the designed fallback, not a failure.
        unexpected = [
            e for e in failures(learner) if "loading its parameters instead" not in str(e)
        ]
        assert not unexpected, unexpected
    # The newest commits (stored or not) verify: each one recomputes to its record's hash.
    newest = sorted(found)[-2:]
    for r in newest:
        asyncio.run(gm.verify.verify_commit(box, r))
    # align and a joiner compute unstored commits along their chain: the learners' models.
    aligned = make_model(9)
    rounds = gm.align(aligned, mailbox=box)
    assert sorted(rounds.values()) == newest
    for learner in learners:
        assert learner.session is not None
        if learner.session.rounds == tuple(rounds[f] for f in range(2)):
            for mine, theirs in zip(learner.model.parameters(), aligned.parameters(), strict=True):
                assert torch.equal(mine, theirs)
    joiner = make_model(7)
    with gm.Session(joiner, algorithm=algorithm, mailbox=box, learner_id="late") as session:
        assert session.rounds == tuple(rounds[f] for f in range(2))
        for mine, theirs in zip(joiner.parameters(), aligned.parameters(), strict=True):
            assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="dense_every"):
        gm.SparseLoCo(dense_every=0)
    assert from_manifest(algorithm.settings()) == algorithm
