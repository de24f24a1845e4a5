"""What the engine checks at its door (attnkit.serve.door): a request when it is submitted, a sink window when the
engine is built; each refusal names the problem."""

from __future__ import annotations

import re

import pytest

from attnkit.models.generation_options import GenerationOptions
from tests.serve._engine import tiny_engine, tiny_model


@pytest.mark.parametrize(("options", "says"), [
    ({"kv_dtype": "bfloat16"}, "which torch.bfloat16 storage would round again"),
    ({"cache": "sink:4,200"}, "beyond the model's context length 128"),
    ({"cache": "sink:4,100,8", "kv_memory_mib": 0.02}, "more than the KV memory's"),
    ({"cache": "sink:4"}, 'cache must be "full"'),
])
def test_a_window_the_engine_cannot_keep_is_refused_naming_why(options: dict[str, object], says: str) -> None:
    model = tiny_model().float()  # float32: a narrower pool is allowed without a window
    options = {"cache": "sink:4,12,4", **options}
    with pytest.raises(ValueError, match=says):
        tiny_engine(model, **options)


@pytest.mark.parametrize(("prompt", "options", "says"), [
    ([], {}, "the prompt is empty"),
    ([0, 50], {}, "token ids outside the vocabulary [0, 50)"),
    ([1, 2], {"cache": "sink:4,12,4"}, "the engine's settings"),
    ([1] * 100, {"max_new_tokens": 100}, "exceeds the model's context length (128 positions)"),
])
def test_a_request_the_engine_cannot_take_is_refused_at_submit(prompt: list[int], options: dict[str, object],
                                                              says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        tiny_engine(tiny_model()).submit(prompt, GenerationOptions(**options), lambda event: None)
