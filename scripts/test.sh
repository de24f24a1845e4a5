#!/usr/bin/env bash
# Sets everything up, then runs lint, type checks and the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k rope`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
bash scripts/browser.sh
.venv/bin/ruff check src tests
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
