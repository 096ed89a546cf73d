"""The named presets (``lossless``, ``quality``, ``balanced``, ``small``): the policy label each
names, what was measured for it (quality and CPU speed), and :func:`preset_policy`, which turns
a preset name (fitted to a model where ``kvtool calibrate --preset`` fitted it:
:mod:`kvtool.preset_fit`) or a policy JSON file into a :class:`~kvtool.policy.CodecPolicy`.
"""

from __future__ import annotations

import os
from typing import Any

from kvtool.errors import CodecError
from kvtool.policy import CodecPolicy
from kvtool.policy_files import load_policy

#: name → (policy label, what was measured): ``python benchmarks/quality.py``, SmolLM2-135M
#: float32, mean over 3 rotation seeds × the 2 bundled texts (2048 tokens, chunks of 256),
#: bits/element of the whole cache (4 exact sinks included). Keys get the bits; ``candidates=4``
#: (the best of 4 rotations per head and block, by reconstruction error) and ``trellis=true``
#: (trellis-coded quantisation) are the methods that won. ``balanced`` keeps one rotation: with
#: the trellis, four cost 4x the encode for ~4% less KL on both bundled models (``small``, at 2
#: bits, loses 12% without them and keeps them, picked by the scalar codebook's error:
#: ``select=scalar``, one trellis search instead of four, 2-2.6x the encode speed for the same KL
#: on SmolLM2 and +3% on Gemma 3 270M). Outlier counts are per 64 channels
#: (``outliers_per=64``): the same share of channels, so about the same bits, at every head_dim.
PRESETS: dict[str, tuple[str, str]] = {
    "lossless": ("raw", "exact"),
    "quality": ("k=turbomix:bits=4,center=true,candidates=4 v=turbomix:candidates=4 sink=4",
                "3.78 b: KL 0.0026, Δppl +0.10% (seed spread 0.22)"),
    "balanced": ("k=turbomix:outliers=16,outliers_per=64,center=true,trellis=true,norm_bits=8 "
                 "v=turbomix:bits=2,outliers=48,outliers_per=64,outlier_bits=3,trellis=true,"
                 "norm_bits=8 sink=4",
                 "3.28 b: KL 0.0031, Δppl +0.35% (seed spread 0.27)"),
    "small": ("k=turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=3,center=true,"
              "candidates=4,select=scalar,trellis=true v=turbomix:bits=2,candidates=4,"
              "select=scalar,trellis=true sink=4",
              "2.53 b: KL 0.0120, Δppl +1.24% (seed spread 0.65)"),
}


#: each preset's key/value codec speed in MB/s of fp16 input, encode and decode, measured with
#: ``benchmarks/codecs.py --vectors 262144 --repeats 5 --codecs NAME/k,NAME/v,...
#: --backends numpy+numba`` (head_dim 128, 2 threads of a 2-core AMD EPYC, compiled CPU kernels;
#: 2026-11-30, after the code tiles went 2-D; the median of three runs, memory copy at
#: 22.0-23.6 GB/s); ``kvtool codecs --presets --measure`` measures this machine
PRESET_SPEEDS: dict[str, dict[str, tuple[int, int]]] = {
    "quality": {"encode": (469, 711), "decode": (2396, 2335)},
    "balanced": {"encode": (353, 358), "decode": (1491, 1592)},
    "small": {"encode": (218, 283), "decode": (1672, 2482)},
}


def preset_policy(name: str, model_fingerprint: str | None = None) -> CodecPolicy:
    """The policy a preset names, or the one in a policy JSON file (a path ending ``.json``
    or naming an existing file). The presets' outlier counts are per 64 channels
    (``outliers_per=64``), so they keep their share at every head_dim; with
    ``model_fingerprint``, a preset fitted to that model (``kvtool calibrate --preset``) is
    its fitted policy, and a policy file calibrated for another model is refused."""
    if name in PRESETS:
        if model_fingerprint:
            from kvtool.preset_fit import fitted_label

            label = fitted_label(name, model_fingerprint)
            if label is not None:
                return CodecPolicy.from_label(label)
        return CodecPolicy.from_label(PRESETS[name][0])
    if str(name).endswith(".json") or os.path.isfile(name):
        return load_policy(name, model_fingerprint)
    if os.path.exists(name):  # a FIFO, a device: never read (/dev/zero has no end)
        raise CodecError(f"policy file {name}: not a regular file")
    raise CodecError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or give "
                     "a policy JSON file (kvtool calibrate writes one)")


def fitted_weights(name: str, model_fingerprint: str | None) -> tuple[str, str] | None:
    """(model name, weights fingerprint) that the policy ``name`` resolves to for this
    layout was fitted on, where recorded: a preset's fit, or a calibrated policy file."""
    if name in PRESETS:
        from kvtool.preset_fit import fitted_entry

        entry = fitted_entry(name, model_fingerprint) or {}
        weights = entry.get("weights")
        return (str(entry.get("model"))[:80], weights) if isinstance(weights, str) and weights \
            else None
    from kvtool.policy_files import calibrated_weights

    return calibrated_weights(name) if os.path.isfile(name) else None


def presets_table(head_dim: int = 64) -> list[dict[str, Any]]:
    """Every preset: its label, encoded bits/element at ``head_dim`` (mean of keys and values,
    sinks excluded; None, with why in ``unfit``, where its codecs cannot encode that
    head_dim) and what was measured for it."""
    rows = []
    for name, (label, measured) in PRESETS.items():
        policy = preset_policy(name)
        try:
            bits = round((policy.key.bits_per_element(head_dim)
                          + policy.value.bits_per_element(head_dim)) / 2, 4)
            unfit = None
        except CodecError as e:  # e.g. outlier channels that a head_dim of 2 cannot hold
            bits, unfit = None, str(e)
        speed = PRESET_SPEEDS.get(name, {})
        rows.append({"name": name, "label": label, "bits_per_element": bits,
                     **({"unfit": unfit} if unfit else {}), "measured": measured,
                     **{f"{op}_mbps": dict(zip(("key", "value"), mbps, strict=True))
                        for op, mbps in speed.items()}})
    return rows
