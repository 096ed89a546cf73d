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
