"""Attention straight from ``turbomix`` codes of every option on Triton: outlier channels,
``vq=2`` pairs, trellis codes, uint8 norms, centered keys and values (the ``balanced`` and
``small`` presets; CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

The companion of :mod:`kvtool.kernels.triton_attention` (turbo and scalar ``turbomix`` codes)
and the device twin of :mod:`kvtool.kernels.numba_attention_parts`, which is its reference. A
key of block ``b`` is ``k̂[ch_p] = ‖k_p‖ · (y_p @ R_p) + mean[ch_p]`` per part ``p`` (the
outlier channels and the rest, each with the block's own channel set and rotation candidate),
so a score is ``Σ_p ‖k_p‖ · (R_p q[ch_p])·y_p + q·mean``. Every block has its own channels,
rotations and means, so the work splits by block, in one launch of :func:`_parts_kernel`, one
program per (batch · KV head, part) (one launch: at decode sizes the host's launch cost sets
the time; the host-side rotations and merge this replaced were ~100 torch ops per call):

- a block's program gathers each key part's query channels and rotates them into the block's
  domain, ``scale · q[ch_p] @ R_cᵀ`` (to ~16 bits: the leading terms of bf16 pieces of both;
  the fp16 dots after it err by ~6e-4), and takes
  ``q·mean`` for centered keys;
- it scores the block's tokens from the codes (each part's unit values unpacked and looked up
  as ``turbomix``'s decode does, fp16 tensor-core dots with the rotated query, times the
  token's norm) with the softmax local to the block, and sums each value part in its rotated
  domain (``p · ‖v_p‖`` in fp16 against the values, fp32 sums; ~6e-4 relative error, as the
  turbo kernel);
- it rotates each value sum back with its block's ``R`` and stores it in the part's channels
  (plus the softmax weight times the value mean);
- the last parts attend the exact tokens (sinks, window, this forward's tokens) as
  :mod:`kvtool.kernels.triton_attention` does, with the additive bias and the causal rule
  among the new tokens;
- the program that draws a KV head's last ticket merges its parts by their maxima.

The token tile and warps are autotuned per shape on GPUs (results cached where Triton can).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch

from kvtool.kernels.triton_attention_steps import (
    _exact_part,
    _finish_part,
    _query_rows,
    _query_src,
)
from kvtool.kernels.triton_launch import (
    EXACT_SPLIT,
    Launcher,
    Plans,
    Signature,
    StreamScratch,
    exact_key,
    plan_token,
)
from kvtool.kernels.triton_support import INTERPRET, _jit, _persisted, available, next_power_of_2
from kvtool.kernels.triton_turbomix import (
    QUANTIZERS,
    channel_sets_of,
    norm_values,
    word_aligned,
)
from kvtool.kernels.triton_turbomix_steps import _dot, _rot, _rot_cols, _split, _values
from kvtool.kernels.triton_turbomix_tables import _rotations, _seeds, _tables, _width

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

name = "triton"
MAX_ROWS = 64  # query rows (query heads per KV head × query tokens) one program holds
_TABLE = {"scalar": "cent", "pair": "pts", "trellis": "slv"}  # each quantiser's value table


@dataclass(frozen=True)
class RoleTensors:
    """One role's (keys' or values') encoded tokens on the device for :func:`attend`: ``E``
    tokens of ``heads`` = batch · KV heads rows in blocks of ``block``; one entry per part
    (the other channels, then the outlier channels when there are any)."""

    codec: Any
    codes: tuple[torch.Tensor, ...]  # uint8 [heads, E, bytes_p]
    norms: tuple[torch.Tensor, ...]  # float32 [heads, E]
    channels: tuple[torch.Tensor, ...]  # int32 [heads · blocks, n_p], or [1, D]: every block's
    bits: tuple[int, ...]
    choice: torch.Tensor | None  # int32 [heads, blocks]: each block's candidate (None: one)
    mean: torch.Tensor | None  # float32 [heads, blocks, D] (None: uncentered)
    block: int

    @property
    def heads(self) -> int:
        return int(self.codes[0].shape[0])

    @property
    def tokens(self) -> int:
        return int(self.codes[0].shape[1])

    @cached_property
    def launch_parts(self) -> tuple[tuple[list[Any], torch.Tensor, torch.Tensor, dict[str, int]],
                                    ...]:
        """Per part 0 and 1: its kernel arguments but the rotation (codes, norms, value table,
        channels, channel stride per block), its Rᵀ and R pieces and its constants; part 1 of
        a codec without outliers is a placeholder of width 0 (part 0's arguments, unread).
        Worked out once: a store builds its views once per change and attends with them at
        every layer and step."""
        out = []
        for p in range(len(self.codes)):
            channels, bits = self.channels[p], self.bits[p]
            n, device = channels.shape[-1], self.codes[p].device
            quantizer = getattr(self.codec, "quantizer", "scalar")
            seeds = _seeds(self.codec) if hasattr(self.codec, "candidates") \
                else (int(self.codec.seed),)
            rt, r, pieces = _rotations(n, seeds, device)
            out.append(([self.codes[p], self.norms[p], _tables(n, bits, quantizer, device)[
                _TABLE[quantizer]], channels, n if channels.shape[0] > 1 else 0], rt, r,
                {"N": n, "NP": _width(n), "NB": self.codes[p].shape[-1], "B": bits,
                 "RP": pieces}))
        if len(out) == 1:
            out.append((out[0][0], out[0][1], out[0][2],
                        {"N": 0, "NP": 16, "NB": 1, "B": 2, "RP": 1}))
        return tuple(out)

    @cached_property
    def signature(self) -> Signature:
        """What :func:`attend`'s checks and constants read of this role: its part of a plan
        key (a store's views are rebuilt when it changes, so this is worked out once). With
        the tensors' dtypes it fixes every argument of a launch but their addresses."""
        return Signature(self.heads, self.tokens, self.block, self.choice is not None,
                         None if self.mean is None else self.mean.shape[-1],
                         sum(c.shape[-1] for c in self.channels),
                         getattr(self.codec, "quantizer", "scalar"),
                         tuple(tuple(meta.values()) for *_, meta in self.launch_parts),
                         tuple(t.dtype for t in (*self.codes, *self.norms, *self.channels,
                                                 self.choice, self.mean) if t is not None))


def role_tensors(codec: Any, arrays: dict[str, torch.Tensor], heads: int, tokens: int,
                 block: int, dim: int) -> RoleTensors:
    """:class:`RoleTensors` of a ``turbomix`` (or ``turbo``) codec's arrays, where they are,
    for ``heads`` rows of ``tokens`` encoded tokens in blocks of ``block`` (the arrays of the
    codec's encode, the blocks joined: ``codes`` [heads, tokens, bytes] and so on). No host
    sync: the store's arrays come from this process's encode."""
    blocks = tokens // block
    groups = heads * blocks
    sets = channel_sets_of(codec, arrays, groups, dim, check=False)
    bits = (codec.bits, getattr(codec, "outlier_bits", 0))[:len(sets)]
    norms = []
    for suffix in ("", "_hi")[:len(sets)]:
        raw = arrays["norms" + suffix].reshape(groups, block)
        if getattr(codec, "norm_bits", 16) == 8:
            raw = norm_values(raw, arrays["norm_range" + suffix].reshape(groups, 2),
                              check=False)
        norms.append(raw.float().reshape(heads, tokens).contiguous())
    codes = [word_aligned(arrays["codes" + s].reshape(heads, tokens, -1))
             for s in ("", "_hi")[:len(sets)]]
    choice = arrays["rotation"].reshape(heads, blocks).int().contiguous() \
        if "rotation" in arrays else None
    mean = arrays["mean"].reshape(heads, blocks, dim).float().contiguous() \
        if "mean" in arrays else None
    return RoleTensors(codec, tuple(codes), tuple(norms),
                       tuple(s.int().contiguous() for s in sets), bits, choice, mean, block)


# -- launch helpers ------------------------------------------------------------------------------
def _tuned(fn: Any) -> Any:
    """Autotune the token tile and warps on GPUs, keyed on the shape (fixed tile under the
    interpreter)."""
    if triton is None or INTERPRET:
        return _jit(fn)
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=1)
               for n, w in ((16, 4), (32, 4), (16, 8), (32, 8), (64, 8))]
    return triton.autotune(configs, key=["MP", "D", "KNP0", "KNP1", "VNP0", "VNP1", "KQ", "VQ",
                                         "KB0", "KB1", "VB0", "VB1", "BLOCK"],
                           prune_configs_by={"early_config_prune": _prune}, **_persisted())(
        triton.jit(fn))


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Tiles of at most 32 unit values per thread, else the smallest: compiled for sm_90
    (Triton 3.6), ``balanced`` and ``small`` at head_dim 128 spill at most 24 bytes in every
    config up to that (``benchmarks/attention_sass.py --preset``; each trellis code is one
    window of bytes and one table load)."""
    def per_thread(c: Any) -> float:
        width = max(kwargs.get(k, named_args.get(k, 128)) for k in ("KNP0", "VNP0"))
        return c.kwargs["BLOCK_N"] * width / (32 * c.num_warps)

    keep = [c for c in configs if per_thread(c) <= 32]
    return keep or [min(configs, key=per_thread)]


# -- kernels -------------------------------------------------------------------------------------
@_jit
def _part_query(q_ptr, ch_ptr, rt_ptr, bh, R, nq, hq, sb, sh, sn, scale, N: tl.constexpr,
                NP: tl.constexpr, RP: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr):
    """fp16 ``scale · q[ch] @ R_cᵀ`` [MP, NP] of a key part (``ch_ptr``: the block's N
    channels; ``rt_ptr``: its candidate's Rᵀ pieces), rotated to ~16 bits."""
    rmask = tl.arange(0, MP) < R
    src = _query_src(q_ptr, bh, R, nq, hq, sb, sh, sn, MP)
    acc = tl.zeros([MP, NP], tl.float32)
    for k0 in tl.static_range(0, NP, BK):
        j = k0 + tl.arange(0, BK)
        ch = tl.load(ch_ptr + j, mask=j < N, other=0)
        x = tl.load(src[:, None] + ch[None, :], mask=rmask[:, None] & (j < N)[None, :],
                    other=0.0).to(tl.float32)
        acc = _rot(acc, x, rt_ptr, k0, N, NP, BK, RP, False)  # ~16 bits: fp16 next
    return (acc * scale).to(tl.float16)


@_jit
def _scores(s, q, row_ptr, norm_ptr, tok, tmask, table_ptr, N: tl.constexpr,
            NP: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """``s + ‖k_p‖ · q_p · y_p`` for one key part of the tile's tokens."""
    y = _values(row_ptr, tmask, tl.arange(0, NP), table_ptr, table_ptr, table_ptr, N, NB,
                BITS, QUANT, BLOCK_N, NP)
    part = _dot(q, tl.trans(y.to(tl.float16)), tl.zeros(s.shape, tl.float32))
    return s + part * tl.load(norm_ptr + tok, mask=tmask, other=0.0)[None, :]


@_jit
def _value_sum(acc, p, row_ptr, norm_ptr, tok, tmask, table_ptr, N: tl.constexpr,
               NP: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """``acc + (p · ‖v_p‖) @ y_p`` for one value part of the tile's tokens."""
    y = _values(row_ptr, tmask, tl.arange(0, NP), table_ptr, table_ptr, table_ptr, N, NB,
                BITS, QUANT, BLOCK_N, NP)
    pv = p * tl.load(norm_ptr + tok, mask=tmask, other=0.0)[None, :]
    return _dot(pv.to(tl.float16), y.to(tl.float16), acc)


@_jit
def _put_values(acc, l_i, dst, rmask, ch_ptr, r_ptr, mean_ptr, N: tl.constexpr,
                NP: tl.constexpr, RP: tl.constexpr, CENTERED: tl.constexpr, MP: tl.constexpr,
                BN: tl.constexpr):
    """Store a value part's sum ``acc`` [MP, NP] rotated back, ``acc @ R_c`` (to ~16 bits,
    far below the fp16 dots' ~6e-4), in its channels of the rows at ``dst`` [MP], plus ``l_i``
    times the block's mean there."""
    hi, mid, lo = _split(acc)
    for n0 in tl.static_range(0, NP, BN):
        j = n0 + tl.arange(0, BN)
        ch = tl.load(ch_ptr + j, mask=j < N, other=0)
        o = _rot_cols(hi, mid, lo, r_ptr, n0, MP, N, NP, BN, RP, False)
        if CENTERED:
            o += l_i[:, None] * tl.load(mean_ptr + ch, mask=j < N, other=0.0)[None, :]
        tl.store(dst[:, None] + ch[None, :], o, mask=rmask[:, None] & (j < N)[None, :])


@_tuned
def _parts_kernel(q_ptr, kc0_ptr, kn0_ptr, kt0_ptr, kch0_ptr, kcs0, kr0_ptr, kc1_ptr, kn1_ptr,
                  kt1_ptr, kch1_ptr, kcs1, kr1_ptr, vc0_ptr, vn0_ptr, vt0_ptr, vch0_ptr, vcs0,
                  vr0_ptr, vc1_ptr, vn1_ptr, vt1_ptr, vch1_ptr, vcs1, vr1_ptr, kpick_ptr,
                  vpick_ptr, kmean_ptr, vmean_ptr, ke_ptr, ve_ptr, bias_ptr,
                  m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr, NBLK, X, E, hkv, nq, hq, R,
                  bias_b, sb, sh, sn, scale, MP: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr, KPICK: tl.constexpr, VPICK: tl.constexpr,
                  KCENTERED: tl.constexpr, VCENTERED: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_X: tl.constexpr, PCH: tl.constexpr,
                  KQ: tl.constexpr, KN0: tl.constexpr, KNP0: tl.constexpr, KNB0: tl.constexpr,
                  KB0: tl.constexpr, KRP0: tl.constexpr, KN1: tl.constexpr,
                  KNP1: tl.constexpr, KNB1: tl.constexpr, KB1: tl.constexpr,
                  KRP1: tl.constexpr, VQ: tl.constexpr, VN0: tl.constexpr,
                  VNP0: tl.constexpr, VNB0: tl.constexpr, VB0: tl.constexpr,
                  VRP0: tl.constexpr, VN1: tl.constexpr, VNP1: tl.constexpr,
                  VNB1: tl.constexpr, VB1: tl.constexpr, VRP1: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """One (batch · KV head, part): the NBLK blocks first (one each), then E exact parts.
    Writes the part's (max, sum, unrotated value sum) per row; the KV head's last program to
    finish (a ticket in ``count_ptr``) merges them into ``out``."""
    bh = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    rows = tl.arange(0, MP)
    rmask = rows < R
    out = (bh * (NBLK + E) + part) * R + rows
    if part < NBLK:
        g = bh * NBLK + part
        kc = 0
        if KPICK:
            kc = tl.load(kpick_ptr + g)
        q0 = _part_query(q_ptr, kch0_ptr + g * kcs0, kr0_ptr + kc * (KRP0 * KNP0 * KNP0), bh, R,
                         nq, hq, sb, sh, sn, scale, KN0, KNP0, KRP0, MP, min(KNP0, 32))
        q1 = q0
        if KN1 > 0:
            q1 = _part_query(q_ptr, kch1_ptr + g * kcs1, kr1_ptr + kc * (KRP1 * KNP1 * KNP1),
                             bh, R, nq, hq, sb, sh, sn, scale, KN1, KNP1, KRP1, MP,
                             min(KNP1, 32))
        qm = tl.zeros([MP], tl.float32)
        if KCENTERED:
            qs = _query_rows(q_ptr, q_ptr, bh, R, nq, hq, sb, sh, sn, scale, MP, D, False, 16)
            qm = tl.sum(qs * tl.load(kmean_ptr + g * D + tl.arange(0, D))[None, :], axis=1)
        m_i = tl.full([MP], float("-inf"), tl.float32)
        l_i = tl.zeros([MP], tl.float32)
        acc0 = tl.zeros([MP, VNP0], tl.float32)
        acc1 = tl.zeros([MP, VNP1], tl.float32)
        for t0 in range(0, BLOCK, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < BLOCK
            tok = g * BLOCK + t  # = bh · E + blk · BLOCK + t
            s = _scores(qm[:, None] + tl.zeros([MP, BLOCK_N], tl.float32), q0,
                        kc0_ptr + tok * KNB0, kn0_ptr, tok, tmask, kt0_ptr, KN0, KNP0,
                        KNB0, KB0, KQ, BLOCK_N)
            if KN1 > 0:
                s = _scores(s, q1, kc1_ptr + tok * KNB1, kn1_ptr, tok, tmask, kt1_ptr,
                            KN1, KNP1, KNB1, KB1, KQ, BLOCK_N)
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc0 = _value_sum(acc0 * alpha[:, None], p, vc0_ptr + tok * VNB0, vn0_ptr, tok,
                              tmask, vt0_ptr, VN0, VNP0, VNB0, VB0, VQ, BLOCK_N)
            if VN1 > 0:
                acc1 = _value_sum(acc1 * alpha[:, None], p, vc1_ptr + tok * VNB1, vn1_ptr, tok,
                                  tmask, vt1_ptr, VN1, VNP1, VNB1, VB1, VQ, BLOCK_N)
            m_i = m_new
        vc = 0
        if VPICK:
            vc = tl.load(vpick_ptr + g)
        dst = acc_ptr + out * D
        _put_values(acc0, l_i, dst, rmask, vch0_ptr + g * vcs0,
                    vr0_ptr + vc * (VRP0 * VNP0 * VNP0), vmean_ptr + g * D, VN0, VNP0, VRP0,
                    VCENTERED, MP, min(VNP0, 32))
        if VN1 > 0:
            _put_values(acc1, l_i, dst, rmask, vch1_ptr + g * vcs1,
                        vr1_ptr + vc * (VRP1 * VNP1 * VNP1), vmean_ptr + g * D, VN1, VNP1,
                        VRP1, VCENTERED, MP, min(VNP1, 32))
    else:
        m_i, l_i, acc = _exact_part(q_ptr, ke_ptr, ve_ptr, bias_ptr, bh, part - NBLK, X, E, hkv,
                                    nq, R, bias_b, hq, sb, sh, sn, scale, MP, D, CAUSAL,
                                    HAS_BIAS, BLOCK_X)
        tl.store(acc_ptr + out[:, None] * D + tl.arange(0, D)[None, :], acc,
                 mask=rmask[:, None])
    _finish_part(m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr, out, rmask, m_i, l_i, bh, NBLK + E, R,
                 hkv, nq, D, PCH)


_LAUNCH = Launcher(_parts_kernel)


# -- host side -----------------------------------------------------------------------------------
def _check(q: torch.Tensor, keys: RoleTensors, values: RoleTensors, ke: Any, ve: Any,
           bias: Any) -> None:
    batch, hq, nq, dim = q.shape
    heads, n = keys.heads, keys.tokens
    if q.ndim != 4 or heads % max(batch, 1) or hq % max(heads // max(batch, 1), 1):
        raise ValueError(f"attention from codes: q {tuple(q.shape)} does not fit {heads} rows "
                         "of encoded tokens")
    hkv = heads // batch
    if (values.heads, values.tokens, values.block) != (heads, n, keys.block) \
            or n % keys.block or n == 0:
        raise ValueError("attention from codes: keys and values do not hold the same whole "
                         "blocks of tokens")
    for role in (keys, values):
        if role.mean is not None and role.mean.shape[-1] != dim \
                or sum(c.shape[-1] for c in role.channels) != dim:
            raise ValueError(f"attention from codes: the codes are not of head_dim {dim}")
    if dim & (dim - 1) or not 16 <= dim <= 256:
        raise ValueError(f"attention from codes: head_dim {dim} is not a power of two in "
                         "16..256")
    if (hq // hkv) * nq > MAX_ROWS:
        raise ValueError(f"attention from codes: {(hq // hkv) * nq} query rows per KV head, "
                         f"more than {MAX_ROWS}")
    if (ke is None) != (ve is None) or ke is not None and (
            ke.ndim != 4 or ke.shape != ve.shape or tuple(ke.shape[:2]) != (batch, hkv)
            or ke.shape[-1] != dim or ke.dtype != ve.dtype):
        raise ValueError(f"attention from codes: exact keys/values must both be "
                         f"[{batch}, {hkv}, X, {dim}] of one dtype")
    x = 0 if ke is None else ke.shape[2]
    if bias is not None and (bias.ndim != 3 or bias.shape[0] not in (1, batch)
                             or tuple(bias.shape[1:]) != (nq, x)):
        raise ValueError(f"attention from codes: bias {tuple(bias.shape)} is not "
                         f"[1 or {batch}, {nq}, {x}]")
    if n // keys.block + -(-x // EXACT_SPLIT) > 65535:
        raise ValueError("attention from codes: more than 65535 blocks per row")


class _Plan(NamedTuple):
    """What a call's shapes and options decide (checked once per distinct signature)."""

    rows: int
    blocks: int
    exact_parts: int
    parts: int
    states: int
    constants: dict[str, Any]
    token: int  # this plan's part of its launches' keys


def _plan(q: torch.Tensor, keys: RoleTensors, values: RoleTensors, ke: Any, ve: Any,
          bias: Any, causal: bool, out_dtype: torch.dtype) -> _Plan:
    """Check a call (ValueError on a bad one) and work out its launch."""
    _check(q, keys, values, ke, ve, bias)
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"attention from codes: out_dtype must be float16, bfloat16 or "
                         f"float32, got {out_dtype}")
    batch, hq, nq, dim = q.shape
    heads, block = keys.heads, keys.block
    hkv = heads // batch
    rows, blocks = (hq // hkv) * nq, keys.tokens // block
    x = 0 if ke is None else ke.shape[2]
    exact_parts = -(-x // EXACT_SPLIT)
    parts = blocks + exact_parts
    kmeta = [meta for *_, meta in keys.launch_parts]
    vmeta = [meta for *_, meta in values.launch_parts]
    constants = dict(
        MP=max(16, next_power_of_2(rows)), D=dim, BLOCK=block, KPICK=keys.choice is not None,
        VPICK=values.choice is not None, KCENTERED=keys.mean is not None,
        VCENTERED=values.mean is not None, CAUSAL=bool(causal) and nq > 1,
        HAS_BIAS=bias is not None, BLOCK_X=16, PCH=min(next_power_of_2(parts), 64, 8192 // dim),
        KQ=QUANTIZERS[getattr(keys.codec, "quantizer", "scalar")],
        **{f"K{k}{p}": kmeta[p][k] for p in (0, 1) for k in ("N", "NP", "NB", "B", "RP")},
        VQ=QUANTIZERS[getattr(values.codec, "quantizer", "scalar")],
        **{f"V{k}{p}": vmeta[p][k] for p in (0, 1) for k in ("N", "NP", "NB", "B", "RP")},
        **({"BLOCK_N": min(64, max(16, next_power_of_2(block)))} if INTERPRET else {}))
    return _Plan(rows, blocks, exact_parts, parts, heads * parts * rows, constants,
                 plan_token())


_PLANS = Plans()
#: the parts' scratch and the KV heads' tickets, shared by the launches of a stream on GPUs
#: (under the interpreter a kernel runs on the calling thread: scratch of its own per call)
_SCRATCH = StreamScratch(shared=not INTERPRET)


def attend(q: torch.Tensor, keys: RoleTensors, values: RoleTensors,
           ke: torch.Tensor | None = None, ve: torch.Tensor | None = None, *, scale: float,
           bias: torch.Tensor | None = None, causal: bool = False,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Softmax attention of ``q`` [B, Hq, Q, D] over encoded tokens (``keys``/``values``,
    :class:`RoleTensors`; visible to every query) and exact ones ``ke``/``ve`` [B, Hkv, X, D]
    (after them; ``bias`` [1 or B, Q, X] added, causal among the last Q) → [B, Q, Hq, D] in
    ``out_dtype`` (fp32 accumulation, one rounding): the semantics of
    :func:`kvtool.kernels.triton_attention.attend`. Checks and constants are worked out once
    per signature (a decode step's layers share one)."""
    key = (q.shape, q.dtype, q.device, keys.signature, values.signature,
           exact_key(ke, ve, bias), bool(causal), out_dtype)
    plan = _PLANS.get(key, lambda: _plan(q, keys, values, ke, ve, bias, causal, out_dtype))
    batch, hq, nq, dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    strides = q.stride()
    (k0, k1), (v0, v1) = keys.launch_parts, values.launch_parts
    states = plan.states
    work, tickets = _SCRATCH.get(q.device, states * (dim + 2), keys.heads)  # tickets at zero
    out = torch.empty((batch, nq, hq, dim), dtype=out_dtype, device=q.device)
    anything = k0[0][0]  # a pointer for arguments the constants leave unread
    _LAUNCH((keys.heads, plan.parts), (
        q, *k0[0], k0[1], *k1[0], k1[1], *v0[0], v0[2], *v1[0], v1[2],
        *(anything if t is None else t for t in (keys.choice, values.choice, keys.mean,
                                                 values.mean)),
        *((q, q) if ke is None else (ke.contiguous(), ve.contiguous())),
        q if bias is None else bias.to(torch.float32).contiguous(),
        work, work[states:], work[2 * states:], tickets, out, plan.blocks,
        0 if ke is None else ke.shape[2],
        plan.exact_parts, keys.heads // batch, nq, hq, plan.rows,
        1 if bias is None else bias.shape[0], strides[0], strides[1], strides[2],
        float(scale)), plan.constants, fixed=(plan.token, strides))
    return out


__all__ = ["MAX_ROWS", "RoleTensors", "attend", "available", "name", "role_tensors"]
