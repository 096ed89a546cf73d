"""The compiled CPU backend (numba) against the reference array ops.

Codes must be byte-identical except where a coordinate lies within float rounding of a bin
boundary (the butterflies sum in another order than the reference's matmul); decoded values must
agree within float rounding. Every test compares against ``KVTOOL_KERNELS=reference``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kvtool.codecs import get_codec
from kvtool.codecs.rotation import rotation_matrix_t
from kvtool.errors import CodecError
from kvtool.kernels import bitpack, compiled_for, kernel_mode, numpy_ops

numba_cpu = pytest.importorskip("kvtool.kernels.numba_cpu")  # skips only without numba
torch = pytest.importorskip("torch")

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def reference(monkeypatch, fn):
    """``fn()`` with the compiled kernels switched off."""
    with monkeypatch.context() as m:
        m.setenv("KVTOOL_KERNELS", "reference")
        return fn()


def near_boundary(codec, x: np.ndarray, tol: float = 1e-6) -> np.ndarray:
    """Elements whose normalised rotated value lies within ``tol`` of a codebook boundary."""
    dim = x.shape[-1]
    x64 = x.astype(np.float64).reshape(-1, dim)
    y = x64 @ rotation_matrix_t(dim, codec.seed).astype(np.float64)
    y /= np.maximum(np.linalg.norm(x64, axis=-1, keepdims=True), 1e-300)
    bounds = codec.codebook(dim).boundaries.astype(np.float64)
    return (np.abs(y[..., None] - bounds).min(-1) < tol).reshape(x.shape)


def code_mismatch(codec, got: np.ndarray, want: np.ndarray, dim: int) -> np.ndarray:
    return (bitpack.unpack_bits(numpy_ops, got, codec.bits, dim)
            != bitpack.unpack_bits(numpy_ops, want, codec.bits, dim))


def sample(rows: int, dim: int, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim)) * rng.uniform(0.01, 30, (rows, 1))
    x[::7] += rng.standard_normal(dim) * 5  # shared offsets, as real keys have
    x[3, :] = 0  # an all-zero vector
    x[5, 1] = 40  # one dominant channel
    return x.astype(DTYPES[dtype])


def test_compiled_backend_is_active_and_reference_mode_switches_it_off(monkeypatch):
    x = np.ones((4, 64), np.float32)
    assert compiled_for(x) is numba_cpu
    assert compiled_for(torch.from_numpy(x)) is numba_cpu
    monkeypatch.setenv("KVTOOL_KERNELS", "reference")
    assert kernel_mode() == "reference" and compiled_for(x) is None
    called = []
    monkeypatch.setattr(numba_cpu, "turbo_encode", lambda *a: called.append(a))
    get_codec("turbo3").encode(x)
    assert not called


def test_fused_path_is_taken(monkeypatch):
    calls = []
    real = numba_cpu.turbo_decode
    monkeypatch.setattr(numba_cpu, "turbo_decode", lambda *a: calls.append(1) or real(*a))
    codec = get_codec("turbo3")
    codec.decode(codec.encode(np.ones((4, 64), np.float16)))
    assert calls == [1]


@pytest.mark.parametrize("value", ["bogus", "numpy", "1"])
def test_bad_kernel_mode_is_refused(monkeypatch, value):
    monkeypatch.setenv("KVTOOL_KERNELS", value)
    with pytest.raises(CodecError, match="KVTOOL_KERNELS"):
        get_codec("turbo3").encode(np.ones((2, 64), np.float32))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("center", [False, True])
def test_encode_matches_reference(monkeypatch, bits, dim, dtype, center):
    codec = get_codec(f"turbo{bits}", seed=dim * 7 + bits, center=center)
    x = sample(301, dim, dtype, seed=bits)  # not a multiple of the tile
    got = codec.encode(x)
    want = reference(monkeypatch, lambda: codec.encode(x))
    assert got.arrays.keys() == want.arrays.keys()
    for name in ("norms", "mean"):
        if name in want.arrays:  # the norm's fp16 rounding may differ by one ulp, rarely
            a, b = (v.view(np.int16).astype(int) for v in (got.arrays[name], want.arrays[name]))
            assert np.abs(a - b).max() <= 1 and np.mean(a != b) < 0.01
    bad = code_mismatch(codec, got.arrays["codes"], want.arrays["codes"], dim)
    if not center:  # centred inputs are rotated from x − mean: the mask needs that input
        assert not (bad & ~near_boundary(codec, x.astype(np.float32))).any()
    assert bad.mean() < 1e-3


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_matches_reference_within_rounding(monkeypatch, bits, dim, dtype):
    codec = get_codec(f"turbo{bits}", seed=11)
    enc = reference(monkeypatch, lambda: codec.encode(sample(203, dim, "float32")))
    got = codec.decode(enc, dtype)
    want = reference(monkeypatch, lambda: codec.decode(enc, dtype))
    assert got.dtype == want.dtype and got.shape == want.shape
    norms = enc.arrays["norms"].astype(np.float32)[:, None]
    g, w = got.astype(np.float32), want.astype(np.float32)
    if dtype == "float32":  # 1e-5 of the vector's norm: coordinates may cancel to ~0
        assert (np.abs(g - w) <= 1e-5 * norms).all()
    else:  # at most one ulp of the output type, plus float32 rounding of tiny values
        ulp = np.abs(np.spacing(w.astype(DTYPES[dtype]))).astype(np.float32)
        assert (np.abs(g - w) <= ulp + 1e-6 * norms).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_tensors_go_through_zero_copy_views(monkeypatch, dtype):
    codec = get_codec("turbo3")
    x = sample(130, 128, dtype)
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" \
        else torch.from_numpy(x)
    enc = codec.encode(t.requires_grad_(dtype != "bfloat16"))  # autograd leaves, too
    ref = reference(monkeypatch, lambda: codec.encode(x))
    assert isinstance(enc.arrays["codes"], torch.Tensor)
    np.testing.assert_array_equal(enc.arrays["codes"].numpy(), ref.arrays["codes"])
    out = codec.decode(enc)
    assert isinstance(out, torch.Tensor) and str(out.dtype) == f"torch.{dtype}"
    strided = codec.encode(t.detach().T.contiguous().T)  # same values, column-major storage
    np.testing.assert_array_equal(strided.arrays["codes"].numpy(), ref.arrays["codes"])


def test_every_backend_reads_every_other_backends_bytes(monkeypatch):
    codec = get_codec("turbo4", seed=5)
    x = sample(64, 64, "float16")
    fused = codec.encode(x)
    plain = reference(monkeypatch, lambda: codec.encode(x))
    for enc in (fused, plain):
        a = codec.decode(enc, "float32")
        b = reference(monkeypatch, lambda e=enc: codec.decode(e, "float32"))
        c = codec.decode(enc.to_torch(), "float32").numpy()
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()))
        np.testing.assert_allclose(c, b, atol=1e-5 * float(np.abs(b).max()))


def test_non_finite_and_overflow_are_refused_like_the_reference():
    codec = get_codec("turbo3")
    x = np.ones((40, 64), np.float32)
    x[33, 2] = np.nan
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode(x)
    with pytest.raises(CodecError, match="fp16 range"):
        codec.encode(np.full((4, 64), 9000.0, np.float32))  # norm 72000
    x = np.zeros((4, 64), np.float32)
    x[:, 0] = 65504.5  # rounds to 65504 in fp16, but the reference refuses norms above it
    with pytest.raises(CodecError, match="fp16 range"):
        codec.encode(x)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 129])
def test_packing_kernels_match_the_reference_plan(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 1 << bits, (5, 3, n), dtype=np.uint8)
    packed = bitpack.pack_bits(numpy_ops, codes, bits)
    np.testing.assert_array_equal(numba_cpu.pack_bits(codes, bits), packed)
    np.testing.assert_array_equal(numba_cpu.unpack_bits(packed, bits, n), codes)
    values = rng.standard_normal(1 << bits).astype(np.float32)
    np.testing.assert_array_equal(numba_cpu.unpack_lookup(packed, bits, n, values), values[codes])
    t = numba_cpu.pack_bits(torch.from_numpy(codes), bits)
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), packed)


def test_empty_inputs():
    codec = get_codec("turbo3")
    enc = codec.encode(np.zeros((0, 64), np.float16))
    assert enc.arrays["codes"].shape == (0, 24)
    assert codec.decode(enc).shape == (0, 64)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


ROUNDTRIP = ("import numpy as np; from kvtool.codecs import get_codec; "
             "from kvtool.kernels import compiled_for; c = get_codec('turbo3'); "
             "x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float16); "
             "y = c.decode(c.encode(x), 'float32'); "
             "print(compiled_for(x) is not None, float(((y - x) ** 2).sum() / (x.astype("
             "np.float32) ** 2).sum()))")


def test_works_where_no_cache_directory_is_writable(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where a directory is needed: nothing can be created in it
    out = _run(ROUNDTRIP, NUMBA_CACHE_DIR=str(blocked / "cache"))
    assert out.returncode == 0, out.stderr
    active, nmse = out.stdout.split()
    assert active == "True" and 0.02 < float(nmse) < 0.05


CACHE_STATS = """
import json, numpy as np, kvtool
from kvtool.codecs import get_codec
from kvtool.kernels import numba_cpu
c = get_codec("turbo3")
c.decode(c.encode(np.random.default_rng(0).standard_normal((64, 128)).astype(np.float16)))
stats = [k.stats for k in (numba_cpu.turbo_encode_kernel, numba_cpu.turbo_decode_kernel)]
print(json.dumps({"package": kvtool.__file__, "paths": [s.cache_path for s in stats],
                  "hits": [sum(s.cache_hits.values()) for s in stats],
                  "misses": [sum(s.cache_misses.values()) for s in stats]}))
"""


def _set_writable(root: Path, writable: bool) -> None:
    for path in (root, *root.rglob("*")):
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~0o222)


def test_a_read_only_install_caches_its_kernels_in_the_user_cache(tmp_path):
    """A copy of the package with no writable ``__pycache__`` (a system site-packages) and no
    ``NUMBA_CACHE_DIR``: the first process compiles into ``$KVTOOL_CACHE_DIR/numba``, the second
    loads every kernel from there (numba's own hit and miss counts, no timing)."""
    import kvtool

    package = tmp_path / "site" / "kvtool"
    shutil.copytree(Path(kvtool.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    # root writes through permission bits: a file named __pycache__ blocks even root
    (package / "kernels" / "__pycache__").write_text("")
    _set_writable(package, False)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(package.parent), KVTOOL_CACHE_DIR=str(tmp_path / "cache"))
    try:
        runs = []
        for _ in range(2):
            run = subprocess.run([sys.executable, "-c", CACHE_STATS], capture_output=True,
                                 text=True, env=env, cwd=tmp_path, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    finally:
        _set_writable(package, True)
    first, second = runs
    assert first["package"] == str(package / "__init__.py")
    assert all(p.startswith(str(tmp_path / "cache" / "numba")) for p in first["paths"])
    assert first["hits"] == [0, 0] and min(first["misses"]) > 0  # compiled, then saved
    assert min(second["hits"]) > 0 and second["misses"] == [0, 0]  # loaded, none compiled


def test_an_edit_of_a_file_a_kernel_calls_into_recompiles_the_kernel(tmp_path):
    """numba keeps a cached kernel while its own file is unchanged, but the turbo kernels'
    compiled code also holds ``numba_packing``'s unpackers: after an edit there (a ``git pull``
    into an editable install) the next process recompiles them rather than load stale code."""
    import kvtool

    package = tmp_path / "site" / "kvtool"
    shutil.copytree(Path(kvtool.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(package.parent))

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", CACHE_STATS], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["package"] == str(package / "__init__.py")
    assert min(first["misses"]) > 0 and min(second["hits"]) > 0 and second["misses"] == [0, 0]
    edited = package / "kernels" / "numba_packing.py"
    edited.write_text(edited.read_text() + "\n# an edit the turbo kernels' own files do not see\n")
    third, fourth = run(), run()
    assert third["hits"] == [0, 0] and min(third["misses"]) > 0  # recompiled, not stale
    assert min(fourth["hits"]) > 0 and fourth["misses"] == [0, 0]  # and cached again


def test_without_numba_everything_runs_on_the_reference_path():
    code = "import sys; sys.modules['numba'] = None; " + ROUNDTRIP
    out = _run(code)
    assert out.returncode == 0, out.stderr
    active, nmse = out.stdout.split()
    assert active == "False" and 0.02 < float(nmse) < 0.05
    forced = _run("import sys; sys.modules['numba'] = None; " + ROUNDTRIP,
                  KVTOOL_KERNELS="compiled")
    assert forced.returncode != 0 and "not installed" in forced.stderr


def test_llvmlite_library_object_survives_a_namespace_scan():
    """vLLM's Triton override scan calls ``vars(x).get`` on every module attribute that has a
    ``__dict__``; llvmlite's FFI library object used to claim one and break vLLM's start."""
    from llvmlite.binding import ffi

    assert not hasattr(ffi.lib, "__dict__")
    assert ffi.lib.LLVMPY_GetHostCPUName is not None  # real functions still resolve


WARM = """
from kvtool.codecs import get_codec
from kvtool.kernels import numba_cpu, warm_up_async
thread = warm_up_async([get_codec("turbo3"), get_codec("turbo2")], "float16")
print(thread is not None and (thread.join(), True)[1])
print(sorted(str(sig[0].dtype) for sig in numba_cpu.turbo_encode_kernel.signatures),
      sorted(str(sig[-3].dtype) for sig in numba_cpu.turbo_decode_kernel.signatures))
"""


def test_warm_up_loads_the_kernels_for_the_dtype_it_is_given():
    out = _run(WARM)
    assert out.returncode == 0, out.stderr
    started, sigs = out.stdout.strip().split("\n")
    assert started == "True"
    assert sigs == "['uint16'] ['uint16']"  # fp16 in, fp16 out: the kernels capture will run
    assert _run(WARM, KVTOOL_KERNELS="reference").stdout.startswith("False")


KERNEL_PAIR = """
import sys
import numba
import numpy as np
from numba import prange
from kvtool.kernels.numba_support import jit

def spread(out):
    for i in prange(out.shape[0]):
        out[i] = numba.get_thread_id()

kernels = {"serial": jit()(spread), "parallel": jit(parallel=True)(spread)}
out = np.full(8, -1)
kernels[sys.argv[1]](out)
print(sorted(set(out.tolist())))
"""


def test_a_parallel_kernel_does_not_load_the_serial_kernels_cache(tmp_path):
    # numba keys its cache by the function's name, line and types, not its options: a parallel
    # kernel of the same function once loaded the serial one cached before it (one thread)
    module = tmp_path / "pair.py"
    module.write_text(KERNEL_PAIR)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "NUMBA_NUM_THREADS": "2"}
    threads = []
    for kernel in ("serial", "parallel"):  # the serial one fills the cache first
        run = subprocess.run([sys.executable, str(module), kernel], capture_output=True,
                             text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        threads.append(run.stdout.strip())
    assert threads == ["[0]", "[0, 1]"]
