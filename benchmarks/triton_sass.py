"""What the Triton turbo kernels compile to on a GPU, without one: registers, spills, shared
memory and SASS instructions per row, per autotune config.

Each kernel variant is compiled ahead of time for a target (default sm_90, an H100) with the
argument specialisations Triton's launcher gives real tensors (16-byte-aligned pointers, row
counts divisible by 16), then disassembled with the ``nvdisasm`` that ships with Triton. The
row-block kernels are straight-line per block (the decode's loop over sub-tiles counted
``BLOCK_M / SUB`` times), so ``instructions × warps / BLOCK_M`` is the warp-instructions each
row costs (``STG/row``: the global stores among them; a byte stored at a
time costs a store each, 16 bytes in one vector store cost one). The last column turns that
into a ceiling: the rows per second at which the SMs could issue nothing else (``SMs × 4
schedulers × clock``), as a share of the device copy of the same fp16 rows. A kernel far under
that ceiling in ``benchmarks/gpu.py`` is latency-bound (too few warps or no prefetch), not
issue-bound; one near it needs fewer instructions. It is a model, not a measurement:
``benchmarks/gpu.py`` on a GPU is the truth.

    python benchmarks/triton_sass.py                  # turbo2/3/4 at D=128, every config
    python benchmarks/triton_sass.py --dims 64,128,256 --bits 3 --arch 80
    python benchmarks/triton_sass.py --preset quality # the preset's turbomix kernels
    python benchmarks/triton_sass.py --preset quality --kernels decode
    python benchmarks/triton_sass.py --preset balanced --kernels encode --loops
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, never interpret

#: H100 SXM figures for the ceiling: SMs, sustained clock (GHz), the device copy of fp16 rows
#: measured by ``benchmarks/gpu.py`` there (GB/s of fp16-equivalent bytes)
GPUS = {90: (132, 1.755, 1484.0), 80: (108, 1.41, 1300.0)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--arch", type=int, default=90, choices=sorted(GPUS), help="sm_XX target")
    p.add_argument("--dims", default="128", help="head dims (comma-separated)")
    p.add_argument("--bits", default="2,3,4", help="turbo bit widths")
    p.add_argument("--kernels", default="encode,decode", help="encode and/or decode")
    p.add_argument("--preset", choices=("quality", "balanced", "small"),
                   help="instead: the turbomix kernels of this preset's parts (at --dims)")
    p.add_argument("--loops", action="store_true",
                   help="with --preset: each kernel's innermost loop bodies (warp-"
                        "instructions and global loads/stores), the trellis search's steps")
    return p.parse_args(argv)


def compile_kernel(fn, signature: dict[str, str], constants: dict[str, int], warps: int,
                   stages: int, arch: int, fp_fusion: bool = True):
    """The compiled kernel, with Triton's launch-time specialisations of aligned arguments
    (``fp_fusion``: whether to fuse multiplies and adds, off where the launch turns it off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(fn, "fn", fn)  # under the autotuner
    full = {a: "constexpr" if a in constants else signature[a] for a in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if a not in constants and (signature[a].startswith("*") or a == "n_rows")}
    return triton.compile(ASTSource(fn, full, constants, aligned),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   "enable_fp_fusion": fp_fusion})


def sass_profile(kernel) -> tuple[int, int, Counter]:
    """(registers, spill bytes, opcode counts) of a compiled kernel's SASS."""
    usage, sass = disassemble(kernel)
    regs, stack = (int(v) for v in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return regs, stack, Counter(op.split(".")[0] for op, _ in _instructions(sass) if op)


def disassemble(kernel) -> tuple[str, str]:
    """(``cuobjdump`` resource usage, ``nvdisasm`` SASS) of a compiled kernel."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tools / "nvdisasm", f.name], capture_output=True, text=True,
                              check=True).stdout
    return usage, sass


_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*)")


def _instructions(sass: str) -> list[tuple[str, str]]:
    """(opcode with its modifiers, the label it branches to or "") per SASS instruction; a
    label line becomes ("", label) at its place."""
    out = []
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            out.append(("", m.group(1)))
        elif m := _INSTRUCTION.match(line):
            target = re.search(r"(\.L_x_\d+)", m.group(3)) if m.group(2).startswith("BRA") \
                else None
            out.append((m.group(2), target.group(1) if target else ""))
    return out


def loops(kernel, innermost: bool = False) -> list[list[str]]:
    """Each loop body's opcodes (with modifiers), in order: the span of each backward branch
    (``innermost``: those holding no other; the exit's branch to itself is none). Where a
    kernel loops (the trellis search, per coordinate; attention, per token tile), its cost is
    body × trips."""
    code = _instructions(disassemble(kernel)[1])
    at = {target: i for i, (op, target) in enumerate(code) if not op}
    spans = [(at[target], i) for i, (op, target) in enumerate(code)
             if op.startswith("BRA") and target in at and at[target] < i]
    if innermost:
        spans = [(a, b) for a, b in spans
                 if not any((a, b) != (c, d) and a <= c and d <= b for c, d in spans)]
    bodies = [[op for op, _ in code[a:b + 1] if op] for a, b in sorted(spans)]
    return [b for b in bodies if len(b) > 1]


def inner_loops(kernel) -> list[Counter]:
    """Opcode counts (without modifiers) of each innermost loop body (:func:`loops`)."""
    return [Counter(op.split(".")[0] for op in body) for body in loops(kernel, innermost=True)]


def configs(kernel, dim: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, SUB, warps, pipeline stages) of a row kernel's autotune search at head_dim
    ``dim`` on bulk calls, as its pruning keeps them (SUB = BLOCK_M: one tile)."""
    if not hasattr(kernel, "configs"):  # the interpreter's kernels are plain JIT
        return []
    kept = kernel.early_config_prune(kernel.configs, {"D": dim, "size_class": 1})
    return [(c.kwargs["BLOCK_M"], c.kwargs.get("SUB", c.kwargs["BLOCK_M"]), c.num_warps,
             c.num_stages) for c in kept]


def _passes(kernel: str, policy) -> list[tuple[str, object, str, bool]]:
    """(role, codec, quantiser, one chosen candidate per group) of each launch of ``kernel``
    per part: ``select=scalar`` encodes twice (a probe that scores every candidate with the
    scalar codebook and writes no codes, then its quantiser with each group's pick)."""
    out = []
    for role, codec in (("key", policy.key), ("value", policy.value)):
        if kernel == "encode" and codec._selects_by_scalar():
            out += [(f"{role} probe", codec, "scalar", False), (role, codec, codec.quantizer, True)]
        else:
            out.append((role, codec, codec.quantizer, False))
    return out


def preset_main(args: argparse.Namespace) -> None:
    """The ``turbomix`` encode and decode kernels (:mod:`kvtool.kernels.triton_turbomix`) of
    each part of a preset's key and value codecs at ``--dims`` (bf16 in, fp16 out), per autotune
    config its pruning keeps: warp-instructions per row (the static count of a program over its
    rows: the encode's loop over candidates counted once, so about one candidate's work with
    the part's gather and norm), and global loads and stores per program (likewise);
    ``--loops`` adds each innermost loop's body (the trellis's Viterbi step and traceback
    step run once per coordinate and candidate)."""
    import torch

    from kvtool.kernels import triton_turbomix as tt
    from kvtool.kernels.bitpack import group_shape
    from kvtool.kernels.triton_turbomix_tables import (
        _rotation_rows,
        _rotations,
        _seeds,
        _width,
    )
    from kvtool.presets import preset_policy

    signatures = {
        "encode": dict(x_ptr="*bf16", mean_ptr="*fp32", ch_ptr="*i32", ch_stride="i32",
                       rt_ptr="*bf16", bnd_ptr="*fp32", cent_ptr="*fp32", pts_ptr="*fp32",
                       hsq_ptr="*fp32", lvl_ptr="*fp32", edge_ptr="*fp32",
                       choice_ptr="*u8", codes_ptr="*u8", norms_ptr="*fp32", err_ptr="*fp32",
                       u_scr="*fp32",
                       dec_scr="*i32", q_scr="*i8", rows="i32", tokens="i32", groups="i32",
                       C="i32", tok_class="i32"),
        "decode": dict(codes_ptr="*u8", norms_ptr="*fp16", choice_ptr="*i32", ch_ptr="*i32",
                       ch_stride="i32", mean_ptr="*fp32", r_ptr="*bf16", cent_ptr="*fp32",
                       pts_ptr="*fp32", slv_ptr="*fp32", out_ptr="*fp16", tokens="i32",
                       tok_class="i32")}
    policy = preset_policy(args.preset)
    print(f"sm_{args.arch}: {args.preset}'s turbomix kernels, bf16 in, fp16 out, tokens per "
          "group 64")
    print(f"{'kernel':>6} | {'D':>3} | {'role':>11} | {'part':>9} | {'BM':>3} | {'warps':>5} | "
          f"{'regs':>4} | {'spill':>5} | {'smem KB':>7} | {'instr/row':>9} | {'LDG':>4} | "
          f"{'STG':>4}")
    for name, dim in ((k, int(d)) for k in args.kernels.split(",")
                      for d in args.dims.split(",")):
        fn = getattr(tt, f"_{name}_kernel")
        for role, codec, quantizer, chosen in _passes(name, policy):
            n_hi, n_lo = codec._split(dim)
            parts = [(n_lo, codec.bits)] + ([(n_hi, codec.outlier_bits)] if n_hi else [])
            signature = dict(signatures[name])
            if name == "decode" and codec.norm_bits == 8:
                signature["norms_ptr"] = "*fp32"  # the uint8 norms' values
            for n, bits in parts:
                width, quant = _width(n), tt.QUANTIZERS[quantizer]
                cpg, bpg = group_shape(bits)
                pieces = _rotations(n, _seeds(codec), torch.device("cpu"))[2]
                kept = tt._prune(fn.configs, {"tok_class": 64}, NP=width, QUANT=quant)
                for config in kept:
                    bm, warps = config.kwargs["BM"], config.num_warps
                    constants = dict(D=dim, N=n, NP=width, NB=(n * bits + 7) // 8, BITS=bits,
                                     QUANT=quant, RP=pieces, HAS_MEAN=int(codec.center),
                                     BM=bm, BK=min(width, 32))
                    constants["ALL_CH"] = int(n == dim)
                    if name == "encode":
                        constants.update(CPG=cpg, BPG=bpg, PER=1 << (bits - 1),
                                         HAS_CHOICE=int(chosen), CODES=int(role[-5:] != "probe"),
                                         KR=_rotation_rows(width, pieces))
                    else:
                        constants["HAS_CHOICE"] = int(codec.candidates > 1)
                    kernel = compile_kernel(fn, signature, constants, warps, 1, args.arch,
                                            fp_fusion=False)  # as turbomix launches
                    regs, spill, ops = sass_profile(kernel)
                    per = sum(ops.values()) * warps / bm
                    print(f"{name:>6} | {dim:>3} | {role:>11} | {f'{n}x{bits}b':>9} | {bm:>3} | "
                          f"{warps:>5} | {regs:>4} | {spill:>5} | "
                          f"{kernel.metadata.shared / 1024:>7.0f} | {per:>9.0f} | "
                          f"{ops['LDG']:>4} | {ops['STG']:>4}", flush=True)
                    if args.loops:
                        print("       loops: " + ", ".join(
                            f"{sum(b.values())} ({b['LDG']} LDG, {b['STG']} STG)"
                            for b in inner_loops(kernel)), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.preset:
        preset_main(args)
        return
    from kvtool.kernels import triton_cuda as tc
    from kvtool.kernels.bitpack import group_shape

    sms, ghz, copy_gbs = GPUS[args.arch]
    signatures = {
        "encode": (tc._encode_kernel, dict(x_ptr="*fp16", rt_ptr="*fp16", bnd_ptr="*fp32",
                                           codes_ptr="*u8", norms_ptr="*fp32", n_rows="i32",
                                           size_class="i32")),
        "decode": (tc._decode_kernel, dict(codes_ptr="*u8", norms_ptr="*fp32", cent_ptr="*fp32",
                                           r_ptr="*bf16", out_ptr="*fp16", n_rows="i32",
                                           size_class="i32")),
    }
    print(f"sm_{args.arch}: fp16 in (encode) / fp16 out (decode); ceiling = issue-bound rows/s "
          f"as % of a {copy_gbs:.0f} GB/s copy ({sms} SMs at {ghz} GHz)")
    print(f"{'kernel':>7} | {'D':>4} | {'bits':>4} | {'BM':>4} | {'SUB':>4} | {'warps':>5} | "
          f"{'stages':>6} | {'regs':>4} | {'spill':>5} | {'smem KB':>7} | {'instr/row':>9} | "
          f"{'STG/row':>7} | {'ceiling':>7}")
    for name in args.kernels.split(","):
        fn, signature = signatures[name]
        for dim in (int(d) for d in args.dims.split(",")):
            for bits in (int(b) for b in args.bits.split(",")):
                cpg, bpg = group_shape(bits)
                for block_m, sub, warps, stages in configs(fn, dim):
                    constants = dict(D=dim, BITS=bits, CPG=cpg, BPG=bpg, BLOCK_M=block_m)
                    if name == "encode":
                        constants.update(PIECES=1, BN=min(dim, 64))
                    else:
                        constants.update(PIECES=2, BK=min(dim, 64), SUB=sub)
                    kernel = compile_kernel(fn, signature, constants, warps, stages, args.arch)
                    regs, spill, ops = sass_profile(kernel)
                    # a loop over sub-tiles runs its body BLOCK_M / SUB times
                    body = sum(inner_loops(kernel), Counter()) if sub < block_m else Counter()
                    ops += Counter({op: n * (block_m // sub - 1) for op, n in body.items()})
                    per_row = sum(ops.values()) * warps / block_m
                    stores = ops["STG"] * warps / block_m  # warp-level global stores per row
                    ceiling = sms * 4 * ghz * 1e9 / per_row * dim * 2 / (copy_gbs * 1e9)
                    smem = kernel.metadata.shared / 1024
                    fits = "" if smem <= 227 else " (no fit)"
                    print(f"{name:>7} | {dim:>4} | {bits:>4} | {block_m:>4} | {sub:>4} | "
                          f"{warps:>5} | {stages:>6} | {regs:>4} | {spill:>5} | {smem:>7.0f} | "
                          f"{per_row:>9.1f} | {stores:>7.2f} | {ceiling:>6.0%}{fits}",
                          flush=True)


if __name__ == "__main__":
    main()
