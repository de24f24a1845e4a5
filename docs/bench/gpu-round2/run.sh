#!/usr/bin/env bash
# GPU round two, one call on a lent machine (its own torch, transformers; attnkit from this tree's src/):
#     OUT=/some/folder bash docs/bench/gpu-round2/run.sh
# decode.{json,log}: run.py (SmolLM2-shaped decoding, eager and CUDA graphs, attnkit / floor / transformers);
# layer.{json,md,log}: the layer alone at batch 1 against fused QKV + SDPA (the GPU layer target).
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TORCH_LOGS=perf_hints
nvidia-smi -L
timeout --kill-after=10 "${DECODE_LIMIT_S:-330}" python3 docs/bench/gpu-round2/run.py --out "$OUT/decode.json" \
    2>&1 | tee "$OUT/decode.log"
timeout --kill-after=10 "${LAYER_LIMIT_S:-120}" python3 -m attnkit bench --suite custom --contenders attnkit,raw-sdpa \
    --modes inference --batch 1 --seq-lens 128,512,2048 --repeats 20 --no-memory --device cuda --dtype bfloat16 \
    --out /tmp/layer 2>&1 | tee "$OUT/layer.log"
cp /tmp/layer/results.json "$OUT/layer.json"; cp /tmp/layer/summary.md "$OUT/layer.md"
ls -la "$OUT"
