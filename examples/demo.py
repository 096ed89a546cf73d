"""End-to-end demo on the embedded default model (SmolLM2-135M-Instruct).

Captures a bundled document as a prompt prefix, stores its KV cache compressed with turbo3,
inspects the file, reloads it and answers questions about the document without recomputing the
prefix, side by side with a full recompute. Run after ``bash scripts/setup.sh``:

    .venv/bin/python examples/demo.py [--codec turbo3] [--out-dir out]
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from pathlib import Path

SYSTEM = "You are a helpful assistant. Answer questions using the document the user provides."


def chat_prefix(document: str) -> str:
    """The reusable part of the prompt: system message plus the document (ChatML, SmolLM2's)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\nHere is a document.\n\n{document}\n")


def chat_question(question: str) -> str:
    return f"\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", default="turbo3", help="codec for keys and values")
    ap.add_argument("--out-dir", default="out", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args()

    import torch

    from kvtool.engines.hf import capture, continue_generation, full_ids_for, recompute_generation
    from kvtool.formats import load, open_kvz, save
    from kvtool.models import load_model

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    data = resources.files("kvtool.data")
    document = data.joinpath("demo_document.md").read_text(encoding="utf-8")
    questions = json.loads(data.joinpath("demo_questions.json").read_text())["questions"]

    print("== 1. load the default model (converted once from the bundled GGUF, then cached)")
    loaded = load_model("default", dtype="float32")
    print(f"   {loaded.name} from {loaded.path} in {loaded.load_seconds:.2f} s")

    print("== 2. capture the document's KV cache")
    t0 = time.perf_counter()
    cache = capture(loaded.model, loaded.tokenizer, chat_prefix(document), model_info=loaded.info)
    capture_s = time.perf_counter() - t0
    print(f"   {cache.num_tokens} tokens, {cache.num_layers} layers, prefill {capture_s:.2f} s")

    print(f"== 3. compress with {args.codec} and save")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"document.{args.codec}.kvz"
    report = save(cache, path, codec=args.codec)
    print(f"   {path}: {report['file_bytes'] / 1e6:.2f} MB, "
          f"{report['ratio']:.2f}x smaller than fp16 ({report['fp16_bytes'] / 1e6:.2f} MB)")

    print("== 4. inspect")
    with open_kvz(path) as f:
        info = f.info()
        problems = f.verify()
    print(f"   format v{info['format_version']}, model {info['model'].get('name')}, "
          f"{info['num_tokens']} tokens, checksums {'ok' if not problems else problems}")

    print("== 5. reload and answer, restored prefix vs full recompute")
    t0 = time.perf_counter()
    restored = load(path, backend="torch")
    read_s = time.perf_counter() - t0
    for item in questions:
        prompt = chat_question(item["question"])
        res = continue_generation(loaded, restored, prompt, max_new_tokens=args.max_new_tokens)
        full = full_ids_for(restored, loaded.tokenizer, prompt)
        base = recompute_generation(loaded, input_ids=full, max_new_tokens=args.max_new_tokens)
        print(f"\n   Q: {item['question']}   (expected: {item['answer']})")
        print(f"   restored ({args.codec}): {res.text.strip()!r}")
        print(f"   recomputed         : {base.text.strip()!r}")
        print(f"   time to first token: restore {read_s + res.ttft_s:.3f} s "
              f"(file read {read_s:.3f} s) vs recompute {base.ttft_s:.3f} s "
              f"-> {base.ttft_s / (read_s + res.ttft_s):.1f}x faster")


if __name__ == "__main__":
    main()
