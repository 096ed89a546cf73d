"""KvtoolMLXCache vs mlx-lm's KVCache on the default model (SmolLM2-135M, float32, mlx[cpu]).

Three measurements, one process:

1. **Resident K/V memory** at a 2K context (a 2040-token restored prompt + 8 decoded tokens =
   2048): ``sum(layer.nbytes)`` of each prompt cache. ``KVCache.nbytes`` counts its whole
   buffer, i.e. the step padding (256-token steps) it allocates; ``KvtoolMLXCache.nbytes``
   counts codes, exact sinks/window, and the mirror's buffer where there is one. Also shown
   for bfloat16 K/V (the same caches built from bf16 arrays; no model run needed).
2. **Δppl** on the bundled eval text (``kvtool.evaluate.data_text("eval_text.md")``, first
   ``--ppl-tokens`` tokens, 256-token chunks): mlx-lm with KvtoolMLXCache layers vs mlx-lm with
   KVCache, next to the HF engine's ``kvtool.evaluate.evaluate`` (CompressedCache) for the
   same policy and block size. Both keep each chunk's own tokens exact and attend to the
   earlier ones decoded.
3. **Decode speed**: seconds per decoded token at the 2K context (median of ``--steps``),
   KVCache vs KvtoolMLXCache (decode-on-fetch, and ``mirror=True``), as ratios.

    nice -n 10 python benchmarks/mlx_cache.py
    python benchmarks/mlx_cache.py --codec turbo4 --ppl-tokens 512 --steps 4
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from kvtool.cache import KVCache
from kvtool.engines import mlx as engine
from kvtool.engines.mlx_cache import DEFAULT_BLOCK_SIZE, make_kvtool_cache
from kvtool.policy import CodecPolicy

CONTEXT = 2048
DECODED = 8  # tokens decoded after the restored prompt (CONTEXT in all)
MIB = 2**20


def random_cache(n_layers: int, heads: int, dim: int, tokens: int, dtype: str) -> KVCache:
    """Key/value-like random states (keys with a few large channels, as real keys have)."""
    rng = np.random.default_rng(0)
    scale = np.ones(dim, dtype=np.float32)
    scale[:4] = 8.0
    keys = [(rng.standard_normal((heads, tokens, dim)) * scale).astype(np.float32)
            for _ in range(n_layers)]
    values = [rng.standard_normal((heads, tokens, dim)).astype(np.float32)
              for _ in range(n_layers)]
    return KVCache(keys, values).astype(dtype)


def decode_steps(lm: Any, layers: list[Any], token: int, steps: int) -> float:
    """Median seconds of one decode step (``steps`` greedy steps after ``layers``)."""
    times = []
    y = mx.array([[token]])
    for _ in range(steps):
        start = time.perf_counter()
        logits = lm.model(y, cache=layers)
        y = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(y)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mlx_ppl(lm: Any, ids: list[int], layers: list[Any], chunk: int) -> float:
    """Chunked perplexity of ``ids`` with mlx-lm, the past held in ``layers``."""
    total, count = 0.0, 0
    for start in range(0, len(ids), chunk):
        stop = min(start + chunk, len(ids))
        logits = lm.model(mx.array([ids[start:stop]]), cache=layers)[0].astype(mx.float32)
        targets = ids[start + 1:stop + 1]
        if not targets:
            break
        logp = logits[:len(targets)] - mx.logsumexp(logits[:len(targets)], axis=-1,
                                                    keepdims=True)
        picked = mx.take_along_axis(logp, mx.array(targets)[:, None], axis=-1)
        total -= float(picked.sum())
        count += len(targets)
    return math.exp(total / count)


def memory_rows(lm: Any, policy: CodecPolicy, block: int) -> list[tuple[str, str, float]]:
    """(dtype, cache, MiB) at CONTEXT tokens: restored prompt, then DECODED single tokens."""
    rows = []
    n, (heads, dim) = len(lm.model.layers), engine._kv_shape(lm.model)
    for dtype in ("float32", "bfloat16"):
        cache = random_cache(n, heads, dim, CONTEXT, dtype)
        for name, layers in (("KVCache", [mlx_cache.KVCache() for _ in range(n)]),
                             ("KvtoolMLXCache", make_kvtool_cache(lm.model, policy,
                                                                  block_size=block))):
            for i, layer in enumerate(layers):
                k, v = (mx.array(a)[None] for a in cache.layer(i))
                layer.update_and_fetch(k[:, :, :CONTEXT - DECODED], v[:, :, :CONTEXT - DECODED])
                for t in range(CONTEXT - DECODED, CONTEXT):
                    layer.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
            mx.eval([c.state for c in layers])
            rows.append((dtype, name, sum(c.nbytes for c in layers) / MIB))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codec", default="turbo3", help="codec of keys and values")
    ap.add_argument("--recent-tokens", type=int, default=0)
    ap.add_argument("--sink-tokens", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    policy = CodecPolicy.from_options(args.codec, sink_tokens=args.sink_tokens,
                                      recent_tokens=args.recent_tokens)
    lm = engine.load_mlx("default", "float32")
    print(f"policy {policy.describe()}, block {args.block_size}, SmolLM2-135M "
          f"(30 layers × 3 KV heads × 64)\n")

    print(f"1. resident K/V memory at {CONTEXT} tokens ({CONTEXT - DECODED} restored + "
          f"{DECODED} decoded)")
    rows = memory_rows(lm, policy, args.block_size)
    base = {d: mib for d, name, mib in rows if name == "KVCache"}
    for dtype, name, mib in rows:
        print(f"   {dtype:<9} {name:<15} {mib:8.2f} MiB  {100 * mib / base[dtype]:6.1f}%")

    import torch

    from kvtool.evaluate import evaluate, run_baseline
    from kvtool.models import load_model

    torch.set_num_threads(2)
    loaded = load_model("default", dtype="float32")
    base_run = run_baseline(loaded, chunk=args.chunk, max_tokens=args.ppl_tokens, n_queries=0)
    hf = evaluate(loaded, policy, baseline=base_run, chunk=args.chunk,
                  block_size=args.block_size)
    ids = base_run.ids[0].tolist()
    exact = mlx_ppl(lm, ids, mlx_cache.make_prompt_cache(lm.model), args.chunk)
    packed = mlx_ppl(lm, ids, make_kvtool_cache(lm.model, policy, block_size=args.block_size),
                     args.chunk)
    print(f"\n2. perplexity, bundled eval text, {len(ids)} tokens, {args.chunk}-token chunks")
    print(f"   {'engine':<8} {'exact':>8} {policy.describe():>10} {'Δppl':>8} {'Δppl %':>8}")
    for name, a, b in (("mlx-lm", exact, packed), ("HF", hf.baseline_ppl, hf.ppl)):
        print(f"   {name:<8} {a:8.3f} {b:10.3f} {b - a:8.3f} {100 * (b / a - 1):8.2f}")
    print(f"   |Δppl(mlx) − Δppl(HF)| = {abs((packed - exact) - (hf.ppl - hf.baseline_ppl)):.3f}"
          " points")

    print(f"\n3. decode speed at {CONTEXT} tokens (median of {args.steps} steps, float32)")
    text_ids = ids * (CONTEXT // len(ids) + 1)
    from kvtool.engines.hf import capture  # HF prefills 2K tokens ~50x faster than mlx[cpu]

    prompt = capture(loaded.model, loaded.tokenizer, token_ids=text_ids[:CONTEXT - DECODED],
                     model_info=loaded.info)
    times = {}
    for name, kwargs in (("KVCache", None), ("KvtoolMLXCache", {"mirror": False}),
                         ("KvtoolMLXCache mirror", {"mirror": True})):
        layers = engine.to_prompt_cache(prompt, lm.model, None if kwargs is None else policy,
                                        block_size=args.block_size, **(kwargs or {}))
        times[name] = decode_steps(lm, layers, text_ids[CONTEXT - DECODED], args.steps)
    for name, s in times.items():
        print(f"   {name:<22} {s:7.3f} s/token  {s / times['KVCache']:5.2f}× KVCache's time")


if __name__ == "__main__":
    main()
