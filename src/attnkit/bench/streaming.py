"""The streaming suite: SmolLM2 generating far past its context with sink caches, beside the growing cache.

    attnkit bench --suite streaming --out bench-out/streaming          # 20,000 tokens, window 1020: long
    python -m attnkit.bench.streaming --new-tokens 2000 --window 256   # a small run, minutes

One process, greedy decoding with no stop token, from the first 32 tokens of
the long text kept in the tests (``tests/data/python_reference.txt``: the
Python Language Reference, PSF licence), each phase in turn:

- ``generate``: ``new_tokens`` new tokens (default 20,000) with the sink
  cache (``cache="sink:SINKS,WINDOW,CHUNK"``, default 4 sinks, a window of
  1020, chunks of 64), then with the growing KV cache, which stops at the
  model's context length (8,192 positions for SmolLM2: generation refuses
  more, and the model was not trained past it). Resident memory (VmRSS) is
  sampled every ``sample_every`` tokens (rows of kind ``memory``, with the
  tokens/s of each stretch); the ``generate`` rows give the whole run's
  tokens/s and how much resident memory grew once the sink cache was full.
- ``perplexity``: teacher-forced over the first ``perplexity_tokens`` tokens
  of the text (default 8,000): the full cache (pieces of 512 tokens through a
  KVCache: the same as one forward) and the sink cache (pieces of one chunk,
  so each token sees the sinks and at least ``window`` recent tokens).
- ``target`` rows: sink perplexity <= 1.5x the full cache's; resident memory
  flat (growth under 5% of the RSS) once the sink cache is full.

Rows are dicts with a "kind", as every row suite of :mod:`.command`; the
env row records torch's CPU capability.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .report import env_text
from .runner import cpu_record, torch_threads

Row = dict[str, Any]
TEXT = Path(__file__).resolve().parents[3] / "tests" / "data" / "python_reference.txt"
PROMPT_TOKENS = 32
FULL_PIECE = 512  # tokens per teacher-forced piece through the growing cache
PERPLEXITY_BAR = 1.5  # sink perplexity / full perplexity must stay at or under this
FLAT_SHARE = 0.05  # resident memory may grow by this share of itself after the sink cache fills


@dataclass(frozen=True)
class StreamingSuite:
    """What one run measures (see the module docstring); checked at construction."""

    new_tokens: int = 20_000
    sinks: int = 4
    window: int = 1020
    chunk: int = 64
    perplexity_tokens: int = 8_000
    sample_every: int = 1_000
    threads: int = 2
    weights: str = "float32"
    full: bool = True  # also the growing cache (generation and perplexity)

    def __post_init__(self) -> None:
        for name in ("new_tokens", "sinks", "window", "chunk", "perplexity_tokens", "sample_every", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"the streaming suite's {name} must be an int >= 1, got {name}={value!r}")

    @property
    def cache(self) -> str:
        """The sink cache as ``generate(cache=...)`` names it."""
        return f"sink:{self.sinks},{self.window},{self.chunk}"

    @property
    def capacity(self) -> int:
        """Keys a sink cache holds at most."""
        return self.sinks + self.window + self.chunk - 1

    @classmethod
    def from_options(cls, options: Any) -> StreamingSuite:
        """The suite ``attnkit bench --suite streaming`` asks for (``options``: :class:`.options.Options`).

        ``--new-tokens`` sets the tokens generated (left at the bench's default of 128, the suite's 20,000);
        ``--seq-lens W`` the sink cache's window (default 1020); ``--threads`` the threads.
        """
        if options.device != "cpu" or options.dtype != "float32":
            raise ValueError(f"the streaming suite runs SmolLM2 in float32 on the CPU (it measures resident "
                             f"memory); got --device {options.device} --dtype {options.dtype}")
        new_tokens = cls.new_tokens if options.new_tokens == 128 else options.new_tokens
        window = options.seq_lens[0] if options.seq_lens else cls.window
        return cls(new_tokens=new_tokens, window=window, threads=options.threads)


def long_text(path: Path = TEXT) -> str:
    """The long text kept in the tests, without its header (the lines up to ``# ---``)."""
    if not path.is_file():
        raise ValueError(f"the streaming suite reads the long text of a source checkout, {path}; it is not there "
                         "(run from a clone of the repository)")
    return path.read_text(encoding="utf-8").split("# ---\n", 1)[1]


def rss_mib() -> float:
    """This process's resident set (VmRSS) in MiB; NaN where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def _settle() -> float:
    """Free what can be freed (Python garbage, glibc's free heap), then the RSS in MiB."""
    from attnkit.models.decoder import release_freed_memory

    gc.collect()
    release_freed_memory()
    return rss_mib()


def generation_rows(model: Any, prompt: torch.Tensor, cache: str, new_tokens: int, suite: StreamingSuite,
                    say: Callable[[str], None]) -> list[Row]:
    """Generate ``new_tokens`` greedily with ``cache``: a memory row every ``sample_every`` tokens, then a summary."""
    from attnkit.models.generation import generate_steps
    from attnkit.models.generation_options import GenerationStats

    stats, rows = GenerationStats(), list[Row]()
    before = _settle()
    begin = last_time = time.perf_counter()
    last_n = 0
    for n, _ in enumerate(generate_steps(model, prompt, max_new_tokens=new_tokens, stop_ids=[], cache=cache,
                                         stats=stats), start=1):
        if n % suite.sample_every == 0 or n == new_tokens:
            now = time.perf_counter()
            rows.append({"kind": "memory", "cache": cache, "tokens": n, "rss_mib": round(rss_mib(), 1),
                         "tokens_per_s": round((n - last_n) / (now - last_time), 2)})
            say(f"{cache}: {n} tokens, RSS {rows[-1]['rss_mib']} MiB, {rows[-1]['tokens_per_s']} tokens/s")
            last_n, last_time = n, now
    seconds = time.perf_counter() - begin
    full_at = suite.capacity - prompt.shape[1]  # new tokens after which a sink cache holds its bound
    after = [r["rss_mib"] for r in rows if r["tokens"] >= full_at]
    summary = {"kind": "generate", "cache": cache, "new_tokens": stats.new_tokens, "seconds": round(seconds, 1),
               "tokens_per_s": round(stats.new_tokens / seconds, 2),
               "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2), "rss_before_mib": round(before, 1),
               "rss_end_mib": rows[-1]["rss_mib"], "rss_max_mib": max(r["rss_mib"] for r in rows),
               "growth_after_full_mib": round(max(after) - after[0], 1) if after else None}
    return [*rows, summary]


def perplexity(model: Any, ids: torch.Tensor, caches: Sequence[Any], piece: int) -> float:
    """exp(mean negative log-likelihood) of ids[:, 1:] given what precedes, fed ``piece`` tokens at a time."""
    total, count = 0.0, ids.shape[1] - 1
    with torch.inference_mode():
        for start in range(0, count, piece):
            end = min(start + piece, count)
            logits = model(ids[:, start:end], kv_caches=caches)  # (1, P) -> (1, P, V)
            total += float(torch.nn.functional.cross_entropy(logits[0], ids[0, start + 1 : end + 1], reduction="sum"))
    return math.exp(total / count)


def perplexity_rows(model: Any, ids: torch.Tensor, suite: StreamingSuite, say: Callable[[str], None]) -> list[Row]:
    """Teacher-forced perplexity over ids (1, N + 1): the sink cache, and the full cache when asked for."""
    from attnkit.models.sink_caches import sink_caches

    runs = {suite.cache: (lambda: sink_caches(model, sinks=suite.sinks, window=suite.window, chunk=suite.chunk),
                          suite.chunk)}
    if suite.full:
        runs["full"] = (model.new_caches, FULL_PIECE)
    rows = []
    for cache, (make, piece) in runs.items():
        begin = time.perf_counter()
        value = perplexity(model, ids, make(), piece)
        rows.append({"kind": "perplexity", "cache": cache, "tokens": ids.shape[1] - 1, "perplexity": round(value, 3),
                     "seconds": round(time.perf_counter() - begin, 1)})
        say(f"perplexity {cache}: {value:.3f}")
    return rows


def streaming_targets(rows: Sequence[Row], suite: StreamingSuite) -> list[Row]:
    """The two claims as rows: perplexity within 1.5x of the full cache's, resident memory flat once full."""
    ppl = {r["cache"]: r["perplexity"] for r in rows if r["kind"] == "perplexity"}
    gen = next(r for r in rows if r["kind"] == "generate" and r["cache"] == suite.cache)
    targets = []
    if "full" in ppl:
        ratio = ppl[suite.cache] / ppl["full"]
        targets.append({"kind": "target", "target": f"sink perplexity <= {PERPLEXITY_BAR}x the full cache's",
                        "measured": f"{ratio:.3f}x", "met": ratio <= PERPLEXITY_BAR})
    growth = gen["growth_after_full_mib"]
    flat = growth is not None and growth <= FLAT_SHARE * gen["rss_end_mib"]
    targets.append({"kind": "target", "target": f"RSS flat after the sink cache fills (growth <= "
                    f"{FLAT_SHARE:.0%} of RSS), {gen['new_tokens']} tokens",
                    "measured": "not full yet" if growth is None else f"{growth} MiB", "met": flat})
    return targets


def _env_row(suite: StreamingSuite, model: Any, full_tokens: int) -> Row:
    from attnkit.modules.quantize import weight_form

    return {"kind": "env", "model": "SmolLM2-135M-Instruct", "weights": weight_form(model), "threads": suite.threads,
            "torch": torch.__version__, **cpu_record(), "sink_cache": suite.cache, "capacity": suite.capacity,
            "new_tokens": suite.new_tokens, "full_cache_new_tokens": full_tokens,
            "full_cache_stop": f"stopped at the model's context length {model.context_length}" if suite.full and
            full_tokens < suite.new_tokens else "", "perplexity_tokens": suite.perplexity_tokens}


def run_streaming_suite(options: Any, log: Callable[[str], None] | None = None) -> list[Row]:
    """The suite's rows: env, memory samples, generate, perplexity and target rows.

    ``options``: :class:`.options.Options` (as every row suite of ``attnkit bench``) or a :class:`StreamingSuite`.
    """
    from attnkit.models import load_smollm2

    suite = options if isinstance(options, StreamingSuite) else StreamingSuite.from_options(options)
    say = log or (lambda _: None)
    text = long_text()
    with torch_threads(suite.threads):
        model = load_smollm2(weights=suite.weights)
        tokenizer: Any = model.tokenizer  # a GGUFTokenizer: encode() has no context limit
        ids = torch.tensor([tokenizer.encode(text)])  # (1, N)
        if ids.shape[1] < suite.perplexity_tokens + 1:
            raise ValueError(f"the long text has {ids.shape[1]} tokens; perplexity over {suite.perplexity_tokens} "
                             f"needs {suite.perplexity_tokens + 1}")
        prompt = ids[:, :PROMPT_TOKENS]  # (1, T)
        full_tokens = min(suite.new_tokens, model.context_length - PROMPT_TOKENS)
        rows = [_env_row(suite, model, full_tokens)]
        rows += generation_rows(model, prompt, suite.cache, suite.new_tokens, suite, say)
        if suite.full:
            rows += generation_rows(model, prompt, "full", full_tokens, suite, say)
        rows += perplexity_rows(model, ids[:, : suite.perplexity_tokens + 1], suite, say)
    return rows + streaming_targets(rows, suite)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m attnkit.bench.streaming``: the suite as plain text, its sizes as options."""
    parser = argparse.ArgumentParser(description="SmolLM2 with sink caches beside the growing cache.")
    defaults = StreamingSuite()
    for name in ("new_tokens", "sinks", "window", "chunk", "perplexity_tokens", "sample_every", "threads"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                            help=f"default {getattr(defaults, name)}")
    parser.add_argument("--no-full", action="store_true", help="leave the growing cache out")
    args = vars(parser.parse_args(argv))
    suite = replace(defaults, full=not args.pop("no_full"), **args)
    for row in run_streaming_suite(suite, log=print):
        print(env_text(row) if row["kind"] == "env" else row)


if __name__ == "__main__":
    main()
