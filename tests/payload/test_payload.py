"""The payload codec: standard safetensors both ways, hash-checked, zero-copy on read."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import gradientmail as gm
from gradientmail.payload import transfer as payload
from gradientmail.wire import TensorSpec, blob_key, parts_key

TENSORS = {
    "w": torch.randn(3, 5),
    "b16": torch.randn(7, dtype=torch.float64).to(torch.bfloat16),
    "step": torch.tensor([3], dtype=torch.int64),
    "mask": torch.tensor([True, False]),
    "empty": torch.zeros(0, 4),
    "scalar": torch.tensor(2.5),
}


def test_round_trip_and_interoperability() -> None:
    key, data = payload.encode(TENSORS)
    decoded = payload.decode(key, data)
    for source in (decoded, st_load(data)):  # ours, and the safetensors library's reader
        assert set(source) == set(TENSORS)
        for name, tensor in TENSORS.items():
            assert torch.equal(source[name], tensor), name
            assert source[name].dtype == tensor.dtype
    theirs = st_save(TENSORS)
    ours = payload.decode(blob_key(__import__("hashlib").sha256(theirs).hexdigest()), theirs)
    assert all(torch.equal(ours[n], t) for n, t in TENSORS.items())


def test_encoding_is_deterministic_and_content_addressed() -> None:
    key, data = payload.encode(TENSORS)
    again = payload.encode(dict(reversed(list(TENSORS.items()))))
    assert (key, data) == again
    other = payload.encode({**TENSORS, "w": TENSORS["w"] + 1})
    assert other[0] != key


def test_decoding_copies_nothing() -> None:
    big = {"x": torch.arange(1_000_000, dtype=torch.float32)}
    key, data = payload.encode(big)
    view = payload.decode(key, data)["x"]
    start = view.untyped_storage().data_ptr()
    assert bytes(memoryview(data)[-4:]) == bytes(view[-1:].numpy().tobytes())
    assert start != big["x"].untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), gm.PayloadCorrupt, "hash to"),
        (lambda d: d[: len(d) // 2], gm.PayloadCorrupt, "corrupt or truncated"),
    ],
)
def test_corruption_is_detected(mutate, error, message) -> None:  # type: ignore[no-untyped-def]
    key, data = payload.encode(TENSORS)
    with pytest.raises(error, match=message):
        payload.decode(key, mutate(data))


def test_a_well_hashed_but_malformed_payload_is_a_protocol_error() -> None:
    import hashlib

    for data in (b"\x00", b"\xff" * 16, b"\x04\x00\x00\x00\x00\x00\x00\x00nope"):
        key = blob_key(hashlib.sha256(data).hexdigest())
        with pytest.raises(gm.ProtocolError):
            payload.decode(key, data)


def test_layout_is_checked_against_the_manifest() -> None:
    key, data = payload.encode({"w": torch.zeros(2, 2)})
    with pytest.raises(gm.ProtocolError, match=r"manifest says torch\.float32"):
        payload.decode(key, data, [TensorSpec("w", (4,), "torch.float32")])
    with pytest.raises(gm.ProtocolError, match="missing"):
        payload.decode(key, data, [TensorSpec("v", (2, 2), "torch.float32")])


def test_missing_blob_is_named() -> None:
    box = gm.MemoryMailbox()
    with pytest.raises(gm.ProtocolError, match="payload is missing"):
        asyncio.run(payload.get_tensors(box, blob_key("0" * 64)))


# -- payloads stored in parts ------------------------------------------------------------------

BIG = {
    "a": torch.randn(300),  # 1,200 bytes: straddles parts of 512
    "b": torch.arange(50, dtype=torch.int64),
    "c": torch.randn(4, 64).to(torch.bfloat16),
}


def _stored(box: gm.MemoryMailbox) -> dict[str, bytes]:
    async def read() -> dict[str, bytes]:
        keys = await box.list("blobs/")
        return {k: v for k in keys if (v := await box.get(k)) is not None}

    return asyncio.run(read())


def test_a_large_payload_is_stored_in_parts_that_concatenate_to_safetensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(payload, "PART_BYTES", 512)
    box = gm.MemoryMailbox()
    key, size = asyncio.run(payload.put_tensors(box, BIG))
    whole_key, whole = payload.encode(BIG)
    assert key.endswith(".parts")
    assert key != whole_key
    assert size == len(whole)
    stored = _stored(box)
    index = json.loads(stored[key])
    assert [part["size"] for part in index["parts"]][:-1] == [512] * (len(index["parts"]) - 1)
    joined = b"".join(stored[part["key"]] for part in index["parts"])
    assert joined == whole  # the parts are ranges of the one standard safetensors stream
    assert set(stored) == {key, *(part["key"] for part in index["parts"])}
    got = asyncio.run(payload.get_tensors(box, key))
    for name, tensor in BIG.items():
        assert torch.equal(got[name], tensor), name
        assert got[name].dtype == tensor.dtype, name
    assert payload.encode_payload(BIG).key == key  # verify recomputes the same key


def test_a_header_spanning_parts_and_one_byte_parts_still_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for part_bytes in (1, 7, 64):  # the 8-byte length and the header cross part boundaries
        monkeypatch.setattr(payload, "PART_BYTES", part_bytes)
        box = gm.MemoryMailbox()
        small = {"x": torch.arange(6, dtype=torch.float32), "y": torch.ones(3)}
        key, _ = asyncio.run(payload.put_tensors(box, small))
        got = asyncio.run(payload.get_tensors(box, key))
        assert all(torch.equal(got[n], t) for n, t in small.items()), part_bytes


def _tamper(box: gm.MemoryMailbox, key: str, data: bytes) -> gm.MemoryMailbox:
    """A copy of ``box`` with ``key`` holding ``data`` (None: absent)."""
    copy = gm.MemoryMailbox()
    for k, v in _stored(box).items():
        if k != key:
            asyncio.run(copy.put_if_absent(k, v))
    if data:
        asyncio.run(copy.put_if_absent(key, data))
    return copy


def test_a_corrupt_or_missing_part_or_index_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "PART_BYTES", 512)
    box = gm.MemoryMailbox()
    key, _ = asyncio.run(payload.put_tensors(box, BIG))
    stored = _stored(box)
    first = json.loads(stored[key])["parts"][1]["key"]
    flipped = bytes([stored[first][0] ^ 1]) + stored[first][1:]
    cases = [
        (_tamper(box, first, flipped), gm.PayloadCorrupt, f"{first}: the 512 bytes read hash"),
        (_tamper(box, first, b""), gm.ProtocolError, f"its part {first}: the payload is missing"),
        (_tamper(box, key, stored[key] + b" "), gm.PayloadCorrupt, "corrupt or truncated"),
    ]
    for tampered, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            asyncio.run(payload.get_tensors(tampered, key))


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (b"[]", "not a part index"),
        (b'{"format":"gradientmail.parts/1","size":0,"parts":[]}', "names no parts"),
        (
            b'{"format":"gradientmail.parts/1","size":5,"parts":[{"key":"blobs/x","size":5}]}',
            "is not a blob key",
        ),
        (
            b'{"format":"gradientmail.parts/1","size":9,"parts":[{"key":"blobs/'
            + b"0" * 64
            + b'","size":5}]}',
            "do not add up",
        ),
        (
            b'{"format":"gradientmail.parts/1","size":5,"parts":[{"key":"blobs/'
            + b"0" * 64
            + b'.parts","size":5}]}',
            "bad part entry",
        ),
    ],
)
def test_a_malformed_index_is_a_protocol_error(index: bytes, message: str) -> None:
    box = gm.MemoryMailbox()
    key = parts_key(hashlib.sha256(index).hexdigest())
    asyncio.run(box.put_if_absent(key, index))
    with pytest.raises(gm.ProtocolError, match=message):
        asyncio.run(payload.get_tensors(box, key))


def test_parts_are_swept_with_their_payload_but_shared_parts_are_spared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Training with payloads in parts: every blob left after sweeping is an index or a part
    an index names (no orphaned part), no part a kept payload shares with a swept one is gone
    (a frozen tensor's parts recur every round), the newest commits load and verify."""
    from gradientmail.engine.verify import verify_commit
    from tests.session.test_session import ALGORITHM
    from tests.training import Learner, commits, make_model, run_learners

    monkeypatch.setattr(payload, "PART_BYTES", 64)
    model = make_model()
    model[0].weight.requires_grad_(False)  # frozen: the same parts (and zero momentum) each round
    box = gm.MemoryMailbox()
    run_learners([Learner("a", 80, model=model)], box, ALGORITHM, keep_rounds=2)
    stored = _stored(box)
    indexes = [k for k in stored if k.endswith(".parts")]
    assert indexes
    reachable = set(indexes)
    for key in indexes:
        reachable |= {part["key"] for part in json.loads(stored[key])["parts"]}
    assert set(stored) == reachable  # no orphaned part, no part missing
    shared = [k for k in reachable if sum(k in stored[i].decode() for i in indexes) > 1]
    assert shared  # the case this test is about did happen
    gm.align(make_model(), mailbox=box)  # the newest commits are intact
    newest = commits(box)[-1]
    assert newest.round >= 2 * ALGORITHM.fragments
    checked = asyncio.run(verify_commit(box, newest.round))  # keys recomputed from parts
    assert checked.contributors == ("a",)


@pytest.mark.parametrize("part_bytes", [1 << 30, 512, 100])
def test_get_tensors_into_existing_memory(monkeypatch: pytest.MonkeyPatch, part_bytes: int) -> None:
    """``into=``: the payload lands in the given tensors (one blob, or parts, straddling
    tensors included) and those same tensors are returned."""
    monkeypatch.setattr(payload, "PART_BYTES", part_bytes)
    box = gm.MemoryMailbox()
    key, _ = asyncio.run(payload.put_tensors(box, BIG))
    into = {name: torch.zeros_like(t) for name, t in BIG.items()}
    pointers = {name: t.data_ptr() for name, t in into.items()}
    got = asyncio.run(payload.get_tensors(box, key, into=into))
    for name, tensor in BIG.items():
        assert got[name] is into[name]
        assert got[name].data_ptr() == pointers[name]
        assert torch.equal(into[name], tensor), name


def test_nothing_is_written_into_existing_memory_when_a_part_is_bad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(payload, "PART_BYTES", 512)
    box = gm.MemoryMailbox()
    key, _ = asyncio.run(payload.put_tensors(box, BIG))
    stored = _stored(box)
    last = json.loads(stored[key])["parts"][-1]["key"]
    broken = _tamper(box, last, bytes([stored[last][0] ^ 1]) + stored[last][1:])
    into = {name: torch.zeros_like(t) for name, t in BIG.items()}
    with pytest.raises(gm.PayloadCorrupt):
        asyncio.run(payload.get_tensors(broken, key, into=into))
    assert all(not t.any() for t in into.values())  # every part is verified before any copy
    wrong = {**into, "a": torch.zeros(299)}
    with pytest.raises(ValueError, match=r"into\['a'\] is torch.float32\[299\]"):
        asyncio.run(payload.get_tensors(box, key, into=wrong))
    with pytest.raises(ValueError, match="into= holds"):
        asyncio.run(payload.get_tensors(box, key, into={"a": into["a"]}))
    assert all(not t.any() for t in into.values())
