"""Quality benchmark: perplexity change of every codec and of selected K/V policies.

On the default model and the bundled evaluation text (~3.8K tokens), the text is processed in
chunks; each chunk attends to a past held by a ``CompressedCache`` (encode→decode with the
policy), and the perplexity is compared with the same chunking on an exact ``DynamicCache``.
Also reported: bits/element actually used (encoded bytes of the captured cache stored as
bfloat16, every side-info byte and the lossless sinks/layers/window included), key/value cosine,
and the attention KL of the last 16 queries against compressed keys.

    python benchmarks/quality.py                          # every codec + the default policies
    python benchmarks/quality.py --max-tokens 1024 --codecs turbo3 --policy "k=turbo4 v=turbo2"
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvtool.codecs import list_codecs
from kvtool.evaluate import evaluate, read_text, run_baseline
from kvtool.models import load_model
from kvtool.policy import CodecPolicy

# K/V policies worth comparing (from a small search on this model; add more with --policy).
# Findings: the first token is an attention sink (keeping just it halves turbo3's damage), and
# centring keys per block (center=true) pays off once the sinks are kept out of the blocks.
DEFAULT_POLICIES = [
    "k=turbo4 v=turbo3",
    "turbo4 sink=4",
    "k=turbo4:center=true v=turbo4 sink=4",
    "turbo3 sink=1",
    "turbo3 sink=4",
    "turbo3 protect=1 sink=8",
    "k=turbo3:center=true v=turbo3",
    "k=turbo3:center=true v=turbo3 sink=4",
    "k=turbo3:center=true v=turbo3 sink=4 recent=64",
    "k=turbo4:center=true v=turbo2 sink=4",
    "k=kivi4 v=kivi2",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=None, help="text file (default: bundled eval text)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--codecs", default=None, help="comma-separated ids (default: every codec)")
    ap.add_argument("--policy", action="append", default=None,
                    help="policy label, e.g. 'k=turbo4 v=turbo3 sink=8' (repeatable; "
                         "default: a built-in list)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model("default", dtype=args.dtype)
    start = time.perf_counter()
    base = run_baseline(loaded, read_text(args.text), chunk=args.chunk,
                        max_tokens=args.max_tokens)
    print(f"# default model ({args.dtype}), {base.ids.shape[1]} tokens in chunks of {args.chunk}, "
          f"runtime block {args.block_size}; baseline ppl {base.ppl:.4f} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    codecs = args.codecs.split(",") if args.codecs else list_codecs()
    labels = codecs + (args.policy if args.policy is not None else DEFAULT_POLICIES)
    print(f"{'policy':<48} {'bits/el':>7} {'K cos':>7} {'V cos':>7} {'attn KL':>8} "
          f"{'ppl':>8} {'Δppl %':>8}", flush=True)
    rows = []
    for label in labels:
        policy = CodecPolicy.from_label(label)
        r = evaluate(loaded, policy, baseline=base, block_size=args.block_size)
        m = r.metrics
        rows.append({"policy": label, **r.to_json()})
        print(f"{label:<48} {m['bits_per_element']:>7.3f} {m['key_cosine']:>7.4f} "
              f"{m['value_cosine']:>7.4f} {m.get('attention_kl', float('nan')):>8.4f} "
              f"{r.ppl:>8.4f} {r.delta_ppl_pct:>+8.3f}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
