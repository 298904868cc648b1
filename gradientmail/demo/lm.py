"""The small byte-level language model that the built-in node trains and the quality
benchmark (``bench/quality.py``) measures: data, model, one training step, evaluation,
sampling. One copy, so that the demo a user sees is the model the benchmark reports on.

Part of the demo, not the library, and it imports torch at the top: ``import gradientmail``
never loads it (the built-in node and the CLI import it inside the functions that need it).

- **Data**: the Python standard library's own ``.py`` sources (``sysconfig``'s ``stdlib``
  directory, ``site-packages`` left out), files in sorted order, byte-level tokens. Each file
  is cut into blocks of :data:`BLOCK` bytes; every :data:`HOLDOUT`-th block of the whole
  sequence is held out for validation (5%, mixing all sources). The training blocks go to
  one of :data:`SHARDS` shards by the file's top-level package or module (:func:`shard_of`),
  so the shards are non-IID on purpose. :func:`node_shard` gives node ``i`` of ``n`` its
  own part. A learner samples windows of ``context + 1`` bytes from its shard with a
  generator seeded by (seed, learner).
- **Model**: a small pre-LayerNorm causal transformer LM (:class:`TinyLM`): byte and
  position embeddings, ``layers`` blocks of multi-head attention and a 4x GELU MLP, a final
  LayerNorm and an untied head. No dropout, no buffers: every tensor is a parameter.
- **Training**: AdamW (betas 0.9/0.95, weight decay 0.01), linear warm-up over the first 5%
  of local steps, then cosine decay to 10% (:func:`lr_at`); one step is :func:`train_step`.
- **Evaluation**: the mean next-byte cross-entropy (nats per byte) over a fixed set of
  validation windows (:func:`evaluate`); :func:`generate` samples bytes from a prompt.
- **Cache**: reading and cutting the stdlib costs about 0.5 s of CPU warm and 1.5 s cold
  (≈ 30 MB); every node of a local run and the CLI need it at once, on the same cores.
  :func:`cached_corpus` keeps the result as safetensors (never pickle) under the user's
  cache directory, written atomically, so later processes load it in a few milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import platform
import sysconfig
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BLOCK",
    "HOLDOUT",
    "SEED",
    "SHARDS",
    "SHARD_NAMES",
    "VOCAB",
    "Batches",
    "Block",
    "Corpus",
    "ModelSize",
    "TinyLM",
    "build_corpus",
    "build_model",
    "cache_dir",
    "cached_corpus",
    "evaluate",
    "generate",
    "load_params",
    "lr_at",
    "make_optimizer",
    "node_shard",
    "param_count",
    "shard_of",
    "stdlib_files",
    "train_step",
]

log = logging.getLogger("gradientmail")

SHARDS = 4  # shards of the corpus (the benchmark's M learners: one each)
BLOCK = 2048  # bytes per block; every HOLDOUT-th block is validation
HOLDOUT = 20  # 1 block in 20: 5%
SEED = 1234
VOCAB = 256

# Shard 1: tools, GUIs, codec tables and generated data. Shard 0 is the test suite, shard 2
# every other package (a directory), shard 3 every single-file module. Names a Python version
# lacks are simply absent.
_TOOLS = frozenset(
    {
        "encodings",
        "idlelib",
        "tkinter",
        "turtledemo",
        "pydoc_data",
        "lib2to3",
        "distutils",
        "ensurepip",
        "venv",
        "curses",
        "msilib",
        "__phello__",
        "turtle.py",
    }
)
SHARD_NAMES = (
    "test suite (test/)",
    "tools, GUIs, codec tables (encodings, idlelib, tkinter, pydoc_data, lib2to3, ...)",
    "other packages (asyncio, email, unittest, xml, ctypes, multiprocessing, ...)",
    "single-file modules (typing.py, inspect.py, argparse.py, ...)",
)


def shard_of(top: str, is_package: bool) -> int:
    """The shard that holds the files under the top-level name ``top``."""
    if top == "test":
        return 0
    if top in _TOOLS:
        return 1
    return 2 if is_package else 3


@dataclass(frozen=True)
class ModelSize:
    d_model: int
    layers: int
    heads: int


# -- data ------------------------------------------------------------------------------------


@dataclass
class Corpus:
    shards: list[torch.Tensor]  # uint8, one per shard
    val: torch.Tensor  # uint8 [eval_windows, context + 1]
    sources: list[dict[str, Any]]  # per shard: bytes, files, top-level names
    val_bytes: int
    train_bytes: int
    files: int
    stdlib: str
    python: str

    def describe(self) -> dict[str, Any]:
        return {
            "stdlib": self.stdlib,
            "python": self.python,
            "files": self.files,
            "train_bytes": self.train_bytes,
            "val_bytes": self.val_bytes,
            "val_fraction": self.val_bytes / max(1, self.val_bytes + self.train_bytes),
            "eval_windows": int(self.val.shape[0]),
            "shards": self.sources,
        }


def stdlib_files(root: Path) -> Iterator[tuple[Path, str, bool]]:
    """``(path, top-level name, is a package)`` of every ``.py`` file, in sorted order."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        top = rel.parts[0]
        if top in ("site-packages", "dist-packages") or "__pycache__" in rel.parts:
            continue
        yield path, top, len(rel.parts) > 1


def build_corpus(
    *, context: int, eval_windows: int, seed: int = SEED, max_bytes: int | None = None
) -> Corpus:
    """Read the stdlib, cut it into blocks, hold out 5%, shard the rest by package.

    ``max_bytes``: read at most about this much per shard (tests). The validation set is
    ``eval_windows`` windows of ``context + 1`` bytes drawn from the held-out blocks with a
    generator seeded by ``seed``: the same windows in every process.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces: list[list[bytes]] = [[] for _ in range(SHARDS)]
    tops: list[dict[str, int]] = [{} for _ in range(SHARDS)]
    files = [0] * SHARDS
    val_blocks: list[bytes] = []
    block_no = 0
    read = [0] * SHARDS
    for path, top, is_package in stdlib_files(root):
        shard = shard_of(top, is_package)
        if max_bytes is not None and read[shard] >= max_bytes:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        read[shard] += len(data)
        files[shard] += 1
        for start in range(0, len(data), BLOCK):
            block = data[start : start + BLOCK]
            if block_no % HOLDOUT == HOLDOUT - 1:
                val_blocks.append(block)
            else:
                pieces[shard].append(block)
                tops[shard][top] = tops[shard].get(top, 0) + len(block)
            block_no += 1
    shards = [torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8) for p in pieces]
    for i, data_shard in enumerate(shards):
        if data_shard.numel() < 4 * (context + 1):
            raise RuntimeError(
                f"shard {i} ({SHARD_NAMES[i]}) holds only {data_shard.numel()} bytes"
            )
    # Fixed validation windows: drawn from the held-out blocks long enough to hold one.
    usable = [b for b in val_blocks if len(b) >= context + 1]
    if not usable:
        raise RuntimeError("no held-out block is long enough for a validation window")
    g = torch.Generator().manual_seed(seed + 7)
    windows = []
    for _ in range(eval_windows):
        block = usable[int(torch.randint(len(usable), (1,), generator=g))]
        start = int(torch.randint(len(block) - context, (1,), generator=g))
        windows.append(block[start : start + context + 1])
    val = torch.frombuffer(bytearray(b"".join(windows)), dtype=torch.uint8).view(
        eval_windows, context + 1
    )
    sources = []
    for i in range(SHARDS):
        ranked = sorted(tops[i].items(), key=lambda kv: (-kv[1], kv[0]))
        sources.append(
            {
                "learner": i,
                "what": SHARD_NAMES[i],
                "bytes": int(shards[i].numel()),
                "files": files[i],
                "top_level": [name for name, _ in ranked],
                "largest": [[name, n] for name, n in ranked[:8]],
            }
        )
    return Corpus(
        shards=shards,
        val=val,
        sources=sources,
        val_bytes=sum(len(b) for b in val_blocks),
        train_bytes=sum(int(s.numel()) for s in shards),
        files=sum(files),
        stdlib=str(root),
        python=platform.python_version(),
    )


def node_shard(shards: list[torch.Tensor], node: int, nodes: int) -> torch.Tensor:
    """Node ``node`` of ``nodes``'s training bytes: with up to :data:`SHARDS` nodes, the
    shards ``j`` with ``j % nodes == node`` joined (every shard is trained, each by one
    node); with more, shard ``node % SHARDS`` (nodes share shards, sampling differently)."""
    if nodes > SHARDS:
        return shards[node % SHARDS]
    mine = [s for j, s in enumerate(shards) if j % nodes == node]
    return mine[0] if len(mine) == 1 else torch.cat(mine)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/gradientmail`` (``~/.cache/gradientmail``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gradientmail"


def cached_corpus(
    *, context: int, eval_windows: int, seed: int = SEED, max_bytes: int | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(shards, val)`` of :func:`build_corpus`, from the cache when an earlier process
    built the same one (same Python, stdlib, cut and validation windows), else built and
    stored. A cache that cannot be read or written is skipped (logged), never an error."""
    from safetensors.torch import load_file, save_file

    stdlib = sysconfig.get_paths()["stdlib"]
    key = repr((1, platform.python_version(), stdlib, BLOCK, HOLDOUT, SHARDS, context,
                eval_windows, seed, max_bytes))  # fmt: skip
    path = cache_dir() / f"lm-corpus-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
    try:
        tensors = load_file(path)
        return [tensors[f"shard{i}"] for i in range(SHARDS)], tensors["val"]
    except FileNotFoundError:
        pass
    except Exception as exc:  # a damaged or foreign file: rebuild over it
        log.info("corpus cache %s unreadable (%s); rebuilding it", path, exc)
    corpus = build_corpus(
        context=context, eval_windows=eval_windows, seed=seed, max_bytes=max_bytes
    )
    tensors = {f"shard{i}": s.contiguous() for i, s in enumerate(corpus.shards)}
    tensors["val"] = corpus.val.contiguous()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".corpus-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, path)  # atomic: concurrent builders each write a whole file
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # left only when the write failed
    except OSError as exc:
        log.info("corpus cache %s not written (%s)", path, exc)
    return corpus.shards, corpus.val


class Batches:
    """Learner ``learner``'s training windows: ``batch`` random windows per step from its own
    shard, the same sequence in every process (a generator seeded by (seed, learner))."""

    def __init__(self, shard: torch.Tensor, learner: int, batch: int, context: int, seed: int):
        self.shard = shard
        self.batch = batch
        self.context = context
        self.generator = torch.Generator().manual_seed(seed * 1000 + learner)
        self.offsets = torch.arange(context + 1)

    def next(self) -> torch.Tensor:
        """``[batch, context + 1]`` int64 tokens."""
        starts = torch.randint(
            int(self.shard.numel()) - self.context - 1, (self.batch, 1), generator=self.generator
        )
        return self.shard[starts + self.offsets].long()


# -- the model -------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyLM(nn.Module):
    """A byte-level causal transformer language model."""

    def __init__(self, size: ModelSize, context: int) -> None:
        super().__init__()
        if size.d_model % size.heads:
            raise ValueError(f"d_model {size.d_model} is not a multiple of heads {size.heads}")
        self.context = context
        self.tok = nn.Embedding(VOCAB, size.d_model)
        self.pos = nn.Parameter(torch.zeros(context, size.d_model))
        self.blocks = nn.ModuleList(Block(size.d_model, size.heads) for _ in range(size.layers))
        self.ln = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, VOCAB, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.ln(h))
        return logits


def build_model(size: ModelSize, context: int, seed: int) -> TinyLM:
    """The same initial parameters in every process."""
    torch.manual_seed(seed)
    return TinyLM(size, context)


def param_count(size: ModelSize, context: int) -> int:
    return sum(p.numel() for p in TinyLM(size, context).parameters())


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def lr_at(step: int, steps: int, lr: float) -> float:
    """Learning rate of local step ``step`` (1-based) of ``steps``."""
    warm = max(1, steps // 20)
    if step <= warm:
        return lr * step / warm
    progress = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    lr: float,
) -> float:
    """One AdamW step on ``tokens`` ``[batch, context + 1]``; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, chunk: int = 64) -> float:
    """Mean next-byte cross-entropy (nats) over the validation windows."""
    was_training = model.training
    model.eval()
    total = 0.0
    count = 0
    for start in range(0, val.shape[0], chunk):
        tokens = val[start : start + chunk].long()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(
            logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += tokens[:, 1:].numel()
    model.train(was_training)
    return total / count


@torch.no_grad()
def generate(
    model: TinyLM, prompt: bytes, length: int, *, temperature: float = 0.0, seed: int = 0
) -> bytes:
    """``length`` bytes sampled after ``prompt`` (the last ``model.context`` bytes seen);
    ``temperature`` 0 is greedy, otherwise a generator seeded by ``seed`` draws them."""
    was_training = model.training
    model.eval()
    tokens = list(prompt) or [ord("\n")]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(length):
        logits = model(torch.tensor([tokens[-model.context :]]))[0, -1]
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(token)
    model.train(was_training)
    return bytes(tokens[len(tokens) - length :])


def load_params(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (by parameter name) into ``model``."""
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value)
