#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one command (a stock CUDA PyTorch image: torch,
# triton, transformers, numba, safetensors, pytest, pytest-xdist; no vLLM, no install step),
# within SESSION_SECONDS in all (default 560: a device command may run 600 s), each stage
# capped by its own limit and by what is left:
#   1. the gpu test cases, compiled, with xdist workers (TEST_SECONDS at most; first, since their
#      compiles, spread over the workers, fill Triton's cache for the benchmark's kernels),
#   2. benchmarks/gpu.py --all (its own time budget, BENCH_BUDGET seconds; BENCH_SECTIONS picks
#      tables, e.g. attention,presets,cache),
#   3. benchmarks/gpu_attention_split.py: where a call of attention from codes spends its time
#      (SPLIT_SECONDS),
#   4. benchmarks/cold_start.py: the first save/load of a CUDA cache in a fresh process against
#      warm ones (COLD_SECONDS),
#   5. Nsight Compute on one turbo3 encode and decode launch at D=128, then on the quality
#      preset's turbomix ones (benchmarks/ncu_turbo.py): what limits them (NCU_SECONDS),
#   6. benchmarks/autotune_table.py: every config the autotuner timed, per kernel and key.
# The tests run with KVTOOL_AUTOTUNE_CACHE=0: their small calls leave no autotune choice behind
# for a later benchmark on this machine to load.
# A limit of 0 skips its stage (the split-K sweep is off by default: SPLIT_SECONDS=50 runs it).
# Tests print each case as it ends (-v): a stage cut at its limit still shows what passed.
# Logs and the benchmark's JSON go to $OUT (default ./gpu-out): eight files at most, what a lent
# machine sends back (the split-K sweep appends to bench.log).
# Wheels missing there (zstandard) travel in .whl/ (see the README's GPU section) and are
# installed into /tmp/site first.
#   bash scripts/gpu_session.sh          # TEST_SECONDS=150 BENCH_BUDGET=290 COLD_SECONDS=45 NCU_SECONDS=45
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
SESSION_SECONDS=${SESSION_SECONDS:-560}
BENCH_BUDGET=${BENCH_BUDGET:-290}
BENCH_SECTIONS=${BENCH_SECTIONS:-}
TEST_SECONDS=${TEST_SECONDS:-150}
SPLIT_SECONDS=${SPLIT_SECONDS:-0}
COLD_SECONDS=${COLD_SECONDS:-45}
NCU_SECONDS=${NCU_SECONDS:-45}
deadline=$((SECONDS + SESSION_SECONDS))
# the seconds a stage may take: its own limit, or what is left of the session if less
budget() { local left=$((deadline - SECONDS)); echo $(($1 < left ? $1 : left)); }
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
cases=(tests/triton_cases.py tests/triton_turbomix_cases.py tests/triton_attention_cases.py
       tests/triton_attention_parts_cases.py)
workers=$(( $(nproc) / 2 < 8 ? $(nproc) / 2 : 8 ))
parallel=(-n "$workers")  # an image without pytest-xdist runs the cases in one process
python3 -c "import xdist" 2>/dev/null || parallel=()
# what `pytest -m gpu` runs (tests/test_triton_*.py run these files in fresh processes), here
# with every case's output and time; then the in-process gpu tests
tests=$(budget "$TEST_SECONDS")
if ((tests > 10)); then
    KVTOOL_AUTOTUNE_CACHE=0 timeout "$tests" python3 -m pytest -p no:cacheprovider -m gpu \
        "${parallel[@]}" -v --durations=15 "${cases[@]}" 2>&1 | tee "$OUT/tests.log" || status=1
fi
left=$(budget $((TEST_SECONDS - (SECONDS - start))))
if ((left > 10)); then
    KVTOOL_AUTOTUNE_CACHE=0 timeout "$left" python3 -m pytest -p no:cacheprovider -m gpu \
        -v --durations=5 tests/test_load_device.py tests/test_vllm_device_io.py 2>&1 \
        | tee -a "$OUT/tests.log" || status=1
fi
echo "gpu tests: $((SECONDS - start)) s" | tee -a "$OUT/tests.log"

start=$SECONDS
bench=$(budget "$BENCH_BUDGET")
if ((bench > 30)); then
    # gpu.py keeps to its budget row by row; the timeout leaves it 15% to finish a row
    timeout "$(budget $((bench * 115 / 100)))" python3 benchmarks/gpu.py --all --budget $((bench - 10)) \
        ${BENCH_SECTIONS:+--sections "$BENCH_SECTIONS"} --json "$OUT/gpu.json" 2>&1 \
        | tee "$OUT/bench.log" || status=1
fi
echo "benchmark: $((SECONDS - start)) s" | tee -a "$OUT/bench.log"

# where attention from codes spends a call: host µs, device time per split-K, autotune picks
split=$(budget "$SPLIT_SECONDS")
if ((split > 10)); then
    timeout "$split" python3 benchmarks/gpu_attention_split.py 2>&1 \
        | tee -a "$OUT/bench.log" || status=1
fi
cold=$(budget "$COLD_SECONDS")
if ((cold > 10)); then
    timeout "$cold" python3 benchmarks/cold_start.py --device cuda \
        --policy turbo3,quality,balanced --repeats 2 2>&1 \
        | tee "$OUT/cold_start.log" || status=1
fi
# counters, clocks left alone (--clock-control none); the compile launches are skipped
ncu_s=$(budget "$NCU_SECONDS")
# (diagnostic only: a machine that refuses counter reads does not fail the session)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
      2>/dev/null | tail -n 1)
if ((ncu_s > 10)) && [[ -n "$NCU" ]]; then
    : > "$OUT/ncu.log"
    # turbo3, then the quality preset's value codec (turbomix: 12% of the copy on the H100)
    for what in "" "--preset quality --vectors 1M"; do
        left=$(budget $((ncu_s / 2)))
        ((left > 10)) || break
        timeout "$left" "$NCU" --clock-control none --section SpeedOfLight \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section Occupancy --section WarpStateStats -k 'regex:_(en|de)code_kernel' \
            --launch-skip 2 --launch-count 2 python3 benchmarks/ncu_turbo.py $what 2>&1 \
            | tee -a "$OUT/ncu.log" \
            || echo "ncu: exit $? (counters refused, or cut at ${left} s)" | tee -a "$OUT/ncu.log"
    done
fi
table=$(budget 60)
if ((table > 5)); then
    timeout "$table" python3 benchmarks/autotune_table.py --json "$OUT/autotune.json" \
        > "$OUT/autotune.txt" 2>&1 || status=1
    tail -n 3 "$OUT/autotune.txt"
fi
exit $status
