"""The floor contender (attnkit.bench.floor): the same logits and greedy tokens as attnkit's model it is built on."""

from __future__ import annotations

import pytest
import torch

from attnkit.bench.floor import Floor, FloorLlama
from attnkit.models import LlamaConfig, LlamaModel
from tests.models._decoder import smollm2

CONFIG = LlamaConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=128,
                     context_length=64)


def tiny(dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A random tiny Llama whose greedy tokens vary (weights of std 0.5: at the default scale it repeats one token,
    which no RoPE or cache bug would change)."""
    torch.manual_seed(0)
    model = LlamaModel(CONFIG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name != "embed.weight":
                p.normal_(0, 0.5)
    return model.to(dtype)


def prompts(batch: int, length: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))  # (B, T)


def test_prefill_logits_equal_attnkit_float64() -> None:
    model = tiny(torch.float64)
    floor = FloorLlama.from_attnkit(model)
    ids = prompts(2, 11)  # (B, T)
    with torch.no_grad():
        want = model(ids)  # (B, T, V)
        floor.setup_caches(2, 20)
        whole = floor(ids, torch.arange(11))
        floor.setup_caches(2, 20)  # the same prompt in two pieces: the second attends to the first through the cache
        pieces = torch.cat([floor(ids[:, :6], torch.arange(6)), floor(ids[:, 6:], torch.arange(6, 11))], dim=1)
    torch.testing.assert_close(whole, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(pieces, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_tokens_equal_attnkit(dtype: torch.dtype) -> None:
    model = tiny(dtype)
    ids = prompts(1, 9)
    want = model.generate(ids, max_new_tokens=16, stop_ids=[])[:, 9:]  # (1, 16)
    assert len(set(want[0].tolist())) > 4  # tokens that vary: a wrong position would change them
    assert torch.equal(FloorLlama.from_attnkit(model).generate(ids, 16), want)


def test_batch_rows_equal_each_alone() -> None:
    model = tiny(torch.float64)
    floor = FloorLlama.from_attnkit(model)
    ids = prompts(2, 7)
    both = floor.generate(ids, 16)  # (2, 16)
    assert both.shape == (2, 16) and not torch.equal(both[0], both[1])
    for row in range(2):
        assert torch.equal(both[row], floor.generate(ids[row : row + 1], 16)[0])


def test_contender_times_and_refuses_mixed_lengths() -> None:
    contender = Floor(tiny())
    first, rest = contender.single(list(range(5)), 4)
    assert first > 0 and rest > 0
    assert contender.batch([[1, 2, 3], [4, 5, 6]], 4) > 0
    with pytest.raises(ValueError, match=r"lengths \[2, 3\]"):
        contender.batch([[1, 2, 3], [4, 5]], 4)


def test_prompt_beyond_capacity_is_refused_naming_the_numbers() -> None:
    floor = FloorLlama.from_attnkit(tiny(), capacity=16)
    with pytest.raises(ValueError, match=r"20 prompt tokens .* capacity 16"):
        floor.generate(prompts(1, 20), 1)
    with pytest.raises(ValueError, match=r"10 prompt tokens \+ 7 new ones = 17 .* capacity 16"):
        floor.generate(prompts(1, 10), 7)
    assert floor.generate(prompts(1, 10), 6).shape == (1, 6)  # exactly the capacity: allowed
    with pytest.raises(ValueError, match=r"torch\.long"):
        floor.generate(prompts(1, 10).int(), 6)
    with pytest.raises(ValueError, match="context length 64"):
        FloorLlama.from_attnkit(tiny(), capacity=65)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["float32", "float16", "int4"])
def test_smollm2_tokens_equal_attnkit(form: str) -> None:
    from attnkit.models import load_smollm2
    from attnkit.modules.quantize import available_forms, quantize

    model = smollm2()  # float32, shared with the other tests: never quantized in place
    if form != "float32":
        if form not in available_forms():
            pytest.skip(f"this CPU's PyTorch has no {form} kernels")
        model = quantize(load_smollm2(weights="float32"), form)
    ids = torch.tensor([model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])
    want = model.generate(ids, max_new_tokens=16, stop_ids=[])[:, ids.shape[1] :]  # (1, 16)
    floor = FloorLlama.from_attnkit(model, capacity=256)
    assert floor.blocks[0].qkv is model.layers[0].attention.qkv_proj  # the very same (packed) layers
    assert floor.embed is model.embed and floor.head is model.lm_head
    assert torch.equal(floor.generate(ids, 16), want)
