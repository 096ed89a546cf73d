#!/usr/bin/env bash
# Set up (idempotent) and run the full test suite plus lint. Exit non-zero on any failure,
# including pytest's "no tests collected" (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kvtool tests benchmarks examples
# `gpu` tests need a CUDA device: deselected (not skipped) where there is none, and said so
marker=()
if ! .venv/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA device: deselecting the gpu-marked tests (the Triton kernels still run under TRITON_INTERPRET=1)"
    marker=(-m "not gpu")
fi
# two pytest-xdist workers (KVTOOL_TEST_WORKERS; 0: one process, no xdist): most tests keep one
# core busy, so two workers use a 2-core machine. With --dist loadgroup, tests/conftest.py's
# scheduler keeps a module with a module-scoped fixture on one worker, and hands the work out in
# collection order (--no-loadscope-reorder): the longest first, the soak tests (run alone) last
workers=${KVTOOL_TEST_WORKERS:-2}
xdist=()
if [ "$workers" != 0 ]; then
    xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
# the slowest tests, so that the suite stays well inside CI's limit (target: 25 minutes)
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "${xdist[@]}" "${marker[@]}" "$@"
