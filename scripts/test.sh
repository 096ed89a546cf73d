#!/usr/bin/env bash
# Set up (idempotent) and run the full test suite plus lint. Exit non-zero on any failure,
# including pytest's "no tests collected" (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kvtool tests benchmarks examples
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
