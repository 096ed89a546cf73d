"""Long-context retrieval benchmark: can the model still tell near-duplicate facts apart in a
cache compressed by each policy?

Each context (2K–8K tokens of the bundled texts, seeded) hides nine facts at spread depths
(``benchmarks/retrieval_task.py``): per family (locker codes, keepers' names, event dates) a
near-duplicate pair (codes with two digits swapped, the same first name with another surname,
the same day and year in another month) and a distinct needle. The context is prefilled once,
exactly, in the model's chat template; each policy then compresses that cache as users do
(``CompressedCache.from_kvcache``; peers prefill their own cache) and every question is
answered from a copy of it: each fact alone ("distinct" and "near" columns), then each family's
three facts as a list in one answer ("list": after each answer the next fact's cue follows, so
later answers read the earlier ones too). The assistant's turn starts with the answer's cue
("The code of the blue locker is"); up to 10 tokens are decoded greedily, to the first "." or
newline, and must start with the value (case, spaces and punctuation ignored). Accuracy per
(model, policy, length) with a 95% Wilson interval over the facts asked.

    python benchmarks/retrieval.py                                  # SmolLM2, 2K, 4 contexts
    python benchmarks/retrieval.py --lengths 2K,4K --contexts 4 --policies exact,quality,small
    python benchmarks/retrieval.py --models default,gemma --policies exact,quality,quanto-4
    python benchmarks/retrieval.py --json retrieval.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from bench_models import load_named
from peers import QUALITY_PEERS, peer_available, peer_cache
from retrieval_task import (
    Fact,
    build_context,
    exact_match,
    filler_paragraphs,
    make_facts,
    wilson,
)
from tqdm import tqdm

from kvtool.engines.hf import capture, to_dynamic_cache
from kvtool.engines.hf_runtime import CompressedCache
from kvtool.errors import KvtoolError
from kvtool.evaluate import data_text
from kvtool.policy import CodecPolicy
from kvtool.presets import PRESETS

TEXTS = ("eval_text.md", "story_text.md", "demo_document.md")
INSTRUCTION = ("Read the document below carefully. It contains locker codes, the names of "
               "keepers and the dates of events. Answer the question after it with the exact "
               "value from the document.\n\n")
DEFAULT_POLICIES = ["exact", "quality", "balanced", "small"]
KINDS = ("distinct", "near", "list", None)  # table columns: record kinds, None = all
ANSWER_TOKENS = 10  # at most this many greedy tokens per answer (it ends at "." or a newline)


def parse_length(text: str) -> int:
    """``2K`` → 2048, ``512`` → 512."""
    text = text.strip().upper()
    return int(float(text[:-1]) * 1024) if text.endswith("K") else int(text)


def _ids(model: Any, ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], device=next(model.parameters()).device)


# -- prompts ----------------------------------------------------------------------------------
@dataclass
class Question:
    kind: str  # "single" (one fact) or "list" (each fact after the last, in one answer)
    facts: list[Fact]
    ids: list[int]  # the tokens after the cached context: question, turn end, first cue


def split_template(tokenizer: Any) -> tuple[str, str]:
    """(text before the user's content, text between it and the assistant's answer)."""
    if not getattr(tokenizer, "chat_template", None):
        return "", "\nAnswer: "
    mark = "\x00CONTENT\x00"
    full = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = full.split(mark)
    return head, tail


def questions_for(tokenizer: Any, facts: list[Fact], tail: str) -> list[Question]:
    """Every fact alone, then each family's facts as a list, tokenized after the context."""
    def ids(question: str, cue: str) -> list[int]:
        text = f"\n\nQuestion: {question}{tail}{cue}"
        return tokenizer(text, add_special_tokens=False).input_ids

    out = [Question("single", [f], ids(f.question, f.cue)) for f in facts]
    for family in dict.fromkeys(f.family for f in facts):
        group = [f for f in facts if f.family == family]
        out.append(Question("list", group, ids(" ".join(f.question for f in group),
                                               group[0].cue)))
    return out


@dataclass
class Context:
    seed: int
    facts: list[Fact]
    prefix_ids: list[int]
    questions: list[Question]


def make_context(tokenizer: Any, paragraphs: list[str], n_tokens: int, seed: int) -> Context:
    """The seeded context of at most (about) ``n_tokens`` tokens, template and instruction
    included."""
    head, tail = split_template(tokenizer)
    facts = make_facts(seed)
    start = random.Random(seed).randrange(len(paragraphs))

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    budget = n_tokens - count(head + INSTRUCTION)
    for _ in range(3):  # tokens of the joined text are not quite the sum of its parts' tokens
        document = build_context(paragraphs, facts, budget, count, start)
        special = not head  # no template: let the tokenizer add its own BOS
        prefix_ids = tokenizer(head + INSTRUCTION + document, add_special_tokens=special).input_ids
        if len(prefix_ids) <= n_tokens:
            break
        budget -= len(prefix_ids) - n_tokens
    return Context(seed, facts, prefix_ids, questions_for(tokenizer, facts, tail))


# -- answering ----------------------------------------------------------------------------------
@torch.inference_mode()
def greedy(loaded: Any, past: Any, ids: list[int], max_new: int, stop: set[int],
           until: tuple[str, ...] = (".", "\n")) -> tuple[list[int], list[int]]:
    """Greedy tokens after ``ids``, continuing ``past``: at most ``max_new``, up to a stop
    token or a token holding one of ``until``. Returns (new tokens, those not yet in
    ``past``)."""
    out: list[int] = []
    x = _ids(loaded.model, ids)
    for _ in range(max_new):
        logits = loaded.model(input_ids=x, past_key_values=past, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        if token in stop:
            return out, []
        out.append(token)
        if any(u in loaded.tokenizer.decode([token]) for u in until):
            break
        x = _ids(loaded.model, [token])
    return out, out[-1:]


def ask(loaded: Any, past: Any, q: Question, stop: set[int]) -> list[str]:
    """The answer to each fact of ``q``, in one assistant turn continuing ``past``: after each
    answer the next fact's cue follows (so a list's later answers see the earlier ones)."""
    tok, answers, ids = loaded.tokenizer, [], q.ids
    for i in range(len(q.facts)):
        new, pending = greedy(loaded, past, ids, ANSWER_TOKENS, stop)
        answers.append(tok.decode(new, skip_special_tokens=True).strip())
        if i + 1 < len(q.facts):
            ids = pending + tok(" " + q.facts[i + 1].cue, add_special_tokens=False).input_ids
    return answers


def stop_tokens(loaded: Any) -> set[int]:
    eos = loaded.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tok = loaded.tokenizer
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


def prefilled(loaded: Any, ctx: Context, policy: str, exact: Any) -> Any:
    """The cache ``policy`` answers from: the exact capture ``exact`` (a KVCache) as a
    DynamicCache, compressed by a kvtool policy, or a peer's cache prefilled by the model."""
    model = loaded.model
    if policy == "exact":
        return to_dynamic_cache(exact, model)
    if policy in PEERS:
        past, _ = peer_cache(model.config, *PEERS[policy])
        with torch.inference_mode():
            model(input_ids=_ids(model, ctx.prefix_ids), past_key_values=past, use_cache=True)
        return past
    kv_policy = CodecPolicy.from_label(policy)
    return CompressedCache.from_kvcache(exact, kv_policy.resolve(exact), model)


PEERS = {f"{backend}-{bits}": (backend, bits) for backend, bits in QUALITY_PEERS}


def answer_all(loaded: Any, ctx: Context, past: Any, stop: set[int]) -> list[dict[str, Any]]:
    """Every question of ``ctx`` from a copy of ``past``: one record per fact asked."""
    records = []
    for q in ctx.questions:
        for fact, out in zip(q.facts, ask(loaded, copy.deepcopy(past), q, stop), strict=True):
            kind = "list" if q.kind == "list" else "near" if fact.twin else "distinct"
            records.append({"kind": kind, "family": fact.family, "depth": round(fact.depth, 3),
                            "answer": fact.answer, "output": out,
                            "correct": exact_match(out, fact.answer)})
    return records


# -- the run ----------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    policy: str
    length: int
    tokens: float = 0.0  # mean prefix tokens
    seconds: float = 0.0
    error: str | None = None  # a peer that failed on this model
    records: list[dict[str, Any]] = field(default_factory=list)

    def accuracy(self, kind: str | None = None) -> tuple[int, int, float, float, float]:
        """(correct, n, accuracy, Wilson low, high) over records of ``kind`` (None: all)."""
        rs = [r for r in self.records if kind is None or r["kind"] == kind]
        k = sum(r["correct"] for r in rs)
        lo, hi = wilson(k, len(rs))
        return k, len(rs), k / len(rs) if rs else float("nan"), lo, hi

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for kind in KINDS:
            k, n, acc, lo, hi = self.accuracy(kind)
            out[kind or "all"] = {"correct": k, "n": n, "accuracy": acc, "wilson95": [lo, hi]}
        return out


def run_length(loaded: Any, policies: list[str], length: int, contexts: int,
               seed: int) -> list[Row]:
    """One row per policy: ``contexts`` contexts of about ``length`` tokens (seeds ``seed``…),
    each prefilled once exactly and answered from every policy's cache."""
    model_name = getattr(loaded, "name", "model")
    paragraphs = filler_paragraphs([data_text(t) for t in TEXTS])
    stop = stop_tokens(loaded)
    rows = {p: Row(model_name, p, length) for p in policies}
    with tqdm(total=contexts * len(policies), desc=f"{model_name} {length} tok",
              file=sys.stderr, leave=False) as bar:
        for c in range(contexts):
            ctx = make_context(loaded.tokenizer, paragraphs, length, seed + c)
            t = time.perf_counter()
            exact = capture(loaded.model, loaded.tokenizer, token_ids=ctx.prefix_ids)
            prefill = time.perf_counter() - t
            for policy in policies:
                row = rows[policy]
                bar.update()
                if row.error:
                    continue
                t = time.perf_counter()
                try:
                    past = prefilled(loaded, ctx, policy, exact)
                except Exception as e:  # a peer that cannot run this model: reported, not fatal
                    if policy not in PEERS:
                        raise
                    row.error = f"{type(e).__name__}: {e}"
                    continue
                records = answer_all(loaded, ctx, past, stop)
                row.records += [dict(r, seed=ctx.seed) for r in records]
                row.tokens += len(ctx.prefix_ids) / contexts
                row.seconds += time.perf_counter() - t + (prefill if policy == "exact" else 0)
    return list(rows.values())


def run_model(name: str, policies: list[str], lengths: list[int], contexts: int,
              seed: int, device: str = "cpu") -> list[Row]:
    loaded = load_named(name, device=device)
    rows = []
    for length in lengths:
        rows += run_length(loaded, policies, length, contexts, seed)
        for row in rows[-len(policies):]:
            print(format_row(row), flush=True)
    return rows


def format_row(row: Row) -> str:
    if row.error:
        return f"{row.model[:24]:<24} {row.policy[:18]:<18} failed: {row.error[:120]}"
    cells = []
    for kind in KINDS:
        k, n, acc, lo, hi = row.accuracy(kind)
        cells.append(f"{acc:6.1%} [{lo:.2f}, {hi:.2f}] {k:>3}/{n:<3}")
    return (f"{row.model[:24]:<24} {row.policy[:18]:<18} {row.tokens:>6.0f}  "
            + "  ".join(cells) + f"  {row.seconds:6.0f}")


HEADER = (f"{'model':<24} {'policy':<18} {'tokens':>6}  "
          + "  ".join(f"{t:<28}" for t in ("distinct: acc [95% CI] k/n", "near-duplicate",
                                            "list items", "all")) + "  seconds")


def policy_names(arg: str | None) -> list[str]:
    """``--policies``: exact, preset names, peer names (``quanto-4``…) or policy labels; the
    default is exact, the presets and every installed peer."""
    if arg:
        names = [p.strip() for p in arg.split(",") if p.strip()]
    else:
        names = DEFAULT_POLICIES + [p for p, (b, _) in PEERS.items() if peer_available(b)]
    for name in names:
        if name != "exact" and name not in PEERS and name not in PRESETS:
            try:  # a bad label fails before any model loads
                CodecPolicy.from_label(name)
            except KvtoolError as e:
                raise SystemExit(f"--policies {name!r}: {e}") from None
        if name in PEERS and not peer_available(PEERS[name][0]):
            raise SystemExit(f"peer {name} is not installed (see benchmarks/peers.py)")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default", help="comma-separated: default, gemma, paths")
    ap.add_argument("--policies", default=None,
                    help="comma-separated: exact, quality, balanced, small, quanto-4, hqq-3, "
                    "manthanquant-3 or policy labels (default: exact, presets, installed peers)")
    ap.add_argument("--lengths", default="2K", help="context lengths in tokens, e.g. 2K,4K,8K")
    ap.add_argument("--contexts", type=int, default=4, help="contexts per length")
    ap.add_argument("--seed", type=int, default=0, help="context i uses seed + i")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (short answers are decode-bound: 1 is often fastest)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", default=None, help="write every row and answer to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policies = policy_names(args.policies)
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    start = time.perf_counter()
    print(f"# seeds {args.seed}..{args.seed + args.contexts - 1}; per context 9 facts (3 "
          "near-duplicate pairs, 3 distinct), asked alone and as 3 lists of 3; seconds: the "
          "policy's own (exact: with the prefill; kvtool policies: compressing it; peers: their "
          "own prefill)", flush=True)
    print(HEADER, flush=True)
    rows = []
    for name in args.models.split(","):
        rows += run_model(name.strip(), policies, lengths, args.contexts, args.seed,
                          args.device)
    print(f"\n# {time.perf_counter() - start:.0f} s in all")
    print(HEADER)
    for row in rows:
        print(format_row(row))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([r.to_json() for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
