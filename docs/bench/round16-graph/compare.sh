#!/usr/bin/env bash
# The serving engine's compiled decode step before and after "one graph for every B" (round sixteen): for each
# source tree given, round fifteen's graph.py over a new empty cache folder: a cold compile, a warm restart, then
# the decode table (eager against compiled at N = 1 and 16, one thread per process).
#   bash docs/bench/round16-graph/compare.sh /path/to/old/src /path/to/new/src > docs/bench/round16-graph/compare.txt
set -euo pipefail
script="$(cd "$(dirname "$0")/.." && pwd)/round15-graph/graph.py"
for src in "$@"; do
  folder=$(mktemp -d)
  echo "== $src ($(git -C "$src" log --oneline -1 2>/dev/null || echo 'working tree'))"
  for step in cold warm; do
    echo "compile, $step (seconds, ready, status): $(env -u TORCHINDUCTOR_CACHE_DIR ATTNKIT_CACHE="$folder" \
      OMP_NUM_THREADS=1 PYTHONPATH="$src" python "$script" --compile-once | tail -1)"
  done
  env -u TORCHINDUCTOR_CACHE_DIR ATTNKIT_CACHE="$folder" OMP_NUM_THREADS=1 PYTHONPATH="$src" python "$script" --decode
  rm -rf "$folder"
done
