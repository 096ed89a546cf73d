"""The Triton kernels' tests (``tests/triton_cases.py``), each run in a fresh process.

Without CUDA they run under Triton's interpreter (``TRITON_INTERPRET=1``), which must never be
set in this process: triton decorates its kernels once, so every Triton kernel imported after it
(vLLM's too) would become an interpreted one; it runs there with no GPU visible, on a GPU
machine too. With CUDA, the ``gpu`` cases run compiled: ~2 minutes on an H100 with a cold
Triton cache (estimate per case in ``tests/triton_cases.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from gpu_util import assert_every_case_ran, run_case_file  # noqa: E402

CASES = Path(__file__).with_name("triton_cases.py")


def test_kernels_under_the_interpreter():
    out = run_case_file(CASES, "-m", "not gpu", TRITON_INTERPRET="1",
                    CUDA_VISIBLE_DEVICES="")  # on CPU tensors, GPU or not
    assert_every_case_ran(out, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_cuda():
    out = run_case_file(CASES, "-m", "gpu")
    assert "passed" in out.strip().splitlines()[-1]
