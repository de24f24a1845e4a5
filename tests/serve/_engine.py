"""Shared by the serving engine's tests: a tiny random float64 Llama, an engine over it, a driver that runs
requests to their end, and a one-id-per-word tokenizer for the HTTP layer."""

from __future__ import annotations

from typing import Any

import torch

from attnkit.models import LlamaConfig, LlamaModel
from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine, Event


def tiny_model() -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                         context_length=128)
    model = LlamaModel(config).double().eval()
    model.stop_token_ids = ()
    return model


def decode_ids(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def tiny_engine(model: LlamaModel, **options: Any) -> Engine:
    options.setdefault("kv_memory_mib", 1)
    return Engine(model, decode_ids, block_size=4, **options)


def run_requests(engine: Engine, prompts: list[list[int]],
                 params: list[GenerationOptions]) -> list[tuple[list[int], str]]:
    """Submit every prompt, step until all finish; (token ids, finish reason) of each."""
    results: list[tuple[list[int], str]] = [([], "") for _ in prompts]

    def collect(i: int) -> Any:
        def on_event(event: Event) -> None:
            results[i][0].extend(event.token_ids)
            if event.finish_reason:
                results[i] = (results[i][0], event.finish_reason)
        return on_event

    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(prompt, p, collect(i))
    for _ in range(10_000):
        if engine.idle:
            break
        engine.step()
    return results


class Words:
    """A tokenizer of one id per word (the tiny model's vocabulary is 50), for the HTTP layer's tests."""

    def encode(self, text: str) -> list[int]:
        return [len(w) % 50 for w in text.split()] or [1]

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))
