"""GPU benchmark of kvtool's Triton kernels and of ``CompressedCache`` on a CUDA device.

    python benchmarks/gpu.py --all --json gpu.json   # every table at fixed sizes, <= 8 min (H100)
    python benchmarks/gpu.py --device cpu --smoke     # tiny sizes, CPU tensors, Triton
                                                      # interpreter: checks code paths (< 1 min)
    python benchmarks/gpu.py --sections throughput --vectors 4M --dims 128
    python benchmarks/gpu.py --skip-cache --tokens 1K,8K --batches 1

Tables, each printed row by row as it is measured, then the section's wall time (helpers:
``gpu_sections.py``, ``gpu_cache.py``, ``gpu_common.py``):

1. ``throughput``: turbo2/3/4 encode (fp16 in) and decode (fp16 out) of ``[vectors, D]``
   (:mod:`kvtool.kernels.triton_cuda`), GB/s and % of ``dst.copy_(src)`` on the same fp16
   array in the same run. Every column counts fp16-equivalent bytes, ``vectors * D * 2`` (the
   copy reads and writes that much, so it shows half its raw traffic). ``dtypes``: the same
   for turbo<``--dtype-bits``> at D=128, encoding from and decoding to fp16/bf16/fp32 (still
   counted as fp16-equivalent bytes, so cells compare as vectors per second).
2. ``attention``: decode attention straight from codes (one query per sequence, GQA;
   ``kvtool.kernels.triton_attention.turbo_decode_attention``, or ``triton_cuda``'s before that
   module exists) against SDPA on fp16 K/V (what ``DynamicCache`` pays) and against decoding K
   and V to fp16 then SDPA; speedup = other time / codes time; max|diff| against SDPA on the
   decoded K/V. Then the same for each preset's codes (``--attention-presets``), encoded as
   ``CompressedCache`` stores them and read by the kernel it uses (``quality``:
   ``triton_attention``; ``balanced``/``small``: ``triton_attention_parts``).
3. ``presets``: each preset's (``quality``, ``balanced``, ``small``) key and value codec through
   ``codec.encode``/``codec.decode`` on fp16 device tensors laid out like CompressedCache's
   encode calls (``[blocks, 64, D]``; Triton turbomix kernels on CUDA), GB/s and % of the copy.
4. ``cache``: ``DynamicCache`` against ``CompressedCache`` (turbo3 and the presets) on a
   random-init Llama (16 layers, hidden 2048, 16/4 heads, head_dim 128, bf16): prefill seconds,
   decode tok/s (manual greedy loop), peak memory, K/V bytes, ratios to DynamicCache.

Times are medians of CUDA-event-timed repeats after warm-up (``time.perf_counter`` on the CPU),
each starting with a flushed L2 on CUDA (``--warm-l2``: back to back, as the H200 sessions
timed them; see :class:`gpu_common.Clock`).
Triton compiles and autotunes every kernel variant on first use; ``--warm-workers N`` (default
on CUDA) first runs each section at small sizes in N parallel processes, which fills Triton's
on-disk cache in parallel so the measured run only loads kernels (and autotunes at full size:
the warm processes keep no autotune choice, ``KVTOOL_AUTOTUNE_CACHE=0``, since their timings
come from GPU-sharing processes at the small sizes).
``--all`` fixes the sizes (below) and a 460 s budget: sections share it cumulatively, a row
that would not fit in its section's share (judged by the previous row) is skipped and named.

``--all``: 16M and 64M vectors (64M where memory allows), D 64/128/256, turbo2/3/4; dtypes at
D=128, 16M; attention Hq 32, Hkv 8, D 128, B 1/8, 8K/32K tokens; presets at 1M vectors;
cache at 8K/32K tokens, 32 decode steps, 3 rounds paired with DynamicCache, DynamicCache +
turbo3 (recent 128) + the presets.
``--smoke``: 128 vectors, 256 tokens (Hq 4, Hkv 2, D 64), 4K preset vectors, a 2-layer
hidden-64 Llama (head_dim 16) at 256 tokens with turbo3 (recent 64) and ``quality``, 4 steps,
1 round.

``--json FILE`` (rewritten after every section): ``meta`` (device, versions, timer, total_s),
``warm`` (tasks, failed, killed, wall_s) and per section ``rows`` (flat dicts of labels and
numbers; ``peak_*`` are null off CUDA), ``skipped``, ``errors`` and ``wall_s``. A row that
raises is printed as FAILED and the run goes on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_common import Bench, Budget, Clock, count, counts, words  # benchmarks/ is the cwd

SECTIONS = ("throughput", "dtypes", "attention", "presets", "cache")
#: seconds of the ``--all`` budget per stage (scaled to ``--budget``), used cumulatively
#   (warm-ups took 31-68 s on an H200; the sections now autotune alone, at full size, and the
#   cache rows run 3 paired rounds)
SHARES = {"warm": 75, "throughput": 90, "dtypes": 25, "attention": 50, "presets": 65,
          "cache": 155}
ALL = {"vectors": counts("16M,64M"), "dims": [64, 128, 256], "bits": [2, 3, 4],
       "dtypes": ["fp16", "bf16", "fp32"], "dtype_bits": 3, "tokens": counts("8K,32K"),
       "batches": [1, 8], "heads": 32, "kv_heads": 8, "head_dim": 128, "k_bits": 3,
       "v_bits": 3, "repeats": 10, "preset_vectors": count("1M"),
       "presets": ["quality", "balanced", "small"], "roles": ["key", "value"],
       "contexts": counts("8K,32K"), "steps": 32, "rounds": 3,
       "policy": ["turbo3", "quality", "balanced", "small"], "recent": 128, "layers": 16,
       "hidden": 2048, "model_heads": 16, "model_kv_heads": 4, "model_head_dim": 128,
       "intermediate": 8192, "vocab": 32000, "budget": 460.0}
SMOKE = {**ALL, "vectors": [128], "tokens": [256], "batches": [1, 2], "heads": 4,
         "kv_heads": 2, "head_dim": 64, "repeats": 1, "preset_vectors": count("4K"),
         "contexts": [256], "steps": 4, "rounds": 1, "policy": ["turbo3", "quality"], "recent": 64,
         "layers": 2, "hidden": 64, "model_heads": 4, "model_kv_heads": 2, "model_head_dim": 16,
         "intermediate": 128, "vocab": 1000, "budget": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    a = p.add_argument
    a("--all", action="store_true", help="every section at the fixed sizes above, 460 s budget "
      "(options given as well override them)")
    a("--smoke", action="store_true", help="tiny sizes (with --device cpu: under the Triton "
      "interpreter; timings meaningless)")
    a("--device", choices=["cuda", "cpu"], default="cuda",
      help="cpu: CPU tensors under TRITON_INTERPRET=1 (set here), for checking code paths")
    a("--json", type=Path, default=None, help="write every result to this file")
    a("--sections", type=words, default=list(SECTIONS), help=f"comma list of {SECTIONS}")
    a("--skip-throughput", action="store_true", help="no throughput or dtypes table")
    a("--skip-presets", action="store_true", help="no preset table")
    a("--skip-attention", action="store_true", help="no attention table")
    a("--skip-cache", action="store_true", help="no DynamicCache/CompressedCache table")
    a("--budget", type=float, default=None, help="total seconds (default: none; --all: 460)")
    a("--warm-workers", type=int, default=None,
      help="parallel processes filling Triton's cache first (default: on CUDA, up to 12; 0: off)")
    a("--repeats", type=int, default=20, help="timed repeats per measurement")
    a("--warm-l2", action="store_true", help="time calls back to back with whatever the L2 "
      "holds (default on CUDA: each timed call starts with a flushed L2)")
    # throughput / dtypes
    a("--vectors", type=counts, default=counts("1M,4M,16M,64M"), help="vector counts")
    a("--max-vectors", type=count, default=None, help="drop vector counts above this")
    a("--dims", type=counts, default=[64, 128, 256], help="head dims")
    a("--bits", type=counts, default=[2, 3, 4], help="turbo bit widths")
    a("--dtypes", type=words, default=["fp16", "bf16", "fp32"], help="dtypes table rows")
    a("--dtype-bits", type=int, default=3, help="turbo bit width of the dtypes table")
    # attention
    a("--tokens", type=counts, default=counts("1K,2K,4K,8K,16K,32K"), help="context lengths")
    a("--batches", type=counts, default=[1, 4, 8], help="batch sizes")
    a("--heads", type=int, default=32, help="query heads")
    a("--kv-heads", type=int, default=8, help="kv heads")
    a("--head-dim", type=int, default=128, help="head dim (attention and presets)")
    a("--k-bits", type=int, default=3, help="key codec turbo<k>")
    a("--v-bits", type=int, default=3, help="value codec turbo<v>")
    a("--split-k", type=int, default=None, help="splits (default: the kernel's heuristic)")
    a("--attention-presets", type=words, default=["quality", "balanced", "small"],
      help="presets whose codes the attention table also reads")
    # presets
    a("--preset-vectors", type=count, default=count("1M"), help="vectors per codec call")
    a("--presets", type=words, default=["quality", "balanced", "small"], help="preset names")
    a("--roles", type=words, default=["key", "value"], help="key, value or both")
    # cache
    a("--contexts", type=counts, default=counts("8K,32K"), help="cache table context lengths")
    a("--steps", type=int, default=32, help="greedy decode steps")
    a("--rounds", type=int, default=3, help="timed runs per cache, each paired with a "
      "DynamicCache run (ratios: the pairs' median)")
    a("--policy", action="append", default=None,
      help="CompressedCache policy label or preset (repeatable; default turbo3 + the presets)")
    a("--recent", type=int, default=128, help="recent window of non-preset policies")
    a("--layers", type=int, default=16)
    a("--hidden", type=int, default=2048)
    a("--model-heads", type=int, default=16)
    a("--model-kv-heads", type=int, default=4)
    a("--model-head-dim", type=int, default=128)
    a("--intermediate", type=int, default=8192)
    a("--vocab", type=int, default=32000)
    args = p.parse_args(argv)
    sizes = SMOKE if args.smoke else ALL
    if args.smoke or args.all:  # the fixed sizes, then the options given on the command line
        preset = {k: v for k, v in sizes.items() if k != "policy"}
        args = p.parse_args(argv, namespace=argparse.Namespace(**preset))
    if args.policy is None:
        args.policy = sizes["policy"]
    if args.max_vectors is not None:
        args.vectors = [n for n in args.vectors if n <= args.max_vectors]
    skips = {"throughput": args.skip_throughput, "dtypes": args.skip_throughput,
             "attention": args.skip_attention, "presets": args.skip_presets,
             "cache": args.skip_cache}
    for name, given, known in (("sections", args.sections, SECTIONS),
                               ("dtypes", args.dtypes, ("fp16", "bf16", "fp32")),
                               ("roles", args.roles, ("key", "value")),
                               ("attention presets", args.attention_presets,
                                ("quality", "balanced", "small"))):
        if set(given) - set(known):
            p.error(f"unknown {name} {sorted(set(given) - set(known))}; choose from "
                    f"{', '.join(known)}")
    args.sections = [s for s in SECTIONS if s in args.sections and not skips[s]]
    if args.warm_workers is None:
        args.warm_workers = min(12, max(1, (os.cpu_count() or 2) - 2)) \
            if args.device == "cuda" else 0
    return args


def warm_tasks(args: argparse.Namespace) -> list[list[str]]:
    """gpu.py argument lists that run each selected section at small sizes, one kernel family
    each (longest first): the same kernel variants as the measured run, compiled in parallel."""
    common = ["--device", args.device, "--warm-workers", "0", "--repeats", "1"]
    small = ",".join(str(n) for n in sorted({min(n, 1 << 16) for n in args.vectors}))
    tasks: list[list[str]] = []
    if "cache" in args.sections:
        model = ["--layers", "1", "--steps", str(args.steps), "--rounds", "1",
                 "--recent", str(args.recent),
                 "--contexts", ",".join(map(str, args.contexts))]
        for flag in ("hidden", "model_heads", "model_kv_heads", "model_head_dim",
                     "intermediate", "vocab"):
            model += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        tasks += [["--sections", "cache", "--policy", p, *model] for p in args.policy]
    if "presets" in args.sections:
        tasks += [["--sections", "presets", "--presets", p, "--roles", r, "--preset-vectors",
                   str(min(args.preset_vectors, 1 << 16)), "--head-dim", str(args.head_dim)]
                  for p in args.presets for r in args.roles]
    if "dtypes" in args.sections:
        tasks += [["--sections", "dtypes", "--dtypes", d, "--vectors", small, "--dims",
                   ",".join(map(str, args.dims)), "--dtype-bits", str(args.dtype_bits)]
                  for d in args.dtypes]
    if "throughput" in args.sections:
        tasks += [["--sections", "throughput", "--dims", str(d), "--bits", str(bits),
                   "--vectors", small] for d in sorted(args.dims, reverse=True)
                  for bits in args.bits]
    if "attention" in args.sections:
        tasks.append(["--sections", "attention", "--tokens", ",".join(map(str, args.tokens)),
                      "--batches", ",".join(map(str, args.batches)), "--heads",
                      str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim",
                      str(args.head_dim), "--k-bits", str(args.k_bits), "--v-bits",
                      str(args.v_bits), "--attention-presets", ",".join(args.attention_presets)]
                     + ([] if args.split_k is None else ["--split-k", str(args.split_k)]))
    return [common + t for t in tasks]


def label(task: list[str]) -> str:
    """A warm task's arguments after the common ones (which start with ``--device``)."""
    return " ".join(task[task.index("--sections"):])


def warm(args: argparse.Namespace, until: float | None) -> dict:
    """Runs :func:`warm_tasks` in ``args.warm_workers`` parallel processes (output discarded);
    processes still running at ``until`` are killed (Triton writes its cache atomically)."""
    tasks = warm_tasks(args)
    print(f"\nwarming Triton's cache: {len(tasks)} tasks in {args.warm_workers} processes",
          flush=True)
    pending, running, failed, killed = list(tasks), [], [], []
    # compile every config, but keep no autotune choice: several processes share the GPU here
    # and the throughput and preset tasks run small sizes under the measured run's keys, so a
    # choice they left on disk would be what the measured run loads instead of tuning alone
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVTOOL_AUTOTUNE_CACHE"] = "0"
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            while pending and len(running) < args.warm_workers:
                task = pending.pop(0)
                log = open(Path(tmp) / f"{len(pending)}.log", "w+")
                proc = subprocess.Popen([sys.executable, __file__, *task], env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
                running.append((proc, task, log))
            time.sleep(0.2)
            late = until is not None and time.monotonic() > until
            for item in list(running):
                proc, task, log = item
                if proc.poll() is None and late:
                    proc.kill()
                    proc.wait()
                    killed.append(label(task))
                elif proc.poll() is None:
                    continue
                elif proc.returncode:
                    log.seek(0)
                    lines = log.read().strip().splitlines() or ["(no output)"]
                    why = next((x for x in lines if "FAILED" in x), lines[-1]).strip()
                    failed.append(f"{label(task)}: {why}")
                running.remove(item)
                log.close()
            if late:
                killed += [label(t) for t in pending]
                pending = []
    for what, items in (("failed", failed), ("cut at the warm budget", killed)):
        for item in items:
            print(f"  warm task {what}: {item}", flush=True)
    return {"tasks": len(tasks), "workers": args.warm_workers, "failed": failed,
            "killed": killed}


def header(torch, tc, device: str) -> dict:
    """Prints and returns the device and library versions."""
    import transformers

    if device == "cuda":
        name = torch.cuda.get_device_name()
        free, total = torch.cuda.mem_get_info()
        mem = f", {total / 2**30:.0f} GiB ({free / 2**30:.0f} GiB free)"
    else:
        name, mem = f"CPU ({platform.processor() or platform.machine()})", ""
    meta = {"device": name, "torch": torch.__version__, "triton": tc.triton.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "interpreter": bool(tc.INTERPRET),
            "timer": "cuda events" if device == "cuda" else "perf_counter"}
    print(f"{name}{mem}; torch {meta['torch']} (CUDA {meta['cuda']}), triton {meta['triton']}, "
          f"transformers {meta['transformers']}; timer: {meta['timer']}", flush=True)
    if device == "cpu":
        print("CPU tensors under TRITON_INTERPRET=1: TIMINGS ARE MEANINGLESS, this run checks "
              "that every section's code runs", flush=True)
    return meta


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    try:
        import torch
    except ImportError:
        sys.exit("benchmarks/gpu.py: torch is not installed; this benchmark needs CUDA torch")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: CUDA is not available (torch.cuda.is_available() is False);"
                 " run on an NVIDIA GPU, or check the code paths with --device cpu --smoke")
    from kvtool.kernels import triton_cuda as tc

    if not tc.available():
        sys.exit("benchmarks/gpu.py: triton is not installed; pip install triton")
    if args.device == "cpu" and not tc.INTERPRET:
        sys.exit("benchmarks/gpu.py: --device cpu needs triton imported under TRITON_INTERPRET=1")
    import gpu_cache
    import gpu_sections

    torch.manual_seed(0)
    budget = Budget(args.budget, SHARES, start)
    results: dict = {"meta": {**header(torch, tc, args.device), "argv": sys.argv[1:],
                              "smoke": args.smoke, "all": args.all, "budget_s": args.budget}}

    def save() -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1))

    if args.warm_workers > 0 and args.sections:
        t0 = time.monotonic()
        results["warm"] = warm(args, budget.deadline("warm").at)
        results["warm"]["wall_s"] = time.monotonic() - t0
        print(f"[warm: {results['warm']['wall_s']:.1f} s]", flush=True)
    clock = Clock(torch, args.device, args.repeats, warmup=0 if args.smoke else 2,
                  cold_l2=not args.warm_l2)
    run = {"throughput": gpu_sections.throughput, "dtypes": gpu_sections.dtypes,
           "attention": gpu_sections.attention, "presets": gpu_sections.presets,
           "cache": gpu_cache.cache}
    failures = 0
    for name in args.sections:
        t0 = time.monotonic()
        deadline = budget.deadline(name)
        try:
            out = run[name](Bench(torch, tc, args.device, clock, args, deadline))
        except Exception as error:  # the next sections still run; the exit status says so
            deadline.errors.append(f"{name}: {type(error).__name__}: {error}")
            print(f"  {name} FAILED: {type(error).__name__}: {str(error)[:500]}", flush=True)
            out = {"rows": []}
        out["skipped"] = out.get("skipped", []) + deadline.skipped
        out["errors"] = deadline.errors
        failures += len(deadline.errors)
        out["wall_s"] = time.monotonic() - t0
        results[name] = out
        print(f"[{name}: {out['wall_s']:.1f} s]", flush=True)
        save()
    results["meta"]["total_s"] = time.monotonic() - start
    times = ", ".join(f"{k} {results[k]['wall_s']:.0f} s" for k in ("warm", *args.sections)
                      if k in results)
    print(f"\ntotal {results['meta']['total_s']:.0f} s ({times})"
          + (f"; {failures} FAILED rows/sections" if failures else ""), flush=True)
    save()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
