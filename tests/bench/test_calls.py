"""The calls benchmark's counts come from the code path they name (deterministic: no timing here)."""

from __future__ import annotations

import torch

from attnkit.bench.calls import count_step, engine_step_files
from attnkit.models import LlamaConfig, LlamaModel


def _tiny() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  ffn_size=64, context_length=128)).eval()


def test_a_decode_step_is_counted_in_the_layers_and_the_kernel() -> None:
    model = _tiny()
    for static in (False, True):
        total, seen = count_step(model, static)
        assert total == sum(seen.values()) > 0
        assert seen["attention.py:_step"] == 2  # one per layer: the step went through the checked model's context
        assert seen["scaled_dot_product_attention (C)"] == 2


def test_the_engine_step_files_run_from_the_engine_to_the_kernel() -> None:
    files = engine_step_files(_tiny())
    assert files[0] == "serve/engine.py"
    for reached in ("serve/runner.py", "serve/paged.py", "models/decoder.py", "modules/attention.py",
                    "backends/sdpa.py", "models/sampling.py"):
        assert reached in files
    assert not any(f.startswith("bench/") for f in files)  # the benchmark's own callback is not the engine's
