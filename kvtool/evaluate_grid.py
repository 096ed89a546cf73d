"""A policy's quality as its mean over rotation seeds × texts, with the spread around it.

One 2K-token text and one rotation seed give a Δppl that moves by more than the differences
between policies (issue 13): a policy's number here is its **mean** over ≥ 3 seeds
(:meth:`CodecPolicy.with_seed`) and ≥ 2 texts of different genres, ranked by the mean
next-token KL (compressed past vs exact), which is steadier than Δppl. The spread is max − min
over the runs, in the metric's own unit (Δppl: percentage points).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtool.codecs.turbo import DEFAULT_SEED
from kvtool.engines.hf_runtime import DEFAULT_BLOCK_SIZE
from kvtool.evaluate import Baseline, data_text, evaluate, run_baseline
from kvtool.policy import CodecPolicy

#: the bundled texts: an expository essay and a story with dialogue
DEFAULT_TEXTS = ("eval_text.md", "story_text.md")
DEFAULT_SEEDS = (DEFAULT_SEED, 1, 2)
METRICS = ("delta_ppl_pct", "kl", "kl_past", "bits_per_element", "attention_kl")


def seed_list(count: int) -> tuple[int, ...]:
    """The first ``count`` rotation seeds: :data:`DEFAULT_SEEDS`, then 3, 4, …"""
    return (DEFAULT_SEEDS + tuple(range(3, 3 + count)))[:count]


@dataclass
class Sweep:
    """Every run of one policy and their aggregate."""

    label: str
    policy: dict[str, Any]
    runs: list[dict[str, Any]]
    mean: dict[str, float] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)
    std: dict[str, float] = field(default_factory=dict)
    seed_spread: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.seed_spread:
            self.seed_spread = seed_spread(self.runs)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def aggregate(runs: list[dict[str, Any]], metrics: tuple[str, ...] = METRICS
              ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(mean, spread = max − min, population std) of each metric over ``runs``."""
    mean, spread, std = {}, {}, {}
    for name in metrics:
        values = [float(r[name]) for r in runs if name in r and not math.isnan(float(r[name]))]
        if not values:
            continue
        mean[name] = statistics.fmean(values)
        spread[name] = max(values) - min(values)
        std[name] = statistics.pstdev(values)
    return mean, spread, std


def seed_spread(runs: list[dict[str, Any]], metrics: tuple[str, ...] = METRICS
                ) -> dict[str, float]:
    """The spread due to the rotation seed alone: per text, max − min over its seeds; the mean
    over texts (texts differ by more than seeds do, so :func:`aggregate`'s spread mixes both).
    Empty when no text has two seeded runs."""
    by_text: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("seed") is not None:
            by_text.setdefault(str(r.get("text")), []).append(r)
    out = {}
    for name in metrics:
        spreads = []
        for group in by_text.values():
            values = [float(r[name]) for r in group
                      if name in r and not math.isnan(float(r[name]))]
            if len(values) >= 2:
                spreads.append(max(values) - min(values))
        if spreads:
            out[name] = statistics.fmean(spreads)
    return out


def load_baselines(loaded: Any, texts: dict[str, str | None] | None = None, *, chunk: int = 256,
                   max_tokens: int | None = 2048, n_queries: int = 16) -> dict[str, Baseline]:
    """The exact run of each text (name → text; None: the bundled file of that name)."""
    texts = texts or {name: None for name in DEFAULT_TEXTS}
    return {name: run_baseline(loaded, text if text is not None else data_text(name),
                               chunk=chunk, max_tokens=max_tokens, n_queries=n_queries)
            for name, text in texts.items()}


def sweep(loaded: Any, policy: CodecPolicy, baselines: dict[str, Baseline],
          seeds: tuple[int, ...] = DEFAULT_SEEDS, *, block_size: int = DEFAULT_BLOCK_SIZE,
          on_run: Any = None) -> Sweep:
    """Evaluate ``policy`` under every seed on every baseline's text; ``on_run(run)`` sees each
    run as it finishes (progress). Policies without a seeded codec run once per text."""
    seeded = policy.with_seed(seeds[0]) != policy.with_seed(seeds[-1])
    runs = []
    for name, base in baselines.items():
        for seed in seeds if seeded else seeds[:1]:
            r = evaluate(loaded, policy.with_seed(seed), baseline=base, block_size=block_size)
            run = {"text": name, "seed": seed if seeded else None, "tokens": r.tokens,
                   "ppl": r.ppl, "baseline_ppl": r.baseline_ppl,
                   "delta_ppl_pct": r.delta_ppl_pct, "kl": r.kl, "kl_past": r.kl_past,
                   "bits_per_element": r.metrics["bits_per_element"],
                   "attention_kl": r.metrics.get("attention_kl", math.nan)}
            runs.append(run)
            if on_run is not None:
                on_run(run)
    mean, spread, std = aggregate(runs)
    if seeded:  # named as run under the first seed, never a seed it did not run under
        policy = policy.with_seed(seeds[0])
    return Sweep(policy.describe(), policy.to_json(), runs, mean, spread, std)


def format_table(sweeps: list[Sweep], names: dict[str, str] | None = None) -> str:
    """A table ranked by mean KL: bits, KL and Δppl as mean ± spread (max − min over every
    run), and the Δppl spread across seeds alone (:func:`seed_spread`)."""
    names = names or {}
    lines = [f"{'policy':<58} {'bits/el':>7} {'KL mean':>8} {'KL sprd':>8} "
             f"{'Δppl% mean':>10} {'Δppl sprd':>9} {'seed sprd':>9} {'runs':>4}"]
    for s in sorted(sweeps, key=lambda s: s.mean.get("kl", math.inf)):
        m, sp = s.mean, s.spread
        label = names.get(s.label, s.label)
        lines.append(f"{label:<58} {m.get('bits_per_element', math.nan):>7.3f} "
                     f"{m.get('kl', math.nan):>8.5f} {sp.get('kl', math.nan):>8.5f} "
                     f"{m.get('delta_ppl_pct', math.nan):>+10.3f} "
                     f"{sp.get('delta_ppl_pct', math.nan):>9.3f} "
                     f"{s.seed_spread.get('delta_ppl_pct', math.nan):>9.3f} {len(s.runs):>4}")
    return "\n".join(lines)


def eval_sweep(loaded: Any, policy: CodecPolicy, text_name: str | None, text: str | None,
               seeds: int, *, chunk: int, block_size: int, max_tokens: int | None,
               as_json: bool) -> None:
    """``kvtool eval --seeds N``: the sweep of one policy, as a table or JSON."""
    import json

    import click

    texts = {text_name: text} if text is not None else None
    baselines = load_baselines(loaded, texts, chunk=chunk, max_tokens=max_tokens or 2048)
    all_seeds = seed_list(seeds)
    s = sweep(loaded, policy, baselines, all_seeds, block_size=block_size)
    if as_json:
        click.echo(json.dumps({"model": loaded.name, **s.to_json()}, indent=2, sort_keys=True))
        return
    for r in s.runs:
        click.echo(f"{r['text']:<16} seed {r['seed']!s:<6} Δppl {r['delta_ppl_pct']:+.3f}%  "
                   f"KL {r['kl']:.5f} (after the first chunk {r['kl_past']:.5f})  "
                   f"bits {r['bits_per_element']:.3f}")
    click.echo(format_table([s]))
