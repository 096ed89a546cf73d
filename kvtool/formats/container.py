"""The safetensors container: writing it byte-for-byte, and parsing it defensively.

Layout (as defined by safetensors): an 8-byte little-endian header length ``n``; ``n`` bytes of
JSON (``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}``) padded with
spaces to a multiple of 8; then the data section, where each tensor occupies
``[begin, end)`` relative to its start, with no holes.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import isfinite, prod
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from kvtool.errors import FormatError
from kvtool.formats import constants as C

_NP_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}


def np_dtype(name: str) -> np.dtype:
    """numpy dtype (little-endian) for a kvtool dtype name."""
    return _NP_DTYPES.get(name) or np.dtype(name).newbyteorder("<")


def dtype_name(arr: np.ndarray) -> str:
    """kvtool dtype name of a numpy array (``bfloat16`` for ``ml_dtypes.bfloat16``)."""
    name = str(arr.dtype)
    if name not in C.DTYPE_TO_ST:
        raise FormatError(f"arrays of dtype {name} cannot be stored in a .kvz file")
    return name


def as_bytes(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous little-endian uint8 view (or copy) of ``arr``'s data."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8)


def crc32_hex(data: Any) -> str:
    """The documented checksum: zlib.crc32 as 8 lowercase hex digits."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


# -- writing ---------------------------------------------------------------------------------------
@dataclass
class Blob:
    """One tensor as stored: safetensors dtype/shape and its bytes (uint8 array or bytes)."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    data: Any

    @property
    def nbytes(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else int(self.data.nbytes)


def encode_header(blobs: Iterable[Blob], metadata: dict[str, str]) -> bytes:
    """The length-prefixed, space-padded JSON header for ``blobs`` written in order."""
    header: dict[str, Any] = {C.SAFETENSORS_METADATA_KEY: metadata}
    offset = 0
    for blob in blobs:
        if blob.name in header:
            raise FormatError(f"duplicate tensor name {blob.name!r}")
        header[blob.name] = {"dtype": blob.st_dtype, "shape": list(blob.shape),
                             "data_offsets": [offset, offset + blob.nbytes]}
        offset += blob.nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                     allow_nan=False).encode("ascii")
    raw += C.HEADER_PAD_BYTE * (-(len(raw) + C.HEADER_LENGTH_BYTES) % C.HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


def write_container(f: BinaryIO, blobs: list[Blob], metadata: dict[str, str]) -> int:
    """Write header and data to ``f``; returns the number of bytes written."""
    head = encode_header(blobs, metadata)
    f.write(head)
    total = len(head)
    for blob in blobs:
        f.write(blob.data)
        total += blob.nbytes
    return total


# -- reading ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """A validated tensor entry; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str  # kvtool dtype name
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not isfinite(value):  # 1e999: valid JSON, but a float no writer can serialise
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


#: a surrogate escape (``\\ud800``), or a surrogate in a str: a pair of them is one character
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def parse_json(raw: bytes | str, what: str) -> Any:
    """Strict JSON (no NaN/Infinity nor a number past float range, no duplicate keys, no lone
    surrogate escape: a string that is not text, which no writer makes and printing it would
    fail on); any failure is a FormatError."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                          object_pairs_hook=_no_duplicates)
        if _SURROGATE.search(text):  # rare: only then is the decoded text checked
            try:
                json.dumps(data, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds an unpaired surrogate escape (\\udXXX): not "
                                 "text") from None
        return data
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise FormatError(f"{what} is not valid JSON: {str(e)[:120]}") from None


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_shape(shape: Any, what: str) -> tuple[int, ...]:
    if (not isinstance(shape, list) or len(shape) > C.MAX_NDIM
            or not all(is_int(s) and 0 <= s < 2**48 for s in shape)):
        raise FormatError(f"{what}: invalid shape {str(shape)[:80]}")
    return tuple(shape)


def parse_container(read_at: Callable[[int, int], bytes], file_size: int
                    ) -> tuple[dict[str, str], dict[str, Entry]]:
    """Read and validate the safetensors header: its metadata and every tensor entry.

    Checks, before anything is allocated from the header's numbers: the header length against
    :data:`MAX_HEADER_BYTES` and the file size, JSON validity, dtypes, shapes, and that every
    ``data_offsets`` range is in bounds, sized ``prod(shape) * itemsize`` and overlaps no other.
    """
    if file_size < C.HEADER_LENGTH_BYTES + 2:
        raise FormatError(f"file too small to be a .kvz file ({file_size} bytes)")
    (n,) = struct.unpack("<Q", read_at(0, C.HEADER_LENGTH_BYTES))
    if n > C.MAX_HEADER_BYTES:
        raise FormatError(f"header length {n} exceeds the {C.MAX_HEADER_BYTES}-byte limit "
                          "(corrupt or not a .kvz file)")
    if C.HEADER_LENGTH_BYTES + n > file_size:
        raise FormatError(f"header length {n} runs past the end of the {file_size}-byte file "
                          "(truncated or not a .kvz file)")
    raw = read_at(C.HEADER_LENGTH_BYTES, n)
    if not raw.startswith(b"{"):
        raise FormatError("not a safetensors/.kvz file (header does not start with '{')")
    header = parse_json(raw, "safetensors header")
    if not isinstance(header, dict):
        raise FormatError("safetensors header is not a JSON object")
    metadata = header.pop(C.SAFETENSORS_METADATA_KEY, None)
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError("not a .kvz file: safetensors __metadata__ missing or not all strings")
    if len(header) > C.MAX_TENSORS:
        raise FormatError(f"too many tensors ({len(header)})")
    data_start = C.HEADER_LENGTH_BYTES + n
    data_len = file_size - data_start
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise FormatError(f"tensor {name[:60]!r}: entry is not an object")
        st_dtype, offsets = info.get("dtype"), info.get("data_offsets")
        if not isinstance(st_dtype, str) or st_dtype not in C.ST_DTYPES:
            raise FormatError(f"tensor {name[:60]!r}: unknown dtype {str(st_dtype)[:20]!r}")
        dtype = C.ST_DTYPES[st_dtype]
        shape = check_shape(info.get("shape"), f"tensor {name[:60]!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(is_int(o) for o in offsets)):
            raise FormatError(f"tensor {name[:60]!r}: invalid data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise FormatError(f"tensor {name[:60]!r}: data_offsets [{begin}, {end}] outside "
                              f"the {data_len}-byte data section (truncated file?)")
        if end - begin != prod(shape) * C.ITEMSIZE[dtype]:
            raise FormatError(f"tensor {name[:60]!r}: {end - begin} bytes do not match shape "
                              f"{list(shape)} of {dtype}")
        entries[name] = Entry(name, dtype, shape, data_start + begin, data_start + end)
    last_end, last_name = data_start, ""
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.nbytes and e.begin < last_end:
            raise FormatError(f"tensors {last_name[:60]!r} and {e.name[:60]!r} overlap")
        if e.nbytes and e.begin > last_end:
            raise FormatError(f"{e.begin - last_end} bytes before tensor {e.name[:60]!r} "
                              "belong to no tensor")
        if e.nbytes:
            last_end, last_name = e.end, e.name
    if last_end != file_size:
        raise FormatError(f"{file_size - last_end} bytes after the last tensor belong to no "
                          "tensor (the data section must be covered exactly)")
    return metadata, entries
