#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one command (a stock CUDA PyTorch image: torch,
# triton, transformers, numba, safetensors, pytest, pytest-xdist; no vLLM, no install step):
#   1. benchmarks/gpu.py --all (every table; its own time budget, BENCH_BUDGET seconds), then
#      benchmarks/gpu_attention_split.py (≤ 2 min),
#   2. benchmarks/cold_start.py: the first save/load of a CUDA cache in a fresh process against
#      warm ones (COLD_SECONDS at most; 0 skips it),
#   3. the gpu test cases, compiled, with xdist workers (TEST_SECONDS at most).
# Logs and the benchmark's JSON go to $OUT (default ./gpu-out). Wheels missing there (zstandard)
# travel in .whl/ (see the README's GPU section) and are installed into /tmp/site first.
#   bash scripts/gpu_session.sh                 # BENCH_BUDGET=300 COLD_SECONDS=150 TEST_SECONDS=200
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
BENCH_BUDGET=${BENCH_BUDGET:-300}
TEST_SECONDS=${TEST_SECONDS:-200}
COLD_SECONDS=${COLD_SECONDS:-150}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers, numba, zstandard, xdist; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', \
transformers.__version__, 'numba', numba.__version__)" 2>&1 | tee -a "$OUT/device.txt"

status=0
start=$SECONDS
timeout $((BENCH_BUDGET + 60)) python3 benchmarks/gpu.py --all --budget "$BENCH_BUDGET" \
    --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.log" || status=1
echo "benchmark: $((SECONDS - start)) s" | tee -a "$OUT/bench.log"
# where attention from codes spends a call: host µs, device time per split-K, autotune picks
timeout 120 python3 benchmarks/gpu_attention_split.py 2>&1 | tee "$OUT/attention_split.log" \
    || status=1
if (( COLD_SECONDS > 0 )); then
    timeout "$COLD_SECONDS" python3 benchmarks/cold_start.py --device cuda \
        --json "$OUT/cold_start.json" 2>&1 | tee "$OUT/cold_start.log" || status=1
fi

start=$SECONDS
cases=(tests/triton_cases.py tests/triton_turbomix_cases.py tests/triton_attention_cases.py
       tests/triton_attention_parts_cases.py)
workers=$(( $(nproc) / 2 < 8 ? $(nproc) / 2 : 8 ))
# what `pytest -m gpu` runs (tests/test_triton_*.py run these files in fresh processes), here
# with every case's output and time; then the in-process gpu tests
timeout "$TEST_SECONDS" python3 -m pytest -p no:cacheprovider -q -m gpu -n "$workers" \
    --durations=15 "${cases[@]}" 2>&1 | tee "$OUT/tests.log" || status=1
left=$(( TEST_SECONDS - (SECONDS - start) ))
if (( left > 10 )); then
    timeout "$left" python3 -m pytest -p no:cacheprovider -q -m gpu --durations=5 \
        tests/test_load_device.py tests/test_vllm_device_io.py 2>&1 | tee -a "$OUT/tests.log" \
        || status=1
fi
echo "gpu tests: $((SECONDS - start)) s" | tee -a "$OUT/tests.log"
exit $status
