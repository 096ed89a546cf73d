"""GPU throughput of the Triton turbo kernels (:mod:`kvtool.kernels.triton_cuda`).

Three tables:

1. turbo2/3/4 encode (fp16 in) and decode (fp16 out) in GB/s next to a device-to-device
   ``dst.copy_(src)`` of the same fp16 array, measured in the same run. Every column counts
   fp16-equivalent bytes, ``vectors * D * 2`` (so the copy, which reads and writes that much,
   shows half its raw traffic).
2. Each preset's key and value codec (``quality``, ``balanced``, ``small``) through the codec
   API on CUDA tensors (``codec.encode(x)``, ``codec.decode(enc)``, fp16), GB/s next to the copy:
   what a vLLM or transformers user on a GPU gets (``turbomix`` has no Triton kernels yet, so
   this is its host round trip).
3. Decode attention straight from codes (one query per sequence, GQA) against decoding K and V
   to fp16 and running ``torch.nn.functional.scaled_dot_product_attention``; the SDPA time on
   already-decoded fp16 K/V is shown too.

Times are medians over CUDA-event-timed repeats after warm-up (the first calls also autotune).

    python benchmarks/gpu.py                      # everything (64M vectors needs ~70 GB)
    python benchmarks/gpu.py --max-vectors 4M --dims 128 --tokens 1K,8K
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def count(text: str) -> int:
    """'4M' → 4194304, '1K' → 1024, '300' → 300."""
    text = text.strip().upper()
    return int(text[:-1]) * SUFFIX[text[-1]] if text[-1] in SUFFIX else int(text)


def counts(text: str) -> list[int]:
    return [count(t) for t in text.split(",") if t.strip()]


def human(n: int) -> str:
    for s in ("G", "M", "K"):
        if n >= SUFFIX[s] and n % SUFFIX[s] == 0:
            return f"{n // SUFFIX[s]}{s}"
    return str(n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--vectors", type=counts, default=counts("1M,4M,16M,64M"),
                   help="vector counts for encode/decode (default 1M,4M,16M,64M)")
    p.add_argument("--max-vectors", type=count, default=None,
                   help="drop vector counts above this (e.g. 4M for a quick run)")
    p.add_argument("--dims", type=counts, default=[64, 128, 256], help="head dims")
    p.add_argument("--bits", type=counts, default=[2, 3, 4], help="turbo bit widths")
    p.add_argument("--tokens", type=counts, default=counts("1K,2K,4K,8K,16K,32K"),
                   help="context lengths for decode attention")
    p.add_argument("--batches", type=counts, default=[1, 4, 8], help="batch sizes (attention)")
    p.add_argument("--heads", type=int, default=32, help="query heads (attention)")
    p.add_argument("--kv-heads", type=int, default=8, help="kv heads (attention)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (attention)")
    p.add_argument("--k-bits", type=int, default=3, help="key codec turbo<k> (attention)")
    p.add_argument("--v-bits", type=int, default=3, help="value codec turbo<v> (attention)")
    p.add_argument("--split-k", type=int, default=None, help="splits (default: heuristic)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per measurement")
    p.add_argument("--preset-vectors", type=count, default=count("64K"),
                   help="vectors per preset codec call (D=--head-dim; default 64K: the host "
                        "round trip takes seconds per call)")
    p.add_argument("--skip-throughput", action="store_true", help="only the attention table")
    p.add_argument("--skip-presets", action="store_true", help="no preset table")
    p.add_argument("--skip-attention", action="store_true", help="only the throughput table")
    args = p.parse_args(argv)
    if args.max_vectors is not None:
        args.vectors = [n for n in args.vectors if n <= args.max_vectors]
    return args


def timer(torch, repeats: int) -> Callable[[Callable[[], object]], float]:
    def measure(fn: Callable[[], object]) -> float:
        """Median milliseconds of ``fn`` after warm-up."""
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    return measure


def copy_ms(torch, measure, x) -> float:
    dst = torch.empty_like(x)
    return measure(lambda: dst.copy_(x))


def codec_ms(torch, tc, measure, x, bits: int, seed: int) -> tuple[float, float]:
    """(encode ms, decode ms) of fp16 ``x`` with turbo<bits>."""
    encode = measure(lambda: tc.turbo_encode(x, bits, seed))
    codes, norms = tc.turbo_encode(x, bits, seed)
    norms = norms.half()
    dim = x.shape[-1]
    return encode, measure(lambda: tc.turbo_decode(codes, norms, dim, bits, seed, torch.float16))


def throughput(args: argparse.Namespace, torch, tc, measure) -> None:
    seed = 0x6B76
    head = ["D", "vectors", "copy"] + [f"{op} t{b}" for b in args.bits for op in ("enc", "dec")]
    print("\nencode (fp16 in) / decode (fp16 out), GB/s of fp16-equivalent bytes (vectors*D*2)")
    print(" | ".join(f"{h:>9}" for h in head))
    for dim in args.dims:
        for n in args.vectors:
            size = n * dim * 2
            free, _ = torch.cuda.mem_get_info()
            if free < 2.3 * size:
                print(f"{dim:>9} | {human(n):>9} | skipped: needs ~{2.3 * size / 2**30:.0f} GiB "
                      f"of GPU memory, {free / 2**30:.0f} GiB free")
                continue
            x = torch.randn((n, dim), device="cuda", dtype=torch.float16)
            times = [copy_ms(torch, measure, x)]
            for bits in args.bits:
                times.extend(codec_ms(torch, tc, measure, x, bits, seed))
            x = None
            torch.cuda.empty_cache()
            cells = [f"{dim:>9}", f"{human(n):>9}"] + [f"{size / ms / 1e6:>9.0f}" for ms in times]
            print(" | ".join(cells), flush=True)


def attention_row(args: argparse.Namespace, torch, tc, measure, b: int, n: int) -> list[str]:
    """One attention table row: batch ``b``, ``n`` tokens."""
    f = torch.nn.functional
    hq, hkv, dim = args.heads, args.kv_heads, args.head_dim
    kb, vb, ks, vs = args.k_bits, args.v_bits, 11, 12
    scale = dim**-0.5
    q = torch.randn((b, hq, dim), device="cuda", dtype=torch.float16)
    kc, kn = tc.turbo_encode(torch.randn((b, hkv, n, dim), device="cuda", dtype=torch.float16),
                             kb, ks)
    vc, vn = tc.turbo_encode(torch.randn((b, hkv, n, dim), device="cuda", dtype=torch.float16),
                             vb, vs)
    kn, vn = kn.half(), vn.half()

    def ours():
        return tc.turbo_decode_attention(q, kc, kn, vc, vn, dim=dim, k_bits=kb, k_seed=ks,
                                         v_bits=vb, v_seed=vs, scale=scale, split_k=args.split_k)

    def sdpa(kd, vd):
        return f.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale,
                                              enable_gqa=hq != hkv)[:, :, 0]

    def decoded():
        return (tc.turbo_decode(kc, kn, dim, kb, ks, torch.float16),
                tc.turbo_decode(vc, vn, dim, vb, vs, torch.float16))

    t_ours = measure(ours)
    t_base = measure(lambda: sdpa(*decoded()))
    kd, vd = decoded()
    t_sdpa = measure(lambda: sdpa(kd, vd))
    diff = (ours() - sdpa(kd, vd).float()).abs().max().item()
    return [f"{b:>9}", f"{human(n):>9}", f"{t_ours * 1e3:>9.1f}", f"{t_base * 1e3:>9.1f}",
            f"{t_sdpa * 1e3:>9.1f}", f"{t_base / t_ours:>8.1f}x", f"{diff:>9.1e}"]


def attention(args: argparse.Namespace, torch, tc, measure) -> None:
    print(f"\ndecode attention, Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim}, keys "
          f"turbo{args.k_bits}, values turbo{args.v_bits}: µs per step")
    head = ["B", "tokens", "codes", "dec+sdpa", "sdpa fp16", "speedup", "max|diff|"]
    print(" | ".join(f"{h:>9}" for h in head))
    for b in args.batches:
        for n in args.tokens:
            print(" | ".join(attention_row(args, torch, tc, measure, b, n)), flush=True)
            torch.cuda.empty_cache()


def presets(args: argparse.Namespace, torch) -> None:
    from kvtool.policy import PRESETS, preset_policy

    measure = timer(torch, 3)
    n, dim = args.preset_vectors, args.head_dim
    size = n * dim * 2
    x = torch.randn((n, dim), device="cuda", dtype=torch.float16)
    copy = copy_ms(torch, measure, x)
    print(f"\npresets through the codec API, {human(n)} x {dim} fp16 on the GPU, GB/s "
          f"(x copy at {size / copy / 1e6:.0f} GB/s)")
    print(" | ".join(f"{h:>12}" for h in ("preset", "role", "encode", "(x copy)", "decode",
                                           "(x copy)")))
    for name in PRESETS:
        if name == "lossless":
            continue
        policy = preset_policy(name)
        for role, codec in (("key", policy.key), ("value", policy.value)):
            enc = codec.encode(x)
            times = (measure(lambda c=codec: c.encode(x)),
                     measure(lambda c=codec, e=enc: c.decode(e)))
            cells = [name, role] + [f"{v:.2f}" for ms in times
                                    for v in (size / ms / 1e6, copy / ms)]
            print(" | ".join(f"{c:>12}" for c in cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("benchmarks/gpu.py: torch is not installed; this benchmark needs CUDA torch")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: CUDA is not available (torch.cuda.is_available() is False);"
                 " this benchmark needs an NVIDIA GPU")
    from kvtool.kernels import triton_cuda as tc

    if not tc.available():
        sys.exit("benchmarks/gpu.py: triton is not installed; pip install triton")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {tc.triton.__version__}")
    measure = timer(torch, args.repeats)
    if not args.skip_throughput:
        throughput(args, torch, tc, measure)
    if not args.skip_presets:
        presets(args, torch)
    if not args.skip_attention:
        attention(args, torch, tc, measure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
