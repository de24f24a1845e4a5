"""The GGUF loader refuses what cannot describe a model, checks every tensor, and honours RoPE scaling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._util import need
from tests.models._decoder import write_tiny_llama

need("gguf")
need("tokenizers")

from attnkit.models import LlamaConfig, LlamaModel, load_gguf  # noqa: E402
from attnkit.models.loader import SlowDtypeWarning, llama_config, rope_scaling, warn_if_slow  # noqa: E402

GOOD = {"general.architecture": "llama", "llama.embedding_length": 32, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.block_count": 2, "llama.feed_forward_length": 48,
        "llama.context_length": 64, "llama.vocab_size": 100}


def _hf_llama(model: LlamaModel, factor: float) -> Any:
    """transformers' LlamaForCausalLM with model's weights and linear RoPE scaling ``factor``."""
    transformers = need("transformers")
    c = model.config
    rope = {"rope_type": "linear", "factor": factor, "rope_theta": c.rope_base}
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.ffn_size,
                                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                      num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.context_length,
                                      rms_norm_eps=c.norm_eps, tie_word_embeddings=True, rope_parameters=rope,
                                      attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(config).double().eval()
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed.weight)
        hf.model.norm.weight.copy_(model.norm.weight)
        for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
            w = ours.attention.qkv_proj.weight
            a = theirs.self_attn
            a.q_proj.weight.copy_(w[:q])
            a.k_proj.weight.copy_(w[q : q + kv])
            a.v_proj.weight.copy_(w[q + kv :])
            a.o_proj.weight.copy_(ours.attention.out_proj.weight)
            gate, up = ours.mlp.gate_up_proj.weight.chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.weight)
            theirs.input_layernorm.weight.copy_(ours.attention_norm.weight)
            theirs.post_attention_layernorm.weight.copy_(ours.mlp_norm.weight)
    return hf


def test_linear_rope_scaling_equals_transformers_factor_4() -> None:
    """A file asking for linear RoPE scaling loaded with plain RoPE: logits 15 off the reference."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                         context_length=256, rope_base=10000.0, rope_scaling=4.0)
    model = LlamaModel(config).double().eval()
    hf = _hf_llama(model, 4.0)
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        ours, theirs = model(ids), hf(input_ids=ids).logits
        plain = LlamaModel(LlamaConfig(**{**config.__dict__, "rope_scaling": 1.0})).double().eval()
        plain.load_state_dict(model.state_dict())
        unscaled = plain(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)  # transformers' angles are float32
    assert (unscaled - theirs).abs().max() > 1e-2  # the test would see scaling ignored


@pytest.mark.parametrize(("extra", "factor"), [
    ({"llama.rope.scaling.factor": 4.0}, 4.0),  # no type: llama.cpp reads linear
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, 2.0),
    ({"llama.rope.scale_linear": 8.0}, 8.0),  # the older key
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, 1.0),
    ({}, 1.0),
])
def test_rope_scaling_metadata_is_honoured(extra: dict[str, Any], factor: float) -> None:
    assert rope_scaling({**GOOD, **extra}) == factor
    assert llama_config({**GOOD, **extra}).rope_scaling == factor


@pytest.mark.parametrize("kind", ["yarn", "longrope", "llama3", "su"])
def test_other_rope_scaling_types_are_refused_by_name(kind: str) -> None:
    with pytest.raises(ValueError, match=f"RoPE scaling '{kind}' .*only 'linear'"):
        llama_config({**GOOD, "llama.rope.scaling.type": kind, "llama.rope.scaling.factor": 4.0})


@pytest.mark.parametrize(("change", "message"), [
    ({"llama.attention.head_count": 0}, r"llama.attention.head_count = 0 cannot describe a model"),
    ({"llama.attention.head_count": -4}, r"llama.attention.head_count = -4"),
    ({"llama.attention.head_count_kv": 0}, r"llama.attention.head_count_kv = 0"),
    ({"llama.attention.head_count": 5}, r"embedding_length = 32 is not divisible by .*head_count = 5"),
    ({"llama.attention.head_count_kv": 3}, r"head_count = 4 is not a multiple of .*head_count_kv = 3"),
    ({"llama.block_count": 0}, r"llama.block_count = 0"),
    ({"llama.feed_forward_length": -1}, r"llama.feed_forward_length = -1"),
    ({"llama.context_length": 0}, r"llama.context_length = 0"),
    ({"llama.attention.key_length": 16}, r"key_length = 16 differs from embedding_length / head_count = 8: heads "
                                         r"of their own size are not supported"),
    ({"llama.attention.value_length": 16}, r"value_length = 16 differs"),
    ({"llama.rope.dimension_count": 4}, r"partial rotary embedding"),
    ({"general.architecture": "mamba"}, r"architecture 'mamba' is not supported"),
])
def test_metadata_that_cannot_describe_a_model_is_named(change: dict[str, Any], message: str) -> None:
    """Zero heads was a ZeroDivisionError; key_length blamed partial rotary embedding."""
    with pytest.raises(ValueError, match=message):
        llama_config({**GOOD, **change})


def _rand(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(("name", "shape"), [
    ("blk.0.ffn_gate.weight", (47, 32)), ("blk.1.attn_q.weight", (32, 31)), ("blk.0.attn_k.weight", (8, 32)),
    ("blk.0.attn_norm.weight", (31,)), ("token_embd.weight", (265, 16)), ("blk.1.ffn_down.weight", (32, 47)),
])
def test_a_tensor_of_the_wrong_shape_is_named(tmp_path: Path, name: str, shape: tuple[int, ...]) -> None:
    """Wrong gate/up or q/k shapes loaded and generated garbage; a wrong norm was a state_dict error."""
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, extra={name: _rand(*shape)})
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \({shape[0]},.*but the metadata implies"):
        load_gguf(path)


def test_a_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory, not a GGUF file"):
        load_gguf(tmp_path)


def test_bfloat16_on_a_cpu_without_it_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.warns(SlowDtypeWarning, match="capability 'AVX2'.*float32 is the faster choice"):
        warn_if_slow(torch.bfloat16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512_BF16")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_slow(torch.bfloat16)
        warn_if_slow(torch.float32)
