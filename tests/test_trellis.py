"""Trellis-coded quantisation (``turbomix:trellis=true``): the Viterbi path is the best one, the
tables beat the scalar and 2-D codebooks, and the codec round-trips through every backend and
a file."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kvz_util import outlier_keys, squared_error

from kvtool.cache import KVCache
from kvtool.codecs import get_codec
from kvtool.codecs.trellis import (
    MEMORY,
    STATES,
    state_values,
    subset_table,
    trellis_codes,
    trellis_values,
    viterbi,
)
from kvtool.codecs.trellis_tables import trellis_levels
from kvtool.errors import CodecError
from kvtool.policy import CodecPolicy

SCALAR_MSE = {2: 0.1175, 3: 0.03454, 4: 0.009497}  # Lloyd–Max on N(0, 1)
PAIR_MSE = {2: 0.10760, 3: 0.02974, 4: 0.00828}  # vq=2's tables


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tables_are_sorted_finite_and_twice_the_scalar_levels(bits):
    levels = trellis_levels(bits)
    assert levels.dtype == np.float32 and levels.shape == (2 ** (bits + 1),)
    assert np.isfinite(levels).all() and (np.diff(levels) > 0).all()
    np.testing.assert_allclose(levels, -levels[::-1], atol=0.05)  # trained on a symmetric law


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_state_indexed_table_gives_the_decoded_values(bits):
    """What the Triton and MLX kernels look up (one load per coordinate): the value at
    ``state << bits | code``, the state the path bits of the 5 codes before (zeros first)."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, (50, 40)).astype(np.uint8)
    path = np.pad(codes.astype(np.int64) >> (bits - 1), ((0, 0), (MEMORY, 0)))
    state = sum(path[:, MEMORY - k:MEMORY - k + 40] << (k - 1) for k in range(1, MEMORY + 1))
    table = state_values(40, bits)
    assert table.shape == (STATES << bits,) and table.dtype == np.float32
    np.testing.assert_array_equal(table[(state << bits) | codes], trellis_values(codes, bits))


def test_subsets_follow_ungerboecks_rules():
    table = subset_table()
    assert table.shape == (STATES, 2) and set(table.ravel().tolist()) == {0, 1, 2, 3}
    # both branches out of a state use one union (even or odd levels), in different subsets
    assert (table[:, 0] % 2 == table[:, 1] % 2).all() and (table[:, 0] != table[:, 1]).all()
    # both branches into a state come from one union, in different subsets
    for state in range(STATES):
        preds = (state >> 1, (state >> 1) | (STATES >> 1))
        into = [table[p, state & 1] for p in preds]
        assert into[0] % 2 == into[1] % 2 and into[0] != into[1]


@pytest.mark.parametrize("bits", [2, 3])
def test_viterbi_finds_the_least_error_code_sequence(bits):
    """Against every code sequence of a short row: none decodes closer than the encoder's."""
    dim = 5
    rows = np.random.default_rng(bits).standard_normal((6, dim)).astype(np.float32) / np.sqrt(dim)
    every = np.array(list(itertools.product(range(2 ** bits), repeat=dim)), np.uint8)
    decoded = trellis_values(every, bits)  # [all sequences, dim]
    codes = trellis_codes(rows, bits)
    got = trellis_values(codes, bits)
    for row, mine in zip(rows, got, strict=True):
        best = ((decoded - row) ** 2).sum(axis=1).min()
        assert ((mine - row) ** 2).sum() == pytest.approx(best, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_trellis_beats_scalar_and_pair_codebooks_on_gaussian_rows(bits):
    dim = 64
    u = np.random.default_rng(10 + bits).standard_normal((3000, dim)).astype(np.float32)
    u /= np.sqrt(dim)
    codes = trellis_codes(u, bits)
    assert codes.dtype == np.uint8 and codes.max() < 2 ** bits
    mse = float(((trellis_values(codes, bits) - u) ** 2).mean()) * dim
    assert mse < 0.8 * SCALAR_MSE[bits] and mse < 0.9 * PAIR_MSE[bits]


def test_every_code_decodes_to_a_level_of_its_table():
    codes = np.random.default_rng(0).integers(0, 8, (50, 64)).astype(np.uint8)
    values = trellis_values(codes, 3) * np.sqrt(64)
    assert np.isin(values, trellis_levels(3)).all()
    # the path bits of the MEMORY codes before a coordinate pick its subset: changing one
    # coordinate's path bit moves later values, and only the next MEMORY ones
    flipped = codes.copy()
    flipped[:, 10] ^= 4
    moved = (trellis_values(flipped, 3) != trellis_values(codes, 3)).any(axis=0)
    assert not moved[:10].any() and not moved[11 + MEMORY:].any() and moved[10]


def test_viterbi_is_chunk_independent():
    rows = np.random.default_rng(4).standard_normal((300, 16)).astype(np.float32) / 4
    levels = trellis_levels(3) / np.float32(4)
    whole = viterbi(rows, levels)
    halves = [viterbi(rows[:100], levels), viterbi(rows[100:], levels)]
    for i in range(2):
        np.testing.assert_array_equal(whole[i], np.concatenate([h[i] for h in halves]))


def test_trellis_codec_beats_vq2_at_the_same_bits_and_round_trips(tmp_path):
    torch = pytest.importorskip("torch")
    from kvtool.formats import load, save

    x = outlier_keys((4, 64, 64))
    for bits in (2, 3, 4):
        trellis = get_codec(f"turbomix:bits={bits},center=true,trellis=true")
        pair = get_codec(f"turbomix:bits={bits},center=true,vq=2")
        assert trellis.bits_per_element(64) == pair.bits_per_element(64)
        assert squared_error(trellis, x) < 0.92 * squared_error(pair, x)
    codec = get_codec("turbomix:center=true,outliers=8,candidates=3,trellis=true,norm_bits=8")
    enc = codec.encode(x)
    assert sorted(enc.arrays) == sorted(codec.expected_arrays(x.shape, "float32"))
    torch_enc = codec.encode(torch.from_numpy(x))
    for name in enc.arrays:  # every backend writes the same bytes
        np.testing.assert_array_equal(np.asarray(torch_enc.arrays[name]), enc.arrays[name])
    np.testing.assert_array_equal(np.asarray(codec.decode(torch_enc, "float32")),
                                  np.asarray(codec.decode(enc, "float32")))
    save(KVCache([x], [x]), tmp_path / "t.kvz", policy=CodecPolicy.from_options(
        key_codec=codec.get_config(), value_codec="turbomix:trellis=true"))
    back = load(tmp_path / "t.kvz")
    np.testing.assert_allclose(np.asarray(back.keys[0], np.float32),
                               np.asarray(codec.decode(enc, "float32")), rtol=0, atol=1e-6)
    value = get_codec("turbomix:trellis=true")
    np.testing.assert_allclose(np.asarray(back.values[0], np.float32),
                               np.asarray(value.decode(value.encode(x), "float32")),
                               rtol=0, atol=1e-6)


def test_trellis_option_is_checked_and_named_only_when_set():
    assert "trellis" not in get_codec("turbomix:vq=2").get_config()
    config = get_codec("turbomix:trellis=true").get_config()
    assert config["trellis"] is True and get_codec(config).quantizer == "trellis"
    with pytest.raises(CodecError, match="choose one"):
        get_codec("turbomix:trellis=true,vq=2")
    with pytest.raises(CodecError, match="outlier_bits=5"):
        get_codec("turbomix:trellis=true,outliers=4,outlier_bits=5")
    with pytest.raises(CodecError, match="trellis"):
        get_codec("turbomix:trellis=maybe")
