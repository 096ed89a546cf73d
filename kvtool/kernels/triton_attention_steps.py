"""The tile steps of the Triton attention from codes (:mod:`kvtool.kernels.triton_attention`):
a program's query rows (rotated or not), unpacking code rows into fp16 centroids, the
exact-accuracy dots of the exact tokens, the online softmax of an encoded part and of an exact
part, and the merge of a KV head's parts by the program that finishes last."""

from __future__ import annotations

from kvtool.kernels.triton_cuda import _centroids, _mm, _split
from kvtool.kernels.triton_support import _INTERP, _jit, tl
from kvtool.kernels.triton_turbomix_steps import _dot


@_jit
def _exact_dot(a, b, acc):
    """``acc + a @ b`` in fp32 accuracy for an fp32 ``a`` and a ``b`` of the exact tokens'
    dtype: ``a`` split in pieces of ``b``'s 16-bit type (bf16: three, exact; fp16: two)."""
    if b.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif b.dtype == tl.bfloat16:
        hi, mid, lo = _split(a, 3)
        return _dot(hi, b, _dot(mid, b, _dot(lo, b, acc)))
    else:
        hi = a.to(tl.float16)
        lo = (a - hi.to(tl.float32)).to(tl.float16)
        return _dot(hi, b, _dot(lo, b, acc))


@_jit
def _query_src(q_ptr, bh, R, nq, hq, sb, sh, sn, MP: tl.constexpr):
    """Pointers [MP] to the query rows of KV head row ``bh``: row r is query token ``r mod
    nq`` of query head ``(bh mod hkv)·(R / nq) + r / nq`` (strides ``sb``/``sh``/``sn``)."""
    row = bh * R + tl.arange(0, MP)  # (batch, query head, query token) order
    head = row // nq
    return q_ptr + (head // hq) * sb + (head % hq) * sh + (row % nq) * sn


@_jit
def _query_rows(q_ptr, rt_ptr, bh, R, nq, hq, sb, sh, sn, scale, MP: tl.constexpr,
                D: tl.constexpr, ROTATE: tl.constexpr, BK: tl.constexpr):
    """fp32 ``scale · q @ R_cᵀ`` (``ROTATE``; ``rt_ptr`` at ``R_cᵀ``, exact in bf16, q in
    three bf16 pieces: fp32 accuracy) or ``scale · q`` of KV head row ``bh``'s MP query rows;
    row r is query token ``r mod nq`` of query head ``(bh mod hkv)·(R / nq) + r / nq``."""
    rows = tl.arange(0, MP)
    rmask = rows < R
    src = _query_src(q_ptr, bh, R, nq, hq, sb, sh, sn, MP)
    if ROTATE:
        acc = tl.zeros([MP, D], tl.float32)
        for k0 in range(0, D, BK):  # BK rows of Rᵀ at a time: few live registers
            x = tl.load(src[:, None] + (k0 + tl.arange(0, BK))[None, :], mask=rmask[:, None],
                        other=0.0).to(tl.float32)
            hi, mid, lo = _split(x, 3)
            acc = _mm(acc, hi, mid, lo, rt_ptr, k0, 0, D, BK, D, 3)
    else:
        acc = tl.load(src[:, None] + tl.arange(0, D)[None, :], mask=rmask[:, None],
                      other=0.0).to(tl.float32)
    return acc * scale


@_jit
def _field(w, AT: tl.constexpr, BITS: tl.constexpr):
    return (w >> AT) & ((1 << BITS) - 1)


# the fields at AT + STEP·e (e < 2, 4, 8, 16) as trailing in-register axes [..., 2, ..., 2] in
# natural order: a join tree keeps every code in the thread holding its word, where a broadcast
# against a shift vector makes Triton spread them over threads (a shared-memory round trip)
@_jit
def _fields2(w, AT: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr):
    return tl.join(_field(w, AT, BITS), _field(w, AT + STEP, BITS))


@_jit
def _fields4(w, AT: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr):
    return tl.join(_fields2(w, AT, 2 * STEP, BITS), _fields2(w, AT + STEP, 2 * STEP, BITS))


@_jit
def _fields8(w, AT: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr):
    return tl.join(_fields4(w, AT, 2 * STEP, BITS), _fields4(w, AT + STEP, 2 * STEP, BITS))


@_jit
def _fields16(w, AT: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr):
    return tl.join(_fields8(w, AT, 2 * STEP, BITS), _fields8(w, AT + STEP, 2 * STEP, BITS))


@_jit
def _lookup(table_ptr, codes):
    """``table[codes]`` of a small fp16 table in the layout of ``codes`` (as a ``tl.load``, the
    coalescing pass would move the gather's 64-bit addresses through shared memory first)."""
    if _INTERP:
        y = tl.load(table_ptr + codes.to(tl.int32))
    else:
        y = tl.inline_asm_elementwise(
            "{ .reg .u64 a; mad.wide.u32 a, $1, 2, $2; ld.global.nc.b16 $0, [a]; }", "=h,r,l",
            [codes.to(tl.uint32), table_ptr.to(tl.uint64, bitcast=True)], dtype=tl.float16,
            is_pure=True, pack=1)
    return y


@_jit
def _prmt(a, b, sel):
    """PTX ``prmt.b32`` in its default mode: byte k of the result is byte ``n & 7`` of the
    eight bytes of ``a`` (0..3) then ``b`` (4..7), ``n`` being ``sel``'s nibble k; with ``n``'s
    bit 3 set, that byte's sign bit fills the result byte. Emulated under the interpreter."""
    if _INTERP:
        out = (sel & 0) + (a & 0)
        for k in tl.static_range(4):
            nibble = (sel >> (4 * k)) & 15
            at = nibble & 7
            byte = (tl.where(at < 4, a, b) >> ((at & 3) * 8)) & 0xFF
            byte = tl.where(nibble < 8, byte, tl.where(byte < 0x80, 0, 0xFF))
            out = out | (byte << (8 * k))
    else:
        out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                        dtype=tl.uint32, is_pure=True, pack=1)
    return out


@_jit
def _planes(table_ptr):
    """Eight fp16 table entries as byte planes for :func:`_prmt`: (low bytes of entries 0..3,
    of 4..7, high bytes of 0..3, of 4..7)."""
    words = table_ptr.to(tl.pointer_type(tl.uint32))
    w0, w1 = tl.load(words), tl.load(words + 1)
    w2, w3 = tl.load(words + 2), tl.load(words + 3)
    return (_prmt(w0, w1, 0x6420), _prmt(w2, w3, 0x6420), _prmt(w0, w1, 0x7531),
            _prmt(w2, w3, 0x7531))


@_jit
def _halves16(pair):
    """The two fp16 values packed in 32-bit ``pair`` (low half first)."""
    return ((pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True),
            (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True))


@_jit
def _in_order(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight tensors as one with a trailing [2, 2, 2] holding them in order (the last join's
    axis is the lowest bit; adjacent codes end in adjacent registers, a fp16 pair)."""
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)),
                   tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@_jit
def _look4(lo0, lo1, hi0, hi1, sel):
    """Centroids of the four 3-bit codes in ``sel``'s nibbles 0..3: four ``prmt``."""
    lo = _prmt(lo0, lo1, sel)
    hi = _prmt(hi0, hi1, sel)
    c0, c1 = _halves16(_prmt(lo, hi, 0x5140))
    c2, c3 = _halves16(_prmt(lo, hi, 0x7362))
    return c0, c1, c2, c3


@_jit
def _look4x16(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, codes):
    """Centroids of the four 4-bit codes in nibbles 0..3 of ``codes``: entries 0..7 and 8..15
    looked up, then picked per byte by each code's bit 3 (a byte mask from ``prmt``'s sign
    mode)."""
    sel = codes & 0x7777
    upper = _prmt(codes & 0, (codes & 0) | 0x80808080, 0x8888 | ((codes >> 1) & 0x4444))
    lo = (_prmt(lo0, lo1, sel) & ~upper) | (_prmt(lo2, lo3, sel) & upper)
    hi = (_prmt(hi0, hi1, sel) & ~upper) | (_prmt(hi2, hi3, sel) & upper)
    c0, c1 = _halves16(_prmt(lo, hi, 0x5140))
    c2, c3 = _halves16(_prmt(lo, hi, 0x7362))
    return c0, c1, c2, c3


@_jit
def _look8x4(words, table_ptr):
    """Centroids of the eight 4-bit codes of each 32-bit word as a trailing [2, 2, 2] in
    natural order (16-entry table: its byte planes in eight registers)."""
    lo0, lo1, hi0, hi1 = _planes(table_ptr)
    lo2, lo3, hi2, hi3 = _planes(table_ptr + 8)
    c0, c1, c2, c3 = _look4x16(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, words & 0xFFFF)
    c4, c5, c6, c7 = _look4x16(lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, words >> 16)
    return _in_order(c0, c1, c2, c3, c4, c5, c6, c7)


@_jit
def _nibbles3(x):
    """The four 3-bit codes at bits 0, 3, 6, 9 of ``x`` in nibbles 0..3."""
    return (x & 7) | ((x & 0x38) << 1) | ((x & 0x1C0) << 2) | ((x & 0xE00) << 3)


@_jit
def _look8(groups, lo0, lo1, hi0, hi1):
    """Centroids of the eight 3-bit codes of each 24-bit group as a trailing [2, 2, 2] in
    natural order, looked up in registers (byte planes of :func:`_planes`): no memory access
    and ~2 instructions a code, where a table load costs ~5 and an L1 round trip."""
    c0, c1, c2, c3 = _look4(lo0, lo1, hi0, hi1, _nibbles3(groups & 0xFFF))
    c4, c5, c6, c7 = _look4(lo0, lo1, hi0, hi1, _nibbles3(groups >> 12))
    return _in_order(c0, c1, c2, c3, c4, c5, c6, c7)


@_jit
def _words3(codes_ptr, row_off, rmask, D: tl.constexpr):
    """The three 32-bit words of each 32-code group of 3-bit rows: ([R, D / 32] × 3)."""
    qi = tl.arange(0, D // 32)
    ptr = (codes_ptr + row_off[:, None] + qi[None, :] * 12).to(tl.pointer_type(tl.uint32))
    return (tl.load(ptr, mask=rmask[:, None], other=0),
            tl.load(ptr + 1, mask=rmask[:, None], other=0),
            tl.load(ptr + 2, mask=rmask[:, None], other=0))


@_jit
def _halves(x, R: tl.constexpr):
    """``x`` [R] as its first and second halves ([R / 2] each)."""
    return tl.split(tl.permute(tl.reshape(x, [2, R // 2]), [1, 0]))


@_jit
def _unit_tile(codes_ptr, row_off, rmask, table_ptr, R: tl.constexpr, D: tl.constexpr,
               BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr,
               WORDS: tl.constexpr, PAIR: tl.constexpr):
    """fp16 centroids [R, D] of the packed rows at byte offsets ``row_off``. ``WORDS`` (rows
    4-byte aligned): the codes read as 32-bit words and split in registers; else byte by byte
    (:func:`~kvtool.kernels.triton_cuda._centroids`).

    ``PAIR`` (3 bits; set where each thread holds at least two rows' groups): rows r and
    r + R/2 are joined before their codes are split, so a thread's centroids span two rows and
    Triton stores the tile to shared memory for ``tl.dot`` along D, 16 bytes at a time
    (compiled for sm_90 that is ~12 ``st.shared.v4`` per thread and tile instead of 64 16-bit
    stores: with one row per thread its layout picks the row axis as the fast one)."""
    if not WORDS:  # (no early return: Triton would still compile what follows)
        y = _centroids(codes_ptr, row_off, rmask, table_ptr, R, D, BITS, CPG, BPG)
    elif BITS == 3:  # 32 codes in 3 words: 4 groups of 8 codes in 3 bytes each
        if PAIR:
            off_a, off_b = _halves(row_off, R)
            mask_a, mask_b = _halves(rmask, R)
            a0, a1, a2 = _words3(codes_ptr, off_a, mask_a, D)
            b0, b1, b2 = _words3(codes_ptr, off_b, mask_b, D)
            w0, w1, w2 = tl.join(a0, b0), tl.join(a1, b1), tl.join(a2, b2)
        else:
            w0, w1, w2 = _words3(codes_ptr, row_off, rmask, D)
        groups = tl.join(tl.join(w0 & 0xFFFFFF, (w1 >> 16) | ((w2 & 0xFF) << 16)),
                         tl.join((w0 >> 24) | ((w1 & 0xFFFF) << 8), w2 >> 8))
        lo0, lo1, hi0, hi1 = _planes(table_ptr)
        y = _look8(groups, lo0, lo1, hi0, hi1)
        if PAIR:  # [R/2, D/32, half, 2, 2, 2, 2, 2] -> [half, R/2, D/32, ...]
            y = tl.permute(y, [2, 0, 1, 3, 4, 5, 6, 7])
        y = tl.reshape(y, [R, D])
    else:
        wi = tl.arange(0, D * BITS // 32)
        ptr = (codes_ptr + row_off[:, None]).to(tl.pointer_type(tl.uint32)) + wi[None, :]
        w = tl.load(ptr, mask=rmask[:, None], other=0)
        if BITS == 4:
            y = tl.reshape(_look8x4(w, table_ptr), [R, D])
        else:
            y = tl.reshape(_lookup(table_ptr, _fields16(w, 0, 2, 2)), [R, D])
    return y


@_jit
def _codes_part(q_ptr, rt_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, kcent_ptr, vcent_ptr, order_ptr,
                goff_ptr, mean_ptr, bh, part, N, NBLK, S, R, nq, hq, sb, sh, sn, scale,
                MP: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, KCPG: tl.constexpr,
                KBPG: tl.constexpr, VBITS: tl.constexpr, VCPG: tl.constexpr,
                VBPG: tl.constexpr, KWORDS: tl.constexpr, VWORDS: tl.constexpr,
                CK: tl.constexpr, CV: tl.constexpr, SORTED: tl.constexpr,
                CENTERED: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                BLOCK_N: tl.constexpr, WARPS: tl.constexpr):
    """Online softmax of the part's encoded tokens: (max, sum, value sum in the rotated
    domain) per row. Part = (group, split); group = value rotation · CK + key rotation.
    ``WARPS``: the launch's warps (two rows per thread and more: 3-bit tiles are paired)."""
    PAIR: tl.constexpr = BLOCK_N * D >= 2048 * WARPS
    group = part // S
    cols = tl.arange(0, D)
    if SORTED:  # the group's blocks: order[first:first + count], tokens block by block
        first = tl.load(goff_ptr + bh * (CK * CV + 1) + group)
        n = (tl.load(goff_ptr + bh * (CK * CV + 1) + group + 1) - first) * BLOCK
    else:
        first = 0
        n = N
    chunk = tl.cdiv(tl.cdiv(n, S), BLOCK_N) * BLOCK_N
    lo = (part % S) * chunk
    hi = tl.minimum(lo + chunk, n)
    q = _query_rows(q_ptr, rt_ptr + (group % CK) * D * D, bh, R, nq, hq, sb, sh, sn, scale, MP,
                    D, True, BK).to(tl.float16)
    if CENTERED:  # q·mean in two fp16 pieces of the scaled query (the mean is fp16)
        qs = _query_rows(q_ptr, rt_ptr, bh, R, nq, hq, sb, sh, sn, scale, MP, D, False, BK)
        qs_hi = qs.to(tl.float16)
        qs_lo = (qs - qs_hi.to(tl.float32)).to(tl.float16)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, D], tl.float32)
    for v0 in range(lo, hi, BLOCK_N):
        v = v0 + tl.arange(0, BLOCK_N)
        vmask = v < hi
        if SORTED:
            blk = tl.load(order_ptr + bh * NBLK + first + v // BLOCK, mask=vmask,
                          other=0).to(tl.int64)
            tok = blk * BLOCK + v % BLOCK
        else:
            tok = v.to(tl.int64)
            blk = tok // BLOCK
        kv = bh * N + tok
        yk = _unit_tile(kc_ptr, kv * (D * KBITS // 8), vmask, kcent_ptr, BLOCK_N, D, KBITS,
                        KCPG, KBPG, KWORDS, PAIR)
        s = _dot(q, tl.trans(yk), tl.zeros([MP, BLOCK_N], tl.float32))
        s = s * tl.load(kn_ptr + kv, mask=vmask, other=0.0).to(tl.float32)[None, :]
        if CENTERED:
            mean = tl.load(mean_ptr + (bh * NBLK + blk)[:, None] * D + cols[None, :],
                           mask=vmask[:, None], other=0.0)
            s = _dot(qs_lo, tl.trans(mean), _dot(qs_hi, tl.trans(mean), s))
        s = tl.where(vmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        yv = _unit_tile(vc_ptr, kv * (D * VBITS // 8), vmask, vcent_ptr, BLOCK_N, D, VBITS,
                        VCPG, VBPG, VWORDS, PAIR)
        pv = p * tl.load(vn_ptr + kv, mask=vmask, other=0.0).to(tl.float32)[None, :]
        acc = _dot(pv.to(tl.float16), yv, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@_jit
def _exact_part(q_ptr, ke_ptr, ve_ptr, bias_ptr, bh, e, X, E, hkv, nq, R, bias_b, hq, sb, sh, sn,
                scale, MP: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_X: tl.constexpr):
    """Online softmax of the part's exact tokens (unrotated): exact token j is visible to row r
    (query token i = r mod Q) unless causal and ``j > X − Q + i``; ``bias`` [1 or B, Q, X]."""
    rows = tl.arange(0, MP)
    rmask = rows < R
    cols = tl.arange(0, D)
    qs = _query_rows(q_ptr, q_ptr, bh, R, nq, hq, sb, sh, sn, scale, MP, D, False, 16)
    qi = rows % nq
    chunk = tl.cdiv(tl.cdiv(X, E), BLOCK_X) * BLOCK_X
    lo = e * chunk
    hi = tl.minimum(lo + chunk, X)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, D], tl.float32)
    for x0 in range(lo, hi, BLOCK_X):
        j = x0 + tl.arange(0, BLOCK_X)
        jmask = j < hi
        k = tl.load(ke_ptr + (bh * X + j)[:, None] * D + cols[None, :], mask=jmask[:, None],
                    other=0.0)
        s = _exact_dot(qs, tl.trans(k), tl.zeros([MP, BLOCK_X], tl.float32))
        if HAS_BIAS:
            brow = (tl.minimum(bh // hkv, bias_b - 1) * nq + qi).to(tl.int64) * X
            s += tl.load(bias_ptr + brow[:, None] + j[None, :],
                         mask=rmask[:, None] & jmask[None, :], other=0.0)
        visible = jmask[None, :]
        if CAUSAL:
            visible = visible & (j[None, :] <= X - nq + qi[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        val = tl.load(ve_ptr + (bh * X + j)[:, None] * D + cols[None, :], mask=jmask[:, None],
                      other=0.0)
        acc = _exact_dot(p, val, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@_jit
def _finish_part(m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr, out, rmask, m_i, l_i, bh, P, R,
                 hkv, nq, D: tl.constexpr, PCH: tl.constexpr):
    """Write a part's (max, sum) per row (its value sum already at ``acc_ptr``), take KV head
    row ``bh``'s ticket, and, drawing the last of its P, merge them into ``out``."""
    tl.store(m_ptr + out, m_i, mask=rmask)
    tl.store(l_ptr + out, l_i, mask=rmask)
    # every thread's stores, then one gpu-scope acq_rel ticket: the last program sees them all
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
    if ticket == P - 1:
        _merge(m_ptr, l_ptr, acc_ptr, out_ptr, bh, P, R, hkv, nq, D, PCH)
        tl.store(count_ptr + bh, 0)  # ready for a relaunch on the same buffers (autotuning)


@_jit
def _merge(m_ptr, l_ptr, acc_ptr, out_ptr, bh, P, R, hkv, nq, D: tl.constexpr,
           PCH: tl.constexpr):
    """Merge the P parts' softmax states of each of KV head row ``bh``'s R query rows and
    normalise into out [B, Q, Hq, D]. Run by the program that finished last: the parts come
    from other SMs, so they are read past L1 (``.cg``)."""
    cols = tl.arange(0, D)
    at = bh * P  # part p of row r: (at + p) * R + r
    hq = hkv * (R // nq)
    for r in range(0, R):
        top = tl.full([1], float("-inf"), tl.float32)
        for p0 in range(0, P, PCH):
            pi = p0 + tl.arange(0, PCH)
            m = tl.load(m_ptr + (at + pi) * R + r, mask=pi < P, other=float("-inf"),
                        cache_modifier=".cg")
            top = tl.maximum(top, tl.max(m, axis=0))
        total = tl.zeros([1], tl.float32)
        o = tl.zeros([D], tl.float32)
        for p0 in range(0, P, PCH):
            pi = p0 + tl.arange(0, PCH)
            m = tl.load(m_ptr + (at + pi) * R + r, mask=pi < P, other=float("-inf"),
                        cache_modifier=".cg")
            w = tl.exp(m - top)
            total += tl.sum(w * tl.load(l_ptr + (at + pi) * R + r, mask=pi < P, other=0.0,
                                        cache_modifier=".cg"), axis=0)
            a = tl.load(acc_ptr + ((at + pi) * R + r)[:, None] * D + cols[None, :],
                        mask=(w > 0)[:, None], other=0.0, cache_modifier=".cg")
            o += tl.sum(w[:, None] * a, axis=0)
        g, i = r // nq, r % nq
        dst = out_ptr + (((bh // hkv) * nq + i) * hq + (bh % hkv) * (R // nq) + g) * D
        tl.store(dst + cols, o / total)
