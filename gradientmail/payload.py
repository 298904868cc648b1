"""Tensors ↔ mailbox bytes: safetensors, named by their sha256.

No pickle ever crosses the mailbox: safetensors holds a JSON header and raw little-endian
buffers, so bytes read from a shared bucket cannot run code. A payload's key is
``blobs/{sha256 of its bytes}``; reading verifies the hash (:class:`PayloadCorrupt` on a
mismatch) and the layout the reader expects (:class:`ProtocolError`). Writing the same
tensors twice writes one object.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.protocol import TensorSpec, blob_key, blob_sha

__all__ = ["decode", "encode", "get_tensors", "put_tensors"]


def encode(tensors: Mapping[str, torch.Tensor]) -> tuple[str, bytes]:
    """Serialise ``tensors``; return ``(blobs/<sha256>, bytes)``."""
    ready = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    data = st_save(ready)
    return blob_key(hashlib.sha256(data).hexdigest()), data


def decode(
    key: str, data: bytes, expect: Sequence[TensorSpec] | None = None
) -> dict[str, torch.Tensor]:
    """Verify ``data`` against the hash in ``key`` and the expected layout, then load it."""
    sha = blob_sha(key)
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha:
        raise PayloadCorrupt(
            f"{key}: the {len(data)} bytes read hash to {actual[:16]}…; the object is "
            "corrupt or truncated"
        )
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise ProtocolError(f"{key}: not a safetensors payload ({exc})") from exc
    if expect is not None:
        wanted = {spec.name: spec for spec in expect}
        if set(tensors) != set(wanted):
            missing = sorted(set(wanted) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(wanted))[:3]
            raise ProtocolError(
                f"{key}: tensors differ from the manifest (missing {missing}, unexpected {extra})"
            )
        for name, tensor in tensors.items():
            spec = wanted[name]
            if tuple(tensor.shape) != spec.shape or str(tensor.dtype) != spec.dtype:
                raise ProtocolError(
                    f"{key}: {name} is {tensor.dtype}{list(tensor.shape)}, the manifest "
                    f"says {spec.dtype}{list(spec.shape)}"
                )
    return tensors


async def put_tensors(box: Mailbox, tensors: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """Store ``tensors`` as a blob; return its key and size. Idempotent."""
    key, data = encode(tensors)
    await box.put_if_absent(key, data)  # False: the same bytes are already there
    return key, len(data)


async def get_tensors(
    box: Mailbox, key: str, expect: Sequence[TensorSpec] | None = None
) -> dict[str, torch.Tensor]:
    data = await box.get(key)
    if data is None:
        raise ProtocolError(
            f"{key}: the payload is missing (swept, or written to a different store)"
        )
    return decode(key, data, expect)
