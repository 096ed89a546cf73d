"""The ``kvz.header`` JSON: metadata checks (format, version, checksum) and schema validation.

Validation turns any malformed header into a one-line :class:`FormatError` before a reader uses
a number from it, and cross-checks every tensor the header names against the container entries.
Unknown keys are ignored (forward compatibility within major version 1).
"""

from __future__ import annotations

import re
from math import prod
from typing import Any

from kvtool.cache import every_layer_slides
from kvtool.errors import FormatError, NewerVersionError
from kvtool.formats import constants as C
from kvtool.formats.container import Entry, check_shape, crc32_hex, is_int, parse_json

#: ASCII decimal, no leading zero ("１" and "01" are not what a writer writes)
_VERSION_RE = re.compile(r"(0|[1-9][0-9]{0,5})(?:\.(0|[1-9][0-9]{0,5}))?")
_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
_PART_RE = re.compile(r"^[a-z0-9_]+$")
MAX_ELEMENTS_PER_BYTE = 64  # a segment decodes to at most this many elements per stored byte


def check_part_name(part: str, codec_id: str) -> None:
    if not isinstance(part, str) or not _PART_RE.match(part):
        raise FormatError(f"codec {codec_id!r} produced array name {part!r}; "
                          "names must be lower_snake_case")


def parse_version(version: str) -> tuple[int, int]:
    """``"1"`` → (1, 0), ``"1.2"`` → (1, 2); refuses a major version other than 1."""
    m = _VERSION_RE.fullmatch(version)
    if not m:
        raise FormatError(f"invalid .kvz format version {version[:20]!r}")
    major, minor = int(m.group(1)), int(m.group(2) or 0)
    if major != C.FORMAT_MAJOR:
        from kvtool import __version__

        newer = major > C.FORMAT_MAJOR
        error = NewerVersionError if newer else FormatError
        raise error(f".kvz format version {version} is not supported: kvtool "
                    f"{__version__} reads format version {C.FORMAT_MAJOR}"
                    f"{'; upgrade kvtool' if newer else ''}")
    return major, minor


def read_metadata(metadata: dict[str, str], verify: bool) -> dict[str, Any]:
    """Check ``kvz.format``/``kvz.format_version``/the header checksum; return the parsed header."""
    fmt = metadata.get(C.META_FORMAT)
    if fmt != C.FORMAT_NAME:
        raise FormatError("not a .kvz file: safetensors metadata lacks "
                          f"{C.META_FORMAT}={C.FORMAT_NAME!r}")
    version = metadata.get(C.META_FORMAT_VERSION)
    if version is None:
        raise FormatError(f"not a .kvz file: metadata lacks {C.META_FORMAT_VERSION}")
    parse_version(version)
    raw = metadata.get(C.META_HEADER)
    if raw is None:
        raise FormatError(f"corrupt .kvz file: metadata lacks {C.META_HEADER}")
    crc = metadata.get(C.META_HEADER_CRC32)
    if verify and crc is None:
        raise FormatError(f"corrupt .kvz file: metadata lacks {C.META_HEADER_CRC32}")
    if verify and crc32_hex(raw.encode("utf-8")) != crc:
        raise FormatError("checksum mismatch in the kvz header (file corrupted)")
    header = parse_json(raw, "kvz header")
    if not isinstance(header, dict):
        raise FormatError("kvz header is not a JSON object")
    return header


def _get(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str,
         optional: bool = False) -> Any:
    value = obj.get(key)
    if value is None and optional:
        return None
    if kind is int:
        ok = is_int(value) and value >= 0
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise FormatError(f"{where}: {key!r} missing or of the wrong type")
    return value


def _check_tensors(table: Any, entries: dict[str, Entry]) -> None:
    if not isinstance(table, dict):
        raise FormatError(f"kvz header: {C.H_TENSORS!r} missing or not an object")
    for name, t in table.items():
        where = f"tensor {name[:60]!r}"
        if not isinstance(t, dict):
            raise FormatError(f"{where}: entry is not an object")
        dtype = t.get("dtype")
        if not isinstance(dtype, str) or dtype not in C.ITEMSIZE:
            raise FormatError(f"{where}: unknown dtype {str(dtype)[:20]!r}")
        shape = check_shape(t.get("shape"), where)
        compression = t.get("compression", C.COMPRESSION_NONE)
        if compression not in C.COMPRESSIONS:
            raise FormatError(f"{where}: unknown compression {str(compression)[:20]!r}")
        if not isinstance(t.get(C.CHECKSUM_ALGORITHM), str) or not _CRC_RE.match(t["crc32"]):
            raise FormatError(f"{where}: missing or invalid crc32")
        entry = entries.get(name)
        if entry is None:
            raise FormatError(f"{where} is listed in the kvz header but missing from the file")
        nbytes = prod(shape) * C.ITEMSIZE[dtype]
        if compression == C.COMPRESSION_NONE:
            if entry.dtype != dtype or entry.shape != shape:
                raise FormatError(f"{where}: stored as {entry.dtype}{list(entry.shape)} but the "
                                  f"header says {dtype}{list(shape)}")
        elif entry.dtype != "uint8" or len(entry.shape) != 1 or (
                nbytes > entry.nbytes * C.MAX_ZSTD_RATIO + 4096):
            raise FormatError(f"{where}: invalid {compression} blob for {nbytes} bytes")


def _check_role(role: Any, where: str, num_tokens: int, table: dict[str, Any]) -> None:
    if not isinstance(role, dict):
        raise FormatError(f"{where}: missing or not an object")
    shape = check_shape(role.get("shape"), where)
    dtype = role.get("dtype")
    if len(shape) != 3 or dtype not in C.FLOAT_DTYPES:
        raise FormatError(f"{where}: shape must be [heads, tokens, head_dim] of fp32/fp16/bf16")
    heads, tokens, dim = shape
    if tokens > num_tokens or not 1 <= dim <= C.MAX_HEAD_DIM:
        raise FormatError(f"{where}: shape {list(shape)} is inconsistent with the file")
    segments = _get(role, "segments", list, where)
    pos = 0
    for j, seg in enumerate(segments):
        sw = f"{where} segment {j}"
        if not isinstance(seg, dict):
            raise FormatError(f"{sw}: not an object")
        start, stop = _get(seg, "start", int, sw), _get(seg, "stop", int, sw)
        if start != pos or stop <= start or stop > tokens:
            raise FormatError(f"{sw}: token range [{start}, {stop}) does not continue [0, {pos})")
        pos = stop
        if check_shape(seg.get("shape"), sw) != (heads, stop - start, dim) or (
                seg.get("dtype") != dtype):
            raise FormatError(f"{sw}: shape/dtype disagree with the layer")
        codec = _get(seg, "codec", dict, sw)
        if not isinstance(codec.get("id"), str):
            raise FormatError(f"{sw}: codec config lacks a string 'id'")
        parts = _get(seg, "tensors", dict, sw)
        if not parts:
            raise FormatError(f"{sw}: no tensors")
        stored = 0
        for part, name in parts.items():
            if not isinstance(name, str) or name not in table:
                raise FormatError(f"{sw}: tensor for {str(part)[:40]!r} is not in the header")
            t = table[name]
            stored += prod(t["shape"]) * C.ITEMSIZE[t["dtype"]]
        if heads * (stop - start) * dim > MAX_ELEMENTS_PER_BYTE * stored + 4096:
            raise FormatError(f"{sw}: {list(seg['shape'])} is too large for its "
                              f"{stored} stored bytes")
    if pos != tokens:
        raise FormatError(f"{where}: segments cover {pos} of {tokens} tokens")


def token_layout_problem(lengths: list[int], num_tokens: int, ids_count: int | None,
                         layer_info: list[Any] | None) -> str | None:
    """Why a cache's token counts disagree, or None: ``num_tokens`` is the longest layer's
    (where every layer has a sliding window, it MAY exceed it: the token ids' count), a shorter
    layer is a sliding-window one (``layer_info``: a ``sliding_window`` ≥ 1) that
    holds at least the last ``sliding_window - 1`` tokens (what the next step attends to), and
    the token ids, if any, are one per token. A file that breaks this loads but is wrong:
    its chunks would be keyed by ids that have no K/V, its restore would lack tokens."""
    longest = max(lengths, default=0)
    slid = num_tokens > longest and ids_count == num_tokens \
        and every_layer_slides(layer_info, len(lengths))  # no layer holds every token
    if num_tokens != longest and not slid:
        return f"num_tokens is {num_tokens}, but the longest layer holds {longest} tokens"
    infos = list(layer_info) if layer_info is not None else [None] * len(lengths)
    for i, (n, info) in enumerate(zip(lengths, infos, strict=False)):
        window = (info or {}).get("sliding_window")
        if window is not None and (not is_int(window) or window < 1):
            return f"layer {i}: sliding_window {str(window)[:20]} is not a positive integer"
        if n < num_tokens and window is None:
            return (f"layer {i} holds {n} of {num_tokens} tokens, but layer_info names no "
                    "sliding window for it")
        if window is not None and n < min(num_tokens, window - 1):
            return (f"layer {i} holds {n} of {num_tokens} tokens, fewer than its sliding "
                    f"window of {window} keeps (the last {window - 1}, all the next token sees)")
    if ids_count is not None and ids_count != num_tokens:
        return f"{ids_count} token ids for {num_tokens} tokens"
    return None


def check_store_chunk(chunk: Any, num_tokens: int, where: str) -> None:
    """A prefix-store chunk's place (optional): a chain key and a start that is a whole
    number of chunks (a chunk holds ``num_tokens`` tokens), as the store writes them."""
    if chunk is None:
        return
    if (not isinstance(chunk, dict) or not isinstance(chunk.get("key"), str)
            or not re.fullmatch(C.STORE_KEY_RE, chunk["key"]) or not is_int(chunk.get("start"))
            or chunk["start"] < 0 or num_tokens < 1 or chunk["start"] % num_tokens):
        raise FormatError(f"{where}: {C.H_STORE_CHUNK} must be {{\"key\": 64 lowercase hex "
                          "digits, \"start\": a multiple of num_tokens ≥ 0}")


def check_lossy_sources(sources: Any, where: str) -> None:
    """``lossy_sources`` as a writer records them (optional): a sorted list of distinct
    non-empty strings, present only when not empty."""
    if sources is ...:
        return
    if (not isinstance(sources, list) or not 1 <= len(sources) <= C.MAX_LOSSY_SOURCES
            or not all(isinstance(s, str) and 1 <= len(s) <= C.MAX_LOSSY_SOURCE_CHARS
                       for s in sources) or sources != sorted(set(sources))):
        raise FormatError(f"{where}: {C.H_LOSSY_SOURCES} must be a sorted list of 1 to "
                          f"{C.MAX_LOSSY_SOURCES} distinct strings of 1 to "
                          f"{C.MAX_LOSSY_SOURCE_CHARS} characters")


def validate_header(header: dict[str, Any], entries: dict[str, Entry]) -> None:
    """Validate the kvz header's schema and cross-check it with the container entries."""
    where = "kvz header"
    for key, kind in ((C.H_CREATOR, dict), (C.H_MODEL, dict), (C.H_TOKENIZER, dict)):
        _get(header, key, kind, where)
    fp = header[C.H_TOKENIZER].get("fingerprint")
    if fp is not None and not isinstance(fp, str):
        raise FormatError(f"{where}: tokenizer fingerprint must be a string or null")
    num_layers = _get(header, C.H_NUM_LAYERS, int, where)
    num_tokens = _get(header, C.H_NUM_TOKENS, int, where)
    if num_layers > C.MAX_LAYERS:
        raise FormatError(f"{where}: {num_layers} layers exceed the limit of {C.MAX_LAYERS}")
    if header.get(C.H_DTYPE) not in C.FLOAT_DTYPES:
        raise FormatError(f"{where}: 'dtype' must be float32, float16 or bfloat16")
    _get(header, C.H_POLICY, dict, where, optional=True)
    _get(header, C.H_LAYER_POLICY, dict, where, optional=True)
    table = header.get(C.H_TENSORS)
    _check_tensors(table, entries)
    ids = _get(header, C.H_TOKEN_IDS, dict, where, optional=True)
    if ids is not None:
        t = table.get(ids.get("tensor")) if isinstance(ids.get("tensor"), str) else None
        if (t is None or t["dtype"] not in C.TOKEN_DTYPES or len(t["shape"]) != 1
                or ids.get("count") != t["shape"][0]):
            raise FormatError(f"{where}: token_ids must name a 1-D int32/int64 tensor of "
                              "'count' elements")
    check_store_chunk(header.get(C.H_STORE_CHUNK), num_tokens, where)
    check_lossy_sources(header.get(C.H_LOSSY_SOURCES, ...), where)
    layers = _get(header, C.H_LAYERS, list, where)
    if len(layers) != num_layers:
        raise FormatError(f"{where}: {len(layers)} layers listed, num_layers is {num_layers}")
    info = _get(header, C.H_LAYER_INFO, list, where, optional=True)
    if info is not None and (len(info) != num_layers or not all(
            x is None or isinstance(x, dict) for x in info)):
        raise FormatError(f"{where}: layer_info must hold one object per layer")
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise FormatError(f"layer {i}: not an object")
        for role in C.ROLES:
            _check_role(layer.get(role), f"layer {i} {role}", num_tokens, table)
        if layer["key"]["shape"][:2] != layer["value"]["shape"][:2]:
            raise FormatError(f"layer {i}: keys and values disagree on heads or tokens")
    if layers and header[C.H_DTYPE] != layers[0]["key"]["dtype"]:
        raise FormatError(f"{where}: 'dtype' {header[C.H_DTYPE]} is not the first layer's "
                          f"{layers[0]['key']['dtype']} (what the writer records)")
    problem = token_layout_problem([layer["key"]["shape"][1] for layer in layers], num_tokens,
                                   None if ids is None else ids["count"], info)
    if problem:
        raise FormatError(f"{where}: {problem}")
