"""A structural mutation fuzzer for .kvz files: "load raises FormatError, or returns exactly what
the writer wrote".

Each mutant is one edit that a hostile or broken tool could make to a file's structure — array
shapes, dtypes, codec configs, segment ranges, tensor references, the policy, compression flags —
with every checksum recomputed afterwards, so that only the reader's structural checks stand
between the edit and the caller. Edits of values alone (payload bytes, a seed changed
consistently everywhere) produce files a writer could have written; they are out of scope here
and are what checksums are for.

Run ``python tests/kvz_mutate.py --cases 12000`` for a long campaign with a summary table.
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import zstandard

sys.path.insert(0, os.path.dirname(__file__))

from kvz_util import read_parts, synthetic_cache  # noqa: E402

from kvtool.errors import FormatError  # noqa: E402
from kvtool.formats import constants as C  # noqa: E402
from kvtool.formats import load, open_kvz, save  # noqa: E402
from kvtool.formats.container import Blob, crc32_hex, encode_header  # noqa: E402

# every codec, zstd on and off, and mixed policies
BASES: list[tuple[str, dict[str, Any]]] = [
    *[(c, {"codec": c}) for c in ("raw", "fp8", "int8", "int4", "kivi2", "kivi4", "turbo2",
                                 "turbo3", "turbo4", "prism")],
    ("turbo3+zstd", {"codec": "turbo3", "zstd": True}),
    ("kivi4+zstd", {"codec": "kivi4", "zstd": True}),
    ("raw:fp16+zstd", {"codec": 'raw:dtype="float16"', "zstd": True}),
    ("mixed", {"key_codec": "turbo3:center=true", "value_codec": "kivi4", "sink_tokens": 2,
               "recent_tokens": 3, "protect_layers": 1}),
    ("mixed+zstd", {"key_codec": "int4:group_size=8", "value_codec": "prism", "sink_tokens": 1,
                    "zstd": True}),
    ("turbomix", {"key_codec": "turbomix:center=true,outliers=8,candidates=2,trellis=true,"
                               "norm_bits=8", "value_codec": "turbomix:vq=2,candidates=2",
                  "sink_tokens": 1}),
]
SAME_SIZE = {1: ["uint8", "int8", "bool", "float8_e4m3fn", "float8_e5m2"],
             2: ["float16", "bfloat16", "uint16", "int16"],
             4: ["float32", "int32", "uint32"], 8: ["float64", "int64", "uint64"]}
CODEC_IDS = ["raw", "fp8", "int8", "int4", "kivi2", "kivi4", "turbo2", "turbo3", "turbo4",
             "prism", "turbomix", "nosuch"]


@dataclass
class Parsed:
    """A .kvz file taken apart: metadata, kvz header and logical (decompressed) tensors."""

    metadata: dict[str, str]
    header: dict[str, Any]
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]]  # name -> (dtype, shape, logical)
    order: list[str]
    as_stored: frozenset[str] = frozenset()  # written byte for byte, whatever the header says

    def copy(self) -> Parsed:
        return Parsed(dict(self.metadata), copy.deepcopy(self.header), dict(self.tensors),
                      list(self.order), self.as_stored)


def parse(path: str) -> Parsed:
    metadata, blobs = read_parts(path)
    header = json.loads(metadata[C.META_HEADER])
    tensors = {}
    for b in blobs:
        t = header[C.H_TENSORS][b.name]
        data = bytes(b.data)
        if t.get("compression") == C.COMPRESSION_ZSTD:
            data = zstandard.ZstdDecompressor().decompress(data)
        tensors[b.name] = (t["dtype"], tuple(t["shape"]), data)
    return Parsed(metadata, header, tensors, [b.name for b in blobs])


def serialize(p: Parsed) -> bytes:
    """Rebuild the file: compress what the header says is zstd, recompute every checksum."""
    table = p.header[C.H_TENSORS]
    blobs = []
    for name in p.order:
        dtype, shape, data = p.tensors[name]
        info = table.get(name, {})
        if info.get("compression") == C.COMPRESSION_ZSTD and name not in p.as_stored:
            data = zstandard.ZstdCompressor(write_content_size=True).compress(data)
            blob = Blob(name, "U8", (len(data),), data)
        else:
            blob = Blob(name, C.DTYPE_TO_ST.get(dtype, "U8"), shape, data)
        if name in table:
            table[name]["crc32"] = crc32_hex(blob.data)
        blobs.append(blob)
    raw = json.dumps(p.header, sort_keys=True, separators=(",", ":"))
    metadata = dict(p.metadata, **{C.META_HEADER: raw,
                                   C.META_HEADER_CRC32: crc32_hex(raw.encode())})
    return encode_header(blobs, metadata) + b"".join(b.data for b in blobs)


# -- mutations -------------------------------------------------------------------------------------
def _segments(p: Parsed) -> list[tuple[int, str, int, dict[str, Any]]]:
    return [(i, r, j, seg) for i, layer in enumerate(p.header[C.H_LAYERS]) for r in C.ROLES
            for j, seg in enumerate(layer[r]["segments"])]


def _part(p: Parsed, rng: random.Random) -> str:
    names = [n for *_, seg in _segments(p) for n in seg["tensors"].values()]
    return rng.choice(names)


def _set_tensor(p: Parsed, name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> None:
    p.tensors[name] = (dtype, shape, data)
    p.header[C.H_TENSORS][name].update(dtype=dtype, shape=list(shape))


def m_shrink(p: Parsed, rng: random.Random) -> str:
    name = _part(p, rng)
    dtype, shape, data = p.tensors[name]
    choice = rng.randrange(4)
    if choice == 0 or not shape:
        new = (1,)
    elif choice == 1:
        new = shape[1:] or (1,)
    elif choice == 2:
        k = rng.randrange(len(shape))
        new = tuple(max(0, s - 1) if d == k else s for d, s in enumerate(shape))
    else:
        k = rng.randrange(len(shape))
        new = tuple(1 if d == k else s for d, s in enumerate(shape))
    n = prod(new) * C.ITEMSIZE[dtype]
    _set_tensor(p, name, dtype, new, data[:n].ljust(n, b"\0"))
    return "shrink"


def m_relabel(p: Parsed, rng: random.Random) -> str:
    name = _part(p, rng)
    dtype, shape, data = p.tensors[name]
    others = [d for d in SAME_SIZE[C.ITEMSIZE[dtype]] if d != dtype]
    _set_tensor(p, name, rng.choice(others), shape, data)
    return "dtype relabel"


def m_reshape(p: Parsed, rng: random.Random) -> str:
    name = _part(p, rng)
    dtype, shape, data = p.tensors[name]
    n = prod(shape)
    options = [(n,), (1, n), (n, 1)]
    if len(shape) >= 2:
        options.append((*shape[:-2], shape[-1], shape[-2]))
        options.append((*shape[:-2], shape[-2] * shape[-1]))
    new = rng.choice([o for o in options if o != shape] or [(1, n)])
    _set_tensor(p, name, dtype, new, data)
    return "reshape"


def _config_edit(config: dict[str, Any], rng: random.Random) -> None:
    key = rng.choice(["id", "seed", "center", "axis", "group_size", "z_bits", "r_bits",
                      "theta_bits", "dtype", "codec_version", "trellis", "norm_bits", "vq",
                      "unknown", "drop"])
    value: Any
    if key == "id":
        value = rng.choice(CODEC_IDS)
    elif key == "drop":
        others = [k for k in config if k != "id"]
        if others:
            del config[rng.choice(others)]
        return
    elif key == "unknown":
        config[rng.choice(["centre", "bits", "extra"])] = rng.choice([1, True, "x"])
        return
    else:
        value = rng.choice({
            "seed": [0, 1, 7, -1, True, "7", 2**63],
            "center": [True, False, "maybe", 1, None],
            "axis": ["channel", "token", "chan", 0],
            "group_size": [1, 2, 5, 16, 32, 64, 128, 1000, 0, -3, True, 2.5],
            "dtype": [None, "float16", "bfloat16", "float32", "fp16", "float64"],
            "codec_version": [0, 1, 2, True, "1"],
            "trellis": [True, False, 1, "yes"],
            "norm_bits": [8, 16, 4, True],
            "vq": [1, 2, 3],
        }.get(key, [1, 2, 3, 4, 5, 8, 9, 0, False]))
    config[key] = value


def m_codec(p: Parsed, rng: random.Random) -> str:
    *_, seg = rng.choice(_segments(p))
    _config_edit(seg["codec"], rng)
    return "codec config"


def m_policy(p: Parsed, rng: random.Random) -> str:
    policy = p.header.get(C.H_POLICY)
    if not policy:
        return m_codec(p, rng)
    key = rng.choice(["key", "value", "lossless", "sink_tokens", "recent_tokens",
                      "protect_layers"])
    if isinstance(policy.get(key), dict):
        _config_edit(policy[key], rng)
    else:
        policy[key] = rng.choice([0, 1, 2, 3, 50, -1, "2"])
    return "policy"


def m_alias(p: Parsed, rng: random.Random) -> str:
    *_, seg = rng.choice(_segments(p))
    part = rng.choice(list(seg["tensors"]))
    seg["tensors"][part] = rng.choice(list(p.header[C.H_TENSORS]))
    return "aliasing"


def m_range(p: Parsed, rng: random.Random) -> str:
    i, r, j, seg = rng.choice(_segments(p))
    segs = p.header[C.H_LAYERS][i][r]["segments"]
    choice = rng.randrange(3)
    if choice == 0 and len(segs) > 1:
        a, b = rng.sample(range(len(segs)), 2)
        segs[a], segs[b] = segs[b], segs[a]
    elif choice == 1:
        d = rng.choice([-1, 1])
        seg["stop"] += d
        seg["shape"][1] += d
        if j + 1 < len(segs):
            segs[j + 1]["start"] += d
            segs[j + 1]["shape"][1] -= d
    else:
        seg["start"] += rng.choice([-1, 1])
    return "segment range"


def m_layer_shape(p: Parsed, rng: random.Random) -> str:
    i, r, *_ = rng.choice(_segments(p))
    info = p.header[C.H_LAYERS][i][r]
    axis = rng.choice([0, 2])
    value = rng.choice([1, info["shape"][axis] + 1, max(1, info["shape"][axis] - 1), 4096,
                        1 << 20])
    info["shape"][axis] = value
    for seg in info["segments"]:
        seg["shape"][axis] = value
    return "layer shape"


def m_tokens(p: Parsed, rng: random.Random) -> str:
    """Token counts grown everywhere consistently (a decode bomb) or the ids table edited."""
    if rng.random() < 0.5 and p.header.get(C.H_TOKEN_IDS):
        p.header[C.H_TOKEN_IDS]["count"] += rng.choice([-1, 1])
        return "token ids"
    big = rng.choice([1 << 16, 1 << 20, 1 << 24])
    p.header[C.H_NUM_TOKENS] = big
    for layer in p.header[C.H_LAYERS]:
        for r in C.ROLES:
            info = layer[r]
            info["shape"][1] = big
            last = info["segments"][-1]
            last["shape"][1] += big - last["stop"]
            last["stop"] = big
    return "bomb"


def m_compression(p: Parsed, rng: random.Random) -> str:
    name = rng.choice(list(p.header[C.H_TENSORS]))
    t = p.header[C.H_TENSORS][name]
    t["compression"] = (C.COMPRESSION_NONE if t.get("compression") == C.COMPRESSION_ZSTD
                        else C.COMPRESSION_ZSTD)
    if rng.random() < 0.7:  # the blob stays as it was stored: only the flag lies
        dtype, shape, data = p.tensors[name]
        if t["compression"] == C.COMPRESSION_NONE:
            data = zstandard.ZstdCompressor(write_content_size=True).compress(data)
            p.tensors[name] = ("uint8", (len(data),), data)
        else:
            p.tensors[name] = ("uint8", (len(data),), data)
            p.as_stored = p.as_stored | {name}
    return "compression flag"


MUTATIONS = [m_shrink, m_relabel, m_reshape, m_codec, m_policy, m_alias, m_range,
             m_layer_shape, m_tokens, m_compression]


# -- the property ----------------------------------------------------------------------------------
def decoded(path: str) -> tuple[Any, ...]:
    cache = load(path)
    arrays = tuple((str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes())
                   for pair in zip(cache.keys, cache.values, strict=True) for a in pair)
    ids = None if cache.token_ids is None else np.asarray(cache.token_ids).tolist()
    return arrays, ids


def model_identity(layers: int, heads: int, dim: int) -> dict[str, Any]:
    """A model identity as kvtool.models writes it: layout fields and their fingerprint."""
    from kvtool.identity import canonical_sha256

    layout = {"architecture": "llama", "num_layers": layers, "num_kv_heads": heads,
              "head_dim": dim, "rope": {"rope_theta": 10000.0}, "dtype": "float16"}
    return {"name": "synthetic", "architecture": "LlamaForCausalLM", "num_layers": layers,
            "num_kv_heads": heads, "head_dim": dim, "dtype": "float16", "layout": layout,
            "fingerprint": canonical_sha256(layout)}


def verifies(path: str) -> bool:
    """What ``kvtool inspect --verify`` says: True for exit 0."""
    try:
        with open_kvz(path) as f:
            return not f.verify()
    except FormatError:
        return False


def make_bases(directory: str) -> dict[str, tuple[Parsed, Any]]:
    out = {}
    for k, (name, opts) in enumerate(BASES):
        dim = 24 if k % 2 else 16
        cache = synthetic_cache(layers=3, heads=2, tokens=10, dim=dim, seed=k,
                                model=model_identity(3, 2, dim))
        cache = cache.map_arrays(lambda a: (a * 8).round() / 8)  # compressible for zstd
        path = os.path.join(directory, f"base{k}.kvz")
        save(cache, path, **opts)
        out[name] = (parse(path), decoded(path))
    return out


def run(cases: int, seed: int = 0, directory: str | None = None) -> dict[str, Counter]:
    """Try ``cases`` mutants; counts per mutation class of 'refused', 'identical', 'silent'
    (loaded but different: the property broken), 'crash: <exception type>', and, checked on
    every 4th mutant, 'verify disagrees' (``inspect --verify`` and ``load`` disagree)."""
    results: dict[str, Counter] = {}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        bases = make_bases(tmp)
        names = sorted(bases)
        rng = random.Random(seed)
        path = os.path.join(tmp, "mutant.kvz")
        for case in range(cases):
            base, expected = bases[rng.choice(names)]
            p = base.copy()
            kind = rng.choice(MUTATIONS)(p, rng)
            with open(path, "wb") as f:
                f.write(serialize(p))
            try:
                outcome = "identical" if decoded(path) == expected else "silent"
            except FormatError:
                outcome = "refused"
            except Exception as e:  # noqa: BLE001 - anything but FormatError is a bug
                outcome = f"crash: {type(e).__name__}: {str(e)[:80]}"
            if case % 4 == 0 and verifies(path) != (outcome == "identical"):
                outcome = f"verify disagrees with load ({outcome})"
            results.setdefault(kind, Counter())[outcome] += 1
    return results


def table(results: dict[str, Counter]) -> str:
    rows = [f"{'mutation':<18} {'tried':>6} {'refused':>8} {'identical':>9} {'silent':>6} "
            f"{'other':>5}"]
    total: Counter = Counter()
    for kind in sorted(results):
        c = results[kind]
        crash = sum(v for k, v in c.items() if k not in ("refused", "identical", "silent"))
        n = sum(c.values())
        total.update(tried=n, refused=c["refused"], identical=c["identical"], silent=c["silent"],
                     crash=crash)
        rows.append(f"{kind:<18} {n:>6} {c['refused']:>8} {c['identical']:>9} "
                    f"{c['silent']:>6} {crash:>5}")
    rows.append(f"{'total':<18} {total['tried']:>6} {total['refused']:>8} "
                f"{total['identical']:>9} {total['silent']:>6} {total['crash']:>5}")
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    res = run(args.cases, args.seed)
    print(table(res))
    for kind, c in sorted(res.items()):
        for outcome, n in c.items():
            if outcome not in ("refused", "identical"):
                print(f"{kind}: {outcome} x{n}")
