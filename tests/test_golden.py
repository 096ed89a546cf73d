"""Golden .kvz files (tests/golden/) must load forever, to the same decoded values.

They are written only by ``python tests/make_golden.py --regenerate``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from kvz_util import available_codecs

from kvtool.codecs.registry import BUILTIN_CODECS
from kvtool.formats import load, open_kvz

GOLDEN = Path(__file__).resolve().parent / "golden"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())


def test_every_builtin_codec_has_a_golden_file():
    missing = [c for c in available_codecs()
               if c in BUILTIN_CODECS and f"codec-{c}" not in EXPECTED]
    assert not missing, (f"no golden file for {missing}; run "
                         "`python tests/make_golden.py --regenerate --only codec-<id>`")
    assert {"zstd", "policy"} <= set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_file_decodes_to_the_recorded_values(name):
    want = EXPECTED[name]
    path = GOLDEN / want["file"]
    assert path.stat().st_size < 20_000
    with open_kvz(path) as f:
        assert f.verify() == []
        assert f.format_version == "1"
    cache = load(path)
    assert cache.num_layers == want["num_layers"] and cache.num_tokens == want["num_tokens"]
    assert cache.token_ids.tolist() == want["token_ids"]
    assert cache.model == want["model"]
    assert cache.tokenizer_fingerprint == want["tokenizer_fingerprint"]
    # lossless files must give the recorded bytes; lossy ones decode through a BLAS matmul on
    # this machine, which may round the last float32 bits (and so an fp16/bf16 output's last
    # bit) apart from the machine that recorded expected.json: compared to rounding only
    lossless = want["save"].get("codec") == "raw"
    for layer, stats in zip(zip(cache.keys, cache.values, strict=True), want["layers"],
                            strict=True):
        for x, s in zip(layer, (stats["key"], stats["value"]), strict=True):
            assert list(x.shape) == s["shape"] and str(x.dtype) == s["dtype"]
            digest = hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
            if lossless:
                assert digest == s["sha256"]
            x64 = np.asarray(x, dtype=np.float32).astype(np.float64)
            assert x64.sum() == pytest.approx(s["sum"], rel=1e-3, abs=1e-2)
            assert (x64**2).sum() == pytest.approx(s["sumsq"], rel=1e-4)
            ulp = float(ml_dtypes.finfo(x.dtype).eps)  # one rounding of the stored dtype
            np.testing.assert_allclose(x64.reshape(-1)[:8], s["head"], rtol=max(1e-3, ulp),
                                       atol=1e-3)


def test_golden_policy_file_keeps_its_segments():
    with open_kvz(GOLDEN / "policy.kvz") as f:
        segs = [(s["start"], s["stop"], s["codec"]["id"])
                for s in f.header["layers"][1]["key"]["segments"]]
        assert segs == [(0, 2, "raw"), (2, 9, "turbo4"), (9, 12, "raw")]
        assert [s["codec"]["id"] for s in f.header["layers"][0]["value"]["segments"]] == ["raw"]
    with open_kvz(GOLDEN / "zstd.kvz") as f:
        assert f.info()["zstd_tensors"] > 0


def test_golden_layer_policy_file_keeps_each_layers_codecs():
    """Per-layer codecs live in ``layer_policy`` with ``policy`` null (older readers skip the
    segment check); each layer decodes with its own codecs."""
    with open_kvz(GOLDEN / "layer-policy.kvz") as f:
        assert f.header["policy"] is None
        assert f.header["layer_policy"]["num_layers"] == 4
        ids = [[[s["codec"]["id"] for s in layer[role]["segments"]] for role in ("key", "value")]
               for layer in f.header["layers"]]
        assert f.info()["policy"] == f.header["layer_policy"]
    assert ids == [[["raw"], ["raw"]], [["raw", "turbo3"], ["raw", "turbo2"]],
                   [["raw", "turbo4"], ["raw", "turbo2"]], [["raw", "turbomix"], ["raw", "turbo4"]]]
