"""``gradientmail align --out``: a file that ``load_state_dict(strict=True)`` takes.

The mailbox holds a tied tensor once (under the name ``named_parameters`` gives it); the
manifest records the model's other names for it (``aliases``), and ``align --out`` writes
each as a copy, beside the frozen parameters, so the file has every name ``state_dict``
has. The metadata says ``format: pt``, which ``transformers``' ``from_pretrained`` needs.

Each case trains one learner for a few steps in this process (a ``file://`` mailbox) and
runs the command in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.cli import main
from gradientmail.errors import ProtocolError


class TiedLM(torch.nn.Module):
    """Embedding and output layer sharing one weight, a frozen layer, a float buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.mid.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.full((), 1.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mid(self.embed(tokens)))) / self.temperature


def _train(model: torch.nn.Module, url: str, batch: object, steps: int = 4) -> None:
    """One learner, ``steps`` steps of next-token loss on ``batch``'s tokens."""
    box = gm.open_mailbox(url)
    trainable = [t for t in model.parameters() if t.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1)
    algorithm = gm.DiLoCo(sync_every=2, fragments=2)
    options = {"poll_interval": 0.05, "round_timeout": 5.0}
    with gm.Session(
        model, algorithm=algorithm, mailbox=box, learner_id="solo", **options
    ) as session:
        for _ in range(steps):
            optimizer.zero_grad()
            batch_loss(model, batch).backward()
            optimizer.step()
            session.step(samples=4)


def batch_loss(model: torch.nn.Module, tokens: object) -> torch.Tensor:
    assert isinstance(tokens, torch.Tensor)
    out = model(tokens)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), tokens.flatten())


def _align_out(url: str, target: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    status = main(["align", url, "--out", str(target)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return captured.out


def _same_state(left: torch.nn.Module, right: torch.nn.Module) -> None:
    mine, theirs = left.state_dict(), right.state_dict()
    assert list(mine) == list(theirs)
    for name, value in mine.items():
        assert torch.equal(value, theirs[name]), name


def test_the_file_has_every_state_dict_name_and_loads_strictly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = (tmp_path / "mailbox").as_uri()
    trained = TiedLM(seed=0)
    _train(trained, url, torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1)))
    target = tmp_path / "model.safetensors"
    said = _align_out(url, target, capsys)
    assert "(1 tied: head.weight = embed.weight)" in said, said

    expected = TiedLM(seed=0).state_dict()
    tensors = load_file(str(target))
    assert sorted(tensors) == sorted(expected)  # tied and frozen names included
    fresh = TiedLM(seed=7)  # other values everywhere
    fresh.load_state_dict(tensors, strict=True)
    assert fresh.head.weight is fresh.embed.weight  # loading keeps the tie
    aligned = TiedLM(seed=7)
    gm.align(aligned, mailbox=gm.open_mailbox(url))  # what the run's model is
    _same_state(fresh, aligned)
    assert torch.equal(tensors["head.weight"], tensors["embed.weight"])
    assert not torch.equal(aligned.embed.weight, TiedLM(seed=0).embed.weight)  # it trained
    with safe_open(str(target), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata["gradientmail.rounds"]).keys() == {"0", "1"}


def test_the_manifest_records_tied_names_and_old_runs_read_without_them() -> None:
    from gradientmail.engine.layout import ModelLayout

    algorithm = gm.DiLoCo(sync_every=2, fragments=2)
    manifest = ModelLayout(TiedLM(seed=0), algorithm).manifest("a", algorithm)
    assert manifest.aliases == {"head.weight": "embed.weight"}
    back = p.decode_manifest(p.MANIFEST, p.encode(manifest))
    assert back.aliases == manifest.aliases
    assert ModelLayout.from_manifest(back).aliases == manifest.aliases

    wire = json.loads(p.encode(manifest))
    del wire["aliases"]  # a run created before aliases existed
    assert p.decode_manifest(p.MANIFEST, json.dumps(wire).encode()).aliases == {}
    untied = ModelLayout(torch.nn.Sequential(torch.nn.Linear(2, 2)), gm.DiLoCo(sync_every=2))
    assert "aliases" not in json.loads(p.encode(untied.manifest("a", gm.DiLoCo(sync_every=2))))

    for bad in ({"head.weight": "nowhere"}, {"mid.bias": "embed.weight"}, {"x": 3}):
        wire["aliases"] = bad
        with pytest.raises(ProtocolError, match="alias"):
            p.decode_manifest(p.MANIFEST, json.dumps(wire).encode())


def test_a_tiny_gpt2_file_loads_strictly_and_from_pretrained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16, tie_word_embeddings=True
    )

    def gpt2(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model: torch.nn.Module = transformers.GPT2LMHeadModel(config)
        return model

    url = (tmp_path / "mailbox").as_uri()
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    _train(gpt2(0), url, tokens, steps=2)
    folder = tmp_path / "gpt2"
    said = _align_out(url, folder / "model.safetensors", capsys)
    assert "lm_head.weight = transformer.wte.weight" in said, said

    aligned = gpt2(5)
    gm.align(aligned, mailbox=gm.open_mailbox(url))
    strict = gpt2(6)
    tensors = load_file(str(folder / "model.safetensors"))
    assert sorted(tensors) == sorted(strict.state_dict())
    strict.load_state_dict(tensors, strict=True)
    _same_state(strict, aligned)
    config.save_pretrained(folder)  # from_pretrained reads config.json beside the file
    pretrained = transformers.GPT2LMHeadModel.from_pretrained(folder)
    _same_state(pretrained, aligned)
