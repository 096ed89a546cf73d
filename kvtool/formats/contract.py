"""Refuse every file a writer could not have written, before any array is read.

:func:`check_contract` runs after the schema checks of :mod:`kvtool.formats.header` and costs
O(header) time and memory. It checks what the schema alone cannot:

- every segment holds exactly the arrays its codec writes for the segment's shape and dtype
  (:meth:`kvtool.codecs.Codec.expected_arrays`), named as the writer names them, each stored
  tensor backing one segment only (no aliasing) and no tensor left unreferenced;
- the segments are the ones the file's policy produces (a codec edited in one segment only);
- the layers' shapes are those of the KV layout the model identity declares;
- the total decoded size stays under a limit relative to the file size (decode bombs).

Value ranges (finite norms and scales, int8 codes >= -127) need the data and are checked by the
reader as it decodes each segment (:func:`check_values`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np

from kvtool.codecs.abc import ArraySpec, Codec
from kvtool.errors import FormatError, KvtoolError
from kvtool.formats import constants as C
from kvtool.formats.container import Entry, is_int

SegmentSpecs = dict[tuple[int, str, int], dict[str, ArraySpec] | None]


def decoded_limit(file_bytes: int, max_decoded_bytes: int | None = None) -> tuple[int, str]:
    """The most bytes a file of ``file_bytes`` may decode to (see :data:`C.ENV_MAX_DECODED`),
    and what set it, in words."""
    if max_decoded_bytes is not None:
        return int(max_decoded_bytes), "the caller's limit"
    env = os.environ.get(C.ENV_MAX_DECODED, "").strip()
    if env:
        try:
            limit = int(float(env))
        except (ValueError, OverflowError):
            limit = 0
        if limit <= 0:  # the environment's fault, not the file's
            raise KvtoolError(f"{C.ENV_MAX_DECODED}={env[:40]!r} is not a positive number "
                              "of bytes")
        return limit, C.ENV_MAX_DECODED
    return (max(C.MIN_DECODED_LIMIT, C.MAX_DECODED_RATIO * file_bytes),
            f"{C.MAX_DECODED_RATIO}x the file size, at least {C.MIN_DECODED_LIMIT >> 20} MiB")


class Deadline:
    """Bounds the time spent validating one header (a cap on top of the size caps)."""

    def __init__(self, seconds: float = C.MAX_HEADER_SECONDS):
        self.end = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise FormatError(f"header too complex: validation took over "
                              f"{C.MAX_HEADER_SECONDS:.0f} s (corrupt or hostile file)")


def _check_budget(header: dict[str, Any], file_bytes: int, limit: int, given_by: str) -> None:
    """Refuse a file that would decode to over ``limit`` bytes (``given_by``: what set the
    limit, :func:`decoded_limit`)."""
    decoded = sum(prod(layer[r]["shape"]) * C.ITEMSIZE[layer[r]["dtype"]]
                  for layer in header[C.H_LAYERS] for r in C.ROLES)
    stored = sum(prod(t["shape"]) * C.ITEMSIZE[t["dtype"]]
                 for t in header[C.H_TENSORS].values())
    worst = max(decoded, stored)
    if worst > limit:
        raise FormatError(f"the file ({file_bytes} bytes) would decode to {worst} bytes, over "
                          f"the limit of {limit} ({given_by}); set {C.ENV_MAX_DECODED} "
                          "to a larger number of bytes if this cache is really that large")


def _check_arrays(where: str, parts: dict[str, str], expected: dict[str, ArraySpec],
                  table: dict[str, Any], codec_id: str) -> None:
    if set(parts) != set(expected):
        raise FormatError(f"{where}: codec {codec_id!r} writes arrays {sorted(expected)}, "
                          f"the file has {sorted(parts)}")
    for part, spec in expected.items():
        t = table[parts[part]]
        if t["dtype"] != spec.dtype or tuple(t["shape"]) != tuple(spec.shape):
            raise FormatError(f"tensor {parts[part]!r}: {t['dtype']}{list(t['shape'])} is not "
                              f"what codec {codec_id!r} writes ({spec.dtype}"
                              f"{list(spec.shape)})")


def _check_policy(header: dict[str, Any], codec_for: Callable[[dict], Codec | None]) -> None:
    """Every layer's segments are those its policy produces (same ranges, same codecs): the
    uniform ``policy`` and the per-layer ``layer_policy``, whichever the file carries."""
    for key in (C.H_POLICY, C.H_LAYER_POLICY):
        if header.get(key) is not None:
            _check_one_policy(header, key, codec_for)


def _check_one_policy(header: dict[str, Any], key: str,
                      codec_for: Callable[[dict], Codec | None]) -> None:
    from kvtool.errors import KvtoolError
    from kvtool.policy import CodecPolicy

    num_layers = header[C.H_NUM_LAYERS]
    try:
        policy = CodecPolicy.from_json(header[key])
        policy.check_layers(num_layers)
        if key == C.H_LAYER_POLICY and (not policy.layers or policy.num_layers != num_layers):
            raise ValueError(f"per-layer codecs for {policy.num_layers} layers, where the file "
                             f"has {num_layers}" if policy.layers else "no per-layer codecs")
    except (KvtoolError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"kvz header: invalid {key} ({str(e)[:120]})") from None
    for i, layer in enumerate(header[C.H_LAYERS]):
        for role in C.ROLES:
            info = layer[role]
            want = [(s.start, s.stop, s.codec.get_config())
                    for s in policy.segments(role, i, num_layers, info["shape"][1])]
            have = [(s["start"], s["stop"], codec_for(s["codec"]).get_config())
                    for s in info["segments"]]
            if have != want:
                raise FormatError(f"layer {i} {role}: its segments are not the ones the file's "
                                  f"policy ({policy.describe()[:120]}) produces")


def check_identity(header: dict[str, Any]) -> None:
    """The layers' shapes agree with the KV layout the model identity declares (when it does):
    a writer stores the arrays of the model it names."""
    from kvtool.identity import canonical_sha256, dtype_problem, valid_weights

    model = header[C.H_MODEL]
    problem = dtype_problem(model)
    if problem:
        raise FormatError(f"kvz header: {problem}")
    if not valid_weights(model.get("weights")):
        raise FormatError("kvz header: model.weights must be a sha256 hex digest or null")
    layout = model.get("layout")
    if isinstance(layout, dict) and "fingerprint" in model:
        if canonical_sha256(layout) != model["fingerprint"]:
            raise FormatError("kvz header: the model fingerprint does not match its layout")
    declared = {k: model.get(k) for k in ("num_layers", "num_kv_heads", "head_dim")}
    if isinstance(layout, dict):  # the fingerprinted layout declares them too, and must agree
        for name in declared:
            value = layout.get(name)
            if not is_int(value) or (name == "num_layers" and layout.get("num_kv_shared_layers")):
                continue
            if is_int(declared[name]) and declared[name] != value:
                raise FormatError(f"kvz header: the model's {name} is {declared[name]}, its "
                                  f"layout's {value}")
            declared[name] = value
    if is_int(declared["num_layers"]) and declared["num_layers"] != header[C.H_NUM_LAYERS]:
        raise FormatError(f"kvz header: {header[C.H_NUM_LAYERS]} layers, the model has "
                          f"{declared['num_layers']}")
    for i, layer in enumerate(header[C.H_LAYERS]):
        for role in C.ROLES:
            heads, _, dim = layer[role]["shape"]
            for name, have in (("num_kv_heads", heads), ("head_dim", dim)):
                if is_int(declared[name]) and declared[name] != have:
                    raise FormatError(f"layer {i} {role}: {name} {have}, the model has "
                                      f"{declared[name]}")
    if isinstance(layout, dict):
        _check_windows(layout, header.get(C.H_LAYER_INFO) or [])


def _check_windows(layout: dict[str, Any], info: list[Any]) -> None:
    """Sliding windows the layers declare are the model's (a layout written by
    :func:`kvtool.identity.kv_layout` names its window and, where they differ, each layer's
    type): a window it does not have would trim what every engine restores in full."""
    window, types = layout.get("sliding_window", ...), layout.get("layer_types", ...)
    for i, entry in enumerate(info):
        declared = entry.get("sliding_window") if isinstance(entry, dict) else None
        if declared is None:
            continue
        full = isinstance(types, list) and i < len(types) and types[i] == "full_attention"
        if full or (window is None and types in (None, ...)) or (
                is_int(window) and declared != window):
            raise FormatError(f"layer {i}: a sliding window of {declared} tokens, which the "
                              f"model (sliding_window {window}) does not have there")


def check_contract(header: dict[str, Any], entries: dict[str, Entry], file_bytes: int,
                   minor: int, codec_for: Callable[[dict], Codec | None],
                   max_decoded_bytes: int | None = None) -> SegmentSpecs:
    """Check the file against what its writer must have done; the expected arrays per segment.

    ``minor`` is the file's minor format version: a file of a newer minor version may carry
    tensors this reader does not know, which are then ignored instead of refused.
    ``codec_for`` returns None for a codec id that is not installed: such segments cannot be
    checked here (``None`` in the result), and decoding them fails.
    """
    deadline = Deadline()
    check_identity(header)
    if header.get(C.H_LAYER_POLICY) is not None and header.get(C.H_POLICY) is not None:
        raise FormatError("kvz header: a layer_policy is written only with policy null")
    _check_budget(header, file_bytes, *decoded_limit(file_bytes, max_decoded_bytes))
    table = header[C.H_TENSORS]
    owner: dict[str, str] = {}
    ids = header.get(C.H_TOKEN_IDS)
    if ids is not None:
        if ids["tensor"] != C.TOKENS_TENSOR:
            raise FormatError(f"kvz header: token ids must be stored as {C.TOKENS_TENSOR!r}")
        owner[C.TOKENS_TENSOR] = "token_ids"
    specs: SegmentSpecs = {}
    for i, layer in enumerate(header[C.H_LAYERS]):
        deadline.check()
        for role in C.ROLES:
            for j, seg in enumerate(layer[role]["segments"]):
                where = f"layer {i} {role} segment {j}"
                for part, name in seg["tensors"].items():
                    if name != C.tensor_name(i, role, j, part):
                        raise FormatError(f"{where}: tensor {name[:60]!r} for {part!r} is not "
                                          f"named {C.tensor_name(i, role, j, part)!r}")
                    if name in owner:
                        raise FormatError(f"tensor {name!r} backs both {owner[name]} and "
                                          f"{where}")
                    owner[name] = where
                codec = codec_for(seg["codec"])
                if codec is None:
                    specs[(i, role, j)] = None
                    continue
                expected = codec.expected_arrays(tuple(seg["shape"]), seg["dtype"])
                _check_arrays(where, seg["tensors"], expected, table, codec.codec_id)
                specs[(i, role, j)] = expected
    if minor <= C.FORMAT_MINOR:
        stray = (set(table) | set(entries)) - set(owner)
        if stray:
            raise FormatError(f"tensor {sorted(stray)[0][:60]!r} is stored but not used by any "
                              "segment")
        if None not in specs.values():
            _check_policy(header, codec_for)
    deadline.check()
    return specs


def check_values(name: str, arr: np.ndarray, spec: ArraySpec) -> None:
    """A stored array's values are in the range every writer keeps (see :class:`ArraySpec`)."""
    if arr.size == 0:
        return
    # isfinite, min and max run on fp16/bf16 as stored: no float32 copy of a raw tensor
    if spec.dtype in C.FLOAT_DTYPES and not np.isfinite(arr).all():
        raise FormatError(f"tensor {name!r} holds NaN or Inf, which no writer stores")
    if spec.low is not None and arr.min() < spec.low:
        raise FormatError(f"tensor {name!r} holds {arr.min()}, below the {spec.low} that "
                          "every writer keeps")
    if spec.high is not None and arr.max() > spec.high:
        raise FormatError(f"tensor {name!r} holds {arr.max()}, above the {spec.high} that "
                          "every writer keeps")
