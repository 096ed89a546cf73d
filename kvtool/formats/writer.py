"""Writing .kvz files: encode each layer/role as the policy's token segments, then write the
safetensors container atomically (temp file, fsync, rename) and deterministically."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvtool.cache import KVCache, every_layer_slides, merge_sources
from kvtool.codecs import Codec, Encoded
from kvtool.errors import CodecError, FormatError
from kvtool.fileio import atomic_write, check_output_path
from kvtool.formats import constants as C
from kvtool.formats.container import Blob, as_bytes, crc32_hex, dtype_name, write_container
from kvtool.formats.contract import check_identity
from kvtool.formats.header import (
    check_lossy_sources,
    check_part_name,
    check_store_chunk,
    token_layout_problem,
)
from kvtool.kernels import Array, ops_for
from kvtool.policy import CodecPolicy


def resolve_policy(policy: CodecPolicy | None, codec: str | dict | Codec | None = None,
                   key_codec: str | dict | Codec | None = None,
                   value_codec: str | dict | Codec | None = None, protect_layers: int = 0,
                   sink_tokens: int = 0, recent_tokens: int = 0) -> CodecPolicy:
    """``policy`` itself, or one built from CLI-style options (default codec: raw)."""
    options = (codec, key_codec, value_codec)
    if policy is not None:
        if not isinstance(policy, CodecPolicy):  # save(cache, path, "turbo3")
            raise TypeError(f"policy must be a CodecPolicy, got {type(policy).__name__} "
                            f"{str(policy)[:40]!r} (a codec goes in codec=...)")
        if any(o is not None for o in options) or protect_layers or sink_tokens or recent_tokens:
            raise ValueError("pass either a policy or codec options, not both")
        return policy
    return CodecPolicy.from_options(codec=codec, key_codec=key_codec, value_codec=value_codec,
                                    protect_layers=protect_layers, sink_tokens=sink_tokens,
                                    recent_tokens=recent_tokens)


def zstd_level(zstd: int | bool | None) -> int:
    """0 (off) or a zstd level: ``True`` → the default level, an int in 1..22 → that level."""
    if zstd is None or zstd is False:
        return 0
    if zstd is True:
        return C.DEFAULT_ZSTD_LEVEL
    if not isinstance(zstd, int) or not 0 <= zstd <= C.ZSTD_MAX_LEVEL:
        raise ValueError(f"zstd must be a bool or a level in 1..{C.ZSTD_MAX_LEVEL}, got {zstd!r}")
    return zstd


class _Encoder:
    """Collects blobs (in file order) and the header's tensor table."""

    def __init__(self, level: int, entropy: bool = False):
        self.entropy = entropy
        self.blobs: list[Blob] = []
        self.table: dict[str, dict[str, Any]] = {}
        self.cctx = None
        if level:
            import zstandard

            self.cctx = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                                 write_checksum=False, threads=0)

    def add(self, name: str, arr: np.ndarray, code_bits: int | None = None) -> None:
        """Store ``arr`` as is, or zstd/rANS-compressed where that is smaller (``code_bits``:
        the width of the bit-packed codes it holds, for the entropy coder)."""
        dtype = dtype_name(arr)
        data: Any = as_bytes(arr)
        entry: dict[str, Any] = {"dtype": dtype, "shape": [int(s) for s in arr.shape],
                                 "compression": C.COMPRESSION_NONE}
        blob = Blob(name, C.DTYPE_TO_ST[dtype], tuple(entry["shape"]), data)
        if self.cctx is not None and data.nbytes:
            packed = self.cctx.compress(data)
            if len(packed) < data.nbytes:  # keep incompressible tensors (packed codes) as they are
                entry["compression"] = C.COMPRESSION_ZSTD
                blob = Blob(name, "U8", (len(packed),), packed)
        if self.entropy and data.nbytes:
            coded = _rans(arr, code_bits)
            if len(coded) < blob.nbytes and data.nbytes <= len(coded) * C.MAX_ZSTD_RATIO:
                entry["compression"] = C.COMPRESSION_RANS
                blob = Blob(name, "U8", (len(coded),), coded)
        entry[C.CHECKSUM_ALGORITHM] = crc32_hex(blob.data)
        self.blobs.append(blob)
        self.table[name] = entry

    @property
    def stored_bytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)


def _rans(arr: np.ndarray, code_bits: int | None) -> bytes:
    """The rANS blob of ``arr``: symbols of ``code_bits`` along rows of its last axis (packed
    codes) or bytes by position in an element, contexts per first-axis index (head)."""
    from kvtool.codecs import entropy

    itemsize = arr.dtype.itemsize
    row = int(arr.shape[-1]) * itemsize if code_bits and arr.ndim else itemsize
    lead = int(arr.shape[0]) if arr.ndim >= 2 else 1
    return entropy.encode(np.ascontiguousarray(arr).view(np.uint8).reshape(-1),
                          code_bits=code_bits, row_bytes=max(row, 1), lead=lead)


def _check_declared(codec: Codec, encoded: Encoded) -> None:
    """A codec's output must be what it declares: readers refuse anything else."""
    try:
        codec.check_encoded(encoded)
    except CodecError as e:
        raise CodecError(f"{e}: its output breaks what it declares (expected_arrays), and "
                         "readers would refuse the file") from None


def _encode_role(enc: _Encoder, x: Array, layer: int, role: str, num_layers: int,
                 policy: CodecPolicy) -> dict[str, Any]:
    xp = ops_for(x)
    heads, tokens, dim = (int(s) for s in x.shape)
    dtype = xp.dtype_name(x)
    if dtype not in C.FLOAT_DTYPES:
        raise ValueError(f"layer {layer} {role}: dtype {dtype} is not fp32, fp16 or bf16")
    segments = []
    for j, seg in enumerate(policy.segments(role, layer, num_layers, tokens)):
        encoded = seg.codec.encode(x[:, seg.start:seg.stop]).to_numpy()
        if tuple(encoded.shape) != (heads, seg.stop - seg.start, dim):
            raise FormatError(f"codec {seg.codec.codec_id!r} reported shape {encoded.shape}")
        _check_declared(seg.codec, encoded)
        parts = {}
        for part in sorted(encoded.arrays):
            check_part_name(part, seg.codec.codec_id)
            parts[part] = name = C.tensor_name(layer, role, j, part)
            bits = getattr(seg.codec, "bits", None) if part == "codes" else None
            enc.add(name, np.asarray(encoded.arrays[part]),
                    bits if isinstance(bits, int) and 1 <= bits < 8 else None)
        segments.append({"start": seg.start, "stop": seg.stop, "codec": seg.codec.get_config(),
                         "shape": [heads, seg.stop - seg.start, dim], "dtype": dtype,
                         "tensors": parts})
    return {"shape": [heads, tokens, dim], "dtype": dtype, "segments": segments}


def write_kvz(path: str | os.PathLike, layers: Iterable[tuple[Array, Array]], *,
              num_layers: int, policy: CodecPolicy, model: dict[str, Any] | None = None,
              tokenizer_fingerprint: str | None = None, token_ids: Any = None,
              layer_info: list[dict[str, Any] | None] | None = None,
              zstd: int | bool = False, entropy: bool = False,
              progress: bool = False,
              store_chunk: dict[str, Any] | None = None,
              lossy_sources: Iterable[str] = ()) -> dict[str, Any]:
    """Encode ``num_layers`` (keys, values) pairs with ``policy`` and write a .kvz file
    (``store_chunk``: a prefix-store chunk's key and start, recorded in its header;
    ``lossy_sources``: the lossy steps the K/V went through before, recorded too)."""
    from tqdm.auto import tqdm

    from kvtool import __version__

    path = os.fsdecode(path)  # str, bytes or PathLike, as load takes
    check_output_path(path)  # before the encoding work, not after it
    if not all(isinstance(k, str) for k in (model or {})):  # JSON would turn 1 into "1"
        raise ValueError("model info keys must be strings")
    from kvtool.identity import dtype_problem

    problem = dtype_problem(model)
    if problem:
        raise ValueError(f"model info: {problem}")
    if tokenizer_fingerprint is not None and not isinstance(tokenizer_fingerprint, str):
        raise ValueError("tokenizer_fingerprint must be a string or None, got "
                         f"{type(tokenizer_fingerprint).__name__}")
    policy.check_layers(num_layers)
    policy = policy.resolve()  # sink=auto without the whole cache: every scanned token exact
    enc = _Encoder(zstd_level(zstd), bool(entropy))
    ids_entry = None
    if token_ids is not None:
        ids = np.asarray(token_ids).reshape(-1).astype(np.int64)
        if ids.size and ids.min() < 0:
            raise ValueError(f"cannot save this cache: token id {int(ids.min())} is negative")
        small = ids.size == 0 or (ids.min() >= -(2**31) and ids.max() < 2**31)
        enc.add(C.TOKENS_TENSOR, ids.astype(np.int32) if small else ids)
        ids_entry = {"tensor": C.TOKENS_TENSOR, "count": int(ids.size)}
    layer_entries: list[dict[str, Any]] = []
    num_tokens, fp16_bytes, source_bytes, dtype = 0, 0, 0, "float32"
    with tqdm(total=num_layers, desc="encoding", unit="layer", disable=not progress,
              leave=False) as bar:
        for i, (k, v) in enumerate(layers):
            if i >= num_layers:
                raise ValueError(f"more than {num_layers} layers")
            entry = {role: _encode_role(enc, x, i, role, num_layers, policy)
                     for role, x in zip(C.ROLES, (k, v), strict=True)}
            if entry["key"]["shape"][:2] != entry["value"]["shape"][:2]:
                raise ValueError(f"layer {i}: keys and values disagree on heads or tokens")
            dtype = dtype if i else entry["key"]["dtype"]
            num_tokens = max(num_tokens, entry["key"]["shape"][1])
            fp16_bytes += sum(2 * int(np.prod(entry[r]["shape"])) for r in C.ROLES)
            source_bytes += sum(C.ITEMSIZE[entry[r]["dtype"]] * int(np.prod(entry[r]["shape"]))
                                for r in C.ROLES)
            layer_entries.append(entry)
            bar.update(1)
    if len(layer_entries) != num_layers:
        raise ValueError(f"expected {num_layers} layers, got {len(layer_entries)}")
    if ids_entry is not None and ids_entry["count"] > num_tokens \
            and every_layer_slides(layer_info, num_layers):
        num_tokens = ids_entry["count"]  # no layer holds every token: the sequence's length
    problem = token_layout_problem([e["key"]["shape"][1] for e in layer_entries], num_tokens,
                                   None if ids_entry is None else ids_entry["count"], layer_info)
    if problem:
        raise ValueError(f"cannot save this cache: {problem}")
    header: dict[str, Any] = {
        C.H_CREATOR: {"name": "kvtool", "version": __version__},
        C.H_MODEL: dict(model or {}),
        C.H_TOKENIZER: {"fingerprint": tokenizer_fingerprint},
        C.H_NUM_LAYERS: num_layers,
        C.H_NUM_TOKENS: num_tokens,
        C.H_DTYPE: dtype,
        C.H_TOKEN_IDS: ids_entry,
        C.H_POLICY: None if policy.layers else policy.to_json(),
        C.H_LAYER_INFO: None if layer_info is None else list(layer_info),
        C.H_LAYERS: layer_entries,
        C.H_TENSORS: enc.table,
    }
    if policy.layers:  # only then: files of uniform policies stay byte-identical
        header[C.H_LAYER_POLICY] = policy.to_json()
    if store_chunk is not None:
        header[C.H_STORE_CHUNK] = store_chunk
    if isinstance(lossy_sources, str):  # would read as its characters
        raise TypeError("lossy_sources must be a list of strings, not a string")
    sources = merge_sources(lossy_sources)
    if sources:  # only then: files of exact K/V stay byte-identical
        header[C.H_LOSSY_SOURCES] = sources
    try:  # never write what the reader refuses
        check_identity(header)
        check_store_chunk(header.get(C.H_STORE_CHUNK), num_tokens, "store_chunk")
        check_lossy_sources(header.get(C.H_LOSSY_SOURCES, ...), "lossy_sources")
    except FormatError as e:
        raise ValueError(f"cannot save this cache: {e}") from None
    try:
        header_json = json.dumps(header, sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model info and layer_info must be JSON-safe: {e}") from None
    metadata = {
        C.META_FORMAT: C.FORMAT_NAME,
        C.META_FORMAT_VERSION: C.FORMAT_VERSION,
        C.META_HEADER: header_json,
        C.META_HEADER_CRC32: crc32_hex(header_json.encode("utf-8")),
    }
    file_bytes = atomic_write(path, lambda f: write_container(f, enc.blobs, metadata))
    return {
        "path": os.fspath(path),
        "file_bytes": file_bytes,
        "stored_bytes": enc.stored_bytes,
        "fp16_bytes": fp16_bytes,
        "ratio": round(fp16_bytes / file_bytes, 4) if file_bytes else 0.0,
        "source_dtype": dtype,
        "source_bytes": source_bytes,
        "ratio_vs_source": round(source_bytes / file_bytes, 4) if file_bytes else 0.0,
        "num_layers": num_layers,
        "num_tokens": num_tokens,
        "policy": policy.describe(),
    }


def save(cache: KVCache, path: str | os.PathLike, policy: CodecPolicy | None = None, *,
         codec: str | dict | Codec | None = None, key_codec: str | dict | Codec | None = None,
         value_codec: str | dict | Codec | None = None, protect_layers: int = 0,
         sink_tokens: int = 0, recent_tokens: int = 0, zstd: int | bool = False,
         entropy: bool = False, progress: bool = False,
         store_chunk: dict[str, Any] | None = None) -> dict[str, Any]:
    """Encode ``cache`` and write it to ``path`` as a .kvz file.

    Pass a :class:`CodecPolicy` or the options that build one (default codec: ``raw``).
    ``zstd`` compresses each tensor (``True`` or a level 1..22) where that makes it smaller;
    ``entropy`` rANS-codes each tensor (quantised codes at their entropy, ~2.5-2.8 bits for
    turbo3's 3) where that is smaller still.
    Returns a report: ``file_bytes``, ``fp16_bytes``, ``ratio`` (fp16 bytes / file bytes), ...
    """
    for i, layer in enumerate(zip(cache.keys, cache.values, strict=True)):
        if any(getattr(getattr(x, "device", None), "type", None) == "meta" for x in layer):
            raise ValueError(f"layer {i}: a tensor on the meta device holds no values")
    policy = resolve_policy(policy, codec, key_codec, value_codec, protect_layers,
                            sink_tokens, recent_tokens).resolve(cache)  # sink=auto: found here
    return write_kvz(path, zip(cache.keys, cache.values, strict=True),
                     num_layers=cache.num_layers, policy=policy, model=cache.model,
                     tokenizer_fingerprint=cache.tokenizer_fingerprint,
                     token_ids=cache.token_ids, layer_info=cache.layer_info, zstd=zstd,
                     entropy=entropy, progress=progress, store_chunk=store_chunk,
                     lossy_sources=cache.lossy_sources)
