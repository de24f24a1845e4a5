"""The serving engine's compiled decode step (attnkit.serve.graph) on SmolLM2: cold and warm compile times, and
decode tokens/s eager against compiled at 1 and 16 concurrent requests, through Engine directly.

    .venv/bin/python docs/bench/round15-graph/graph.py > docs/bench/round15-graph/graph.txt

SmolLM2-135M-Instruct in the default weight form (weights="auto", as ``attnkit serve`` loads it), one CPU thread
per process (the machine is shared). Compile times: a fresh process builds ``Engine(compile=True)`` and waits for
the graph, first over an empty cache folder (``ATTNKIT_CACHE`` a new temporary folder, ``TORCHINDUCTOR_CACHE_DIR``
unset: Inductor's kernels go under it too, as with ``attnkit serve``), then again in a new process over the same
folder. Decode: N requests of 16-token prompts submitted together, 64 new greedy tokens each; tokens/s of the
steps after the first (which prefills and samples each first token), median of 3 rounds, eager and compiled
engines interleaved in one process; the tokens of both are compared. Last, over a new cold folder: what the
eager step serves while the compile runs beside it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

NEW = 64
PROMPT_LENGTH = 16


def compile_once() -> None:
    """In a process of its own: load, build Engine(compile=True), wait; print the compile's seconds."""
    from attnkit.models import load_smollm2
    from attnkit.serve import Engine

    torch.set_num_threads(1)
    model = load_smollm2(weights="auto")
    began = time.perf_counter()
    engine = Engine(model, model.decode, kv_memory_mib=64, compile=True)
    ready = engine.wait_compiled(timeout=3600)
    status = engine.compile_status()
    print(f"{time.perf_counter() - began:.1f} {ready} {status}", flush=True)


def child(option: str, env: dict[str, str]) -> list[str]:
    """The lines a child process of this script printed when run with ``option``."""
    done = subprocess.run([sys.executable, __file__, option], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{option} failed: {done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()


def decode_rate(engine: object, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Tokens/s of the steps after the first, and each request's tokens."""
    from attnkit.models.generation_options import GenerationOptions

    answers: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, GenerationOptions(max_new_tokens=NEW),  # type: ignore[attr-defined]
                      lambda e, i=i: answers[i].extend(e.token_ids))
    engine.step()  # type: ignore[attr-defined]
    first = sum(map(len, answers))
    began = time.perf_counter()
    while not engine.idle:  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
    return (sum(map(len, answers)) - first) / (time.perf_counter() - began), answers


def decode_table() -> list[str]:
    from attnkit.models import load_smollm2
    from attnkit.modules.quantize import weight_form
    from attnkit.serve import Engine

    torch.set_num_threads(1)
    model = load_smollm2(weights="auto")
    model.stop_token_ids = ()  # every request decodes its 64 tokens
    compiled = Engine(model, model.decode, kv_memory_mib=128, compile=True)
    assert compiled.wait_compiled(timeout=3600), compiled.compile_status()
    eager = Engine(model, model.decode, kv_memory_mib=128)
    g = torch.Generator().manual_seed(0)
    lines = [f"weights {weight_form(model)}; compile status after the table: see the last line"]
    for n in (1, 16):
        prompts = [torch.randint(100, 40000, (PROMPT_LENGTH,), generator=g).tolist() for _ in range(n)]
        rates: dict[str, list[float]] = {"eager": [], "compiled": []}
        tokens: dict[str, list[list[int]]] = {}
        for engine in (eager, compiled):  # a warm-up
            decode_rate(engine, [list(p) for p in prompts])
        for _ in range(3):
            for name, engine in (("eager", eager), ("compiled", compiled)):
                rate, tokens[name] = decode_rate(engine, [list(p) for p in prompts])
                rates[name].append(rate)
        e, c = statistics.median(rates["eager"]), statistics.median(rates["compiled"])
        same = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"], strict=True))
        lines.append(f"N = {n:2d}: eager {e:6.1f} tok/s, compiled {c:6.1f} tok/s, ratio {c / e:.2f} "
                     f"(rounds: eager {', '.join(f'{r:.1f}' for r in rates['eager'])}; compiled "
                     f"{', '.join(f'{r:.1f}' for r in rates['compiled'])}); {same}/{n} answers token-equal")
    lines.append(f"compile status: {compiled.compile_status()}")
    return lines


def during_compile() -> list[str]:
    """In a process of its own, over a cold cache folder: the eager step's N = 1 decode rate before, and while the
    compile runs beside it (a thread of the same process: one more core busy, and the GIL shared)."""
    from attnkit.models import load_smollm2
    from attnkit.serve import Engine

    torch.set_num_threads(1)
    model = load_smollm2(weights="auto")
    model.stop_token_ids = ()
    prompt = torch.randint(100, 40000, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    alone = Engine(model, model.decode, kv_memory_mib=64)
    before = statistics.median(decode_rate(alone, [list(prompt)])[0] for _ in range(4))
    compiling = Engine(model, model.decode, kv_memory_mib=64, compile=True)
    during = []
    while compiling.compile_status()["state"] == "compiling":
        during.append(decode_rate(compiling, [list(prompt)])[0])
    return [f"N =  1 eager while compiling: {statistics.median(during):.1f} tok/s (median of {len(during)} runs), "
            f"{before:.1f} before it: ratio {statistics.median(during) / before:.2f}; the compile then took "
            f"{compiling.compile_status()['seconds']} s"]


def main() -> None:
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, 1 thread per process, "
          f"{os.cpu_count()} CPUs (shared with other work)", flush=True)
    with tempfile.TemporaryDirectory() as folder:  # one cache folder: cold, then warm, then the table's engine
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {
            "ATTNKIT_CACHE": folder, "OMP_NUM_THREADS": "1"}
        print(f"compile, cold cache folder (seconds, ready, status): {child('--compile-once', env)[-1]}", flush=True)
        print(f"compile, warm cache folder (a restart): {child('--compile-once', env)[-1]}", flush=True)
        for line in child("--decode", env):
            print(line, flush=True)
    with tempfile.TemporaryDirectory() as folder:  # cold again
        for line in child("--during", env | {"ATTNKIT_CACHE": folder}):
            print(line, flush=True)


if __name__ == "__main__":
    if "--compile-once" in sys.argv:
        compile_once()
    elif "--decode" in sys.argv or "--during" in sys.argv:
        for line in decode_table() if "--decode" in sys.argv else during_compile():
            print(line, flush=True)
    else:
        main()
