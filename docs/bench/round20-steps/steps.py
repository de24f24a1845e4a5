"""No step backwards (issue 35): benchmark rows of this tree beside main before issue 35 (e148183), interleaved.

    python docs/bench/round20-steps/steps.py BASE_SRC ROUNDS      # the driver: prints one JSON line
    python docs/bench/round20-steps/steps.py --rows                # one worker: this interpreter's attnkit

The driver runs a worker process for each source tree in turn (``PYTHONPATH`` = the tree's ``src``: this
checkout's and ``BASE_SRC``, e.g. a worktree of e148183; which goes first alternates), ROUNDS times each, and
reports every row's median per tree and the median over rounds of each round's ratio (this tree's rate over the
base's, the two measured one after the other: above 1 is faster; the issue's bar is 0.97). A worker measures,
with 2 threads, each row's rate after a warm-up:

- the layer (``MultiHeadAttention``, d 768, 12 heads, causal) at B = 1, T = 1,024: inference and training
  (forward and backward), calls per second (median of 11);
- ``attnkit.attention`` at B = 1, 12 heads, T = 1,024, causal: the default kernel and ``"chunked"``;
- SmolLM2-135M-Instruct's ``generate``, greedy, 64 new tokens, stop ids off: decode tokens/s at batch 1 and 8
  after a 16-token prompt in the default form (int4 here), at batch 1 in float32, and after a 2,000-token
  prompt (int4); prefill tokens/s of that prompt;
- MiniLM's embeddings of 8 texts of 128 tokens, texts per second (median of 11).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve()


def per_second(fn: Callable[[], object], repeats: int = 11, items: float = 1.0) -> float:
    """``items`` per second of ``fn``: the median of ``repeats`` timed calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return items / statistics.median(times)


def rows() -> dict[str, float]:
    import torch

    import attnkit
    from attnkit.models import load_gguf
    from attnkit.models.generation_options import GenerationStats
    from attnkit.models.loader import smollm2_path
    from attnkit.models.minilm import load_minilm

    torch.set_num_threads(2)
    torch.manual_seed(0)
    out: dict[str, float] = {}
    layer = attnkit.MultiHeadAttention(768, 768, 12, causal=True)
    x = torch.randn(1, 1024, 768)
    with torch.inference_mode():
        out["layer inference B=1 T=1024 (calls/s)"] = per_second(lambda: layer(x))
    xg = x.clone().requires_grad_()
    out["layer training B=1 T=1024 (calls/s)"] = per_second(lambda: layer(xg).sum().backward())
    q, k, v = (torch.randn(1, 12, 1024, 64) for _ in range(3))
    out["attention() default T=1024 (calls/s)"] = per_second(lambda: attnkit.attention(q, k, v, causal=True))
    out["attention() chunked T=1024 (calls/s)"] = per_second(
        lambda: attnkit.attention(q, k, v, causal=True, backend="chunked"))

    def decode(model: object, ids: torch.Tensor) -> GenerationStats:
        stats = GenerationStats()
        model.generate(ids, max_new_tokens=64, stop_ids=[], stats=stats)  # type: ignore[attr-defined]
        return stats

    prompt = torch.randint(100, 40000, (8, 16), generator=torch.Generator().manual_seed(0))
    long = torch.randint(100, 40000, (1, 2000), generator=torch.Generator().manual_seed(1))
    for weights in ("auto", "float32"):
        model = load_gguf(smollm2_path(), weights=weights)
        model.stop_token_ids = ()
        decode(model, prompt[:1])  # warm-up
        out[f"SmolLM2 {weights} decode B=1 (tokens/s)"] = statistics.median(
            decode(model, prompt[:1]).decode_tokens_per_s for _ in range(3))
        if weights == "auto":
            out["SmolLM2 auto decode B=8 (tokens/s)"] = statistics.median(
                decode(model, prompt).decode_tokens_per_s for _ in range(3))
            stats = decode(model, long)
            out["SmolLM2 auto decode after 2,000 tokens (tokens/s)"] = stats.decode_tokens_per_s
            out["SmolLM2 auto prefill 2,000 tokens (tokens/s)"] = stats.prefill_tokens_per_s
    minilm = load_minilm()
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out["MiniLM embeddings 8 x 128 (texts/s)"] = per_second(lambda: minilm(ids, mask), items=8)
    return out


def main() -> None:
    if sys.argv[1:] == ["--rows"]:
        import torch

        import attnkit

        print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "attnkit": attnkit.__file__,
                          "rows": rows()}))
        return
    base, rounds = sys.argv[1], int(sys.argv[2])
    trees = {"this tree": str(HERE.parents[3] / "src"), "e148183": base}
    runs: dict[str, dict[str, list[float]]] = {tree: {} for tree in trees}
    capability = None
    for r in range(rounds):
        for tree, src in sorted(trees.items(), reverse=r % 2 == 1):  # which goes first alternates
            env = {**os.environ, "PYTHONPATH": src}
            done = subprocess.run([sys.executable, str(HERE), "--rows"], env=env, capture_output=True, text=True,
                                  check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            capability = result["cpu_capability"]
            assert result["attnkit"].startswith(src), (tree, result["attnkit"])
            for name, value in result["rows"].items():
                runs[tree].setdefault(name, []).append(round(value, 2))
    medians = {tree: {name: statistics.median(v) for name, v in by.items()} for tree, by in runs.items()}
    ratios = {name: round(statistics.median(a / b for a, b in zip(mine, runs["e148183"][name], strict=True)), 3)
              for name, mine in runs["this tree"].items()}  # each round's pair: this VM's speed drifts by a third
    print(json.dumps({"cpu_capability": capability, "ratios": ratios, "medians": medians, "runs": runs}))


if __name__ == "__main__":
    main()
