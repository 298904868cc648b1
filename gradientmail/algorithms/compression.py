"""Deterministic compressors for pseudo-gradients.

A compressor turns one model tensor's pseudo-gradient (flattened, float32) into a few small
tensors that the engine stores in a safetensors payload as ``f"{tensor_name}#{suffix}"``,
and adds the decoded values, scaled by a contribution's weight, into a float32 accumulator.
Three are available (``numel`` elements, ``C`` = ``chunk``, ``nchunks = ceil(numel / C)``):

``TopK(density, bits, chunk)`` (``"topk"``)
    Per chunk keeps the ``k = max(1, round(density · C))`` entries of largest ``|value|``
    (Python's ``round``, half to even; the last chunk, of length ``L < C``, keeps
    ``min(k, L)``), everything else decodes to zero: use it with error feedback (keep
    ``e − decode(encode(e))`` as the next round's residual). Per chunk one float32
    ``scale`` = max ``|kept value|``; the kept values are quantized uniformly and
    symmetrically to ``2**bits`` levels over ``[-scale, scale]``. Parts: ``"idx"`` int16,
    the kept entries' positions inside their chunk, strictly increasing within a chunk;
    ``"val"`` uint8, the codes packed ``8 / bits`` a byte, first code in the lowest bits,
    the last byte zero-padded; ``"scale"`` float32 ``[nchunks]``. Bytes per element ≈
    ``density · (2 + bits / 8) + 4 / C``: 0.046 for the default (0.02, 2, 4096), about
    87 times less than float32. Error per kept value ≤ ``scale / (2**bits − 1)`` (half a
    quantization step), plus float32 rounding (a few ulp of ``scale``).

``Cast(dtype)`` (``"cast"``)
    Keeps every element, rounded to ``bfloat16`` or ``float16`` (round to nearest even).
    Part ``"val"`` of that dtype, 2 bytes per element. Relative error ≤ 2**-8 (bfloat16)
    or 2**-11 (float16, for normal values; encode refuses values that overflow it).

``Quantize(bits, chunk)`` (``"quantize"``)
    Keeps every element, quantized per chunk against ``scale`` = max ``|value|`` of the
    chunk (float32) to the integers ``[-M, M]``, ``M = 2**(bits−1) − 1`` (127 or 7).
    Parts: ``"q"``: int8 codes (bits 8), or codes ``+ 8`` two per uint8, the first in the
    low nibble, a zero high nibble padding an odd count (bits 4); ``"scale"`` float32
    ``[nchunks]``. Bytes per element ``1 + 4 / C`` (bits 8) or ``0.5 + 4 / C`` (bits 4).
    Error per element ≤ ``scale / (2·M)`` (``scale / 254`` for int8, ``scale / 14`` for 4
    bits), plus float32 rounding.

Decoding is bit-deterministic: :meth:`Compression.add_decoded` computes each decoded value
with a fixed sequence of float32 element-wise operations (each rounded once, no fused
multiply-add, no reductions), multiplies it by the weight rounded to float32, and adds the
product once into its element of ``out``. Every step is an IEEE-754 correctly rounded
operation, so the result is the same on any machine and with any number of threads. It
validates the parts completely before it writes anything (``PayloadCorrupt`` naming the
part otherwise). Encoding is deterministic too, except which of equally large entries
top-k keeps.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.settings import check, compressor_info

__all__ = [
    "COMPRESSIONS",
    "Cast",
    "Compression",
    "Quantize",
    "TopK",
    "compression_from_settings",
]


@runtime_checkable
class Compression(Protocol):
    """What the round engine needs of a compressor (see the module docstring)."""

    @property
    def name(self) -> str:
        """The settings' ``name``: ``"topk"``, ``"cast"`` or ``"quantize"``."""
        ...

    def settings(self) -> dict[str, Any]:
        """Every field and ``name``, JSON; :func:`compression_from_settings` reads it back."""
        ...

    def encode(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts (suffix -> contiguous CPU tensor) of a 1-D float32 tensor."""
        ...

    def add_decoded(
        self, out: torch.Tensor, parts: Mapping[str, torch.Tensor], weight: float, *, where: str
    ) -> None:
        """Validate ``parts`` against ``out.numel()``, then ``out += weight · decode``."""
        ...

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int, *, where: str) -> torch.Tensor:
        """The decoded float32 tensor of ``numel`` elements."""
        ...

    def encoded_bytes(self, numel: int) -> int:
        """The bytes of the tensors :meth:`encode` returns for ``numel`` elements."""
        ...


# -- shared helpers ---------------------------------------------------------------------------


def _f32(value: float) -> float:
    """``value`` rounded to float32 (to nearest even), as a Python float."""
    try:
        rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        rounded = math.inf
    return rounded


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _input(owner: object, values: torch.Tensor) -> torch.Tensor:
    """``values`` checked to be a 1-D float32 tensor, made contiguous."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{owner}.encode takes a tensor, not a {type(values).__name__}")
    if values.dtype != torch.float32 or values.dim() != 1:
        raise ValueError(
            f"{owner}.encode takes a 1-D float32 tensor, got {values.dtype} of shape "
            f"{list(values.shape)}"
        )
    return values.contiguous()


def _accumulator(owner: object, out: torch.Tensor, weight: float) -> float:
    """Check ``add_decoded``'s ``out`` and return ``weight`` rounded to float32."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 1:
        what = f"{out.dtype} of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else out
        raise ValueError(f"{owner}.add_decoded: out must be a 1-D float32 tensor, got {what}")
    w32 = _f32(float(weight))
    if not math.isfinite(w32):
        raise ValueError(f"{owner}.add_decoded: weight {weight!r} is not a finite float32")
    return w32


def _decode(
    codec: Compression, parts: Mapping[str, torch.Tensor], numel: int, where: str
) -> torch.Tensor:
    if not _is_int(numel) or numel < 0:
        raise ValueError(f"{codec}.decode: numel must be an int >= 0, got {numel!r}")
    out = torch.zeros(size=(numel,), dtype=torch.float32)
    codec.add_decoded(out, parts, 1.0, where=where)
    return out


def _add_scaled(
    out: torch.Tensor, decoded: torch.Tensor, w32: float, index: torch.Tensor | None
) -> None:
    """``out[i] = fl(out[i] + fl(w32 · decoded_i))`` at ``index`` (unique) or everywhere;
    ``decoded`` is overwritten. Multiply then add, two roundings: ``add_(x, alpha=w)``
    may fuse them."""
    if w32 != 1.0:  # fl(1 · d) == d: skipping the multiply changes no bit
        decoded.mul_(w32)
    if index is None:
        out.add_(decoded)
    else:  # every index once, so each element gets exactly one addition
        out.index_add_(0, index, decoded)


def _check_keys(parts: Mapping[str, torch.Tensor], expected: Sequence[str], where: str) -> None:
    if not isinstance(parts, Mapping):
        raise PayloadCorrupt(
            f"{where}#{expected[0]}: parts are a {type(parts).__name__}, not a mapping"
        )
    names = ", ".join(expected)
    for suffix in expected:
        if suffix not in parts:
            raise PayloadCorrupt(f"{where}#{suffix}: missing (expected parts {names})")
    extra = sorted(str(key) for key in parts if key not in expected)
    if extra:
        raise PayloadCorrupt(f"{where}#{extra[0]}: unexpected part (expected parts {names})")


def _part(
    parts: Mapping[str, torch.Tensor], suffix: str, dtype: torch.dtype, length: int, where: str
) -> torch.Tensor:
    """``parts[suffix]``, checked to be a 1-D tensor of ``dtype`` and ``length``."""
    tensor = parts[suffix]
    if not isinstance(tensor, torch.Tensor):
        raise PayloadCorrupt(f"{where}#{suffix}: a {type(tensor).__name__}, not a tensor")
    if tensor.dtype != dtype:
        raise PayloadCorrupt(f"{where}#{suffix}: dtype {tensor.dtype}, expected {dtype}")
    if tensor.dim() != 1 or tensor.numel() != length:
        raise PayloadCorrupt(f"{where}#{suffix}: shape {list(tensor.shape)}, expected [{length}]")
    return tensor


def _check_scale(scale: torch.Tensor, where: str) -> None:
    bad = ~(torch.isfinite(scale) & (scale >= 0))
    if bool(bad.any()):
        chunk = int(bad.nonzero()[0, 0])
        raise PayloadCorrupt(
            f"{where}#scale: chunk {chunk} has scale {float(scale[chunk])!r}, expected a "
            "finite value >= 0"
        )


def _check_padding(packed: torch.Tensor, used_bits: int, suffix: str, where: str) -> None:
    """The bits of the last byte past ``used_bits`` must be zero."""
    spare = used_bits % 8
    if spare and int(packed[-1]) >> spare:
        raise PayloadCorrupt(
            f"{where}#{suffix}: padding bits of the last byte are not zero "
            f"(byte {int(packed[-1])}, {spare} bits used)"
        )


def _packed_len(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2**bits) packed ``8 / bits`` a byte, the first in the lowest bits."""
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    nbytes = _packed_len(codes.numel(), bits)
    padded = torch.zeros(size=(nbytes * per,), dtype=torch.uint8)
    padded[: codes.numel()] = codes
    grid = padded.view(size=(nbytes, per))
    packed = torch.zeros(size=(nbytes,), dtype=torch.uint8)
    for j in range(per):
        packed.bitwise_or_(grid[:, j] << (bits * j))
    return packed


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`_pack`'s output, uint8."""
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(start=0, end=8, step=bits, dtype=torch.uint8)
    grid = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return grid.reshape(shape=(packed.numel() * per,))[:count]


def _segments(numel: int, chunk: int) -> list[tuple[int, int, int]]:
    """``(start, rows, width)``: the full chunks as one ``rows × chunk`` block, then the
    short last chunk (one row) if any."""
    full, tail = divmod(numel, chunk)
    segments = []
    if full:
        segments.append((0, full, chunk))
    if tail:
        segments.append((full * chunk, 1, tail))
    return segments


def _fields(cls: type, settings: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``settings`` less ``name``, checked to hold only fields of ``cls``."""
    if settings.get("name", name) != name:
        raise ValueError(f"{cls.__name__} reads settings named {name!r}, not {settings['name']!r}")
    known = [f.name for f in fields(cls)]
    values = {k: v for k, v in settings.items() if k != "name"}
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise ValueError(
            f"{cls.__name__} has no setting {unknown[0]!r} (its settings: {', '.join(known)})"
        )
    return values


# -- top-k ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopK:
    """Per chunk the largest ``density`` fraction of entries, quantized to ``bits``.

    Decoding, per kept entry with code ``q`` in a chunk of scale ``s`` (``L = 2**bits``,
    ``c = float32(2 / (L − 1))``, every step a float32 operation rounded once)::

        d = ((q · c) − 1) · s
        out[chunk_start + idx] = out[chunk_start + idx] + (float32(weight) · d)
    """

    density: float = 0.02
    """Fraction of each chunk kept, in (0, 1]."""
    bits: int = 2
    """Bits per kept value: 2, 4 or 8."""
    chunk: int = 4096
    """Elements per chunk, 1 to 32768 (positions inside a chunk are int16)."""

    def __post_init__(self) -> None:
        check(type(self).__name__, compressor_info("topk").fields, self)
        object.__setattr__(self, "density", float(self.density))

    @property
    def name(self) -> str:
        return "topk"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "density": self.density, "bits": self.bits, "chunk": self.chunk}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> TopK:
        return cls(**_fields(cls, settings, "topk"))

    @property
    def per_chunk(self) -> int:
        """Entries kept in a full chunk: ``max(1, round(density · chunk))``."""
        return max(1, round(self.density * self.chunk))

    def kept(self, numel: int) -> int:
        """Entries kept of a tensor of ``numel`` elements (a pure function of the settings)."""
        full, tail = divmod(numel, self.chunk)
        return full * self.per_chunk + min(self.per_chunk, tail)

    def _blocks(self, numel: int) -> list[tuple[int, int, int, int, int]]:
        """``(start, rows, width, kept_start, kept_width)`` per block of :func:`_segments`;
        row ``r`` of a block is chunk ``start // chunk + r``."""
        blocks = []
        kept_start = 0
        for start, rows, width in _segments(numel, self.chunk):
            kept_width = min(self.per_chunk, width)
            blocks.append((start, rows, width, kept_start, kept_width))
            kept_start += rows * kept_width
        return blocks

    def encoded_bytes(self, numel: int) -> int:
        kept = self.kept(numel)
        nchunks = -(-numel // self.chunk)
        return 2 * kept + _packed_len(kept, self.bits) + 4 * nchunks

    def encode(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parts ``idx`` (int16), ``val`` (uint8), ``scale`` (float32). Codes are
        ``clamp(round_half_even(((v / s) + 1) · (L − 1) / 2), 0, L − 1)`` (``s`` replaced
        by 1 in an all-zero chunk). ``ValueError`` if ``values`` holds a NaN or infinity
        among the entries top-k keeps (NaN counts as largest)."""
        x = _input(self, values)
        numel = x.numel()
        kept = self.kept(numel)
        nchunks = -(-numel // self.chunk)
        idx = torch.empty(size=(kept,), dtype=torch.int16)
        codes = torch.empty(size=(kept,), dtype=torch.uint8)
        scale = torch.empty(size=(nchunks,), dtype=torch.float32)
        half = float(((1 << self.bits) - 1) / 2)  # 1.5, 7.5, 127.5: exact in float32
        for start, rows, width, kept_start, kept_width in self._blocks(numel):
            block = x[start : start + rows * width].view(size=(rows, width))
            _, position = torch.topk(block.abs(), kept_width, dim=1, sorted=False)
            position, _ = torch.sort(position, dim=1)
            chosen = torch.gather(block, 1, position)
            chunk_scale = chosen.abs().amax(dim=1, keepdim=True)
            first = start // self.chunk
            scale[first : first + rows] = chunk_scale.view(size=(rows,))
            window = slice(kept_start, kept_start + rows * kept_width)
            idx[window] = position.view(size=(rows * kept_width,))
            divisor = torch.where(chunk_scale > 0, chunk_scale, torch.ones_like(chunk_scale))
            level = chosen.div_(divisor).add_(1.0).mul_(half).round_().clamp_(0, 2 * half)
            codes[window] = level.view(size=(rows * kept_width,))
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{self}.encode: the values hold a NaN or an infinity")
        return {"idx": idx, "val": _pack(codes, self.bits), "scale": scale}

    def add_decoded(
        self, out: torch.Tensor, parts: Mapping[str, torch.Tensor], weight: float, *, where: str
    ) -> None:
        """Validate ``parts`` (keys, dtypes, lengths, positions in range and strictly
        increasing within each chunk, scales finite and >= 0, the padding bits of ``val``
        zero), then ``out[i] += float32(weight) · d_i`` for the kept entries (see the class
        docstring for ``d``). ``PayloadCorrupt`` before anything is written otherwise."""
        w32 = _accumulator(self, out, weight)
        numel = out.numel()
        kept = self.kept(numel)
        _check_keys(parts, ("idx", "val", "scale"), where)
        idx = _part(parts, "idx", torch.int16, kept, where)
        val = _part(parts, "val", torch.uint8, _packed_len(kept, self.bits), where)
        scale = _part(parts, "scale", torch.float32, -(-numel // self.chunk), where)
        _check_scale(scale, where)
        _check_padding(val, kept * self.bits, "val", where)
        blocks = self._blocks(numel)
        position = idx.to(dtype=torch.int64)  # a copy: becomes the global index below
        for start, rows, width, kept_start, kept_width in blocks:
            block = position[kept_start : kept_start + rows * kept_width]
            self._check_positions(block.view(size=(rows, kept_width)), start, width, where)

        step = _f32(2 / ((1 << self.bits) - 1))
        decoded = _unpack(val, self.bits, kept).to(dtype=torch.float32)
        decoded.mul_(step).sub_(1.0)
        for start, rows, _, kept_start, kept_width in blocks:
            first = start // self.chunk
            window = slice(kept_start, kept_start + rows * kept_width)
            decoded[window].view(size=(rows, kept_width)).mul_(scale[first : first + rows, None])
            chunk_start = torch.arange(start=start, end=start + rows * self.chunk, step=self.chunk)
            position[window].view(size=(rows, kept_width)).add_(chunk_start[:, None])
        _add_scaled(out, decoded, w32, position)

    def _check_positions(self, rows: torch.Tensor, start: int, width: int, where: str) -> None:
        """Each row (one chunk's positions) in ``[0, width)`` and strictly increasing."""
        first = start // self.chunk
        outside = (rows[:, 0] < 0) | (rows[:, -1] >= width)
        if bool(outside.any()):
            row = int(outside.nonzero()[0, 0])
            raise PayloadCorrupt(
                f"{where}#idx: chunk {first + row} has a position outside [0, {width}) "
                f"(its positions start {rows[row, :8].tolist()})"
            )
        disorder = (rows[:, 1:] <= rows[:, :-1]).any(dim=1)
        if bool(disorder.any()):
            row = int(disorder.nonzero()[0, 0])
            raise PayloadCorrupt(
                f"{where}#idx: chunk {first + row}'s positions are not strictly increasing "
                f"(unsorted or duplicated; they start {rows[row, :8].tolist()})"
            )

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int, *, where: str) -> torch.Tensor:
        return _decode(self, parts, numel, where)


# -- cast -------------------------------------------------------------------------------------

CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Cast:
    """Every element rounded to a 16-bit float.

    Decoding: ``out[i] = out[i] + (float32(weight) · float32(val_i))`` (the conversion to
    float32 is exact; a multiply then an add, each rounded once in float32).
    """

    dtype: str = "bfloat16"
    """``"bfloat16"`` or ``"float16"``."""

    def __post_init__(self) -> None:
        check(type(self).__name__, compressor_info("cast").fields, self)

    @property
    def name(self) -> str:
        return "cast"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Cast:
        return cls(**_fields(cls, settings, "cast"))

    @property
    def torch_dtype(self) -> torch.dtype:
        return CAST_DTYPES[self.dtype]

    def encoded_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Part ``val``: the values rounded to nearest even. ``ValueError`` if the values
        hold a NaN or infinity or overflow the dtype (float16 beyond ±65504)."""
        val = _input(self, values).to(dtype=self.torch_dtype)
        if not bool(torch.isfinite(val).all()):
            raise ValueError(
                f"{self}.encode: the values hold a NaN or an infinity, or overflow {self.dtype}"
            )
        return {"val": val}

    def add_decoded(
        self, out: torch.Tensor, parts: Mapping[str, torch.Tensor], weight: float, *, where: str
    ) -> None:
        """Validate ``parts`` (key, dtype, length, every value finite), then add (see the
        class docstring). ``PayloadCorrupt`` before anything is written otherwise."""
        w32 = _accumulator(self, out, weight)
        _check_keys(parts, ("val",), where)
        val = _part(parts, "val", self.torch_dtype, out.numel(), where)
        finite = torch.isfinite(val)
        if not bool(finite.all()):
            at = int((~finite).nonzero()[0, 0])
            raise PayloadCorrupt(f"{where}#val: element {at} is {float(val[at])!r}, not finite")
        _add_scaled(out, val.to(dtype=torch.float32), w32, None)

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int, *, where: str) -> torch.Tensor:
        return _decode(self, parts, numel, where)


# -- quantize ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantize:
    """Every element quantized per chunk to ``bits``-bit signed integers.

    Decoding, per element with integer code ``q`` in ``[-M, M]`` (``M = 2**(bits−1) − 1``)
    in a chunk of scale ``s``, every step a float32 operation rounded once::

        f = s / M                  (per chunk)
        d = float32(q) · f
        out[i] = out[i] + (float32(weight) · d)
    """

    bits: int = 8
    """8 (int8 codes) or 4 (two codes per uint8)."""
    chunk: int = 4096
    """Elements per scale, >= 1."""

    def __post_init__(self) -> None:
        check(type(self).__name__, compressor_info("quantize").fields, self)

    @property
    def name(self) -> str:
        return "quantize"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "bits": self.bits, "chunk": self.chunk}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Quantize:
        return cls(**_fields(cls, settings, "quantize"))

    @property
    def levels(self) -> int:
        """``M``: codes are the integers ``[-M, M]``."""
        return (1 << (self.bits - 1)) - 1

    def encoded_bytes(self, numel: int) -> int:
        return _packed_len(numel, self.bits) + 4 * -(-numel // self.chunk)

    def encode(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parts ``q`` and ``scale``. Codes are ``clamp(round_half_even((v / s) · M), −M,
        M)`` (``s`` replaced by 1 in an all-zero chunk). ``ValueError`` if the values hold
        a NaN or an infinity."""
        x = _input(self, values)
        numel = x.numel()
        scale = torch.empty(size=(-(-numel // self.chunk),), dtype=torch.float32)
        level = torch.empty(size=(numel,), dtype=torch.float32)
        m = float(self.levels)
        for start, rows, width in _segments(numel, self.chunk):
            block = x[start : start + rows * width].view(size=(rows, width))
            chunk_scale = block.abs().amax(dim=1, keepdim=True)
            first = start // self.chunk
            scale[first : first + rows] = chunk_scale.view(size=(rows,))
            divisor = torch.where(chunk_scale > 0, chunk_scale, torch.ones_like(chunk_scale))
            target = level[start : start + rows * width].view(size=(rows, width))
            torch.div(block, divisor, out=target)
            target.mul_(m).round_().clamp_(-m, m)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{self}.encode: the values hold a NaN or an infinity")
        if self.bits == 8:
            q = level.to(dtype=torch.int8)
        else:
            q = _pack(level.add_(8.0).to(dtype=torch.uint8), 4)
        return {"q": q, "scale": scale}

    def add_decoded(
        self, out: torch.Tensor, parts: Mapping[str, torch.Tensor], weight: float, *, where: str
    ) -> None:
        """Validate ``parts`` (keys, dtypes, lengths, codes in ``[-M, M]``, a zero padding
        nibble, scales finite and >= 0), then add (see the class docstring).
        ``PayloadCorrupt`` before anything is written otherwise."""
        w32 = _accumulator(self, out, weight)
        numel = out.numel()
        _check_keys(parts, ("q", "scale"), where)
        code_dtype = torch.int8 if self.bits == 8 else torch.uint8
        q = _part(parts, "q", code_dtype, _packed_len(numel, self.bits), where)
        scale = _part(parts, "scale", torch.float32, -(-numel // self.chunk), where)
        _check_scale(scale, where)
        if self.bits == 8:
            bad = q < -self.levels
        else:
            _check_padding(q, numel * 4, "q", where)
            q = _unpack(q, 4, numel)
            bad = q == 0  # stored q + 8: 1..15
        if bool(bad.any()):
            at = int(bad.nonzero()[0, 0])
            raise PayloadCorrupt(
                f"{where}#q: element {at} has a code out of [-{self.levels}, {self.levels}]"
            )

        decoded = q.to(dtype=torch.float32)
        if self.bits == 4:
            decoded.sub_(8.0)  # exact
        factor = scale / torch.full_like(scale, float(self.levels))
        for start, rows, width in _segments(numel, self.chunk):
            first = start // self.chunk
            block = decoded[start : start + rows * width].view(size=(rows, width))
            block.mul_(factor[first : first + rows, None])
        _add_scaled(out, decoded, w32, None)

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int, *, where: str) -> torch.Tensor:
        return _decode(self, parts, numel, where)


COMPRESSIONS: dict[str, type[TopK] | type[Cast] | type[Quantize]] = {
    "topk": TopK,
    "cast": Cast,
    "quantize": Quantize,
}


def compression_from_settings(settings: Mapping[str, Any]) -> Compression:
    """The compressor ``settings`` (a :meth:`Compression.settings` dict) describes.

    ``ProtocolError`` for a missing or unknown ``name``; ``ValueError`` (from the class)
    for a bad or unknown field.
    """
    name = settings.get("name")
    cls = COMPRESSIONS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(
            f"unknown compression {name!r}; known: {', '.join(sorted(COMPRESSIONS))}"
        )
    return cls.from_settings(settings)
