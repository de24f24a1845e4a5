"""The int8 paged pool (``Engine(kv_dtype="int8")``, ``attnkit serve --kv-dtype int8``): generate's int8 cache format,
int8 codes and one bfloat16 scale per (position, key/value head), kept in the paged pool and read back dequantised."""

from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from attnkit.models import LlamaConfig, LlamaModel
from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine, Event, PagedBatch, PagedKVPool
from attnkit.serve.compile_cache import CompileCache


def _model(head_dim: int = 8, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A tiny decoder whose matrices are scaled up 8 times: at their initial scale every greedy answer repeats one
    token, and tokens that never change compare nothing."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, d_model=4 * head_dim, num_layers=2, num_heads=4, num_kv_heads=2,
                         ffn_size=48, context_length=128)
    model = LlamaModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(8)
    model.stop_token_ids = ()
    return model.to(dtype)


def _decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def _engine(model: LlamaModel, **options: Any) -> Engine:
    return Engine(model, _decode, kv_memory_mib=1, block_size=4, **options)


def _collect(answer: list[int]) -> Callable[[Event], None]:
    """A request's callback: its tokens appended to ``answer``."""
    return lambda event: answer.extend(event.token_ids)


def _tokens(engine: Engine, prompts: list[list[int]], new: int = 8) -> list[list[int]]:
    """Greedy answers of ``prompts`` submitted together, stepped until all finish."""
    answers: list[list[int]] = [[] for _ in prompts]
    for prompt, answer in zip(prompts, answers, strict=True):
        engine.submit(prompt, GenerationOptions(max_new_tokens=new), _collect(answer))
    while not engine.idle:
        engine.step()
    return answers


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 50, (n,), generator=g).tolist() for n in lengths]


def _quantized(x: Tensor) -> Tensor:
    """x (..., D) quantised and dequantised in float64: each vector's scale max|x| / 127 rounded to bfloat16, its
    codes round(x / scale)."""
    x = x.double()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).to(torch.bfloat16).double()  # (..., 1)
    return torch.round(x / scale).clamp(-127, 127) * scale  # (..., D)


def test_an_int8_pool_hands_back_each_rows_own_keys_quantised_and_dequantised() -> None:
    """Two rows with their own blocks, written in two calls (a left-padded prompt, then one token each): every
    position a row reads back is its own key and value, to the rounding of int8 codes with a bfloat16 scale per
    (position, head); a row's positions past its length read nothing (-1)."""
    pool = PagedKVPool(num_layers=1, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.int8)
    assert pool.dtype == torch.int8 and pool.k_scales[0].dtype == pool.v_scales[0].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    k1, v1, k2, v2 = (3 * torch.randn(2, 2, t, 8, generator=g) for t in (6, 6, 1, 1))  # (B, G, T, D)
    tables = [[3, 0], [5]]
    calls = [(k1, v1, torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, -1, 0, 1, 2]]), [6, 3]),
             (k2, v2, torch.tensor([[6], [3]]), [7, 4])]
    with torch.inference_mode():
        for k, v, positions, lengths in calls:
            pool.batch = PagedBatch.build(tables, positions, lengths, pool.block_size, pool.spare)
            held = pool.layers[0].update(k, v, positions)
    assert held.k.dtype == held.v.dtype == torch.float32 and held.k.shape == held.v.shape == (2, 2, 7, 8)
    keys = [torch.cat((k1[0], k2[0]), dim=1), torch.cat((k1[1, :, 3:], k2[1]), dim=1)]  # (G, S_b, D) per row
    values = [torch.cat((v1[0], v2[0]), dim=1), torch.cat((v1[1, :, 3:], v2[1]), dim=1)]
    for b, length in enumerate((7, 4)):
        torch.testing.assert_close(held.k[b, :, :length], _quantized(keys[b]).float())
        torch.testing.assert_close(held.v[b, :, :length], _quantized(values[b]).float())
    torch.testing.assert_close(held.positions, torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, -1, -1, -1]]))


def test_an_int8_engine_answers_as_generate_over_an_int8_cache() -> None:
    """Greedy tokens of prompts served together equal ``generate(kv_dtype="int8")``'s for each prompt alone. Both
    store the same codes and scales, and at this head dim (8, not a multiple of 16) generate's cache never takes
    the int8 kernel (``Int8Keys.reads_directly``): both attend over the same dequantised float32 numbers with the
    usual kernels, so tokens agree as the float32 engine's agree with generate's. The int8 rounding shows: a float
    pool answers some of these prompts otherwise."""
    model = _model()
    engine = _engine(model, kv_dtype="int8")
    prompts = _prompts(3, 9, 17, 5)
    answers = _tokens(engine, prompts, new=16)
    for prompt, tokens in zip(prompts, answers, strict=True):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=16, stop_ids=[], kv_dtype="int8")
        assert tokens == alone[0, len(prompt):].tolist()
    assert answers != _tokens(_engine(model), prompts, new=16)


def test_an_int8_pool_holds_about_3_5_times_the_blocks_of_a_float32_pool() -> None:
    """Per (position, head) a key takes D int8 codes and a bfloat16 scale (D + 2 bytes) against float32's 4D: at
    D = 16, 64 / 18 = 3.56 times the blocks in the same memory; the tensors held take the bytes counted."""
    model = _model(head_dim=16)
    int8 = PagedKVPool.for_model(model, kv_memory_mib=1, block_size=4, kv_dtype="int8")
    plain = PagedKVPool.for_model(model, kv_memory_mib=1, block_size=4)
    vectors = 2 * 2 * 4 * 2  # (key, value) x layers x positions per block x key/value heads
    assert int8.num_blocks == 2**20 // (vectors * (16 + 2)) == 1820
    assert plain.num_blocks == 2**20 // (vectors * 16 * 4) == 512
    assert int8.num_blocks / plain.num_blocks == pytest.approx(64 / 18, rel=1e-3)
    held = sum(t.numel() * t.element_size() for t in (*int8.k, *int8.v, *int8.k_scales, *int8.v_scales))
    per_block = PagedKVPool.bytes_per_block(num_layers=2, block_size=4, num_kv_heads=2, head_dim=16,
                                            dtype=torch.int8)
    assert held == int8.num_blocks * per_block + per_block // 4  # every block, and the spare slot (a position)
    assert plain.k_scales == plain.v_scales == []  # a float pool holds no scales


def test_int8_is_refused_under_a_float16_model_and_taken_under_a_bfloat16_one() -> None:
    with pytest.raises(ValueError, match="kv_dtype=int8") as refused:
        _engine(_model(dtype=torch.float16), kv_dtype="int8")
    assert "torch.float16" in str(refused.value)
    engine = _engine(_model(dtype=torch.bfloat16), kv_dtype=torch.int8)  # the dtype, as its name
    assert engine.pool.dtype == torch.int8
    answers = _tokens(engine, _prompts(5, 3), new=4)
    assert [len(a) for a in answers] == [4, 4]


@pytest.mark.slow  # one graph compiled: about 30 s on two cores with a cold Inductor cache
def test_the_compiled_step_over_an_int8_pool_gives_the_eager_tokens(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens of a batch (B = 2) and of one request alone (B = 1) equal the eager int8 engine's, and every
    decode step ran the graph (a guard that failed would have marked it failed)."""
    default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"  # Inductor's kernels kept warm
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(default))
    model = _model()
    engine = _engine(model, kv_dtype="int8", compile=True,
                     compile_cache=CompileCache.for_model(model, torch.int8, tmp_path))
    assert engine.wait_compiled(timeout=900), engine.compile_status()
    eager = _engine(model, kv_dtype="int8")
    prompts = _prompts(3, 9)
    assert _tokens(engine, prompts) == _tokens(eager, prompts)
    assert _tokens(engine, prompts[1:], new=6) == _tokens(eager, prompts[1:], new=6)
    assert engine.compile_status()["steps"] >= 7 + 5
