"""Qwen 2 and Qwen 3 GGUF files: tiny random models written on the spot, loaded by attnkit and by transformers'
GGUF loader; logits, cached decoding, greedy tokens and the "qwen2" pre-tokenizer compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._util import need
from tests.models._decoder import (
    CHATML,
    SPECIALS,
    assert_cached_steps_equal_full,
    assert_greedy_tokens_match,
    assert_padded_logits_match,
    byte_alphabet,
    write_tensors_and_close,
)
from tests.models.test_tokenizer_reference import TEXTS

need("gguf")
need("tokenizers")

from attnkit.models import Qwen2Model, Qwen3Model, load_gguf  # noqa: E402
from attnkit.modules.quantize import weight_form  # noqa: E402

# "1 2": Qwen's pre-tokenizer isolates every digit, so "12" never merges (Llama 3's groups of three would)
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ s", "1 2", "Ġ Ġ", "e l", "el l"]
TOKENS = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
SIZES = {"d": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "layers": 2}
HEAD_DIM = {"qwen2": 16, "qwen3": 32}  # Qwen 3's heads are their own size: 4 x 32 in a 64-wide model
ARCHS = ["qwen2", "qwen3"]


def tiny_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's names, (out, in) order, Q/K rows half-split as llama.cpp keeps Qwen's."""
    rng = np.random.default_rng(seed)
    d, h, g, i, hd = SIZES["d"], SIZES["heads"], SIZES["kv_heads"], SIZES["ffn"], HEAD_DIM[arch]

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"token_embd.weight": rand(len(TOKENS), d, scale=1.0), "output_norm.weight": 1 + rand(d, scale=0.1)}
    if arch == "qwen3":
        out["output.weight"] = rand(len(TOKENS), d)  # untied head (Qwen 2 ties it)
    for layer in range(SIZES["layers"]):
        p = f"blk.{layer}."
        out |= {p + "attn_norm.weight": 1 + rand(d, scale=0.1), p + "attn_q.weight": rand(h * hd, d),
                p + "attn_k.weight": rand(g * hd, d), p + "attn_v.weight": rand(g * hd, d),
                p + "attn_output.weight": rand(d, h * hd), p + "ffn_norm.weight": 1 + rand(d, scale=0.1),
                p + "ffn_gate.weight": rand(i, d), p + "ffn_up.weight": rand(i, d), p + "ffn_down.weight": rand(d, i)}
        if arch == "qwen2":
            out |= {p + "attn_q.bias": rand(h * hd, scale=0.5), p + "attn_k.bias": rand(g * hd, scale=0.5),
                    p + "attn_v.bias": rand(g * hd, scale=0.5)}
        else:
            out |= {p + "attn_q_norm.weight": 1 + rand(hd, scale=0.1),
                    p + "attn_k_norm.weight": 1 + rand(hd, scale=0.1)}
    return out


def write_tiny_qwen(path: Path, arch: str, *, pre: str = "qwen2", strings: dict[str, str] | None = None,
                    drop: tuple[str, ...] = (), key_length: int | None = None, template: str = CHATML,
                    context_length: int = 128) -> dict[str, np.ndarray]:
    """Write a tiny Qwen 2 / Qwen 3 GGUF file at ``path`` (metadata as llama.cpp writes it); return its weights."""
    gguf = need("gguf")
    weights = tiny_weights(arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(SIZES["layers"])
    w.add_context_length(context_length)
    w.add_embedding_length(SIZES["d"])
    w.add_feed_forward_length(SIZES["ffn"])
    w.add_head_count(SIZES["heads"])
    w.add_head_count_kv(SIZES["kv_heads"])
    if arch == "qwen3":
        w.add_key_length(key_length or HEAD_DIM[arch])
        w.add_value_length(key_length or HEAD_DIM[arch])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in (strings or {}).items():
        w.add_string(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_bos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(template)
    write_tensors_and_close(w, weights, drop)
    return weights


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    write_tiny_qwen(path, arch)
    return arch, path


@pytest.fixture(scope="module")
def hf(tiny: tuple[str, Path]) -> Any:
    """transformers' Qwen2ForCausalLM / Qwen3ForCausalLM from the tiny file, in float32.

    transformers does not read qwen3.attention.key_length from a GGUF file (it keeps Qwen3Config's head_dim,
    128, the real models' size): the tiny heads' 32 is given."""
    transformers = need("transformers")
    arch, path = tiny
    extra = {"head_dim": HEAD_DIM[arch]} if arch == "qwen3" else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32, attn_implementation="eager",
                                                             **extra).eval()


def test_the_file_loads_as_its_architecture_with_each_weight_in_its_place(tiny: tuple[str, Path]) -> None:
    """Q/K rows permuted as Llama's are, or the bias or norms dropped, would still load without this."""
    arch, path = tiny
    model: Any = load_gguf(path)
    w = {name: torch.from_numpy(array) for name, array in tiny_weights(arch).items()}
    assert type(model) is {"qwen2": Qwen2Model, "qwen3": Qwen3Model}[arch]
    for i, block in enumerate(model.layers):
        p = f"blk.{i}."
        attention = block.attention
        assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 2, HEAD_DIM[arch])
        torch.testing.assert_close(attention.qkv_proj.weight, torch.cat([w[p + f"attn_{n}.weight"] for n in "qkv"]))
        torch.testing.assert_close(block.mlp.gate_up_proj.weight,
                                   torch.cat([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]]))
        if arch == "qwen2":
            torch.testing.assert_close(attention.qkv_proj.bias, torch.cat([w[p + f"attn_{n}.bias"] for n in "qkv"]))
            assert attention.qk_norm is None
        else:
            assert attention.qkv_proj.bias is None
            torch.testing.assert_close(attention.qk_norm.q_norm.weight, w[p + "attn_q_norm.weight"])
            torch.testing.assert_close(attention.qk_norm.k_norm.weight, w[p + "attn_k_norm.weight"])
    head = w.get("output.weight", w["token_embd.weight"])
    torch.testing.assert_close(model.lm_head.weight, head)
    assert (model.lm_head.weight is model.embed.weight) == (arch == "qwen2")


def test_logits_match_transformers_on_a_left_padded_batch(tiny: tuple[str, Path], hf: Any) -> None:
    model: Any = load_gguf(tiny[1])
    ids = torch.randint(3, len(TOKENS), (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :10] = 0, 0  # left padding
    assert_padded_logits_match(model, hf, ids, mask)


def test_cached_decoding_equals_the_full_forward(tiny: tuple[str, Path]) -> None:
    """Prefill 4 tokens, then one per step: a bias or norm applied twice to cached keys (or not at all) differs
    (float64, so any difference is a bug, not rounding)."""
    model: Any = load_gguf(tiny[1]).double()
    ids = torch.randint(3, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(0))
    assert_cached_steps_equal_full(model, ids, prefill=4)


def test_sixteen_greedy_tokens_match_transformers_generate(tiny: tuple[str, Path], hf: Any) -> None:
    model: Any = load_gguf(tiny[1])
    ids = torch.tensor([[5, 40, 41, 262, 100]])
    assert_greedy_tokens_match(model, hf, ids)


def test_weights_auto_keeps_float32_for_an_unmeasured_architecture(tiny: tuple[str, Path]) -> None:
    """Qwen models inherit Llama's blocks, not its measured weight forms (int4 was measured on SmolLM2 only)."""
    assert weight_form(load_gguf(tiny[1], weights="auto")) == "float32"


# --- the tokenizer ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-tok") / "tiny.gguf"
    write_tiny_qwen(path, "qwen2")
    return path


@pytest.mark.parametrize("text", [*TEXTS, "It's 12 o'CLOCK, THEY'RE here", "a12b 1212 ١٢", "hello  \n\n  there"])
def test_qwen2_pre_tokenizer_ids_equal_transformers_original_regex(qwen2_file: Path, text: str) -> None:
    """llama.cpp's spelled-out (?:'[sS]|...) regex against Qwen's tokenizer.json regex with (?i:'s|...)."""
    transformers = need("transformers")
    ours = load_gguf(qwen2_file).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(qwen2_file.parent), gguf_file=qwen2_file.name)
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]


def test_qwen2_isolates_every_digit(qwen2_file: Path) -> None:
    """The "1 2" merge never applies: Llama 3's split (digits in threes) would give the merged token."""
    tok = load_gguf(qwen2_file).tokenizer
    one, two = TOKENS.index("1"), TOKENS.index("2")
    assert tok.encode("x 12") == [TOKENS.index("x"), TOKENS.index("Ġ"), one, two]


# --- bad files -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "options", "match"), [
    ("qwen2", {"pre": "qwen35"}, r"pre-tokenizer 'qwen35' \(tokenizer.ggml.pre\) is not supported"),
    ("qwen2", {"strings": {"qwen2.rope.scaling.type": "yarn"}},
     r"RoPE scaling 'yarn' \(qwen2.rope.scaling.type\) is not supported"),
    ("qwen3", {"strings": {"qwen3.rope.scaling.type": "longrope"}}, r"RoPE scaling 'longrope' \(qwen3.rope"),
    ("qwen2", {"drop": ("blk.1.attn_k.bias",)}, r"tensor 'blk.1.attn_k.bias' is missing"),
    ("qwen3", {"drop": ("blk.0.attn_q_norm.weight",)}, r"tensor 'blk.0.attn_q_norm.weight' is missing"),
])
def test_a_file_the_loader_cannot_honour_is_refused_by_name(tmp_path: Path, arch: str, options: dict[str, Any],
                                                            match: str) -> None:
    write_tiny_qwen(tmp_path / "bad.gguf", arch, **options)
    with pytest.raises(ValueError, match=match):
        load_gguf(tmp_path / "bad.gguf")


def test_qwen3_heads_contradicting_the_tensors_are_named(tmp_path: Path) -> None:
    """A key_length (16) the tensors (heads of 32) do not have: the first tensor of the wrong shape is named."""
    write_tiny_qwen(tmp_path / "bad.gguf", "qwen3", key_length=16)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight' has shape \(128, 64\), but the metadata "
                                         r"implies \(64, 64\)"):
        load_gguf(tmp_path / "bad.gguf")


@pytest.mark.parametrize(("options", "match"), [
    ({"drop": ("blk.1.attn_q.weight",)}, r"tensor 'blk.1.attn_q.weight' is missing"),
    ({"template": "{% for m in messages %}"}, r"the chat template of .*tiny.gguf does not parse"),
])
def test_a_bad_file_is_refused_before_any_weight_is_read(tmp_path: Path, options: dict[str, Any],
                                                         match: str) -> None:
    """Bug: the last layer's missing tensor, or a template that does not parse, was found after every weight
    before it had been read (or, for the template, at the first chat)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_qwen(path, "qwen2", **options)
    read: list[tuple[int, int]] = []
    with pytest.raises(ValueError, match=match):
        load_gguf(path, progress=lambda done, total: read.append((done, total)))
    assert read == []
