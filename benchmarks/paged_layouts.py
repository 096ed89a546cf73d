"""The vLLM store's copies in and out of a CPU paged cache, per layout: one layer's gather (a
save) and scatter (a load) of a chunk, from a block boundary and from mid-block.

Layouts: ``cpu`` (the ``vec``/``vec16`` ISAs: strided views), ``cpu_amx`` (AMX tiles: whole
blocks permuted as 4-byte words), and ``cpu_probed`` (a packing read off a cache writer: whole
blocks through a row gather), here read off the AMX packing so the two compare on one packing;
with vLLM installed, also the packing of the ISA vLLM picks on this machine, read off its own
writer. Times are medians of ``--reps``; ``× cpu`` is each against the ``cpu`` layout in the
same run (this machine is shared: ratios, not absolute times).

    python benchmarks/paged_layouts.py                   # 1,024 tokens × 3 heads × 64, bf16
    python benchmarks/paged_layouts.py --tokens 4096 --heads 8 --head-dim 128 --json rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvtool.engines.vllm.layout import PagedLayout
from kvtool.engines.vllm.layout_probe import Writer, probe_offsets


def layout_writer(layout: PagedLayout) -> Writer:
    """``layout``'s own scatter as a :data:`Writer` of one block's consecutive slots (what
    :func:`probe_offsets` writes)."""

    def write(key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        n = kv.shape[2]
        layout.scatter(kv, [int(slot_mapping[0]) // n], int(slot_mapping[0]) % n,
                       key.transpose(0, 1), value.transpose(0, 1))

    return write


def layouts(dtype: torch.dtype, block_size: int, head_dim: int) -> dict[str, PagedLayout]:
    amx = PagedLayout("cpu_amx", head_dim)
    out = {"cpu": PagedLayout("cpu", head_dim), "cpu_amx": amx,
           "cpu_probed (amx)": PagedLayout("cpu_probed", head_dim, probe_offsets(
               layout_writer(amx), dtype, block_size, head_dim))}
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from kvtool.engines.vllm.layout_probe import vllm_cpu_writer
        isa = _get_attn_isa(dtype, block_size, head_dim)
        out[f"cpu_probed (vLLM {isa})"] = PagedLayout("cpu_probed", head_dim, probe_offsets(
            vllm_cpu_writer(isa), dtype, block_size, head_dim))
    except Exception as e:  # no vLLM, or a build without CPU kernels
        print(f"(no vLLM writer: {type(e).__name__}: {e})")
    return out


def median_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype, n, d = getattr(torch, args.dtype), args.block_size, args.head_dim
    blocks = list(range(args.tokens // n + 2))[::-1]  # out of order, one spare for mid-block
    kv = torch.randn(len(blocks) + 2, args.heads, n, 2 * d).to(dtype)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(args.heads, args.tokens, d, generator=gen).to(dtype) for _ in range(2))
    mid = n // 3 + 1
    rows = []
    reference = None
    for name, layout in layouts(dtype, n, d).items():
        layout.scatter(kv, blocks, mid, k, v)  # each layout reads back what it wrote
        got = layout.gather(kv, blocks, mid, mid + args.tokens)
        assert torch.equal(got[0], k) and torch.equal(got[1], v), name
        row = {"layout": name}
        for start, tag in ((0, "aligned"), (mid, "mid")):
            row[f"gather_{tag}_us"] = median_us(
                lambda s=start, lo=layout: lo.gather(kv, blocks, s, s + args.tokens), args.reps)
            row[f"scatter_{tag}_us"] = median_us(
                lambda s=start, lo=layout: lo.scatter(kv, blocks, s, k, v), args.reps)
        reference = reference or row
        row["vs_cpu"] = {key: row[key] / reference[key] for key in row if key.endswith("_us")}
        rows.append(row)
    print(f"one layer: {args.tokens} tokens × {args.heads} heads × {d}, {args.dtype}, blocks "
          f"of {n}, {args.threads} threads; median of {args.reps} (µs; × cpu)")
    cols = ("gather_aligned_us", "gather_mid_us", "scatter_aligned_us", "scatter_mid_us")
    print(f"{'layout':>26} | " + " | ".join(f"{c[:-3]:>22}" for c in cols))
    for row in rows:
        cells = [f"{row[c]:9.0f} ({row['vs_cpu'][c]:4.1f}×)" for c in cols]
        print(f"{row['layout']:>26} | " + " | ".join(f"{c:>22}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
