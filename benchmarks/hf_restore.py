"""Restore vs recompute on the default model (SmolLM2-135M, HF transformers, CPU).

For each prefix length, a synthetic document is captured once and saved as .kvz with each codec;
then "restore" = read the file + rebuild a DynamicCache + prefill the question + first token, and
"recompute" = prefill document + question + first token. Also prints the first-step logit error
of each codec against recompute and whether the greedy continuations agree.

    python benchmarks/hf_restore.py                          # 500 and 2000 tokens, raw + turbo3
    python benchmarks/hf_restore.py --tokens 1000 --codecs raw,turbo4 --threads 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from kvtool.engines import hf
from kvtool.formats import load, save
from kvtool.models import load_model

QUESTION = " Which station reported the most wind?"


def document(tokenizer, tokens: int) -> str:
    """Deterministic, non-repeating text of about ``tokens`` tokens."""
    places = ["Skerry Point", "Gull Rock", "Harbour Mouth", "North Cape", "Eel Bay", "Tor Head"]
    lines, i = [], 0
    while True:
        lines.append(f"Log {i}: the station at {places[i % 6]} reported {(i * 7) % 23} degrees "
                     f"and {(i * 13) % 41} knots of wind from the {'NESW'[i % 4]}.")
        i += 1
        if i % 8 == 0 and len(hf.encode_text(tokenizer, " ".join(lines))) >= tokens:
            break
    text = " ".join(lines)
    ids = hf.encode_text(tokenizer, text)[:tokens]
    return tokenizer.decode(ids)


def best_of(n: int, fn):
    results = [fn() for _ in range(n)]
    return min(results, key=lambda r: r[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="500,2000")
    parser.add_argument("--codecs", default="raw,turbo3")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="best of N")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    loaded = load_model("default", dtype=args.dtype)
    print(f"model: {loaded.name} {args.dtype}, load {loaded.load_seconds:.2f} s "
          f"({time.perf_counter() - start:.2f} s with imports), {args.threads} thread(s)")
    header = (f"{'tokens':>6} {'setup':<9} {'file MB':>8} {'read s':>7} {'restore s':>9} "
              f"{'TTFT s':>7} {'recompute TTFT s':>16} {'speed-up':>8} {'max|dlogit|':>11} "
              f"{'same text':>9}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(t) for t in args.tokens.split(",")):
            cache = hf.capture(loaded.model, loaded.tokenizer,
                               document(loaded.tokenizer, n), model_info=loaded.info)
            full = hf.full_ids_for(cache, loaded.tokenizer, QUESTION)
            base = best_of(args.repeats, lambda full=full: (
                (r := hf.recompute_generation(loaded, full, args.new_tokens)).ttft_s, r))[1]
            for codec in args.codecs.split(","):
                path = os.path.join(tmp, f"{n}-{codec}.kvz")
                save(cache, path, codec=codec)

                def run(path=path):
                    t0 = time.perf_counter()
                    restored = load(path, backend="torch")
                    read = time.perf_counter() - t0
                    out = hf.continue_generation(loaded, restored, QUESTION, args.new_tokens)
                    return read + out.ttft_s, read, out

                ttft, read, out = best_of(args.repeats, run)
                diff = (out.first_logits - base.first_logits).abs().max().item()
                print(f"{len(cache.token_ids):>6} {codec:<9} {os.path.getsize(path) / 1e6:>8.2f} "
                      f"{read:>7.3f} {out.restore_s:>9.4f} {ttft:>7.3f} {base.ttft_s:>16.3f} "
                      f"{base.ttft_s / ttft:>7.1f}x {diff:>11.4f} "
                      f"{str(out.new_token_ids == base.new_token_ids):>9}")


if __name__ == "__main__":
    main()
