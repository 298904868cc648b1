"""A recording mailbox: every call of a learner's session, with its thread, key, bytes and
times, and what each blob key carried (learned from the records the learners wrote). Used
by benchmarks 3 and 6 to split bytes by purpose and latency into phases."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import gradientmail as gm


@dataclass(frozen=True)
class Op:
    learner: str
    thread: str  # "comm", "sync", or "main" (join / leave)
    op: str  # put / get / list / delete
    key: str
    up: int
    down: int
    start: float
    end: float
    ok: bool | None = None  # put_if_absent's answer


class Registry:
    """What each blob key carried, learned from the records the learners wrote."""

    def __init__(self) -> None:
        self.purpose: dict[str, str] = {}
        self.closer: dict[int, str] = {}  # round -> the learner whose record won
        self.params_round: dict[str, int] = {}  # params blob -> its round
        self.part_of: dict[str, str] = {}  # a part's key -> its index (the payload key)
        self.lock = threading.Lock()

    def payload(self, key: str) -> str:
        """The payload key a blob belongs to: itself, or the index naming it (a part)."""
        return self.part_of.get(key, key)

    def note_put(self, learner: str, key: str, data: bytes, created: bool) -> None:
        if key.startswith("blobs/") and key.endswith(".parts"):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                parts = [part["key"] for part in json.loads(data)["parts"]]
                with self.lock:
                    for part in parts:
                        self.part_of.setdefault(part, key)
        elif key.startswith("snapshots/"):
            with contextlib.suppress(ValueError, KeyError):
                with self.lock:
                    self.purpose.setdefault(json.loads(data)["payload"], "snapshot")
        elif key.startswith("rounds/") and created:
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(data)
                with self.lock:
                    self.purpose[record["params"]] = "params"
                    self.params_round[record["params"]] = int(record["round"])
                    if record.get("momentum"):
                        self.purpose[record["momentum"]] = "momentum"
                    self.closer[int(record["round"])] = learner


class Recorder(gm.Mailbox):
    """Passes every call to ``inner`` and logs it (thread, key, bytes, start and end)."""

    def __init__(self, inner: gm.Mailbox, learner: str, log: list[Op], registry: Registry):
        self.inner = inner
        self.learner = learner
        self.log = log
        self.registry = registry

    def _thread(self) -> str:
        name = threading.current_thread().name  # the Session's loop threads are named
        if name.startswith("gm-comm"):
            return "comm"
        return "sync" if name.startswith("gm-sync") else "main"

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        thread, start = self._thread(), time.monotonic()
        created = None
        try:
            created = await self.inner.put_if_absent(key, data)
            return created
        finally:
            self.log.append(
                Op(self.learner, thread, "put", key, len(data), 0, start, time.monotonic(), created)
            )
            if created is not None:
                self.registry.note_put(self.learner, key, data, created)

    async def get(self, key: str) -> bytes | None:
        thread, start = self._thread(), time.monotonic()
        data = None
        try:
            data = await self.inner.get(key)
            return data
        finally:
            size = len(data or b"")
            self.log.append(Op(self.learner, thread, "get", key, 0, size, start, time.monotonic()))

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        thread, start = self._thread(), time.monotonic()
        try:
            return await self.inner.list(prefix, after=after)
        finally:
            self.log.append(Op(self.learner, thread, "list", prefix, 0, 0, start, time.monotonic()))

    async def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        thread, start = self._thread(), time.monotonic()
        try:
            await self.inner.delete(keys)
        finally:
            first = keys[0] if keys else ""
            self.log.append(
                Op(self.learner, thread, "delete", first, 0, 0, start, time.monotonic())
            )


def round_of(key: str) -> int | None:
    parts = key.split("/")
    if len(parts) >= 2 and parts[0] in ("rounds", "snapshots", "claims") and parts[1].isdigit():
        return int(parts[1])
    return None


def purpose_of(op: Op, registry: Registry) -> str:
    """What an operation carried, e.g. ``put snapshot`` or ``get params (closer)``."""
    kind = op.key.partition("/")[0]
    if kind == "blobs" and op.op in ("put", "get"):
        payload = registry.payload(op.key)  # a part counts as its payload
        what = registry.purpose.get(payload, "blob?")
        if op.op == "get" and what == "params":
            r = registry.params_round.get(payload)
            closer = registry.closer.get(r) if r is not None else None
            who = "by its closer" if closer == op.learner else op.thread
            return f"get params ({who})"
        return f"{op.op} {what}"
    return f"{op.op} {kind} (records)"
