"""How far a row's logits and sampled tokens move between the row alone and the row in a batch, per weight form.

    .venv/bin/python docs/bench/round11-invariance/padding_and_batch.py \
        > docs/bench/round11-invariance/padding_and_batch.txt

SmolLM2-135M-Instruct, 1 thread. (1) One chat prompt alone against the same prompt left-padded by 1, 3 and 11
positions (batch of one): the largest logit difference of the prefill's last position. (2) Six prompts of 1
to 45 tokens generated as one batch and each alone, 16 new tokens: greedy, and sampled (temperature 1, top-p
0.95, one seed per row, so a row's random numbers are the same alone and in the batch): how many rows come
out the same.
"""

from __future__ import annotations

import warnings

import torch

from attnkit.models import load_smollm2
from attnkit.models.generation import prompt_positions

PROMPTS = ["Hi", "The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers and explain why each is prime, briefly.", "Once upon a time",
           "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively, with a docstring and tests\n"]


def padding_differences(model, ids: torch.Tensor) -> list[float]:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        alone = model.step(ids, None, model.new_caches(64))  # (1, V)
        out = []
        for pad in (1, 3, 11):
            padded = torch.cat([torch.full((1, pad), model.pad_token_id), ids], 1)  # (1, pad + T)
            mask = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)], 1)
            out.append(float((alone - model.step(padded, prompt_positions(mask), model.new_caches(64))).abs().max()))
    return out


def rows_alike(model, **sampling) -> int:  # type: ignore[no-untyped-def]
    batch = model.tokenize(PROMPTS)
    seeds = [100 + i for i in range(len(PROMPTS))]
    width = batch["input_ids"].shape[1]
    together = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=16, stop_ids=[],
                              seed=seeds, **sampling)[:, width:]
    same = 0
    for row, text in enumerate(PROMPTS):
        ids = model.tokenize(text)["input_ids"]
        alone = model.generate(ids, max_new_tokens=16, stop_ids=[], seed=[seeds[row]], **sampling)[0, ids.shape[1]:]
        same += bool(torch.equal(alone, together[row]))
    return same


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 1 thread")
    for form in ("float32", "float16", "int8", "int4"):
        model = load_smollm2(weights=form)
        ids = model.tokenize(model.chat_prompt([{"role": "user", "content": "Name three colors."}]))["input_ids"]
        pads = ", ".join(f"{d:.2g}" for d in padding_differences(model, ids))
        greedy, sampled = rows_alike(model), rows_alike(model, temperature=1.0, top_p=0.95)
        print(f"{form}: largest logit difference, {ids.shape[1]}-token prompt padded by 1/3/11: {pads}; "
              f"rows equal alone and in a batch of {len(PROMPTS)}: greedy {greedy}, sampled {sampled}", flush=True)


if __name__ == "__main__":
    main()
