"""``kvtool serve`` end to end: time to first token cold, warm in-process and after a restart
(served from the store), store size against vLLM's raw per-layer layout, and the store's
Prometheus metrics over N concurrent requests after the restart.

A ~2K-token prompt (the bundled eval text plus a question) is sent, streamed, through the
``openai`` client to a real server on 127.0.0.1:

1. server A, cold store: the prompt (cold prefill), then the same prompt again (warm: vLLM's own
   prefix cache in the process) — the first request's chunks are written to the store;
2. server A stops; server B starts on the same store: the prompt again (restart: its prefix is
   loaded from the store), then ``--concurrency`` requests at once (the document with another
   question each), counted through B's ``/metrics``.

    python benchmarks/serve.py                     # the connector's default policy
    python benchmarks/serve.py --codec raw --tokens 2048

"Raw per-layer layout" is what vLLM's ExampleConnector writes: every stored token's K and V
in the model's dtype (bf16), one file per layer per prompt (headers not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTIONS = ["When was the lighthouse first lit?", "Who designed the tower?",
             "How tall is the tower?", "What was the original light source?",
             "Summarise the text above in one sentence.", "Which year is mentioned first?",
             "What is the main topic of the text?", "Name one place mentioned above."]


def prompt_ids(tokens: int, question: str) -> list[int]:
    """``tokens`` ids of the bundled eval text (repeated as needed) followed by ``question``."""
    from transformers import AutoTokenizer

    from kvtool.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default")[1], local_files_only=True)
    text = (Path(__file__).parents[1] / "kvtool" / "data" / "eval_text.md").read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens] + tok(f"\n\nQuestion: {question}\nAnswer:",
                              add_special_tokens=False)["input_ids"]


class Server:
    def __init__(self, store: str, log: str, args: argparse.Namespace):
        self.store, self.log, self.args = store, log, args

    def start(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        kvtool = shutil.which("kvtool", path=os.path.dirname(sys.executable)) or "kvtool"
        cmd = [kvtool, "serve", "--store", self.store, "--port", str(self.port),
               "--max-model-len", str(self.args.tokens + 512)]
        if self.args.codec:
            cmd += ["--codec", self.args.codec]
        cmd += ["--", "--max-num-seqs", str(self.args.concurrency)]
        began = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        import openai

        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-",
                                    timeout=1800, max_retries=0)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited; see {self.log}")
            try:
                self.model = self.client.models.list().data[0].id
                break
            except Exception:
                time.sleep(2)
        print(f"  server up in {time.perf_counter() - began:.0f} s (port {self.port})",
              file=sys.stderr)
        return self

    def ttft(self, ids: list[int]) -> float:
        """Seconds to the first streamed token of a greedy completion."""
        began = time.perf_counter()
        stream = self.client.completions.create(model=self.model, prompt=ids, max_tokens=4,
                                                temperature=0, stream=True)
        first = None
        for _ in stream:
            first = first or time.perf_counter() - began
        return first or float("nan")

    def metrics(self) -> dict[tuple[str, str], float]:
        """kvtool_store_* samples summed per (name, result/kind label)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics") as r:
            text = r.read().decode()
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("kvtool_store_") and not s.name.endswith("_created"):
                    key = (s.name, s.labels.get("result") or s.labels.get("kind") or "")
                    out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self) -> None:
        """SIGTERM to the API server (it shuts its engine down); leftovers killed after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for _ in range(30):
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(1)
        os.killpg(self.proc.pid, signal.SIGKILL)


def store_bytes(store: str) -> int:
    return sum(p.stat().st_size for p in Path(store).rglob("*.kvz") if "quarantine" not in p.parts)


def raw_layout_bytes(tokens: int) -> int:
    from transformers import AutoConfig

    from kvtool.identity import model_identity
    from kvtool.models import resolve_model

    info = model_identity(AutoConfig.from_pretrained(resolve_model("default")[1],
                                                     local_files_only=True))
    return tokens * 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"] * 2


async def concurrent(server: Server, prompts: list[list[int]]) -> tuple[float, int]:
    """Wall seconds for all prompts at once, and how many failed."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-",
                                timeout=1800, max_retries=0)
    began = time.perf_counter()
    results = await asyncio.gather(*(client.completions.create(
        model=server.model, prompt=p, max_tokens=8, temperature=0) for p in prompts),
        return_exceptions=True)
    return time.perf_counter() - began, sum(isinstance(r, BaseException) for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="document tokens per prompt")
    ap.add_argument("--codec", help="store codec (default: the connector's policy)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--store", help="store directory (default: a fresh temp dir)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvtool-serve-bench-")
    store = args.store or os.path.join(tmp, "store")
    prompt = prompt_ids(args.tokens, QUESTIONS[0])
    others = [prompt_ids(args.tokens, q) for q in QUESTIONS[1:]]
    others = (others * (1 + args.concurrency // len(others)))[:args.concurrency]

    a = Server(store, os.path.join(tmp, "a.log"), args).start()
    try:
        cold = a.ttft(prompt)
        warm = a.ttft(prompt)
        time.sleep(5)  # background saves
    finally:
        a.stop()
    stored = store_bytes(store)
    b = Server(store, os.path.join(tmp, "b.log"), args).start()
    try:
        restart = b.ttft(prompt)
        before = b.metrics()
        wall, failed = asyncio.run(concurrent(b, others))
        time.sleep(3)  # the next engine steps carry the last counters
        after = b.metrics()
    finally:
        b.stop()

    print(f"\nkvtool serve, default model, {len(prompt)}-token prompt, policy "
          f"{args.codec or 'connector default'}\n")
    print("| request | TTFT (s) | vs cold |\n|---|---|---|")
    for name, t in (("cold (server A)", cold), ("warm, same process (A)", warm),
                    ("after restart, from the store (B)", restart)):
        print(f"| {name} | {t:.2f} | {cold / t:.1f}x |")
    raw = raw_layout_bytes(args.tokens // 256 * 256)
    print(f"\n| store | bytes |\n|---|---|\n| kvtool store ({args.tokens // 256 * 256} stored "
          f"tokens) | {stored:,} |\n| vLLM raw per-layer layout (bf16) | {raw:,} "
          f"({raw / max(stored, 1):.2f}x kvtool) |")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    print(f"\n{args.concurrency} concurrent requests on B: {wall:.1f} s wall, {failed} failed\n")
    print("| metric | value |\n|---|---|")
    for (name, label), value in sorted(delta.items()):
        if value and not name.endswith("_bucket"):
            print(f"| {name}{'{' + label + '}' if label else ''} | {value:,.3f} |")
    print(f"\nlogs: {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
