"""Payloads: tensors <-> content-addressed safetensors bytes in the mailbox (torch).

- ``transfer.py``: the codec (encode/decode, no pickle), hashing, parts, put/get with
  verification (:func:`put_tensors`, :func:`get_tensors`).
- ``buffers.py``: pools of fragment-sized buffers reused once nothing refers to them.
"""

from gradientmail.payload.transfer import (
    PART_BYTES,
    Encoded,
    blob_keys,
    can_send,
    decode,
    encode,
    encode_payload,
    get_tensors,
    put_tensors,
)

__all__ = [
    "PART_BYTES",
    "Encoded",
    "blob_keys",
    "can_send",
    "decode",
    "encode",
    "encode_payload",
    "get_tensors",
    "put_tensors",
]
