"""The GGUF loader refuses what cannot describe a model, checks every tensor, and honours RoPE scaling."""

from __future__ import annotations

import warnings
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
from attnkit.models.llama import llama_config, rope_scaling  # noqa: E402
from attnkit.models.loader import SlowDtypeWarning  # noqa: E402

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
    ({"llama.rope.scaling.factor": 4.0, "llama.rope.scale_linear": 2.0}, 4.0),  # the new key first
    ({"llama.rope.scaling.type": "linear"}, 1.0),  # llama.cpp: no factor, or 0, is no scaling
    ({"llama.rope.scaling.factor": 0.0}, 1.0),
    ({"llama.rope.scaling.factor": 1.0, "llama.rope.scaling.attn_factor": 1.0}, 1.0),
    ({}, 1.0),
])
def test_rope_scaling_metadata_is_honoured(extra: dict[str, Any], factor: float) -> None:
    assert rope_scaling({**GOOD, **extra}) == factor
    assert llama_config({**GOOD, **extra}).rope_scaling == factor


def _write_with_rope_keys(path: Path, monkeypatch: pytest.MonkeyPatch, keys: dict[str, Any]) -> None:
    """The tiny file of write_tiny_llama, with ``keys`` (llama.rope.*) written beside the RoPE base."""
    gguf = need("gguf")
    add_base = gguf.GGUFWriter.add_rope_freq_base

    def add_base_and_keys(writer: Any, value: float) -> None:
        add_base(writer, value)
        for key, item in keys.items():
            (writer.add_string if isinstance(item, str) else writer.add_float32)(key, item)

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_rope_freq_base", add_base_and_keys)
        write_tiny_llama(path)


@pytest.mark.parametrize("keys", [{"llama.rope.scaling.factor": 4.0}, {"llama.rope.scale_linear": 4.0}])
def test_a_file_with_rope_scaling_loaded_with_plain_rope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         keys: dict[str, Any]) -> None:
    """The factor travels from the file to every layer's RotaryEmbedding (it was read by no one)."""
    path = tmp_path / "scaled.gguf"
    _write_with_rope_keys(path, monkeypatch, keys)
    model: Any = load_gguf(path)
    assert model.config.rope_scaling == 4.0
    assert {block.attention.rope.scaling for block in model.layers} == {4.0}


def test_a_file_with_yarn_scaling_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "yarn.gguf"
    _write_with_rope_keys(path, monkeypatch, {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match=r"RoPE scaling 'yarn' \(llama.rope.scaling.type\) is not supported"):
        load_gguf(path)


@pytest.mark.parametrize("kind", ["yarn", "longrope", "llama3", "su"])
def test_other_rope_scaling_types_are_refused_by_name(kind: str) -> None:
    with pytest.raises(ValueError, match=f"RoPE scaling '{kind}' .*only 'linear'"):
        llama_config({**GOOD, "llama.rope.scaling.type": kind, "llama.rope.scaling.factor": 4.0})


@pytest.mark.parametrize(("change", "message"), [
    ({"llama.rope.scaling.factor": -2.0}, r"llama.rope.scaling.factor = -2.0 cannot scale RoPE"),
    ({"llama.rope.scale_linear": float("nan")}, r"llama.rope.scale_linear = nan cannot scale RoPE"),
    ({"llama.rope.scaling.factor": float("inf")}, r"llama.rope.scaling.factor = inf"),
    ({"llama.rope.scaling.factor": "4"}, r"llama.rope.scaling.factor = '4'"),
    ({"llama.rope.scaling.factor": 4.0, "llama.rope.scaling.attn_factor": 0.5},
     r"llama.rope.scaling.attn_factor = 0.5 is not supported"),
])
def test_a_rope_factor_that_cannot_scale_is_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama_config({**GOOD, **change})


@pytest.mark.parametrize(("change", "message"), [
    ({"llama.attention.head_count": 0}, r"llama.attention.head_count = 0 cannot describe a model"),
    ({"llama.attention.head_count": -4}, r"llama.attention.head_count = -4"),
    ({"llama.attention.head_count_kv": 0}, r"llama.attention.head_count_kv = 0"),
    ({"llama.attention.head_count": 5}, r"embedding_length = 32 is not divisible by .*head_count = 5"),
    ({"llama.attention.head_count_kv": 3}, r"head_count = 4 is not a multiple of .*head_count_kv = 3"),
    ({"llama.block_count": 0}, r"llama.block_count = 0"),
    ({"llama.embedding_length": 0}, r"llama.embedding_length = 0 cannot describe a model"),
    ({"llama.embedding_length": 36}, r"36 / 4 = 9: rotary embedding needs an even head dim"),
    ({"llama.vocab_size": 0}, r"llama.vocab_size = 0 cannot describe a model"),
    ({"llama.rope.freq_base": 0.5}, r"freq_base = 0.5 cannot describe a model: expected a finite number > 1"),
    ({"llama.attention.layer_norm_rms_epsilon": -1e-5}, r"layer_norm_rms_epsilon = -1e-05 cannot describe a model"),
    ({"llama.embedding_length": 32.0}, r"llama.embedding_length = 32.0 .*expected an integer >= 1"),
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


def test_metadata_without_a_vocabulary_is_named() -> None:
    metadata = {k: v for k, v in GOOD.items() if k != "llama.vocab_size"}
    with pytest.raises(ValueError, match=r"no vocabulary: neither llama\.vocab_size nor tokenizer\.ggml\.tokens"):
        llama_config(metadata)
    assert llama_config({**metadata, "tokenizer.ggml.tokens": ["a", "b", "c"]}).vocab_size == 3


@pytest.mark.parametrize(("change", "message"), [
    ({"num_heads": 0}, r"LlamaConfig num_heads=0 cannot describe a model"),
    ({"vocab_size": -1}, r"LlamaConfig vocab_size=-1"),
    ({"num_kv_heads": 3}, r"num_kv_heads to divide num_heads, got d_model=32, num_heads=4, num_kv_heads=3"),
    ({"d_model": 36}, r"head dim d_model / num_heads = 9 must be even"),
])
def test_a_config_that_cannot_describe_a_model_is_named(change: dict[str, Any], message: str) -> None:
    """LlamaConfig(num_heads=0) was a ZeroDivisionError at head_dim."""
    sizes = {"vocab_size": 64, "d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_size": 48}
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**sizes, **change})


def _rand(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(("name", "shape"), [
    ("blk.0.ffn_gate.weight", (47, 32)), ("blk.1.attn_q.weight", (32, 31)), ("blk.0.attn_k.weight", (8, 32)),
    ("blk.0.attn_norm.weight", (31,)), ("token_embd.weight", (265, 16)), ("blk.1.ffn_down.weight", (32, 47)),
    ("blk.1.ffn_up.weight", (48, 16)), ("blk.0.attn_v.weight", (24, 32)), ("blk.0.attn_output.weight", (32, 16)),
    ("blk.1.ffn_norm.weight", (33,)), ("output_norm.weight", (16,)), ("output.weight", (100, 32)),
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


def test_bfloat16_is_silently_seven_times_slower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_gguf(dtype=bfloat16) on an AVX2 CPU: one warning naming the capability, at the caller's line."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.warns(SlowDtypeWarning, match=r"bfloat16 on this CPU \(PyTorch capability 'AVX2'.*float32 is "
                                              r"faster here") as record:
        model = load_gguf(path, dtype=torch.bfloat16)
    assert len(record) == 1 and record[0].filename == __file__
    assert model.embed.weight.dtype == torch.bfloat16  # a warning, not a refusal
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_gguf(path)  # float32: nothing to say
