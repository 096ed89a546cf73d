"""Concurrent requests on mlx-lm: one at a time vs batched, mlx-lm's KVCache vs KvtoolMLXCache.

What ``kvtool serve --engine mlx`` does when several conversations come back at once: each
request continues a cached prefix (its own ``--prompt-tokens`` of the bundled eval text,
restored from an HF capture, as the server's LRU prompt cache or store holds it) with
``--suffix-tokens`` new ones, then generates ``--new-tokens`` greedily. Four rows, one process,
the default model (SmolLM2-135M, float32, mlx[cpu]):

* ``alone``: the requests one after another (``generate_step``), as the server served them
  before batching (and still does for a request with a seed);
* ``batched``: all together in ``mlx_lm.batch_generate`` (``BatchGenerator``, what the server
  runs), with the same caches.

Columns: wall seconds, generated tokens per second, the ratio to KVCache alone, the K/V held
at the end (``nbytes`` of the requests' caches; KVCache counts its 256-token steps), and
whether the batched requests generated the same tokens as alone.

    nice -n 10 python benchmarks/mlx_batch.py
    python benchmarks/mlx_batch.py --requests 8 --prompt-tokens 1024 --codec turbo4
"""

from __future__ import annotations

import argparse
import copy
import importlib
import time
from typing import Any

import mlx.core as mx

from kvtool.engines import mlx as engine
from kvtool.engines.mlx_cache import DEFAULT_BLOCK_SIZE
from kvtool.policy import CodecPolicy

mlx_generate = importlib.import_module("mlx_lm.generate")  # mlx_lm.generate is a function
MIB = 2**20


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def alone(lm: Any, suffixes: list[list[int]], caches: list[list[Any]], new: int,
          ) -> tuple[list[list[int]], list[list[Any]]]:
    """Each request by itself; its tokens (to the first end-of-sequence) and its cache."""
    eos = set(lm.wrapper.eos_token_ids)
    out = []
    for suffix, cache in zip(suffixes, caches, strict=True):
        tokens = []
        for t, _ in mlx_generate.generate_step(mx.array(suffix), lm.model, prompt_cache=cache,
                                               max_tokens=new, sampler=greedy):
            if int(t) in eos:
                break
            tokens.append(int(t))
        out.append(tokens)
    return out, caches


def batched(lm: Any, suffixes: list[list[int]], caches: list[list[Any]], new: int,
            ) -> tuple[list[list[int]], list[list[Any]]]:
    """All requests in one ``mlx_lm.batch_generate``; tokens and caches as :func:`alone`."""
    r = mlx_generate.batch_generate(lm.model, lm.wrapper, suffixes, prompt_caches=caches,
                                    max_tokens=new, return_prompt_caches=True,
                                    return_token_ids=True)
    return [list(map(int, t)) for t in r.token_ids], r.caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codec", default="turbo3", help="codec of keys and values")
    ap.add_argument("--recent-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=512,
                    help="each request's cached prefix")
    ap.add_argument("--suffix-tokens", type=int, default=8, help="each request's new prompt")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens each request generates")
    args = ap.parse_args()
    policy = CodecPolicy.from_options(args.codec, recent_tokens=args.recent_tokens)

    import torch

    from kvtool.engines.hf import capture  # HF prefills ~50x faster than mlx[cpu]
    from kvtool.evaluate import data_text
    from kvtool.models import load_model

    torch.set_num_threads(2)
    loaded = load_model("default", dtype="float32")
    lm = engine.load_mlx("default", "float32")
    ids = loaded.tokenizer(data_text("eval_text.md"))["input_ids"]
    span = args.prompt_tokens + args.suffix_tokens
    stride = max(1, (len(ids) - span) // max(1, args.requests - 1))
    starts = [min(i * stride, len(ids) - span) for i in range(args.requests)]
    if len(ids) < span:
        raise SystemExit(f"the eval text has {len(ids)} tokens, fewer than {span}")
    prefixes = [capture(loaded.model, loaded.tokenizer, model_info=loaded.info,
                        token_ids=ids[s:s + args.prompt_tokens]) for s in starts]
    suffixes = [ids[s + args.prompt_tokens:s + span] for s in starts]
    print(f"{args.requests} requests, each {args.prompt_tokens} cached + {args.suffix_tokens} "
          f"new prompt tokens, {args.new_tokens} generated; SmolLM2-135M float32; "
          f"policy {policy.describe()}, block {args.block_size}\n")

    warm = engine.to_prompt_cache(prefixes[0], lm.model, policy, block_size=args.block_size)
    batched(lm, [suffixes[0][:2]] * 2, [warm, copy.deepcopy(warm)], 2)  # compile, allocate
    results: dict[tuple[str, str], tuple[float, list[list[int]], float]] = {}
    for cache_name, row_policy in (("KVCache", None), ("KvtoolMLXCache", policy)):
        restored = [engine.to_prompt_cache(p, lm.model, row_policy, block_size=args.block_size)
                    for p in prefixes]
        for mode, run in (("alone", alone), ("batched", batched)):
            caches = copy.deepcopy(restored)
            start = time.perf_counter()
            tokens, ends = run(lm, suffixes, caches, args.new_tokens)
            seconds = time.perf_counter() - start
            held = sum(layer.nbytes for cache in ends for layer in cache) / MIB
            results[cache_name, mode] = (seconds, tokens, held)

    base = results["KVCache", "alone"][0]
    print("| cache | requests | seconds | generated tok/s | time vs KVCache alone | K/V held "
          "(MiB) | same tokens as alone |")
    print("|---|---|---|---|---|---|---|")
    for (cache_name, mode), (seconds, tokens, held) in results.items():
        same = sum(t == a for t, a in zip(tokens, results[cache_name, "alone"][1], strict=True))
        print(f"| {cache_name} | {mode} | {seconds:.2f} | "
              f"{sum(map(len, tokens)) / seconds:.1f} | {seconds / base:.2f}x | {held:.1f} | "
              f"{same}/{len(tokens)} |")


if __name__ == "__main__":
    main()
