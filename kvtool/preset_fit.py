"""Presets resolved per model: a preset is a bit budget and a short menu of measured policies.

The presets were tuned on SmolLM2-135M (head_dim 64, 3 KV heads). On Gemma 3 270M (head_dim
256, one KV head serving four query heads) `quality` lost 2.5x more next-token KL than there
and missed its target; a policy with outlier channels at more bits met it within the same
budget (README, "Presets fitted per model"). So each preset names a budget (:data:`BUDGETS`,
bits/element of the whole cache, exact sinks included) and a menu (:data:`MENUS`, the fixed
preset first). :func:`fit_preset` measures every menu policy that fits the budget at this
model's head_dim, as ``benchmarks/quality.py`` does (mean next-token KL over texts × rotation
seeds), and keeps the least-KL one; :func:`save_fit` records it per model fingerprint (the
fields that decide the KV layout) in ``cache_dir()/presets``, and :func:`fitted_label` gives it
back to every command that takes ``--preset`` for that model. kvtool ships the fits it measured
for the bundled models (``kvtool/data/preset-fits-*.json``: Gemma 3 270M's three); a
user's own fit comes first. Without a fit, a preset is its fixed policy, as before.

A fit file names a menu entry, never a policy of its own: a file naming anything else, or
damaged, is ignored with a warning (the fixed preset is used), so a crafted cache file cannot
slip an arbitrary codec under a preset's name.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtool.codecs.turbo import DEFAULT_SEED
from kvtool.errors import KvtoolError
from kvtool.policy import CodecPolicy
from kvtool.presets import PRESETS

log = logging.getLogger("kvtool")

FIT_VERSION = 1
#: bits/element each preset may spend, over a cache of BUDGET_TOKENS tokens (exact sinks
#: included), whatever the calibration text's length
BUDGETS: dict[str, float] = {"quality": 4.0, "balanced": 3.3, "small": 2.6}
BUDGET_TOKENS = 2048
#: each preset's menu: its fixed policy first (what a model without a fit gets), then the
#: alternatives measured best at that budget on the bundled models
MENUS: dict[str, tuple[str, ...]] = {
    "quality": (
        PRESETS["quality"][0],
        # key outliers at 6 bits, value outliers at 4, uint8 norms: Gemma 3.96 b, KL 0.0027,
        # Δppl +0.08% (2048 tokens × 2 texts × 3 seeds; the fixed preset: KL 0.0103)
        "k=turbomix:bits=4,outliers=16,outliers_per=64,outlier_bits=6,center=true,"
        "candidates=4,norm_bits=8 v=turbomix:outliers=16,outliers_per=64,candidates=4,"
        "norm_bits=8 sink=4",
        # key outliers at 5 bits, value outliers at 4, uint8 norms: Gemma 3.84 b, KL 0.0033
        "k=turbomix:bits=4,outliers=16,outliers_per=64,outlier_bits=5,center=true,"
        "candidates=4,norm_bits=8 v=turbomix:outliers=16,outliers_per=64,candidates=4,"
        "norm_bits=8 sink=4",
        # key outliers only: Gemma 3.74 b, KL 0.0033 (1024 tokens × 2 texts × 2 seeds)
        "k=turbomix:bits=4,outliers=16,outliers_per=64,outlier_bits=5,center=true,"
        "candidates=4 v=turbomix:candidates=4 sink=4",
    ),
    "balanced": (
        PRESETS["balanced"][0],
        # 8 key outliers per 64 channels, 3-bit values: SmolLM2 3.28 b, KL 0.0031 (with one
        # rotation 0.0037, where the preset's policy loses 4%: so it keeps four candidates,
        # picked by the scalar codebook since 2026-11-30: one trellis search, not four)
        "k=turbomix:outliers=8,outliers_per=64,center=true,candidates=4,select=scalar,"
        "trellis=true,norm_bits=8 v=turbomix:candidates=4,select=scalar,trellis=true,"
        "norm_bits=8 sink=4",
        # 32 key outliers per 64 channels, four rotations: for keys with many loud channels
        # (Gemma 3 270M: 3.27 b, KL 0.0070 against the fixed preset's 0.0082, 2048 tokens ×
        # 2 texts × 3 seeds; over the budget at head_dim 64)
        "k=turbomix:outliers=32,outliers_per=64,center=true,candidates=4,select=scalar,"
        "trellis=true,norm_bits=8 v=turbomix:bits=2,outliers=48,outliers_per=64,outlier_bits=3,"
        "candidates=4,select=scalar,trellis=true,norm_bits=8 sink=4",
    ),
    "small": (
        PRESETS["small"][0],
        # the 2-D codebook instead of the trellis: SmolLM2 2.53 b, KL 0.0151
        "k=turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=3,center=true,"
        "candidates=4,vq=2 v=turbomix:bits=2,candidates=4,vq=2 sink=4",
        # key outliers at 4 bits, and 16 value outliers per 64 at 3: Gemma 3 270M 2.58 b
        # (fp32 sinks), KL 0.0182 against the fixed preset's 0.0312 (2048 tokens × 2 texts ×
        # 3 seeds); over the budget at head_dim 64
        "k=turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=4,center=true,"
        "candidates=4,select=scalar,trellis=true v=turbomix:bits=2,outliers=16,outliers_per=64,"
        "outlier_bits=3,candidates=4,select=scalar,trellis=true sink=4",
        # key outliers at 4 bits only: Gemma 2.43 b, KL 0.0200
        "k=turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=4,center=true,"
        "candidates=4,select=scalar,trellis=true v=turbomix:bits=2,candidates=4,select=scalar,"
        "trellis=true sink=4",
    ),
}
MIN_TOKENS = 96  # the fewest a fit measures anything with (presets: 4 sinks)
DEFAULT_TOKENS = 1024  # tokens of each calibration text
DEFAULT_SEEDS = (DEFAULT_SEED, 1)  # rotation seeds per text (evaluate_grid's first two)


@dataclass
class Fit:
    """A preset fitted to one model: the chosen menu policy and every candidate's numbers."""

    preset: str
    label: str
    bits: float
    kl: float
    delta_ppl_pct: float
    model: str
    fingerprint: str
    tokens: int
    texts: list[str]
    seeds: list[int]
    seconds: float
    candidates: list[dict[str, Any]] = field(default_factory=list)
    weights: str | None = None  # the fitted checkpoint's (a layout's fits are shared)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def menu_policies(name: str) -> list[CodecPolicy]:
    """The menu of preset ``name`` as policies (the fixed preset first)."""
    if name not in MENUS:
        raise KvtoolError(f"preset {name!r} has no budget to fit; choose one of "
                          f"{', '.join(MENUS)}")
    return [CodecPolicy.from_label(label) for label in MENUS[name]]


def expected_bits(policy: CodecPolicy, head_dim: int, tokens: int) -> float:
    """Mean bits/element of a ``tokens``-long cache at ``head_dim``: keys and values at their
    codecs' rate, the policy's sink tokens exact (16 bits)."""
    coded = (policy.key.bits_per_element(head_dim) + policy.value.bits_per_element(head_dim)) / 2
    sinks = min(policy.sink_tokens, tokens)
    return (coded * (tokens - sinks) + 16 * sinks) / tokens


def check_fit_tokens(tokens: int) -> None:
    """Refuse a fit over fewer than :data:`MIN_TOKENS` tokens: its later chunks must attend to
    encoded 64-token blocks."""
    if tokens < MIN_TOKENS:
        raise KvtoolError(f"--tokens {tokens}: a fit measures chunks that attend to encoded "
                          f"blocks of 64 tokens; give --tokens {MIN_TOKENS} or more")


def fit_preset(loaded: Any, name: str, *, texts: dict[str, str | None] | None = None,
               tokens: int = DEFAULT_TOKENS, seeds: Sequence[int] = DEFAULT_SEEDS,
               on_run: Callable[[dict[str, Any]], None] | None = None) -> Fit:
    """Measure ``name``'s menu on ``loaded`` and choose the least mean KL within the budget;
    the fixed preset (first) stays unless that policy beats it in every paired run."""
    from kvtool.evaluate import data_text
    from kvtool.evaluate_grid import DEFAULT_TEXTS, load_baselines, sweep
    from kvtool.identity import kv_layout

    budget, start = BUDGETS.get(name), time.perf_counter()
    policies = menu_policies(name)
    check_fit_tokens(tokens)
    head_dim = int(kv_layout(loaded.model.config)["head_dim"])
    texts = texts or {text_name: None for text_name in DEFAULT_TEXTS}
    # a text shorter than ``tokens`` is measured whole, in chunks of its own length
    measured = min([tokens] + [len(loaded.tokenizer(data_text(key) if text is None
                                                     else text).input_ids)
                               for key, text in texts.items()])
    if measured < MIN_TOKENS:
        raise KvtoolError(f"the calibration text has {measured} tokens: a fit measures chunks "
                          f"that attend to encoded blocks of 64 tokens; give a text of "
                          f"{MIN_TOKENS} tokens or more")
    # chunks of at most a quarter of the text: all but the first run on the compressed past
    baselines = load_baselines(loaded, texts, max_tokens=tokens,
                               chunk=max(16, min(256, measured // 4)))
    rows: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {}  # label: its sweep's runs
    for policy in policies:
        bits = round(expected_bits(policy, head_dim, BUDGET_TOKENS), 4)
        row: dict[str, Any] = {"label": policy.describe(), "bits": bits}
        if bits > budget:
            row["skipped"] = (f"{bits:.3f} b > {budget} b at head_dim {head_dim}, "
                              f"{BUDGET_TOKENS} tokens")
        else:
            s = sweep(loaded, policy, baselines, tuple(seeds), on_run=on_run)
            runs[row["label"]] = s.runs
            row.update(kl=s.mean["kl"], kl_spread=s.spread["kl"],
                       delta_ppl_pct=s.mean["delta_ppl_pct"],
                       measured_bits=s.mean["bits_per_element"])
        rows.append(row)
    fitting = [r for r in rows if "skipped" not in r and not math.isnan(r["kl"])]
    if not fitting:
        raise KvtoolError(f"no {name} policy fits {budget} bits/element on {loaded.name}")
    best = min(fitting, key=lambda r: r["kl"])  # ties: the earlier (the fixed preset first)
    fixed = rows[0]
    if best is not fixed and fixed in fitting and not _wins_every_run(runs[best["label"]],
                                                                      runs[fixed["label"]]):
        best["not_chosen"] = ("a lower mean KL, but not in every paired run of two or more "
                              "(text, seed): the fixed preset is kept")
        best = fixed
    return Fit(name, best["label"], best["bits"], best["kl"], best["delta_ppl_pct"],
               loaded.name, str(loaded.fingerprints.get("model", "")),
               int(next(iter(baselines.values())).ids.shape[1]), list(baselines),
               [int(s) for s in seeds], round(time.perf_counter() - start, 2), rows,
               (getattr(loaded, "info", None) or {}).get("weights"))


def _wins_every_run(runs: list[dict[str, Any]], against: list[dict[str, Any]]) -> bool:
    """Whether ``runs`` have a lower KL than ``against`` in each of two or more runs paired by
    text and seed: a lower mean over fewer, or with a loss, can be noise (a sign test)."""
    theirs = {(r["text"], r["seed"]): r["kl"] for r in against}
    pairs = [(r["kl"], theirs.get((r["text"], r["seed"]))) for r in runs]
    return len(pairs) >= 2 and all(b is not None and a < b for a, b in pairs)


def fits_path(fingerprint: str) -> Path:
    """The file of every preset fitted to the model with this fingerprint: in
    ``$KVTOOL_PRESET_FITS_DIR``, else ``cache_dir()/presets``."""
    from kvtool.models import cache_dir

    folder = os.environ.get("KVTOOL_PRESET_FITS_DIR")
    base = Path(folder).expanduser() if folder else cache_dir() / "presets"
    return base / f"{str(fingerprint)[:32]}.json"


def _read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("version") != FIT_VERSION \
            or not isinstance(data.get("presets"), dict):
        raise ValueError("not a kvtool preset-fit file of this version")
    return data


def save_fit(fit: Fit) -> Path:
    """Record ``fit`` beside the model's other fitted presets (atomically)."""
    from kvtool.fileio import atomic_write

    path = fits_path(fit.fingerprint)
    try:
        data = _read(path) if path.is_file() else None
    except (OSError, ValueError):
        data = None  # a damaged file is replaced
    data = data or {"version": FIT_VERSION, "fingerprint": fit.fingerprint, "presets": {}}
    data["model"] = fit.model
    data["presets"][fit.preset] = fit.to_json()
    blob = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(blob) or len(blob))
    return path


def shipped_path(fingerprint: str) -> Path:
    """The fits kvtool ships for a bundled model (``kvtool/data/preset-fits-<fp>.json``),
    measured with ``kvtool calibrate --preset`` and copied as written."""
    return Path(__file__).parent / "data" / f"preset-fits-{str(fingerprint)[:32]}.json"


def fitted_label(name: str, fingerprint: str | None) -> str | None:
    """The label of ``name`` fitted to the model with ``fingerprint``, or None (no fit: the
    fixed preset): see :func:`fitted_entry`."""
    entry = fitted_entry(name, fingerprint)
    return None if entry is None else entry["label"]


def fitted_entry(name: str, fingerprint: str | None) -> dict[str, Any] | None:
    """The fit of ``name`` to the model with ``fingerprint`` (its ``label`` today's menu
    policy), or None: the user's own fit (:func:`fits_path`) first, else the one kvtool ships
    for that model (:func:`shipped_path`). A fit that is damaged, for another model or not on
    the preset's menu is ignored with a warning."""
    if not fingerprint or name not in MENUS:
        return None
    for path in (fits_path(fingerprint), shipped_path(fingerprint)):
        if not path.is_file():
            continue
        try:
            data = _read(path)
            entry = data["presets"].get(name)
            if entry is None:
                continue
            if data.get("fingerprint") != fingerprint or entry.get("fingerprint") != fingerprint:
                raise ValueError("it was fitted to another model")
            menu = {_picked_alike(label): CodecPolicy.from_label(label).describe()
                    for label in MENUS[name]}
            picked = _picked_alike(str(entry.get("label")))
            if picked not in menu:
                raise ValueError(f"its {name} policy is not on the preset's menu")
            return {**entry, "label": menu[picked]}
        except (OSError, ValueError, TypeError, AttributeError, KvtoolError) as e:
            _warn_once(f"kvtool: ignoring the preset fits in {path} ({str(e)[:120]})")
    return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A damaged fit file is read by each lookup of a command (the policy, then the weights it
    was fitted on): said once a process."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _picked_alike(label: str) -> str:
    """A menu policy's label up to how its rotations are picked (``select``): a fit made before
    a menu policy took ``select=scalar`` (2026-11-30) means today's, whose files are the same
    kind and whose quality was measured alike."""
    return re.sub(r",select=[a-z]+", "", CodecPolicy.from_label(label).describe())


def format_fit(fit: Fit) -> list[str]:
    """The candidates as a table, the chosen one marked."""
    lines = [f"{'':2}{'bits/el':>8} {'KL':>9} {'Δppl%':>7}  policy  (bits/element of a "
             f"{BUDGET_TOKENS}-token cache)"]
    for r in fit.candidates:
        mark = "* " if r["label"] == fit.label else "  "
        skipped = f"  (over budget: {r['skipped']})" if "skipped" in r else ""
        if "kl" in r:
            kept = f"\n{'':28}(not chosen: {r['not_chosen']})" if "not_chosen" in r else ""
            lines.append(f"{mark}{r['bits']:>8.3f} {r['kl']:>9.5f} {r['delta_ppl_pct']:>+7.2f}  "
                         f"{r['label']}{kept}")
        else:
            lines.append(f"{mark}{r['bits']:>8.3f} {'—':>9} {'—':>7}  {r['label']}{skipped}")
    return lines
