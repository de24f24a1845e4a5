"""One streaming client of ``attnkit serve`` (eager step) beside ``generate`` of the same prompt in one process.

    python docs/bench/round19-thread/serve1.py ROUNDS OUT_DIR

SmolLM2-135M-Instruct in its default form; the serving suite's first chat request (its system prompt and
question), greedy, at most 128 new tokens (the server's answer may stop sooner; ``generate`` runs all 128). Each
round, interleaved:

- ``serve --threads 2`` and ``serve --threads 1`` (``--no-compile``): one streamed request on a server started
  for the round, after a warm-up request; the decode rate is (chunks - 1) over the time from the first chunk to
  the last;
- ``serve --threads 2`` with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP's threads sleep at once at a barrier, where by
  default they spin a while): whether the engine's threads spinning beside the HTTP thread cost;
- ``generate`` of the same prompt ids in a fresh process with 2 threads (``GenerationStats.decode_tokens_per_s``).

Prints the medians and every value, and writes OUT_DIR/serve1.json with the CPU capability.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from attnkit.bench.serve_client import ServerProcess, chat_request, post_stream

NEW = 128
GENERATE = """
import sys, json, torch
from attnkit.models import load_gguf
from attnkit.models.loader import smollm2_path
from attnkit.models.generation_options import GenerationStats
torch.set_num_threads(2)
model = load_gguf(smollm2_path(), weights="auto")
ids = torch.tensor([model.tokenizer.chat_ids(json.loads(sys.argv[1]))])
rates = []
for _ in range(2):  # a warm-up, then the measured run
    stats = GenerationStats()
    model.generate(ids, max_new_tokens=NEW, stop_ids=[], stats=stats)
    rates.append(stats.decode_tokens_per_s)
print(rates[-1])
""".replace("NEW", str(NEW))


def body() -> dict[str, Any]:
    request = chat_request(0)
    return {**request, "model": "smollm2", "max_tokens": NEW, "temperature": 0}


def served(threads: int, env: dict[str, str], log: Path) -> float:
    before = dict(os.environ)
    os.environ.update(env)
    try:
        server = ServerProcess.attnkit("--max-batch", "4", log=log, threads=threads)
    finally:
        os.environ.clear()
        os.environ.update(before)
    try:
        post_stream(server.url, body())  # warm-up
        stream = post_stream(server.url, body())
        return (len(stream.chunks) - 1) / (stream.chunks[-1] - stream.chunks[0])
    finally:
        server.stop()


def generated() -> float:
    messages = json.dumps(body()["messages"])
    done = subprocess.run([sys.executable, "-c", GENERATE, messages], capture_output=True, text=True, check=True,
                          timeout=600)
    return float(done.stdout.split()[-1])


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    variants = {"serve, 2 threads": (2, {}), "serve, 1 thread": (1, {}),
                "serve, 2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"})}
    runs: dict[str, list[float]] = {name: [] for name in [*variants, "generate, 2 threads"]}
    with tempfile.TemporaryDirectory() as work:
        for r in range(rounds):
            for name, (threads, env) in variants.items():
                runs[name].append(round(served(threads, env, Path(work) / f"{r}-{threads}.log"), 2))
            runs["generate, 2 threads"].append(round(generated(), 2))
            print(r, {name: values[-1] for name, values in runs.items()}, flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "new_tokens": NEW, "medians": medians,
              "runs": runs}
    print(json.dumps(result, indent=1))
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve1.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
