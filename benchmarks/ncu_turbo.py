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

Each kernel's autotune search is replaced by the one config given (rows per program, warps;
default: the H100's winners at D=128), so no tuning launches come before the profiled ones.
Without CUDA it runs the same calls under the Triton interpreter at the size given (a check of
the script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import time


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
    p.add_argument("--encode", type=_config, default=(64, 4), help="rows,warps (default 64,4)")
    p.add_argument("--decode", type=_config, default=(128, 4),
                   help="rows,warps (default 128,4)")
    return p.parse_args(argv)


def _pin(kernel: object, rows: int, warps: int) -> None:
    """The autotuner's search becomes one config (it launches a lone config untimed)."""
    if hasattr(kernel, "configs"):  # compiled; the interpreter's kernels are plain JIT
        import triton

        kernel.configs = [triton.Config({"BLOCK_M": rows}, num_warps=warps, num_stages=1)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from gpu_common import count  # benchmarks/ is the script's directory

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # read when the kernels are decorated, at their import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kvtool.kernels import triton_cuda as tc

    n = count(args.vectors)
    _pin(tc._encode_kernel, *args.encode)
    _pin(tc._decode_kernel, *args.decode)
    x = torch.randn((n, args.dim), device=device, dtype=torch.float16)
    for launch in ("compile", "profiled"):
        start = time.perf_counter()
        codes, norms = tc.turbo_encode(x, args.bits, 7)
        out = tc.turbo_decode(codes, norms, args.dim, args.bits, 7, torch.float16)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"{launch}: encode + decode of {n} x {args.dim} fp16 at {args.bits} bits "
              f"(encode {args.encode}, decode {args.decode} rows,warps) on {device}: "
              f"{time.perf_counter() - start:.3f} s", flush=True)
    error = (out.float() - x.float()).pow(2).sum() / x.float().pow(2).sum()
    print(f"relative MSE {error.item():.4f}")


if __name__ == "__main__":
    main()
