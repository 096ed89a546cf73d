"""Every config Triton's autotuner timed for kvtool's kernels, per kernel and key, from the
results it keeps on disk (``cache_results``: ``<cache dir>/<hash>/<kernel>.autotune.json``).

A GPU run keeps one config per key; this prints what it chose from: each config's median time
and its ratio to the best, so a lent GPU's session leaves the whole spread of row blocks,
warps and pipelining behind, not only the winners (``scripts/gpu_session.sh`` runs it last).
Key values are named after the kernel's autotune key (the tensor arguments' dtypes follow it);
a kernel name two modules share is told apart by its configs' parameters.

    python benchmarks/autotune_table.py                        # Triton's cache directory
    python benchmarks/autotune_table.py --cache DIR --json autotune.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--cache", help="Triton cache directory (default: Triton's, "
                                   "TRITON_CACHE_DIR or ~/.triton/cache)")
    p.add_argument("--json", help="write the results here too")
    return p.parse_args(argv)


def default_cache() -> Path:
    """Where Triton keeps its cache in this environment."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def key_names() -> dict[tuple[str, frozenset[str]], list[str]]:
    """(kernel name, its configs' parameter names) → its autotune key, for kvtool's kernels."""
    import triton

    from kvtool.kernels import (
        triton_attention,
        triton_attention_parts,
        triton_cuda,
        triton_turbomix,
    )

    names = {}
    for module in (triton_cuda, triton_attention, triton_attention_parts, triton_turbomix):
        for value in vars(module).values():
            if isinstance(value, triton.runtime.Autotuner):
                params = frozenset(value.configs[0].kwargs)
                names[(value.fn.__name__, params)] = list(value.keys)
    return names


def _median(timing: Any) -> float | None:
    """The autotuner's timing of a config (ms, or [median, p20, p80] ms) in ms; None where it
    did not run (Triton times a config that fails to compile or launch as inf)."""
    value = float(timing[0] if isinstance(timing, list) else timing)
    return value if math.isfinite(value) else None


def load(cache: Path, names: dict[tuple[str, frozenset[str]], list[str]]) -> list[dict]:
    """One entry per kernel and key: ``kernel``, ``key`` (named), ``configs`` (fastest first:
    ``config``, ``ms``, ``ratio`` to the best; None for configs that did not run)."""
    entries = []
    for path in sorted(cache.glob("*/*.autotune.json")):
        kernel = path.name.removesuffix(".autotune.json")
        data = json.loads(path.read_text())
        timed = [(c, _median(t)) for c, t in data["configs_timings"]]
        if not timed:
            continue
        params = frozenset(timed[0][0].get("kwargs", {}))
        keys = names.get((kernel, params), [])
        values = list(data["key"])
        named = [f"{k}={v}" for k, v in zip(keys, values, strict=False)]
        dtypes = list(dict.fromkeys(str(v).removeprefix("torch.") for v in values[len(keys):]))
        key = " ".join(named + ([f"dtypes={','.join(dtypes)}"] if dtypes else []))
        ran = [ms for _, ms in timed if ms is not None]
        best = min(ran, default=None)
        configs = [{"config": describe(c), "ms": ms,
                    "ratio": ms / best if ms is not None and best else None}
                   for c, ms in sorted(timed, key=lambda item: math.inf if item[1] is None
                                       else item[1])]
        entries.append({"kernel": kernel, "key": key, "configs": configs})
    return sorted(entries, key=lambda e: (e["kernel"], e["key"]))


def describe(config: dict) -> str:
    """A config as ``BLOCK_M=64 w4 s1``."""
    kwargs = " ".join(f"{k}={v}" for k, v in config.get("kwargs", {}).items())
    return f"{kwargs} w{config.get('num_warps')} s{config.get('num_stages')}".strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache = Path(args.cache) if args.cache else default_cache()
    entries = load(cache, key_names())
    print(f"autotune results in {cache}: {len(entries)} kernel keys")
    for entry in entries:
        print(f"\n{entry['kernel']}  {entry['key']}")
        for row in entry["configs"]:
            ms = "failed" if row["ms"] is None else f"{row['ms']:.4f}"
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            print(f"  {row['config']:<32} {ms:>10} ms  {ratio:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(entries, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
