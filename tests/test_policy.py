"""CodecPolicy: per-layer/role codecs, token segments, labels and JSON."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool.codecs import get_codec
from kvtool.errors import CodecError
from kvtool.policy import CodecPolicy


def test_segments_cover_tokens_with_sinks_and_recent_window():
    policy = CodecPolicy.from_options("turbo3", sink_tokens=4, recent_tokens=8)
    segs = policy.segments("key", 5, 30, 100)
    assert [(s.start, s.stop, s.codec.codec_id) for s in segs] == [
        (0, 4, "raw"), (4, 92, "turbo3"), (92, 100, "raw")]
    # fewer tokens than the windows: never overlapping, never empty
    assert [(s.start, s.stop) for s in policy.segments("key", 5, 30, 6)] == [(0, 4), (4, 6)]
    assert policy.segments("value", 0, 30, 0) == []


def test_protected_layers_and_roles():
    policy = CodecPolicy.from_options(key_codec="turbo4", value_codec="kivi2", protect_layers=1)
    assert policy.codec_for("key", 0, 30).codec_id == "raw"
    assert policy.codec_for("value", 29, 30).codec_id == "raw"
    assert policy.codec_for("key", 1, 30).codec_id == "turbo4"
    assert policy.codec_for("value", 1, 30).axis == "token"  # KIVI's per-role layout
    assert CodecPolicy.from_options("kivi2").key.axis == "channel"


def test_label_and_json_round_trip():
    policy = CodecPolicy.from_options(key_codec="turbo3:center=true", value_codec="turbo3",
                                      sink_tokens=4)
    assert policy.describe() == "k=turbo3:center=true v=turbo3 sink=4"
    assert CodecPolicy.from_label(policy.describe()) == policy
    assert CodecPolicy.from_json(policy.to_json()) == policy
    assert CodecPolicy.from_options("kivi2").describe() == "kivi2"  # per-role defaults hidden
    assert CodecPolicy.from_label("turbo4 protect=1").protect_layers == 1
    assert CodecPolicy.from_options().key == get_codec("raw")


@pytest.mark.parametrize("label", ["k=kivi2:axis=token", "v=kivi4:axis=channel",
                                   "kivi2 layers=2 L1.k=kivi2:axis=token"])
def test_an_option_a_label_names_is_kept_over_the_roles_default(label):
    """KIVI's keys go per channel and values per token unless the label says otherwise; an
    explicit ``axis`` was replaced by the role's, so the label and JSON forms disagreed."""
    policy = CodecPolicy.from_label(label)
    axis = label.rpartition("axis=")[2]
    assert axis in (policy.key.get_config().get("axis"), policy.value.get_config().get("axis"),
                    *(c.get_config().get("axis") for _, own in policy.layers for c in
                      (own.key, own.value) if c is not None))
    assert CodecPolicy.from_label(policy.describe()) == policy
    assert CodecPolicy.from_json(policy.to_json()) == policy
    plain = CodecPolicy.from_label(label.replace(f":axis={axis}", ""))
    assert plain != policy  # the role's default is another axis


@pytest.mark.parametrize("lossless", ["turbo2", "raw:dtype=float16", "turbo4:seed=7"])
def test_a_policy_whose_lossless_codec_is_not_raw_says_so_in_its_label(lossless):
    """The label a file and a report carry names the codec of protected layers and tokens;
    read back, it is the same policy (it used to say nothing, and read back as raw)."""
    policy = CodecPolicy.from_json({"key": "turbo3", "value": "turbo3", "lossless": lossless,
                                    "protect_layers": 2, "sink_tokens": 4})
    assert f"lossless={lossless}" in policy.describe()
    assert CodecPolicy.from_label(policy.describe()) == policy
    assert "lossless" not in CodecPolicy.from_options("turbo3", protect_layers=2).describe()


def test_bad_options():
    with pytest.raises(CodecError):
        CodecPolicy.from_options("turbo3", sink_tokens=-1)
    with pytest.raises(CodecError, match="integer"):
        CodecPolicy.from_label("turbo3 sink=many")


# -- per-layer codecs ---------------------------------------------------------------------------
LAYERED = {"key": "turbo3", "value": "turbo2", "sink_tokens": 2, "protect_layers": 1,
           "num_layers": 4, "layers": {"0": {"key": "turbo4"}, "2": "lossless",
                                       "3": {"key": "kivi2", "value": "turbo4"}}}


def test_per_layer_codecs_win_over_protect_and_base():
    policy = CodecPolicy.from_json(LAYERED)
    assert [policy.codec_for("key", i, 4).codec_id for i in range(4)] == [
        "turbo4", "turbo3", "raw", "kivi2"]
    assert [policy.codec_for("value", i, 4).codec_id for i in range(4)] == [
        "raw", "turbo2", "raw", "turbo4"]  # layer 0 value: still protected
    assert policy.codec_for("key", 3, 4).axis == "channel"  # per-role defaults apply (KIVI)
    assert policy.segments("key", 2, 4, 10)[0].stop == 10  # a lossless layer: one segment
    with pytest.raises(CodecError, match="4 layers; the model has 30"):
        policy.codec_for("key", 1, 30)
    assert {c.codec_id for c in policy.codecs()} == {"turbo3", "turbo2", "raw", "turbo4",
                                                      "kivi2"}
    assert CodecPolicy.from_json({**LAYERED, "key": "raw", "value": "raw"}).is_lossy("float32")
    reseeded = policy.with_seed(7)
    assert reseeded.codec_for("value", 3, 4).get_config()["seed"] == 7


def test_per_layer_round_trips_json_label_and_file(tmp_path):
    from kvtool.policy_files import load_policy, save_policy
    from kvtool.presets import preset_policy

    policy = CodecPolicy.from_json(LAYERED)
    assert CodecPolicy.from_json(policy.to_json()) == policy
    label = policy.describe()
    assert "layers=4" in label and "L2=raw" in label
    assert CodecPolicy.from_label(label) == policy
    path = tmp_path / "p.json"
    save_policy(policy, path, {"calibration": {"note": "ignored by readers"}})
    assert load_policy(path) == policy == preset_policy(str(path))
    from_file = CodecPolicy.from_options(preset=str(path), sink_tokens=8)
    assert from_file.layers == policy.layers and from_file.sink_tokens == 8
    # uniform policies keep today's JSON (no per-layer keys)
    assert "layers" not in CodecPolicy.from_options("turbo3").to_json()


@pytest.mark.parametrize("change, message", [
    ({"key": "nope"}, "unknown codec 'nope'"),
    ({"layers": {"0": {"key": "nope"}}}, "unknown codec"),
    ({"layers": {"4": "lossless"}}, "out of range for 4 layers"),
    ({"layers": {"-1": "lossless"}}, "not an integer"),
    ({"layers": {"\u00b2": "lossless"}}, "not an integer"),  # isdigit, not int
    ({"layers": {"x": "lossless"}}, "not an integer"),
    ({"layers": {"1": {"kee": "turbo3"}}}, "key"),
    ({"layers": {"1": 3}}, "lossless"),
    ({"layers": ["turbo3"]}, "must be an object"),
    ({"num_layers": None}, "needs num_layers"),
    ({"num_layers": "4"}, "num_layers"),
    ({"sink_tokens": "2"}, "sink_tokens must be an integer"),
    ({"sink_tokens": True}, "sink_tokens must be an integer"),
    ({"value": 5}, "must be a codec"),
    ({"key": {"id": "turbo3", "center": "maybe"}}, "center"),
])
def test_bad_per_layer_policies_are_one_line_codec_errors(change, message):
    with pytest.raises(CodecError, match=message) as e:
        CodecPolicy.from_json({**LAYERED, **change})
    assert "\n" not in str(e.value)


def test_a_policy_file_calibrated_for_another_model_is_refused_for_it(tmp_path):
    from kvtool.errors import ModelMismatchError
    from kvtool.policy_files import load_policy, save_policy
    from kvtool.presets import preset_policy

    policy = CodecPolicy.from_label("k=turbo4 v=turbo3")
    for section in ("calibration", "preset_fit"):
        path = tmp_path / f"{section}.json"
        save_policy(policy, path, {section: {"model": "SmolLM2", "fingerprint": "a" * 64}})
        assert load_policy(path) == load_policy(path, "a" * 64) == policy
        assert preset_policy(str(path), "a" * 64) == policy
        with pytest.raises(ModelMismatchError, match="was calibrated for SmolLM2"):
            preset_policy(str(path), "b" * 64)
    save_policy(policy, tmp_path / "plain.json")  # no record: any model
    assert load_policy(tmp_path / "plain.json", "b" * 64) == policy


def test_bad_policy_files(tmp_path):
    from kvtool.policy_files import load_policy

    for text, message in [("{", "not a JSON policy file"), ("[1]", "JSON object"),
                          ('{"value": "raw"}', "'key'"),
                          ('{"key": "turbo3", "value": "raw", "key": "raw"}', "duplicate key"),
                          (b'{"key": "\xff"}', "not a JSON policy file"),
                          ('{"key": "raw", "value": "raw", "sink_token": 4}',
                           "unknown policy key 'sink_token'; did you mean 'sink_tokens'"),
                          ('{"key": "raw", "value": "raw", "sink": 4}',  # a label's spelling
                           "unknown policy key 'sink'; in a policy file it is 'sink_tokens'"),
                          ('{"key": "raw", "value": "raw", "sink_tokens": 99999999999999999999}',
                           "sink_tokens must be an integer from 0 to 2147483647"),
                          ('{"key": "raw", "value": "raw", "auto_sinks": 2147483648}',
                           "auto_sinks must be an integer from 0")]:
        (tmp_path / "bad.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(CodecError, match=message):
            load_policy(tmp_path / "bad.json")
    with pytest.raises(CodecError, match="cannot read"):
        load_policy(tmp_path / "missing.json")


def test_kvz_with_per_layer_policy_decodes_each_layer_with_its_codecs(tmp_path):
    import numpy as np
    from kvz_util import synthetic_cache

    from kvtool.formats import load, open_kvz, save

    cache = synthetic_cache(layers=4, heads=2, tokens=10, dim=16, dtype="float32")
    policy = CodecPolicy.from_json(LAYERED)
    save(cache, tmp_path / "c.kvz", policy=policy)
    with open_kvz(tmp_path / "c.kvz") as f:
        header = f.header
    assert header["policy"] is None and CodecPolicy.from_json(header["layer_policy"]) == policy
    back = load(tmp_path / "c.kvz")
    for i in range(4):
        for role, arrays in (("key", cache.keys), ("value", cache.values)):
            got = back.keys[i] if role == "key" else back.values[i]
            want = np.concatenate([s.codec.decode(s.codec.encode(arrays[i][:, s.start:s.stop]),
                                                  "float32")
                                   for s in policy.segments(role, i, 4, 10)], axis=1)
            assert [s["codec"]["id"] for s in header["layers"][i][role]["segments"]] == [
                s.codec.codec_id for s in policy.segments(role, i, 4, 10)]
            np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(back.keys[2], cache.keys[2])  # the lossless layer
    with pytest.raises(CodecError, match="4 layers"):
        save(synthetic_cache(layers=3), tmp_path / "d.kvz", policy=policy)


def test_preset_outliers_scale_with_head_dim():
    """The presets' outlier counts are per 64 channels (``outliers_per=64``): the same share,
    so about the same bits, at every head_dim; absolute counts stay absolute."""
    from kvtool.codecs.turbomix import TurboMixCodec
    from kvtool.presets import preset_policy

    balanced, small = preset_policy("balanced"), preset_policy("small")
    assert [balanced.key._split(d)[0] for d in (16, 64, 128, 256)] == [4, 16, 32, 64]
    assert [balanced.value._split(d)[0] for d in (16, 64, 256)] == [12, 48, 192]
    assert small.key._split(8) == (2, 6) and small.key._split(128) == (32, 96)
    for role in (balanced.key, balanced.value, small.key):
        assert 0 <= role.bits_per_element(64) - role.bits_per_element(256) <= 0.375  # norms
    assert get_codec("turbomix:outliers=16")._split(256) == (16, 240)
    for bad in ("turbomix:outliers_per=64", "turbomix:outliers=64,outliers_per=64",
                "turbomix:outliers=8,outliers_per=-1"):
        with pytest.raises(CodecError, match="outliers"):
            get_codec(bad)
    codec = get_codec("turbomix:outliers=16,outliers_per=64,vq=2")
    assert isinstance(codec, TurboMixCodec) and get_codec(codec.get_config()) == codec
    assert "outliers_per" not in get_codec("turbomix:outliers=16").get_config()
    x = np.random.default_rng(0).standard_normal((2, 16, 256)).astype(np.float32)
    enc = codec.encode(x)
    mask = np.unpackbits(enc.arrays["outlier_mask"], axis=-1, bitorder="little")
    assert (mask.reshape(2, -1)[:, :256].sum(1) == 64).all()
    err = np.mean((np.asarray(codec.decode(enc)) - x) ** 2) / np.mean(x ** 2)
    assert err < 0.05

@pytest.mark.parametrize("options", [{"protect_layers": 0.5}, {"sink_tokens": True},
                                     {"recent_tokens": -5}, {"recent_tokens": "3"},
                                     {"preset": "quality", "protect_layers": -1},
                                     {"preset": "quality", "recent_tokens": -5}])
def test_counts_are_integers_at_least_zero_with_or_without_a_preset(options):
    """``protect_layers=0.5`` was saved, then refused by the reader; with a preset, negative
    counts reached the encoder."""
    with pytest.raises(CodecError, match="must be an integer from 0 to"):
        CodecPolicy.from_options("turbo3", **options)


@pytest.mark.parametrize("fields", [{"protect_layers": True}, {"sink_tokens": -3},
                                    {"recent_tokens": 10**12}, {"auto_sinks": 2.5}])
def test_a_policy_built_by_hand_checks_its_counts_too(tmp_path, fields):
    """A ``CodecPolicy`` made directly (not through from_options) was written, replacing a
    good file, and then refused by load (or failed mid-encode with another codec's shape)."""
    from kvz_util import synthetic_cache

    from kvtool.formats import load, save

    t3 = get_codec("turbo3")
    path = tmp_path / "a.kvz"
    save(synthetic_cache(layers=2, tokens=8), path, codec="turbo3")
    before = path.read_bytes()
    with pytest.raises(CodecError, match="must be an integer from 0 to"):
        save(synthetic_cache(layers=2, tokens=8), path,
             policy=CodecPolicy(key=t3, value=t3, **fields))
    assert path.read_bytes() == before and load(path).num_layers == 2
    with pytest.raises(CodecError, match="key must be a Codec, got str"):
        CodecPolicy(key="turbo3", value=t3)


@pytest.mark.parametrize("label,message", [
    ("turbo3 layers=4 L1-0=raw", "not a range"),  # was dropped: layer 0 kept turbo3
    ("turbo3 layers=4 L0-99999999=raw", "not a range"),  # built 10^8 codecs first
    ("turbo3 L0=raw", "need layers=N"),
    ("turbo3 turbo4", "second time"),  # the last one won
    ("turbo3 sink=4 sink=5", "second time"),
    ("turbo3 sink=4_0", "integer"), ("turbo3 sink=+4", "integer"),
    ("turbo3 sink=٤", "integer"), ("turbo3 sink=autox", "auto:N"),
    ("turbo3 layers=4 L١=raw", "second time"),  # not a layer part (non-ASCII): a codec
])
def test_malformed_labels_are_refused(label, message):
    with pytest.raises(CodecError, match=message):
        CodecPolicy.from_label(label)


def test_a_codec_of_another_type_is_a_codec_error():
    for bad in (3, ["turbo3"], 2.5):
        with pytest.raises(CodecError, match="a codec is an id"):
            CodecPolicy.from_options(codec=bad)


def test_counts_given_as_zero_override_a_presets():
    """``sink_tokens=0`` (``--sink-tokens 0``) over a preset kept the preset's 4 sinks."""
    assert CodecPolicy.from_options(preset="balanced").sink_tokens == 4
    assert CodecPolicy.from_options(preset="balanced", sink_tokens=0).sink_tokens == 0
    assert CodecPolicy.from_options(preset="balanced", recent_tokens=8).sink_tokens == 4
