"""Paged KV layouts (kvtool.engines.vllm.layout) on synthetic paged tensors.

Each layout is checked against an independent reference writer that places every token by hand;
one test checks the CPU layouts against vLLM's own ``cpu_attn_reshape_and_cache`` op with the
ISA vLLM picks on this machine (``amx`` on x86 CPUs with AMX; skipped without vLLM).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from paged_writers import amx_write, vllm_cpu_ops_or_skip, write_tokens  # noqa: E402

from kvtool.engines.vllm.layout import (  # noqa: E402
    PagedLayout,
    UnsupportedLayoutError,
    detect_layout,
    kernel_block_ids,
    slots,
)

H, D, BS, NB = 3, 8, 4, 7


def empty(name: str, dtype=torch.float32) -> torch.Tensor:
    if name == "flash":
        return torch.zeros(2, NB, BS, H, D, dtype=dtype)
    return torch.zeros(NB, H, BS, 2 * D, dtype=dtype)


def reference_write(name: str, kv: torch.Tensor, block_ids, start: int, k, v) -> None:
    """Place token by token, straight from each layout's definition."""
    for t in range(k.shape[1]):
        pos = start + t
        b, o = block_ids[pos // BS], pos % BS
        for h in range(H):
            if name == "flash":
                kv[0, b, o, h], kv[1, b, o, h] = k[h, t], v[h, t]
            elif name == "split":
                kv[b, h, o, :D], kv[b, h, o, D:] = k[h, t], v[h, t]
            else:  # cpu: row of the (block, head) = K as [D, BS], then V as [BS, D]
                row = kv[b, h].reshape(-1)
                for d in range(D):
                    row[d * BS + o] = k[h, t, d]
                row[BS * D + o * D: BS * D + (o + 1) * D] = v[h, t]


@pytest.fixture
def kv_data():
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(H, 10, D, generator=gen), torch.randn(H, 10, D, generator=gen))


@pytest.mark.parametrize("name", ["cpu", "split", "flash"])
@pytest.mark.parametrize("start", [0, 3, 4])
def test_scatter_matches_reference_and_gather_inverts(name, start, kv_data):
    k, v = kv_data
    blocks = [5, 0, 3, 6]  # out of order, not contiguous
    want, got = empty(name), empty(name)
    reference_write(name, want, blocks, start, k, v)
    layout = PagedLayout(name, D)
    layout.scatter(got, blocks, start, k, v)
    assert torch.equal(got, want)
    gk, gv = layout.gather(want, blocks, start, start + k.shape[1])
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert gk.is_contiguous() and gk.shape == (H, 10, D)


@pytest.mark.parametrize("name", ["cpu", "split", "flash"])
def test_partial_ranges_and_other_blocks_untouched(name, kv_data):
    k, v = kv_data
    layout = PagedLayout(name, D)
    kv = empty(name)
    layout.scatter(kv, [2, 4, 1], 1, k[:, :5], v[:, :5])  # tokens 1..5: blocks 2 and 4
    touched = kv[:, [2, 4]] if name == "flash" else kv[[2, 4]]
    rest = kv[:, [0, 1, 3, 5, 6]] if name == "flash" else kv[[0, 1, 3, 5, 6]]
    assert touched.abs().sum() > 0 and rest.abs().sum() == 0
    gk, gv = layout.gather(kv, [2, 4, 1], 2, 4)
    assert torch.equal(gk, k[:, 1:3]) and torch.equal(gv, v[:, 1:3])


def test_bf16_and_dtype_cast(kv_data):
    k, v = kv_data
    layout = PagedLayout("cpu", D)
    kv = empty("cpu", torch.bfloat16)
    layout.scatter(kv, [1, 2, 3], 0, k, v)  # float32 in, cast to the cache's dtype
    gk, gv = layout.gather(kv, [1, 2, 3], 0, 10)
    assert gk.dtype == torch.bfloat16
    assert torch.equal(gk, k.to(torch.bfloat16)) and torch.equal(gv, v.to(torch.bfloat16))


def test_split_layout_through_strided_view(kv_data):
    """The standardized [B, H, N, 2D] view over NHD-ordered memory: writes land in storage."""
    k, v = kv_data
    physical = torch.zeros(NB, BS, H, 2 * D)
    view = physical.permute(0, 2, 1, 3)  # logical [B, H, N, 2D], not contiguous
    PagedLayout("split", D).scatter(view, [3, 1, 6], 2, k, v)
    assert torch.equal(physical[3, 2, :, D:], v[:, 0])  # position 2: block 3, offset 2
    assert torch.equal(physical[1, 0, :, :D], k[:, 2])  # position 4: block 1, offset 0


def test_cpu_layout_rejects_non_row_contiguous():
    kv = torch.zeros(NB, BS, H, 2 * D).permute(0, 2, 1, 3)  # (block, head) rows not contiguous
    with pytest.raises(UnsupportedLayoutError):
        PagedLayout("cpu", D).gather(kv, [0], 0, 1)


def test_detect_layout():
    assert detect_layout(empty("cpu"), D, "CPU_ATTN", "vec").name == "cpu"
    assert detect_layout(empty("cpu"), D, "CPU_ATTN", "vec16").name == "cpu"
    assert detect_layout(empty("split"), D, "FLASH_ATTN").name == "split"
    assert detect_layout(empty("flash"), D, "FLASH_ATTN").name == "flash"
    amx = torch.zeros(NB, H, 32, 2 * 16, dtype=torch.bfloat16)
    assert detect_layout(amx, 16, "CPU_ATTN", "amx").name == "cpu_amx"
    with pytest.raises(UnsupportedLayoutError, match="ISA"):
        detect_layout(empty("cpu"), D, "CPU_ATTN", "neon")
    with pytest.raises(UnsupportedLayoutError):
        detect_layout(torch.zeros(NB, H, BS, D), D, "FLASH_ATTN")  # MLA-like: no V half
    with pytest.raises(UnsupportedLayoutError):
        PagedLayout("nope", D)


def test_bad_ranges_and_shapes(kv_data):
    k, v = kv_data
    layout = PagedLayout("split", D)
    with pytest.raises(ValueError, match="blocks"):
        layout.gather(empty("split"), [0, 1], 0, 9)  # 2 blocks hold 8 tokens
    with pytest.raises(ValueError, match="heads"):
        layout.scatter(empty("split"), [0, 1, 2], 0, k[:2], v[:2])
    with pytest.raises(ValueError):
        slots([0], BS, 3, 2)
    for bad in ([0, -1], [0, NB]):  # torch takes -1 as the last block; NB is past the end
        kv = empty("split")
        with pytest.raises(ValueError, match=f"blocks 0..{NB - 1}"):
            layout.scatter(kv, bad, 0, k[:, :2 * BS], v[:, :2 * BS])
        with pytest.raises(ValueError, match=f"blocks 0..{NB - 1}"):
            layout.gather(kv, bad, BS, 2 * BS)
        assert not kv.any()
    layout.gather(empty("split"), [0, NB], 0, BS)  # the tokens use block 0 alone


def test_kernel_block_ids():
    assert kernel_block_ids([4, 1], 1) == [4, 1]
    assert kernel_block_ids([4, 1], 2) == [8, 9, 2, 3]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("block_size,dim,start,tokens", [
    (32, 64, 0, 67), (32, 64, 21, 67), (64, 32, 5, 131), (16, 48, 3, 35),
    (32, 64, 32, 64),  # whole blocks: packed without reading them
    (32, 64, 37, 10),  # inside one block
])
def test_amx_layout_matches_reference_and_gather_inverts(dtype, block_size, dim, start, tokens):
    """Writes land where vLLM's packing puts them and leave every other token (the blocks'
    tokens around the range, the other role) as it was; gathers of any window invert them."""
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(2, tokens, dim, generator=gen).to(dt) for _ in range(2))
    blocks = [4, 0, 3, 1, 2]  # out of order, not contiguous
    before = torch.randn(5, 2, block_size, 2 * dim, generator=gen).to(dt)
    want, got = before.clone(), before.clone()
    write_tokens(amx_write, want, blocks, start, k, v)
    layout = detect_layout(got, dim, "CPU_ATTN", "amx")
    layout.scatter(got, blocks, start, k, v)
    assert torch.equal(got, want)
    gk, gv = layout.gather(want, blocks, start, start + tokens)
    assert torch.equal(gk, k) and torch.equal(gv, v) and gk.is_contiguous()
    for a, b in ((7, 9), (1, min(block_size + 1, tokens)),
                 (min(block_size - 1, tokens - 1), tokens)):  # from a block's last token
        gk, gv = layout.gather(want, blocks, start + a, start + b)  # windows across blocks
        assert torch.equal(gk, k[:, a:b]) and torch.equal(gv, v[:, a:b]), (a, b)
    keys_only = before.clone()
    layout.write(keys_only, blocks, start, "key", k)
    half = block_size * dim
    assert torch.equal(keys_only.flatten(2)[..., half:], before.flatten(2)[..., half:])
    assert torch.equal(keys_only.flatten(2)[..., :half], want.flatten(2)[..., :half])


def test_amx_layout_refuses_what_it_cannot_pack():
    for kv, why in ((torch.zeros(2, 1, 32, 64), "float32"),  # 4-byte values: another packing
                    (torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16), "blocks of 8"),
                    (torch.zeros(2, 1, 32, 2 * 24, dtype=torch.bfloat16), "head_dim 24")):
        layout = PagedLayout("cpu_amx", kv.shape[3] // 2)
        with pytest.raises(UnsupportedLayoutError, match=why):
            layout.write(kv, [0], 0, "key", torch.ones(1, 2, kv.shape[3] // 2))
        assert not kv.any()


def _vllm_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The ISA vLLM's CPU backend picks for this cache on this machine."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


@pytest.mark.parametrize("isa,block_size", [("vec", 32), ("vec16", 16), ("picked", 32),
                                            ("picked", 64)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_layout_matches_vllm_kernel(isa, block_size, dtype):
    """vLLM's own cache writer (the op cpu_attn.py calls) agrees with the layout kvtool
    detects for its ISA; "picked" is the ISA vLLM itself picks here (``amx`` for bfloat16 on
    a CPU with AMX, whose writer is only loaded there)."""
    vllm_cpu_ops_or_skip()
    from vllm import _custom_ops as ops

    dt = getattr(torch, dtype)
    heads, dim, tokens = 3, 64, block_size + 7
    if isa == "picked":
        isa = _vllm_isa(dt, block_size, dim)
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(tokens, heads, dim, generator=gen).to(dt)
    value = torch.randn(tokens, heads, dim, generator=gen).to(dt)
    kv = torch.zeros(5, heads, block_size, 2 * dim, dtype=dt)
    key_cache, value_cache = kv.view(5, heads, 2 * block_size, dim).chunk(2, dim=2)
    blocks = [3, 1]
    slot = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                         for p in range(tokens)])
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot, isa)
    layout = detect_layout(kv, dim, "CPU_ATTN", isa)
    gk, gv = layout.gather(kv, blocks, 0, tokens)
    assert torch.equal(gk, key.transpose(0, 1)) and torch.equal(gv, value.transpose(0, 1))
    again = torch.zeros_like(kv)
    layout.scatter(again, blocks, 0, key.transpose(0, 1), value.transpose(0, 1))
    assert torch.equal(again, kv)


@pytest.mark.parametrize("dtype", ["uint8", "float8_e4m3fn", "int8"])
def test_a_cache_of_scaled_codes_is_refused_not_written(dtype):
    """vLLM's fp8 caches (``--kv-cache-dtype fp8``) come as uint8: a cast into them writes
    truncated integers where values belong."""
    kv = torch.zeros(4, 2, 4, 16, dtype=getattr(torch, dtype))
    with pytest.raises(UnsupportedLayoutError, match="fp8"):
        detect_layout(kv, 8, "FLASH_ATTN")
    layout = PagedLayout("split", 8)
    with pytest.raises(UnsupportedLayoutError, match="fp8"):
        layout.write(kv, [0], 0, "key", torch.ones(2, 3, 8))
    assert not kv.float().any()
