"""Which prefix-store policy keeps temperature-0 answers stable after a restart?

For each bundled eval prompt (the demo document + each question of ``demo_questions.json``,
chat-templated as :func:`kvtool.evaluate.demo_prompt` builds it) this runs what a vLLM server
with kvtool's store does after a restart, on the HF engine: the prompt's full chunks (as the
connector cuts them, leaving at least one token to compute) are written through
:class:`~kvtool.engines.vllm.store.PrefixStore` with the policy (sinks on the first chunk only,
zstd on, exactly as the connector writes them), read back, restored, and the rest of the
prompt plus ``--max-new-tokens`` greedy tokens are computed. The continuation is compared with a
recompute of the whole prompt (no store). ``raw`` is the control: it shows the numerical noise
of restore-then-continue itself.

    nice -n 10 .venv/bin/python benchmarks/store_policy.py [--dtype bfloat16] [--max-new-tokens 32]

Prints a table: policy, nominal bits/element (codecs, sinks aside), bits/element of the chunk
files on disk (headers and zstd included), prompts whose continuation matches recompute, and
the first divergent new-token position per prompt (``-``: identical).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

DEFAULT_POLICIES = (
    "raw",
    "k=kivi4 v=turbo3",  # the connector's default before this change
    "k=turbo4:center=true v=turbo3 sink=4",
    "k=turbo4:center=true v=turbo4 sink=4",
    "k=kivi4 v=turbo4 sink=4",
    "turbo4 sink=4",
    "quality",  # the store's default (a preset)
    "balanced",
)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@torch.inference_mode()
def _recompute(loaded, ids: list[int], max_new: int):
    """Greedy new tokens of a whole-prompt recompute, and the prompt's K/V from its prefill."""
    from transformers import DynamicCache

    from kvtool.engines.hf import _greedy

    past = DynamicCache(config=loaded.model.config)
    new, *_ = _greedy(loaded, ids, past, max_new, time.perf_counter())
    n = len(ids)  # the cache also holds the new tokens: keep the prompt's
    keys = [layer.keys[0, :, :n].clone() for layer in past.layers]
    values = [layer.values[0, :, :n].clone() for layer in past.layers]
    return new, keys, values


def _through_store(loaded, policy, ids: list[int], keys, values, chunk_tokens: int,
                   root: Path):
    """The prompt's stored prefix as the store returns it: ``(KVCache, file bytes)``."""
    from kvtool.cache import KVCache
    from kvtool.engines.vllm.store import PrefixStore

    store = PrefixStore(root, loaded.info, chunk_tokens, policy, zstd=True)
    chunks = store.chunks(ids, limit=len(ids) - 1)  # vLLM computes at least one token
    parts, nbytes = [], 0
    for c in chunks:
        nbytes += store.write(c, [k[:, c.start:c.stop] for k in keys],
                              [v[:, c.start:c.stop] for v in values], ids)
        parts.append(store.read(c))
    stop = chunks[-1].stop if chunks else 0
    k = [torch.cat([p.keys[i] for p in parts], dim=1) for i in range(len(keys))]
    v = [torch.cat([p.values[i] for p in parts], dim=1) for i in range(len(values))]
    cache = KVCache(k, v, token_ids=np.asarray(ids[:stop]), model=dict(loaded.info),
                    tokenizer_fingerprint=loaded.fingerprints["tokenizer"])
    return cache, nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16, what "
                    "kvtool serve and vLLM run the default model in)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--policy", action="append", help="a policy label (repeatable; default: "
                    + "; ".join(DEFAULT_POLICIES) + ")")
    ap.add_argument("--questions", type=int, default=None, help="only the first N questions")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)

    from kvtool.engines.hf import continue_generation
    from kvtool.evaluate import data_text, demo_prompt
    from kvtool.models import load_model
    from kvtool.policy import CodecPolicy

    labels = list(args.policy or DEFAULT_POLICIES)
    policies = [CodecPolicy.from_label(label) for label in labels]  # bad labels fail fast
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model("default", dtype=args.dtype)
    tok = loaded.tokenizer
    n_questions = len(json.loads(data_text("demo_questions.json"))["questions"])
    prompts = [tok(demo_prompt(tok, q), add_special_tokens=False)["input_ids"]
               for q in range(min(n_questions, args.questions or n_questions))]
    head_dim = loaded.info["head_dim"]
    start = time.perf_counter()
    rows = {label: {"matches": 0, "first_diff": [], "bytes": 0, "elements": 0}
            for label in labels}
    for n, ids in enumerate(prompts):
        want, keys, values = _recompute(loaded, ids, args.max_new_tokens)
        print(f"prompt {n}: {len(ids)} tokens, recompute {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
        for label, policy in zip(labels, policies, strict=True):
            with tempfile.TemporaryDirectory(prefix="kvtool-store-policy-") as root:
                cache, nbytes = _through_store(loaded, policy, ids, keys, values,
                                               args.chunk_tokens, Path(root))
            got = continue_generation(loaded, cache, input_ids=ids,
                                      max_new_tokens=args.max_new_tokens).new_token_ids
            diff = _first_difference(want, got)
            print(f"  {label}: {'identical' if diff is None else f'differs at {diff}'}",
                  file=sys.stderr, flush=True)
            row = rows[label]
            row["matches"] += diff is None
            row["first_diff"].append(diff)
            row["bytes"] += nbytes
            row["elements"] += 2 * cache.num_layers * loaded.info["num_kv_heads"] \
                * cache.num_tokens * head_dim
    print(f"\nstore policies on the default model ({args.dtype}, HF engine, chunks of "
          f"{args.chunk_tokens}, zstd, {args.max_new_tokens} new tokens, greedy), "
          f"{time.perf_counter() - start:.0f} s\n")
    print("| policy | bits/element (codecs) | bits/element (files) | matches recompute | "
          "first divergence (new token) |")
    print("|---|---|---|---|---|")
    out = []
    for label, policy in zip(labels, policies, strict=True):
        row = rows[label]
        nominal = (policy.key.bits_per_element(head_dim)
                   + policy.value.bits_per_element(head_dim)) / 2
        on_disk = 8 * row["bytes"] / max(row["elements"], 1)
        firsts = ", ".join("-" if d is None else str(d) for d in row["first_diff"])
        print(f"| {policy.describe()} | {nominal:.2f} | {on_disk:.2f} | "
              f"{row['matches']}/{len(prompts)} | {firsts} |")
        out.append({"policy": policy.describe(), "bits_nominal": nominal,
                    "bits_files": on_disk, "matches": row["matches"], "prompts": len(prompts),
                    "first_difference": row["first_diff"], "dtype": args.dtype})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
