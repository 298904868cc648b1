"""The payload codec: standard safetensors both ways, hash-checked, zero-copy on read."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import gradientmail as gm
from gradientmail import payload
from gradientmail.protocol import TensorSpec, blob_key

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
