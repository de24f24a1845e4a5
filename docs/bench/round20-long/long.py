"""Decoding after a 4,000-token prompt: attnkit's defaults beside llama.cpp's server, on the same file.

    ATTNKIT_LLAMA_SERVER=/path/to/llama-server python docs/bench/round20-long/long.py ROUNDS

SmolLM2-135M-Instruct in its default form, 2 threads per contender, greedy, 64 new tokens (attnkit's stop ids
biased away, llama.cpp's ``ignore_eos``: every answer has 64), the same 4,000-token prompt (the first 20,000
characters of this repository's BENCHMARKS.md, cut at 4,000 tokens) to each:

- ``llama-server``: llama.cpp's server on the Q4_1 file, flash attention off (its own decode rate,
  ``timings.predicted_per_second``), and ``llama-server (default)``, its default flash attention setting ("auto",
  which turns it on here: slower at this length);
- ``attnkit serve (graph)``: the server's default, measured once ``/health`` says the compiled step is ready;
- ``attnkit serve (eager)``: ``--no-compile``;
- ``generate``: the library's default (eager), in this process;
- ``generate(compile=True)``: the opt-in compiled loop, in this process (its first call compiles: a warm-up).

Each server runs alone: started for its turn, it answers once (prefilling the prompt, which it then caches) and
is timed on a second answer, then stopped (with every server kept running side by side, the servers' rates fell
by up to half between two runs, where ``generate``'s did not: round twenty in BENCHMARKS.md). Servers: the
decode rate of a streamed ``/v1/completions`` answer, chunks after the first over the time after it;
llama-server's own ``predicted_per_second``. ``generate``: ``GenerationStats.decode_tokens_per_s`` (its
compiled loop compiled before the first round). Every contender once per round, interleaved. One JSON line,
with the CPU capability.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from attnkit.bench.serve import llama_server_path, wait_compiled
from attnkit.bench.serve_client import ServerProcess, free_port
from attnkit.models import load_gguf
from attnkit.models.generation_options import GenerationStats
from attnkit.models.loader import smollm2_path

NEW, THREADS, TOKENS = 64, 2, 4000
TEXT = Path(__file__).parents[3] / "BENCHMARKS.md"


def stream_rate(url: str, prompt: str, bias: dict[str, int]) -> float:
    """Tokens/s after the first of one streamed greedy completion of ``NEW`` tokens."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "stream": True,
            "logit_bias": bias}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def llama_rate(url: str, prompt: str) -> float:
    """llama-server's own decode rate for one greedy completion of ``NEW`` tokens."""
    body = {"prompt": prompt, "n_predict": NEW, "temperature": 0, "ignore_eos": True, "cache_prompt": True}
    answer = httpx.post(url + "/completion", json=body, timeout=600).json()
    assert answer["timings"]["predicted_n"] == NEW, answer["timings"]
    return float(answer["timings"]["predicted_per_second"])


def main() -> None:
    rounds = int(sys.argv[1])
    torch.set_num_threads(THREADS)
    model = load_gguf(smollm2_path(), weights="auto")  # what attnkit serve loads
    ids = model.tokenize(TEXT.read_text()[:20000])["input_ids"][0].tolist()[:TOKENS]
    prompt = model.decode(ids, skip_special_tokens=False)
    stops = {str(i): -100 for i in model.stop_token_ids}
    work = Path(tempfile.mkdtemp(prefix="round20-long-"))
    pool = ("--max-batch", "1", "--kv-memory", "256")
    llama_bin = llama_server_path()
    assert llama_bin is not None, "set ATTNKIT_LLAMA_SERVER"

    def llama_server(*options: str) -> ServerProcess:
        port = free_port()
        return ServerProcess([llama_bin, "-m", str(smollm2_path()), "--port", str(port), "--host", "127.0.0.1", "-t",
                              str(THREADS), "-c", str(TOKENS + NEW + 256), "--parallel", "1", "--no-webui", *options],
                             port=port, log=work / "llama.log")

    def graph_server() -> ServerProcess:
        server = ServerProcess.attnkit("--compile", *pool, log=work / "graph.log", threads=THREADS)
        ready.append(round(wait_compiled(server.url), 1))
        return server

    def served(start: Callable[[], ServerProcess], rate: Callable[[str], float]) -> Callable[[], float]:
        """A fresh server alone on the machine: one answer to prefill the prompt (and warm up), then the one timed."""
        def run() -> float:
            server = start()
            try:
                rate(server.url)
                return rate(server.url)
            finally:
                server.stop()
        return run

    def generated(compile: bool) -> float:
        stats = GenerationStats()
        model.generate(torch.tensor([ids]), max_new_tokens=NEW, stop_ids=[], compile=compile, stats=stats)
        return stats.decode_tokens_per_s

    ready: list[float] = []  # seconds until each graph server's compiled step was ready
    contenders = {
        "llama-server": served(lambda: llama_server("-fa", "off"), lambda url: llama_rate(url, prompt)),
        "llama-server (default)": served(llama_server, lambda url: llama_rate(url, prompt)),
        "attnkit serve (graph)": served(graph_server, lambda url: stream_rate(url, prompt, stops)),
        "attnkit serve (eager)": served(lambda: ServerProcess.attnkit(*pool, log=work / "eager.log", threads=THREADS),
                                        lambda url: stream_rate(url, prompt, stops)),
        "generate": lambda: generated(False), "generate(compile=True)": lambda: generated(True)}
    generated(True)  # the compiled loop's first call compiles
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, contender in contenders.items():
            runs[name].append(round(contender(), 1))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "prompt_tokens": len(ids),
                      "graph_ready_s": ready, "medians": medians, "runs": runs,
                      "vs_llama_server": {name: round(m / medians["llama-server"], 2) for name, m in medians.items()}}))

if __name__ == "__main__":
    main()
