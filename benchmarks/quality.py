"""Quality benchmark: every preset and method as mean ± spread over rotation seeds × texts.

Each text (default: the two bundled ones, an essay and a story, 2048 tokens each) is processed
in chunks; each chunk attends to a past held by a ``CompressedCache`` (encode→decode with the
policy), against the same chunking on an exact ``DynamicCache``. Per run: Δppl, the mean
next-token KL (compressed vs exact), bits/element actually used (the captured cache encoded as
a .kvz would store it, bfloat16, side information and lossless sinks included) and the
attention KL of the last 16 queries. Per policy: the mean and the spread (max − min) over
3 seeds × 2 texts, ranked by mean KL. Peers (``benchmarks/peers.py``): transformers'
``QuantizedCache`` with quanto (``pip install -e ".[peers]"``) and hqq (``DISABLE_CUDA=1 pip
install hqq``) where installed, and the ManthanQuant scheme on every past token.

    python benchmarks/quality.py                                   # presets + methods + peers
    python benchmarks/quality.py --max-tokens 512 --seeds 2 --policy "turbo3 sink=4"
    python benchmarks/quality.py --plot docs/quality.png --json rows.json
    python benchmarks/quality.py --models default,gemma --presets-only \
        --json docs/quality_models.json --plot docs/quality_models.png  # one table, both models

With several models, each gets its table and a last one puts them side by side (presets, then
peers, then the rest); JSON rows carry their model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import torch
from bench_models import load_named
from peers import QUALITY_PEERS, peer_available, peer_cache, peer_label

from kvtool.evaluate import read_text, run_with_past
from kvtool.evaluate_grid import (
    DEFAULT_SEEDS,
    DEFAULT_TEXTS,
    Sweep,
    aggregate,
    format_table,
    load_baselines,
    seed_list,
    sweep,
)
from kvtool.policy import CodecPolicy

# methods tried for issue 13 (presets are added in front); add more with --policy
from kvtool.presets import PRESETS

# methods tried for issue 13 (presets are added in front); add more with --policy
METHODS = [
    "turbo3 sink=4",
    "k=turbo3:center=true v=turbo3 sink=4",
    "k=turbomix:center=true,candidates=4 v=turbomix:candidates=4 sink=4",
    "k=turbo3:center=true v=turbo3 sink=auto",
    "k=turbomix:center=true,outliers=16 v=turbo3 sink=4",
    "k=turbomix:bits=2,outliers=32,outlier_bits=4,center=true v=turbo2 sink=4",
    "k=turbo4:center=true v=turbo2 sink=4",
    "k=turbo4:center=true v=turbo3 sink=4",
    "k=turbomix:bits=2,outliers=16,outlier_bits=3,center=true v=turbo2 sink=4",
]


def peer_sweep(loaded, baselines, backend: str, nbits: int) -> Sweep | None:
    """A peer (:data:`peers.QUALITY_PEERS`) on every text; None where it is not installed."""
    if not peer_available(backend):
        return None
    runs = []
    for name, base in baselines.items():
        past, bits = peer_cache(loaded.model.config, backend, nbits)
        ppl, kl, _ = run_with_past(loaded.model, base, past)
        runs.append({"text": name, "seed": None, "delta_ppl_pct": 100 * (ppl / base.ppl - 1),
                     "kl": kl, "bits_per_element": bits})
    mean, spread, std = aggregate(runs)
    return Sweep(peer_label(backend, nbits), {}, runs, mean, spread, std)


def plot(per_model: dict[str, list[Sweep]], path: str, names: dict[str, str],
         max_bits: float = 6.0, max_delta_ppl: float = 5.0) -> None:
    """Per model, Δppl and KL against bits/element, mean with min–max bars, one point per
    policy. Lossless policies (KL 0) and points beyond ``max_bits`` are left out; a Δppl above
    ``max_delta_ppl`` is drawn at the top edge with its value written next to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "osD^vP*Xh<>p"
    rows = len(per_model)
    fig, grid = plt.subplots(rows, 2, figsize=(13, 3.3 + 3.3 * rows), squeeze=False)
    legend: dict[str, Any] = {}
    for axes, (model, sweeps) in zip(grid, per_model.items(), strict=True):
        shown = [s for s in sweeps if s.mean.get("kl", 0) > 0
                 and s.mean["bits_per_element"] <= max_bits]
        clipped = 0
        for ax, metric, title in ((axes[0], "kl", "mean next-token KL (nats, log)"),
                                  (axes[1], "delta_ppl_pct", "Δ perplexity (%)")):
            for s in shown:
                label = _short(names.get(s.label, s.label))
                i = list(legend).index(label) if label in legend else len(legend)
                values = [r[metric] for r in s.runs]
                x, y = s.mean["bits_per_element"], s.mean[metric]
                color = "black" if "peer" in label else plt.cm.tab20(i % 20)
                marker = "s" if label.startswith("preset") else markers[i % len(markers)]
                if metric == "delta_ppl_pct" and y > max_delta_ppl:
                    handle, = ax.plot(x, max_delta_ppl, marker="^", color=color)
                    ax.annotate(f"{y:+.0f}%", (x, max_delta_ppl), textcoords="offset points",
                                xytext=(6, -4 - 9 * clipped), fontsize=7)
                    clipped += 1
                else:
                    handle = ax.errorbar(x, y, yerr=[[y - min(values)], [max(values) - y]],
                                         fmt=marker, capsize=3, color=color,
                                         markersize=8 if label.startswith("preset") else 6)
                legend.setdefault(label, handle)
            ax.set_xlabel("bits / element")
            ax.set_ylabel(title)
            ax.grid(alpha=0.3)
            if metric == "kl":
                ax.set_yscale("log")
            else:
                ax.set_ylim(top=max_delta_ppl * 1.05)
        axes[0].set_title(f"{model}: KL, mean and min–max over seeds × texts", fontsize=9)
        axes[1].set_title(f"{model}: Δppl, mean and min–max over seeds × texts", fontsize=9)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=2, fontsize=7,
               frameon=False)
    fig.tight_layout(rect=(0, min(0.45, 0.018 * (len(legend) + 2) / rows), 1, 1))
    fig.savefig(path, dpi=110)


def _short(label: str, width: int = 90) -> str:
    """A legend entry: ``preset NAME`` for the presets, other labels cut to ``width``."""
    if label.startswith("preset "):
        return label.split(":")[0]
    return label if len(label) <= width else label[:width - 1] + "…"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", action="append", default=None,
                    help="text file (repeatable; default: the two bundled texts)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=len(DEFAULT_SEEDS),
                    help="rotation seeds per text (default 3)")
    ap.add_argument("--seed-list", default=None, metavar="S1,S2,...",
                    help="these rotation seeds instead (e.g. 3,4,5: a second draw of three)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", "--model", default="default",
                    help="comma list: default (SmolLM2-135M-Instruct), gemma (Gemma 3 270M) or "
                         "model paths; several: one table across them at the end")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--policy", action="append", default=None,
                    help="policy label or preset (repeatable; default: presets + methods)")
    ap.add_argument("--presets-only", action="store_true",
                    help="the presets (and peers), not the methods")
    ap.add_argument("--no-peers", action="store_true", help="skip the peer rows")
    ap.add_argument("--peers-only", action="store_true", help="only the peer rows")
    ap.add_argument("--peer", action="append", default=None, metavar="BACKEND",
                    help="only these peers (repeatable: quanto, hqq, manthanquant)")
    ap.add_argument("--json", default=None, help="also write every run to this JSON file")
    ap.add_argument("--plot", default=None, help="draw Δppl and KL against bits to this PNG")
    ap.add_argument("--from-json", action="append", default=None, metavar="FILE",
                    help="no runs: print the tables (and --plot) of earlier --json files")
    args = ap.parse_args()
    if args.from_json:
        report(load_sweeps(args.from_json), args)
        return
    torch.set_num_threads(args.threads)
    per_model = {}
    for name in args.models.split(","):
        loaded = load_named(name.strip(), dtype=args.dtype)
        per_model[loaded.name] = measure(loaded, args)
    report(per_model, args)


def measure(loaded: Any, args: argparse.Namespace) -> list[Sweep]:
    """Every policy's (and peer's) sweep on one model, each printed as it ends."""
    texts = ({p: read_text(p) for p in args.text} if args.text
             else {name: None for name in DEFAULT_TEXTS})
    start = time.perf_counter()
    baselines = load_baselines(loaded, texts, chunk=args.chunk, max_tokens=args.max_tokens)
    seeds = (tuple(int(x) for x in args.seed_list.split(",")) if args.seed_list
             else seed_list(args.seeds))
    print(f"# {loaded.name} ({args.dtype}), texts "
          + ", ".join(f"{n} ({b.ids.shape[1]} tok, ppl {b.ppl:.3f})" for n, b in baselines.items())
          + f", chunks of {args.chunk}, runtime block {args.block_size}, seeds {list(seeds)} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    labels = args.policy if args.policy is not None \
        else [*PRESETS] if args.presets_only else [*PRESETS, *METHODS]
    if args.peers_only:
        labels = []
    preset_labels = {CodecPolicy.from_label(PRESETS[p][0]).describe() for p in PRESETS}
    labels = [x for x in labels if x in PRESETS
              or CodecPolicy.from_label(x).describe() not in preset_labels]  # measured once
    sweeps, names = [], {}
    for label in labels:
        policy = CodecPolicy.from_label(label)
        t = time.perf_counter()
        s = sweep(loaded, policy, baselines, seeds, block_size=args.block_size)
        if label in PRESETS:
            names[s.label] = f"preset {label}: {s.label}"
        sweeps.append(s)
        print(f"{names.get(s.label, s.label):<58} bits {s.mean['bits_per_element']:.3f}  "
              f"KL {s.mean['kl']:.5f} ± {s.spread['kl']:.5f}  Δppl {s.mean['delta_ppl_pct']:+.3f}"
              f"% ± {s.spread['delta_ppl_pct']:.3f}  ({time.perf_counter() - t:.0f} s)",
              flush=True)
    if not args.no_peers:
        for backend, nbits in QUALITY_PEERS:
            if args.peer and backend not in args.peer:
                continue
            try:
                s = peer_sweep(loaded, baselines, backend, nbits)
            except Exception as e:  # a peer that fails here is reported, not fatal
                print(f"peer {backend}-{nbits}: failed ({type(e).__name__}: {e})")
                continue
            if s is not None:
                sweeps.append(s)
                print(f"{s.label:<58} KL {s.mean['kl']:.5f}  Δppl "
                      f"{s.mean['delta_ppl_pct']:+.3f}%", flush=True)
    return sweeps


def preset_names(sweeps: list[Sweep]) -> dict[str, str]:
    """Sweep label → "preset NAME: label" for the policies the presets name."""
    by_label = {CodecPolicy.from_label(label).describe(): name
                for name, (label, _) in PRESETS.items()}
    return {s.label: f"preset {by_label[s.label]}: {s.label}" for s in sweeps
            if s.label in by_label}


def load_sweeps(paths: list[str]) -> dict[str, list[Sweep]]:
    """The sweeps of earlier ``--json`` files per model (rows without a model: the file's
    name; a policy measured twice on a model: its first run)."""
    per_model: dict[str, dict[str, Sweep]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for row in json.load(f):
                model = row.get("model") or os.path.basename(path)
                per_model.setdefault(model, {}).setdefault(row["label"], Sweep(
                    row["label"], row["policy"], row["runs"], row["mean"], row["spread"],
                    row["std"]))
    return {m: list(s.values()) for m, s in per_model.items()}


def cross_table(per_model: dict[str, list[Sweep]], names: dict[str, str]) -> str:
    """One row per preset and peer (then the other policies), per model its bits, mean KL ±
    spread and mean Δppl; "—" where the policy did not run on that model."""
    models = list(per_model)
    by_model = {m: {s.label: s for s in sweeps} for m, sweeps in per_model.items()}
    order: list[str] = []
    for sweeps in per_model.values():
        order += [s.label for s in sweeps if s.label not in order]
    rank = {label: (0 if label in names else 1 if label.startswith("peer") else 2, i)
            for i, label in enumerate(order)}
    head = f"{'policy':<40}" + "".join(f" | {m[:33]:^33}" for m in models)
    sub = f"{'':<40}" + f" | {'bits':>5} {'KL mean ± sprd':>16} {'Δppl%':>8}" * len(models)
    lines = [head, sub]
    for label in sorted(order, key=rank.__getitem__):
        name = _short(names.get(label, label), 40)
        cells = []
        for m in models:
            s = by_model[m].get(label)
            cells.append(f"{'—':>32}" if s is None else
                         f"{s.mean['bits_per_element']:>5.2f} {s.mean['kl']:>8.5f} ± "
                         f"{s.spread['kl']:<6.4f} {s.mean['delta_ppl_pct']:>+8.2f}")
        lines.append(f"{name[:40]:<40}" + "".join(f" | {c}" for c in cells))
    return "\n".join(lines)


def report(per_model: dict[str, list[Sweep]], args: argparse.Namespace) -> None:
    names = preset_names([s for sweeps in per_model.values() for s in sweeps])
    for model, sweeps in per_model.items():
        print(f"\n# {model}: ranked by mean next-token KL; spread = max − min over seeds × "
              "texts; seed sprd = Δppl max − min over seeds, mean over texts")
        print(format_table(sweeps, names))
    if len(per_model) > 1:
        print("\n# across models: mean over seeds × texts (KL spread = max − min)")
        print(cross_table(per_model, names))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"model": m, **s.to_json()} for m, sweeps in per_model.items()
                       for s in sweeps], f, indent=2,
                      default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    if args.plot:
        plot(per_model, args.plot, names)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
