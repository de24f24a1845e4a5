"""The README's CPU claims under each of PyTorch's dispatch modes, in one run: AVX512 as the CPU reports, and AVX2.

    .venv/bin/python docs/bench/round12-avx2/dispatch.py > docs/bench/round12-avx2/dispatch.txt

Each mode runs in fresh processes (PyTorch reads ATEN_CPU_CAPABILITY at start). The AVX2 mode sets
ATEN_CPU_CAPABILITY=avx2, FBGEMM_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2: an AVX512 machine running
the kernels an AVX2 CPU runs (attnkit.cpu), not an AVX2 CPU's clock or caches. Per mode: the form
``weights="auto"`` picks for SmolLM2, process start to model ready (``load_smollm2(weights="auto")``, warm
index), greedy decode speed of each weight form (16-token prompt, 64 new tokens, median of 3), and
``attnkit train induction``'s wall time. 2 threads. The two modes run twice, interleaved, and every run is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

PROBE = r"""
import json, statistics, sys, time
t0 = time.perf_counter()
import torch
from attnkit.models import load_smollm2
from attnkit.modules.quantize import weight_form
model = load_smollm2(weights="auto")
ready = time.perf_counter() - t0
torch.set_num_threads(2)
ids = model.tokenize("The old lighthouse keeper climbed the stairs every evening, counting each")["input_ids"][:, :16]

def speed(m):
    runs = []
    for _ in range(4):
        t = time.perf_counter()
        m.generate(ids, max_new_tokens=64, stop_ids=[])
        runs.append(64 / (time.perf_counter() - t))
    return statistics.median(runs[1:])

forms = {form: speed(model if form == weight_form(model) else load_smollm2(weights=form))
         for form in ("float32", "float16", "int8", "int4")}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "auto_form": weight_form(model),
                  "ready_s": ready, **{f"{form}_tok_s": v for form, v in forms.items()}}))
"""


def measure(env: dict[str, str]) -> dict[str, object]:
    full = {**os.environ, **env}
    subprocess.run([sys.executable, "-c", "from attnkit.models import load_smollm2; load_smollm2(weights='auto')"],
                   env=full, check=True, capture_output=True)  # the index and the assembled file are warm
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, check=True, capture_output=True, text=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnkit", "train", "induction", "--out", "/tmp/round12-induction"],
                   env=full, check=True, capture_output=True)
    row["induction_s"] = time.perf_counter() - t
    return row


def main() -> None:
    rows = {}
    for round_ in (1, 2):  # the modes interleaved: a shared machine's load drifts within a run
        rows[f"AVX512, run {round_}"] = measure({})
        rows[f"AVX2, run {round_}"] = measure(AVX2)
    forms = ("float32", "float16", "int8", "int4")
    print(f"{'mode':14} {'capability':10} {'auto form':9} {'ready s':>8} "
          + " ".join(f"{form + ' tok/s':>13}" for form in forms) + f" {'induction s':>11}")
    for mode, r in rows.items():
        print(f"{mode:14} {r['capability']:10} {r['auto_form']:9} {r['ready_s']:8.2f} "
              + " ".join(f"{r[form + '_tok_s']:13.1f}" for form in forms) + f" {r['induction_s']:11.1f}")


if __name__ == "__main__":
    main()
