"""Where the compiled decode step's greedy answers part from the eager step's, and how far their log-probabilities
moved before: SmolLM2 in the weight form given (auto: int4 on this CPU; float32), one request alone and four
together, 16-token prompts, 64 greedy tokens, through Engine directly (one thread), over attnkit's cache folder.

    .venv/bin/python docs/bench/round15-graph/agreement.py auto       # then: float32

Output: agreement.txt (both forms).
"""

from __future__ import annotations

import sys

import torch

from attnkit.models import load_smollm2
from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine
from attnkit.serve.events import Choice


def answers(engine: Engine, prompts: list[list[int]]) -> list[list[Choice]]:
    """Each prompt's 64 greedy tokens with their top-2 log-probabilities, submitted together."""
    out: list[list[Choice]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, GenerationOptions(max_new_tokens=64, logprobs=2),
                      lambda e, i=i: out[i].extend(e.logprobs))
    while not engine.idle:
        engine.step()
    return out


def compare(eager: list[Choice], compiled: list[Choice], rows: int) -> str:
    """Where two answers part, the largest log-probability difference before, and the eager top-2 gap there."""
    first = next((i for i, (a, b) in enumerate(zip(eager, compiled, strict=True)) if a.token != b.token), None)
    moved = max((abs(a.logprob - b.logprob) for a, b in zip(eager[:first], compiled[:first], strict=True)),  # type: ignore[operator]
                default=0.0)
    line = f"B={rows} first divergence {first}, max |dlogprob| before {moved:.2e}"
    if first is not None:
        gap = eager[first].top[0][1] - eager[first].top[1][1]
        line += f"; eager top-2 gap there {gap:.2e}, eager top {eager[first].top}, compiled top {compiled[first].top}"
    return line


def main() -> None:
    torch.set_num_threads(1)
    model = load_smollm2(weights=sys.argv[1])
    model.stop_token_ids = ()
    compiled = Engine(model, model.decode, kv_memory_mib=64, compile=True)
    assert compiled.wait_compiled(3600), compiled.compile_status()
    eager = Engine(model, model.decode, kv_memory_mib=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (16,), generator=g).tolist() for _ in range(4)]
    for batch in (prompts[:1], prompts):
        for a, b in zip(answers(eager, batch), answers(compiled, batch), strict=True):
            print(compare(a, b, len(batch)), flush=True)
    print(compiled.compile_status())


if __name__ == "__main__":
    main()
