"""One layer's decode-step attention on the CPU: from codes (the numba kernel ``CompressedCache``
calls) against SDPA on the exact K/V (what ``DynamicCache`` pays), in the same process.

A one-layer random-init Llama (no weights needed) with ``--kv-heads`` KV heads of ``--dim``
channels and ``--groups`` query heads per KV head prefills ``--tokens`` tokens into a
``CompressedCache`` of each policy (blocks of 64), then takes one decode step; the kernel call
that step makes (:mod:`kvtool.kernels.numba_attention` for ``quality`` and plain turbo,
:mod:`kvtool.kernels.numba_attention_parts` for the other presets) is replayed with the same
arguments, best of ``--repeats`` runs of ``--calls`` calls, interleaved with
``torch.nn.functional.scaled_dot_product_attention`` on fp32 K/V of the same shape. The kernel
call is the whole of the step's attention work apart from transformers' hook (a few µs).

    python benchmarks/attend_cpu.py                              # 4K tokens, 3 and 4 groups
    python benchmarks/attend_cpu.py --tokens 4096 16384 --groups 4 --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--policy", default="quality,balanced,small",
                   help="comma list of presets or codecs (default quality,balanced,small)")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--groups", type=int, nargs="+", default=[3, 4],
                   help="query heads per KV head (default 3, the default model's, and 4)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=20, help="calls per timed run (default 20)")
    p.add_argument("--repeats", type=int, default=7, help="best of this many runs (default 7)")
    return p.parse_args(argv)


def captured_call(policy: str, tokens: int, groups: int, args: argparse.Namespace
                  ) -> tuple[Callable[[], object], torch.Tensor]:
    """The kernel call of a decode step over ``tokens`` encoded with ``policy`` (replayable),
    and that step's query."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtool.engines.hf_runtime import CompressedCache
    from kvtool.kernels import numba_attention, numba_attention_parts
    from kvtool.policy import CodecPolicy

    heads = args.kv_heads * groups
    config = LlamaConfig(vocab_size=64, hidden_size=heads * args.dim, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.dim,
                         max_position_embeddings=tokens + 8)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 64, (1, tokens))
    calls: list[tuple[Callable[..., object], tuple]] = []
    kept = {}
    for module in (numba_attention, numba_attention_parts):
        for name in ("_serial", "_parallel"):
            kernel = kept[module, name] = getattr(module, name)
            setattr(module, name, lambda *a, _k=kernel: calls.append((_k, a)) or _k(*a))
    try:
        past = CompressedCache(CodecPolicy.from_label(policy), config=config, block_size=64,
                               attention_from_codes=True)
        with torch.inference_mode():
            model(ids, past_key_values=past, use_cache=True)
            calls.clear()
            model(ids[:, :1], past_key_values=past, use_cache=True)
    finally:
        for (module, name), kernel in kept.items():
            setattr(module, name, kernel)
    if len(calls) != 1:
        raise SystemExit(f"{policy}: the decode step made {len(calls)} kernel calls, not one "
                         "(did it fall back to decode-then-attend?)")
    kernel, a = calls[0]
    return (lambda: kernel(*a)), torch.from_numpy(a[0])


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds a call of ``fn``, averaged over ``calls`` calls in a row."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    print(f"one layer's decode-step attention: {args.kv_heads} KV heads x {args.dim}, "
          f"{args.threads} thread(s), best of {args.repeats} x {args.calls} calls")
    print("| tokens | groups | policy | from codes µs | SDPA fp32 µs | from codes / SDPA |")
    print("|---|---|---|---|---|---|")
    for tokens in args.tokens:
        for groups in args.groups:
            kv = [torch.randn(1, args.kv_heads, tokens, args.dim) for _ in range(2)]
            for policy in args.policy.split(","):
                call, q = captured_call(policy, tokens, groups, args)

                def sdpa(q: torch.Tensor = q, k: torch.Tensor = kv[0],
                         v: torch.Tensor = kv[1]) -> torch.Tensor:
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, enable_gqa=True)

                codes_s, sdpa_s = [], []
                for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
                    codes_s.append(per_call(call, args.calls))
                    sdpa_s.append(per_call(sdpa, args.calls))
                c, s = min(codes_s), min(sdpa_s)
                print(f"| {tokens} | {groups} | {policy} | {c * 1e6:.0f} | {s * 1e6:.0f} | "
                      f"{c / s:.2f} |")


if __name__ == "__main__":
    main()
