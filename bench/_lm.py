"""What every arm of the quality benchmark (``quality.py``) shares: the data, the model, one
training step, the evaluation, and the arms computed in one process.

- **Data**: the Python standard library's own ``.py`` sources (``sysconfig``'s ``stdlib``
  directory, ``site-packages`` left out), files in sorted order, byte-level tokens. Each file
  is cut into blocks of :data:`BLOCK` bytes; every 20th block of the whole sequence is held
  out for validation (5%, mixing all sources). The training blocks go to one of
  :data:`LEARNERS` shards by the file's top-level package or module (:func:`shard_of`), so
  the shards are non-IID on purpose. A learner samples windows of ``context + 1`` bytes
  from its own shard with a generator seeded by (seed, learner): every arm sees the same
  samples in the same order.
- **Model**: a small pre-LayerNorm causal transformer LM (:class:`TinyLM`): byte and
  position embeddings, ``layers`` blocks of multi-head attention and a 4x GELU MLP, a final
  LayerNorm and an untied head. No dropout, no buffers: every tensor is a parameter.
- **Training**: AdamW (betas 0.9/0.95, weight decay 0.01), linear warm-up over the first 5%
  of local steps, then cosine decay to 10%; one step is :func:`train_step`.
- **Evaluation**: the mean next-byte cross-entropy (nats per byte) over a fixed set of
  validation windows (:func:`evaluate`).
- **In-process arms** (:func:`run_inprocess`): ``ddp`` (one model, batch M·B, the M
  learners' batches side by side), ``reference`` (M model copies in one process, DiLoCo with
  zero latency through ``gm.DiLoCo.combine`` itself, Streaming DiLoCo's fragment schedule as
  the library has it), ``reference-late`` (the same with every outer step applied N inner
  steps late, keeping the local progress made meanwhile), ``solo-average`` (no syncs, the
  copies averaged once at the end).
"""

from __future__ import annotations

import math
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LEARNERS = 4  # M
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
    """The learner whose shard holds the files under the top-level name ``top``."""
    if top == "test":
        return 0
    if top in _TOOLS:
        return 1
    return 2 if is_package else 3


# -- sizes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    d_model: int
    layers: int
    heads: int


@dataclass(frozen=True)
class Sizes:
    """Everything that sets a run's size; a worker process gets it as JSON."""

    model: ModelSize
    fast_model: ModelSize  # diloco-fast: steps of a few ms
    batch: int  # B per learner
    steps: int  # T/M local steps per learner
    fast_steps: int
    context: int = 128
    lr: float = 2e-3
    checkpoints: int = 8  # loss-curve points
    eval_windows: int = 512
    sync_every: tuple[int, ...] = (25, 100)
    fragments: tuple[int, ...] = (1, 4)
    threads: int = 1  # torch intra-op threads in every worker (the same everywhere: bitwise)
    seed: int = SEED
    max_stdlib_bytes: int | None = None  # tests: read at most about this much per shard

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sizes:
        values = dict(data)
        values["model"] = ModelSize(**values["model"])
        values["fast_model"] = ModelSize(**values["fast_model"])
        values["sync_every"] = tuple(values["sync_every"])
        values["fragments"] = tuple(values["fragments"])
        return cls(**values)

    def family(self, name: str) -> tuple[ModelSize, int]:
        """The model and local steps of a family: ``main`` or ``fast``."""
        return (self.fast_model, self.fast_steps) if name == "fast" else (self.model, self.steps)

    def checkpoint_steps(self, steps: int) -> list[int]:
        """Local steps after which the loss curve is evaluated (the last one is the end)."""
        k = max(1, min(self.checkpoints, steps))
        return sorted({max(1, round(steps * (c + 1) / k)) for c in range(k)})


# -- data ------------------------------------------------------------------------------------


@dataclass
class Corpus:
    shards: list[torch.Tensor]  # uint8, one per learner
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


def build_corpus(sizes: Sizes) -> Corpus:
    """Read the stdlib, cut it into blocks, hold out 5%, shard the rest by package."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces: list[list[bytes]] = [[] for _ in range(LEARNERS)]
    tops: list[dict[str, int]] = [{} for _ in range(LEARNERS)]
    files = [0] * LEARNERS
    val_blocks: list[bytes] = []
    block_no = 0
    read = [0] * LEARNERS
    cap = sizes.max_stdlib_bytes
    for path, top, is_package in stdlib_files(root):
        shard = shard_of(top, is_package)
        if cap is not None and read[shard] >= cap:
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
        if data_shard.numel() < 4 * (sizes.context + 1):
            raise RuntimeError(
                f"shard {i} ({SHARD_NAMES[i]}) holds only {data_shard.numel()} bytes"
            )
    # Fixed validation windows: drawn from the held-out blocks long enough to hold one.
    usable = [b for b in val_blocks if len(b) >= sizes.context + 1]
    if not usable:
        raise RuntimeError("no held-out block is long enough for a validation window")
    g = torch.Generator().manual_seed(sizes.seed + 7)
    windows = []
    for _ in range(sizes.eval_windows):
        block = usable[int(torch.randint(len(usable), (1,), generator=g))]
        start = int(torch.randint(len(block) - sizes.context, (1,), generator=g))
        windows.append(block[start : start + sizes.context + 1])
    val = torch.frombuffer(bytearray(b"".join(windows)), dtype=torch.uint8).view(
        sizes.eval_windows, sizes.context + 1
    )
    sources = []
    for i in range(LEARNERS):
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
    import platform

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


def save_corpus(corpus: Corpus, path: Path) -> None:
    torch.save({"shards": corpus.shards, "val": corpus.val}, path)


def load_data(path: Path) -> tuple[list[torch.Tensor], torch.Tensor]:
    data = torch.load(path, weights_only=True)
    return list(data["shards"]), data["val"]


class Batches:
    """Learner ``learner``'s training windows: ``batch`` random windows per step from its own
    shard, the same sequence in every arm (a generator seeded by (seed, learner))."""

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
    """The same initial parameters in every process and arm."""
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


def learner_id(i: int) -> str:
    """The learner IDs of every arm (combine orders contributions by them)."""
    return f"learner-{i}"


# -- the in-process arms ---------------------------------------------------------------------


@dataclass
class ArmResult:
    arm: str
    family: str
    final_loss: float
    curve: list[tuple[int, float]]  # (samples, validation loss)
    wall_s: float
    train_loss: float  # mean over the last 10% of steps
    sync_points: int = 0
    rounds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _schedule(algorithm: Any, fragments: int) -> dict[int, int]:
    """Local step (mod sync_every) -> the fragment due then, as the library schedules it."""
    return {algorithm.offset(f): f for f in range(fragments)}


def fragment_names(model: nn.Module, algorithm: Any) -> list[list[str]]:
    named = [(name, p.numel()) for name, p in model.named_parameters()]
    groups: list[list[str]] = algorithm.split(named)
    return groups


def run_inprocess(
    arm: str,
    sizes: Sizes,
    shards: Sequence[torch.Tensor],
    val: torch.Tensor,
    *,
    family: str = "main",
    sync_every: int = 25,
    fragments: int = 1,
    late: int = 0,
    tail: bool = False,
    save: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> ArmResult:
    """``ddp``, ``reference`` (``late`` = 0), ``reference-late`` (``late`` > 0) or
    ``solo-average``, on the ``family``'s model; evaluated at the checkpoints.

    ``tail``: at the end, every fragment with steps since its last sync point contributes
    them in one more round (what a ``close()`` that flushes does). ``save``: the final
    parameters go there (``torch.save`` of a name -> tensor dict).
    """
    import gradientmail as gm

    size, steps = sizes.family(family)
    m = LEARNERS
    checkpoints = set(sizes.checkpoint_steps(steps))
    batches = [Batches(shards[i], i, sizes.batch, sizes.context, sizes.seed) for i in range(m)]
    curve: list[tuple[int, float]] = []
    losses: list[float] = []
    started = time.perf_counter()
    extra: dict[str, Any] = {}
    say = progress or (lambda _: None)
    eval_s = [0.0]  # evaluation time, left out of the arm's wall time

    def measure(model: nn.Module) -> float:
        t = time.perf_counter()
        loss = evaluate(model, val)
        eval_s[0] += time.perf_counter() - t
        return loss

    if arm == "ddp":
        model = build_model(size, sizes.context, sizes.seed)
        opt = make_optimizer(model, sizes.lr)
        for s in range(1, steps + 1):
            tokens = torch.cat([b.next() for b in batches])
            losses.append(train_step(model, opt, tokens, lr_at(s, steps, sizes.lr)))
            if s in checkpoints:
                curve.append((s * m * sizes.batch, measure(model)))
                say(f"{arm}: step {s}/{steps}, loss {curve[-1][1]:.4f}")
        final_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        wall = time.perf_counter() - started - eval_s[0]
        result = ArmResult(arm, family, curve[-1][1], curve, wall, tail_mean(losses))
        _save(save, final_params)
        return result

    if arm not in ("reference", "reference-late", "solo-average"):
        raise ValueError(f"unknown in-process arm {arm!r}")
    sync = arm != "solo-average"
    algorithm = gm.DiLoCo(sync_every=sync_every, fragments=fragments)
    copies = [build_model(size, sizes.context, sizes.seed) for _ in range(m)]
    opts = [make_optimizer(c, sizes.lr) for c in copies]
    params = [dict(c.named_parameters()) for c in copies]
    groups = fragment_names(copies[0], algorithm)
    due = _schedule(algorithm, fragments)
    with torch.no_grad():
        globals_ = [{n: params[0][n].detach().clone() for n in g} for g in groups]
    momentum: list[dict[str, torch.Tensor] | None] = [None] * fragments
    last_sync = [0] * fragments  # local step of each fragment's last contribution
    # reference-late: (apply after local step, fragment, new global, each copy's snapshot)
    pending: list[tuple[int, int, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]] = []
    sync_points = rounds = 0
    ids = [learner_id(i) for i in range(m)]
    eval_model = build_model(size, sizes.context, sizes.seed)
    eval_params = dict(eval_model.named_parameters())

    def combine(f: int, s: int) -> dict[str, torch.Tensor]:
        samples = (s - last_sync[f]) * sizes.batch
        contributions = [
            (ids[i], samples, {n: params[i][n].detach() for n in groups[f]}) for i in range(m)
        ]
        new, mom = algorithm.combine(globals_[f], momentum[f], contributions)
        globals_[f] = new
        momentum[f] = mom
        last_sync[f] = s
        return new

    def global_model() -> nn.Module:
        with torch.no_grad():
            if sync:
                for group in globals_:
                    for n, t in group.items():
                        eval_params[n].copy_(t)
            else:  # solo-average: the copies' mean
                for n, p in eval_params.items():
                    p.copy_(torch.stack([params[i][n].detach() for i in range(m)]).mean(0))
        return eval_model

    for s in range(1, steps + 1):
        lr = lr_at(s, steps, sizes.lr)
        step_losses = [train_step(copies[i], opts[i], batches[i].next(), lr) for i in range(m)]
        losses.append(sum(step_losses) / m)
        if sync:
            for _, f, new, snaps in [x for x in pending if x[0] == s]:
                with torch.no_grad():  # param <- new global + (param - snapshot), as rebase
                    for i in range(m):
                        for n in groups[f]:
                            params[i][n].add_(new[n]).sub_(snaps[i][n])
            pending = [x for x in pending if x[0] != s]
            f_due = due.get(s % sync_every)
            if f_due is not None:
                sync_points += 1
                rounds += 1
                if late == 0:
                    new = combine(f_due, s)
                    with torch.no_grad():  # exact DiLoCo: every copy takes the new global
                        for i in range(m):
                            for n in groups[f_due]:
                                params[i][n].copy_(new[n])
                else:
                    with torch.no_grad():
                        snaps = [
                            {n: params[i][n].detach().clone() for n in groups[f_due]}
                            for i in range(m)
                        ]
                    new = combine(f_due, s)
                    pending.append((s + late, f_due, new, snaps))
        if s in checkpoints:
            curve.append((s * m * sizes.batch, measure(global_model())))
            say(f"{arm}: step {s}/{steps}, loss {curve[-1][1]:.4f}")
    if sync and tail:
        # close(): the commits still in flight are applied first, then every fragment
        # contributes its steps since its last sync point.
        for _, f, new, snaps in sorted(pending, key=lambda x: x[0]):
            with torch.no_grad():
                for i in range(m):
                    for n in groups[f]:
                        params[i][n].add_(new[n]).sub_(snaps[i][n])
        pending = []
        for f in range(fragments):
            if last_sync[f] < steps:
                combine(f, steps)
                rounds += 1
        final = measure(global_model())
        curve[-1] = (curve[-1][0], final)
        extra["tail_rounds"] = True
    final_params = {n: p.detach().clone() for n, p in global_model().named_parameters()}
    result = ArmResult(
        arm,
        family,
        curve[-1][1],
        curve,
        time.perf_counter() - started - eval_s[0],
        tail_mean(losses),
        sync_points=sync_points,
        rounds=rounds,
        extra=extra,
    )
    _save(save, final_params)
    return result


def tail_mean(losses: Sequence[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def _save(path: Path | None, params: Mapping[str, torch.Tensor]) -> None:
    if path is not None:
        torch.save(dict(params), path)


def load_params(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (by parameter name) into ``model``."""
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value)
