"""SmolLM2 on attnkit against transformers' LlamaForCausalLM loaded from the same GGUF file.

transformers dequantises the file itself and runs its own attention; agreeing
with it checks the loader (llama.cpp's Q/K permutation undone, Q/K/V fused in
the right order, tied head), the blocks (RMSNorm, SwiGLU), attnkit's rotary
embedding with grouped heads, and the generation loop.
"""

from __future__ import annotations

import pytest
import torch

from tests.models._decoder import hf_smollm2, smollm2

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Ünïcødé — 42 apples   and 7 pears.",
           "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize("text", PROMPTS)
def test_logits_match_transformers(text: str) -> None:
    model, (hf, tok) = smollm2(), hf_smollm2()
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.inference_mode():
        ours, theirs = model(ids), hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_logits_match_transformers_on_a_left_padded_batch() -> None:
    model, (hf, _) = smollm2(), hf_smollm2()
    batch = model.tokenize(PROMPTS[:3])
    mask = batch["attention_mask"].bool()
    assert not mask.all()  # the rows really are padded
    with torch.inference_mode():
        ours = model(batch["input_ids"], batch["attention_mask"])
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-4, rtol=1e-4)


def test_32_greedy_tokens_match_transformers_generate() -> None:
    model, (hf, tok) = smollm2(), hf_smollm2()
    ids = torch.tensor([tok("The history of the Roman Empire")["input_ids"]])
    with torch.inference_mode():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                             min_new_tokens=32, pad_token_id=tok.pad_token_id)
    ours = model.generate(ids, max_new_tokens=32, stop_ids=[])
    assert ours.shape == (1, ids.shape[1] + 32)
    assert ours.tolist() == theirs.tolist()


def test_chat_answer_says_paris_and_stops_at_end_of_turn() -> None:
    model = smollm2()
    ids = model.tokenize(model.chat_prompt([{"role": "user", "content": "What is the capital of France?"}]))
    out = model.generate(ids["input_ids"], max_new_tokens=24)
    assert out.shape[1] < ids["input_ids"].shape[1] + 24  # it ended its turn early
    assert int(out[0, -1]) in model.stop_token_ids
    assert "Paris" in model.decode(out[0, ids["input_ids"].shape[1] :])


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ünïcødé?"}],
])
def test_chat_prompt_matches_apply_chat_template(messages: list[dict[str, str]]) -> None:
    model, (_, tok) = smollm2(), hf_smollm2()
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert model.chat_prompt(messages) == expected
