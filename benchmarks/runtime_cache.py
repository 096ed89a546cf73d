"""Runtime cache benchmark: resident K/V memory and decode speed at a long context.

One exact prefill of ``--tokens`` random tokens on the default model; every cache is then built
from that prefill's K/V (a CompressedCache built this way holds exactly what a compressed
prefill would: the prefill attends to exact states either way) and greedily decodes ``--steps``
tokens. Caches: ``DynamicCache``, ``CompressedCache`` with turbo3/turbo4 (and any ``--policy``
given), and transformers' ``QuantizedCache`` when its quanto or hqq backend is installed.

Resident bytes are counted in the model's dtype and, for comparison at 16 bits, as if the K/V
were bfloat16. Decode speed is the best of ``--repeats`` interleaved runs, in tokens per second
of wall time and of this process's CPU time (on a shared, busy machine the CPU-time figure is the
steadier one; compare ratios to DynamicCache, not absolute numbers across runs).

    python benchmarks/runtime_cache.py                  # 2048 tokens, 16 decode steps, 1 thread
    python benchmarks/runtime_cache.py --policy "k=turbo4 v=turbo3" --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
from transformers import DynamicCache

from kvtool.cache import KVCache
from kvtool.engines.hf_runtime import CompressedCache, cache_nbytes
from kvtool.models import load_model
from kvtool.policy import CodecPolicy


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


@torch.inference_mode()
def decode_speed(model, past, last_logits, steps: int) -> tuple[float, float]:
    """(tokens/s of wall time, tokens/s of this process's CPU time)."""
    tok = last_logits.argmax(-1)[:, None]
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = model(tok, past_key_values=past, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
    return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu)


def nbytes(cache) -> int:
    return quantized_nbytes(cache) if hasattr(cache.layers[0], "_quantize") \
        else cache_nbytes(cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--recent", type=int, default=128, help="full-precision recent window")
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--policy", action="append", default=[],
                    help="extra policy, e.g. 'k=turbo4 v=turbo3' (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model("default", dtype=args.dtype)
    model = loaded.model
    ids = torch.randint(100, model.config.vocab_size - 100, (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    exact = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = model(ids, past_key_values=exact, use_cache=True).logits[:, -1]
    prefill_s = time.perf_counter() - start
    kv = KVCache([layer.keys[0] for layer in exact.layers],
                 [layer.values[0] for layer in exact.layers])
    kv16 = kv.astype("bfloat16")
    del exact

    policies = {f"{p} recent={args.recent}": CodecPolicy.from_label(p, recent_tokens=args.recent,
                                                            sink_tokens=args.sinks)
                for p in ["turbo3", "turbo4", "k=turbo3:center=true v=turbo3 sink=4",
                          *args.policy]}

    def dynamic(cache: KVCache):
        out = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
            out.update(k[None].clone(), v[None].clone(), i)
        return out

    def factory(policy):
        return lambda c: CompressedCache.from_kvcache(c, policy, block_size=args.block_size)

    def quantized(backend: str):
        def make(cache: KVCache):
            from transformers import QuantizedCache

            out = QuantizedCache(backend, model.config, nbits=4, residual_length=args.recent)
            for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
                out.update(k[None].clone(), v[None].clone(), i)
            return out
        return make

    makers = {"DynamicCache": dynamic, **{f"Compressed {n}": factory(p)
                                          for n, p in policies.items()}}
    absent = [b for b, ok in quantized_backends().items() if not ok]
    makers.update({f"QuantizedCache {b} int4": quantized(b)
                   for b, ok in quantized_backends().items() if ok})
    rows = {name: {"tok_s": 0.0, "cpu_tok_s": 0.0} for name in makers}
    for _ in range(args.repeats):
        for name, make in makers.items():
            past = make(kv)
            rows[name]["bytes"] = nbytes(past)
            wall, cpu = decode_speed(model, past, logits, args.steps)
            rows[name]["tok_s"] = max(rows[name]["tok_s"], wall)
            rows[name]["cpu_tok_s"] = max(rows[name]["cpu_tok_s"], cpu)
            del past
    for name, make in makers.items():
        rows[name]["bytes16"] = nbytes(make(kv16))

    base = rows["DynamicCache"]
    print(f"# default model, {args.tokens}-token context, {args.steps} greedy decode steps, "
          f"{args.dtype}, {args.threads} thread(s); exact prefill {prefill_s:.1f} s")
    print(f"{'cache':<50} {'MB':>7} {'vs dyn':>7} {'MB@bf16':>7} {'vs dyn':>7} "
          f"{'tok/s':>6} {'vs dyn':>7} {'cpu tok/s':>9} {'vs dyn':>7}")
    for name, r in rows.items():
        print(f"{name:<50} {r['bytes'] / 1e6:>7.2f} {r['bytes'] / base['bytes']:>7.1%} "
              f"{r['bytes16'] / 1e6:>7.2f} {r['bytes16'] / base['bytes16']:>7.1%} "
              f"{r['tok_s']:>6.2f} {r['tok_s'] / base['tok_s']:>7.1%} "
              f"{r['cpu_tok_s']:>9.2f} {r['cpu_tok_s'] / base['cpu_tok_s']:>7.1%}")
    for backend in absent:
        print(f"QuantizedCache({backend!r}): backend not installed, skipped "
              f"(pip install {'optimum-quanto' if backend == 'quanto' else 'hqq'} to compare)")


if __name__ == "__main__":
    main()
