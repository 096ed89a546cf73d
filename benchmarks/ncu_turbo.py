"""The turbo encode and decode kernels, one config each, launched twice (a compile, then the
launch to profile): what Nsight Compute reads to say what limits them. On the H100 (ninth
session, ``docs/gpu.md``) turbo3 decode at D=128 ran at 65% of the device copy while its
static instruction count allows over 160%, and a config with 40% fewer registers was slower:
neither issue rate nor occupancy explains it, and counters can.

    ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        -k 'regex:_(en|de)code_kernel' --launch-skip 2 --launch-count 2 \
        python3 benchmarks/ncu_turbo.py          # what scripts/gpu_session.sh runs
    python3 benchmarks/ncu_turbo.py --vectors 1M --bits 4 --decode 64,4
    python3 benchmarks/ncu_turbo.py --preset quality   # its value codec's turbomix kernels

With ``--preset`` the kernels are the preset's ``turbomix`` encode and decode (``--role``'s
codec, vectors laid out as ``CompressedCache`` encodes them: blocks of 64 tokens), pinned to the
H100's winners (encode 32 rows × 4 warps, decode 16 × 4): on the H100 ``quality``'s decode ran
at 12% of the copy, and its 64-row config, with a quarter of the programs and no spills, took
1.7× as long as the 16-row one.

Each kernel's autotune search is replaced by its config of the rows per program and warps
given (default: the H100's winners at D=128; turbo's decode: the sub-tiled search that
replaced its winner, 256 rows), so no tuning launches come before the profiled ones.
Without CUDA it runs the same calls under the Triton interpreter at the size given (a check of
the script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def _config(text: str) -> tuple[int, int]:
    rows, warps = (int(v) for v in text.split(","))
    return rows, warps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--vectors", default="4M", help="rows (K/M suffixes; default 4M)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--encode", type=_config,
                   help="rows,warps (default 64,4; --preset: 32,4)")
    p.add_argument("--decode", type=_config,
                   help="rows,warps (default 256,4: 64-row sub-tiles; --preset: 16,4)")
    p.add_argument("--preset", choices=("quality", "balanced", "small"),
                   help="profile this preset's turbomix kernels instead of turbo's")
    p.add_argument("--role", choices=("key", "value"), default="value",
                   help="the preset's codec (default value)")
    args = p.parse_args(argv)
    args.encode = args.encode or ((32, 4) if args.preset else (64, 4))
    args.decode = args.decode or ((16, 4) if args.preset else (256, 4))
    return args


def _pin(kernel: object, rows: int, warps: int, name: str = "BLOCK_M") -> None:
    """The autotuner's search becomes its one config of ``rows`` per program and ``warps`` (it
    launches a lone config untimed); ``name``: its rows-per-program parameter (turbomix's:
    ``BM``)."""
    if hasattr(kernel, "configs"):  # compiled; the interpreter's kernels are plain JIT
        found = [c for c in kernel.configs if c.kwargs[name] == rows and c.num_warps == warps]
        if not found:
            raise SystemExit(f"{kernel.fn.__name__} searches no config of {rows} rows and "
                             f"{warps} warps: " + ", ".join(
                                 f"{c.kwargs[name]},{c.num_warps}" for c in kernel.configs))
        kernel.configs = found[:1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from gpu_common import count  # benchmarks/ is the script's directory

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # read when the kernels are decorated, at their import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    n = count(args.vectors)
    x, roundtrip, what = (_preset if args.preset else _turbo)(args, n, device)
    for launch in ("compile", "profiled"):
        start = time.perf_counter()
        out = roundtrip(x)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"{launch}: {what} of {x.numel() // args.dim} x {args.dim} fp16 (encode "
              f"{args.encode}, decode {args.decode} rows,warps) on {device}: "
              f"{time.perf_counter() - start:.3f} s", flush=True)
    error = (out.float() - x.float()).pow(2).sum() / x.float().pow(2).sum()
    print(f"relative MSE {error.item():.4f}")


def _turbo(args: argparse.Namespace, n: int, device: str) -> tuple[Any, Any, str]:
    """(input, its encode + decode, label): turbo's kernels, each pinned."""
    import torch

    from kvtool.kernels import triton_cuda as tc

    _pin(tc._encode_kernel, *args.encode)
    _pin(tc._decode_kernel, *args.decode)

    def roundtrip(x: Any) -> Any:
        codes, norms = tc.turbo_encode(x, args.bits, 7)
        return tc.turbo_decode(codes, norms, args.dim, args.bits, 7, torch.float16)

    x = torch.randn((n, args.dim), device=device, dtype=torch.float16)
    return x, roundtrip, f"encode + decode at {args.bits} bits"


def _preset(args: argparse.Namespace, n: int, device: str) -> tuple[Any, Any, str]:
    """(input, its encode + decode, label): the preset's turbomix encode and decode
    (:mod:`kvtool.kernels.triton_turbomix`, what its codec runs on CUDA), each pinned; the
    input in blocks of 64 tokens, as ``CompressedCache`` encodes them."""
    import torch

    from kvtool.kernels import triton_turbomix as tt
    from kvtool.presets import preset_policy

    _pin(tt._encode_kernel, *args.encode, name="BM")
    _pin(tt._decode_kernel, *args.decode, name="BM")
    codec = getattr(preset_policy(args.preset), args.role)

    def roundtrip(x: Any) -> Any:
        return tt.decode(codec, tt.encode(codec, x), tuple(x.shape), "float16")

    x = torch.randn((max(1, n // 64), 64, args.dim), device=device, dtype=torch.float16)
    return x, roundtrip, f"{args.preset} {args.role} encode + decode"


if __name__ == "__main__":
    main()
