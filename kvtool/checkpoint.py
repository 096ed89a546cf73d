"""The weights fingerprint of a model directory's safetensors checkpoint (format spec 3.6).

Two models of one KV layout (a base model and its fine-tune) have the same layout fingerprint
(:func:`kvtool.identity.model_fingerprint`) and different K/V. :func:`weights_fingerprint`
tells them apart by hashing a sample of every K/V-shaping tensor, read straight from the files
every engine (transformers, vLLM, mlx-lm) loads, floats through bfloat16 so that a float32
checkpoint and its bfloat16 copy agree. It reads a few KB per tensor: milliseconds for a
small model, well under a second for a 70B one.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

WEIGHTS_TAG = b"kvtool-weights-1\n"
SAMPLE_BLOCKS, SAMPLE_RUN = 16, 64  # runs of elements hashed per tensor, evenly spread
MAX_SAFETENSORS_HEADER = 100_000_000  # as the safetensors library
# tensors that shape no K/V, and that checkpoints of one model keep or drop freely
NOT_KV_WEIGHTS = ("lm_head.", "rotary_emb.inv_freq")
FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}  # hashed as bfloat16 through float32
WIDTHS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
          "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
BF16_NAN = 0x7FC0  # every NaN hashes as this one


def checkpoint_files(location: str | Path) -> list[Path]:
    """The safetensors files an engine loads from the model directory ``location``: those its
    index names, else ``model*.safetensors``, else every ``*.safetensors`` (empty when none).
    Raises ValueError for an index that names a file outside the directory."""
    root = Path(location)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(_read_regular(index))["weight_map"]
        names = sorted(set(weight_map.values()))
        for name in names:
            part = Path(name)
            if part.is_absolute() or ".." in part.parts or not part.parts:
                raise ValueError(f"{index}: names {name!r}, outside the model directory")
        return [root / n for n in names]
    return sorted(root.glob("model*.safetensors")) or sorted(root.glob("*.safetensors"))


def weights_fingerprint(location: str | Path | None) -> str | None:
    """sha256 over every K/V-shaping tensor of the checkpoint in ``location`` (a model
    directory): its name, shape and a thousand elements spread over it, floats rounded to
    bfloat16, so that a float32 checkpoint and its bfloat16 copy agree while a fine-tune, a
    merged LoRA, an added token or a quantized copy does not. A sample: an edit of a few
    elements between the runs goes unseen. None when there is no checkpoint it can read (no
    safetensors, a damaged or unknown one): the weights are then unknown, and nothing is
    refused for them."""
    if location is None or not Path(location).is_dir():
        return None
    try:
        tensors: dict[str, tuple[Path, dict[str, Any], int]] = {}
        for path in checkpoint_files(location):
            for name, (entry, base) in _safetensors_table(path).items():
                if not any(part in name for part in NOT_KV_WEIGHTS):
                    tensors.setdefault(name, (path, entry, base))
        if not tensors:
            return None
        h = hashlib.sha256(WEIGHTS_TAG)
        handles: dict[Path, Any] = {}
        try:
            for name in sorted(tensors):
                path, entry, base = tensors[name]
                if path not in handles:
                    handles[path] = _open_regular(path)
                kind = "float" if entry["dtype"] in FLOATS or entry["dtype"] == "BF16" \
                    else entry["dtype"]
                h.update(json.dumps([name, entry["shape"], kind]).encode() + b"\0")
                h.update(_tensor_sample(handles[path], entry, base))
        finally:
            for f in handles.values():
                f.close()
        return h.hexdigest()
    except Exception:  # any unreadable checkpoint: unknown weights, as for an in-memory model
        return None


def quantized_on_load(weights: str | None, method: str | None, config: Any) -> str | None:
    """The fingerprint of the weights an engine computes with: ``weights`` (the checkpoint's),
    or, when the engine quantizes an unquantized checkpoint as it loads it (vLLM's
    ``--quantization fp8``: ``method``), sha256 of both: its K/V are another model's, as a
    quantized copy's would be. A checkpoint quantized on disk (:func:`quantized_on_disk`) is
    loaded as it is stored: its own fingerprint already says so."""
    if not weights or not method or quantized_on_disk(config):
        return weights
    return hashlib.sha256(f"{weights}\0{method}".encode()).hexdigest()


def quantized_on_disk(config: Any) -> bool:
    """Whether the model config declares a quantized checkpoint, where vLLM looks: a
    ``quantization_config`` or (older compressed-tensors) ``compression_config``, at the top
    or in the text config of a multimodal model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return any(getattr(part, key, None) is not None for part in (config, text)
               if part is not None for key in ("quantization_config", "compression_config"))


def _open_regular(path: Path) -> Any:
    """``path`` opened for reading if it is a regular file (a FIFO would block the open)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def _read_regular(path: Path) -> bytes:
    with _open_regular(path) as f:
        return f.read(MAX_SAFETENSORS_HEADER)


def _safetensors_table(path: Path) -> dict[str, tuple[dict[str, Any], int]]:
    """A safetensors file's tensor entries, each with where its data starts."""
    with _open_regular(path) as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path}: header of {size} bytes")
        table = json.loads(f.read(size))
    if not isinstance(table, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    return {k: (v, 8 + size) for k, v in table.items() if k != "__metadata__"}


def _tensor_sample(f: Any, entry: dict[str, Any], base: int) -> bytes:
    """:data:`SAMPLE_BLOCKS` runs of :data:`SAMPLE_RUN` elements spread evenly over a tensor
    (all of a small one): bfloat16 bits for floats, the stored bytes for anything else."""
    start, stop = (int(x) for x in entry["data_offsets"])
    dtype = entry["dtype"]
    width = WIDTHS[dtype]  # a KeyError for a dtype we cannot sample: unknown weights
    count, run = (stop - start) // width, SAMPLE_RUN
    if count <= SAMPLE_BLOCKS * run:
        firsts, run = ([0] if count else []), count
    else:
        firsts = np.linspace(0, count - run, SAMPLE_BLOCKS).astype(np.int64).tolist()
    out = []
    for first in firsts:
        f.seek(base + start + first * width)
        raw = f.read(run * width)
        if len(raw) != run * width:
            raise ValueError("truncated checkpoint")
        out.append(_as_bfloat16(raw, dtype))
    return b"".join(out)


def _as_bfloat16(raw: bytes, dtype: str) -> bytes:
    """bfloat16 bits of float elements (float32 rounded to nearest even, as torch casts; every
    NaN as :data:`BF16_NAN`); other dtypes' bytes as stored."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2")
        return np.where((bits & 0x7FFF) > 0x7F80, BF16_NAN, bits).astype("<u2").tobytes()
    if dtype not in FLOATS:
        return raw
    with np.errstate(over="ignore", invalid="ignore"):  # float64 past float32's range: inf
        values = np.frombuffer(raw, dtype=FLOATS[dtype]).astype("<f4")
    bits = values.view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(values), BF16_NAN, rounded).astype("<u2").tobytes()
