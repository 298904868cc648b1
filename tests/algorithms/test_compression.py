"""The pseudo-gradient compressors of ``gradientmail.algorithms.compression``: what they
keep, their error bounds, bitwise-deterministic decoding, and payload validation."""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from gradientmail.algorithms.compression import (
    Cast,
    Compression,
    Quantize,
    TopK,
    compression_from_settings,
)
from gradientmail.errors import PayloadCorrupt, ProtocolError

WHERE = "p/abc: layer.weight"
ALLOWED_DTYPES = {
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.int32,
}

TOPKS = [
    TopK(),
    TopK(density=0.1, bits=4, chunk=64),
    TopK(density=0.5, bits=8, chunk=7),
    TopK(density=1.0, bits=2, chunk=16),
    TopK(density=0.001, bits=2, chunk=100),  # round(0.1) = 0: keeps max(1, 0) = 1
    TopK(density=0.3, bits=4, chunk=1),
    TopK(density=0.01, bits=8, chunk=32768),
]
QUANTIZES = [Quantize(), Quantize(bits=4, chunk=64), Quantize(bits=8, chunk=1), Quantize(4, 7)]
CASTS = [Cast(), Cast("float16")]
ALL: list[Compression] = [*TOPKS, *QUANTIZES, *CASTS]
SIZES = [0, 1, 5, 100, 3 * 64 + 17, 4096, 2 * 4096 + 123, 40000]


def _id(codec: object) -> str:
    return str(codec).replace(" ", "")


def _f32(value: float) -> float:
    rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return rounded


def _data(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Heavy-tailed and varied in scale per region, like a pseudo-gradient.
    x = torch.randn(size=(numel,), generator=generator, dtype=torch.float32)
    return x * torch.rand(size=(numel,), generator=generator, dtype=torch.float32).pow(4) * 3


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(dtype=torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(chunk, numel - start)) for start in range(0, numel, chunk)]


# -- encoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("codec", ALL, ids=_id)
def test_encoded_parts_are_contiguous_allowed_and_sized_exactly(
    codec: Compression, numel: int
) -> None:
    parts = codec.encode(_data(numel))
    for suffix, tensor in parts.items():
        assert tensor.dtype in ALLOWED_DTYPES, suffix
        assert tensor.is_contiguous(), suffix
        assert tensor.device.type == "cpu", suffix
        assert tensor.dim() == 1, suffix
    assert codec.encoded_bytes(numel) == sum(t.numel() * t.element_size() for t in parts.values())
    assert codec.decode(parts, numel, where=WHERE).shape == (numel,)


@pytest.mark.parametrize("codec", ALL, ids=_id)
def test_parts_do_not_share_memory_with_the_input(codec: Compression) -> None:
    # The engine subtracts the decoded parts from the very tensor it encoded.
    x = _data(300, seed=3)
    parts = codec.encode(x)
    copies = {suffix: tensor.clone() for suffix, tensor in parts.items()}
    codec.add_decoded(x, parts, -1.0, where=WHERE)
    x.fill_(7.0)
    assert all(torch.equal(parts[suffix], copies[suffix]) for suffix in parts)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("codec", TOPKS, ids=_id)
def test_topk_keeps_the_largest_per_chunk_within_the_quantization_bound(
    codec: TopK, numel: int
) -> None:
    x = _data(numel, seed=numel)
    parts = codec.encode(x)
    idx, scale = parts["idx"], parts["scale"]
    assert idx.dtype == torch.int16
    assert parts["val"].dtype == torch.uint8
    decoded = codec.decode(parts, numel, where=WHERE)
    levels = 2**codec.bits
    k = max(1, round(codec.density * codec.chunk))
    kept_at = 0
    for number, (start, length) in enumerate(_chunks(numel, codec.chunk)):
        values = x[start : start + length]
        listed = values.tolist()
        keep = min(k, length)
        # Brute force: the positions of the `keep` largest |values| (no ties in random data).
        order = sorted(range(length), key=lambda i: -abs(listed[i]))
        expected = sorted(order[:keep])
        local = idx[kept_at : kept_at + keep].tolist()
        kept_at += keep
        assert local == expected, f"chunk {number}"
        assert all(0 <= i < length for i in local)
        assert all(a < b for a, b in itertools.pairwise(local))
        chunk_scale = float(scale[number])
        assert chunk_scale == max(abs(listed[i]) for i in expected)
        # Kept entries within half a quantization step (plus float32 rounding); the rest 0.
        got = decoded[start : start + length]
        bound = chunk_scale / (levels - 1) + 4 * torch.finfo(torch.float32).eps * chunk_scale
        error = (got[expected] - values[expected]).abs().max()
        assert float(error) <= bound, f"chunk {number}: {float(error)} > {bound}"
        dropped = torch.ones(length, dtype=torch.bool)
        dropped[expected] = False
        assert not bool(got[dropped].any())
    assert kept_at == idx.numel() == codec.kept(numel)
    assert scale.numel() == len(_chunks(numel, codec.chunk))


def test_topk_all_zero_chunk_has_zero_scale_and_decodes_to_zero() -> None:
    codec = TopK(density=0.25, bits=2, chunk=8)
    x = torch.zeros(size=(20,), dtype=torch.float32)
    x[17] = -3.0
    x[19] = 3.0  # 2 bits have no zero level: a kept 0 would decode to ±scale/3
    parts = codec.encode(x)
    assert parts["scale"].tolist() == [0.0, 0.0, 3.0]
    assert _same_bits(codec.decode(parts, 20, where=WHERE), x)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("codec", QUANTIZES, ids=_id)
def test_quantize_error_is_bounded_by_the_chunk_scale(codec: Quantize, numel: int) -> None:
    x = _data(numel, seed=numel + 1)
    parts = codec.encode(x)
    decoded = codec.decode(parts, numel, where=WHERE)
    m = 2 ** (codec.bits - 1) - 1
    for number, (start, length) in enumerate(_chunks(numel, codec.chunk)):
        values = x[start : start + length]
        chunk_scale = float(parts["scale"][number])
        assert chunk_scale == float(values.abs().max())
        bound = chunk_scale / (2 * m) + 4 * torch.finfo(torch.float32).eps * chunk_scale
        error = float((decoded[start : start + length] - values).abs().max())
        assert error <= bound, f"chunk {number}: {error} > {bound}"


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("codec", CASTS, ids=_id)
def test_cast_decodes_to_the_rounded_values(codec: Cast, numel: int) -> None:
    x = _data(numel, seed=numel + 2)
    decoded = codec.decode(codec.encode(x), numel, where=WHERE)
    rounded = x.to(dtype=codec.torch_dtype).to(dtype=torch.float32)
    # Equal values; a value that rounds to -0.0 decodes to +0.0 (0.0 + -0.0, what a sum adds).
    assert torch.equal(decoded, rounded)
    assert _same_bits(decoded, rounded + 0.0)


@pytest.mark.parametrize("codec", ALL, ids=_id)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_refuses_non_finite_values(codec: Compression, bad: float) -> None:
    x = _data(300)
    x[123] = bad
    with pytest.raises(ValueError, match="NaN or an infinity"):
        codec.encode(x)


def test_cast_float16_refuses_overflow() -> None:
    with pytest.raises(ValueError, match="overflow float16"):
        Cast("float16").encode(torch.tensor([1.0, 70000.0]))
    Cast("bfloat16").encode(torch.tensor([1.0, 70000.0]))


@pytest.mark.parametrize("codec", [TopK(), Quantize(), Cast()], ids=_id)
def test_encode_refuses_a_bad_input(codec: Compression) -> None:
    with pytest.raises(ValueError, match="1-D float32"):
        codec.encode(torch.zeros(size=(2, 3), dtype=torch.float32))
    with pytest.raises(ValueError, match="1-D float32"):
        codec.encode(torch.zeros(size=(6,), dtype=torch.float64))


# -- bitwise decoding -------------------------------------------------------------------------


@pytest.mark.parametrize("weight", [1.0, 0.3, 1 / 3, -2.5, 1e-3, 0.0])
@pytest.mark.parametrize("codec", ALL, ids=_id)
def test_add_decoded_adds_the_float32_product_bitwise(codec: Compression, weight: float) -> None:
    numel = 2 * 4096 + 123
    parts = codec.encode(_data(numel, seed=7))
    decoded = codec.decode(parts, numel, where=WHERE)
    out = _data(numel, seed=8) + 1e-3  # no -0.0: -0 + +0 would be +0
    expected = out + decoded.mul(_f32(weight))
    codec.add_decoded(out, parts, weight, where=WHERE)
    assert _same_bits(out, expected)


@pytest.mark.parametrize("codec", ALL, ids=_id)
def test_decode_is_deterministic_across_calls_and_thread_counts(codec: Compression) -> None:
    numel = 3 * 4096 + 5
    x = _data(numel, seed=9)
    parts = codec.encode(x)
    first = codec.decode(parts, numel, where=WHERE)
    assert _same_bits(first, codec.decode(parts, numel, where=WHERE))
    accumulated = _data(numel, seed=10)
    reference = accumulated.clone()
    codec.add_decoded(reference, parts, 0.37, where=WHERE)
    for threads in (1, 2, 3):
        with _threads(threads):
            assert _same_bits(first, codec.decode(parts, numel, where=WHERE))
            again = accumulated.clone()
            codec.add_decoded(again, parts, 0.37, where=WHERE)
            assert _same_bits(again, reference)
            encoded = codec.encode(x)
            assert encoded.keys() == parts.keys()
            assert all(torch.equal(encoded[k], parts[k]) for k in parts)


@pytest.mark.parametrize("codec", ALL, ids=_id)
def test_decode_of_nothing(codec: Compression) -> None:
    parts = codec.encode(torch.zeros(size=(0,), dtype=torch.float32))
    assert all(t.numel() == 0 for t in parts.values())
    assert codec.decode(parts, 0, where=WHERE).shape == (0,)
    assert codec.encoded_bytes(0) == 0


# -- error feedback ---------------------------------------------------------------------------


@pytest.mark.parametrize("codec", TOPKS[:4], ids=_id)
def test_error_feedback_with_topk_conserves_the_residual(codec: TopK) -> None:
    numel = 2 * 4096 + 300
    x = _data(numel, seed=11)
    decoded = codec.decode(codec.encode(x), numel, where=WHERE)
    residual = x - decoded
    torch.testing.assert_close(decoded + residual, x, rtol=1e-6, atol=1e-6)

    inputs = torch.zeros(size=(numel,), dtype=torch.float64)
    sent = torch.zeros(size=(numel,), dtype=torch.float64)
    residual = torch.zeros(size=(numel,), dtype=torch.float32)
    for round_ in range(20):
        step = _data(numel, seed=100 + round_)
        inputs += step.to(dtype=torch.float64)
        e = residual + step
        decoded = codec.decode(codec.encode(e), numel, where=WHERE)
        sent += decoded.to(dtype=torch.float64)
        residual = e - decoded
    total = sent + residual.to(dtype=torch.float64)
    # Only the float32 roundings of the 20 additions and subtractions remain.
    torch.testing.assert_close(total, inputs, rtol=0, atol=2e-5)


# -- malformed payloads -----------------------------------------------------------------------

Mutation = Callable[[dict[str, torch.Tensor]], None]


def _drop(suffix: str) -> Mutation:
    def mutate(parts: dict[str, torch.Tensor]) -> None:
        del parts[suffix]

    return mutate


def _retype(suffix: str) -> Mutation:
    def mutate(parts: dict[str, torch.Tensor]) -> None:
        tensor = parts[suffix]
        other = torch.int32 if tensor.dtype != torch.int32 else torch.int16
        parts[suffix] = tensor.to(dtype=other)

    return mutate


def _shorten(suffix: str) -> Mutation:
    def mutate(parts: dict[str, torch.Tensor]) -> None:
        parts[suffix] = parts[suffix][:-1].clone()

    return mutate


def _lengthen(suffix: str) -> Mutation:
    def mutate(parts: dict[str, torch.Tensor]) -> None:
        parts[suffix] = torch.cat([parts[suffix], parts[suffix][-1:]])

    return mutate


def _reshape(suffix: str) -> Mutation:
    def mutate(parts: dict[str, torch.Tensor]) -> None:
        parts[suffix] = parts[suffix].reshape(shape=(1, -1))

    return mutate


def _set(suffix: str, position: int, value: float) -> Mutation:
    def mutate(parts: dict[str, torch.Tensor]) -> None:
        tensor = parts[suffix].clone()
        tensor[position] = value
        parts[suffix] = tensor

    return mutate


def _extra(parts: dict[str, torch.Tensor]) -> None:
    parts["junk"] = torch.zeros(size=(1,), dtype=torch.uint8)


def _not_a_tensor(suffix: str) -> Mutation:
    def mutate(parts: dict[str, torch.Tensor]) -> None:
        parts[suffix] = parts[suffix].tolist()  # type: ignore[assignment]

    return mutate


def _generic(suffixes: list[str]) -> Iterator[tuple[str, str, Mutation]]:
    for suffix in suffixes:
        yield f"missing-{suffix}", suffix, _drop(suffix)
        yield f"dtype-{suffix}", suffix, _retype(suffix)
        yield f"short-{suffix}", suffix, _shorten(suffix)
        yield f"long-{suffix}", suffix, _lengthen(suffix)
        yield f"2d-{suffix}", suffix, _reshape(suffix)
        yield f"list-{suffix}", suffix, _not_a_tensor(suffix)
    yield "extra", "junk", _extra


def _scale_cases() -> Iterator[tuple[str, str, Mutation]]:
    for label, value in (("negative", -1.0), ("nan", float("nan")), ("inf", float("inf"))):
        yield f"scale-{label}", "scale", _set("scale", 1, value)


# TopK(density=0.25, bits=2, chunk=8) on 21 elements: chunks of 8, 8, 5, keeping 2, 2, 2
# (6 codes: 12 bits, so the last byte has 4 bits of padding).
TOPK_BAD = TopK(density=0.25, bits=2, chunk=8)
TOPK_CASES = [
    *_generic(["idx", "val", "scale"]),
    *_scale_cases(),
    ("idx-negative", "idx", _set("idx", 0, -1)),
    ("idx-past-chunk", "idx", _set("idx", 1, 8)),
    ("idx-past-tail", "idx", _set("idx", 5, 5)),
    ("idx-far", "idx", _set("idx", 3, 30000)),
    ("idx-duplicate", "idx", _set("idx", 1, -99)),  # replaced below with a real duplicate
    ("val-padding", "val", _set("val", 1, 255)),
]
QUANTIZE_CASES = [
    *_generic(["q", "scale"]),
    *_scale_cases(),
    ("q-minus-128", "q", _set("q", 4, -128)),
]
QUANTIZE4_CASES = [
    *_generic(["q", "scale"]),
    *_scale_cases(),
    ("q-zero-nibble", "q", _set("q", 2, 0x80)),  # low nibble 0 = code -8
    ("q-padding", "q", _set("q", 10, 0xF8)),  # 21 codes: the high nibble of byte 10 pads
]
CAST_CASES = [
    *_generic(["val"]),
    ("val-nan", "val", _set("val", 3, float("nan"))),
    ("val-inf", "val", _set("val", 3, float("-inf"))),
]


def _duplicate_and_unsorted() -> Iterator[tuple[str, str, Mutation]]:
    def duplicate(parts: dict[str, torch.Tensor]) -> None:
        idx = parts["idx"].clone()
        idx[3] = idx[2]
        parts["idx"] = idx

    def unsorted(parts: dict[str, torch.Tensor]) -> None:
        idx = parts["idx"].clone()
        idx[[4, 5]] = idx[[5, 4]]
        parts["idx"] = idx

    yield "idx-duplicate", "idx", duplicate
    yield "idx-unsorted", "idx", unsorted


TOPK_CASES = [case for case in TOPK_CASES if case[0] != "idx-duplicate"]
TOPK_CASES += list(_duplicate_and_unsorted())

MALFORMED: list[Any] = [
    *(pytest.param(TOPK_BAD, s, m, id=f"topk-{n}") for n, s, m in TOPK_CASES),
    *(pytest.param(Quantize(8, 8), s, m, id=f"q8-{n}") for n, s, m in QUANTIZE_CASES),
    *(pytest.param(Quantize(4, 8), s, m, id=f"q4-{n}") for n, s, m in QUANTIZE4_CASES),
    *(pytest.param(Cast(), s, m, id=f"bf16-{n}") for n, s, m in CAST_CASES),
    *(pytest.param(Cast("float16"), s, m, id=f"f16-{n}") for n, s, m in CAST_CASES),
]


@pytest.mark.parametrize(("codec", "suffix", "mutate"), MALFORMED)
def test_malformed_payload_raises_and_writes_nothing(
    codec: Compression, suffix: str, mutate: Mutation
) -> None:
    numel = 21
    x = _data(numel, seed=12)
    parts = codec.encode(x)
    codec.decode(parts, numel, where=WHERE)  # the unmutated parts are fine
    mutate(parts)
    out = _data(numel, seed=13)
    before = out.clone()
    with pytest.raises(PayloadCorrupt, match=f"^{WHERE}#{suffix}: ") as raised:
        codec.add_decoded(out, parts, 0.5, where=WHERE)
    assert _same_bits(out, before), str(raised.value)
    with pytest.raises(PayloadCorrupt, match=f"#{suffix}: "):
        codec.decode(parts, numel, where=WHERE)


@pytest.mark.parametrize("codec", [TopK(0.25, 2, 8), Quantize(8, 8), Cast()], ids=_id)
def test_parts_for_another_length_are_refused(codec: Compression) -> None:
    parts = codec.encode(_data(21))
    # Other chunk counts (TopK's lengths depend on the chunk layout only: 20 would pass).
    for numel in (16, 25, 0, 100):
        with pytest.raises(PayloadCorrupt, match=f"^{WHERE}#"):
            codec.decode(parts, numel, where=WHERE)


def test_add_decoded_refuses_a_bad_accumulator_or_weight() -> None:
    codec = Quantize()
    parts = codec.encode(_data(10))
    with pytest.raises(ValueError, match="1-D float32"):
        codec.add_decoded(torch.zeros(size=(10,), dtype=torch.float64), parts, 1.0, where=WHERE)
    with pytest.raises(ValueError, match="weight"):
        codec.add_decoded(torch.zeros(size=(10,)), parts, float("nan"), where=WHERE)


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL, ids=_id)
def test_settings_round_trip_through_json(codec: Compression) -> None:
    settings = codec.settings()
    assert settings["name"] == codec.name
    assert isinstance(codec, Compression)
    again = compression_from_settings(json.loads(json.dumps(settings)))
    assert again == codec
    assert again.settings() == settings


def test_settings_name_every_field() -> None:
    assert TopK().settings() == {"name": "topk", "density": 0.02, "bits": 2, "chunk": 4096}
    assert Cast().settings() == {"name": "cast", "dtype": "bfloat16"}
    assert Quantize().settings() == {"name": "quantize", "bits": 8, "chunk": 4096}
    assert TopK(density=1).settings()["density"] == 1.0


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: TopK(density=0), "density"),
        (lambda: TopK(density=1.5), "density"),
        (lambda: TopK(density=float("nan")), "density"),
        (lambda: TopK(density=True), "density"),
        (lambda: TopK(density="0.1"), "density"),
        (lambda: TopK(bits=3), "bits"),
        (lambda: TopK(bits=True), "bits"),
        (lambda: TopK(bits=2.0), "bits"),
        (lambda: TopK(chunk=0), "chunk"),
        (lambda: TopK(chunk=32769), "chunk"),
        (lambda: TopK(chunk=True), "chunk"),
        (lambda: Cast(dtype="float32"), "dtype"),
        (lambda: Quantize(bits=2), "bits"),
        (lambda: Quantize(bits=True), "bits"),
        (lambda: Quantize(chunk=0), "chunk"),
        (lambda: Quantize(chunk=False), "chunk"),
        (lambda: compression_from_settings({"name": "topk", "bits": 5}), "bits"),
        (lambda: compression_from_settings({"name": "cast", "dtype": "int8"}), "dtype"),
        (lambda: compression_from_settings({"name": "quantize", "colour": 1}), "colour"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_field(
    make: Callable[[], object], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def test_bad_settings_message_names_class_and_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"^TopK\(bits=3\) must be 2, 4 or 8$"):
        TopK(bits=3)
    with pytest.raises(ValueError, match=r"^Quantize\(bits=2\) must be 8 or 4$"):
        Quantize(bits=2)
    with pytest.raises(ValueError, match=r"^Cast\(dtype='int8'\) must be 'bfloat16' or 'float16'$"):
        Cast(dtype="int8")


@pytest.mark.parametrize("settings", [{"name": "gzip"}, {"density": 0.1}, {"name": 3}])
def test_unknown_compression_is_a_protocol_error(settings: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match=r"unknown compression .*known: cast, quantize, topk"):
        compression_from_settings(settings)
    if "name" in settings:
        with pytest.raises(ProtocolError, match=repr(settings["name"])):
            compression_from_settings(settings)


@pytest.mark.parametrize(
    ("codec", "numel", "expected"),
    [
        (TopK(), 4096, 82 * 2 + 21 + 4),  # k = round(81.92) = 82
        (TopK(), 4096 + 10, (82 + 10) * 2 + 23 + 8),
        (TopK(density=0.5, bits=8, chunk=4), 10, 6 * 2 + 6 + 12),
        (Cast(), 7, 14),
        (Quantize(), 4097, 4097 + 8),
        (Quantize(bits=4, chunk=4), 9, 5 + 12),
    ],
    ids=lambda v: _id(v) if not isinstance(v, int) else str(v),
)
def test_encoded_bytes_by_hand(codec: Compression, numel: int, expected: int) -> None:
    assert codec.encoded_bytes(numel) == expected
