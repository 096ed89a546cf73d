"""Persistence benchmark: .kvz save/load speed, file size, and lazy single-layer reads.

A synthetic cache shaped like the default model (SmolLM2-135M: 30 layers x 3 KV heads x 64 dims,
fp16; keys carry per-channel offsets like real keys) is saved with several codecs. Speeds are
MB/s of fp16-equivalent data; "1 layer" is opening the file and decoding one layer of 30,
compared with loading the whole file. Every time is the best of ``--repeats`` calls, so the
first call's kernel compile or cache load is left out (``benchmarks/cold_start.py`` times it).

    python benchmarks/persistence.py                  # 8192 tokens
    python benchmarks/persistence.py --tokens 1024 --codecs raw,turbo3
    python benchmarks/persistence.py --tokens 2048 --codecs turbo3,quality,balanced,small
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from kvtool.cache import KVCache
from kvtool.formats import load, open_kvz, save
from kvtool.presets import preset_policy

SETUPS = {
    "raw": {"codec": "raw"},
    "raw+zstd": {"codec": "raw", "zstd": True},
    "int8": {"codec": "int8"},
    "turbo3": {"codec": "turbo3"},
    "turbo4": {"codec": "turbo4"},
    **{name: {"policy": name} for name in ("quality", "balanced", "small")},  # the presets
}


def synthetic_cache(tokens: int, layers: int = 30, heads: int = 3, dim: int = 64,
                    seed: int = 0) -> KVCache:
    rng = np.random.default_rng(seed)
    keys, values = [], []
    for _ in range(layers):
        offsets = rng.normal(0.0, 3.0, size=(heads, 1, dim)).astype(np.float32)
        k = rng.standard_normal((heads, tokens, dim), dtype=np.float32) + offsets
        keys.append(k.astype(np.float16))
        values.append(rng.standard_normal((heads, tokens, dim), dtype=np.float32)
                      .astype(np.float16))
    return KVCache(keys, values, token_ids=rng.integers(0, 49152, tokens),
                   model={"name": "synthetic-smollm2", "fingerprint": "bench"})


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_one_layer(path: str, index: int) -> None:
    with open_kvz(path) as f:
        f.layer(index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--codecs", default=",".join(SETUPS),
                        help=f"comma-separated subset of {', '.join(SETUPS)}")
    parser.add_argument("--repeats", type=int, default=3, help="best of N for each save and read")
    parser.add_argument("--dir", default=None, help="where to write the files (default: tmp)")
    args = parser.parse_args()

    cache = synthetic_cache(args.tokens)
    fp16_mb = cache.nbytes / 1e6
    print(f"cache: {cache.num_layers} layers x 3 kv heads x 64 dims x {args.tokens} tokens, "
          f"fp16, {fp16_mb:.1f} MB")
    header = (f"{'setup':<10} {'file MB':>8} {'vs fp16':>8} {'save MB/s':>10} {'load MB/s':>10} "
              f"{'all ms':>8} {'1 layer ms':>11} {'1/all':>7}")
    print(header)
    print("-" * len(header))
    sizes = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.codecs.split(","):
            path = os.path.join(tmp, f"{name}.kvz")
            setup = dict(SETUPS[name])
            if "policy" in setup:
                setup["policy"] = preset_policy(setup["policy"])
            reports = []
            t_save = best(lambda p=path, s=setup, r=reports: r.append(save(cache, p, **s)),
                          args.repeats)  # warm: benchmarks/cold_start.py times a first call
            report = reports[-1]
            t_all = best(lambda p=path: load(p), args.repeats)
            t_one = best(lambda p=path: read_one_layer(p, cache.num_layers // 2), args.repeats)
            sizes[name] = report["file_bytes"]
            print(f"{name:<10} {report['file_bytes'] / 1e6:>8.2f} {report['ratio']:>7.2f}x "
                  f"{fp16_mb / t_save:>10.0f} {fp16_mb / t_all:>10.0f} {t_all * 1e3:>8.1f} "
                  f"{t_one * 1e3:>11.2f} {t_one / t_all:>6.1%}")
    if "raw" in sizes and "turbo3" in sizes:
        ratio = sizes["raw"] / sizes["turbo3"]
        print(f"\nturbo3 file is {ratio:.2f}x smaller than the raw fp16 file "
              f"(target >= 4.9x: {'ok' if ratio >= 4.9 else 'MISSED'})")


if __name__ == "__main__":
    main()
