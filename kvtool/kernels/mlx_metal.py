"""Metal kernels for mlx arrays on Apple GPUs: a design with no kernels yet.

Nothing here runs. This module holds the plan and :func:`available`; until the kernels exist,
mlx arrays on every device go through :mod:`kvtool.kernels.mlx_ops` (array ops, with
``mx.compile`` on the elementwise hot paths). The kernels would be written with
``mx.fast.metal_kernel`` (Metal Shading Language bodies that mlx compiles and caches per
template), which needs a Metal device: on Linux it raises "No Metal back-end".

Ops
---
The same four entry points as :mod:`kvtool.kernels.triton_cuda`, so
:class:`~kvtool.codecs.turbo.TurboCodec` could use them without changes:

- ``turbo_encode(x[rows, D], bits, seed) -> (codes[rows, ceil(D*bits/8)] uint8, norms[rows])``:
  norm, rotation, normalisation, bucketize and bit packing in one pass;
- ``turbo_decode(codes, norms, D, bits, seed, dtype)``: unpack, centroid lookup, inverse
  rotation and scaling, written straight in the output dtype (float32, float16, bfloat16);
- ``turbo_scores(q[..., M, D], codes, norms, bits, seed) -> [..., M, N]``: ``q · k̂ᵀ`` without
  decoding keys. Rotate q once (``q Rᵀ``); then each score is the dot product of the rotated q
  with the key's centroids, times the key's norm;
- ``turbo_decode_attention(q, k_codes, k_norms, v_codes, v_norms, ...)``: one decode step of
  attention read from the codes (flash-decoding, split over tokens).

Threadgroup layout
------------------
One simdgroup (32 lanes) owns one vector; a threadgroup of 8 simdgroups (256 threads) takes 8
rows and the grid is ``ceil(rows / 8)`` threadgroups. For ``D = 32·k`` (k = 2, 4, 8 for D = 64,
128, 256) lane ``l`` holds coordinates ``l·k … l·k + k − 1`` in registers (one ``float2``,
``float4`` or two ``float4`` loads, coalesced across the simdgroup). The norm is a per-lane sum
of squares and one ``simd_sum``. No threadgroup memory and no barriers in encode or decode.
Head dims that are not a power of two (a dense Gram–Schmidt rotation) or not a multiple of 32
stay on mlx_ops' matmul.

Walsh–Hadamard butterflies on simdgroups
-----------------------------------------
The rotation of :mod:`kvtool.codecs.rotation` applied to a row vector is
``y = x·Rᵀ = H(s₂ ⊙ H(s₁ ⊙ x)) / D``, with ``H`` the unnormalised Walsh–Hadamard transform; it
has ``log2(D)`` butterfly stages, each pairing coordinates ``i`` and ``i ^ h``:

- stages with ``h < k`` pair two registers of the same lane: plain adds and subtracts;
- stages with ``h ≥ k`` pair lane ``l`` with lane ``l ^ (h / k)``: each lane reads its
  partner's register with ``simd_shuffle_xor(v, h / k)`` and keeps ``v + p`` if its bit
  ``h / k`` is clear, else ``p − v``. That is 5 shuffle stages for any D ≤ 256.

The signs ``s₁``, ``s₂`` are two bit masks per seed (D bits each) passed as a small constant
buffer; each lane flips its k values with an XOR of the sign bit into the float. Decoding
applies ``R`` itself, ``x = s₁ ⊙ H(s₂ ⊙ H(y)) / D``: the same stages, each sign flip after its
transform instead of before. The sums run in another
order than the matmul of the reference, so as with the numba kernels a coordinate within float
rounding of a bin boundary may take the neighbouring code; tests compare with near-boundary
tolerance.

Packed-code layout
------------------
Exactly :mod:`kvtool.kernels.bitpack`'s: codes of a row LSB-first, back to back, ``ceil(D·bits/8)``
bytes, so files and caches written by any backend decode on Metal and back. Lane ``l``'s k codes
fill bits ``[l·k·bits, (l+1)·k·bits)`` of the row:

- bits 2 and 4 (k·bits a multiple of 8): every lane writes its own whole bytes;
- bits 3: a packing group is 8 codes in 3 bytes, so ``8 / k`` neighbouring lanes form a group
  (2 lanes at D = 128); the lower lane gathers the others' 12-bit fields with
  ``simd_shuffle_down`` and stores the 3 bytes, the other lanes store nothing.

Decoding reverses this: each lane loads the bytes of its group, shifts out its k codes and
looks them up in the 2**bits centroids held in constant memory (≤ 16 floats). Norms are stored
as fp16 by lane 0; the host keeps turbo's checks on them (NaN/Inf input makes its norm NaN).

Scores and decode attention
---------------------------
``turbo_scores``: one threadgroup per (batch·kv head, tile of 256 tokens); the M rotated query
rows of the kv head's group (GQA) sit in threadgroup memory (M·D floats). Each simdgroup walks
its tokens; per token, lanes unpack their k key codes once, multiply with the matching k
coordinates of every query, reduce with ``simd_sum`` and scale by the key norm.

``turbo_decode_attention``: grid (batch·kv heads, splits), splits chosen so that about twice the
GPU's core count of threadgroups run. Per split: scores as above, an online softmax per query
(running max and sum in registers), and the value sum accumulated in the *rotated* basis
(``Σ pᵢ‖vᵢ‖·cᵢ`` over centroid vectors ``cᵢ``), since the rotation is linear. A second small
kernel merges the splits (max-rescaled sums) and rotates each output back once with the
butterflies: one inverse rotation per query instead of one per token. Centred keys add
``q·μ`` (the same for every token of a segment) and centred values add ``μ`` after the merge.

Selection
---------
:func:`kvtool.kernels.compiled_for` returns None for mlx arrays today. With kernels, it would
return this module for an mlx array when :func:`available` is true, the default stream is on
the GPU and ``supported(D, bits)`` holds (power-of-two D in 64..256, bits 2..4), and None under
``KVTOOL_KERNELS=reference``; turbo's ``_kernels`` check is the same as for numba and Triton.
Kernel objects would be built once per (op, bits, D, dtype) with ``mx.fast.metal_kernel`` and
cached; tests would compare them with mlx_ops on Apple hardware with the near-boundary rule of
``tests/test_compiled_kernels.py``.
"""

from __future__ import annotations

name = "metal"


def available() -> bool:
    """Whether a Metal device is present (False on Linux, and where mlx is not installed)."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return bool(mx.metal.is_available())


__all__ = ["name", "available"]
