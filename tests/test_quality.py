"""Issue 13: seed × text aggregation, next-token KL, presets, turbomix, sinks found by norm."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kvz_util import outlier_keys, squared_error

torch = pytest.importorskip("torch")

from kvtool.cache import KVCache  # noqa: E402
from kvtool.codecs import get_codec  # noqa: E402
from kvtool.errors import CodecError  # noqa: E402
from kvtool.evaluate import next_token_kl, top_logp  # noqa: E402
from kvtool.evaluate_grid import aggregate, seed_spread  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402
from kvtool.presets import PRESETS  # noqa: E402
from kvtool.sinks import detect_sinks  # noqa: E402


# -- aggregation and KL -----------------------------------------------------------------------
def test_aggregate_mean_spread_over_seeds_and_texts():
    runs = [{"text": t, "seed": s, "kl": kl, "delta_ppl_pct": d, "bits_per_element": 3.25}
            for (t, s, kl, d) in [("a", 0, 0.01, 1.0), ("a", 1, 0.02, 2.0), ("a", 2, 0.03, 0.0),
                                  ("b", 0, 0.04, 4.0), ("b", 1, 0.05, -1.0),
                                  ("b", 2, 0.06, 0.0)]]
    mean, spread, std = aggregate(runs)
    assert mean["kl"] == pytest.approx(0.035) and spread["kl"] == pytest.approx(0.05)
    assert mean["delta_ppl_pct"] == pytest.approx(1.0) and spread["delta_ppl_pct"] == 5.0
    assert std["bits_per_element"] == 0.0 and "attention_kl" not in mean
    by_seed = seed_spread(runs)  # per text max − min over seeds (a: 2.0, b: 5.0), then the mean
    assert by_seed["delta_ppl_pct"] == pytest.approx(3.5)
    assert by_seed["kl"] == pytest.approx(0.02)
    assert seed_spread([dict(r, seed=None) for r in runs]) == {}  # unseeded: no seed spread


def test_next_token_kl_is_zero_for_equal_and_matches_the_full_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 300, generator=g) * 3, -1)
    q = torch.log_softmax(p + 0.3 * torch.randn(5, 300, generator=g), -1)
    top, idx = top_logp(p, 300)
    assert next_token_kl(top, idx, p).abs().max() < 1e-12
    full = (p.exp() * (p - q)).sum(-1).double()
    torch.testing.assert_close(next_token_kl(top, idx, q), full, rtol=1e-5, atol=1e-9)
    top, idx = top_logp(p, 64)  # the tail as one bucket: a lower bound, close to the full KL
    lumped = next_token_kl(top, idx, q)
    assert (lumped <= full + 1e-9).all() and (lumped > 0.5 * full).all()


# -- presets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, most", [("lossless", 16.0), ("quality", 4.0),
                                        ("balanced", 3.3), ("small", 2.6)])
def test_presets_parse_and_resolve_to_their_bits(name, most):
    policy = CodecPolicy.from_label(name)
    assert CodecPolicy.from_label(PRESETS[name][0]) == policy
    assert CodecPolicy.from_options(preset=name) == policy
    bits = (policy.key.bits_per_element(64) + policy.value.bits_per_element(64)) / 2
    if name == "lossless":
        assert policy.key == get_codec("raw")
    else:  # the encoded part at head_dim 64 (sinks add ~0.03 bits over 2K tokens)
        assert bits <= most - 0.02, (name, bits)
    with pytest.raises(CodecError, match="unknown preset"):
        CodecPolicy.from_options(preset="tiny")


def test_preset_with_codec_override_and_seeds():
    policy = CodecPolicy.from_options(preset="balanced", value_codec="turbo4")
    assert policy.value.codec_id == "turbo4" and policy.sink_tokens == 4
    reseeded = CodecPolicy.from_label("k=turbo3 v=kivi2").with_seed(7)
    assert reseeded.key.seed == 7 and reseeded.value == CodecPolicy.from_label("kivi2").value


# -- turbomix ---------------------------------------------------------------------------------
def test_turbomix_defaults_write_turbo3_codes():
    x = outlier_keys()
    a, b = get_codec("turbomix").encode(x), get_codec("turbo3").encode(x)
    assert sorted(a.arrays) == ["codes", "norms"]
    for name in a.arrays:
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])


def test_data_aware_rotation_keeps_the_lower_error_seed(tmp_path):
    from kvtool.codecs.turbomix import candidate_seed
    from kvtool.formats import load, save
    from kvtool.policy import CodecPolicy as P

    x = outlier_keys()
    codec = get_codec("turbomix", candidates=4, seed=11)
    enc = codec.encode(x)
    rot = np.asarray(enc.arrays["rotation"]).reshape(-1)
    for g in range(x.shape[0]):  # each head's choice is the best of the four seeds, alone
        errs = [squared_error(get_codec("turbomix", seed=candidate_seed(11, c)), x[g:g + 1])
                for c in range(4)]
        assert rot[g] == int(np.argmin(errs)), (g, errs)
    assert squared_error(codec, x) <= squared_error(get_codec("turbomix", seed=11), x)
    cache = KVCache([x], [x])
    policy = P.from_options(key_codec=codec.get_config(), value_codec="turbomix:outliers=16,"
                            "center=true,candidates=3")
    save(cache, tmp_path / "m.kvz", policy=policy)
    back = load(tmp_path / "m.kvz")
    np.testing.assert_allclose(np.asarray(back.keys[0], np.float32),
                               np.asarray(codec.decode(enc, "float32")), rtol=0, atol=0.05)


def test_outlier_channels_get_more_bits():
    x = outlier_keys()
    mixed = get_codec("turbomix:center=true,outliers=16,outlier_bits=4")
    assert mixed.bits_per_element(64) == pytest.approx((16 * 4 + 48 * 3 + 32) / 64)
    enc = mixed.encode(x)
    mask = np.unpackbits(np.asarray(enc.arrays["outlier_mask"]).reshape(3, -1), axis=-1,
                         bitorder="little")
    assert mask.sum(-1).tolist() == [16] * 3 and mask[:, [5, 17]].all()
    assert squared_error(mixed, x) < squared_error(get_codec("turbomix:center=true"), x)
    d = np.asarray(mixed.decode(mixed.encode(torch.from_numpy(x)), "float32"))
    np.testing.assert_array_equal(d, np.asarray(mixed.decode(enc, "float32")))  # any backend
    with pytest.raises(CodecError, match="fewer than 2"):
        mixed.encode(x[..., :17])


# -- 2-D codebooks (vq=2) -----------------------------------------------------------------------
@pytest.mark.parametrize("bits,scalar_mse", [(2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_pair_codebooks_beat_the_scalar_quantiser_on_gaussian_pairs(bits, scalar_mse):
    from kvtool.codecs.turbomix import pair_codes, pair_values
    from kvtool.codecs.vq_tables import pair_codebook

    points = pair_codebook(bits)
    assert points.shape == (4 ** bits, 2) and points.dtype == np.float32
    assert np.isfinite(points).all() and len(np.unique(points, axis=0)) == 4 ** bits
    dim = 64
    u = np.random.default_rng(bits).standard_normal((4000, dim)).astype(np.float32)
    u /= np.sqrt(dim)  # the scale of a unit vector's coordinates in R^64
    codes = pair_codes(u, bits)
    assert codes.max() < 2 ** bits
    back = pair_values(codes.astype(np.float32), bits)
    mse = float(((back - u) ** 2).mean()) * dim
    assert mse < 0.95 * scalar_mse
    # each pair went to its nearest point (brute force on a sample)
    pairs, got = u[:50].reshape(-1, 2) * np.sqrt(dim), back[:50].reshape(-1, 2) * np.sqrt(dim)
    nearest = points[((pairs[:, None] - points[None]) ** 2).sum(-1).argmin(1)]
    np.testing.assert_allclose(got, nearest, rtol=0, atol=1e-6)


def test_vq2_lowers_the_error_at_the_same_bits_and_round_trips_through_a_file(tmp_path):
    from kvtool.formats import load, save

    x = outlier_keys((4, 64, 64))
    for bits in (2, 3, 4):
        pair = get_codec(f"turbomix:bits={bits},center=true,vq=2")
        scalar = get_codec(f"turbomix:bits={bits},center=true")
        assert pair.bits_per_element(64) == scalar.bits_per_element(64)
        assert squared_error(pair, x) < 0.95 * squared_error(scalar, x)
    codec = get_codec("turbomix:center=true,outliers=16,candidates=3,vq=2")
    enc = codec.encode(x)
    torch_enc = codec.encode(torch.from_numpy(x))
    for name in enc.arrays:  # every backend writes the same bytes
        np.testing.assert_array_equal(np.asarray(torch_enc.arrays[name]), enc.arrays[name])
    cache = KVCache([x], [x])
    save(cache, tmp_path / "vq.kvz", policy=CodecPolicy.from_options(key_codec=codec.get_config(),
                                                                   value_codec="turbo3"))
    back = load(tmp_path / "vq.kvz")
    np.testing.assert_allclose(np.asarray(back.keys[0], np.float32),
                               np.asarray(codec.decode(enc, "float32")), rtol=0, atol=1e-6)


def test_vq_option_is_checked_and_named_only_when_set():
    assert "vq" not in get_codec("turbomix").get_config()  # configs from before stay the same
    assert get_codec(get_codec("turbomix:vq=2").get_config()).vq == 2
    with pytest.raises(CodecError, match="vq"):
        get_codec("turbomix:vq=3")
    with pytest.raises(CodecError, match="even"):
        get_codec("turbomix:vq=2").encode(np.ones((2, 4, 9), np.float32))
    with pytest.raises(CodecError, match="even"):
        get_codec("turbomix:vq=2,outliers=3").encode(np.ones((2, 4, 64), np.float32))
    with pytest.raises(CodecError, match="outlier_bits=5"):
        get_codec("turbomix:vq=2,outliers=4,outlier_bits=5").encode(
            np.ones((2, 4, 64), np.float32))


# -- uint8 norms (norm_bits=8) -----------------------------------------------------------------
def test_norm_codes_keep_zero_and_both_ends_and_stay_within_half_a_step():
    from kvtool.codecs.turbomix import norm_codes, norm_values

    rng = np.random.default_rng(3)
    norms = np.exp(rng.uniform(-3, 3, (5, 100))).astype(np.float16)
    norms[0, 7] = 0
    norms[1] = 0  # an all-zero group
    norms[2] = 1.5  # one value: the range is a point
    codes, ranges = norm_codes(norms)
    assert codes.dtype == np.uint8 and ranges.shape == (5, 1, 2) and ranges.dtype == np.float16
    back = norm_values(codes, ranges.reshape(5, 2))
    assert back[0, 7] == 0 and (back[1] == 0).all() and np.allclose(back[2], 1.5, rtol=1e-3)
    ref = norms.astype(np.float64)
    rel = np.abs(back - ref)[ref > 0] / ref[ref > 0]
    step = np.log(np.e ** 6) / 254  # the grid's relative step for a range of e^6
    assert rel.max() <= step / 2 + 2e-3 and rel.mean() < step / 4 + 1e-3
    for g in (0, 3, 4):  # the least and the greatest norm land on the grid's ends
        nz = ref[g][ref[g] > 0]
        assert back[g][ref[g] == nz.max()][0] == pytest.approx(nz.max(), rel=1e-3)
        assert back[g][ref[g] == nz.min()][0] == pytest.approx(nz.min(), rel=1e-3)
    crafted = ranges.reshape(5, 2)[:, ::-1].copy()  # least above greatest: refused
    with pytest.raises(CodecError, match="no writer"):
        norm_values(codes, crafted)
    zero_lo = ranges.reshape(5, 2).copy()
    zero_lo[:, 0] = 0  # a zero least norm with nonzero codes still decodes to finite values
    assert np.isfinite(norm_values(codes, zero_lo)).all()


def test_norm_bits_8_halves_the_norm_bits_at_nearly_the_same_error(tmp_path):
    from kvtool.formats import load, save

    x = outlier_keys((4, 64, 64))
    x *= np.exp(np.random.default_rng(5).standard_normal((4, 64, 1))).astype(np.float32)
    for spec in ("turbomix:center=true,vq=2", "turbomix:outliers=8,candidates=3"):
        fp16 = get_codec(spec)
        small = get_codec(spec + ",norm_bits=8")
        parts = 2 if "outliers" in spec else 1
        assert fp16.bits_per_element(64) - small.bits_per_element(64) == parts * 8 / 64
        assert small.encode(x).nbytes < fp16.encode(x).nbytes
        assert squared_error(small, x) < 1.01 * squared_error(fp16, x)
    codec = get_codec("turbomix:center=true,outliers=8,candidates=3,vq=2,norm_bits=8")
    enc = codec.encode(x)
    assert enc.arrays["norms"].dtype == np.uint8 and "norm_range_hi" in enc.arrays
    torch_enc = codec.encode(torch.from_numpy(x))
    for name in enc.arrays:
        np.testing.assert_array_equal(np.asarray(torch_enc.arrays[name]), enc.arrays[name])
    save(KVCache([x], [x]), tmp_path / "n8.kvz", policy=CodecPolicy.from_options(
        key_codec=codec.get_config(), value_codec="turbomix:norm_bits=8"))
    back = load(tmp_path / "n8.kvz")
    np.testing.assert_allclose(np.asarray(back.keys[0], np.float32),
                               np.asarray(codec.decode(enc, "float32")), rtol=0, atol=1e-6)
    assert "norm_bits" not in get_codec("turbomix").get_config()
    assert get_codec(codec.get_config()).norm_bits == 8
    with pytest.raises(CodecError, match="norm_bits"):
        get_codec("turbomix:norm_bits=4")


# -- attention sinks by norm ------------------------------------------------------------------
def test_sink_detection_finds_planted_tokens():
    rng = np.random.default_rng(3)
    keys = [rng.standard_normal((2, 50, 16)).astype(np.float32) for _ in range(4)]
    values = [k.copy() for k in keys]
    assert detect_sinks(KVCache(keys, values), 16) == 0
    for k, v in zip(keys, values, strict=True):
        k[:, 0] *= 0.1  # a low-norm first token (SmolLM2's sink) ...
        v[:, 2] *= 12  # ... and a high-norm third one
    cache = KVCache(keys, values)
    assert detect_sinks(cache, 16) == 3
    assert detect_sinks(cache, 2) == 1
    policy = CodecPolicy.from_label("turbo3 sink=auto")
    assert policy.describe() == "turbo3 sink=auto" and policy.sink_tokens == 0
    assert CodecPolicy.from_json(policy.to_json()) == policy
    resolved = policy.resolve(cache)
    assert resolved.sink_tokens == 3 and resolved.auto_sinks == 0
    assert CodecPolicy.from_label("turbo3 sink=8").resolve(cache).sink_tokens == 8
    assert not math.isnan(resolved.segments("key", 0, 4, 50)[0].stop)


def test_sink_auto_is_applied_by_the_writers(tmp_path):
    """``kvtool.save`` counts the sinks on the cache it saves (it used to encode them all); a
    writer that sees layers one at a time keeps every scanned token exact. Either way the file
    records the count it applied, not ``sink=auto``."""
    import torch

    from kvtool.formats import load, open_kvz, save
    from kvtool.formats.transcode import transcode
    from kvtool.formats.writer import write_kvz

    rng = np.random.default_rng(3)
    keys = [rng.standard_normal((2, 50, 16)).astype(np.float32) for _ in range(4)]
    for k in keys:
        k[:, 0] *= 0.1
    cache = KVCache(keys, [k.copy() for k in keys])
    policy = CodecPolicy.from_label("turbo3 sink=auto")
    report = save(cache, tmp_path / "a.kvz", policy)
    assert report["policy"] == "turbo3 sink=1"
    back = load(tmp_path / "a.kvz")
    for k, b in zip(keys, back.keys, strict=True):
        np.testing.assert_array_equal(np.asarray(b)[:, :1], k[:, :1])
        assert not np.array_equal(np.asarray(b)[:, 1:2], k[:, 1:2])
    save(cache, tmp_path / "raw.kvz", codec="raw")
    transcode(tmp_path / "raw.kvz", tmp_path / "t.kvz", policy)  # counted in a first pass
    with open_kvz(tmp_path / "t.kvz") as f:
        assert CodecPolicy.from_json(f.header["policy"]).sink_tokens == 1
    write_kvz(tmp_path / "w.kvz", zip(keys, keys, strict=True), num_layers=4, policy=policy)
    with open_kvz(tmp_path / "w.kvz") as f:  # layers as they come: every scanned token exact
        assert CodecPolicy.from_json(f.header["policy"]).sink_tokens == 16
    assert save(KVCache([keys[0][:, :0]], [keys[0][:, :0]]), tmp_path / "e.kvz",
                policy)["num_tokens"] == 0
    meta = torch.zeros(2, 5, 16, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        save(KVCache([meta], [meta]), tmp_path / "m.kvz", policy)


def test_codecs_presets_lists_the_measured_policies():
    import json

    from click.testing import CliRunner

    from kvtool.cli.main import cli

    out = CliRunner().invoke(cli, ["codecs", "--presets", "--json", "--head-dim", "64"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.output)["presets"]}
    assert list(rows) == list(PRESETS)
    for name in ("quality", "balanced", "small"):
        assert "KL" in rows[name]["measured"] and "Δppl" in rows[name]["measured"]
        assert CodecPolicy.from_label(rows[name]["label"]) == CodecPolicy.from_label(name)
    text = CliRunner().invoke(cli, ["codecs", "--presets"]).output
    assert all(name in text for name in PRESETS) and "Δppl" in text
    # a head_dim the outlier presets cannot split: those rows say why, the others still show
    out = CliRunner().invoke(cli, ["codecs", "--presets", "--json", "--head-dim", "2"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.output)["presets"]}
    assert rows["balanced"]["bits_per_element"] is None and "outliers" in rows["balanced"]["unfit"]
    assert rows["quality"]["bits_per_element"] > 0 and "unfit" not in rows["quality"]
    text = CliRunner().invoke(cli, ["codecs", "--presets", "--head-dim", "2"]).output
    assert "not at head_dim 2: turbomix: outliers=" in text


def test_codecs_presets_show_each_presets_speed_and_measure_it_here():
    import json

    from click.testing import CliRunner

    from kvtool.cli.main import cli
    from kvtool.presets import PRESET_SPEEDS

    text = CliRunner().invoke(cli, ["codecs", "--presets"]).output
    for name, speeds in PRESET_SPEEDS.items():  # the recorded key/value speeds
        assert f"encode {speeds['encode'][0]}/{speeds['encode'][1]} MB/s" in text, name
    out = CliRunner().invoke(cli, ["codecs", "--presets", "--measure", "--json",
                                   "--head-dim", "64"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.output)["presets"]}
    for name in PRESETS:  # every preset measured here, lossless (raw) too
        for op in ("encode_mbps", "decode_mbps"):
            assert set(rows[name][op]) == {"key", "value"}
            assert all(v > 0 for v in rows[name][op].values())
