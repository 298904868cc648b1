"""A recording mailbox: every call of a learner's session, with its thread, key, bytes and
times, how many keys each listing returned, and what each blob key carried (learned from the
records the learners wrote, Moshpit's group records included). Used by ``rounds``, ``scale``
and ``idle`` to split bytes by purpose and latency into phases."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.errors import ProtocolError


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
    """What each blob key carried, learned from the records the learners wrote; and per
    Moshpit ``group-rounds/`` record created, its closer and its member count."""

    def __init__(self) -> None:
        self.purpose: dict[str, str] = {}
        self.closer: dict[int, str] = {}  # round -> the learner whose record won
        self.params_round: dict[str, int] = {}  # params blob -> its round
        self.part_of: dict[str, str] = {}  # a part's key -> its index (the payload key)
        self.group_closer: dict[tuple[int, str], str] = {}
        self.group_members: dict[tuple[int, str], int] = {}
        self.lock = threading.Lock()

    def payload(self, key: str) -> str:
        """The payload key a blob belongs to: itself, or the index naming it (a part)."""
        return self.part_of.get(key, key)

    def note_put(self, learner: str, key: str, data: bytes, created: bool) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError, ProtocolError), self.lock:
            if key.startswith("blobs/") and key.endswith(".parts"):
                for part in json.loads(data)["parts"]:
                    self.part_of.setdefault(part["key"], key)
            elif key.startswith("snapshots/"):
                self.purpose.setdefault(json.loads(data)["payload"], "snapshot")
            elif key.startswith("rounds/") and created:
                record = json.loads(data)
                self.purpose[record["params"]] = "params"
                self.params_round[record["params"]] = int(record["round"])
                if record.get("momentum"):
                    self.purpose[record["momentum"]] = "momentum"
                self.closer[int(record["round"])] = learner
            elif key.startswith(p.GROUP_SNAPSHOTS):
                self.purpose.setdefault(p.decode_snapshot(key, data).payload, "snapshot")
            elif key.startswith(p.GROUP_ROUNDS) and created:
                commit = p.decode_commit(key, data)
                group = p.parse_group_round_key(key)
                if len(commit.contributors) > 1:  # alone: its own snapshot's payload
                    self.purpose.setdefault(commit.params, "group params")
                self.group_closer[group] = learner
                self.group_members[group] = len(commit.contributors)


class Recorder(gm.Mailbox):
    """Passes every call to ``inner`` and logs it (thread, key, bytes, start and end); each
    listing's ``(end, learner, keys returned)`` goes to ``listed`` when given."""

    def __init__(
        self,
        inner: gm.Mailbox,
        learner: str,
        log: list[Op],
        registry: Registry,
        listed: list[tuple[float, str, int]] | None = None,
    ):
        self.inner = inner
        self.learner = learner
        self.log = log
        self.registry = registry
        self.listed = listed

    def _note(self, op: str, key: str, up: int, down: int, start: float, ok: bool | None) -> None:
        name = threading.current_thread().name  # the Session's loop threads are named
        thread = {"gm-comm": "comm", "gm-sync": "sync"}.get(name[:7], "main")
        self.log.append(Op(self.learner, thread, op, key, up, down, start, time.monotonic(), ok))

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        start, created = time.monotonic(), None
        try:
            created = await self.inner.put_if_absent(key, data)
            return created
        finally:
            self._note("put", key, len(data), 0, start, created)
            if created is not None:
                self.registry.note_put(self.learner, key, data, created)

    async def get(self, key: str) -> bytes | None:
        start, data = time.monotonic(), None
        try:
            data = await self.inner.get(key)
            return data
        finally:
            self._note("get", key, 0, len(data or b""), start, None)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        start = time.monotonic()
        try:
            keys = await self.inner.list(prefix, after=after)
        finally:
            self._note("list", prefix, 0, 0, start, None)
        if self.listed is not None:
            self.listed.append((time.monotonic(), self.learner, len(keys)))
        return keys

    async def delete(self, keys: Iterable[str]) -> None:
        keys, start = list(keys), time.monotonic()
        try:
            await self.inner.delete(keys)
        finally:
            self._note("delete", keys[0] if keys else "", 0, 0, start, None)


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
