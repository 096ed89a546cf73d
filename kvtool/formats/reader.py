"""Reading .kvz files: :class:`KvzFile` (mmap-based, lazy per layer) and :func:`load`.

Every failure caused by the file's content is a one-line :class:`FormatError`.

``device=`` asks for torch tensors on a device. On CUDA each segment's arrays, checked on the
host, move there first (turbo codes and norms: an eighth to a quarter of fp16's bytes) and the
codec decodes them there (Triton kernels where Triton is installed): no host decode, no compiled
CPU kernel to load or compile, no decoded K/V crossing the bus. Other devices get the host
decode, moved.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from math import prod
from typing import Any

import numpy as np

from kvtool.cache import KVCache, cast_label, check_prefix, merge_sources
from kvtool.codecs import Codec, Encoded, get_codec
from kvtool.errors import (
    CodecError,
    CodecVersionError,
    FormatError,
    KvtoolError,
    MissingCodecError,
    NewerVersionError,
    UnknownCodecError,
    not_the_files,
)
from kvtool.fileio import check_input_file
from kvtool.formats import constants as C
from kvtool.formats.container import Entry, crc32_hex, np_dtype, parse_container
from kvtool.formats.contract import check_contract, check_values
from kvtool.formats.header import parse_version, read_metadata, validate_header
from kvtool.kernels import kernel_mode, ops_for, to_torch

BACKENDS = ("numpy", "torch")
#: device types whose segments are decoded on the device (the arrays moved there first); tests
#: add "cpu" to take that path without a GPU
DECODE_ON_DEVICE = ("cuda",)


class KvzFile:
    """An open .kvz file. Reads only the bytes a call needs; use as a context manager."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True,
                 max_decoded_bytes: int | None = None):
        self.path = os.fspath(path)
        self.verify_checksums = verify
        self._codecs: dict[str, Codec] = {}
        check_input_file(self.path)  # a FIFO or device is refused without opening it
        self._file = open(self.path, "rb")  # closed by close()
        try:
            self.file_bytes = os.fstat(self._file.fileno()).st_size
            self._mm = (mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
                        if self.file_bytes else None)
            metadata, self._entries = parse_container(self._read_at, self.file_bytes)
            self.metadata = metadata
            self.header = read_metadata(metadata, verify)
            validate_header(self.header, self._entries)
            self.format_version = metadata[C.META_FORMAT_VERSION]
            self._specs = check_contract(self.header, self._entries, self.file_bytes,
                                         parse_version(self.format_version)[1],
                                         self._installed_codec, max_decoded_bytes)
        except FormatError as e:
            self.close()
            raise type(e)(f"{self.path}: {e}") from None
        except BaseException:
            self.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self._mm.close()
            self._mm = None
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> KvzFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KvzFile({self.path!r}, layers={self.num_layers}, tokens={self.num_tokens}, "
                f"codecs={sorted(self._codec_ids())})")

    # -- header views ------------------------------------------------------------------------------
    @property
    def policy_unchecked(self) -> str | None:
        """Why the header's policy was not checked against the segments, which a reader does
        only in a format minor it implements and with every codec installed (None: checked,
        or no policy). Decoding reads the segments either way."""
        if self.header.get(C.H_POLICY) is None and self.header.get(C.H_LAYER_POLICY) is None:
            return None
        if parse_version(self.format_version)[1] > C.FORMAT_MINOR:
            return f"format {self.format_version} is newer than this reader's"
        if None in self._specs.values():
            return "a segment's codec is not installed"
        return None

    @property
    def num_layers(self) -> int:
        return self.header[C.H_NUM_LAYERS]

    @property
    def num_tokens(self) -> int:
        return self.header[C.H_NUM_TOKENS]

    @property
    def model(self) -> dict[str, Any]:
        return self.header[C.H_MODEL]

    @property
    def tokenizer_fingerprint(self) -> str | None:
        return self.header[C.H_TOKENIZER].get("fingerprint")

    @property
    def layer_info(self) -> list[dict[str, Any] | None] | None:
        return self.header.get(C.H_LAYER_INFO)

    @property
    def store_chunk(self) -> dict[str, Any] | None:
        """A prefix-store chunk's place (``key``, ``start``) as its writer recorded it; None
        for any other file (and for chunks written before kvtool recorded it)."""
        return self.header.get(C.H_STORE_CHUNK)

    @property
    def token_ids(self) -> np.ndarray | None:
        ids = self.header.get(C.H_TOKEN_IDS)
        if ids is None:
            return None
        out = self.read_tensor(ids["tensor"]).astype(np.int64)
        if out.size and out.min() < 0:  # no tokenizer makes one; a store would key by it
            raise FormatError(f"{self.path}: token id {int(out.min())} is negative")
        return out

    def lossy_sources(self, dtype: str | None = None) -> list[str]:
        """What made this file's K/V (decoded as ``dtype``) differ from those computed: the
        lossy steps its header records before its codecs, its own lossy codecs and every
        cast to a dtype that does not hold the model's (:func:`~kvtool.cache.cast_label`).
        Empty: exact in the model's dtype."""
        from kvtool.identity import identity_dtype

        computed = identity_dtype(self.model) or self.header[C.H_DTYPE]
        found = [*self.header.get(C.H_LOSSY_SOURCES, []),
                 cast_label(computed, C.normalize_dtype(dtype))]
        for layer in self.header[C.H_LAYERS]:
            for role in C.ROLES:
                found.append(cast_label(computed, layer[role]["dtype"]))
                for seg in layer[role]["segments"]:
                    codec = seg["codec"]
                    found.append(codec["id"] if codec["id"] != "raw" else cast_label(
                        computed, codec.get("dtype") or layer[role]["dtype"]))
        return merge_sources(found)

    def _role(self, i: int, role: str) -> dict[str, Any]:
        i = _index(i)
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range: the file has {self.num_layers} layers")
        if role not in C.ROLES:
            raise ValueError(f"role must be 'key' or 'value', got {role!r}")
        return self.header[C.H_LAYERS][i][role]

    def _codec_ids(self) -> set[str]:
        return {seg["codec"]["id"] for layer in self.header[C.H_LAYERS] for r in C.ROLES
                for seg in layer[r]["segments"]}

    # -- raw tensor access -------------------------------------------------------------------------
    def _read_at(self, offset: int, size: int) -> bytes:
        if self._mm is None:
            return b""
        return self._mm[offset:offset + size]

    def _stored(self, entry: Entry) -> np.ndarray:
        if self._mm is None:
            raise FormatError(f"{self.path}: file is closed")
        return np.frombuffer(self._mm, np.uint8, entry.nbytes, entry.begin).copy()

    def read_tensor(self, name: str, verify: bool | None = None) -> np.ndarray:
        """One tensor, decompressed, checksum-verified, with its logical dtype and shape."""
        info = self.header[C.H_TENSORS].get(name)
        if info is None:
            raise FormatError(f"{self.path}: no tensor {name!r}")
        stored = self._stored(self._entries[name])
        if self.verify_checksums if verify is None else verify:
            if crc32_hex(stored) != info[C.CHECKSUM_ALGORITHM]:
                raise FormatError(f"{self.path}: checksum mismatch in tensor {name!r} "
                                  "(file corrupted)")
        dtype, shape = np_dtype(info["dtype"]), tuple(info["shape"])
        if info.get("compression", C.COMPRESSION_NONE) == C.COMPRESSION_ZSTD:
            stored = _unzstd(stored, prod(shape) * dtype.itemsize, f"{self.path}: tensor {name!r}")
        elif info.get("compression") == C.COMPRESSION_RANS:
            stored = _unrans(stored, prod(shape) * dtype.itemsize, f"{self.path}: tensor {name!r}")
        return stored.view(dtype).reshape(shape)

    def codec(self, config: dict[str, Any]) -> Codec:
        """The codec of a segment's config (cached); a FormatError if it is invalid here."""
        try:
            return self._codec(config)
        except FormatError as e:
            raise type(e)(f"{self.path}: {e}") from None

    def _installed_codec(self, config: dict[str, Any]) -> Codec | None:
        """The codec, or None where its id is not installed here (a plugin's file can still be
        inspected; decoding its segments fails)."""
        try:
            return self._codec(config)
        except MissingCodecError:
            return None

    def _codec(self, config: dict[str, Any]) -> Codec:
        key = repr(sorted(config.items()))
        if key not in self._codecs:
            try:
                self._codecs[key] = get_codec(config)
            except CodecVersionError as e:
                raise NewerVersionError(str(e)) from None
            except UnknownCodecError as e:
                raise MissingCodecError(str(e)) from None
            except CodecError as e:
                raise FormatError(str(e)) from None
            except Exception as e:  # a plugin's constructor rejecting a corrupt config
                raise FormatError(f"invalid config for codec {config.get('id')!r}: "
                                  f"{type(e).__name__}: {e}") from None
            missing = sorted(set(self._codecs[key].get_config()) - set(config))
            if missing:  # filled from this reader's defaults, which a later one may change
                del self._codecs[key]
                raise FormatError(f"the config of codec {config.get('id')!r} lacks "
                                  f"{', '.join(map(repr, missing))}: a writer records every "
                                  "parameter, so a file never depends on a reader's defaults")
        return self._codecs[key]

    # -- encoded and decoded layers ----------------------------------------------------------------
    def encoded(self, i: int, role: str, *, tokens: int | None = None
                ) -> list[tuple[dict[str, Any], Encoded]]:
        """``(segment_info, Encoded)`` of layer ``i``'s ``role`` (segments before ``tokens``)."""
        out = []
        for j, seg in enumerate(self._role(i, role)["segments"]):
            if tokens is not None and seg["start"] >= tokens:
                break
            specs = self._specs[(i, role, j)]
            if specs is None:  # a codec that is not installed: the error names it
                self.codec(seg["codec"])
            arrays = {}
            for part, name in seg["tensors"].items():
                arrays[part] = self.read_tensor(name)
                try:
                    check_values(name, arrays[part], specs[part])
                except FormatError as e:
                    raise FormatError(f"{self.path}: {e}") from None
            try:
                self.codec(seg["codec"]).check_stored(arrays)
                _check_widened(seg, arrays)
            except CodecError as e:
                raise FormatError(f"{self.path}: layer {i} {role} segment {j}: {e}") from None
            out.append((seg, Encoded(arrays, tuple(seg["shape"]), seg["dtype"])))
        return out

    def _decode_role(self, i: int, role: str, dtype: str | None, backend: str,
                     tokens: int | None, device: Any = None) -> Any:
        info = self._role(i, role)
        heads, total, dim = info["shape"]
        check_prefix(i, total, self.num_tokens, tokens)
        n = total if tokens is None else min(tokens, total)
        out_dtype = dtype or info["dtype"]
        # decodes to fp16 saturate: a file of wider values read as fp16 decodes to float32 first,
        # so that a value past fp16's range is refused rather than clipped
        narrowing = out_dtype == "float16" and info["dtype"] != "float16"
        decode_dtype = "float32" if narrowing else out_dtype
        on_device = _decodes_on(device)
        kernel_mode()  # a bad KVTOOL_KERNELS is the environment's error, not the file's
        parts = []
        for seg, enc in self.encoded(i, role, tokens=n):  # checked on the host, then moved
            codec = self.codec(seg["codec"])
            try:
                if backend == "torch":
                    enc = enc.to_torch(device if on_device else None)
                x = codec.decode(enc, decode_dtype)
            except Exception as e:
                if not_the_files(e):
                    raise
                raise FormatError(f"{self.path}: layer {i} {role}: codec {codec.codec_id!r} "
                                  f"could not decode tokens {seg['start']}..{seg['stop']}: "
                                  f"{type(e).__name__}: {str(e)[:120]}") from None
            if tuple(x.shape) != tuple(seg["shape"]):
                raise FormatError(f"{self.path}: layer {i} {role}: codec "
                                  f"{codec.codec_id!r} decoded shape {tuple(x.shape)}, "
                                  f"expected {tuple(seg['shape'])}")
            parts.append(x[:, : n - seg["start"]] if seg["stop"] > n else x)
        out = _concat(parts, (heads, n, dim), decode_dtype, backend,
                      device if on_device else None)
        if narrowing:
            xp = ops_for(out)
            out = xp.astype(out, "float16")
            if not xp.all_finite(out):  # past fp16's range: inf where the file holds a number
                raise KvtoolError(f"{self.path}: layer {i} {role} holds values past float16's "
                                  "65504: read it as bfloat16 or float32")
        return out if on_device or device is None else out.to(device)

    def layer(self, i: int, dtype: str | None = None, backend: str | None = None, *,
              tokens: int | None = None, device: Any = None) -> tuple[Any, Any]:
        """Decoded ``(keys, values)`` of layer ``i``, reading only that layer's bytes
        (``device``: torch tensors there, see the module docstring)."""
        dtype, backend = C.normalize_dtype(dtype), _check_backend(backend, device)
        tokens = self._prefix(tokens)
        return tuple(self._decode_role(i, r, dtype, backend, tokens, device) for r in C.ROLES)

    def _prefix(self, tokens: Any) -> int | None:
        """``tokens`` checked as a prefix length of this file (None: every token)."""
        if tokens is None:
            return None
        tokens = _count(tokens, "tokens")
        if not 0 <= tokens <= self.num_tokens:
            raise ValueError(f"prefix of {tokens} tokens from a file of {self.num_tokens}")
        return tokens

    def to_cache(self, *, layers: Iterable[int] | None = None, tokens: int | None = None,
                 backend: str | None = None, dtype: str | None = None,
                 progress: bool = False, device: Any = None) -> KVCache:
        """Decode into a :class:`KVCache` (``layers``: a subset; ``tokens``: a prefix)."""
        from tqdm.auto import tqdm

        dtype, backend = C.normalize_dtype(dtype), _check_backend(backend, device)
        index = list(range(self.num_layers)) if layers is None else [_index(i) for i in layers]
        for i in index:
            self._role(i, "key")
        if len(index) == self.num_layers and index != list(range(self.num_layers)):
            # a cache of every layer saves as the model's (a subset does not): reordered or
            # repeated, layer j would restore into another's place
            raise ValueError(f"layers lists {self.num_layers} layers, as many as the file "
                             f"holds, but not each once in order: {str(index)[:60]}")
        tokens = self._prefix(tokens)
        keys, values = [], []
        for i in tqdm(index, desc="decoding", unit="layer", disable=not progress, leave=False):
            k, v = self.layer(i, dtype, backend, tokens=tokens, device=device)
            keys.append(k)
            values.append(v)
        ids = self.token_ids
        if ids is not None and tokens is not None:
            ids = ids[:tokens]
        info = self.layer_info
        try:
            return KVCache(keys, values, token_ids=ids, model=dict(self.model),
                           tokenizer_fingerprint=self.tokenizer_fingerprint,
                           layer_info=None if info is None else [info[i] for i in index],
                           lossy_sources=self.lossy_sources(dtype))
        except ValueError as e:
            raise FormatError(f"{self.path}: {e}") from None

    # -- checks and summaries ----------------------------------------------------------------------
    def verify(self) -> list[str]:
        """Check every checksum, zstd blob and codec; a list of problems (empty: all good)."""
        from kvtool.formats.info import verify_file

        return verify_file(self)

    def info(self) -> dict[str, Any]:
        """Everything ``kvtool inspect --json`` prints."""
        from kvtool.formats.info import file_info

        return file_info(self)


def _count(n: Any, what: str) -> int:
    """``n`` as an int: an integer, not a float (2.5 was a slice error) or bool (True read as
    1)."""
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"{what} must be an integer, got {n!r}")
    return n.__index__()


def _check_widened(seg: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """A ``raw`` segment stored wider than its role (``raw:dtype=float32`` in a float16 role)
    holds the role's values converted, exactly: any other value is one no writer stores, and
    the file would read as exact while a read in the role's dtype rounds or clips it."""
    codec, role = seg["codec"], seg["dtype"]
    if codec["id"] != "raw" or codec.get("dtype") != "float32" or role == "float32":
        return
    data = arrays["data"]
    with np.errstate(over="ignore"):
        same = np.array_equal(data.astype(np_dtype(role)).astype(np.float32), data)
    if not same:
        raise CodecError(f"raw float32 data holds values that are not {role} values, which its "
                         f"{role} role's writer stores exactly")


def _index(i: Any) -> int:
    """A layer index: an integer, not a float (1.7 was read as layer 1), bool or string."""
    if isinstance(i, bool) or not hasattr(i, "__index__"):
        raise TypeError(f"layer indices must be integers, got {i!r}")
    return i.__index__()


def _check_backend(backend: str | None, device: Any = None) -> str:
    """``backend``, default numpy (torch where a ``device`` is asked for)."""
    backend = backend or ("numpy" if device is None else "torch")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if device is not None and backend != "torch":
        raise ValueError(f"device={device!r} needs backend='torch' (numpy arrays live on the "
                         "host)")
    if device is not None:
        import torch

        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise KvtoolError(f"device={device!r}: this torch has no CUDA device (the file is "
                              "not at fault)")
    return backend


def _decodes_on(device: Any) -> bool:
    """Whether segments bound for ``device`` are decoded there (:data:`DECODE_ON_DEVICE`)."""
    if device is None:
        return False
    import torch

    return torch.device(device).type in DECODE_ON_DEVICE


def _unzstd(blob: np.ndarray, size: int, where: str) -> np.ndarray:
    import zstandard

    try:
        params = zstandard.get_frame_parameters(blob)
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
            raise FormatError(f"{where}: the zstd frame names no content size, which every "
                              "writer's does")
        if params.content_size != size:
            raise FormatError(f"{where}: zstd frame holds {params.content_size} bytes, "
                              f"expected {size}")
        # one frame, whole: zstd checks its output against the size just checked
        frame = zstandard.ZstdDecompressor().decompressobj()
        out = frame.decompress(blob)
        if not frame.eof or frame.unused_data:
            raise FormatError(f"{where}: the tensor is not one whole zstd frame ("
                              + ("bytes follow it" if frame.eof else "it is cut short") + ")")
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: corrupt zstd data ({e})") from None
    if len(out) != size:
        raise FormatError(f"{where}: zstd data decompressed to {len(out)} bytes, expected {size}")
    return np.frombuffer(out, np.uint8).copy() if size else np.zeros(0, np.uint8)


def _unrans(blob: np.ndarray, size: int, where: str) -> np.ndarray:
    from kvtool.codecs import entropy

    try:
        return entropy.decode(blob, size)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None


def _concat(parts: list[Any], shape: tuple[int, int, int], dtype: str, backend: str,
            device: Any = None) -> Any:
    if not parts:
        empty = np.zeros(shape, np_dtype(dtype))
        return to_torch(empty, device) if backend == "torch" else empty
    if len(parts) == 1:
        return parts[0].contiguous() if backend == "torch" else np.ascontiguousarray(parts[0])
    if backend == "torch":
        import torch

        return torch.cat(parts, dim=1)
    return np.concatenate(parts, axis=1)


def open_kvz(path: str | os.PathLike, *, verify: bool = True,
             max_decoded_bytes: int | None = None) -> KvzFile:
    """Open a .kvz file for lazy access (header parsed and validated; no tensor read yet).

    ``max_decoded_bytes`` overrides the decode-bomb limit (default: 64x the file size, at
    least 64 MiB, or ``$KVTOOL_MAX_DECODED_BYTES``).
    """
    return KvzFile(path, verify=verify, max_decoded_bytes=max_decoded_bytes)


def load(path: str | os.PathLike, *, layers: Iterable[int] | None = None,
         tokens: int | None = None, backend: str | None = None, dtype: str | None = None,
         verify: bool = True, progress: bool = False,
         max_decoded_bytes: int | None = None, device: Any = None) -> KVCache:
    """Read a .kvz file into a :class:`KVCache`.

    ``layers`` selects a subset, ``tokens=N`` a prefix of N tokens (only the segments it needs
    are read), ``backend`` "numpy" (default) or "torch", ``dtype`` the output dtype (default: the
    saved one), ``verify`` checks every checksum it reads. ``device`` (e.g. ``"cuda"``) returns
    torch tensors there; a CUDA device decodes on the GPU (module docstring).
    """
    with open_kvz(path, verify=verify, max_decoded_bytes=max_decoded_bytes) as f:
        return f.to_cache(layers=layers, tokens=tokens, backend=backend, dtype=dtype,
                          progress=progress, device=device)
