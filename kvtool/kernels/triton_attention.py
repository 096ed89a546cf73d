"""Split-K flash-decoding attention straight from turbo and scalar ``turbomix`` codes (Triton:
CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

A turbo key is ``k̂ = ‖k‖ · c @ R`` (``c``: the centroids its codes name), so a score is
``‖k‖ · (q @ Rᵀ)·c``: each program rotates its queries once and every score is a dot product of
a rotated query with centroids looked up in a 4..16-entry fp16 table. Values are summed in the
rotated domain, ``Σ p ‖v‖ c``, and rotated back once per part. Code rows are read as 32-bit
words (3 words hold 32 three-bit codes) and split into codes by join trees that keep each code
in the thread that loaded it; 3- and 4-bit centroids are then looked up in registers with PTX
``prmt`` on byte planes of the table (no memory access per code; 2-bit codes still load from
the table), and 3-bit tiles pair two rows per thread where the tile allows, so their centroids
reach shared memory for ``tl.dot`` 16 bytes at a time. Compiled for sm_90 that is ~62
warp-instructions per token of a KV head for turbo3 at head_dim 128 (BLOCK_N 64, 4 warps),
against ~89 with a table load per code (``benchmarks/attention_sass.py``).

One kernel per call, :func:`_attend_kernel` (its steps:
:mod:`kvtool.kernels.triton_attention_steps`), one program per (batch · KV head, part). A call
is a single launch because at decode sizes the host's launch cost, not the device, sets the
time (three launches cost ~200 µs of host time on an H200, the kernels ~30 µs at 8K tokens).

- A program starts from the raw queries: ``scale · q @ R_cᵀ`` for its part's key rotation
  ``c`` (turbomix's candidates) and ``scale · q`` for exact tokens and key means, in fp32
  accuracy.
- The ``G`` query heads of the KV head times the ``Q`` query tokens (``G·Q ≤``
  :func:`max_rows`, padded to 16 rows) are the M side of ``tl.dot``, so ``q·kᵀ`` and ``p·v``
  run on tensor cores with fp16 operands (rotated query, centroids, ``p·‖v‖``; ~6e-4 relative
  error) and fp32 accumulation.
- An encoded part is a token range of one *group*: with candidates the blocks are sorted by
  their (value, key) rotation pair (once per store change, in ``triton_attention_store``), so
  a program reads one key rotation and one value rotation; centered keys add ``q·mean`` per
  token (the block's fp16 mean against the scaled query in two fp16 pieces). The part ends by
  rotating its value sum back with its ``R`` (exact in bf16, the sum in two bf16 pieces).
- The last parts attend the exact tokens (sinks, window, this forward's tokens) in the
  unrotated domain — an accumulator of their own, in fp32 accuracy (16-bit K/V times the fp32
  operand in 16-bit pieces) — with an optional additive bias and the causal rule among the new
  tokens.
- Each program writes its part's softmax state, then takes a ticket (a gpu-scope ``acq_rel``
  atomic on a per-KV-head counter); the program that draws the last ticket merges the parts of
  its KV head's rows and normalises (split-K's reduce, without a second launch).

The token tile, ``num_warps`` and ``num_stages`` of the kernel are autotuned per shape on GPUs
(results cached on disk where Triton can), fixed under the interpreter. Only uncentered
turbo2/3/4 and scalar ``turbomix`` codes with fp16 norms are read here (centered keys too);
outlier channels, ``vq=2``, trellis and ``norm_bits=8`` codes are decoded by their callers,
then attended.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import torch

from kvtool.kernels.bitpack import group_shape
from kvtool.kernels.triton_attention_steps import _codes_part, _exact_part, _finish_part
from kvtool.kernels.triton_attention_store import Store, prepare
from kvtool.kernels.triton_cuda import BITS, DIMS, _codebook, _mm, _rotation, _split, supported
from kvtool.kernels.triton_launch import (
    EXACT_SPLIT,
    Launcher,
    Plans,
    Signature,
    StreamScratch,
    exact_key,
    plan_token,
)
from kvtool.kernels.triton_support import (
    INTERPRET,
    _jit,
    _persisted,
    _sm_count,
    available,
    cdiv,
    next_power_of_2,
)

try:
    import triton
    import triton.language as tl
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    #: what a kernel that does not build here raises (callers decode, then attend)
    BUILD_ERRORS: tuple[type[Exception], ...] = (CompilationError, OutOfResources)
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    BUILD_ERRORS = ()

name = "triton"
MAX_ROWS = 64  # query rows (query heads per KV head × query tokens) one program holds
_EXACT = (torch.float16, torch.bfloat16, torch.float32)
_MIN_SPLIT = 256  # fewest encoded tokens worth a part of their own
#: the warps the interpreter's tiles are laid out for: 3-bit tiles pair rows at head_dim ≥ 128
#: (``BLOCK_N · D ≥ 2048 · WARPS``), as on GPUs where a thread holds two rows' codes
_INTERPRET_WARPS = 1


def _tuned(fn: Any) -> Any:
    """Autotune the token tile, warps and pipelining of the kernel on GPUs, keyed on its shape
    (fixed tile under the interpreter); ``size_class`` (:func:`_size_class`) keeps short parts
    apart from long ones and a grid that leaves SMs idle apart from one that fills them
    (tuned apart, compiled once: it is not specialised on).
    Two-stage configs let the next tile's code words load while this one is scored."""
    if triton is None or INTERPRET:
        return _jit(fn)
    configs = [triton.Config({"BLOCK_N": n, "WARPS": w}, num_warps=w, num_stages=1)
               for n, w in ((16, 4), (32, 4), (64, 4), (32, 8), (64, 8), (128, 8))]
    configs += [triton.Config({"BLOCK_N": n, "WARPS": w}, num_warps=w, num_stages=2)
                for n, w in ((32, 4), (64, 4), (64, 8))]
    return triton.autotune(configs, key=["MP", "D", "KBITS", "VBITS", "CK", "CV", "CENTERED",
                                         "BLOCK", "size_class"],
                           prune_configs_by={"early_config_prune": _prune}, **_persisted())(
        triton.jit(fn, do_not_specialize=["size_class"]))


def _footprint(config: Any, dim: int, rows: int) -> float:
    """fp32-equivalent values per thread of a tile's centroids, scores and value sum."""
    n = config.kwargs["BLOCK_N"]
    return (n * dim + rows * dim + rows * n) / (32 * config.num_warps)


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Up to 32 query rows, every config: each builds for sm_90 (Triton 3.6) with at most 40
    bytes of spills, and the tiles that pair rows (``BLOCK_N`` 64 with 4 warps at head_dim 128)
    are the cheapest per token now that codes are unpacked in registers
    (``benchmarks/attention_sass.py --all-configs``). At 64 rows, tiles of ≤ 64 values per
    thread, else the smallest: larger 3-bit ones do not build (Triton's dot-operand pass
    rejects their shared layout)."""
    dim = kwargs.get("D", named_args.get("D", 128))
    rows = kwargs.get("MP", named_args.get("MP", 16))
    if rows <= 32:
        return configs
    keep = [c for c in configs if _footprint(c, dim, rows) <= 64]
    return keep or [min(configs, key=lambda c: _footprint(c, dim, rows))]


# -- kernels -------------------------------------------------------------------------------------
@_tuned
def _attend_kernel(q_ptr, krt_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, kcent_ptr, vcent_ptr,
                   order_ptr, goff_ptr, mean_ptr, vr_ptr, ke_ptr, ve_ptr, bias_ptr, m_ptr, l_ptr,
                   acc_ptr, count_ptr, out_ptr, N, NBLK, X, S, E, hkv, nq, hq, R, bias_b, sb, sh,
                   sn, scale, size_class, MP: tl.constexpr, D: tl.constexpr,
                   KBITS: tl.constexpr, KCPG: tl.constexpr, KBPG: tl.constexpr,
                   VBITS: tl.constexpr, VCPG: tl.constexpr, VBPG: tl.constexpr,
                   KWORDS: tl.constexpr, VWORDS: tl.constexpr, CK: tl.constexpr,
                   CV: tl.constexpr, SORTED: tl.constexpr, CENTERED: tl.constexpr,
                   BLOCK: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_X: tl.constexpr, ROT_N: tl.constexpr, BK: tl.constexpr,
                   PCH: tl.constexpr, BLOCK_N: tl.constexpr, WARPS: tl.constexpr):
    """One (batch · KV head, part): encoded parts first (CK·CV groups × S splits), then E exact
    parts. Writes the part's (max, sum, value sum) per row, the value sum unrotated; the KV
    head's last program to finish (a ticket in ``count_ptr``) merges them into ``out``."""
    bh = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    coded = CK * CV * S
    rows = tl.arange(0, MP)
    rmask = rows < R
    out = (bh * (coded + E) + part) * R + rows
    if part < coded:
        m_i, l_i, acc = _codes_part(q_ptr, krt_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, kcent_ptr,
                                    vcent_ptr, order_ptr, goff_ptr, mean_ptr, bh, part, N, NBLK,
                                    S, R, nq, hq, sb, sh, sn, scale, MP, D, KBITS, KCPG, KBPG,
                                    VBITS, VCPG, VBPG, KWORDS, VWORDS, CK, CV, SORTED, CENTERED,
                                    BLOCK, BK, BLOCK_N, WARPS)
        # back from the value rotation: acc @ R_c (R exact in bf16, acc in two bf16 pieces)
        hi, mid, lo = _split(acc, 2)
        rot = vr_ptr + (part // S // CK) * D * D
        for n0 in range(0, D, ROT_N):  # a loop, not unrolled: fewer live registers
            o = _mm(tl.zeros([MP, ROT_N], tl.float32), hi, mid, lo, rot, 0, n0, D, D, ROT_N, 2)
            tl.store(acc_ptr + out[:, None] * D + (n0 + tl.arange(0, ROT_N))[None, :], o,
                     mask=rmask[:, None])
    else:
        m_i, l_i, acc = _exact_part(q_ptr, ke_ptr, ve_ptr, bias_ptr, bh, part - coded, X, E, hkv,
                                    nq, R, bias_b, hq, sb, sh, sn, scale, MP, D, CAUSAL,
                                    HAS_BIAS, BLOCK_X)
        tl.store(acc_ptr + out[:, None] * D + tl.arange(0, D)[None, :], acc,
                 mask=rmask[:, None])
    _finish_part(m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr, out, rmask, m_i, l_i, bh, coded + E, R,
                 hkv, nq, D, PCH)


_LAUNCH = Launcher(_attend_kernel)


# -- host side -----------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _rotations(dim: int, seeds: tuple[int, ...], device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Rᵀ stacked [C, D, D], R stacked [C, D, D]) in bf16 (exact) for the candidates' seeds."""
    rots = [_rotation(dim, s, device) for s in seeds]
    return (torch.stack([r.rtb for r in rots]).contiguous(),
            torch.stack([r.rb for r in rots]).contiguous())


@lru_cache(maxsize=32)
def _table(dim: int, bits: int, device: torch.device) -> torch.Tensor:
    """The codebook's centroids in fp16 (the lookup table of the code tiles)."""
    return _codebook(dim, bits, device)[1].to(torch.float16)


def _splits(device: torch.device, programs: int, tokens: int) -> int:
    """Parts per group: as many programs as fit four to an SM, never more (on an H200, 9 splits
    of 64 KV heads — 576 programs for 528 — took 630 µs at 32K tokens where 8 took 555, a
    partial last wave), and none shorter than :data:`_MIN_SPLIT` tokens."""
    want = max(1, 4 * _sm_count(device) // max(1, programs))
    return max(1, min(want, cdiv(tokens, _MIN_SPLIT)))


def _size_class(device: torch.device, programs: int, per_part: int) -> int:
    """The autotune key's shape class: how many tokens a part holds (< 1024, < 8192, more)
    and how the grid fills the GPU (fewer programs than SMs, fewer than three per SM, more).
    The best tile depends on both: a program alone on its SM wants more warps than one of four
    sharing it, and a forced ``split_k`` (a split-K sweep) changes the grid, not the parts'
    class alone, so without the second a sweep reused the choice of another grid."""
    sms = _sm_count(device)
    fill = int(programs >= sms) + int(programs >= 3 * sms)
    return 3 * fill + int(per_part >= 1024) + int(per_part >= 8192)


def max_rows(dim: int) -> int:
    """Most query rows per KV head (query heads per KV head × query tokens) :func:`attend`
    takes at head_dim ``dim`` (their value sums stay in registers)."""
    return MAX_ROWS if dim <= 128 else MAX_ROWS // 2


class _Plan(NamedTuple):
    """What a call's shapes and options decide (checked once per distinct signature)."""

    hkv: int
    rows: int
    split_k: int
    parts: int
    exact_parts: int
    size_class: int
    k_rt: torch.Tensor
    v_r: torch.Tensor
    k_table: torch.Tensor
    v_table: torch.Tensor
    constants: dict[str, Any]  # KWORDS/VWORDS: rows of whole 32-bit words (pointers: per store)
    token: int  # this plan's part of its launches' keys


_PLANS = Plans()


def _plan(q: torch.Tensor, store: Store, ke: torch.Tensor | None, ve: torch.Tensor | None,
          bias: torch.Tensor | None, causal: bool, split_k: int | None,
          out_dtype: torch.dtype) -> _Plan:
    """Check a call's query, exact tokens and options against its store (ValueError on a bad
    one) and work out its launch."""
    dim = store.dim
    if q.ndim != 4 or q.shape[-1] != dim:
        raise ValueError(f"attention from codes: q must be [B, Hq, Q, {dim}], got "
                         f"{tuple(q.shape)}")
    batch, hq, nq, _ = q.shape
    heads, n = store.heads, store.tokens
    if batch == 0 or heads % batch or hq % max(1, heads // batch) or not heads:
        raise ValueError(f"attention from codes: {heads} code rows do not hold the KV heads "
                         f"of {hq} query heads × batch {batch}")
    hkv = heads // batch
    rows = hq // hkv * nq
    if rows > max_rows(dim):
        raise ValueError(f"attention from codes: {rows} query rows per KV head (query heads "
                         f"per KV head × query tokens), at most {max_rows(dim)} at dim {dim}")
    x = 0 if ke is None else ke.shape[2]
    if (ke is None) != (ve is None) or (ke is not None and (
            tuple(ke.shape) != (batch, hkv, x, dim) or ve.shape != ke.shape
            or ke.dtype not in _EXACT or ve.dtype != ke.dtype)):
        raise ValueError("attention from codes: exact keys/values must both be "
                         f"[{batch}, {hkv}, X, {dim}] of one float dtype")
    if out_dtype not in _EXACT:
        raise ValueError(f"attention from codes: out_dtype must be one of {_EXACT}, got "
                         f"{out_dtype}")
    if bias is not None and (bias.ndim != 3 or bias.shape[0] not in (1, batch)
                             or tuple(bias.shape[1:]) != (nq, x)):
        raise ValueError(f"attention from codes: bias {tuple(bias.shape)} is not "
                         f"[1 or {batch}, {nq}, {x}]")
    device = q.device
    ck, cv = len(store.k_seeds), len(store.v_seeds)
    groups = ck * cv
    if split_k is None:
        split_k = _splits(device, heads * groups, cdiv(n, groups))
    if not 1 <= split_k <= 65535 // max(1, groups):
        raise ValueError(f"split_k must be in 1..{65535 // groups}, got {split_k}")
    exact_parts = cdiv(x, EXACT_SPLIT)
    parts = groups * split_k + exact_parts
    if parts > 65535:  # the grid's second axis
        raise ValueError(f"attention from codes: {groups} x split_k {split_k} parts of the "
                         f"encoded tokens and {exact_parts} of the exact ones pass 65535")
    per_part = n // max(1, groups * split_k)
    kcpg, kbpg = group_shape(store.k_bits)
    vcpg, vbpg = group_shape(store.v_bits)
    sorted_ = groups > 1
    blocked = sorted_ or store.key_means is not None
    constants = dict(
        MP=max(16, next_power_of_2(rows)), D=dim, KBITS=store.k_bits, KCPG=kcpg, KBPG=kbpg,
        VBITS=store.v_bits, VCPG=vcpg, VBPG=vbpg, KWORDS=store.k_codes.shape[-1] % 4 == 0,
        VWORDS=store.v_codes.shape[-1] % 4 == 0, CK=ck, CV=cv, SORTED=sorted_,
        CENTERED=store.key_means is not None, BLOCK=store.block if blocked else 1,
        CAUSAL=bool(causal) and nq > 1, HAS_BIAS=bias is not None, BLOCK_X=16,
        ROT_N=min(dim, 32), BK=min(32, dim, 4096 // dim),
        PCH=min(next_power_of_2(parts), 64, 8192 // dim),
        **({"BLOCK_N": 16, "WARPS": _INTERPRET_WARPS} if INTERPRET else {}))
    return _Plan(hkv, rows, split_k, parts, exact_parts,
                 _size_class(device, heads * parts, per_part),
                 _rotations(dim, store.k_seeds, device)[0],
                 _rotations(dim, store.v_seeds, device)[1], _table(dim, store.k_bits, device),
                 _table(dim, store.v_bits, device), constants, plan_token())


#: the parts' scratch and the KV heads' tickets, shared by the launches of a stream on GPUs
#: (under the interpreter a kernel runs on the calling thread: scratch of its own per call)
_SCRATCH = StreamScratch(shared=not INTERPRET)


def attend(q: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor,
           v_codes: torch.Tensor, v_norms: torch.Tensor, ke: torch.Tensor | None = None,
           ve: torch.Tensor | None = None, *, dim: int, k_bits: int, v_bits: int,
           k_seeds: Sequence[int], v_seeds: Sequence[int], scale: float,
           bias: torch.Tensor | None = None, causal: bool = False,
           k_rotations: torch.Tensor | None = None, v_rotations: torch.Tensor | None = None,
           key_means: torch.Tensor | None = None, block: int = 0,
           split_k: int | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Softmax attention of ``q`` over encoded tokens and exact ones: ``[B, Q, Hq, D]`` (the
    layout attention functions return) in ``out_dtype`` (fp32 accumulation, one rounding).

    ``q`` [B, Hq, Q, D] (any float dtype, strided); ``k_codes``/``v_codes`` uint8 packed codes
    [B·Hkv, N, D·bits/8] and ``k_norms``/``v_norms`` float [B·Hkv, N] of the N encoded tokens,
    which every query sees; ``k_seeds``/``v_seeds``: the rotation seed of each candidate
    (turbo: one). With several candidates or ``key_means``, tokens come in blocks of ``block``:
    ``k_rotations``/``v_rotations`` (uint8 [B·Hkv, N / block], each < its candidates; None:
    candidate 0) name each block's rotation and ``key_means`` (fp16 values [B·Hkv, N / block,
    D]) its keys' mean. ``ke``/``ve`` [B, Hkv, X, D] (fp16, bf16 or fp32): the exact tokens, the
    Q new ones last; exact token j is visible to query i unless ``causal`` and
    ``j > X − Q + i``; ``bias`` (float [1 or B, Q, X], additive, ``-inf`` hides) is added to
    exact scores. ``split_k``: parts per rotation group (default: enough to fill the GPU).

    :func:`prepare` then :func:`attend_store`: a caller that attends over the same encoded
    tokens again (every layer of a decode step, every step until its store changes) keeps
    the :class:`Store` and calls :func:`attend_store`.
    """
    store = prepare(k_codes, k_norms, v_codes, v_norms, dim=dim, k_bits=k_bits, v_bits=v_bits,
                    k_seeds=k_seeds, v_seeds=v_seeds, k_rotations=k_rotations,
                    v_rotations=v_rotations, key_means=key_means, block=block)
    return attend_store(q, store, ke, ve, scale=scale, bias=bias, causal=causal,
                        split_k=split_k, out_dtype=out_dtype)


def attend_store(q: torch.Tensor, store: Store, ke: torch.Tensor | None = None,
                 ve: torch.Tensor | None = None, *, scale: float,
                 bias: torch.Tensor | None = None, causal: bool = False,
                 split_k: int | None = None, out_dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """:func:`attend` over a :class:`Store` (:func:`prepare`). What the shapes decide (checks,
    split, constants) is worked out once per distinct signature (:func:`_plan`; the exact
    tokens' count is not part of it, see ``triton_launch.exact_key``), and the launch is keyed
    by that plan (``triton_launch``'s ``fixed`` keys)."""
    key = (q.shape, q.dtype, q.device, store.signature, exact_key(ke, ve, bias), bool(causal),
           split_k, out_dtype)
    plan = _PLANS.get(key, lambda: _plan(q, store, ke, ve, bias, causal, split_k, out_dtype))
    batch, hq, nq, dim = q.shape
    heads, n = store.heads, store.tokens
    if q.stride(-1) != 1:
        q = q.contiguous()
    constants = plan.constants
    words = store.words
    if not (words[0] and words[1]):  # rows at an odd address are read byte by byte
        constants = {**constants, "KWORDS": constants["KWORDS"] and words[0],
                     "VWORDS": constants["VWORDS"] and words[1]}
    states = heads * plan.parts * plan.rows
    work, tickets = _SCRATCH.get(q.device, states * (dim + 2), heads)  # tickets at zero
    out = torch.empty((batch, nq, hq, dim), dtype=out_dtype, device=q.device)
    strides = q.stride()
    _LAUNCH((heads, plan.parts), (
        q, plan.k_rt, store.k_codes, store.k_norms, store.v_codes, store.v_norms,
        plan.k_table, plan.v_table, store.order, store.offsets,
        store.k_codes if store.key_means is None else store.key_means, plan.v_r,
        *((q, q) if ke is None else (ke.contiguous(), ve.contiguous())),
        q if bias is None else bias.to(torch.float32).contiguous(),
        work, work[states:], work[2 * states:], tickets, out,
        n, store.blocks, 0 if ke is None else ke.shape[2], plan.split_k, plan.exact_parts,
        plan.hkv, nq, hq, plan.rows,
        1 if bias is None else bias.shape[0], strides[0], strides[1], strides[2],
        float(scale), plan.size_class), constants, tuned=plan.size_class,
        fixed=(plan.token, words, strides))
    return out


def turbo_decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor,
                           v_codes: torch.Tensor, v_norms: torch.Tensor, *, dim: int,
                           k_bits: int, k_seed: int, v_bits: int, v_seed: int, scale: float,
                           split_k: int | None = None) -> torch.Tensor:
    """Split-K decode attention straight from turbo codes: ``softmax(q·k̂ᵀ·scale)·v̂`` → fp32
    ``[B, Hq, D]`` for q ``[B, Hq, D]``, codes ``[B, Hkv, N, nbytes]``, norms ``[B, Hkv, N]``
    (the signature and semantics of :func:`kvtool.kernels.triton_cuda.turbo_decode_attention`;
    ``split_k``: token splits). A call whose layout (shapes, strides, dtypes, devices,
    options) was seen before skips the checks and reuses its store's signature (and so its
    launch plan): the layers of a decode step attend over as many tokens each, so all but the
    first make such a call, and at batch 1 the host's work, not the kernel, sets the time."""
    layout = (q.shape, q.dtype, q.device, *(
        (t.shape, t.stride(), t.dtype, t.device) for t in (k_codes, k_norms, v_codes, v_norms)),
        dim, k_bits, k_seed, v_bits, v_seed, split_k)
    hit = _TURBO_LAYOUTS.get(layout)
    if hit is None:
        store = _turbo_store(q, k_codes, k_norms, v_codes, v_norms, dim, k_bits, k_seed,
                             v_bits, v_seed, split_k)
        if len(_TURBO_LAYOUTS) >= 64:
            _TURBO_LAYOUTS.clear()
        _TURBO_LAYOUTS[layout] = (store.signature, all(
            t.is_contiguous() for t in (k_codes, k_norms, v_codes, v_norms)))
    else:
        signature, dense = hit
        b, hkv, n = k_codes.shape[:3]
        if dense:  # the kernel reads pointers: the [B, Hkv, ...] tensors serve as they are
            kc, kn, vc, vn = k_codes, k_norms, v_codes, v_norms
        else:
            kc, vc = (t.reshape(b * hkv, n, -1).contiguous() for t in (k_codes, v_codes))
            kn, vn = (t.reshape(b * hkv, n).contiguous() for t in (k_norms, v_norms))
        store = Store(kc, kn, vc, vn, dim, k_bits, v_bits, (k_seed,), (v_seed,), None, 0, 1,
                      kc, kc, (kc.data_ptr() % 4 == 0, vc.data_ptr() % 4 == 0), signature,
                      b * hkv, n)
    return attend_store(q.unsqueeze(2), store, scale=scale, split_k=split_k).squeeze(1)


#: turbo_decode_attention's checked call layouts: their stores' signatures, and whether the
#: four code and norm tensors are contiguous
_TURBO_LAYOUTS: dict[tuple[Any, ...], tuple[Signature, bool]] = {}


def _turbo_store(q: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor,
                 v_codes: torch.Tensor, v_norms: torch.Tensor, dim: int, k_bits: int,
                 k_seed: int, v_bits: int, v_seed: int, split_k: int | None) -> Store:
    """:func:`turbo_decode_attention`'s checks (ValueError on a bad call) and its store."""
    for bits in (k_bits, v_bits):
        if not supported(dim, bits):
            raise ValueError(f"triton turbo kernels support dims {DIMS} and bits {BITS}, "
                             f"got dim={dim} bits={bits}")
    if q.ndim != 3 or k_codes.ndim != 4:
        raise ValueError("decode attention: inconsistent q/k/v shapes")
    b, hq, d = q.shape
    hkv, n = k_codes.shape[1], k_codes.shape[2]
    if (d != dim or hq % hkv or n == 0 or tuple(k_codes.shape) != (b, hkv, n, dim * k_bits // 8)
            or tuple(v_codes.shape) != (b, hkv, n, dim * v_bits // 8)
            or tuple(k_norms.shape) != (b, hkv, n) or tuple(v_norms.shape) != (b, hkv, n)):
        raise ValueError("decode attention: inconsistent q/k/v shapes")
    if split_k is not None and not 1 <= split_k <= 65535:
        raise ValueError(f"split_k must be in 1..65535, got {split_k}")
    if any(t.device != q.device for t in (k_codes, k_norms, v_codes, v_norms)):
        raise ValueError("decode attention: q, codes and norms must be on one device")
    return prepare(k_codes.reshape(b * hkv, n, -1), k_norms.reshape(b * hkv, n),
                   v_codes.reshape(b * hkv, n, -1), v_norms.reshape(b * hkv, n), dim=dim,
                   k_bits=k_bits, v_bits=v_bits, k_seeds=(k_seed,), v_seeds=(v_seed,))


__all__ = ["BUILD_ERRORS", "MAX_ROWS", "INTERPRET", "Store", "attend", "attend_store", "available",
           "max_rows", "name", "prepare", "supported", "turbo_decode_attention"]
