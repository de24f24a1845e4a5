"""Where a SmolLM2 decoding step's time goes: matrix products, attention, everything else.

    python docs/bench/decode-profile/profile_decode.py [--threads 2] [--tokens 64] [--context 16]

For each weight form, eager and compiled (GenerationOptions.compile): the wall time per new token
at batch 1, and the profiler's self time of the matrix-product ops (F.linear, the packed kernels)
and of attention (SDPA) per step; "everything else" is the rest of the wall time (norms, rotary
embedding, cache writes, sampling, Python between them). Prints one line per case, and JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from attnkit.models import load_smollm2

MATMUL = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "int4pack", "int8pack", "linear_fp16_weight")
ATTENTION = ("scaled_dot_product", "flash_attention")


def breakdown(model, ids, tokens: int, compiled: bool) -> dict[str, float]:
    options = dict(max_new_tokens=tokens, stop_ids=[], compile=compiled)
    with torch.inference_mode():
        for _ in range(2):
            model.generate(ids, **options)  # warm-up (and compilation)
        start = time.perf_counter()
        model.generate(ids, **options)
        wall = (time.perf_counter() - start) / tokens
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.generate(ids, **options)
    spent = {"matmul": 0.0, "attention": 0.0}
    for event in prof.key_averages():
        name = event.key
        if any(k in name for k in ATTENTION):
            spent["attention"] += event.self_cpu_time_total
        elif any(k in name for k in MATMUL):
            spent["matmul"] += event.self_cpu_time_total
    per_step = {k: v / 1e3 / (tokens + 1) for k, v in spent.items()}  # us over tokens + 1 forwards -> ms/step
    return {"ms_per_token": wall * 1e3, "matmul_ms": per_step["matmul"], "attention_ms": per_step["attention"],
            "other_ms": wall * 1e3 - per_step["matmul"] - per_step["attention"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--forms", default="float32,float16,int4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for form in args.forms.split(","):
        model = load_smollm2(weights=form)
        text = "The capital of France is a city that " * (args.context // 8 + 1)
        ids = model.tokenize(text)["input_ids"][:, :args.context]  # (1, context)
        for compiled in (False, True):
            row = {"form": form, "compiled": compiled, "threads": args.threads, "context": args.context,
                   "capability": torch.backends.cpu.get_cpu_capability(),
                   **breakdown(model, ids, args.tokens, compiled)}
            rows.append(row)
            print(f"{form:>8} {'compiled' if compiled else 'eager':>8}: {row['ms_per_token']:5.1f} ms/token = "
                  f"matmul {row['matmul_ms']:5.1f} + attention {row['attention_ms']:4.1f} + "
                  f"other {row['other_ms']:5.1f}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
