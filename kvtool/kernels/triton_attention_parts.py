"""Attention straight from ``turbomix`` codes of every option on Triton: outlier channels,
``vq=2`` pairs, trellis codes, uint8 norms, centered keys and values (the ``balanced`` and
``small`` presets; CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

The companion of :mod:`kvtool.kernels.triton_attention` (turbo and scalar ``turbomix`` codes)
and the device twin of :mod:`kvtool.kernels.numba_attention_parts`, which is its reference. A
key of block ``b`` is ``k̂[ch_p] = ‖k_p‖ · (y_p @ R_p) + mean[ch_p]`` per part ``p`` (the
outlier channels and the rest, each with the block's own channel set and rotation candidate),
so a score is ``Σ_p ‖k_p‖ · (R_p q[ch_p])·y_p + q·mean``. Every block has its own channels,
rotations and means, so the work splits by block:

- host side, torch ops on the device (no host sync): each key part's query rotated into every
  block's domain, ``scale · q[ch_p] @ R_cᵀ`` (one matmul per candidate), and ``q·mean``;
- :func:`_block_kernel`, one program per (batch · KV head, block): the block's scores from the
  codes (each part's unit values unpacked and looked up as ``turbomix``'s decode does, fp16
  tensor-core dots with the rotated query, times the token's norm), the softmax local to the
  block, and the block's value sums per part in the part's rotated domain (``p · ‖v_p‖`` in
  fp16 against the values, fp32 sums; ~6e-4 relative error, as the turbo kernel);
- host side: each part's value sum rotated back with its block's ``R`` and put in its
  channels, plus the softmax weight times the value mean; the exact tokens (sinks, window, this
  forward's tokens) in fp32 with the additive bias and the causal rule among the new tokens;
  every block and the exact tokens merged by their maxima.

The token tile and warps are autotuned per shape on GPUs (results cached where Triton can).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kvtool.codecs.rotation import rotation_matrix
from kvtool.kernels.triton_cuda import INTERPRET, _jit, _persisted, available, next_power_of_2
from kvtool.kernels.triton_turbomix import (
    QUANTIZERS,
    _seeds,
    _tables,
    _width,
    channel_sets_of,
    norm_values,
)
from kvtool.kernels.triton_turbomix_steps import _dot, _values

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

name = "triton"
MAX_ROWS = 64  # query rows (query heads per KV head × query tokens) one program holds
_TABLE = {"scalar": "cent", "pair": "pts", "trellis": "lvl"}  # each quantiser's value table


@dataclass(frozen=True)
class RoleTensors:
    """One role's (keys' or values') encoded tokens on the device for :func:`attend`: ``E``
    tokens of ``heads`` = batch · KV heads rows in blocks of ``block``; one entry per part
    (the other channels, then the outlier channels when there are any)."""

    codec: Any
    codes: tuple[torch.Tensor, ...]  # uint8 [heads, E, bytes_p]
    norms: tuple[torch.Tensor, ...]  # float32 [heads, E]
    channels: tuple[torch.Tensor, ...]  # int64 [heads, blocks, n_p]
    bits: tuple[int, ...]
    choice: torch.Tensor | None  # int64 [heads, blocks]: each block's candidate (None: one)
    mean: torch.Tensor | None  # float32 [heads, blocks, D] (None: uncentered)
    block: int

    @property
    def heads(self) -> int:
        return int(self.codes[0].shape[0])

    @property
    def tokens(self) -> int:
        return int(self.codes[0].shape[1])


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
    codes = [arrays["codes" + s].reshape(heads, tokens, -1).contiguous()
             for s in ("", "_hi")[:len(sets)]]
    choice = arrays["rotation"].reshape(heads, blocks).long() if "rotation" in arrays else None
    mean = arrays["mean"].reshape(heads, blocks, dim).float() if "mean" in arrays else None
    return RoleTensors(codec, tuple(codes), tuple(norms),
                       tuple(s.long().expand(groups, -1).reshape(heads, blocks, -1)
                             for s in sets), bits, choice, mean, block)


# -- launch helpers ------------------------------------------------------------------------------
def _tuned(fn: Any) -> Any:
    """Autotune the token tile and warps on GPUs, keyed on the shape (fixed tile under the
    interpreter)."""
    if triton is None or INTERPRET:
        return _jit(fn)
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=1)
               for n, w in ((16, 4), (32, 4), (16, 8), (32, 8), (64, 8))]
    return triton.autotune(configs, key=["MP", "KNP0", "KNP1", "VNP0", "VNP1", "KQ", "VQ",
                                         "KB0", "KB1", "VB0", "VB1", "BLOCK"],
                           prune_configs_by={"early_config_prune": _prune}, **_persisted())(
        triton.jit(fn))


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Tiles of at most 16 unit values per thread (the trellis lookups hold several such tiles;
    compiled for sm_90, ``balanced`` and ``small`` at head_dim 128 spill nothing there and
    272-1,968 bytes at 32), else the smallest."""
    def per_thread(c: Any) -> float:
        width = max(kwargs.get(k, named_args.get(k, 128)) for k in ("KNP0", "VNP0"))
        return c.kwargs["BLOCK_N"] * width / (32 * c.num_warps)

    keep = [c for c in configs if per_thread(c) <= 16]
    return keep or [min(configs, key=per_thread)]


# -- kernels -------------------------------------------------------------------------------------
@_jit
def _scores(s, q, row_ptr, norm_ptr, tok, tmask, table_ptr, sub_ptr, N: tl.constexpr,
            NP: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """``s + ‖k_p‖ · q_p · y_p`` for one key part of the tile's tokens."""
    y = _values(row_ptr, tmask, tl.arange(0, NP), table_ptr, table_ptr, table_ptr, sub_ptr, N,
                NB, BITS, QUANT, BLOCK_N, NP)
    part = _dot(q, tl.trans(y.to(tl.float16)), tl.zeros(s.shape, tl.float32))
    return s + part * tl.load(norm_ptr + tok, mask=tmask, other=0.0)[None, :]


@_jit
def _value_sum(acc, p, row_ptr, norm_ptr, tok, tmask, table_ptr, sub_ptr, N: tl.constexpr,
               NP: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """``acc + (p · ‖v_p‖) @ y_p`` for one value part of the tile's tokens."""
    y = _values(row_ptr, tmask, tl.arange(0, NP), table_ptr, table_ptr, table_ptr, sub_ptr, N,
                NB, BITS, QUANT, BLOCK_N, NP)
    pv = p * tl.load(norm_ptr + tok, mask=tmask, other=0.0)[None, :]
    return _dot(pv.to(tl.float16), y.to(tl.float16), acc)


@_tuned
def _block_kernel(q0_ptr, q1_ptr, qm_ptr, kc0_ptr, kc1_ptr, kn0_ptr, kn1_ptr, vc0_ptr,
                  vc1_ptr, vn0_ptr, vn1_ptr, kt0_ptr, kt1_ptr, vt0_ptr, vt1_ptr, sub_ptr,
                  m_ptr, l_ptr, a0_ptr, a1_ptr, E, NBLK, R,
                  MP: tl.constexpr, BLOCK: tl.constexpr, CENTERED: tl.constexpr,
                  KQ: tl.constexpr, KN0: tl.constexpr, KNP0: tl.constexpr, KNB0: tl.constexpr,
                  KB0: tl.constexpr, KN1: tl.constexpr, KNP1: tl.constexpr,
                  KNB1: tl.constexpr, KB1: tl.constexpr,
                  VQ: tl.constexpr, VN0: tl.constexpr, VNP0: tl.constexpr, VNB0: tl.constexpr,
                  VB0: tl.constexpr, VN1: tl.constexpr, VNP1: tl.constexpr,
                  VNB1: tl.constexpr, VB1: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (batch · KV head, block): its (max, sum) per query row and its value sums per part
    in the part's rotated domain, the softmax local to the block."""
    bh = tl.program_id(0).to(tl.int64)
    g = bh * NBLK + tl.program_id(1)
    rows = tl.arange(0, MP)
    rmask = rows < R
    at = g * R + rows
    q0 = tl.load(q0_ptr + at[:, None] * KNP0 + tl.arange(0, KNP0)[None, :],
                 mask=rmask[:, None], other=0.0).to(tl.float16)
    if KN1 > 0:
        q1 = tl.load(q1_ptr + at[:, None] * KNP1 + tl.arange(0, KNP1)[None, :],
                     mask=rmask[:, None], other=0.0).to(tl.float16)
    if CENTERED:
        qm = tl.load(qm_ptr + at, mask=rmask, other=0.0)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc0 = tl.zeros([MP, VNP0], tl.float32)
    acc1 = tl.zeros([MP, VNP1], tl.float32)
    for t0 in range(0, BLOCK, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < BLOCK
        tok = g * BLOCK + t  # = bh · E + blk · BLOCK + t
        s = _scores(tl.zeros([MP, BLOCK_N], tl.float32), q0, kc0_ptr + tok * KNB0, kn0_ptr,
                    tok, tmask, kt0_ptr, sub_ptr, KN0, KNP0, KNB0, KB0, KQ, BLOCK_N)
        if KN1 > 0:
            s = _scores(s, q1, kc1_ptr + tok * KNB1, kn1_ptr, tok, tmask, kt1_ptr, sub_ptr,
                        KN1, KNP1, KNB1, KB1, KQ, BLOCK_N)
        if CENTERED:
            s += qm[:, None]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = _value_sum(acc0 * alpha[:, None], p, vc0_ptr + tok * VNB0, vn0_ptr, tok, tmask,
                          vt0_ptr, sub_ptr, VN0, VNP0, VNB0, VB0, VQ, BLOCK_N)
        if VN1 > 0:
            acc1 = _value_sum(acc1 * alpha[:, None], p, vc1_ptr + tok * VNB1, vn1_ptr, tok,
                              tmask, vt1_ptr, sub_ptr, VN1, VNP1, VNB1, VB1, VQ, BLOCK_N)
        m_i = m_new
    tl.store(m_ptr + at, m_i, mask=rmask)
    tl.store(l_ptr + at, l_i, mask=rmask)
    tl.store(a0_ptr + at[:, None] * VNP0 + tl.arange(0, VNP0)[None, :], acc0,
             mask=rmask[:, None])
    if VN1 > 0:
        tl.store(a1_ptr + at[:, None] * VNP1 + tl.arange(0, VNP1)[None, :], acc1,
                 mask=rmask[:, None])


# -- host side -----------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _rotations(n: int, seeds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """R [C, n, n] float32 of each candidate's seed."""
    return torch.stack([torch.tensor(rotation_matrix(n, s), dtype=torch.float32)
                        for s in seeds]).to(device)


def _part_meta(role: RoleTensors, p: int) -> dict[str, Any]:
    """The kernel's constants and table of part ``p`` of ``role`` (a placeholder part of width
    0 past the last)."""
    if p >= len(role.codes):
        return {"N": 0, "NP": 16, "NB": 1, "B": 2, "table": None}
    n, bits = role.channels[p].shape[-1], role.bits[p]
    quantizer = getattr(role.codec, "quantizer", "scalar")
    tables = _tables(n, bits, quantizer, role.codes[p].device)
    return {"N": n, "NP": _width(n), "NB": role.codes[p].shape[-1], "B": bits,
            "table": tables[_TABLE[quantizer]], "sub": tables["sub"]}


def _select(x: torch.Tensor, rots: torch.Tensor, choice: torch.Tensor | None,
            transpose: bool) -> torch.Tensor:
    """``x @ R_cᵀ`` (``transpose``) or ``x @ R_c`` per block, c = the block's candidate;
    ``x`` [heads, blocks, rows, n]: one matmul per candidate."""
    if choice is None or rots.shape[0] == 1:
        return x @ (rots[0].T if transpose else rots[0])
    out = torch.zeros_like(x)
    for c in range(rots.shape[0]):
        y = x @ (rots[c].T if transpose else rots[c])
        out += torch.where((choice == c)[:, :, None, None], y, 0.0)
    return out


def _queries(qs: torch.Tensor, keys: RoleTensors, width: int, p: int) -> torch.Tensor:
    """Key part ``p``'s query per block: ``scale · q[ch_p] @ R_cᵀ`` float32 [heads, blocks,
    rows, width], zero-padded."""
    heads, rows, _ = qs.shape
    channels = keys.channels[p]
    blocks, n = channels.shape[1:]
    part = torch.gather(qs[:, None].expand(-1, blocks, -1, -1), 3,
                        channels[:, :, None, :].expand(-1, -1, rows, -1))
    rotated = _select(part, _rotations(n, _seeds_of(keys.codec), qs.device), keys.choice, True)
    if width == n:
        return rotated.contiguous()
    out = torch.zeros((heads, blocks, rows, width), dtype=torch.float32, device=qs.device)
    out[..., :n] = rotated
    return out


def _seeds_of(codec: Any) -> tuple[int, ...]:
    """Each candidate's rotation seed (turbo: its one seed)."""
    return _seeds(codec) if hasattr(codec, "candidates") else (int(codec.seed),)


def _exact(qs: torch.Tensor, ke: torch.Tensor, ve: torch.Tensor, bias: torch.Tensor | None,
           causal: bool, batch: int, nq: int) -> tuple[torch.Tensor, ...]:
    """(max, sum, value sum) per row of the exact tokens, in fp32: token j is visible to row r
    (query token i = r mod Q) unless causal and ``j > X − Q + i``; ``bias`` [1 or B, Q, X]."""
    heads, rows, dim = qs.shape
    x = ke.shape[2]
    k = ke.reshape(heads, x, dim).float()
    s = qs @ k.transpose(1, 2)
    qi = torch.arange(rows, device=qs.device) % nq
    if bias is not None:
        b = bias.float()[:, qi]  # [1 or B, rows, X]
        s = (s.view(batch, heads // batch, rows, x) + b[:, None]).reshape(heads, rows, x)
    if causal:
        j = torch.arange(x, device=qs.device)
        s = s.masked_fill(j[None, :] > x - nq + qi[:, None], -torch.inf)
    m = s.amax(-1)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
    return m, p.sum(-1), p @ ve.reshape(heads, x, dim).float()


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
    if (hq // hkv) * nq > MAX_ROWS:
        raise ValueError(f"attention from codes: {(hq // hkv) * nq} query rows per KV head, "
                         f"more than {MAX_ROWS}")
    if (ke is None) != (ve is None) or ke is not None and (
            ke.shape != ve.shape or tuple(ke.shape[:2]) != (batch, hkv) or ke.shape[-1] != dim):
        raise ValueError(f"attention from codes: exact keys/values must both be "
                         f"[{batch}, {hkv}, X, {dim}]")
    x = 0 if ke is None else ke.shape[2]
    if bias is not None and (bias.ndim != 3 or bias.shape[0] not in (1, batch)
                             or tuple(bias.shape[1:]) != (nq, x)):
        raise ValueError(f"attention from codes: bias {tuple(bias.shape)} is not "
                         f"[1 or {batch}, {nq}, {x}]")
    if n // keys.block > 65535:
        raise ValueError("attention from codes: more than 65535 blocks per row")


def attend(q: torch.Tensor, keys: RoleTensors, values: RoleTensors,
           ke: torch.Tensor | None = None, ve: torch.Tensor | None = None, *, scale: float,
           bias: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Softmax attention of ``q`` [B, Hq, Q, D] over encoded tokens (``keys``/``values``,
    :class:`RoleTensors`; visible to every query) and exact ones ``ke``/``ve`` [B, Hkv, X, D]
    (after them; ``bias`` [1 or B, Q, X] added, causal among the last Q) → fp32
    [B, Q, Hq, D]: the semantics of :func:`kvtool.kernels.triton_attention.attend`."""
    _check(q, keys, values, ke, ve, bias)
    batch, hq, nq, dim = q.shape
    heads, n, block = keys.heads, keys.tokens, keys.block
    hkv = heads // batch
    rows, blocks = (hq // hkv) * nq, n // block
    device = q.device
    qs = (q.float() * scale).reshape(heads, rows, dim)  # row r: query head r // Q, token r % Q
    kp = [_part_meta(keys, p) for p in (0, 1)]
    vp = [_part_meta(values, p) for p in (0, 1)]
    q0 = _queries(qs, keys, kp[0]["NP"], 0)
    q1 = _queries(qs, keys, kp[1]["NP"], 1) if kp[1]["N"] else q0
    qm = torch.einsum("hrd,hbd->hbr", qs, keys.mean).contiguous() \
        if keys.mean is not None else q0
    m = torch.empty((heads, blocks, rows), dtype=torch.float32, device=device)
    lsum = torch.empty_like(m)
    acc = [torch.empty((heads, blocks, rows, vp[p]["NP"] if vp[p]["N"] else 1),
                       dtype=torch.float32, device=device) for p in (0, 1)]
    codes = [r.codes[p] if p < len(r.codes) else r.codes[0] for r in (keys, values)
             for p in (0, 1)]
    norms = [r.norms[p] if p < len(r.norms) else r.norms[0] for r in (keys, values)
             for p in (0, 1)]
    tables = [meta["table"] if meta["N"] else kp[0]["table"] for meta in (*kp, *vp)]
    _block_kernel[(heads, blocks)](
        q0, q1, qm, codes[0], codes[1], norms[0], norms[1], codes[2], codes[3], norms[2],
        norms[3], *tables, kp[0]["sub"], m, lsum, acc[0], acc[1], n, blocks, rows,
        MP=max(16, next_power_of_2(rows)), BLOCK=block, CENTERED=keys.mean is not None,
        KQ=QUANTIZERS[getattr(keys.codec, "quantizer", "scalar")],
        **{f"K{k}{p}": kp[p][k] for p in (0, 1) for k in ("N", "NP", "NB", "B")},
        VQ=QUANTIZERS[getattr(values.codec, "quantizer", "scalar")],
        **{f"V{k}{p}": vp[p][k] for p in (0, 1) for k in ("N", "NP", "NB", "B")},
        **({"BLOCK_N": min(64, max(16, next_power_of_2(block)))} if INTERPRET else {}))
    o = torch.zeros((heads, blocks, rows, dim), dtype=torch.float32, device=device)
    for p, channels in enumerate(values.channels):
        width = channels.shape[-1]
        back = _select(acc[p][..., :width], _rotations(width, _seeds_of(values.codec), device),
                       values.choice, False)
        o.scatter_(3, channels[:, :, None, :].expand(-1, -1, rows, -1), back)
    if values.mean is not None:
        o += lsum[..., None] * values.mean[:, :, None, :]
    top = m.amax(1)
    if ke is not None and ke.shape[2]:
        me, le, oe = _exact(qs, ke, ve, bias, causal, batch, nq)
        top = torch.maximum(top, me)
        we = torch.exp(me - top)
    w = torch.exp(m - top[:, None])
    num = (w[..., None] * o).sum(1)
    den = (w * lsum).sum(1)
    if ke is not None and ke.shape[2]:
        num += we[..., None] * oe
        den += we * le
    out = (num / den[..., None]).view(batch, hkv, hq // hkv, nq, dim)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, nq, hq, dim)


__all__ = ["MAX_ROWS", "RoleTensors", "attend", "available", "name", "role_tensors"]
