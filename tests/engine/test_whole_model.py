"""The whole model travels: floating-point buffers with their fragment (averaged, not
outer-stepped), frozen parameters once with the manifest, and models on any device.

``requires_cuda`` tests run where a GPU exists and are reported as NOT RUN elsewhere
(``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.engine import layout as _layout
from gradientmail.payload import get_tensors, put_tensors
from tests.training import Learner, commits, failures, run_learners, verify_all

ALGORITHM = gm.DiLoCo(sync_every=6, fragments=2, outer_lr=0.7, outer_momentum=0.9)
Tensors = dict[str, torch.Tensor]


class Cached(torch.nn.Module):
    """A module with buffers that must NOT travel: a non-persistent float cache and an
    integer counter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(4.0), persistent=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def bn_model(seed: int = 0, frozen: bool = False) -> torch.nn.Sequential:
    """Linear → BatchNorm → Tanh → Linear (+ a module of buffers that stay local). With
    ``frozen``, the first layer's bias is frozen (``requires_grad=False``)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Tanh(),
        Cached(),
        torch.nn.Linear(16, 1),
    )
    if frozen:
        model[0].bias.requires_grad_(False)
    return model


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _payload(box: gm.Mailbox, key: str) -> Tensors:
    return asyncio.run(get_tensors(box, key))


def _fragment_of(layout: _layout.ModelLayout, name: str) -> int:
    found = [f for f, names in enumerate(layout.fragments) if name in names]
    assert found, f"{name} is in no fragment"
    return found[0]


def _specs(layout: _layout.ModelLayout) -> dict[str, tuple[int, str]]:
    return {s.name: (f, s.kind) for f, specs in enumerate(layout.specs) for s in specs}


def _weighted(
    contributions: list[tuple[str, int, Mapping[str, torch.Tensor]]], name: str
) -> torch.Tensor:
    """Σ samples_i · local_i / Σ samples_i, in learner order, float32, as combine does it."""
    ordered = sorted(contributions, key=lambda c: c[0])
    total = float(sum(s for _, s, _ in ordered))
    acc = torch.zeros(ordered[0][2][name].shape)
    for _, samples, local in ordered:
        acc.add_(local[name].to(torch.float32), alpha=samples / total)
    return acc


# -- the layout ---------------------------------------------------------------------------


def test_float_buffers_travel_with_their_fragment_and_the_rest_stays_local() -> None:
    model = bn_model(frozen=True)
    layout = _layout.ModelLayout(model, ALGORITHM)
    specs = _specs(layout)
    # BatchNorm's running statistics go with the fragment of BatchNorm's own parameters.
    assert specs["1.running_mean"] == (specs["1.weight"][0], "buffer")
    assert specs["1.running_var"] == (specs["1.weight"][0], "buffer")
    assert specs["1.weight"][1] == "param"
    for local in ("1.num_batches_tracked", "3.cache", "3.calls", "0.bias"):
        assert local not in specs, local  # integer, non-persistent, frozen: not in rounds
    assert layout.buffer_names(specs["1.weight"][0]) == {"1.running_mean", "1.running_var"}
    assert [s.name for s in layout.frozen_specs] == ["0.bias"]
    assert layout.frozen_specs[0].kind == "frozen"
    # Parameters split as before buffers existed: the buffers follow, they never move them.
    trainable = [(n, q.numel()) for n, q in model.named_parameters() if q.requires_grad]
    split = ALGORITHM.split(trainable)
    assert [[n for n in f if n in dict(trainable)] for f in layout.fragments] == split
    # A copy holds the buffers too (detached, not the model's memory).
    fragment = specs["1.running_var"][0]
    copy = layout.copy_out(fragment)
    assert torch.equal(copy["1.running_var"], model[1].running_var)
    assert copy["1.running_var"].data_ptr() != model[1].running_var.data_ptr()


def test_a_model_on_the_meta_device_is_refused_naming_the_tensor() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"parameter '0\.weight' is on the meta device"):
        _layout.ModelLayout(model, ALGORITHM)
    model = bn_model()
    model[1].running_mean = torch.empty(16, device="meta")  # a buffer without data
    with pytest.raises(ValueError, match=r"buffer '1\.running_mean' is on the meta device"):
        gm.Session(model, algorithm=ALGORITHM, mailbox=gm.MemoryMailbox(), learner_id="a")


def test_a_model_with_nothing_to_train_is_refused() -> None:
    model = bn_model()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        _layout.ModelLayout(model, ALGORITHM)


def fake_device() -> Any:
    """A Transfer on which every tensor takes the device path: each move is counted, and a
    "device" copy is a fresh tensor (a real move never aliases host memory either)."""

    class FakeDevice(_layout.Transfer):
        def __init__(self) -> None:
            super().__init__()
            self.moves: Counter[str] = Counter()

        def on_host(self, tensor: torch.Tensor) -> bool:
            return False

        def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
            self.moves["to_host"] += 1
            host = super().to_host(tensor)
            assert host.device.type == "cpu"
            return host

        def to_device(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            assert host.device.type == "cpu", "only host tensors cross the mailbox"
            self.moves["to_device"] += 1
            return host.to(like.device, copy=True)

        def synchronize(self, devices: Iterable[torch.device]) -> None:
            self.moves["synchronize"] += 1
            super().synchronize(devices)

    return FakeDevice()


def test_the_device_path_moves_through_host_tensors_in_copy_out_load_and_rebase() -> None:
    model = bn_model(frozen=True)
    fake = fake_device()
    layout = _layout.ModelLayout(model, ALGORITHM, transfer=fake)
    fragment = _fragment_of(layout, "1.running_mean")
    names = layout.fragments[fragment]
    buffers = layout.buffer_names(fragment)
    tensors = {name: layout.tensor(name) for name in names}

    copy = layout.copy_out(fragment)
    assert fake.moves == {"to_host": len(names), "synchronize": 1}  # one sync for them all
    for name in names:
        assert copy[name].device.type == "cpu"
        assert torch.equal(copy[name], tensors[name])
        assert copy[name].untyped_storage().data_ptr() != tensors[name].data_ptr()

    fake.moves.clear()
    new_global = {n: v + 1.0 for n, v in copy.items()}
    layout.load(fragment, new_global)
    assert fake.moves == {"to_device": len(names), "synchronize": 1}
    assert all(torch.equal(tensors[n], new_global[n]) for n in names)

    fake.moves.clear()
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.add_(0.25)  # local progress since the anchor (new_global)
    anchor = new_global
    newer = {n: v * 2.0 for n, v in new_global.items()}
    layout.rebase(fragment, newer, anchor)
    params = len(names) - len(buffers)
    assert fake.moves == {"to_device": 2 * params + len(buffers), "synchronize": 1}
    for name in names:
        # Parameters keep their local progress; buffers (statistics) take the commit's value.
        want = newer[name] if name in buffers else newer[name] + 0.25
        assert torch.allclose(tensors[name], want), name

    fake.moves.clear()
    before = {n: t.clone() for n, t in tensors.items()}
    layout.mix(fragment, new_global, 0.25)  # Streaming DiLoCo's blend
    assert fake.moves == {"to_device": len(names), "synchronize": 1}
    for name in names:
        want = (
            new_global[name] if name in buffers else 0.25 * before[name] + 0.75 * new_global[name]
        )
        assert torch.allclose(tensors[name], want), name

    fake.moves.clear()
    frozen = layout.frozen_tensors()
    assert fake.moves == {"to_host": 1, "synchronize": 1}
    layout.load_frozen({"0.bias": frozen["0.bias"] - 3.0})
    assert fake.moves["to_device"] == 1
    assert torch.equal(model[0].bias, frozen["0.bias"] - 3.0)


def test_buffers_are_looked_up_each_time_model_to_replaces_them() -> None:
    model = bn_model()
    layout = _layout.ModelLayout(model, ALGORITHM)
    fragment = _fragment_of(layout, "1.running_mean")
    model.to(torch.float64).to(torch.float32)  # _apply: every buffer is a new tensor now
    values = {n: torch.full_like(v, 7.0) for n, v in layout.copy_out(fragment).items()}
    layout.load(fragment, values)
    assert torch.equal(model[1].running_mean, torch.full((16,), 7.0))


def test_for_run_follows_the_manifest_not_this_models_requires_grad() -> None:
    trained = _layout.ModelLayout(bn_model(frozen=True), ALGORITHM)
    manifest = trained.manifest("creator", ALGORITHM)
    evaluation = bn_model(seed=5)  # nothing frozen here
    layout = _layout.ModelLayout.for_run(evaluation, manifest)
    assert layout.specs == trained.specs
    assert layout.frozen_specs == trained.frozen_specs
    layout.load_frozen({"0.bias": torch.full((16,), 2.0)})
    assert torch.equal(evaluation[0].bias, torch.full((16,), 2.0))
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    with pytest.raises(gm.ProtocolError, match=r"1\.running_mean is not one in this model"):
        _layout.ModelLayout.for_run(other, manifest)


# -- the wire -----------------------------------------------------------------------------


def test_tensor_kinds_and_frozen_parameters_on_the_wire() -> None:
    layout = _layout.ModelLayout(bn_model(frozen=True), ALGORITHM)
    manifest = layout.manifest("a", ALGORITHM, frozen_payload=p.blob_key("0" * 64))
    wire = json.loads(p.encode(manifest))
    flat = [spec for fragment in wire["fragments"] for spec in fragment]
    assert {s["name"]: s.get("kind") for s in flat}["1.running_mean"] == "buffer"
    assert "kind" not in next(s for s in flat if s["name"] == "1.weight")  # the default
    assert wire["frozen"] == [
        {"name": "0.bias", "shape": [16], "dtype": "torch.float32", "kind": "frozen"}
    ]
    assert wire["frozen_payload"] == p.blob_key("0" * 64)
    assert p.decode_manifest(p.MANIFEST, p.encode(manifest)) == manifest
    # A model without buffers or frozen parameters writes what earlier releases wrote, and
    # their manifests read unchanged.
    plain = _layout.ModelLayout(torch.nn.Sequential(torch.nn.Linear(2, 2)), gm.DiLoCo())
    old = (
        b'{"algorithm":{"name":"diloco"},"creator":"a","format":1,"fragments":[[{"dtype":'
        b'"torch.float32","name":"0.weight","shape":[2,2]},{"dtype":"torch.float32","name":'
        b'"0.bias","shape":[2]}]]}'
    )
    decoded = p.decode_manifest(p.MANIFEST, old)
    assert decoded.fragments == plain.specs
    assert (decoded.frozen, decoded.frozen_payload) == ((), None)
    assert p.encode(p.Manifest("a", {"name": "diloco"}, plain.specs)) == old
    # A kind a list does not take is named.
    bad = json.loads(old)
    bad["fragments"][0][0]["kind"] = "frozen"
    with pytest.raises(gm.ProtocolError, match=r"'0\.weight' of kind 'frozen'"):
        p.decode_manifest(p.MANIFEST, json.dumps(bad).encode())
    # Frozen on one side and trainable on the other is a difference, named.
    trainable = _layout.ModelLayout(bn_model(), ALGORITHM).manifest("b", ALGORITHM)
    assert "parameter 0.bias: run has torch.float32[16] (frozen), this node has " in "; ".join(
        manifest.differences(trainable)
    )
    assert manifest.differences(layout.manifest("b", ALGORITHM)) == []  # payload not compared


def test_the_buffer_mode_is_recorded_only_when_not_the_default() -> None:
    assert "buffers" not in gm.DiLoCo().settings()
    closer = gm.DiLoCo(buffers="closer")
    assert closer.settings()["buffers"] == "closer"
    assert gm.DiLoCo.from_settings(closer.settings()) == closer
    with pytest.raises(ValueError, match="buffers='median'"):
        gm.DiLoCo(buffers="median")


# -- combine and verify -------------------------------------------------------------------


def _inputs(
    seed: int = 0,
) -> tuple[Tensors, Tensors, list[tuple[str, int, Mapping[str, torch.Tensor]]]]:
    gen = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(5, 3, generator=gen), "mean": torch.randn(3, generator=gen)}
    momentum = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    local = [
        (learner, samples, {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()})
        for learner, samples in (("c", 3), ("a", 1), ("b", 7))
    ]
    return base, momentum, local


def test_combine_averages_buffers_plainly_and_steps_only_the_parameters() -> None:
    base, momentum, local = _inputs()
    params, m = ALGORITHM.combine(base, momentum, local, buffer_names={"mean"})
    # The buffer: the plain sample-weighted average, bitwise; no momentum.
    assert _bits(params["mean"]) == _bits(_weighted(local, "mean"))
    assert torch.equal(m["mean"], torch.zeros(3))
    # The parameter: exactly what combine gives it without the buffer alongside.
    alone, alone_m = ALGORITHM.combine(
        {"w": base["w"]}, {"w": momentum["w"]}, [(n, s, {"w": t["w"]}) for n, s, t in local]
    )
    assert _bits(params["w"]) == _bits(alone["w"])
    assert _bits(m["w"]) == _bits(alone_m["w"])
    assert not torch.allclose(params["w"], _weighted(local, "w"))  # outer-stepped
    # Into out buffers, and with the momentum updated in place: the same bits.
    inplace = {k: v.clone() for k, v in momentum.items()}
    out = ({k: torch.full(v.shape, float("nan")) for k, v in base.items()}, inplace)
    got, got_m = ALGORITHM.combine(base, inplace, local, out=out, buffer_names={"mean"})
    assert all(_bits(got[k]) == _bits(params[k]) for k in base)
    assert all(_bits(got_m[k]) == _bits(m[k]) for k in base)
    # The first round (no momentum yet), and a momentum without the buffer's entry.
    first, _ = ALGORITHM.combine(base, {"w": momentum["w"]}, local, buffer_names=["mean"])
    assert _bits(first["mean"]) == _bits(params["mean"])
    with pytest.raises(ValueError, match=r"buffer_names \['nope'\]"):
        ALGORITHM.combine(base, momentum, local, buffer_names={"nope"})


def test_combine_takes_the_closers_buffers_when_configured() -> None:
    base, momentum, local = _inputs()
    closer = gm.DiLoCo(outer_lr=0.7, outer_momentum=0.9, buffers="closer")
    params, m = closer.combine(base, momentum, local, buffer_names={"mean"}, closer="b")
    assert torch.equal(params["mean"], dict((n, t) for n, _, t in local)["b"]["mean"])
    assert torch.equal(m["mean"], torch.zeros(3))
    averaged, _ = ALGORITHM.combine(base, momentum, local, buffer_names={"mean"})
    assert torch.equal(params["w"], averaged["w"])  # parameters as always
    # A closer that did not contribute: the first contributor in learner order.
    params, _ = closer.combine(base, momentum, local, buffer_names={"mean"}, closer="zed")
    assert torch.equal(params["mean"], dict((n, t) for n, _, t in local)["a"]["mean"])


@pytest.mark.parametrize("mode", ["average", "closer"])
def test_verify_recomputes_a_commit_with_buffers(mode: str) -> None:
    """A commit whose buffers are averaged (or the closer's) verifies; one whose buffers
    were outer-stepped like parameters (what a closer without kinds computes) does not."""
    from gradientmail.engine.verify import verify_commit

    algorithm = gm.DiLoCo(sync_every=6, fragments=1, outer_lr=0.7, outer_momentum=0.9, buffers=mode)
    model = bn_model()
    layout = _layout.ModelLayout(model, algorithm)
    box = gm.MemoryMailbox()
    manifest = layout.manifest("a", algorithm)
    asyncio.run(box.put_if_absent(p.MANIFEST, p.encode(manifest)))
    base = layout.copy_out(0)

    def put(tensors: Mapping[str, torch.Tensor]) -> str:
        return asyncio.run(put_tensors(box, tensors))[0]

    asyncio.run(
        box.put_if_absent(p.round_key(0), p.encode(p.Commit(0, 0, None, (), put(base), None, "a")))
    )
    gen = torch.Generator().manual_seed(3)
    local = [
        (learner, samples, {k: v + torch.rand(v.shape, generator=gen) for k, v in base.items()})
        for learner, samples in (("a", 2), ("b", 5))
    ]
    listed = tuple(p.Contribution(n, s, put(t)) for n, s, t in local)

    def commit(r: int, buffer_names: frozenset[str]) -> None:
        params, m = algorithm.combine(base, None, local, buffer_names=buffer_names, closer="b")
        record = p.Commit(r, 0, r - 1, listed, put(params), put(m), "b")
        asyncio.run(box.put_if_absent(p.round_key(r), p.encode(record)))

    commit(1, layout.buffer_names(0))
    assert asyncio.run(verify_commit(box, 1)).contributors == ("a", "b")
    asyncio.run(box.delete([p.round_key(1)]))
    commit(1, frozenset())  # buffers treated as parameters
    with pytest.raises(gm.ProtocolError, match="parameters are not the combination"):
        asyncio.run(verify_commit(box, 1))


# -- sessions -----------------------------------------------------------------------------


def _snapshot(box: gm.Mailbox, contribution: p.Contribution) -> Tensors:
    return _payload(box, contribution.payload)


def test_align_loads_the_running_stats_a_run_synced() -> None:
    box = gm.MemoryMailbox()
    learners = [
        Learner("a", 60, seed=1, model=bn_model(1)),
        Learner("b", 60, seed=2, model=bn_model(2)),
    ]
    run_learners(learners, box, ALGORITHM)
    newest = {c.fragment: c for c in commits(box)}  # the newest commit of each fragment
    assert min(c.round for c in newest.values()) >= ALGORITHM.fragments
    committed: Tensors = {}
    for commit in newest.values():
        committed.update(_payload(box, commit.params))
    assert {"1.running_mean", "1.running_var"} <= committed.keys()
    assert "1.num_batches_tracked" not in committed
    fresh = bn_model(seed=9)
    gm.align(fresh, mailbox=box)
    assert torch.equal(fresh[1].running_mean, committed["1.running_mean"])
    assert torch.equal(fresh[1].running_var, committed["1.running_var"])
    assert not torch.equal(fresh[1].running_var, torch.ones(16))  # not the initial value
    # A buffer that is not floating point keeps each model's own value.
    assert fresh[1].num_batches_tracked.item() == 0
    for learner in learners:
        assert learner.model[1].num_batches_tracked.item() == learner.steps  # its own count
        assert failures(learner) == [], failures(learner)


def test_a_round_averages_the_running_stats_and_verify_recomputes_it() -> None:
    box = gm.MemoryMailbox()
    learners = [
        Learner("a", 60, seed=1, model=bn_model(1)),
        Learner("b", 60, seed=2, model=bn_model(2)),
    ]
    run_learners(learners, box, ALGORITHM)
    training = [c for c in commits(box) if c.round >= ALGORITHM.fragments]
    fragment = _specs(_layout.ModelLayout(bn_model(), ALGORITHM))["1.running_mean"][0]
    checked = 0
    for commit in training:
        if commit.fragment != fragment:
            continue
        committed = _payload(box, commit.params)
        contributions = [(c.learner, c.samples, _snapshot(box, c)) for c in commit.contributors]
        for name in ("1.running_mean", "1.running_var"):
            assert _bits(committed[name]) == _bits(_weighted(contributions, name)), (commit, name)
        checked += 1
    assert checked >= 2
    verify_all(box)


def test_late_commits_blend_into_a_model_with_buffers() -> None:
    """overlap + mixing (Streaming DiLoCo's blend) over a model whose fragments hold buffers."""
    box = gm.MemoryMailbox()
    learners = [
        Learner("a", 60, seed=1, model=bn_model(1)),
        Learner("b", 60, seed=2, model=bn_model(2)),
    ]
    run_learners(learners, box, ALGORITHM, overlap=3, mixing=0.5)
    assert len([c for c in commits(box) if c.round >= ALGORITHM.fragments]) >= 4
    for learner in learners:
        assert failures(learner) == [], failures(learner)


def test_a_frozen_parameter_never_travels_in_a_round_and_never_drifts() -> None:
    box = gm.MemoryMailbox()
    models = [bn_model(seed=1, frozen=True), bn_model(seed=1, frozen=True)]
    initial = _bits(models[0][0].bias)
    learners = [
        Learner(n, 90, seed=s, model=m) for n, s, m in (("a", 1, models[0]), ("b", 2, models[1]))
    ]
    run_learners(learners, box, ALGORITHM)
    found = commits(box)
    assert len([c for c in found if c.round >= ALGORITHM.fragments]) >= 8
    for commit in found:
        payloads = [commit.params, *(c.payload for c in commit.contributors)]
        payloads += [commit.momentum] if commit.momentum else []
        for key in payloads:
            assert "0.bias" not in _payload(box, key), f"round {commit.round}: {key}"
    for model in models:
        assert _bits(model[0].bias) == initial  # bitwise, on every learner
    assert not torch.equal(models[0][0].weight, bn_model(seed=1)[0].weight)  # others trained
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(box.get(p.MANIFEST)))
    assert [s.name for s in manifest.frozen] == ["0.bias"]


def test_a_joiner_and_align_load_the_creators_frozen_parameters() -> None:
    box = gm.MemoryMailbox()
    creator_model, joiner_model = bn_model(seed=1, frozen=True), bn_model(seed=2, frozen=True)
    assert not torch.equal(creator_model[0].bias, joiner_model[0].bias)
    with gm.Session(creator_model, algorithm=ALGORITHM, mailbox=box, learner_id="creator"):
        manifest = p.decode_manifest(p.MANIFEST, asyncio.run(box.get(p.MANIFEST)))
        assert manifest.frozen_payload is not None
        stored = _payload(box, manifest.frozen_payload)
        assert _bits(stored["0.bias"]) == _bits(creator_model[0].bias)
        with gm.Session(joiner_model, algorithm=ALGORITHM, mailbox=box, learner_id="joiner"):
            assert _bits(joiner_model[0].bias) == _bits(creator_model[0].bias)
    evaluation = bn_model(seed=3)  # built fresh, nothing frozen: align follows the run
    gm.align(evaluation, mailbox=box)
    assert _bits(evaluation[0].bias) == _bits(creator_model[0].bias)
    assert torch.equal(evaluation[1].running_var, creator_model[1].running_var)


# -- CUDA -------------------------------------------------------------------------------


@pytest.mark.requires_cuda
def test_a_cuda_model_trains_syncs_and_aligns() -> None:
    """Learners whose models (parameters, BatchNorm statistics, a frozen parameter) live on
    the GPU: rounds commit and apply, everything that crosses the mailbox is on the host,
    the model stays on the GPU, and align loads a GPU model bitwise."""
    device = torch.device("cuda")
    box = gm.MemoryMailbox()
    learners = [
        Learner(n, 60, seed=s, model=bn_model(s, frozen=True).to(device))
        for n, s in (("a", 1), ("b", 2))
    ]
    run_cuda_learners(learners, box)
    found = commits(box)
    assert len([c for c in found if c.round >= ALGORITHM.fragments]) >= 6
    for learner in learners:
        assert failures(learner) == [], failures(learner)
        assert learner.session is not None
        assert learner.session.counters().applied >= 4
        assert all(t.device.type == "cuda" for t in learner.model.state_dict().values())
    evaluation = bn_model(seed=7).to(device)
    rounds = gm.align(evaluation, mailbox=box)
    newest = {c.fragment: c for c in found}
    assert rounds == {f: c.round for f, c in newest.items()}
    for commit in newest.values():
        for name, value in _payload(box, commit.params).items():
            assert _bits(evaluation.state_dict()[name]) == _bits(value), name
    verify_all(box)


def run_cuda_learners(learners: list[Learner], box: gm.Mailbox) -> None:
    """tests.training.train with the batches on the model's device."""
    import threading

    def train(learner: Learner) -> None:
        generator = torch.Generator().manual_seed(1000 + learner.seed)
        device = next(learner.model.parameters()).device
        try:
            optimizer = torch.optim.SGD(
                [q for q in learner.model.parameters() if q.requires_grad], lr=0.05
            )
            with gm.Session(
                learner.model,
                algorithm=ALGORITHM,
                mailbox=box,
                learner_id=learner.name,
                poll_interval=0.05,
                round_timeout=1.0,
                lease_timeout=3.0,
                keep_rounds=10_000,
            ) as session:
                learner.session = session
                for _ in range(learner.steps):
                    x = torch.randn(16, 8, generator=generator).to(device)
                    loss = ((learner.model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    session.step(samples=16)
        except BaseException as exc:
            learner.error = exc

    threads = [threading.Thread(target=train, args=(learner,)) for learner in learners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for learner in learners:
        assert learner.error is None, f"{learner.name} failed: {learner.error!r}"
