"""Which grammar library keeps the per-token JSON mask cheapest for SmolLM2 (49,152 tokens) on this CPU.

Run from the repository root, after installing the three libraries without their dependencies
(none of them needs torch for this; xgrammar needs apache-tvm-ffi)::

    .venv/bin/pip install --no-deps -c constraints.txt llguidance xgrammar outlines-core apache-tvm-ffi
    .venv/bin/python docs/bench/round13-grammar/measure.py > docs/bench/round13-grammar/output.txt

For each library: the one-off tokenizer set-up, the compile time of one JSON schema (nested object, array,
enum, bounded number, required fields), then the time to compute the allowed-token bitmask (V bits) at each
token of a 64-token answer (the answer's tokens are committed one by one, as a server would), mean and p99
over every step of several passes. Every library gets the same token bytes (from attnkit's GGUF tokenizer).

Choice: **llguidance** (output.txt: one run on a shared 2-core AVX512 Xeon, torch threads 2). Per token the
three are alike: mean 0.02-0.17 ms across runs (the order changed from run to run on this shared machine), small
beside a SmolLM2 decode step (tens of milliseconds). What separates them is the compile of each new schema:
llguidance 1-2 ms (its mask is computed lazily from a token trie and the lexer's state, nothing
precomputed per schema), xgrammar 0.8-2.2 s and outlines-core 0.5-1.3 s (each precomputes per-state token
tables over the whole 49k vocabulary), which a server pays on every request with a schema it has not seen:
compile plus the 63 masks of this answer are 5-8 ms with llguidance, 0.7-2.2 s with the others.
llguidance also names what it refuses ("Unimplemented keys: [\"uniqueItems\"]", a regex's look-around), which
becomes the 400's message, and its wheel has no dependencies (xgrammar's matcher imports torch and needs
apache-tvm-ffi; outlines-core turns the schema into one regex first).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from attnkit.models import load_smollm2
from attnkit.serve.grammar import token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "kind": {"type": "string", "enum": ["bread", "cake", "pastry"]},
        "price": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "baker": {"type": "object", "properties": {"name": {"type": "string"}, "years": {"type": "integer"}},
                  "required": ["name", "years"], "additionalProperties": False},
    },
    "required": ["name", "kind", "price", "tags", "baker"],
    "additionalProperties": False,
}
ANSWER = {"name": "Pain de campagne au levain naturel de Lyon", "kind": "bread", "price": 4.5,
          "tags": ["sourdough", "rye", "crusty", "Lyon", "organic"],
          "baker": {"name": "Marie-Claire Dubois", "years": 27}}
PASSES = 10


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f}"


def _steps(start: Callable[[], Any], mask: Callable[[Any], None], commit: Callable[[Any, int], Any],
           ids: list[int]) -> list[float]:
    """Per-token mask times over PASSES fresh matchers (``start``): mask, then commit the answer's next token."""
    times = []
    for _ in range(PASSES):
        matcher = start()
        for token in ids:
            begin = time.perf_counter()
            mask(matcher)
            times.append(time.perf_counter() - begin)
            if commit(matcher, token) is False:
                raise AssertionError(f"token {token} refused")
    return times


def measure_llguidance(vocab: list[bytes], tok: Any, ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.numpy as lln

    class Wrapper:  # what llguidance.TokenizerWrapper reads
        def __init__(self) -> None:
            self.tokens, self.eos_token_id, self.bos_token_id = vocab, tok.eos_id, tok.bos_id

        def __call__(self, text: bytes) -> list[int]:
            return tok.encode(text.decode("utf-8", errors="replace"))

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapper()), eos_token=list(tok.stop_ids))
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - start
    bitmask = lln.allocate_token_bitmask(1, len(vocab))
    times = _steps(lambda: llguidance.LLMatcher(lltok, grammar), lambda m: lln.fill_next_token_bitmask(m, bitmask, 0),
                   lambda m, t: m.consume_token(t), ids)
    return {"setup": setup, "compile": compile_s, "times": times, "version": llguidance.__version__}


def measure_xgrammar(vocab: list[bytes], tok: Any, ids: list[int]) -> dict[str, Any]:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, stop_token_ids=list(tok.stop_ids))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))
    times = _steps(lambda: xgrammar.GrammarMatcher(compiled), lambda m: m.fill_next_token_bitmask(bitmask),
                   lambda m, t: m.accept_token(t), ids)
    import importlib.metadata
    return {"setup": setup, "compile": compile_s, "times": times,
            "version": importlib.metadata.version("xgrammar")}


def measure_outlines(vocab: list[bytes], tok: Any, ids: list[int]) -> dict[str, Any]:
    import importlib.metadata

    import outlines_core
    from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

    start = time.perf_counter()
    specials = set(tok.specials)
    by_bytes: dict[bytes, list[int]] = {}
    for i, piece in enumerate(vocab):
        if i not in tok.stop_ids and tok.tokens[i] not in specials:
            by_bytes.setdefault(piece, []).append(i)
    vocabulary = outlines_core.Vocabulary(tok.eos_id, by_bytes)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - start
    bitmask = allocate_token_bitmask(len(vocab))
    times = _steps(lambda: outlines_core.Guide(index), lambda g: fill_next_token_bitmask(g, bitmask),
                   lambda g, t: g.advance(t), ids)
    return {"setup": setup, "compile": compile_s, "times": times,
            "version": importlib.metadata.version("outlines-core")}


def main() -> None:
    model = load_smollm2()
    tok = model.tokenizer
    vocab = token_bytes(tok)
    text = json.dumps(ANSWER, separators=(",", ":"))
    ids = tok.encode(text)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}")
    print(f"# SmolLM2 vocabulary {len(vocab)} tokens; answer {len(ids)} tokens: {text}")
    print(f"# {PASSES} passes over the answer; times in ms")
    print(f"{'library':<22} {'tokenizer':>9} {'compile':>9} {'mask mean':>9} {'mask p99':>9} {'1st mask':>9} "
          f"{'request':>9}")
    results = {}
    for name, run in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar),
                      ("outlines-core", measure_outlines)):
        try:
            r = run(vocab, tok, ids)
        except Exception as err:  # a library that cannot run here says why, the others still run
            print(f"{name:<22} failed: {err!r}")
            continue
        first = statistics.fmean(r["times"][:: len(ids)])  # each pass's first mask (a fresh matcher)
        times = sorted(r["times"])
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        request = r["compile"] + statistics.fmean(times) * len(ids)  # a new schema's compile and its answer's masks
        results[name] = {"version": r["version"], "tokenizer_ms": r["setup"] * 1e3, "compile_ms": r["compile"] * 1e3,
                         "mask_mean_ms": statistics.fmean(times) * 1e3, "mask_p99_ms": p99 * 1e3,
                         "first_mask_ms": first * 1e3, "request_ms": request * 1e3}
        print(f"{name + ' ' + r['version']:<22} {_ms(r['setup'])} {_ms(r['compile'])} "
              f"{_ms(statistics.fmean(times))} {_ms(p99)} {_ms(first)} {_ms(request)}")
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "answer_tokens": len(ids),
                      "results": results}))


if __name__ == "__main__":
    main()
