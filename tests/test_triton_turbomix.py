"""The Triton ``turbomix`` kernels' tests (``tests/triton_turbomix_cases.py``), each run in a
fresh process, as ``tests/test_triton_kernels.py`` runs ``tests/triton_cases.py``: under
Triton's interpreter (``TRITON_INTERPRET=1``, never set in this process) with no GPU visible,
the ``gpu`` cases compiled on CUDA: ~3 minutes on an H100 with a cold Triton cache (estimate per
case in ``tests/triton_turbomix_cases.py``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from gpu_util import assert_every_case_ran, run_case_file  # noqa: E402

CASES = Path(__file__).with_name("triton_turbomix_cases.py")


#: the interpreted cases in two processes run side by side (CI's two cores; this process only
#: waits): the trellis cases of test_encode_decode_match_the_reference, about half the time
#: (the Viterbi loop runs step by step in the interpreter), and every other case
SHARDS = (("test_encode_decode_match_the_reference and trellis", 8),
          ("not (test_encode_decode_match_the_reference and trellis)", 42))


def test_turbomix_kernels_under_the_interpreter():
    with ThreadPoolExecutor(len(SHARDS)) as pool:
        outs = list(pool.map(lambda shard: run_case_file(
            CASES, "-m", "not gpu", "-k", shard[0], TRITON_INTERPRET="1",
            CUDA_VISIBLE_DEVICES=""), SHARDS))  # on CPU tensors, GPU or not
    for out, (_, cases) in zip(outs, SHARDS, strict=True):
        assert_every_case_ran(out, cases)  # 50 in all


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_turbomix_kernels_on_cuda():
    out = run_case_file(CASES, "-m", "gpu")
    assert "passed" in out.strip().splitlines()[-1]
