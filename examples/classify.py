"""A user's own training script, run the README's way: a classifier on real text.

    gradientmail run --nodes 4 -- python examples/classify.py

Each node reads the node environment (``gradientmail.NodeEnv``: mailbox URL, learner
id, its index, the DiLoCo settings and ``GRADIENTMAIL_STEPS``), lines up with the others at
the ``start`` barrier, and trains a small MLP on its own shard of the data for that many
steps inside ``env.session(model)``, calling ``session.step()`` after each optimizer step.

The data is real and needs no download: this interpreter's standard library sources. The
task is to tell which top-level stdlib package (``asyncio``, ``email``, ``xml``, …: twelve
classes, chance 1/12) a 64-byte snippet of Python source comes from, from the snippet's
byte histogram and hashed byte bigrams. Every file is cut into 2 KiB blocks; a block goes,
by a hash of its path and position, to the test set (about 15%) or to one of the shards,
so the test text is never trained on and each node trains on text no other node sees.

Other modes, for checking a run (``examples/classify_check.py`` drives them):

    python examples/classify.py --alone --shard 0 --shards 4 --steps 800 --save alone.pt
    python examples/classify.py --evaluate --aligned URL --model alone.pt ...

``--alone`` trains the same model on one shard without GradientMail (no import of it);
``--evaluate`` prints one JSON line per model with its test accuracy and loss, the run's
aligned model (``gm.align`` from the mailbox URL, in this process) and saved models alike.
A node given ``--out DIR`` saves its own model as it was after its last local step
(``DIR/{learner}.pt``) and its counters (``DIR/{learner}.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any

import torch

CLASSES = (
    "asyncio",
    "distutils",
    "email",
    "http",
    "idlelib",
    "importlib",
    "lib2to3",
    "logging",
    "multiprocessing",
    "tkinter",
    "unittest",
    "xml",
)
SNIPPET = 64  # bytes per example
BLOCK = 2048  # the unit a file is split into for the test set and the shards
TEST_SHARE = 0.15
TEST_PER_CLASS = 250
BUCKETS = 2048  # hashed byte bigrams
FEATURES = 256 + BUCKETS
HIDDEN = 128
BATCH = 64
LR = 2e-3


# -- data -----------------------------------------------------------------------------------


def _blocks() -> dict[str, list[tuple[int, bytes]]]:
    """Every class's source blocks as ``(hash, bytes)``; the hash decides where a block goes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    blocks: dict[str, list[tuple[int, bytes]]] = {}
    for name in CLASSES:
        found: list[tuple[int, bytes]] = []
        for path in sorted((stdlib / name).rglob("*.py")):
            rel = path.relative_to(stdlib).as_posix()
            if "/test" in rel or "idle_test" in rel:
                continue  # test suites: shared boilerplate across packages
            data = path.read_bytes()
            for start in range(0, len(data) - SNIPPET, BLOCK):
                key = zlib.crc32(f"{rel}:{start}".encode())
                found.append((key, data[start : start + BLOCK]))
        if not found:
            raise SystemExit(f"classify: no sources for {name!r} under {stdlib}")
        blocks[name] = found
    return blocks


def _is_test(key: int) -> bool:
    return key % 1000 < TEST_SHARE * 1000


def shard_text(shard: int, shards: int) -> list[bytes]:
    """One shard's training text per class: the blocks that are neither test nor another
    shard's, concatenated."""
    out = []
    for found in _blocks().values():
        mine = [b for key, b in found if not _is_test(key) and (key // 1000) % shards == shard]
        out.append(b"".join(mine))
    return out


def test_set() -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping snippets of the test blocks, ``TEST_PER_CLASS`` per class."""
    snippets: list[bytes] = []
    labels: list[int] = []
    for label, found in enumerate(_blocks().values()):
        text = b"".join(b for key, b in found if _is_test(key))
        starts = range(0, len(text) - SNIPPET, SNIPPET)
        step = max(1, len(starts) // TEST_PER_CLASS)
        for start in list(starts)[::step][:TEST_PER_CLASS]:
            snippets.append(text[start : start + SNIPPET])
            labels.append(label)
    return features(snippets), torch.tensor(labels)


def features(snippets: list[bytes]) -> torch.Tensor:
    """Byte histogram and hashed byte-bigram counts, each normalised to sum 1."""
    raw = torch.tensor([list(s) for s in snippets], dtype=torch.long)
    n = len(snippets)
    hist = torch.zeros(n, 256).scatter_add_(1, raw, torch.ones(raw.shape))
    pairs = (raw[:, :-1] * 257 + raw[:, 1:] * 31) % BUCKETS
    bigrams = torch.zeros(n, BUCKETS).scatter_add_(1, pairs, torch.ones(pairs.shape))
    return torch.cat([hist / SNIPPET, bigrams / (SNIPPET - 1)], dim=1)


class Batches:
    """Endless class-balanced batches of random snippets from one shard's text."""

    def __init__(self, texts: list[bytes], seed: int) -> None:
        self.texts = texts
        self.generator = torch.Generator().manual_seed(seed)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(len(self.texts), (BATCH,), generator=self.generator)
        snippets = []
        for label in labels.tolist():
            text = self.texts[label]
            start = int(torch.randint(len(text) - SNIPPET, (1,), generator=self.generator))
            snippets.append(text[start : start + SNIPPET])
        return features(snippets), labels


# -- model ----------------------------------------------------------------------------------


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model everywhere (the creator's wins anyway)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, len(CLASSES)),
    )


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.item())


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    x, y = data
    logits = model(x)
    return {
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "loss": float(torch.nn.functional.cross_entropy(logits, y)),
    }


# -- modes ----------------------------------------------------------------------------------


def run_node(out: Path | None) -> int:
    """One node of a run: the environment says everything (see gradientmail/launch/env.py)."""
    import gradientmail as gm
    from gradientmail.launch.env import NodeEnv

    env = NodeEnv.from_environ()
    print(f"{env.learner_id}: gradientmail from {gm.__file__}", flush=True)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = Batches(shard_text(env.node_index, env.nodes), seed=1000 + env.node_index)
    box = env.open_mailbox()
    skipped_events = 0

    def on_event(event: Any) -> None:
        nonlocal skipped_events
        if type(event).__name__ == "SyncSkipped":
            skipped_events += 1

    started = time.monotonic()
    with env.session(model, mailbox=box, on_event=on_event) as session:
        env.barrier(box, poll_interval=0.2).wait("start", parties=env.parties("start"))
        print(f"{env.learner_id}: shard {env.node_index}/{env.nodes}, {env.steps} steps")
        for step in range(1, env.steps + 1):
            loss = train_step(model, optimizer, next(batches))
            session.step(samples=BATCH)
            if step % max(1, env.steps // 8) == 0 or step == env.steps:
                print(f"{env.learner_id}: step {step} loss {loss:.4f}", flush=True)
        local = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seconds = time.monotonic() - started
    counters = session.counters()
    fields = ("published", "skipped_syncs", "sync_points", "waits", "waited_s", "wait_timeouts")
    report = {
        "learner": env.learner_id,
        "library": gm.__file__,
        "steps": session.steps,
        "seconds": round(seconds, 2),
        "rounds": list(session.rounds),
        "sync_skipped_events": skipped_events,
        **{name: getattr(counters, name) for name in fields if hasattr(counters, name)},
    }
    print(f"{env.learner_id}: done in {seconds:.1f} s: {json.dumps(report)}", flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(local, out / f"{env.learner_id}.pt")
        (out / f"{env.learner_id}.json").write_text(json.dumps(report))
    return 0


def run_alone(shard: int, shards: int, steps: int, save: Path | None) -> int:
    """The same training on one shard with nobody else: the baseline."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = Batches(shard_text(shard, shards), seed=1000 + shard)
    for _ in range(steps):
        train_step(model, optimizer, next(batches))
    if save is not None:
        torch.save(model.state_dict(), save)
    print(json.dumps({"model": f"alone-{shard}", **evaluate(model, test_set())}))
    return 0


def run_evaluate(aligned: str | None, paths: list[Path], timeout: float) -> int:
    data = test_set()
    chance = {"accuracy": 1 / len(CLASSES), "loss": math.log(len(CLASSES))}
    print(json.dumps({"model": "chance", **chance, "test_size": len(data[1])}))
    if aligned is not None:
        import gradientmail as gm

        model = build_model()
        loaded = gm.align(model, mailbox=gm.open_mailbox(aligned), timeout=timeout)
        rounds = {str(k): v for k, v in loaded.items()}
        print(json.dumps({"model": "aligned", "rounds": rounds, **evaluate(model, data)}))
    for path in paths:
        model = build_model()
        model.load_state_dict(torch.load(path))
        print(json.dumps({"model": path.stem, **evaluate(model, data)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="node: save its local model and counters here")
    parser.add_argument("--alone", action="store_true", help="train one shard without a run")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--save", type=Path, help="--alone: save the model here")
    parser.add_argument("--evaluate", action="store_true", help="print test accuracy and loss")
    parser.add_argument("--aligned", metavar="URL", help="--evaluate: gm.align from this run")
    parser.add_argument("--model", type=Path, action="append", default=[], help="saved model")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on gm.align")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.alone:
        return run_alone(args.shard, args.shards, args.steps, args.save)
    if args.evaluate:
        return run_evaluate(args.aligned, args.model, args.timeout)
    return run_node(args.out)


if __name__ == "__main__":
    sys.exit(main())
