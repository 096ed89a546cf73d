"""The connector's CUDA path (:mod:`kvtool.engines.vllm.device_io`) with the Triton ``turbomix``
kernels it runs on a GPU, under Triton's interpreter on CPU tensors.

Not collected on its own: ``tests/test_vllm_device_io.py`` runs this file in a fresh process
with ``TRITON_INTERPRET=1`` (never set in the main test process: see ``tests/triton_cases.py``).
``turbomix`` picks its Triton kernels for CUDA tensors only; here they serve CPU tensors too
(``_cuda``), so that ``encode_chunk`` and ``load_file`` run the GPU's kernels, while numpy
arrays keep the numpy reference (``_fused`` off): the host path's codes and decodes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("run this file through tests/test_vllm_device_io.py (TRITON_INTERPRET=1)",
                pytrace=False)

from kvtool.codecs.turbomix import TurboMixCodec  # noqa: E402
from kvtool.engines.vllm import device_io  # noqa: E402
from kvtool.engines.vllm.common import policy_from_extra  # noqa: E402
from kvtool.engines.vllm.layout import PagedLayout  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore  # noqa: E402
from kvtool.formats import load, open_kvz  # noqa: E402
from kvtool.kernels import to_numpy, triton_turbomix  # noqa: E402

H, D, BS, NB, CHUNK = 2, 32, 4, 8, 16
MODEL = {"fingerprint": "e" * 64, "name": "tiny"}
BLOCKS = [4, 1, 7, 0]


@pytest.fixture(autouse=True)
def _triton_for_tensors(monkeypatch):
    monkeypatch.setattr(TurboMixCodec, "_fused", lambda self, like: None)
    monkeypatch.setattr(TurboMixCodec, "_cuda", lambda self, like: triton_turbomix
                        if isinstance(like, torch.Tensor) else None)


def paged(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(NB, BS, H, 2 * D, generator=gen) + 0.3).to(torch.bfloat16).transpose(1, 2)


def codes(path: str) -> dict[str, np.ndarray]:
    with open_kvz(path) as f:
        return {name: f.read_tensor(name) for name in f.header["tensors"]}


def test_triton_codes_through_the_device_path(tmp_path):
    """Codes made by the Triton kernels are written as the reference's (same arrays, shapes
    and dtypes; codes within float rounding of a decision), and the kernels decode the file
    into the paged blocks as the host's numpy reference decodes it."""
    policy = policy_from_extra({})  # the default: the quality preset
    layout = PagedLayout("split", D)
    caches = [paged(1), paged(2)]
    ids = list(range(100, 100 + CHUNK))
    dev = PrefixStore(tmp_path / "dev", MODEL, CHUNK, policy, zstd=True)
    ref = PrefixStore(tmp_path / "ref", MODEL, CHUNK, policy, zstd=True)
    chunk = dev.chunks(ids)[0]
    gathered = [layout.gather(kv, BLOCKS, 0, CHUNK) for kv in caches]
    keys, values = [k for k, _ in gathered], [v for _, v in gathered]
    encoded = device_io.encode_chunk(keys, values, dev.chunk_policy(chunk))
    assert dev.write_encoded(chunk, device_io.to_host(encoded), ids) > 0
    ref.write(chunk, [to_numpy(k) for k in keys], [to_numpy(v) for v in values], ids)
    mine, want = codes(str(dev.root / dev._name(chunk))), codes(str(ref.root / ref._name(chunk)))
    assert mine.keys() == want.keys()
    for name, a in want.items():
        b = mine[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert float(np.mean(a != b)) <= (0.01 if ".codes" in name or ".norms" in name
                                          else 0.0), name

    sentinel = torch.full_like(caches[0], 3.0)
    targets = [(sentinel.clone(), layout, [3, 6, 0, 5]) for _ in caches]
    dev.read_into(chunk, CHUNK, None,
                  lambda f: device_io.load_file(f, targets, 0, 2, CHUNK))
    host = load(str(dev.root / dev._name(chunk)))  # numpy: the reference decode
    for (kv, _, blocks), k, v in zip(targets, host.keys, host.values, strict=True):
        got_k, got_v = layout.gather(kv, blocks, 2, CHUNK)
        for got, want_x in ((got_k, k[:, 2:]), (got_v, v[:, 2:])):
            want_t = torch.from_numpy(np.asarray(want_x, dtype=np.float32))
            step = 2.0 ** (torch.floor(torch.log2(want_t.abs().clamp_min(1e-30))) - 7)
            assert bool(((got.float() - want_t).abs() <= step).all())
        mask = torch.ones_like(kv)  # 0 where the load wrote: the same writes, of zeros
        layout.write(mask, blocks, 2, "key", torch.zeros(H, CHUNK - 2, D))
        layout.write(mask, blocks, 2, "value", torch.zeros(H, CHUNK - 2, D))
        untouched = mask.bool()
        assert bool((kv[untouched] == 3.0).all())
        assert int((~untouched).sum()) == 2 * H * (CHUNK - 2) * D
