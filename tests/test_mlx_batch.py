"""Batched generation on kvtool's compressed mlx cache (:mod:`kvtool.engines.mlx_batch`): what
``kvtool serve --engine mlx`` runs when requests come together. A batch keeps every row
compressed and attends to what each request would alone, so batched greedy tokens equal each
request's own; a cached prefix keeps its codes; the batch layout matches mlx-lm's
``BatchKVCache`` column for column."""

from __future__ import annotations

import copy

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.models import cache as mlx_cache  # noqa: E402
from mlx_util import alone, batched  # noqa: E402

from kvtool.engines import mlx as E  # noqa: E402
from kvtool.engines.mlx_batch import KvtoolBatchCache  # noqa: E402
from kvtool.engines.mlx_cache import KvtoolMLXCache, make_kvtool_cache  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

TEXTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
         "1, 2, 3, 4,", "Water boils at a temperature of"]
POLICY = CodecPolicy.from_options("turbo3", recent_tokens=8)


@pytest.fixture(scope="module")
def lm():
    return E.load_mlx("default", "float32")


def _cache(model, policy=POLICY):
    return make_kvtool_cache(model, policy, block_size=4)


def test_batched_requests_generate_what_each_would_alone(lm):
    """Prompts of unequal length prefilled in steps of 8 (right padding), rows leaving at
    different lengths (filter) and two requests joining a running batch (extend): each
    request's greedy tokens are its own alone, and it ends in a compressed cache of its
    tokens."""
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    limits = [12, 5, 9, 12]
    want = [alone(lm.model, p, _cache(lm.model), n) for p, n in zip(prompts, limits, strict=True)]
    resident: list[int] = []
    got, caches = batched(
        lm.model, [[(p, None, n) for p, n in zip(prompts[:2], limits[:2], strict=True)],
                   [(p, None, n) for p, n in zip(prompts[2:], limits[2:], strict=True)]],
        _cache, watch=lambda gen: resident.append(gen.prompt_cache_nbytes))
    assert got == want
    for cache, prompt, n in zip(caches, prompts, limits, strict=True):
        assert {type(layer) for layer in cache} == {KvtoolMLXCache}
        assert {layer.offset for layer in cache} == {len(prompt) + n}  # as mlx-lm's KVCache
    # the rows were held as codes (and exact windows of 8-11 tokens), never as a buffer of
    # every token's float32 K/V (mlx-lm's BatchKVCache: at least 1x, in steps of 256 tokens)
    layers, heads, dim = len(caches[0]), 3, 64
    exact = 2 * layers * heads * dim * 4 * sum(len(p) + n for p, n in zip(prompts, limits,
                                                                           strict=True))
    assert 0 < max(resident) < 0.75 * exact


def test_a_cached_prefix_keeps_its_codes(lm):
    """Requests continuing caches that hold encoded blocks (the server's LRU prompt cache, a
    stored entry) generate as they would alone, and their caches come back with the prefix's
    codes as they were: decoded bit for bit the same, not re-encoded from decoded values."""
    ids = lm.tokenizer.encode(" ".join(TEXTS))
    prefixes = []
    for cut in (30, 17):
        cache = _cache(lm.model)
        lm.model(mx.array([ids[:cut]]), cache=cache)
        prefixes.append(cache)
    requests = [(ids[30:36], prefixes[0], 6), (ids[17:20], prefixes[1], 8),
                (ids[:9], None, 7)]
    want = [alone(lm.model, p, copy.deepcopy(c) if c is not None else _cache(lm.model), n)
            for p, c, n in requests]
    got, caches = batched(lm.model, [requests], _cache)
    assert got == want
    for prefix, cache in zip(prefixes, caches[:2], strict=True):
        for before, after in zip(prefix, cache, strict=True):
            fixed = before.offset - before.streams[0].tail.shape[-2]  # encoded, or sinks
            assert fixed >= 8
            for x, y in zip(before.materialize(), after.materialize(), strict=True):
                assert np.array_equal(np.array(x[..., :fixed, :]), np.array(y[..., :fixed, :]))


def _stock_and_ours(lengths, rng, heads=2, dim=8):
    """Lossless rows of ``lengths`` random tokens, merged by mlx-lm's ``BatchKVCache`` and by
    :class:`KvtoolBatchCache`."""
    rows = []
    for n in lengths:
        k, v = (mx.array(rng.standard_normal((1, heads, n, dim)).astype(np.float32))
                for _ in range(2))
        plain, ours = mlx_cache.KVCache(), KvtoolMLXCache()
        if n:
            plain.update_and_fetch(k, v)
            ours.update_and_fetch(k, v)
        rows.append((plain, ours))
    return (mlx_cache.BatchKVCache.merge([p for p, _ in rows]),
            KvtoolBatchCache.merge([o for _, o in rows]))


def _forward(stock, ours, keys, values, real=None):
    """One forward's ``update_and_fetch`` on both batch caches: they agree on the layout, and
    on every column a real query (``real``: [batch, new], None: all) may attend to (the mask
    is made first, as a model does). A right-padded prefill's padding queries attend to
    padding, which mlx-lm holds and a kvtool row does not: their outputs are dropped."""
    new = keys.shape[2]
    mask = np.array(stock.make_mask(new, return_array=True))
    assert np.array_equal(mask, np.array(ours.make_mask(new, return_array=True)))
    out_stock, out_ours = stock.update_and_fetch(keys, values), ours.update_and_fetch(keys, values)
    assert stock._idx == ours.size()
    assert stock.left_padding.tolist() == ours.left_padding.tolist()
    assert stock.offset.tolist() == ours.offset.tolist()
    if real is not None:
        mask = mask & np.asarray(real)[:, None, :, None]
    visible = mask.any(axis=(1, 2))  # [batch, columns]: attended by some real query
    for a, b in zip(out_stock, out_ours, strict=True):
        a, b = np.array(a), np.array(b)
        assert a.shape == b.shape
        assert np.array_equal(a.transpose(0, 2, 1, 3)[visible], b.transpose(0, 2, 1, 3)[visible])


@pytest.mark.parametrize("seed", range(6))
def test_the_batch_layout_is_mlx_lms(seed):
    """Random merges, padded prefills, decode steps, filters, extends and trims on lossless
    rows: every column a query attends to holds what mlx-lm's ``BatchKVCache`` holds there,
    and every extracted row the same tokens."""
    rng = np.random.default_rng(seed)
    stock, ours = _stock_and_ours(list(rng.integers(0, 12, size=3)), rng)
    for _ in range(12):
        op = rng.choice(["prefill", "step", "filter", "extend", "trim"])
        batch = len(ours.rows)
        if op == "prefill":
            lengths = [int(n) for n in rng.integers(1, 10, size=batch)]
            padding = [max(lengths) - n for n in lengths]
            for c in (stock, ours):
                c.prepare(lengths=lengths, right_padding=padding)
            for start in range(0, max(lengths), 4):
                new = min(4, max(lengths) - start)
                k, v = (mx.array(rng.standard_normal((batch, 2, new, 8)).astype(np.float32))
                        for _ in range(2))
                real = [[start + j < n for j in range(new)] for n in lengths]
                _forward(stock, ours, k, v, real)
            for c in (stock, ours):
                c.finalize()
        elif op == "step":
            k, v = (mx.array(rng.standard_normal((batch, 2, 1, 8)).astype(np.float32))
                    for _ in range(2))
            _forward(stock, ours, k, v)
        elif op == "filter" and batch > 1:
            keep = sorted(int(i) for i in rng.choice(batch, size=batch - 1, replace=False))
            stock.filter(keep)
            ours.filter(keep)
        elif op == "extend":
            more = _stock_and_ours(list(rng.integers(0, 12, size=2)), rng)
            stock.extend(more[0])
            ours.extend(more[1])
        elif op == "trim":
            n = int(rng.integers(0, 3))
            if all(n <= r.offset for r in ours.rows):  # mlx-lm trims inside a row's tokens
                assert stock.trim(n) == ours.trim(n)
        for i in range(len(ours.rows)):
            if ours.rows[i].offset:
                want = stock.extract(i)
                got = ours.extract(i)
                assert got.offset == want.offset
                for x, y in zip(want.state[:2], got.materialize(), strict=True):
                    assert np.array_equal(np.array(x), np.array(y))


def test_a_row_dropped_mid_prefill_leaves_the_others_aligned():
    """mlx-lm filters only between prefills; a filter between two steps of a padded prefill
    keeps the remaining rows' padding and tokens in step all the same."""
    rng = np.random.default_rng(0)
    _, ours = _stock_and_ours([3, 0, 5], rng)
    lengths = [6, 2, 4]
    ours.prepare(lengths=lengths, right_padding=[0, 4, 2])
    for step, keep in ((4, [0, 2]), (2, None)):
        batch = len(ours.rows)
        k, v = (mx.array(rng.standard_normal((batch, 2, step, 8)).astype(np.float32))
                for _ in range(2))
        ours.update_and_fetch(k, v)
        if keep:
            ours.filter(keep)
    ours.finalize()
    assert [r.offset for r in ours.rows] == [3 + 6, 5 + 4]
    assert ours.offset.tolist() == [r.offset for r in ours.rows]
    assert (ours.left_padding + ours.offset).tolist() == [ours.size()] * 2
