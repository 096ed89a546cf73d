"""KVCache: validation, shape helpers and conversions."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kvtool.cache import KVCache


def make_cache(layers=3, heads=2, tokens=5, dim=8):
    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    values = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    return KVCache(keys, values, token_ids=np.arange(tokens), model={"fingerprint": "abc"})


def test_shape_helpers():
    cache = make_cache()
    assert cache.num_layers == 3 and cache.num_tokens == 5 and cache.dtype == "float16"
    assert cache.nbytes == 2 * 3 * 2 * 5 * 8 * 2
    prefix = cache.prefix(2)
    assert prefix.num_tokens == 2 and prefix.token_ids.tolist() == [0, 1]
    np.testing.assert_array_equal(prefix.keys[1], cache.keys[1][:, :2])


def test_validation():
    k = np.zeros((2, 5, 8), np.float32)
    with pytest.raises(ValueError, match="key layers"):
        KVCache([k, k], [k])
    with pytest.raises(ValueError, match="disagree"):
        KVCache([k], [np.zeros((2, 4, 8), np.float32)])
    with pytest.raises(ValueError, match="kv_heads, tokens, head_dim"):
        KVCache([k[0]], [k[0]])
    with pytest.raises(ValueError):
        make_cache().prefix(6)


def test_torch_round_trip():
    torch = pytest.importorskip("torch")
    cache = make_cache().astype("bfloat16")
    as_torch = cache.to_numpy().to_torch()
    assert as_torch.keys[0].dtype == torch.bfloat16 and as_torch.dtype == "bfloat16"
    back = as_torch.to_numpy()
    np.testing.assert_array_equal(back.keys[2].astype(np.float32),
                                  cache.keys[2].astype(np.float32))
    assert back.model == {"fingerprint": "abc"}


def test_a_cast_to_float16_that_overflows_is_refused():
    x = np.ones((1, 4, 8), np.float32)
    big = KVCache([x * 1e6], [x])
    with warnings.catch_warnings(), \
            pytest.raises(ValueError, match="layer 0 holds values past float16's 65504"):
        warnings.simplefilter("error")  # the refusal alone, no numpy overflow warning first
        big.astype("float16")
    with pytest.raises(ValueError, match="dtype must be"):
        big.astype("bogus")
    assert big.astype("bfloat16").keys[0].dtype.name == "bfloat16"
    assert KVCache([x], [x]).astype("float16").keys[0].dtype == np.float16


def test_token_ids_and_layer_info_are_checked():
    x = np.ones((1, 3, 4), np.float32)
    for ids in ([1.7, 2, 3], np.array([2**63, 1, 2], np.uint64), [True, False, True]):
        with pytest.raises(ValueError, match="token_ids must be integers"):
            KVCache([x], [x], token_ids=ids)
    assert KVCache([x], [x], token_ids=np.array([1, 2, 3], np.uint64)).token_ids.tolist() == [
        1, 2, 3]
    with pytest.raises(ValueError, match="one dict"):
        KVCache([x], [x], layer_info=["abc"])
