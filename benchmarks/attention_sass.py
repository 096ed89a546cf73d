"""What attention from codes (:mod:`kvtool.kernels.triton_attention`) compiles to on a GPU,
without one: per autotune config, the registers, spills and shared memory of the kernel, and
the SASS of its token loop (the loop over code tiles that holds the ``tl.dot``\\ s): warp-
instructions per token of one KV head, load/store instructions per token, and the two costs
the unpacking of codes used to carry, table loads (``ld.global.nc`` per code) and 16-bit
shared-memory stores.

Compiled ahead of time like ``benchmarks/triton_sass.py`` (default sm_90) for uncentered turbo
keys and values, bf16 queries and exact tokens, 4 query rows per KV head (32 query heads over
8). ``--preset`` compiles :mod:`kvtool.kernels.triton_attention_parts` instead, for the
``balanced`` or ``small`` preset's codes at D=128 (their outlier parts, trellis codes, 4
candidates, centered keys, blocks of 64); there the loop is a block's (a tile of 64 tokens
makes no loop: "-"). A model, not a measurement: ``benchmarks/gpu_attention_split.py`` on a
GPU is the truth.

    python benchmarks/attention_sass.py                    # turbo2/3/4 at D=128
    python benchmarks/attention_sass.py --dims 64,256 --bits 3
    python benchmarks/attention_sass.py --preset balanced
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

from triton_sass import compile_kernel, loops, sass_profile

_LSU = ("LDG", "STG", "LDS", "STS", "LDSM", "STSM")
_POINTERS = dict(q_ptr="*bf16", krt_ptr="*bf16", kc_ptr="*u8", kn_ptr="*fp16", vc_ptr="*u8",
                 vn_ptr="*fp16", kcent_ptr="*fp16", vcent_ptr="*fp16", order_ptr="*i32",
                 goff_ptr="*i32", mean_ptr="*fp16", vr_ptr="*bf16", ke_ptr="*bf16",
                 ve_ptr="*bf16", bias_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32",
                 acc_ptr="*fp32", count_ptr="*i32", out_ptr="*bf16")
_INTS = ("N", "NBLK", "X", "S", "E", "hkv", "nq", "hq", "R", "bias_b", "sb", "sh", "sn",
         "size_class")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--arch", type=int, default=90, help="sm_XX target (default 90)")
    p.add_argument("--dims", default="128", help="head dims (comma-separated)")
    p.add_argument("--bits", default="2,3,4", help="turbo bit widths of keys and values")
    p.add_argument("--rows", type=int, default=16,
                   help="query rows per KV head the program holds, padded (16, 32 or 64)")
    p.add_argument("--quality", action="store_true",
                   help="the quality preset's codes: 4 candidate rotations each, centered keys "
                        "(blocks of 64); --bits sets the key width, values at 3 bits")
    p.add_argument("--preset", choices=("balanced", "small"),
                   help="the parts kernel on this preset's codes (D=128) instead")
    p.add_argument("--all-configs", action="store_true",
                   help="also the configs the autotuner prunes (marked 'pruned')")
    return p.parse_args(argv)


def token_loop(kernel) -> list[str]:
    """The SASS instructions (opcode and modifiers) of the longest loop that runs ``HMMA``."""
    return max((body for body in loops(kernel) if any(o.startswith("HMMA") for o in body)),
               key=len, default=[])


def _row(kernel, warps: int, block_n: int, looped: bool = True) -> str:
    """regs | spill | smem KB | instr/token | ld/st/token | table loads | 16-bit STS (the
    per-token columns "-" where the token tiles make no loop)."""
    regs, spill, _ = sass_profile(kernel)
    loop = Counter(token_loop(kernel) if looped else ())
    per_token = warps / block_n
    lsu = sum(n for op, n in loop.items() if op.startswith(_LSU))
    table = sum(n for op, n in loop.items() if op.startswith("LDG") and ".CONSTANT" in op)
    sts16 = sum(n for op, n in loop.items() if op.startswith("STS.U16"))
    if not loop:
        return f"{regs:>4} | {spill:>5} | {kernel.metadata.shared / 1024:>7.1f} | " + " | ".join(
            f"{'-':>{w}}" for w in (11, 11, 11, 10))
    return (f"{regs:>4} | {spill:>5} | {kernel.metadata.shared / 1024:>7.1f} | "
            f"{sum(loop.values()) * per_token:>11.1f} | {lsu * per_token:>11.1f} | "
            f"{table * per_token:>11.1f} | {sts16 * per_token:>10.1f}")


def _preset_parts(preset: str) -> dict[str, int]:
    """The parts kernel's per-part constants for ``preset``'s key and value codecs at D=128."""
    from kvtool.kernels.triton_turbomix_tables import _rotations, _width
    from kvtool.presets import preset_policy

    policy, out = preset_policy(preset), {}
    for role, codec in (("K", policy.key), ("V", policy.value)):
        n_hi = codec._split(128)[0]
        widths = [(128 - n_hi, codec.bits), (n_hi, codec.outlier_bits)]
        for p, (n, bits) in enumerate(widths):
            pieces = _rotations(n, (codec.seed,), "cpu")[2] if n else 1
            out |= {f"{role}N{p}": n, f"{role}NP{p}": _width(n) if n else 16,
                    f"{role}NB{p}": (n * bits + 7) // 8 if n else 1,
                    f"{role}B{p}": bits if n else 2, f"{role}RP{p}": pieces}
    return out


def parts_main(args: argparse.Namespace) -> None:
    """The parts kernel's table for ``args.preset``."""
    from kvtool.kernels import triton_attention_parts as tap
    from kvtool.presets import preset_policy

    policy = preset_policy(args.preset)
    ints = {"kcs0", "kcs1", "vcs0", "vcs1", "NBLK", "X", "E", "hkv", "nq", "hq", "R", "bias_b",
            "sb", "sh", "sn"}
    kinds = {"c": "*u8", "ch": "*i32", "pick": "*i32", "r": "*bf16", "q": "*bf16", "ke": "*bf16",
             "ve": "*bf16", "count": "*i32"}
    signature = {"scale": "fp32"}
    for name in getattr(tap._parts_kernel, "fn", tap._parts_kernel).arg_names:
        if name in ints:
            signature[name] = "i32"
        elif name.endswith("_ptr"):
            stem = re.sub(r"^[kv](?=c|ch|pick|r\d)|\d?_ptr$", "", name)
            signature[name] = kinds.get(stem, "*fp32")
    constants = dict(MP=args.rows, D=128, BLOCK=64, KPICK=True, VPICK=True,
                     KCENTERED=policy.key.center, VCENTERED=policy.value.center, CAUSAL=False,
                     HAS_BIAS=False, BLOCK_X=16, PCH=64, KQ=2, VQ=2, **_preset_parts(args.preset))
    print(f"sm_{args.arch}, the {args.preset} preset's codes through triton_attention_parts, "
          f"D=128, {args.rows} query rows per KV head (padded): the block loop's "
          f"warp-instructions and load/store instructions per token")
    print(f"{'BN':>4} | {'warps':>5} | {'regs':>4} | {'spill':>5} | {'smem KB':>7} | "
          f"{'instr/token':>11} | {'ld/st/token':>11} | {'table loads':>11} | {'16-bit STS':>10}")
    kept = tap._prune(tap._parts_kernel.configs, {}, **constants)
    for config in tap._parts_kernel.configs:
        block_n, warps = config.kwargs["BLOCK_N"], config.num_warps
        if config not in kept and not args.all_configs:
            continue
        mark = "" if config in kept else " pruned"
        kernel = compile_kernel(tap._parts_kernel, signature, {**constants, **config.kwargs},
                                warps, config.num_stages, args.arch)
        row = _row(kernel, warps, block_n, looped=block_n < constants["BLOCK"])
        print(f"{block_n:>4} | {warps:>5} | {row}{mark}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.preset:
        parts_main(args)
        return
    from kvtool.kernels import triton_attention as ta
    from kvtool.kernels.bitpack import group_shape

    signature = {**_POINTERS, **{name: "i32" for name in _INTS}, "scale": "fp32"}
    codes = "quality's codes" if args.quality else "turbo keys and values"
    print(f"sm_{args.arch}, {codes}, {args.rows} query rows per KV head (padded): the token "
          f"loop's warp-instructions and load/store instructions per token")
    print(f"{'D':>4} | {'bits':>4} | {'BN':>4} | {'warps':>5} | {'stages':>6} | {'regs':>4} | "
          f"{'spill':>5} | {'smem KB':>7} | {'instr/token':>11} | {'ld/st/token':>11} | "
          f"{'table loads':>11} | {'16-bit STS':>10}")
    for dim in (int(d) for d in args.dims.split(",")):
        for bits in (int(b) for b in args.bits.split(",")):
            cpg, bpg = group_shape(bits)
            kept = ta._prune(ta._attend_kernel.configs, {}, D=dim, MP=args.rows)
            for config in ta._attend_kernel.configs:
                block_n, warps = config.kwargs["BLOCK_N"], config.num_warps
                if config not in kept and not args.all_configs:
                    continue
                vbits = 3 if args.quality else bits
                vcpg, vbpg = group_shape(vbits)
                groups = 4 if args.quality else 1
                constants = dict(
                    MP=args.rows, D=dim, KBITS=bits, KCPG=cpg, KBPG=bpg, VBITS=vbits,
                    VCPG=vcpg, VBPG=vbpg, KWORDS=True, VWORDS=True, CK=groups, CV=groups,
                    SORTED=args.quality, CENTERED=args.quality,
                    BLOCK=64 if args.quality else 1, CAUSAL=False, HAS_BIAS=False, BLOCK_X=16,
                    ROT_N=min(dim, 32), BK=min(32, dim, 4096 // dim),
                    PCH=min(64, 8192 // dim), **config.kwargs)
                row = (f"{dim:>4} | {bits:>4} | {block_n:>4} | {warps:>5} | "
                       f"{config.num_stages:>6} | ")
                mark = "" if config in kept else " pruned"
                try:
                    kernel = compile_kernel(ta._attend_kernel, signature, constants, warps,
                                            config.num_stages, args.arch)
                except Exception as e:  # noqa: BLE001 - Triton raises bare RuntimeErrors too
                    print(f"{row}does not build: {type(e).__name__}{mark}", flush=True)
                    continue
                print(f"{row}{_row(kernel, warps, block_n)}{mark}", flush=True)

if __name__ == "__main__":
    main()
