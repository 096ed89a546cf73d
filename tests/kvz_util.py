"""Helpers for the .kvz format tests: synthetic caches, codec availability, file surgery."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kvtool.cache import KVCache
from kvtool.codecs import get_codec, list_codecs
from kvtool.codecs.abc import ArraySpec
from kvtool.codecs.raw import RawCodec
from kvtool.codecs.registry import BUILTIN_CODECS
from kvtool.formats import constants as C
from kvtool.formats.container import Blob, crc32_hex, encode_header, parse_container

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def synthetic_cache(layers: int = 3, heads: int = 2, tokens: int = 12, dim: int = 32,
                    dtype: str = "float16", seed: int = 0, token_ids: bool = True,
                    **kwargs: Any) -> KVCache:
    """A deterministic cache; keys carry per-channel offsets like real keys do."""
    rng = np.random.default_rng(seed)
    keys, values = [], []
    for _ in range(layers):
        offsets = rng.normal(0, 2.0, size=(heads, 1, dim))
        keys.append((rng.standard_normal((heads, tokens, dim)) + offsets).astype(NP_DTYPES[dtype]))
        values.append(rng.standard_normal((heads, tokens, dim)).astype(NP_DTYPES[dtype]))
    ids = rng.integers(0, 49152, size=tokens) if token_ids else None
    model = {"name": "synthetic", "architecture": "LlamaForCausalLM", "fingerprint": "f" * 16}
    return KVCache(keys, values, token_ids=ids, model=kwargs.pop("model", model),
                   tokenizer_fingerprint=kwargs.pop("tokenizer_fingerprint", "t" * 16), **kwargs)


def outlier_keys(shape: tuple[int, ...] = (3, 40, 64), seed: int = 0) -> np.ndarray:
    """Key-like float32 vectors: a common offset and two outlier channels (5 and 17)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) + 2.0
    x[..., 5] *= 9
    x[..., 17] *= 4
    return x


def squared_error(codec, x: np.ndarray) -> float:
    """‖x − decode(encode(x))‖² of ``codec`` on ``x``."""
    return float(((np.asarray(codec.decode(codec.encode(x), "float32")) - x) ** 2).sum())


def codec_available(codec_id: str) -> bool:
    """False for a built-in whose module has not been written yet (skip, don't fail)."""
    target = BUILTIN_CODECS.get(codec_id)
    return target is None or importlib.util.find_spec(target.partition(":")[0]) is not None


def codec_or_skip(codec_id: str):
    if not codec_available(codec_id):
        pytest.skip(f"codec {codec_id} not implemented yet")
    return get_codec(codec_id)


def available_codecs() -> list[str]:
    return [c for c in list_codecs() if codec_available(c)]


def as_f32(x: Any) -> np.ndarray:
    from kvtool.kernels import to_numpy

    return np.asarray(to_numpy(x)).astype(np.float32)


def bits(x: Any) -> bytes:
    from kvtool.kernels import to_numpy

    return np.ascontiguousarray(to_numpy(x)).tobytes()


def one_line_error(result, code: int) -> str:
    """The single ``Error: ...`` stderr line of a CLI run that exited with ``code``."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


# -- file surgery ----------------------------------------------------------------------------------
def read_parts(path: str | os.PathLike) -> tuple[dict[str, str], list[Blob]]:
    """The metadata and the stored blobs (in file order) of a safetensors file."""
    data = open(path, "rb").read()
    metadata, entries = parse_container(lambda o, n: data[o:o + n], len(data))
    st = {v: k for k, v in C.ST_DTYPES.items()}
    blobs = [Blob(e.name, st[e.dtype], e.shape, data[e.begin:e.end])
             for e in sorted(entries.values(), key=lambda e: e.begin)]
    return metadata, blobs


def write_parts(path: str | os.PathLike, metadata: dict[str, str], blobs: list[Blob]) -> None:
    with open(path, "wb") as f:
        f.write(encode_header(blobs, metadata))
        for b in blobs:
            f.write(b.data)


def rewrite_header(src: str | os.PathLike, dst: str | os.PathLike, fn) -> None:
    """Copy ``src`` to ``dst`` with ``fn(header_dict)`` applied to kvz.header (crc refreshed)."""
    metadata, blobs = read_parts(src)
    header = json.loads(metadata[C.META_HEADER])
    header = fn(header) or header
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"))
    metadata[C.META_HEADER] = raw
    metadata[C.META_HEADER_CRC32] = crc32_hex(raw.encode())
    write_parts(dst, metadata, blobs)


class FlatRaw(RawCodec):
    """raw, but its array has no block axis (as a plugin codec may do)."""

    codec_id = "flatraw-test"

    def expected_arrays(self, shape, dtype):
        return {"data": ArraySpec((int(np.prod(shape)),), self.dtype or dtype)}

    def _encode(self, xp, x):
        return {"data": xp.copy(x).reshape(-1)}

    def _decode(self, xp, enc):
        return enc.arrays["data"].reshape(enc.shape)
