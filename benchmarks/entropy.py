"""Entropy coding benchmark: bits/element on disk and load speed of turbo3 with rANS vs fixed width.

Bits/element are the whole file's bits (codes, norms, tables, lane states, tokens, JSON header)
over the number of K/V elements, also split by array; load speed is ``kvtool.load`` in MB/s of
fp16-equivalent data, each setup's time also as a ratio to fixed-width turbo3 in this process.

    # real K/V of the default model (capture once; a raw fp16 file, ~90 MB):
    kvtool capture --prompt-file kvtool/data/eval_text.md --dtype float16 -o /tmp/raw.kvz
    python benchmarks/entropy.py --kvz /tmp/raw.kvz
    python benchmarks/entropy.py --kvz /tmp/raw.kvz --tokens 256   # a prefix-store chunk
    python benchmarks/entropy.py                                   # synthetic, no model needed
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from persistence import best  # benchmarks/ is the script's directory

from kvtool.cache import KVCache
from kvtool.formats import load, open_kvz, save

SETUPS = {"fixed": {}, "zstd": {"zstd": True}, "rans": {"entropy": True},
          "rans+zstd": {"zstd": True, "entropy": True}}


def prefix(cache: KVCache, tokens: int | None) -> KVCache:
    if tokens is None:
        return cache
    ids = None if cache.token_ids is None else cache.token_ids[:tokens]
    return KVCache([k[:, :tokens] for k in cache.keys], [v[:, :tokens] for v in cache.values],
                   token_ids=ids, model=cache.model,
                   tokenizer_fingerprint=cache.tokenizer_fingerprint, layer_info=cache.layer_info)


def parts_bits(path: str, elements: int) -> dict[str, float]:
    """Stored bits/element per array name (codes, norms, ...)."""
    out: dict[str, float] = {}
    with open_kvz(path) as f:
        for name in f.header["tensors"]:
            part = name.rsplit(".", 1)[-1]
            out[part] = out.get(part, 0.0) + 8 * f._entries[name].nbytes / elements
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvz", default=None, help="a raw .kvz capture (default: synthetic)")
    parser.add_argument("--tokens", type=int, default=None, help="use only this prefix")
    parser.add_argument("--codec", default="turbo3", help="codec or policy codec (turbo3)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N loads")
    args = parser.parse_args()

    if args.kvz:
        cache = load(args.kvz)
    else:
        import sys

        sys.path.insert(0, os.path.dirname(__file__))
        from persistence import synthetic_cache

        cache = synthetic_cache(args.tokens or 2048)
    cache = prefix(cache, args.tokens)
    elements = sum(int(k.size + v.size) for k, v in zip(cache.keys, cache.values, strict=True))
    fp16_mb = 2 * elements / 1e6
    print(f"{'real' if args.kvz else 'synthetic'} cache: {cache.num_layers} layers, "
          f"{cache.num_tokens} tokens, {elements} elements; codec {args.codec}")
    header = (f"{'setup':<10} {'bits/el':>8} {'codes':>7} {'norms':>7} {'other':>7} "
              f"{'save s':>7} {'load MB/s':>10} {'load vs fixed':>14}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        base = None
        for name, options in SETUPS.items():
            path = os.path.join(tmp, f"{name}.kvz")
            t0 = time.perf_counter()
            report = save(cache, path, codec=args.codec, **options)
            t_save = time.perf_counter() - t0
            load(path)  # warm (numba's cached start)
            t_load = best(lambda p=path: load(p), args.repeats)
            base = base or t_load
            parts = parts_bits(path, elements)
            codes, norms = parts.pop("codes", 0.0), parts.pop("norms", 0.0)
            total = 8 * report["file_bytes"] / elements
            print(f"{name:<10} {total:>8.4f} {codes:>7.4f} {norms:>7.4f} "
                  f"{total - codes - norms:>7.4f} {t_save:>7.2f} {fp16_mb / t_load:>10.0f} "
                  f"{base / t_load:>13.2f}x")


if __name__ == "__main__":
    main()
