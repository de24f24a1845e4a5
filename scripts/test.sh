#!/usr/bin/env bash
# Sets everything up, then runs lint, type checks and the whole test suite; then the weight-form, model and
# serving-engine tests (not the HTTP server nor transformers' reference, whose kernels are the same) a second time
# with PyTorch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2: what an AVX2 CPU runs,
# on any x86 machine; tests/conftest.py sets fbgemm's and oneDNN's variables to match).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k rope` (then the AVX2 pass is skipped).
# Two pytest workers (pytest-xdist), each test file whole in one of them (its module fixtures load once), each
# worker's PyTorch on one thread: many tests wait on Python, processes or sockets, and the suite ran in 8.7
# minutes on 2 cores where one worker with 2 threads took 16.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python may write the bytecode of what it imports: setup.sh installs without compiling every file, and where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) each of the suite's many processes (servers, CLIs,
# notebooks, ranks) compiled torch's and transformers' Python again: 7.2 s to import them against 3.4 s.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh --dev
bash scripts/browser.sh
.venv/bin/ruff check src tests
.venv/bin/mypy
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
parallel=(-n "${TEST_WORKERS:-2}" --dist loadfile --durations=30)
.venv/bin/python -m pytest "${parallel[@]}" "$@"
if [ "$#" -eq 0 ] && [ "$(uname -m)" = x86_64 ]; then
  echo "The weight-form, model and serving tests again, with PyTorch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2):"
  # Inductor's own cache of compiled kernels, apart: its key does not name ATEN_CPU_CAPABILITY, and graphs the
  # first pass compiled, loaded under avx2, decoded wrong tokens (tests/models/test_generation.py's compiled steps)
  inductor="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}-avx2"
  TORCHINDUCTOR_CACHE_DIR="$inductor" ATEN_CPU_CAPABILITY=avx2 \
    .venv/bin/python -m pytest "${parallel[@]}" -m "not browser and not slow" \
    tests/modules/test_quantize.py tests/modules/test_quantize_refusals.py tests/modules/test_kv_dtype.py \
    tests/models/test_generation.py tests/models/test_llama.py tests/models/test_gemma3.py \
    tests/models/test_penalties.py tests/serve/test_engine.py tests/test_cpu.py
fi
