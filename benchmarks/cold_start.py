"""The first ``kvtool.save`` / ``kvtool.load`` in a fresh process against warm ones.

A process's first call pays what later calls reuse: numba kernels loaded from their cache (or
compiled), Triton kernels compiled and autotuned (or read from its cache), tables built. The
target (issue 25): the first save and the first load each within 2× the warm time plus 1 s.

Each policy runs in a fresh Python process (``--child``) that imports kvtool, builds a
synthetic cache on ``--device`` (keys with per-channel offsets, as ``benchmarks/persistence.py``),
then times a save to a temporary file and a load of it back onto the device — the first of each,
then the median of ``--repeats`` more (CUDA work is synchronised before each clock stops).
The kernel caches are the ones this machine has (what a user meets after ``scripts/setup.sh``);
``--empty-caches`` points numba and Triton at empty directories instead (a first run ever).

    python benchmarks/cold_start.py                              # CPU, the default model's shape
    python benchmarks/cold_start.py --device cuda                # 16 layers x 4 x 8192 x 128 bf16
    python benchmarks/cold_start.py --policy turbo3 --empty-caches --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICIES = ("turbo3", "quality", "balanced", "small")
#: (layers, KV heads, tokens, head_dim, dtype) per device: the default model's layout on the CPU
#: (SmolLM2-135M, 4K tokens), the issue's CUDA cache (256 MiB of bf16) on a GPU
SHAPES = {"cpu": (30, 3, 4096, 64, "float16"), "cuda": (16, 4, 8192, 128, "bfloat16")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--policy", default=",".join(POLICIES),
                   help=f"comma list of codecs or presets (default {','.join(POLICIES)})")
    p.add_argument("--layers", type=int, help="default: per device (see SHAPES)")
    p.add_argument("--heads", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--repeats", type=int, default=3, help="warm calls (median; default 3)")
    p.add_argument("--empty-caches", action="store_true",
                   help="numba's and Triton's caches in empty directories: compile everything")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one policy, in this process
    args = p.parse_args(argv)
    if args.device not in SHAPES:
        p.error(f"--device must be one of {sorted(SHAPES)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    layers, heads, tokens, dim, dtype = SHAPES[args.device]
    args.layers, args.heads = args.layers or layers, args.heads or heads
    args.tokens, args.dim, args.dtype = args.tokens or tokens, args.dim or dim, dtype
    return args


def child(args: argparse.Namespace) -> dict:
    """Times one policy's first and warm save/load in this (fresh) process."""
    start = time.perf_counter()
    import torch
    from persistence import synthetic_cache  # benchmarks/ is the script's directory

    import kvtool
    from kvtool.policy import CodecPolicy

    imported = time.perf_counter() - start
    cuda = args.device == "cuda"

    def timed(fn):
        if cuda:  # the cache's build (or the last call) may still be running on the device
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    cache = synthetic_cache(args.tokens, args.layers, args.heads, args.dim) \
        .to_torch(args.device).astype(args.dtype)
    policy = CodecPolicy.from_label(args.child)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cache.kvz")
        save = lambda: kvtool.save(cache, path, policy)  # noqa: E731
        load = lambda: kvtool.load(path, backend="torch", device=args.device)  # noqa: E731
        report, first_save = timed(save)
        loaded, first_load = timed(load)
        if loaded.keys[0].device.type != torch.device(args.device).type:
            raise SystemExit(f"load returned tensors on {loaded.keys[0].device}")
        saves = [timed(save)[1] for _ in range(args.repeats)]
        loads = [timed(load)[1] for _ in range(args.repeats)]
    return {"policy": args.child, "device": args.device, "import_s": imported,
            "first_save_s": first_save, "warm_save_s": statistics.median(saves),
            "first_load_s": first_load, "warm_load_s": statistics.median(loads),
            "fp16_bytes": report["fp16_bytes"], "file_bytes": report["file_bytes"]}


def run_child(args: argparse.Namespace, policy: str, caches: str | None) -> dict:
    """:func:`child` in a fresh interpreter (``caches``: an empty directory for its kernels)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH")) if p))
    env.pop("TRITON_INTERPRET", None)
    if caches:
        env.update(NUMBA_CACHE_DIR=os.path.join(caches, "numba"),
                   TRITON_CACHE_DIR=os.path.join(caches, "triton"))
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", policy,
            "--device", args.device, "--layers", str(args.layers), "--heads", str(args.heads),
            "--tokens", str(args.tokens), "--dim", str(args.dim),
            "--repeats", str(args.repeats)]
    run = subprocess.run(argv, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{policy}: the child process failed:\n{run.stderr[-3000:]}")
    row = json.loads(run.stdout.strip().splitlines()[-1])
    row["caches"] = "empty" if caches else "kept"
    for op in ("save", "load"):
        row[f"{op}_limit_s"] = 2 * row[f"warm_{op}_s"] + 1
        row[f"{op}_within"] = row[f"first_{op}_s"] <= row[f"{op}_limit_s"]
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    policies = [p for p in args.policy.split(",") if p]
    from kvtool.errors import KvtoolError
    from kvtool.policy import CodecPolicy

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/cold_start.py: --device cuda, but CUDA is not "
                             "available (torch.cuda.is_available() is False)")
    for policy in policies:  # refused here, in one line, not by a child's traceback
        try:
            CodecPolicy.from_label(policy)
        except KvtoolError as e:
            raise SystemExit(f"--policy {policy}: {e}") from None
    mib = args.layers * args.heads * args.tokens * args.dim * 2 * 2 / 2**20
    print(f"first vs warm save/load in a fresh process: {args.device}, {args.layers} layers x "
          f"{args.heads} KV heads x {args.tokens} tokens x {args.dim} ({args.dtype}, "
          f"{mib:.0f} MiB of K/V); warm: median of {args.repeats}; limit: 2 x warm + 1 s")
    print(f"| policy | caches | import s | save: first | warm | limit | load: first | warm | "
          f"limit | within |\n|{'---|' * 10}", flush=True)
    rows = []
    for policy in policies:
        for caches in ([None, "empty"] if args.empty_caches else [None]):
            with tempfile.TemporaryDirectory() as tmp:
                row = run_child(args, policy, tmp if caches else None)
            rows.append(row)
            within = "yes" if row["save_within"] and row["load_within"] else "NO"
            print(f"| {policy} | {row['caches']} | {row['import_s']:.2f} | "
                  f"{row['first_save_s']:.2f} | {row['warm_save_s']:.2f} | "
                  f"{row['save_limit_s']:.2f} | {row['first_load_s']:.2f} | "
                  f"{row['warm_load_s']:.2f} | {row['load_limit_s']:.2f} | {within} |",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                        if k != "child"}, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
