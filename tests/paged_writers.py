"""Reference writers of vLLM's CPU paged-cache packings, straight from each ISA's definition in
vLLM's ``csrc/cpu/cpu_attn_*.hpp`` (``reshape_and_cache``), in the
:data:`~kvtool.engines.vllm.layout_probe.Writer` contract: (key ``[T, H, D]``, value, paged
cache ``[B, H, N, 2D]``, slot_mapping ``[T]``). Each (block, head) row holds its keys' N*D
elements first, then its values'; ``key_at``/``value_at`` give an element's place in its half.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

Offset = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]  # (token, dim, N, D)


def _writer(key_at: Offset, value_at: Offset):
    def write(key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        b, h, n, two_d = kv.shape
        d = two_d // 2
        rows = kv.view(b, h, 2 * n * d)
        blk, o = (slot_mapping // n)[:, None], (slot_mapping % n)[:, None]
        dims = torch.arange(d)[None, :]
        at_key, at_value = key_at(o, dims, n, d), n * d + value_at(o, dims, n, d)
        for head in range(h):
            rows[blk, head, at_key] = key[:, head].to(kv.dtype)
            rows[blk, head, at_value] = value[:, head].to(kv.dtype)
    return write


#: ``vec``/``vec16`` (cpu_attn_vec.hpp): keys transposed ``[D, N]``, values ``[N, D]``
vec_write = _writer(lambda o, d, n, dim: d * n + o, lambda o, d, n, dim: o * dim + d)

#: ``amx`` (cpu_attn_amx.hpp): keys ``[N/16, D/2, 16, 2]``, values ``[D/16, N/2, 16, 2]``
amx_write = _writer(
    lambda o, d, n, dim: ((o // 16) * (dim // 2) + d // 2) * 32 + (o % 16) * 2 + d % 2,
    lambda o, d, n, dim: ((d // 16) * (n // 2) + o // 2) * 32 + (d % 16) * 2 + o % 2)

#: ARM ``neon`` with BF16 (cpu_attn_neon_bfmmla.hpp): keys ``[N/8, D/4, 8, 4]`` (8 tokens of 4
#: dims a group), values ``[D/2, N/4, 2, 4]`` (pairs of dims, 4 tokens a row block)
bfmmla_write = _writer(
    lambda o, d, n, dim: (o // 8) * (dim // 4) * 32 + (d // 4) * 32 + (o % 8) * 4 + d % 4,
    lambda o, d, n, dim: (d // 2) * 2 * n + (o // 4) * 8 + (d % 2) * 4 + o % 4)

def fp8_writer(writer, code_dtype: torch.dtype):
    """``writer`` of an fp8 cache at unit scales: K/V rounded to ``code_dtype``'s codes (to
    nearest even, as vLLM's CUDA kernels; its CPU writer truncates) and placed as bytes."""

    def write(key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        writer(key.float().to(code_dtype).view(torch.uint8),
               value.float().to(code_dtype).view(torch.uint8), kv, slot_mapping)

    return write


WRITERS = {"vec": vec_write, "vec16": vec_write, "amx": amx_write, "neon": bfmmla_write}


def write_tokens(writer, kv: torch.Tensor, block_ids: Sequence[int], start: int,
                 keys: torch.Tensor, values: torch.Tensor) -> None:
    """``writer`` on tokens ``[start, start+T)`` of ``block_ids``, K/V as ``[H, T, D]``."""
    n = kv.shape[2]
    pos = torch.arange(start, start + keys.shape[1])
    slot_mapping = torch.as_tensor(list(block_ids))[pos // n] * n + pos % n
    writer(keys.transpose(0, 1), values.transpose(0, 1), kv, slot_mapping)


def vllm_cpu_ops_or_skip() -> None:
    """Skip unless vLLM with its CPU attention kernels (``cpu_attn_reshape_and_cache``) is
    installed."""
    pytest.importorskip("vllm")
    try:
        from vllm import _custom_ops  # noqa: F401
    except Exception as e:  # a vLLM build without CPU ops
        pytest.skip(f"vLLM CPU ops unavailable: {e}")
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("this vLLM build has no CPU attention kernels")
