"""Payloads: tensors <-> content-addressed safetensors bytes in the mailbox (torch).

- ``transfer.py``: the codec (encode/decode, no pickle), hashing, parts, put/get with
  verification (:func:`put_tensors`, :func:`get_tensors`); uploads stream their parts.
- ``stream.py``: reading a payload as a stream of verified parts, decoded piece by piece
  into a destination or a sum (memory: a window of parts, not the payload).
- ``_format.py``: the safetensors layout both share (dtype names, header validation).
- ``buffers.py``: pools of fragment-sized buffers reused once nothing refers to them.
- ``_malloc.py``: capping glibc's arenas, so threads do not each keep freed parts.
"""

from gradientmail.payload import transfer
from gradientmail.payload.transfer import *  # noqa: F403 (the names of transfer.__all__)

__all__ = transfer.__all__
