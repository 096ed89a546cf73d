"""Where a call of attention from codes spends its time on a GPU: host launch cost, device time
at the kernel's own split-K choice and at other splits, the autotuner's picks, and a profile of
the host side.

For each (batch, tokens) it prints the call's CUDA-event time, its host µs (calls issued back to
back), its device time alone (CUDA-graph replay) and SDPA's three on fp16 K/V, then the device
time at each ``--splits`` value; then the config the autotuner chose per key, and the top of a
``cProfile`` of ``--profile-calls`` calls at the first shape. Hq 32, Hkv 8, D 128, turbo3 keys
and values (what ``benchmarks/gpu.py``'s attention table uses). Needs CUDA.

    python benchmarks/gpu_attention_split.py                       # 1/8 × 8K/32K, splits 8,16,64
    python benchmarks/gpu_attention_split.py --shapes 1x8K --splits 4,8,16,32,64,128
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from gpu_common import Clock, count  # benchmarks/ is the script's directory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x8K,8x8K,1x32K,8x32K", help="BATCHxTOKENS list")
    p.add_argument("--splits", default="8,16,64", help="split_k values to time (device)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--profile-calls", type=int, default=300, help="0: no profile")
    p.add_argument("--warm-l2", action="store_true",
                   help="time back to back (default: each timed call starts with a flushed L2)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch

    from kvtool.kernels import triton_attention as ta
    from kvtool.kernels import triton_cuda as tc

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_attention_split.py needs a CUDA device")
    clock = Clock(torch, "cuda", args.repeats, cold_l2=not args.warm_l2)
    hq, hkv, dim, scale = 32, 8, 128, 128 ** -0.5
    sdpa_fn = torch.nn.functional.scaled_dot_product_attention
    first = None
    for shape in args.shapes.split(","):
        batch, tokens = int(shape.split("x")[0]), count(shape.split("x")[1])
        q = torch.randn((batch, hq, dim), device="cuda", dtype=torch.float16)
        k, v = (torch.randn((batch, hkv, tokens, dim), device="cuda", dtype=torch.float16)
                for _ in range(2))
        (kc, kn), (vc, vn) = tc.turbo_encode(k, 3, 11), tc.turbo_encode(v, 3, 12)
        kn, vn = kn.half(), vn.half()
        kd, vd = tc.turbo_decode(kc, kn, dim, 3, 11, k.dtype), tc.turbo_decode(vc, vn, dim, 3, 12,
                                                                               v.dtype)

        def codes(split=None, q=q, kc=kc, kn=kn, vc=vc, vn=vn):
            return ta.turbo_decode_attention(q, kc, kn, vc, vn, dim=dim, k_bits=3, k_seed=11,
                                             v_bits=3, v_seed=12, scale=scale, split_k=split)

        def sdpa(q=q, kd=kd, vd=vd):
            return sdpa_fn(q[:, :, None], kd, vd, scale=scale, enable_gqa=True)[:, :, 0]

        first = first or codes
        times = {"codes": clock.median_ms(codes) * 1e3, "sdpa": clock.median_ms(sdpa) * 1e3,
                 "codes_host": clock.host_us(codes), "sdpa_host": clock.host_us(sdpa),
                 "codes_graph": (clock.graph_ms(codes) or 0) * 1e3,
                 "sdpa_graph": (clock.graph_ms(sdpa) or 0) * 1e3}
        diff = (codes().float() - sdpa().float()).abs().max().item()
        print(f"B={batch} tokens={tokens} split={ta._splits(q.device, batch * hkv, tokens)} "
              f"max|diff|={diff:.1e} " + " ".join(f"{k}={v:.1f}µs" for k, v in times.items()),
              flush=True)
        for split in (int(s) for s in args.splits.split(",") if s):
            if split <= tokens // 128:
                graph = clock.graph_ms(lambda s=split: codes(s)) or 0
                print(f"   split={split:4d} graph={graph * 1e3:.1f}µs", flush=True)
    print("autotuner picks (key → config):")
    for key, config in getattr(ta._attend_kernel, "cache", {}).items():
        print(f"   {key[:9]} → {config}")
    print(f"direct launches: {ta._LAUNCH.fast} over {len(ta._LAUNCH.compiled)} keys")
    if args.profile_calls and first is not None:
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(args.profile_calls):
            first()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
