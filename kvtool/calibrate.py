"""Per-layer codec calibration (``kvtool calibrate``): measure what each layer's error costs,
then spend the bits where they buy the most.

1. A short text (default: the first :data:`DEFAULT_TOKENS` tokens of the bundled eval text)
   runs with an exact cache: the first tokens fill the cache (the *prefix*), the last
   ``scored`` tokens are scored (their next-token distributions, top-128 log-probabilities, as
   :mod:`kvtool.evaluate` measures KL).
2. For every layer, role and menu option, only that layer's keys (or values) of the prefix go
   through the option's codec (the sink tokens stay exact, as the policy keeps them); the scored
   tokens run again on that cache and the mean next-token KL(exact ‖ compressed) is recorded.
   A lossless option costs 0 by definition and is not run.
3. One option per (layer, role) is chosen to minimise the summed KL with the mean bits/element
   (``codec.bits_per_element(head_dim)``, every layer and role weighted alike) within the
   budget: a multiple-choice knapsack, solved exactly by :func:`knapsack` on a 1/64-bit grid
   (bits rounded up, so the budget always holds).

Steps 1-2 are the expensive part: their results are cached per model fingerprint, text, token
counts, sinks and menu under ``cache_dir()/calibrate``; another budget reuses them.
Summing single-layer KLs assumes the errors of different layers add up, which holds to first
order for small errors.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.codecs import Codec, codec_for_role, get_codec
from kvtool.codecs.turbomix import outlier_count
from kvtool.errors import KvtoolError
from kvtool.models import check_context_length, max_positions
from kvtool.policy import ROLES, CodecPolicy, LayerCodecs

DEFAULT_TOKENS = 512  # calibration tokens in all (prefix + scored)
DEFAULT_SCORED = 64  # the last tokens, whose next-token KL is measured
DEFAULT_SINKS = 4  # leading tokens kept exact, as the presets do
OUTLIER_FRACTION = 0.25  # ``{outliers}`` in a menu: this share of head_dim (even, >= 2)
BITS_STEP = 1 / 64  # the knapsack's grid of bits/element
LOSSLESS = "lossless"

#: option name → codec label; ``{outliers}`` becomes OUTLIER_FRACTION × head_dim channels.
#: Keys get ``center=true`` (turbomix), as in the presets. The trellis options pick their
#: rotation by the scalar codebook (``select=scalar``: one trellis search, not four; SmolLM2,
#: 3 seeds × 2 texts, KL at 3 bits with 16 outliers 0.00254 against 0.00277 for ``exact``).
DEFAULT_MENU: dict[str, str] = {
    "2b": "turbomix:bits=2,candidates=4,select=scalar,trellis=true,norm_bits=8",
    "2b+out": "turbomix:bits=2,outliers={outliers},outlier_bits=3,candidates=4,select=scalar,"
              "trellis=true,norm_bits=8",
    "3b": "turbomix:bits=3,candidates=4",
    "3b+out": "turbomix:bits=3,outliers={outliers},candidates=4,select=scalar,trellis=true,"
              "norm_bits=8",
    "4b": "turbomix:bits=4,candidates=4",
    LOSSLESS: "raw",
}


def outlier_channels(head_dim: int, fraction: float = OUTLIER_FRACTION) -> int:
    """``{outliers}`` in a menu entry: ``fraction`` of ``head_dim`` (:func:`outlier_count`)."""
    return outlier_count(head_dim, fraction)


def menu_codec(spec: str, role: str, head_dim: int) -> Codec:
    """The codec a menu entry means for ``role`` at ``head_dim``."""
    codec = codec_for_role(spec.format(outliers=outlier_channels(head_dim)), role)
    config = codec.get_config()
    if role == "key" and "center" in config and codec.codec_id == "turbomix":
        codec = get_codec({**config, "center": True})
    return codec


def knapsack(costs: Sequence[Sequence[float]], weights: Sequence[Sequence[float]],
             capacity: float, step: float = BITS_STEP) -> list[int]:
    """One item per group minimising the summed cost with the summed weight ≤ ``capacity``.

    Exact dynamic programming over weights on a grid of ``step`` (weights rounded up, the
    capacity down, so the result always fits); among equal costs, the lighter choice wins.
    Returns the chosen item index of each group.
    """
    units = [np.ceil(np.asarray(w, dtype=np.float64) / step - 1e-9).astype(np.int64)
             for w in weights]
    # a budget past the heaviest choice constrains nothing more: capped there, the table stays
    # small whatever the budget (--bits 1e9, inf)
    heaviest, budget_units = sum(int(u.max()) for u in units), capacity / step + 1e-9
    cap = heaviest if budget_units >= heaviest else int(math.floor(budget_units))
    lightest = sum(int(u.min()) for u in units)
    if lightest > cap:
        raise KvtoolError(f"a budget of {capacity / max(len(units), 1):.3f} bits/element is "
                          f"below the smallest choice ({lightest * step / len(units):.3f})")
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0  # best[c]: the least cost of the groups so far using exactly c units
    choice = np.zeros((len(units), cap + 1), dtype=np.int32)
    for g, (u, cost) in enumerate(zip(units, costs, strict=True)):
        new = np.full(cap + 1, np.inf)
        for j, (w, c) in enumerate(zip(u.tolist(), cost, strict=True)):
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[:cap + 1 - w] + float(c)
            better = cand < new
            new[better] = cand[better]
            choice[g, better] = j
        best = new
    c = int(np.argmin(best))  # lowest cost; np.argmin takes the fewest units among ties
    picked = []
    for g in range(len(units) - 1, -1, -1):
        j = int(choice[g, c])
        picked.append(j)
        c -= int(units[g][j])
    return picked[::-1]


@dataclass
class Measurements:
    """Single-layer KLs: ``kl[layer][role][option]`` (nats), ``bits[role][option]``."""

    options: list[str]
    specs: dict[str, str]
    bits: list[list[float]]
    kl: list[list[list[float]]]
    head_dim: int
    tokens: int
    scored: int
    sinks: int
    seconds: float
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("options", "specs", "bits", "kl", "head_dim",
                                              "tokens", "scored", "sinks", "seconds")}


@dataclass
class Calibration:
    policy: CodecPolicy
    measurements: Measurements
    budget: float
    rows: list[dict[str, Any]]  # per layer: key/value option, bits, measured KL

    @property
    def mean_bits(self) -> float:
        return float(np.mean([r[f"{role}_bits"] for r in self.rows for role in ROLES]))

    @property
    def predicted_kl(self) -> float:
        """Sum of the chosen options' single-layer KLs (the knapsack's objective)."""
        return float(sum(r[f"{role}_kl"] for r in self.rows for role in ROLES))

    def file_extra(self, model: str, fingerprint: str,
                   weights: str | None = None) -> dict[str, Any]:
        """What ``kvtool calibrate`` records next to the policy in its JSON file."""
        m = self.measurements
        return {"calibration": {"model": model, "fingerprint": fingerprint, "weights": weights,
                                "budget_bits": self.budget,
                                "mean_bits": round(self.mean_bits, 4),
                                "predicted_kl": self.predicted_kl, "tokens": m.tokens,
                                "scored": m.scored, "menu": m.specs, "layers": self.rows}}


def _calibration_ids(loaded: Any, text: str | None, tokens: int, scored: int, sinks: int):
    """The text's first ``tokens`` ids; refused unless the prefix before the ``scored`` ones
    holds encoded tokens beyond the ``sinks`` (else every KL is 0 and reads as lossless)."""
    from kvtool.evaluate import data_text

    ids = loaded.tokenizer(text if text is not None else data_text("eval_text.md"),
                           return_tensors="pt").input_ids[:, :tokens]
    check_context_length(ids.shape[1], max_positions(loaded.model.config), None, loaded.name,
                         "the calibration text", "give fewer --tokens")
    need = scored + max(sinks, DEFAULT_SINKS) + 4
    if scored < 1 or ids.shape[1] < need:
        raise KvtoolError(f"the calibration text has {ids.shape[1]} tokens; it needs at least "
                          f"{need} (--scored {scored}, the {sinks} sink tokens kept exact, and "
                          "a prefix to encode): give more --tokens or fewer --sink-tokens")
    return ids.to(next(loaded.model.parameters()).device)


def _cache_key(loaded: Any, ids: Any, scored: int, sinks: int, menu: dict[str, str]) -> str:
    from kvtool import __version__
    from kvtool.evaluate import KL_TOP

    data = {"model": loaded.fingerprints.get("model"), "dtype": loaded.dtype, "kl_top": KL_TOP,
            "weights": (getattr(loaded, "info", None) or {}).get("weights"),
            "tokenizer": loaded.fingerprints.get("tokenizer"), "ids": ids[0].tolist(),
            "scored": scored, "sinks": sinks, "menu": menu, "version": __version__}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _cache_path(loaded: Any, key: str):
    from kvtool.models import cache_dir

    fp = str(loaded.fingerprints.get("model", "model"))[:16]
    return cache_dir() / "calibrate" / f"{fp}-{key[:24]}.json"


def measure(loaded: Any, text: str | None = None, *, tokens: int = DEFAULT_TOKENS,
            scored: int = DEFAULT_SCORED, sinks: int = DEFAULT_SINKS,
            menu: dict[str, str] | None = None, use_cache: bool = True) -> Measurements:
    """Single-layer next-token KL of every (layer, role, menu option) (steps 1-2 above)."""
    import torch

    from kvtool.identity import kv_layout

    menu = dict(menu or DEFAULT_MENU)
    if not menu:
        raise KvtoolError("the calibration menu is empty")
    ids = _calibration_ids(loaded, text, tokens, scored, sinks)
    path = _cache_path(loaded, _cache_key(loaded, ids, scored, sinks, menu))
    layout = kv_layout(loaded.model.config)
    head_dim = int(layout["head_dim"])
    if use_cache and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            cached = Measurements(**data, cached=True)
            if _fits(cached, menu, int(layout["num_layers"]), head_dim):
                return cached
        except (OSError, ValueError, TypeError):
            pass  # a damaged cache entry is measured again (and rewritten)
    options = list(menu)
    codecs = {role: [menu_codec(menu[o], role, head_dim) for o in options] for role in ROLES}
    start = time.perf_counter()
    with torch.inference_mode():
        kl = _measure_kl(loaded.model, ids, scored, sinks, codecs)
    result = Measurements(options, menu,
                          [[c.bits_per_element(head_dim) for c in codecs[r]] for r in ROLES],
                          kl, head_dim, int(ids.shape[1]), scored, sinks,
                          round(time.perf_counter() - start, 2))
    _write_cache(path, result)
    return result


def _fits(m: Measurements, menu: dict[str, str], num_layers: int, head_dim: int) -> bool:
    """Whether cached measurements are of this menu, layer count and head_dim, every KL finite
    and >= 0 and every bits/element finite and > 0 (else they are measured again)."""
    def numbers(rows: Any, count: int) -> bool:
        return isinstance(rows, list) and len(rows) == count and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and x >= 0 for x in rows)

    n = len(menu)
    return (m.options == list(menu) and m.specs == menu and m.head_dim == head_dim
            and isinstance(m.bits, list) and len(m.bits) == len(ROLES)
            and all(numbers(b, n) and min(b, default=1) > 0 for b in m.bits)
            and isinstance(m.kl, list) and len(m.kl) == num_layers
            and all(isinstance(layer, list) and len(layer) == len(ROLES)
                    and all(numbers(role, n) for role in layer) for layer in m.kl))


def _write_cache(path: Any, result: Measurements) -> None:
    from kvtool.fileio import atomic_write

    data = json.dumps(result.to_json(), sort_keys=True).encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(data) or len(data))
    except OSError:
        pass  # a read-only cache dir only costs the next run its time


def _measure_kl(model: Any, ids: Any, scored: int, sinks: int, codecs: dict[str, list[Codec]],
                batch: int = 8) -> list[list[list[float]]]:
    """``kl[layer][role][option]``: each variant (one layer's keys or values of the prefix
    through one codec) scored in batches of ``batch`` rows, one variant per row."""
    import torch
    from transformers import DynamicCache

    from kvtool.cache import KVCache
    from kvtool.engines.hf import to_dynamic_cache
    from kvtool.engines.hf_runtime import attention_windows
    from kvtool.evaluate import _through_policy, next_token_kl, top_logp
    from kvtool.progress import bar

    prefix = int(ids.shape[1]) - scored
    attention_windows(model.config)  # a hybrid model's other layers hold no K/V
    past = DynamicCache(config=model.config)
    model(input_ids=ids[:, :prefix], past_key_values=past, use_cache=True)
    exact = {"key": [layer.keys[0].clone() for layer in past.layers],
             "value": [layer.values[0].clone() for layer in past.layers]}
    num_layers = len(exact["key"])
    prefix_ids = ids[0, :prefix].cpu().numpy()  # the positions, where every layer has slid

    def restored(replace_role: str | None = None, layer: int = 0, x_hat: Any = None):
        arrays = {r: list(exact[r]) for r in ROLES}
        if replace_role is not None:
            arrays[replace_role][layer] = x_hat
        return to_dynamic_cache(KVCache(arrays["key"], arrays["value"], token_ids=prefix_ids),
                                model)

    def scored_logp(cache: Any, rows: int):
        logits = model(input_ids=ids[:, prefix:].expand(rows, -1), past_key_values=cache,
                       use_cache=True).logits
        return torch.log_softmax(logits.float(), dim=-1)

    p_top, p_idx = top_logp(scored_logp(restored(), 1)[0])
    lossy = [j for j, c in enumerate(codecs["key"]) if c != get_codec("raw")]
    kl = [[[0.0] * len(codecs[r]) for r in ROLES] for _ in range(num_layers)]
    variants = [(r, j) for r in range(len(ROLES)) for j in lossy]
    with bar(total=num_layers * len(variants), desc="calibrating", unit="run") as pb:
        for i in range(num_layers):
            for first in range(0, len(variants), batch):
                part = variants[first:first + batch]
                layers = []
                for r, j in part:
                    role, codec = ROLES[r], codecs[ROLES[r]][j]
                    policy = CodecPolicy(key=codec, value=codec, sink_tokens=sinks)
                    x = exact[role][i]
                    x_hat = _through_policy(x, policy, role, i, num_layers)[0].to(x.dtype)
                    layers.append(restored(role, i, x_hat).layers[i])
                cache = restored()
                for n, layer in enumerate(cache.layers):  # batch rows: one variant each
                    if n == i:
                        layer.keys = torch.cat([v.keys for v in layers])
                        layer.values = torch.cat([v.values for v in layers])
                    else:
                        layer.keys = layer.keys.expand(len(part), -1, -1, -1)
                        layer.values = layer.values.expand(len(part), -1, -1, -1)
                logp = scored_logp(cache, len(part))
                for row, (r, j) in enumerate(part):
                    kl[i][r][j] = float(next_token_kl(p_top, p_idx, logp[row]).mean())
                pb.update(len(part))
    return kl


def choose(m: Measurements, budget: float, num_layers: int | None = None) -> Calibration:
    """The policy minimising the summed single-layer KL within ``budget`` bits/element."""
    _refuse_nonpositive(budget)
    layers = num_layers if num_layers is not None else len(m.kl)
    groups = [(i, r) for i in range(layers) for r in range(len(ROLES))]
    picked = knapsack([m.kl[i][r] for i, r in groups], [m.bits[r] for _, r in groups],
                      budget * len(groups))
    chosen = {g: j for g, j in zip(groups, picked, strict=True)}
    codecs = {role: [menu_codec(m.specs[o], role, m.head_dim) for o in m.options]
              for role in ROLES}
    base = [Counter(chosen[(i, r)] for i in range(layers)).most_common(1)[0][0]
            for r in range(len(ROLES))]
    own = []
    for i in range(layers):
        pair = [None if chosen[(i, r)] == base[r] else codecs[role][chosen[(i, r)]]
                for r, role in enumerate(ROLES)]
        if any(c is not None for c in pair):
            own.append((i, LayerCodecs(*pair)))
    policy = CodecPolicy(key=codecs["key"][base[0]], value=codecs["value"][base[1]],
                         sink_tokens=m.sinks, layers=tuple(own),
                         num_layers=layers if own else None)
    rows = []
    for i in range(layers):
        row: dict[str, Any] = {"layer": i}
        for r, role in enumerate(ROLES):
            j = chosen[(i, r)]
            row |= {role: m.options[j], f"{role}_bits": round(m.bits[r][j], 4),
                    f"{role}_kl": m.kl[i][r][j]}
        rows.append(row)
    return Calibration(policy, m, budget, rows)


def calibrate(loaded: Any, budget: float, text: str | None = None, **options: Any) -> Calibration:
    """Measure (or reuse cached measurements) and choose a per-layer policy for ``budget``
    (a budget no choice of the menu fits is refused before the minutes of measuring)."""
    _check_budget(loaded, budget, dict(options.get("menu") or DEFAULT_MENU))
    return choose(measure(loaded, text, **options), budget)


def _refuse_nonpositive(budget: float) -> None:
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise KvtoolError(f"--bits must be a positive number, got {budget!r}")


def _check_budget(loaded: Any, budget: float, menu: dict[str, str]) -> None:
    """:func:`choose`'s refusals that need no measurement: a budget that is not a positive
    number, or below the cheapest option of every layer and role."""
    from kvtool.identity import kv_layout

    _refuse_nonpositive(budget)
    layout = kv_layout(loaded.model.config)
    bits = [[menu_codec(spec, role, layout["head_dim"]).bits_per_element(layout["head_dim"])
             for spec in menu.values()] for role in ROLES]
    groups = layout["num_layers"] * len(ROLES)
    knapsack([[0.0] * len(menu)] * groups, [bits[g % len(ROLES)] for g in range(groups)],
             budget * groups)


def format_table(cal: Calibration) -> list[str]:
    """The table ``kvtool calibrate`` prints: per layer, the option, bits and measured KL."""
    lines = [f"{'layer':>5}  {'key':<9} {'bits':>6} {'KL':>9}   {'value':<9} {'bits':>6} "
             f"{'KL':>9}"]
    for r in cal.rows:
        lines.append(f"{r['layer']:>5}  {r['key']:<9} {r['key_bits']:>6.3f} {r['key_kl']:>9.2e}"
                     f"   {r['value']:<9} {r['value_bits']:>6.3f} {r['value_kl']:>9.2e}")
    m = cal.measurements
    lines.append(f"mean {cal.mean_bits:.3f} bits/element (budget {cal.budget:g}), summed "
                 f"single-layer KL {cal.predicted_kl:.2e} nats; measured on {m.tokens} tokens "
                 f"({m.scored} scored) in {m.seconds:.1f} s" + (" (cached)" if m.cached else ""))
    return lines
