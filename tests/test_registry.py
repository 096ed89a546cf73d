"""Codec registry: built-ins, specs, errors, entry-point plugins."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from kvtool.codecs import Codec, get_codec, list_codecs, parse_codec_spec, reset_registry
from kvtool.errors import CodecError

BUILTINS = {"raw", "fp8", "int8", "int4", "kivi2", "kivi4", "turbo2", "turbo3", "turbo4", "prism"}


def test_every_builtin_is_listed_and_loads():
    assert BUILTINS <= set(list_codecs())
    for codec_id in BUILTINS:
        codec = get_codec(codec_id)
        assert isinstance(codec, Codec) and codec.codec_id == codec_id
        assert 0 < codec.bits_per_element(128) <= 32


@pytest.mark.parametrize("codec_id", sorted(BUILTINS))
def test_config_round_trips_through_json(codec_id):
    codec = get_codec(codec_id)
    config = json.loads(json.dumps(codec.get_config()))
    assert config["id"] == codec_id and isinstance(config["codec_version"], int)
    rebuilt = get_codec(config)
    assert rebuilt == codec and rebuilt.get_config() == codec.get_config()


def test_spec_strings():
    assert parse_codec_spec("turbo3") == {"id": "turbo3"}
    assert parse_codec_spec("turbo3:center=true,seed=5") == {"id": "turbo3", "center": True,
                                                             "seed": 5}
    assert parse_codec_spec('{"id": "int4", "group_size": 32}') == {"id": "int4",
                                                                    "group_size": 32}
    assert get_codec("turbo3:center=true").center is True


@pytest.mark.parametrize("spec, message", [
    ("turbo3:seed=1,seed=2", "'seed' is given twice"),
    ("turbo3:id=int4", "'id' is given twice"),
    ('{"id": "int4", "group_size": 32, "group_size": 64}', "duplicate key 'group_size'"),
    ('{"id": "int4", "group_size": NaN}', "not valid JSON"),
])
def test_an_option_given_twice_is_refused_not_overridden(spec, message):
    with pytest.raises(CodecError, match=message):
        parse_codec_spec(spec)


def test_unknown_codec_names_it_and_mentions_plugins():
    with pytest.raises(CodecError, match=r"'nope'.*plugin.*kvtool\.codecs"):
        get_codec("nope")


@pytest.mark.parametrize("where", ["codec", "label", "k="])
def test_a_preset_where_a_codec_goes_is_named_a_preset(where):
    """``balanced sink=2`` or ``k=balanced`` said "unknown codec 'balanced'"."""
    from kvtool.policy import CodecPolicy

    with pytest.raises(CodecError, match=r"^'balanced' is a preset .* not a codec: .*--preset "
                                         "balanced"):
        if where == "codec":
            get_codec("balanced")
        else:
            CodecPolicy.from_label("balanced sink=2" if where == "label" else "k=balanced")
    assert CodecPolicy.from_label("balanced") == CodecPolicy.from_options(preset="balanced")


def test_bad_options_and_future_versions():
    with pytest.raises(CodecError, match="no option 'colour'"):
        get_codec("turbo3", colour="red")
    with pytest.raises(CodecError, match="newer"):
        get_codec({"id": "turbo3", "codec_version": 99})
    with pytest.raises(CodecError, match="JSON"):
        get_codec("{not json")


def _scaled_codec(version: int, *, keeps_old: bool):
    """A plugin codec storing x / scale in fp16: version 1 divides by 2, version 2 by 4.
    ``keeps_old``: version 2 still decodes version 1's files (it takes ``codec_version``)."""
    from kvtool.codecs.abc import ArraySpec

    class Scaled(Codec):
        codec_id = "test-scaled"
        codec_version = version

        def _scale(self):
            return 2.0 if self.codec_version == 1 else 4.0

        def bits_per_element(self, head_dim):
            return 16.0

        def _encode(self, xp, x):
            return {"half": xp.astype(xp.astype(x, "float32") / self._scale(), "float16")}

        def _decode(self, xp, enc):
            return xp.astype(enc.arrays["half"], "float32") * self._scale()

        def expected_arrays(self, shape, dtype):
            return {"half": ArraySpec(tuple(shape), "float16")}

    if keeps_old:
        def __init__(self, codec_version: int = version):
            self.codec_version = codec_version
        Scaled.__init__ = __init__
    return Scaled


def test_an_older_codec_version_decodes_by_its_rules_or_not_at_all(tmp_path):
    """format.md §7: a file of codec version 1 read where version 2 is installed decodes by
    version 1's rules (a codec that takes ``codec_version``), or is refused as a codec that is
    not installed; never decoded by version 2's rules (here: twice the values)."""
    from kvz_util import synthetic_cache

    from kvtool.codecs import register_codec
    from kvtool.errors import MissingCodecError
    from kvtool.formats import load, save

    cache = synthetic_cache(layers=1, tokens=8, dim=16)
    register_codec(_scaled_codec(1, keeps_old=False))
    try:
        save(cache, tmp_path / "v1.kvz", codec="test-scaled")
        want = load(tmp_path / "v1.kvz")
    finally:
        reset_registry()
    k0 = np.asarray(want.keys[0])
    np.testing.assert_allclose(k0, np.asarray(cache.keys[0]), rtol=1e-3, atol=1e-3)

    register_codec(_scaled_codec(2, keeps_old=False))
    try:
        with pytest.raises(MissingCodecError, match="'test-scaled' version 1 is not installed"):
            load(tmp_path / "v1.kvz")
    finally:
        reset_registry()
    register_codec(_scaled_codec(2, keeps_old=True))
    try:
        got = load(tmp_path / "v1.kvz")
        np.testing.assert_array_equal(np.asarray(got.keys[0]), k0)
        old = get_codec({"id": "test-scaled", "codec_version": 1})
        assert old.get_config()["codec_version"] == 1  # written back as what it decodes
        assert get_codec("test-scaled").get_config()["codec_version"] == 2
    finally:
        reset_registry()


PLUGIN_MODULE = textwrap.dedent('''
    from kvtool.codecs import Codec

    class HalfCodec(Codec):
        """Stores x/2 in fp16 (a test plugin)."""
        codec_id = "{codec_id}"

        def bits_per_element(self, head_dim):
            return 16.0

        def _encode(self, xp, x):
            return {{"half": xp.astype(xp.astype(x, "float32") / 2, "float16")}}

        def _decode(self, xp, enc):
            return xp.astype(enc.arrays["half"], "float32") * 2

        def expected_arrays(self, shape, dtype):
            from kvtool.codecs.abc import ArraySpec

            return {{"half": ArraySpec(tuple(shape), "float16")}}
''')


def _install_fake_distribution(root, dist_name: str, codec_id: str, module: str) -> None:
    (root / f"{module}.py").write_text(PLUGIN_MODULE.format(codec_id=codec_id))
    info = root / f"{dist_name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvtool.codecs]\n{codec_id} = {module}:HalfCodec\n")


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_registry()
    yield tmp_path
    reset_registry()
    for name in [m for m in sys.modules if m.startswith("kvtool_fake_plugin")]:
        del sys.modules[name]


def test_entry_point_plugin_is_discovered(plugin_path):
    _install_fake_distribution(plugin_path, "kvtool_fake_plugin", "half", "kvtool_fake_plugin")
    reset_registry()
    assert "half" in list_codecs()
    codec = get_codec("half")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(codec.decode(codec.encode(x)), x)


def test_plugin_without_expected_arrays_is_refused(plugin_path):
    """The reader checks stored arrays against expected_arrays: a plugin must declare them."""
    _install_fake_distribution(plugin_path, "kvtool_fake_plugin3", "half3", "kvtool_fake_plugin3")
    module = plugin_path / "kvtool_fake_plugin3.py"
    text = module.read_text()
    module.write_text(text[:text.index("    def expected_arrays")])
    reset_registry()
    with pytest.raises(CodecError, match="half3.*does not implement expected_arrays"):
        get_codec("half3")


def test_plugin_with_duplicate_id_is_an_error(plugin_path):
    _install_fake_distribution(plugin_path, "kvtool_fake_plugin2", "turbo3",
                               "kvtool_fake_plugin2")
    reset_registry()
    with pytest.raises(CodecError, match="already registered"):
        list_codecs()


def test_codecs_cli_lists_every_codec():
    from click.testing import CliRunner

    from kvtool.cli.main import cli

    result = CliRunner().invoke(cli, ["codecs", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = {r["id"]: r for r in data["codecs"]}
    assert BUILTINS <= set(rows)
    assert rows["turbo3"]["bits_per_element"] == pytest.approx(3.125)
    assert "numpy" in rows["turbo3"]["backends"]
    text = CliRunner().invoke(cli, ["codecs"]).output
    assert "turbo3" in text and "3.125" in text
