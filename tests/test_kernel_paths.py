"""Fast paths of the array backends: row blocking, finiteness checks, bucketize, and turbo
decoding/encoding block by block exactly as in one piece."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

from kvtool.codecs import get_codec
from kvtool.kernels import numpy_ops, row_blocks


class _Blocks:
    """An ops namespace stand-in with a fixed block size."""

    def __init__(self, step: int):
        self.step = step

    def block_rows(self, like, width):
        return self.step


@pytest.mark.parametrize("rows", [0, 1, 5, 100, 101, 4096, 4097, 10000])
@pytest.mark.parametrize("step", [1, 7, 100, 4096, sys.maxsize])
def test_row_blocks_cover_every_row_in_near_equal_blocks(rows, step):
    blocks = row_blocks(_Blocks(step), None, rows, 64)
    covered = [i for b in blocks for i in range(rows)[b]]
    assert covered == list(range(rows))
    sizes = [len(range(rows)[b]) for b in blocks]
    assert max(sizes) <= max(step, 1)
    assert max(sizes) - min(sizes) <= 1 or rows == 0  # no small remainder block


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_all_finite(bad, dtype):
    x = np.ones((3, 70), dtype=np.float32)
    assert numpy_ops.all_finite(x.astype(dtype))
    assert numpy_ops.all_finite(np.zeros((0, 4), dtype=dtype))
    x[2, 69] = bad
    assert not numpy_ops.all_finite(x.astype(dtype))
    torch = pytest.importorskip("torch")
    from kvtool.kernels import torch_ops

    t = torch.from_numpy(x).to({np.float32: torch.float32, np.float16: torch.float16,
                                ml_dtypes.bfloat16: torch.bfloat16}[dtype])
    assert not torch_ops.all_finite(t) and not torch_ops.all_finite(t.T)  # strided too
    assert torch_ops.all_finite(torch.ones(3, 70, dtype=t.dtype))
    assert torch_ops.all_finite(torch.zeros(0, 4, dtype=t.dtype))


def test_bucketize_paths_agree(rng):
    boundaries = np.sort(rng.standard_normal(15)).astype(np.float32)
    x = rng.standard_normal((50, 64)).astype(np.float32)
    x[0, :15] = boundaries  # ties count as not below
    want = np.searchsorted(boundaries, x, side="left").astype(np.uint8)
    np.testing.assert_array_equal(numpy_ops.bucketize(x, boundaries), want)
    torch = pytest.importorskip("torch")
    from kvtool.kernels import torch_ops

    xt = torch.from_numpy(x)
    np.testing.assert_array_equal(torch_ops.bucketize(xt, boundaries).numpy(), want)
    np.testing.assert_array_equal(torch_ops.compare_add(xt, boundaries).numpy(), want)  # GPUs


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("spec", ["turbo3", "turbo2:center=true", "turbo4"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_turbo_blocks_match_one_block(backend, spec, dtype, rng, monkeypatch):
    if backend == "torch":
        torch = pytest.importorskip("torch")
        from kvtool.kernels import torch_ops as xp

        x = torch.from_numpy(rng.standard_normal((3, 301, 64)).astype(np.float32) * 3 + 1)
        x = x.to(getattr(torch, dtype))
    else:
        xp = numpy_ops
        x = (rng.standard_normal((3, 301, 64)) * 3 + 1).astype(dtype)
    codec = get_codec(spec)
    monkeypatch.setattr(xp, "block_rows", lambda like, width: sys.maxsize)
    whole = codec.encode(x)
    whole_out = np.asarray(codec.decode(whole, "float32"))
    monkeypatch.setattr(xp, "block_rows", lambda like, width: 100)  # 10 blocks of ~90 rows
    blocked = codec.encode(x)
    for name, a in whole.arrays.items():
        a, b = np.asarray(a), np.asarray(blocked.arrays[name])
        assert b.dtype == a.dtype and b.shape == a.shape, name
        if a.dtype == np.uint8:  # BLAS may round a few rows differently: a boundary code flips
            assert (a == b).mean() > 0.999, name
        else:  # fp16 norms and means: equal up to one fp16 rounding, not bit for bit
            np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32),
                                       rtol=np.finfo(a.dtype).eps, atol=0, err_msg=name)
    out = codec.decode(whole, "float32")  # now in blocks: floats equal up to rounding
    assert tuple(out.shape) == whole_out.shape
    np.testing.assert_allclose(np.asarray(out), whole_out, rtol=1e-5,
                               atol=1e-5 * np.abs(whole_out).max())
    assert codec.decode(whole).dtype == x.dtype
