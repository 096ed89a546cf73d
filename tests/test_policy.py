"""CodecPolicy: per-layer/role codecs, token segments, labels and JSON."""

from __future__ import annotations

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


def test_bad_options():
    with pytest.raises(CodecError):
        CodecPolicy.from_options("turbo3", sink_tokens=-1)
    with pytest.raises(CodecError, match="integer"):
        CodecPolicy.from_label("turbo3 sink=many")
