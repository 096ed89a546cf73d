#!/usr/bin/env bash
# The whole suite with numba hidden, as on an install without the `cpu` extra: everything must
# pass on the reference array ops (the modules that test the compiled kernels skip themselves).
# Usage: bash scripts/test_without_numba.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
shadow=$(mktemp -d)
trap 'rm -rf "$shadow"' EXIT
mkdir -p "$shadow/numba"
echo 'raise ModuleNotFoundError("No module named numba (hidden by test_without_numba.sh)", name="numba")' \
    > "$shadow/numba/__init__.py"
PYTHONPATH="$shadow${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -c \
    "import kvtool.kernels as k; assert k.cpu_kernels() is None, 'numba still loads'"
PYTHONPATH="$shadow${PYTHONPATH:+:$PYTHONPATH}" exec .venv/bin/python -m pytest -q \
    -p no:cacheprovider -m "not gpu" "$@"
