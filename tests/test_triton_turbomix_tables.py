"""The Triton ``turbomix`` kernels' host tables (:mod:`kvtool.kernels.triton_turbomix_tables`):
the trellis value table is indexed by a hash of each code's window, which must be one-to-one and
read nothing but the path bits and the code."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool.codecs.trellis import trellis_values
from kvtool.kernels.numpy_ops import pack_bits
from kvtool.kernels.triton_turbomix_tables import (
    TRELLIS_HASH,
    _hashed_state_values,
    trellis_hash,
)


def _windows(codes: np.ndarray, bits: int) -> np.ndarray:
    """Each code's window: the 6·bits bits of it and the 5 codes before (zeros before the
    first), LSB first, as the kernels read them from the packed row."""
    padded = np.concatenate([np.zeros((*codes.shape[:-1], 5), codes.dtype), codes], axis=-1)
    out = np.zeros(codes.shape, np.int64)
    for k in range(6):  # code k of the window: the code 5 - k before
        out |= padded[..., k:k + codes.shape[-1]].astype(np.int64) << (k * bits)
    return out


@pytest.mark.parametrize("bits", sorted(TRELLIS_HASH))
def test_the_hash_is_one_to_one_on_path_bits_and_code(bits):
    state, code = np.arange(32)[:, None], np.arange(1 << bits)[None, :]
    window = code << (5 * bits)
    for k in range(1, 6):
        window = window | (((state >> (k - 1)) & 1) << ((6 - k) * bits - 1))
    hashed = trellis_hash(window, bits).reshape(-1)
    assert sorted(hashed.tolist()) == list(range(32 << bits))


@pytest.mark.parametrize("bits", sorted(TRELLIS_HASH))
def test_the_hashed_table_decodes_packed_rows_as_the_reference(bits):
    """Every window (the earlier codes' other bits too, and rows' first 5 codes) looks up the
    value the reference decodes: a hash that read a bit besides the path bits, or a table
    permuted otherwise, fails here."""
    rng = np.random.default_rng(bits)
    n = 96
    codes = rng.integers(0, 1 << bits, size=(64, n), dtype=np.uint8)
    table = _hashed_state_values(n, bits)
    got = table[trellis_hash(_windows(codes, bits), bits)]
    np.testing.assert_array_equal(got, trellis_values(codes, bits))
    # the windows above come from the bytes the kernels read: the packed row, LSB first
    packed = pack_bits(codes, bits)
    as_int = int.from_bytes(packed[3].tobytes(), "little")
    window = _windows(codes[3:4], bits)[0]
    for i in range(5, n):
        assert window[i] == (as_int >> ((i - 5) * bits)) & ((1 << (6 * bits)) - 1)


def test_codes_the_kernels_read_as_words_start_on_a_word():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kvtool.kernels.triton_turbomix import word_aligned

    rows = torch.arange(4 * 36 + 1, dtype=torch.uint8)
    aligned = rows[:-1].reshape(4, 36)
    assert word_aligned(aligned) is aligned  # no copy of what is already aligned
    shifted = rows[1:].reshape(4, 36)  # a view one byte in
    assert shifted.data_ptr() % 4 != 0
    got = word_aligned(shifted)
    assert got.data_ptr() % 4 == 0 and torch.equal(got, shifted)
