"""Phi-3 GGUF files: a tiny random model written on the spot (fused ``attn_qkv`` and ``ffn_up`` tensors, a window
on every layer), loaded by attnkit and by transformers' GGUF loader; logits, cached decoding, greedy tokens, the
SentencePiece tokenizer and the refusals compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._util import need
from tests.models._decoder import (
    add_sentencepiece_vocab,
    assert_cached_steps_equal_full,
    assert_greedy_tokens_match,
    assert_padded_logits_match,
    write_tensors_and_close,
)

need("gguf")
need("tokenizers")

from attnkit.models import Phi3Model, load_gguf  # noqa: E402
from attnkit.modules.quantize import weight_form  # noqa: E402

# Phi-3's vocabulary in miniature: Llama 2's SentencePiece specials, byte tokens, pieces, then its chat tokens
SPECIALS = ["<unk>", "<s>", "</s>"]  # control tokens 0..2
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["\u2581", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "1", "2", "he", "ll", "llo", "hello",
          "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "12"]
CHAT = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]  # control tokens, as Phi-3's added tokens
TOKENS = SPECIALS + BYTES + PIECES + CHAT
TYPES = [2, 3, 3] + [6] * len(BYTES) + [1] * len(PIECES) + [3] * len(CHAT)
END = TOKENS.index("<|end|>")
TEMPLATE = ("{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
SIZES = {"d": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 96, "layers": 2}
WINDOW = 4


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's Phi-3 names, (out, in) order: Q/K/V fused by rows (half-split, as
    llama.cpp keeps them), gate and up fused by rows in ``ffn_up``, an output head of its own."""
    rng = np.random.default_rng(seed)
    d, h, g, hd, i = SIZES["d"], SIZES["heads"], SIZES["kv_heads"], SIZES["head_dim"], SIZES["ffn"]

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"token_embd.weight": rand(len(TOKENS), d, scale=1.0), "output_norm.weight": 1 + rand(d, scale=0.1),
           "output.weight": rand(len(TOKENS), d)}
    for layer in range(SIZES["layers"]):
        p = f"blk.{layer}."
        out |= {p + "attn_norm.weight": 1 + rand(d, scale=0.1), p + "attn_qkv.weight": rand((h + 2 * g) * hd, d),
                p + "attn_output.weight": rand(d, h * hd), p + "ffn_norm.weight": 1 + rand(d, scale=0.1),
                p + "ffn_up.weight": rand(2 * i, d), p + "ffn_down.weight": rand(d, i)}
    return out


def write_tiny_phi3(path: Path, *, window: int = WINDOW, context: int = 128, original_context: int | None = None,
                    rope_dims: int | None = None, floats: dict[str, float] | None = None,
                    strings: dict[str, str] | None = None, extra: dict[str, np.ndarray] | None = None,
                    drop: tuple[str, ...] = (), space_prefix: bool | None = False) -> dict[str, np.ndarray]:
    """Write a tiny Phi-3 GGUF file at ``path`` (metadata as llama.cpp's converter writes it); return its weights.

    ``space_prefix`` None leaves ``tokenizer.ggml.add_space_prefix`` out, as the converter does for Phi-3."""
    gguf = need("gguf")
    weights = tiny_weights()
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_name("tiny phi3")
    w.add_context_length(context)
    w.add_rope_scaling_orig_ctx_len(original_context or context)
    w.add_embedding_length(SIZES["d"])
    w.add_feed_forward_length(SIZES["ffn"])
    w.add_block_count(SIZES["layers"])
    w.add_head_count(SIZES["heads"])
    w.add_head_count_kv(SIZES["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(rope_dims or SIZES["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(window)
    for key, value in (floats or {}).items():
        w.add_float32(key, value)
    for key, text in (strings or {}).items():
        w.add_string(key, text)
    add_sentencepiece_vocab(w, TOKENS, TYPES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(TOKENS.index("<|endoftext|>"))
    w.add_unk_token_id(0)
    w.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.add_chat_template(TEMPLATE)
    write_tensors_and_close(w, weights | (extra or {}), drop)
    return weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("phi3") / "tiny-phi3.gguf"
    write_tiny_phi3(path)
    return path


@pytest.fixture(scope="module")
def hf(tiny: Path) -> Any:
    """transformers' Phi3ForCausalLM from the tiny file, in float32.

    transformers' GGUF reader maps phi3's sizes but not ``phi3.attention.sliding_window`` (Phi3Config's default
    is no window): the file's window of 4 is given."""
    transformers = need("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny.parent), gguf_file=tiny.name,
                                                             dtype=torch.float32, attn_implementation="eager",
                                                             sliding_window=WINDOW).eval()


def test_the_file_loads_as_phi3_with_each_fused_tensor_in_its_place(tiny: Path) -> None:
    """The fused tensors as stored: Q/K rows permuted as Llama's are, or gate and up swapped, would still load."""
    model: Any = load_gguf(tiny)
    w = {name: torch.from_numpy(array) for name, array in tiny_weights().items()}
    assert type(model) is Phi3Model
    for i, block in enumerate(model.layers):
        p, attention = f"blk.{i}.", block.attention
        assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 2, 16)
        assert attention.window == WINDOW and attention.qkv_proj.bias is None and attention.qk_norm is None
        torch.testing.assert_close(attention.qkv_proj.weight, w[p + "attn_qkv.weight"], rtol=0, atol=0)
        torch.testing.assert_close(attention.out_proj.weight, w[p + "attn_output.weight"], rtol=0, atol=0)
        torch.testing.assert_close(block.mlp.gate_up_proj.weight, w[p + "ffn_up.weight"], rtol=0, atol=0)
        torch.testing.assert_close(block.mlp.down_proj.weight, w[p + "ffn_down.weight"], rtol=0, atol=0)
        torch.testing.assert_close(block.attention_norm.weight, w[p + "attn_norm.weight"], rtol=0, atol=0)
        torch.testing.assert_close(block.mlp_norm.weight, w[p + "ffn_norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, w["output.weight"], rtol=0, atol=0)
    assert model.lm_head.weight is not model.embed.weight  # Phi-3's head is its own


def test_transformers_reads_the_tiny_file_as_phi3(hf: Any) -> None:
    assert type(hf).__name__ == "Phi3ForCausalLM"
    config = hf.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)
    assert config.sliding_window == WINDOW and config.tie_word_embeddings is False


def test_logits_match_transformers_on_a_left_padded_batch_past_the_window(tiny: Path, hf: Any) -> None:
    model: Any = load_gguf(tiny)
    ids = torch.randint(3, len(TOKENS), (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :8] = 0, 0  # left padding
    assert_padded_logits_match(model, hf, ids, mask)


def test_the_window_changes_the_logits_so_the_comparison_sees_it(tiny: Path, hf: Any) -> None:
    """Without the window (llama.cpp's reading of Phi-3) the last logits differ: the test above checks it."""
    model: Any = load_gguf(tiny)
    ids = torch.randint(3, len(TOKENS), (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        windowed = model(ids)
        for block in model.layers:
            block.attention.window = None
        whole = model(ids)
    torch.testing.assert_close(whole[:, :WINDOW], windowed[:, :WINDOW])
    assert not torch.allclose(whole[:, WINDOW:], windowed[:, WINDOW:], rtol=1e-3, atol=1e-3)


def test_cached_decoding_equals_the_full_forward_across_the_window(tiny: Path) -> None:
    """Prefill 3 tokens, then one per step: a cache that forgets the window, or aligns it by slot and not by
    position, differs after 4 tokens (float64, so any difference is a bug, not rounding)."""
    model: Any = load_gguf(tiny).double()
    ids = torch.randint(3, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(0))
    assert_cached_steps_equal_full(model, ids, prefill=3)


def test_sixteen_greedy_tokens_match_transformers_generate(tiny: Path, hf: Any) -> None:
    model: Any = load_gguf(tiny)
    ids = torch.tensor([[1, 40, 41, 262, 100, 270]])
    assert_greedy_tokens_match(model, hf, ids)


def test_weights_auto_keeps_float32_for_an_unmeasured_architecture(tiny: Path) -> None:
    """Phi-3 inherits Llama's blocks, not the weight forms measured on SmolLM2."""
    assert weight_form(load_gguf(tiny, weights="auto")) == "float32"


@pytest.mark.filterwarnings("ignore:quantize.*keep another form")  # the head: 287 outputs, not int4's tiles
@pytest.mark.parametrize(("form", "error"), [("float16", 0.01), ("int8", 0.05), ("int4", 0.3)])
def test_every_weight_form_loads_the_fused_tensors_and_generates(tiny: Path, form: str, error: float) -> None:
    """The logits within the form's rounding (int4's 4-bit grid over random weights: 22% of their norm); gate
    and up swapped in the fused ffn_up put them 91% off, Q/K rows permuted as Llama's 47%."""
    from attnkit.modules.quantize import available_forms

    if form not in available_forms():
        pytest.skip(f"{form} needs fbgemm's kernels (x86 CPUs: AVX2 or AVX512), which this PyTorch lacks")
    model, reference = load_gguf(tiny, weights=form), load_gguf(tiny)
    ids = torch.tensor([[1, 40, 41, 262, 100, 270]])
    with torch.inference_mode():
        ours, expected = model(ids), reference(ids)
    assert weight_form(model) == form
    assert torch.linalg.norm(ours - expected) < error * torch.linalg.norm(expected)  # rounded weights only
    assert model.generate(ids, max_new_tokens=4, stop_ids=[]).shape == (1, 10)


# --- the tokenizer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "pieces"), [
    ("hello world", ["hello", "\u2581world"]),
    ("ab 12", ["a", "b", "\u2581", "12"]),
    ("é", ["<0xC3>", "<0xA9>"]),  # not in the vocabulary: its UTF-8 bytes
    ("<|user|>\nhi<|end|>", ["<|user|>", "h", "<0x69>", "<|end|>"]),  # <|user|> swallows the newline (rstrip)
])
def test_the_sentencepiece_tokenizer_merges_matches_chat_tokens_whole_and_falls_back_to_bytes(
        tiny: Path, text: str, pieces: list[str]) -> None:
    tokenizer = load_gguf(tiny).tokenizer
    assert [TOKENS[i] for i in tokenizer.encode(text)] == pieces


def test_a_chat_turn_ends_at_phi3s_end_token(tiny: Path) -> None:
    """Phi-3 closes each turn with <|end|>: a model that did not stop there would run on into a new turn."""
    model: Any = load_gguf(tiny)
    assert END in model.stop_token_ids and TOKENS.index("<|endoftext|>") in model.stop_token_ids
    ids = model.tokenizer.chat_ids([{"role": "user", "content": "hello"}])
    assert [TOKENS[i] for i in ids] == ["<|user|>", "hello", "<|end|>", "<|assistant|>"]  # rstrip, as llama.cpp


# --- what attnkit cannot honour ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "match"), [
    ({"context": 128, "original_context": 32},
     r"phi3.context_length = 128 extends phi3.rope.scaling.original_context_length = 32 by LongRoPE scaling"),
    ({"floats": {"phi3.rope.scaling.attn_factor": 1.19}},
     r"phi3.rope.scaling.attn_factor = 1.19\d* \(LongRoPE or YaRN scaling\) is not supported"),
    ({"strings": {"phi3.rope.scaling.type": "longrope"}},
     r"RoPE scaling 'longrope' \(phi3.rope.scaling.type\) is not supported"),
    ({"extra": {f"rope_factors_{kind}.weight": np.ones(8, np.float32) for kind in ("long", "short")}},
     r"tensors \['rope_factors_long.weight', 'rope_factors_short.weight'\] are not part of the supported phi3"),
    ({"rope_dims": 12}, r"partial rotary embedding \(phi3.rope.dimension_count = 12, head dim 16\) is not supported"),
    ({"window": 200}, r"phi3.attention.sliding_window = 200 is larger than phi3.context_length = 128"),
    ({"drop": ("blk.1.attn_qkv.weight",)}, r"tensor 'blk.1.attn_qkv.weight' is missing"),
])
def test_a_file_the_loader_cannot_honour_is_refused_by_name(tmp_path: Path, options: dict[str, Any],
                                                            match: str) -> None:
    """Phi-3 128k's LongRoPE (context, attention factor, factor tensors, a scaling type), Phi-4-mini's partial
    and rotary embedding are named, not guessed."""
    write_tiny_phi3(tmp_path / "bad.gguf", **options)
    with pytest.raises(ValueError, match=match):
        load_gguf(tmp_path / "bad.gguf")


def test_separate_q_k_v_tensors_are_named_as_not_phi3s(tmp_path: Path) -> None:
    """A file with attn_q / attn_k / attn_v instead of the fused attn_qkv: the fused one is named missing."""
    w = tiny_weights()
    q, k, v = np.split(w["blk.0.attn_qkv.weight"], [64, 96])
    write_tiny_phi3(tmp_path / "bad.gguf", drop=("blk.0.attn_qkv.weight",),
                    extra={"blk.0.attn_q.weight": q, "blk.0.attn_k.weight": k, "blk.0.attn_v.weight": v})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_qkv.weight' is missing"):
        load_gguf(tmp_path / "bad.gguf")
