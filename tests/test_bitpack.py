"""Bit packing: exact sizes, LSB-first layout, round trips for widths 1–8, backends agree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.kernels import numpy_ops


def reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Bit-by-bit LSB-first packing, the layout docs/format.md specifies."""
    bit_rows = ((codes[..., None].astype(np.uint16) >> np.arange(bits)) & 1).astype(np.uint8)
    return np.packbits(bit_rows.reshape(*codes.shape[:-1], -1), axis=-1, bitorder="little")


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 300), rows=st.integers(0, 4),
       seed=st.integers(0, 2**32 - 1))
def test_round_trip_and_layout(bits, n, rows, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, (rows, n)).astype(np.uint8)
    packed = numpy_ops.pack_bits(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (rows, (n * bits + 7) // 8)
    if rows and n:
        np.testing.assert_array_equal(packed, reference_pack(codes, bits))
    np.testing.assert_array_equal(numpy_ops.unpack_bits(packed, bits, n), codes)


@settings(max_examples=100, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_torch_matches_numpy(bits, n, seed):
    torch = pytest.importorskip("torch")
    from kvtool.kernels import torch_ops

    codes = np.random.default_rng(seed).integers(0, 1 << bits, (3, 2, n)).astype(np.uint8)
    packed = numpy_ops.pack_bits(codes, bits)
    packed_t = torch_ops.pack_bits(torch.from_numpy(codes), bits)
    np.testing.assert_array_equal(packed_t.numpy(), packed)
    np.testing.assert_array_equal(torch_ops.unpack_bits(torch.from_numpy(packed), bits, n).numpy(),
                                  codes)


def test_three_bit_codes_cross_byte_boundaries():
    codes = np.array([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=np.uint8)
    # bit stream, each code LSB first: 100 010 11|0 001 101 0|11 111 000
    assert numpy_ops.pack_bits(codes, 3).tolist() == [[0b11010001, 0b01011000, 0b00011111]]


def test_empty_rows_and_tokens():
    from kvtool.codecs import get_codec

    x = np.zeros((2, 0, 128), dtype=np.float16)
    for codec_id in ("turbo3", "int4", "kivi2", "prism"):
        codec = get_codec(codec_id)
        assert codec.decode(codec.encode(x)).shape == (2, 0, 128), codec_id


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 300), rows=st.integers(0, 4),
       seed=st.integers(0, 2**32 - 1))
def test_unpack_lookup_equals_take_of_unpacked(bits, n, rows, seed):
    from kvtool.kernels import bitpack

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (rows, n)).astype(np.uint8)
    values = rng.standard_normal(1 << bits).astype(np.float32)
    values[0] = -0.0  # values are copied bit for bit, sign of zero included
    packed = numpy_ops.pack_bits(codes, bits)
    want = numpy_ops.take(values, numpy_ops.unpack_bits(packed, bits, n)).view(np.uint32)
    got = numpy_ops.unpack_lookup(packed, bits, n, values)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint32), want)
    torch = pytest.importorskip("torch")
    from kvtool.kernels import torch_ops

    packed_t = torch.from_numpy(packed)
    # torch_ops runs CPU tensors through numpy; bitpack with torch_ops is the path GPUs take
    for got_t in (torch_ops.unpack_lookup(packed_t, bits, n, values),
                  bitpack.unpack_lookup(torch_ops, packed_t, bits, n, values)):
        assert got_t.dtype == torch.float32 and tuple(got_t.shape) == (rows, n)
        np.testing.assert_array_equal(got_t.contiguous().numpy().view(np.uint32), want)


def test_unpack_lookup_leading_axes_and_bad_tables():
    from kvtool.kernels import bitpack

    codes = np.random.default_rng(0).integers(0, 8, (2, 3, 5, 64)).astype(np.uint8)
    values = np.linspace(-1, 1, 8, dtype=np.float32)
    packed = numpy_ops.pack_bits(codes, 3)
    np.testing.assert_array_equal(numpy_ops.unpack_lookup(packed, 3, 64, values), values[codes])
    with pytest.raises(ValueError, match="8 table values"):
        bitpack.unpack_lookup(numpy_ops, packed, 3, 64, values[:4])
