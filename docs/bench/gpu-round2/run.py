"""GPU round two: SmolLM2-135M-shaped decoding on one CUDA GPU in bfloat16, eager and as a captured CUDA graph,
attnkit beside the floor (attnkit.bench.floor, gpt-fast-style) and transformers.

    PYTHONPATH=src python3 docs/bench/gpu-round2/run.py --out $OUT/decode.json

The weights are random, in SmolLM2-135M-Instruct's shapes (attnkit's LlamaConfig defaults; transformers'
LlamaConfig with the same sizes): a step's time does not depend on the values, and no model file has to travel
(SmolLM2's is 94 MiB, a call carries 64). Greedy, no stop ids: every run decodes exactly NEW tokens. Decode
tokens/s = rows x (NEW - 1) / seconds of the steps after the first, the clock read after
sync(); median of ROUNDS runs after a warm-up run (the warm-up compiles and records).

At batch 1 (the contexts given) each runs eager and compiled; the batched case eager only (another batch
size recompiles, a minute each on a lent machine's clock). attnkit "compiled" is ``generate(compile=True)``:
on a GPU torch.compile(mode="reduce-overhead"), a CUDA graph replayed once per step. The floor "compiled" is
the same mode on the floor's one-token step (gpt-fast's way).
Each case is printed as it finishes and the JSON rewritten, so a run stopped at its time limit keeps what it had.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from attnkit.bench.floor import FloorLlama
from attnkit.models.generation import generate_steps
from attnkit.models.llama import LlamaConfig, LlamaModel

NEW = 64
ROUNDS = 3


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rate(steps: Callable[[], Iterator[torch.Tensor]], rows: int) -> tuple[float, list[int]]:
    """Decode tokens/s of the steps after the first, and the first row's tokens."""
    sync()
    it = steps()
    tokens = [int(next(it)[0])]
    sync()
    start = time.perf_counter()
    for token in it:
        tokens.append(int(token[0]))
    sync()
    return rows * (len(tokens) - 1) / (time.perf_counter() - start), tokens


def median_rate(steps: Callable[[], Iterator[torch.Tensor]], rows: int) -> tuple[float, list[float], list[int]]:
    rate(steps, rows)  # warm-up: compiles, records the CUDA graph
    runs = [rate(steps, rows) for _ in range(ROUNDS)]
    return statistics.median(r for r, _ in runs), [round(r, 1) for r, _ in runs], runs[-1][1]


def floor_compiled_steps(floor: FloorLlama, step: Callable[..., torch.Tensor], ids: torch.Tensor,
                         new: int) -> Iterator[torch.Tensor]:
    """The floor's greedy loop with its one-token step compiled (``step``), gpt-fast style."""
    (b, t), length = ids.shape, ids.shape[1] + new
    with torch.inference_mode():
        floor.setup_caches(b, length)
        positions = torch.arange(length, device=ids.device)  # (S,)
        token = floor.head(floor.hidden(ids, positions[:t])[:, -1]).argmax(dim=-1)  # (B,)
        yield token
        for i in range(t, length - 1):
            token = step(token[:, None], positions[i : i + 1]).clone()  # (B,)
            yield token


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", default="16,4000", help="prompt lengths at batch 1")
    parser.add_argument("--batch", type=int, default=8, help="the batched case's rows (16-token prompts)")
    parser.add_argument("--layers", type=int, default=30, help="fewer for a dry run")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    results: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dtype": str(dtype), "new_tokens": NEW, "rounds": ROUNDS, "rows": [],
    }
    print({k: v for k, v in results.items() if k != "rows"}, flush=True)

    def record(**row: Any) -> None:
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    torch.manual_seed(0)
    config = LlamaConfig(num_layers=args.layers)
    model = LlamaModel(config).to(device, dtype).eval()
    floor = FloorLlama.from_attnkit(model, capacity=max(map(int, args.contexts.split(","))) + NEW)
    gen = torch.Generator().manual_seed(1)

    def prompt(rows: int, length: int) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (rows, length), generator=gen).to(device)  # (B, T)

    def attnkit(ids: torch.Tensor, compile: bool) -> Callable[[], Iterator[torch.Tensor]]:
        return lambda: generate_steps(model, ids, max_new_tokens=NEW, stop_ids=[], compile=compile)

    def floor_eager(ids: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
        return lambda: floor.steps(ids, NEW)

    floor_step = None
    if not args.no_compile:
        def one(token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return floor.head(floor.hidden(token, pos)[:, -1]).argmax(dim=-1)  # (B, 1) -> (B,)

        floor_step = torch.compile(one, mode="reduce-overhead", fullgraph=True)

    cases: list[tuple[int, int]] = [(1, int(t)) for t in args.contexts.split(",")] + [(args.batch, 16)]
    for rows, length in cases:
        ids = prompt(rows, length)
        runs: list[tuple[str, Callable[[], Iterator[torch.Tensor]]]] = [
            ("attnkit eager", attnkit(ids, False)), ("floor eager", floor_eager(ids))]
        if floor_step is not None and rows == 1:  # compiled at batch 1 only: each compile costs a minute here
            runs += [("attnkit compiled", attnkit(ids, True)),
                     ("floor compiled", lambda ids=ids: floor_compiled_steps(floor, floor_step, ids, NEW))]
        tokens: dict[str, list[int]] = {}
        for name, steps in runs:
            began = time.perf_counter()
            try:
                median, each, tokens[name] = median_rate(steps, rows)
            except Exception as err:
                record(case=f"B={rows} T={length}", contender=name, error=f"{type(err).__name__}: {err}"[:600])
                continue
            same = None if name == "attnkit eager" else sum(
                a == b for a, b in zip(tokens[name], tokens.get("attnkit eager", []), strict=False))
            record(case=f"B={rows} T={length}", contender=name, tokens_per_s=round(median, 1), rounds=each,
                   same_tokens_as_attnkit_eager=same, seconds_with_warmup=round(time.perf_counter() - began, 1))
    transformers_rows(results, record, config, device, dtype, prompt)
    return 0


def transformers_rows(results: dict[str, Any], record: Callable[..., None], config: LlamaConfig,
                      device: torch.device, dtype: torch.dtype, prompt: Callable[[int, int], torch.Tensor]) -> None:
    """transformers' LlamaForCausalLM of the same sizes (random), eager generate with SDPA, batch 1, 16 tokens:
    decode rate = (NEW - 1) / (time of NEW tokens - time of 1)."""
    try:
        import transformers
        from transformers import LlamaConfig as HFConfig
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM(HFConfig(
            vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.ffn_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.context_length,
            rope_theta=config.rope_base, rms_norm_eps=config.norm_eps, tie_word_embeddings=True,
            attn_implementation="sdpa")).to(device, dtype).eval()
        results["transformers"] = transformers.__version__
        ids = prompt(1, 16)

        def seconds(n: int) -> float:
            sync()
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            sync()
            return time.perf_counter() - start

        seconds(NEW)
        each = [(NEW - 1) / (seconds(NEW) - seconds(1)) for _ in range(ROUNDS)]
        record(case="B=1 T=16", contender="transformers eager (sdpa)", tokens_per_s=round(statistics.median(each), 1),
               rounds=[round(r, 1) for r in each])
    except Exception as err:
        record(case="B=1 T=16", contender="transformers eager (sdpa)", error=f"{type(err).__name__}: {err}"[:600])


if __name__ == "__main__":
    raise SystemExit(main())
