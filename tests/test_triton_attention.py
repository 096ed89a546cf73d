"""Attention from codes on Triton (``tests/triton_attention_cases.py``), run in a fresh process:
under Triton's interpreter (``TRITON_INTERPRET=1``, never set in this process) without CUDA,
the ``gpu`` cases compiled with it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from gpu_util import assert_every_case_ran, run_case_file  # noqa: E402

CASES = Path(__file__).with_name("triton_attention_cases.py")
PARTS = Path(__file__).with_name("triton_attention_parts_cases.py")  # balanced, small


def test_attention_from_codes_under_the_interpreter():
    out = run_case_file(CASES, "-m", "not gpu", TRITON_INTERPRET="1",
                        CUDA_VISIBLE_DEVICES="")  # on CPU tensors, GPU or not
    assert_every_case_ran(out, 18)


@pytest.mark.parametrize("cases,count", [("not compressed_cache", 6),
                                         ("compressed_cache and balanced", 1),
                                         ("compressed_cache and small", 1)])
def test_attention_from_every_turbomix_option_under_the_interpreter(cases, count):
    """In parts, so that the suite's two workers share them (~14 min in one process, nearly
    all of it the two presets' CompressedCache cases)."""
    out = run_case_file(PARTS, "-m", "not gpu", "-k", cases, TRITON_INTERPRET="1",
                        CUDA_VISIBLE_DEVICES="")
    assert_every_case_ran(out, count)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attention_from_codes_on_cuda():
    for cases in (CASES, PARTS):
        out = run_case_file(cases, "-m", "gpu or not gpu")
        assert "passed" in out.strip().splitlines()[-1]
