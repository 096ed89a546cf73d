"""Generate the golden .kvz files under tests/golden/ and their expected decoded statistics.

Golden files are committed and must load forever; run this only on purpose::

    python tests/make_golden.py --regenerate            # every golden
    python tests/make_golden.py --regenerate --only codec-int8 zstd

Without ``--regenerate`` it writes nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
EXPECTED = GOLDEN_DIR / "expected.json"
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def golden_cache(layers: int = 3, dtype: str = "float16", quantized: bool = False,
                 tokens: int = 12, window: int | None = None, sequence: int | None = None):
    """The deterministic synthetic cache every golden file encodes (2 heads, 12 tokens, D=32);
    ``window``: every layer a sliding-window one, holding the last ``tokens`` of ``sequence``."""
    from kvtool.cache import KVCache

    rng = np.random.default_rng(20240607)
    heads, dim = 2, 32
    keys, values = [], []
    for _ in range(layers):
        offsets = rng.normal(0.0, 2.0, size=(heads, 1, dim))
        k = rng.standard_normal((heads, tokens, dim)) + offsets
        v = rng.standard_normal((heads, tokens, dim))
        if quantized:  # few distinct values: zstd has something to find
            k, v = np.round(k * 4) / 4, np.round(v * 4) / 4
        keys.append(k.astype(NP_DTYPES[dtype]))
        values.append(v.astype(NP_DTYPES[dtype]))
    model = {"name": "golden-synthetic", "architecture": "LlamaForCausalLM",
             "fingerprint": "0123456789abcdef"}
    return KVCache(keys, values, token_ids=np.arange(100, 100 + (sequence or tokens)),
                   model=model, tokenizer_fingerprint="fedcba9876543210",
                   layer_info=[{"sliding_window": window}] * layers)


def goldens() -> dict[str, dict[str, Any]]:
    """name → how it is made: cache options and save() options."""
    from kvtool.codecs import list_codecs
    from kvtool.codecs.registry import BUILTIN_CODECS

    specs: dict[str, dict[str, Any]] = {}
    for codec_id in list_codecs():
        if codec_id in BUILTIN_CODECS:
            specs[f"codec-{codec_id}"] = {"cache": {}, "save": {"codec": codec_id}}
    specs["zstd"] = {"cache": {"dtype": "bfloat16", "quantized": True},
                     "save": {"codec": "raw", "zstd": True}}
    # rANS-coded tensors (format.md 6.2): enough tokens that coding beats fixed-width codes
    specs["entropy"] = {"cache": {"layers": 1, "tokens": 192},
                        "save": {"codec": "turbo3", "sink_tokens": 2, "entropy": True}}
    # turbomix's options that add arrays: 2-D codebooks, uint8 norms, outliers, candidates
    specs["turbomix-options"] = {
        "cache": {}, "save": {"key_codec": "turbomix:center=true,outliers=8,candidates=3,vq=2,"
                                           "norm_bits=8",
                              "value_codec": "turbomix:vq=2,norm_bits=8", "sink_tokens": 1}}
    # trellis-coded quantisation: codes whose meaning depends on the trellis tables
    specs["turbomix-trellis"] = {
        "cache": {}, "save": {"key_codec": "turbomix:center=true,outliers=8,candidates=2,"
                                           "trellis=true,norm_bits=8",
                              "value_codec": "turbomix:bits=2,trellis=true", "sink_tokens": 1}}
    # outlier counts per share of head_dim (outliers_per): 8 of 32 key channels, 24 of values
    specs["turbomix-outliers-per"] = {
        "cache": {}, "save": {"key_codec": "turbomix:outliers=4,outliers_per=16,center=true",
                              "value_codec": "turbomix:bits=2,outliers=12,outliers_per=16,"
                                             "outlier_bits=3,trellis=true", "sink_tokens": 1}}
    specs["policy"] = {"cache": {"layers": 4},
                       "save": {"key_codec": "turbo4", "value_codec": "turbo3",
                                "protect_layers": 1, "sink_tokens": 2, "recent_tokens": 3}}
    # per-layer codecs (header key layer_policy, format.md 3.1): a lossless layer, own codecs
    specs["layer-policy"] = {"cache": {"layers": 4}, "save": {"policy": {
        "key": "turbo3", "value": "turbo2", "sink_tokens": 1, "num_layers": 4,
        "layers": {"0": "lossless", "2": {"key": "turbo4"},
                   "3": {"key": "turbomix:bits=2,center=true", "value": "turbo4"}}}}}
    # every layer sliding (Mistral-7B-v0.1): num_tokens is the sequence's, past every layer
    specs["every-layer-sliding"] = {"cache": {"window": 13, "sequence": 20},
                                    "save": {"codec": "turbo3", "sink_tokens": 1}}
    return specs


def array_stats(x: np.ndarray) -> dict[str, Any]:
    """What the golden test compares: exact hash plus tolerant statistics."""
    x32 = np.asarray(x, dtype=np.float32)
    return {
        "shape": list(x.shape),
        "dtype": str(x.dtype),
        "sha256": hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest(),
        "sum": float(x32.astype(np.float64).sum()),
        "sumsq": float((x32.astype(np.float64) ** 2).sum()),
        "head": [float(v) for v in x32.reshape(-1)[:8]],
    }


def cache_stats(cache) -> dict[str, Any]:
    return {
        "num_layers": cache.num_layers,
        "num_tokens": cache.num_tokens,
        "token_ids": [int(t) for t in cache.token_ids],
        "model": cache.model,
        "tokenizer_fingerprint": cache.tokenizer_fingerprint,
        "layers": [{"key": array_stats(k), "value": array_stats(v)}
                   for k, v in zip(cache.keys, cache.values, strict=True)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regenerate", action="store_true",
                        help="Really (re)write golden files (they must otherwise never change).")
    parser.add_argument("--only", nargs="*", default=None, help="Golden names to write.")
    args = parser.parse_args(argv)
    if not args.regenerate:
        parser.print_help()
        print("\nrefusing to write without --regenerate", file=sys.stderr)
        return 2
    from kvtool.formats import load, save

    GOLDEN_DIR.mkdir(exist_ok=True)
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    for name, spec in goldens().items():
        if args.only is not None and name not in args.only:
            continue
        path = GOLDEN_DIR / f"{name}.kvz"
        options = dict(spec["save"])
        if "policy" in options:  # a policy's JSON (expected.json records it as such)
            from kvtool.policy import CodecPolicy

            options["policy"] = CodecPolicy.from_json(options["policy"])
        report = save(golden_cache(**spec["cache"]), path, **options)
        expected[name] = {"file": path.name, **spec, **cache_stats(load(path))}
        print(f"{path.name:<20} {report['file_bytes']:>7} bytes  ratio {report['ratio']:.2f}")
    EXPECTED.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
