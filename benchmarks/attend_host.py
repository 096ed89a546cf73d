"""Host time of one call of attention from codes (:func:`kvtool.kernels.triton_attention.attend`;
for ``balanced``/``small`` :func:`kvtool.kernels.triton_attention_parts.attend`), the part of a
decode step's attention that no GPU speeds up: at batch 1 an H200 ran the kernel in ~38 µs
while the call took ~100 µs to issue.

It measures the Python work of a call up to the kernel launch, on CPU tensors (no GPU needed):
the kernel is replaced by building its launch key (what a repeat launch computes before calling
the compiled kernel), so the numbers leave out the launch itself (~10 µs on an H200) and CUDA's
allocator. Rows: a repeat call of one signature over a kept store (what every layer after the
first makes in a decode step: ``attend_store`` over the layer's prepared store) against a first
call of a signature (the store prepared and checks and launch plan worked out again, as before
plans were kept: the baseline, in the same process). The ``turbo_decode_attention`` rows time
the call ``gpu.py``'s attention table makes (a repeat call skips the checks of a layout it has
seen and prepares no store; 27 µs a call here before it did, 20 after).

    python benchmarks/attend_host.py              # the decode shapes of gpu.py's attention table
    python benchmarks/attend_host.py --calls 5000
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

os.environ.pop("TRITON_INTERPRET", None)

from host_stubs import stub_kernels  # noqa: E402  (benchmarks/ is the script's directory)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--calls", type=int, default=3000, help="calls per row (default 3000)")
    p.add_argument("--repeats", type=int, default=5, help="best of this many runs (default 5)")
    return p.parse_args(argv)


def _first(plans: dict, call: Callable[[], object], *kept: dict) -> None:
    """A call whose signature has no plan yet (nor anything else ``kept``)."""
    plans.clear()
    for cache in kept:
        cache.clear()
    call()


def _roles(preset: str, heads: int, n: int, dim: int) -> list:
    """The preset's key and value :class:`RoleTensors` of ``n`` tokens on ``heads`` rows
    (encoded on the CPU: only their shapes matter here)."""
    import torch

    from kvtool.kernels.triton_attention_parts import role_tensors
    from kvtool.policy import CodecPolicy

    policy = CodecPolicy.from_label(preset)
    x = torch.randn(heads, n // 64, 64, dim)
    out = []
    for role in ("key", "value"):
        codec = policy.codec_for(role, 1, 4)
        arrays = {k: torch.as_tensor(v) for k, v in codec.encode(x).arrays.items()}
        out.append(role_tensors(codec, arrays, heads, n, 64, dim))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from kvtool.kernels import triton_attention as ta
    from kvtool.kernels import triton_attention_parts as tap

    stub_kernels()  # launches stop at their keys; an H100's split heuristic
    torch.set_num_threads(1)
    print(f"host µs per call, best of {args.repeats} runs of {args.calls} calls (kernel launch "
          f"replaced by its launch key)")
    print(f"{'shape':>36} | {'first call':>10} | {'repeat call':>11} | {'ratio':>6}")
    for batch, n, x, preset in ((1, 8192, 0, "turbo_decode_attention"),
                                (8, 32768, 0, "turbo_decode_attention"),
                                (1, 8192, 100, "turbo3"), (8, 32768, 100, "turbo3"),
                                (1, 8192, 100, "quality"), (1, 8192, 100, "balanced"),
                                (1, 8192, 100, "small")):
        hq, hkv, dim = 32, 8, 128
        q = torch.randn(batch, hq, 1, dim, dtype=torch.bfloat16)
        bits = (4, 3) if preset == "quality" else (3, 3)
        codes = [torch.zeros(batch * hkv, n, dim * b // 8, dtype=torch.uint8) for b in bits]
        norms = torch.ones(batch * hkv, n, dtype=torch.float16)
        ke = torch.randn(batch, hkv, x, dim, dtype=torch.bfloat16)
        extra = {}
        if preset == "quality":
            blocks = n // 64
            extra = dict(k_rotations=torch.zeros(batch * hkv, blocks, dtype=torch.uint8),
                         v_rotations=torch.zeros(batch * hkv, blocks, dtype=torch.uint8),
                         key_means=torch.zeros(batch * hkv, blocks, dim,
                                               dtype=torch.float16), block=64)
        kw = dict(dim=dim, k_bits=bits[0], v_bits=bits[1], scale=dim ** -0.5,
                  k_seeds=(1, 2, 3, 4) if preset == "quality" else (1,),
                  v_seeds=(5, 6, 7, 8) if preset == "quality" else (5,), **extra)

        if preset == "turbo_decode_attention":  # gpu.py's attention table calls it
            q3, dense = q[:, :, 0], [c.reshape(batch, hkv, n, -1) for c in codes]
            call = partial(ta.turbo_decode_attention, q3, dense[0], norms.reshape(batch, hkv, n),
                           dense[1], norms.reshape(batch, hkv, n), dim=dim, k_bits=3, k_seed=1,
                           v_bits=3, v_seed=5, scale=dim ** -0.5)
            first = partial(_first, ta._PLANS, call, ta._TURBO_LAYOUTS)
        elif preset in ("balanced", "small"):
            roles = _roles(preset, batch * hkv, n, dim)
            call = partial(tap.attend, q, *roles, ke, ke, scale=dim ** -0.5,
                           out_dtype=torch.bfloat16)
            first = partial(_first, tap._PLANS, call)
        else:  # a CompressedCache prepares its store once per change, then attends
            scale = kw.pop("scale")
            store = ta.prepare(codes[0], norms, codes[1], norms, **kw)
            call = partial(ta.attend_store, q, store, ke, ke, scale=scale,
                           out_dtype=torch.bfloat16)
            first = partial(_first, ta._PLANS, partial(ta.attend, q, codes[0], norms, codes[1],
                                                       norms, ke, ke, scale=scale,
                                                       out_dtype=torch.bfloat16, **kw))

        times = {}
        for label, fn in (("first", first), ("repeat", call)):
            best = float("inf")
            for _ in range(args.repeats):
                fn()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                best = min(best, (time.perf_counter() - start) / args.calls * 1e6)
            times[label] = best
        shape = f"B={batch} N={n // 1024}K {preset}"
        print(f"{shape:>36} | {times['first']:>10.1f} | {times['repeat']:>11.1f} | "
              f"{times['first'] / times['repeat']:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
