"""Summaries and integrity checks of an open .kvz file (what ``kvtool inspect`` shows)."""

from __future__ import annotations

from collections import Counter
from math import prod
from typing import TYPE_CHECKING, Any

from kvtool.cache import is_cast
from kvtool.errors import FormatError
from kvtool.formats import constants as C
from kvtool.formats.container import crc32_hex

if TYPE_CHECKING:
    from kvtool.formats.reader import KvzFile


def _strip(path: str, message: str) -> str:
    return message.removeprefix(f"{path}: ")


def verify_file(f: KvzFile) -> list[str]:
    """Problems found by checking every checksum and decoding every layer, one at a time.

    Opening the file already checked the header against the codec contract; this reads every
    byte, so memory stays at one layer's decoded size.
    """
    problems = []
    raw, crc = f.metadata.get(C.META_HEADER, ""), f.metadata.get(C.META_HEADER_CRC32)
    if crc is None:
        problems.append(f"metadata lacks {C.META_HEADER_CRC32}")
    elif crc32_hex(raw.encode("utf-8")) != crc:
        problems.append("checksum mismatch in the kvz header")
    for name in f.header[C.H_TENSORS]:
        try:
            f.read_tensor(name, verify=True)
        except FormatError as e:
            problems.append(_strip(f.path, str(e)))
    try:
        f.token_ids  # noqa: B018  (read for its checks: a negative id)
    except FormatError as e:
        problem = _strip(f.path, str(e))
        if problem not in problems:  # their checksum, already reported above
            problems.append(problem)
    for i in range(f.num_layers):
        try:
            f.layer(i)
        except FormatError as e:
            problem = _strip(f.path, str(e))
            if problem not in problems:  # a checksum already reported above
                problems.append(problem)
    return problems


def _role_info(f: KvzFile, role: dict[str, Any]) -> dict[str, Any]:
    stored = sum(f._entries[name].nbytes for seg in role["segments"]
                 for name in seg["tensors"].values())
    elements = prod(role["shape"])
    return {
        "shape": role["shape"],
        "dtype": role["dtype"],
        "codecs": [seg["codec"]["id"] for seg in role["segments"]],
        "segments": [{"start": s["start"], "stop": s["stop"], "codec": s["codec"]}
                     for s in role["segments"]],
        "stored_bytes": stored,
        "fp16_bytes": 2 * elements,
        "bits_per_element": round(8 * stored / elements, 4) if elements else 0.0,
    }


def file_info(f: KvzFile) -> dict[str, Any]:
    """A JSON-safe summary: identity, sizes, ratio vs fp16 and per-layer codecs."""
    h = f.header
    info = h.get(C.H_LAYER_INFO) or [None] * f.num_layers
    layers = []
    for i, layer in enumerate(h[C.H_LAYERS]):
        roles = {r: _role_info(f, layer[r]) for r in C.ROLES}
        layers.append({"index": i, "tokens": layer["key"]["shape"][1], "info": info[i], **roles})
    fp16 = sum(lay[r]["fp16_bytes"] for lay in layers for r in C.ROLES)
    payload = sum(lay[r]["stored_bytes"] for lay in layers for r in C.ROLES)
    codecs = Counter(seg["codec"]["id"] for layer in h[C.H_LAYERS] for r in C.ROLES
                     for seg in layer[r]["segments"])
    ids = h.get(C.H_TOKEN_IDS)
    table = h[C.H_TENSORS]
    return {
        "path": f.path,
        "format": C.FORMAT_NAME,
        "format_version": f.format_version,
        "creator": h[C.H_CREATOR],
        "model": h[C.H_MODEL],
        "tokenizer_fingerprint": f.tokenizer_fingerprint,
        "num_layers": f.num_layers,
        "num_tokens": f.num_tokens,
        "num_token_ids": None if ids is None else ids["count"],
        "store_chunk": f.store_chunk,
        "dtype": h[C.H_DTYPE],
        "policy": h.get(C.H_LAYER_POLICY) or h.get(C.H_POLICY),
        "policy_unchecked": f.policy_unchecked,
        "lossy_sources": f.lossy_sources(),
        "decoded_from_lossy": [s for s in h.get(C.H_LOSSY_SOURCES, []) if not is_cast(s)],
        "codecs": dict(sorted(codecs.items())),
        "file_bytes": f.file_bytes,
        "payload_bytes": payload,
        "fp16_bytes": fp16,
        "ratio": round(fp16 / f.file_bytes, 4) if f.file_bytes else 0.0,
        "bits_per_element": round(8 * payload * 2 / fp16, 4) if fp16 else 0.0,
        "tensors": len(table),
        "zstd_tensors": sum(t.get("compression") == C.COMPRESSION_ZSTD for t in table.values()),
        "checksum": C.CHECKSUM_ALGORITHM,
        "layers": layers,
    }
