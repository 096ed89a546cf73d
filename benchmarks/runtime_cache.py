"""Runtime cache benchmark: resident K/V memory and decode speed at long contexts.

One exact prefill of the longest ``--tokens`` context of random tokens on the default model; for
each context length every cache is built from that prefill's K/V, cut to the length (a
CompressedCache built this way holds exactly what a compressed prefill would: the prefill attends
to exact states either way), and decodes ``--steps`` tokens, all caches fed the same (random)
tokens so their logits compare. Caches: ``DynamicCache``; ``CompressedCache`` with turbo3/turbo4
(and any ``--policy`` given), each twice where it can — attending straight from the codes (the
default, ``codes``) and decoding the store first (``attention_from_codes=False``, ``decode``);
and transformers' ``QuantizedCache`` when its quanto or hqq backend is installed.

Resident bytes are counted in the model's dtype and, for comparison at 16 bits, as if the K/V
were bfloat16. Decode speed: the caches take their steps in turn (interleaved, so a busy machine
slows them alike), after one untimed warm-up step each; tokens per second is the inverse of the
median step, of wall time and of this process's CPU time (compare ratios to DynamicCache, not
absolute numbers across runs). ``Δlogit``: max |logit difference| of a ``codes`` cache against
the ``decode`` cache of the same policy over every step (0 where identical).

    python benchmarks/runtime_cache.py                        # 2048 tokens, 8 steps, 1 thread
    python benchmarks/runtime_cache.py --tokens 1024 2048 4096 --steps 6
    python benchmarks/runtime_cache.py --policy "k=turbo4 v=turbo3" --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
from transformers import DynamicCache

from kvtool.cache import KVCache
from kvtool.engines import hf_attention
from kvtool.engines.hf_runtime import CompressedCache, cache_nbytes
from kvtool.models import load_model
from kvtool.policy import CodecPolicy

DEFAULT_POLICIES = ["turbo3", "turbo4", "k=turbo3:center=true v=turbo3 sink=4"]


def quantized_backends() -> dict[str, bool]:
    """transformers' QuantizedCache backends and whether each is installed."""
    return {"quanto": importlib.util.find_spec("optimum") is not None
            and importlib.util.find_spec("optimum.quanto") is not None,
            "hqq": importlib.util.find_spec("hqq") is not None}


def tensor_bytes(obj) -> int:
    """Bytes of a tensor, including quantized tensor subclasses (their inner tensors)."""
    if hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(tensor_bytes(getattr(obj, n)) for n in names)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 0


def quantized_nbytes(cache) -> int:
    """Resident bytes of a transformers QuantizedCache (quantized part + residual)."""
    return sum(tensor_bytes(getattr(layer, name, None)) for layer in cache.layers
               for name in ("_quantized_keys", "_quantized_values", "keys", "values"))


def codes_capable(cache) -> bool:
    """Whether some layer of a CompressedCache can attend from codes."""
    return isinstance(cache, CompressedCache) and any(x.codes_capable for x in cache.layers)


@torch.inference_mode()
def interleaved_steps(model, pasts: dict, tokens: torch.Tensor) -> dict[str, dict]:
    """Feed ``tokens`` [1, 1 + steps] to every cache in turn (the first step untimed): per cache
    the step times (wall and CPU seconds), its last-position logits, attention-from-codes calls."""
    runs = {name: {"wall": [], "cpu": [], "logits": [], "codes": 0} for name in pasts}
    for step in range(tokens.shape[1]):
        tok = tokens[:, step:step + 1]
        for name, past in pasts.items():
            before = hf_attention.STATS["codes"]
            wall, cpu = time.perf_counter(), time.process_time()
            logits = model(tok, past_key_values=past, use_cache=True).logits[0, -1]
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            run = runs[name]
            run["codes"] += hf_attention.STATS["codes"] - before
            run["logits"].append(logits.float())
            if step:
                run["wall"].append(wall)
                run["cpu"].append(cpu)
    return runs


def nbytes(cache) -> int:
    return quantized_nbytes(cache) if hasattr(cache.layers[0], "_quantize") \
        else cache_nbytes(cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048],
                    help="context lengths (one prefill of the longest)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per context")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--recent", type=int, default=128, help="full-precision recent window")
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--policy", action="append", default=[],
                    help="extra policy, e.g. 'k=turbo4 v=turbo3' (repeatable)")
    ap.add_argument("--only", action="store_true",
                    help="only the --policy policies, not the default ones")
    ap.add_argument("--no-decode", action="store_true",
                    help="skip the decode-then-attend caches (faster; no Δlogit)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if importlib.util.find_spec("numba") is not None:  # compiled kernels: the same thread count
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))

    loaded = load_model("default", dtype=args.dtype)
    model = loaded.model
    longest = max(args.tokens)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, longest + args.steps + 1),
                        generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    exact = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :longest], past_key_values=exact, use_cache=True)
    prefill_s = time.perf_counter() - start
    full = KVCache([layer.keys[0] for layer in exact.layers],
                   [layer.values[0] for layer in exact.layers])
    del exact

    policies = {f"{p} recent={args.recent}": CodecPolicy.from_label(p, recent_tokens=args.recent,
                                                            sink_tokens=args.sinks)
                for p in [*([] if args.only else DEFAULT_POLICIES), *args.policy]}

    def dynamic(cache: KVCache):
        out = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
            out.update(k[None].clone(), v[None].clone(), i)
        return out

    def compressed(policy, from_codes: bool | None):
        return lambda c: CompressedCache.from_kvcache(c, policy, model, block_size=args.block_size,
                                                      attention_from_codes=from_codes)

    def quantized(backend: str):
        def make(cache: KVCache):
            from transformers import QuantizedCache

            out = QuantizedCache(backend, model.config, nbits=4, residual_length=args.recent)
            for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
                out.update(k[None].clone(), v[None].clone(), i)
            return out
        return make

    makers, pairs = {"DynamicCache": dynamic}, {}
    for name, policy in policies.items():
        probe = CompressedCache(policy, config=model.config)
        if codes_capable(probe):
            makers[f"Compressed {name} codes"] = compressed(policy, None)
            if not args.no_decode:
                makers[f"Compressed {name} decode"] = compressed(policy, False)
                pairs[f"Compressed {name} codes"] = f"Compressed {name} decode"
        else:
            makers[f"Compressed {name}"] = compressed(policy, None)
    absent = [b for b, ok in quantized_backends().items() if not ok]
    makers.update({f"QuantizedCache {b} int4": quantized(b)
                   for b, ok in quantized_backends().items() if ok})

    print(f"# default model, {args.steps} decode steps (median), {args.dtype}, "
          f"{args.threads} thread(s); exact prefill of {longest} tokens {prefill_s:.1f} s")
    for length in args.tokens:
        kv = KVCache([k[:, :length] for k in full.keys], [v[:, :length] for v in full.values])
        kv16 = kv.astype("bfloat16")
        pasts = {name: make(kv) for name, make in makers.items()}
        sizes = {name: nbytes(past) for name, past in pasts.items()}
        sizes16 = {name: nbytes(make(kv16)) for name, make in makers.items()}
        runs = interleaved_steps(model, pasts, ids[:, length:length + args.steps + 1])
        del pasts
        tok_s = {n: 1 / statistics.median(r["wall"]) for n, r in runs.items()}
        cpu_s = {n: 1 / statistics.median(r["cpu"]) for n, r in runs.items()}
        print(f"\n## {length}-token context")
        print(f"{'cache':<56} {'MB':>7} {'vs dyn':>7} {'MB@bf16':>7} {'vs dyn':>7} "
              f"{'tok/s':>6} {'vs dyn':>7} {'cpu tok/s':>9} {'vs dyn':>7} {'Δlogit':>8} "
              f"{'codes':>5}")
        dyn, dyn16 = sizes["DynamicCache"], sizes16["DynamicCache"]
        for name, run in runs.items():
            delta = "-"
            if name in pairs:
                ref = runs[pairs[name]]["logits"]
                diff = max((a - b).abs().max().item()
                           for a, b in zip(run["logits"], ref, strict=True))
                delta = f"{diff:.1e}"
            print(f"{name:<56} {sizes[name] / 1e6:>7.2f} {sizes[name] / dyn:>7.1%} "
                  f"{sizes16[name] / 1e6:>7.2f} {sizes16[name] / dyn16:>7.1%} "
                  f"{tok_s[name]:>6.2f} {tok_s[name] / tok_s['DynamicCache']:>7.1%} "
                  f"{cpu_s[name]:>9.2f} {cpu_s[name] / cpu_s['DynamicCache']:>7.1%} "
                  f"{delta:>8} {run['codes']:>5}")
    for backend in absent:
        print(f"QuantizedCache({backend!r}): backend not installed, skipped "
              f"(pip install {'optimum-quanto' if backend == 'quanto' else 'hqq'} to compare)")


if __name__ == "__main__":
    main()
