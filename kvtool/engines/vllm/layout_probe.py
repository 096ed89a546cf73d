"""A CPU paged layout checked against vLLM's own cache writer, or read off it.

vLLM's CPU attention packs each (block, head) row of its paged cache the way the ISA it picked
computes best: ``vec`` transposes the keys, ``amx`` packs AMX tiles, ARM's ``neon`` with BF16
packs BFMMLA tiles, POWER, s390x and RISC-V have their own; and a vLLM release may change a
packing. A layout read wrongly loads caches that decode to garbage and says nothing, so the
connector asks the writer itself, once per (dtype, block size, head_dim, ISA), at its first
save or load:

1. a layout kvtool knows for the ISA must agree with the writer: a cache the writer filled
   gathers back exactly, and one the layout scattered equals the writer's, bit for bit;
2. otherwise the writer runs on probe tokens whose elements carry their own token and dim
   (digits exact in the cache's element type: base 64 in 16-bit floats, 16 in fp8 e4m3, 8 in
   e5m2), and the permutation of each row half it makes is read back as a ``cpu_probed``
   layout, which must then agree as in 1.

An fp8 cache (:mod:`~kvtool.engines.vllm.fp8_cache`) is probed at unit scales; its writer's
rounding need not be kvtool's, so "agree" means: what the writer wrote gathers back within the
format's rounding of the input, and scattered back it gives the writer's bytes exactly.

A writer whose packing is not such a permutation, or that fails on the probe of an ISA kvtool
does not know, is refused (:class:`~kvtool.engines.vllm.layout.UnsupportedLayoutError`): the
server then runs without its store. Only :func:`vllm_cpu_writer` touches vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kvtool.engines.vllm.fp8_cache import Fp8Cache
from kvtool.engines.vllm.layout import PagedLayout, UnsupportedLayoutError, detect_layout

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""Writes (key ``[T, H, D]``, value ``[T, H, D]``) into (paged cache ``[B, H, N, 2D]``,
slot_mapping ``[T]``) as vLLM's CPU backend does."""


class WriterFailed(RuntimeError):
    """The cache writer itself raised (not kvtool reading what it wrote)."""

DIGITS = {None: 64, "e4m3": 16, "e5m2": 8}  # a probe's values 1..base are exact in the cache


def vllm_cpu_writer(isa: str, kv_cache_dtype: str = "auto") -> Writer:
    """vLLM's ``cpu_attn_reshape_and_cache`` for ``isa``, as ``cpu_attn.py`` calls it (an
    fp8 ``kv_cache_dtype`` at unit scales)."""

    def write(key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        b, h, n, _ = kv.shape
        key_cache, value_cache = kv.view(b, h, 2 * n, -1).chunk(2, dim=2)
        quantized = () if kv_cache_dtype == "auto" else (1.0, 1.0, kv_cache_dtype)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa,
                                       *quantized)

    return write


def cpu_layout(kv: torch.Tensor, head_dim: int, isa: str | None, writer: Writer | None,
               fp8: Fp8Cache | None = None) -> tuple[PagedLayout, str | None]:
    """(layout of a CPU paged cache that ``isa`` wrote, a warning to log or None), checked
    against ``writer`` where there is one (module doc; ``fp8``: the cache holds fp8 codes);
    UnsupportedLayoutError where none fits."""
    try:
        known, refused = detect_layout(kv, head_dim, "CPU_ATTN", isa, fp8), None
    except UnsupportedLayoutError as e:
        known, refused = None, e
    if writer is None or isa is None:
        if known is None:
            raise refused
        return known, None
    PagedLayout("cpu", head_dim, fp8=fp8).check(kv)  # its shape and element type
    n = int(kv.shape[2])
    if known is not None:
        try:
            if agrees(known, writer, kv.dtype, n):
                return known, None
        except WriterFailed as e:  # only an unchecked layout is used unchecked
            return known, (f"could not check the {known.name!r} layout against vLLM's {isa!r} "
                           f"cache writer ({e}); using it unchecked")
    try:  # from here on a failure refuses: the known layout, if any, is wrong
        offsets = probe_offsets(writer, kv.dtype, n, head_dim, fp8)
        probed = PagedLayout("cpu_probed", head_dim, offsets, fp8)
        fits = agrees(probed, writer, kv.dtype, n)
    except WriterFailed as e:
        raise UnsupportedLayoutError(f"vLLM's cache writer for the CPU attention ISA {isa!r} "
                                     f"failed on a probe ({e})") from e
    if not fits:
        raise UnsupportedLayoutError(f"vLLM's cache writer for the CPU attention ISA {isa!r} "
                                     "packs blocks in a way kvtool cannot read back")
    what = (f"kvtool's {known.name!r} layout disagrees with vLLM's {isa!r} cache writer"
            if known is not None else f"the CPU attention ISA {isa!r} is new to kvtool")
    return probed, f"{what}: using the packing read off the writer"


def agrees(layout: PagedLayout, writer: Writer, dtype: torch.dtype, block_size: int,
           heads: int = 2) -> bool:
    """Whether ``layout`` reads and writes a cache of ``dtype`` exactly as ``writer`` does:
    random tokens over two out-of-order blocks, the second one partly filled (an fp8 cache:
    see the module doc)."""
    n, d = block_size, layout.head_dim
    fp8 = layout.fp8
    if fp8 is not None:  # the writer's scales are 1 (vllm_cpu_writer)
        layout = replace(layout, fp8=replace(fp8, k_scale=1.0, v_scale=1.0))
    tokens = n + n // 2 + 1
    gen = torch.Generator().manual_seed(0)
    given = getattr(torch, fp8.dtype) if fp8 is not None else dtype
    key, value = (torch.randn(tokens, heads, d, generator=gen).to(given) for _ in range(2))
    blocks = [2, 0]
    slot_mapping = torch.tensor([blocks[p // n] * n + p % n for p in range(tokens)])
    written = torch.zeros(3, heads, n, 2 * d, dtype=dtype)
    _write(writer, key, value, written, slot_mapping)
    read = layout.gather(written, blocks, 0, tokens)
    ours = torch.zeros_like(written)
    layout.scatter(ours, blocks, 0, *read)
    if not torch.equal(ours, written):
        return False
    if fp8 is None:
        return all(torch.equal(r, x.transpose(0, 1)) for r, x in zip(read, (key, value),
                                                                     strict=True))
    # an fp8 code is within a quarter of its value (e5m2 truncated) or of the smallest normal
    return all(torch.allclose(r.float(), x.transpose(0, 1).float(), rtol=0.25, atol=2 ** -6)
               for r, x in zip(read, (key, value), strict=True))


def probe_offsets(writer: Writer, dtype: torch.dtype, block_size: int, head_dim: int,
                  fp8: Fp8Cache | None = None) -> dict[str, torch.Tensor]:
    """Per role, the row-half position of each (token, dim) element of one block of ``dtype``
    that ``writer`` fills (:class:`PagedLayout`'s ``offsets``; ``fp8``: the cache holds fp8
    codes); UnsupportedLayoutError where its packing is not one permutation of each row
    half."""
    n, d = block_size, head_dim
    base = DIGITS[fp8.format if fp8 is not None else None]
    given = getattr(torch, fp8.dtype) if fp8 is not None else dtype
    digits = 1
    while base ** digits < max(n, d):
        digits += 1
    token = torch.arange(n).view(n, 1, 1).expand(n, 1, d)
    dim = torch.arange(d).view(1, 1, d).expand(n, 1, d)
    held = torch.zeros(2, n * d, dtype=torch.long)  # per row half: the (token, dim) it holds
    for quantity, weight in ((token, d), (dim, 1)):
        for j in range(digits):
            digit = (quantity // base ** j) % base + 1
            kv = torch.zeros(1, 1, n, 2 * d, dtype=dtype)
            _write(writer, digit.to(given), (-digit).to(given), kv, torch.arange(n))
            values = kv.view(fp8.code_dtype) if fp8 is not None else kv
            got = values.view(2, n * d).double() * torch.tensor([[1.0], [-1.0]],
                                                                dtype=torch.double)
            if not bool(((got >= 1) & (got <= base) & (got == got.round())).all()):
                raise UnsupportedLayoutError(
                    "vLLM's CPU cache writer does not keep a block's keys in the first half "
                    "of each (block, head) row and its values in the second, element for "
                    "element")
            held += (got.long() - 1) * (base ** j * weight)
    every = torch.arange(n * d)
    if not all(torch.equal(h.sort().values, every) for h in held):
        raise UnsupportedLayoutError("vLLM's CPU cache writer does not place each element of a "
                                     "block exactly once")
    return {"key": held[0].argsort(), "value": held[1].argsort()}


def _write(writer: Writer, *args: torch.Tensor) -> None:
    try:
        writer(*args)
    except Exception as e:
        raise WriterFailed(f"{type(e).__name__}: {e}") from e
