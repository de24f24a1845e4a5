"""Gemma 2 GGUF files: a tiny random model written on the spot (every other layer global from layer 1, soft-capped
scores and logits with caps small enough to bite), loaded by attnkit and by transformers' GGUF loader; logits,
cached decoding, greedy tokens, the config's keys and the refusals compared."""

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
from tests.models.test_gemma3 import TOKENS, TYPES  # Gemma's SentencePiece vocabulary in miniature

need("gguf")
need("tokenizers")

from attnkit.models import Gemma2Config, Gemma2Model, load_gguf  # noqa: E402
from attnkit.models.gemma2 import gemma2_config  # noqa: E402
from attnkit.modules.quantize import weight_form  # noqa: E402

SIZES = {"d": 32, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 64, "layers": 4}
WINDOW = 4
ATTN_CAP, FINAL_CAP = 2.0, 3.0  # Gemma 2's are 50 and 30; the tiny scores and logits would not reach those


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's Gemma 2 names, (out, in) order; norms near 1 (the file holds 1 + w)."""
    rng = np.random.default_rng(seed)
    d, h, g, hd, i = SIZES["d"], SIZES["heads"], SIZES["kv_heads"], SIZES["head_dim"], SIZES["ffn"]

    def rand(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"token_embd.weight": rand(len(TOKENS), d, scale=1.0), "output_norm.weight": 1 + rand(d, scale=0.1)}
    for layer in range(SIZES["layers"]):
        p = f"blk.{layer}."
        out |= {p + "attn_norm.weight": 1 + rand(d, scale=0.1), p + "attn_q.weight": rand(h * hd, d),
                p + "attn_k.weight": rand(g * hd, d), p + "attn_v.weight": rand(g * hd, d),
                p + "attn_output.weight": rand(d, h * hd), p + "post_attention_norm.weight": 1 + rand(d, scale=0.1),
                p + "ffn_norm.weight": 1 + rand(d, scale=0.1), p + "ffn_gate.weight": rand(i, d),
                p + "ffn_up.weight": rand(i, d), p + "ffn_down.weight": rand(d, i),
                p + "post_ffw_norm.weight": 1 + rand(d, scale=0.1)}
    return out


def write_tiny_gemma2(path: Path, *, window: int = WINDOW, context: int = 64, key_length: int = 16,
                      caps: tuple[float, float] | None = (ATTN_CAP, FINAL_CAP), strings: dict[str, str] | None = None,
                      drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny Gemma 2 GGUF file at ``path`` (the keys llama.cpp's converter writes); return its weights.
    ``caps`` None leaves both soft-capping keys out."""
    gguf = need("gguf")
    weights = tiny_weights()
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_context_length(context)
    w.add_embedding_length(SIZES["d"])
    w.add_block_count(SIZES["layers"])
    w.add_feed_forward_length(SIZES["ffn"])
    w.add_head_count(SIZES["heads"])
    w.add_head_count_kv(SIZES["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(key_length)
    w.add_value_length(key_length)
    if caps is not None:
        w.add_attn_logit_softcapping(caps[0])
        w.add_final_logit_softcapping(caps[1])
    w.add_sliding_window(window)
    for key, text in (strings or {}).items():
        w.add_string(key, text)
    add_sentencepiece_vocab(w, TOKENS, TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    write_tensors_and_close(w, weights | (extra or {}), drop)
    return weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma2") / "tiny-gemma2.gguf"
    write_tiny_gemma2(path)
    return path


@pytest.fixture(scope="module")
def hf(tiny: Path) -> Any:
    """transformers' Gemma2ForCausalLM from the tiny file, in float32.

    transformers' GGUF reader maps Gemma 2's sizes and window but not the soft-caps (Gemma2Config keeps 50 and
    30) nor a query scale (it keeps query_pre_attn_scalar 256, the real heads' size): the tiny file's are given."""
    transformers = need("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny.parent), gguf_file=tiny.name, dtype=torch.float32, attn_implementation="eager",
        query_pre_attn_scalar=SIZES["head_dim"], attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP).eval()


def test_the_file_loads_as_gemma2_with_every_other_layer_global_from_layer_1(tiny: Path) -> None:
    model: Any = load_gguf(tiny)
    assert type(model) is Gemma2Model
    layers = [block.attention for block in model.layers]
    assert [layer.window for layer in layers] == [WINDOW, None, WINDOW, None]
    assert {layer.rope.base for layer in layers} == {1e4}
    assert {(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.d_out) for layer in layers} == {(4, 2, 16, 32)}
    assert all(layer.scale == 16**-0.5 and layer.qk_norm is None for layer in layers)
    assert {repr(layer.score_mod) for layer in layers} == {f"softcap({ATTN_CAP})"}
    assert (model.config.attn_softcap, model.config.final_softcap) == (ATTN_CAP, FINAL_CAP)
    assert model.lm_head.weight is model.embed.weight  # tied


def test_the_weights_are_the_files_each_in_its_place(tiny: Path) -> None:
    """Q/K/V fused by rows in that order, no Q/K permutation, the four sandwich norms as stored, gate before up."""
    model: Any = load_gguf(tiny)
    w = tiny_weights()
    block, p = model.layers[1], "blk.1."
    expected = {"attention.qkv_proj.weight": np.concatenate([w[p + "attn_q.weight"], w[p + "attn_k.weight"],
                                                             w[p + "attn_v.weight"]]),
                "attention.out_proj.weight": w[p + "attn_output.weight"],
                "attention_norm.weight": w[p + "attn_norm.weight"],
                "post_attention_norm.weight": w[p + "post_attention_norm.weight"],
                "mlp_norm.weight": w[p + "ffn_norm.weight"], "post_mlp_norm.weight": w[p + "post_ffw_norm.weight"],
                "mlp.gate_up_proj.weight": np.concatenate([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]]),
                "mlp.down_proj.weight": w[p + "ffn_down.weight"]}
    state = block.state_dict()
    assert sorted(state) == sorted(expected)  # no q/k norm, nothing else
    for name, array in expected.items():
        torch.testing.assert_close(state[name], torch.from_numpy(array), rtol=0, atol=0, msg=name)


def test_transformers_reads_the_tiny_file_as_we_do(hf: Any) -> None:
    assert type(hf).__name__ == "Gemma2ForCausalLM"
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert hf.config.sliding_window == WINDOW and hf.config.head_dim == 16


def test_logits_match_transformers_on_a_left_padded_batch_past_the_window(tiny: Path, hf: Any) -> None:
    model: Any = load_gguf(tiny)
    ids = torch.randint(6, len(TOKENS), (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :8] = 0, 0  # left padding
    assert_padded_logits_match(model, hf, ids, mask)


def test_the_caps_bite_so_the_comparison_sees_them(tiny: Path) -> None:
    """The same weights under Gemma 2's real caps (50, 30) give other logits: a cap read from the wrong key,
    or not applied, fails the comparison above; the logits stay inside [-3, 3] (tanh rounds to 1 in float32)."""
    model: Any = load_gguf(tiny)
    loose = write_tiny_gemma2(tiny.parent / "loose.gguf", caps=(50.0, 30.0))
    assert loose.keys() == tiny_weights().keys()
    ids = torch.randint(6, len(TOKENS), (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        capped, uncapped = model(ids), load_gguf(tiny.parent / "loose.gguf")(ids)
    assert bool((capped.abs() <= FINAL_CAP).all()) and float(uncapped.abs().max()) > FINAL_CAP
    assert float((capped - torch.tanh(uncapped / FINAL_CAP) * FINAL_CAP).abs().max()) > 1e-2  # the scores' cap


def test_cached_decoding_equals_the_full_forward_across_the_window(tiny: Path) -> None:
    """Prefill 3 tokens, then one per step: the local layers' window aligned by position, the cap applied to
    cached scores as to fresh ones (float64, so any difference is a bug, not rounding)."""
    model: Any = load_gguf(tiny).double()
    ids = torch.randint(6, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(0))
    assert_cached_steps_equal_full(model, ids, prefill=3)


def test_sixteen_greedy_tokens_match_transformers_generate(tiny: Path, hf: Any) -> None:
    model: Any = load_gguf(tiny)
    ids = torch.tensor([[2, 40, 41, 270, 280]])
    assert_greedy_tokens_match(model, hf, ids)


def test_generation_samples_from_the_capped_logits(tiny: Path) -> None:
    """The generation loop's step is capped as forward is: the last position's logits agree."""
    model: Any = load_gguf(tiny)
    ids = torch.tensor([[2, 40, 41, 270, 280]])
    with torch.inference_mode():
        stepped = model.step(ids, None, model.new_caches())
    torch.testing.assert_close(stepped, model(ids)[:, -1])


def test_weights_auto_keeps_float32_for_an_unmeasured_architecture(tiny: Path) -> None:
    """Gemma 2 shares Gemma 3's blocks, not the weight forms measured on Gemma 3 270M."""
    assert weight_form(load_gguf(tiny, weights="auto")) == "float32"


@pytest.mark.filterwarnings("ignore:quantize.*keep another form")  # the head: 289 outputs, not int4's tiles
@pytest.mark.parametrize("form", ["float16", "int8", "int4"])
def test_every_weight_form_loads_and_generates(tiny: Path, form: str) -> None:
    from attnkit.modules.quantize import available_forms

    if form not in available_forms():
        pytest.skip(f"{form} needs fbgemm's kernels (x86 CPUs: AVX2 or AVX512), which this PyTorch lacks")
    model = load_gguf(tiny, weights=form)
    ids = torch.tensor([[2, 40, 41, 270, 280, 285]])
    assert weight_form(model) == form
    assert model.generate(ids, max_new_tokens=4, stop_ids=[]).shape == (1, 10)


# --- the config -------------------------------------------------------------------------------------------------


def metadata(**changes: Any) -> dict[str, Any]:
    """Gemma 2 27B's metadata as llama.cpp's converter writes it (no vocabulary: gemma2.vocab_size given)."""
    keys = {"general.architecture": "gemma2", "gemma2.context_length": 8192, "gemma2.embedding_length": 4608,
            "gemma2.block_count": 46, "gemma2.feed_forward_length": 36864, "gemma2.attention.head_count": 32,
            "gemma2.attention.head_count_kv": 16, "gemma2.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma2.attention.key_length": 128, "gemma2.attention.value_length": 128,
            "gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
            "gemma2.attention.sliding_window": 4096, "gemma2.vocab_size": 256000}
    return {key: value for key, value in (keys | changes).items() if value is not None}


def test_the_27b_scales_queries_by_its_query_pre_attn_scalar_of_144_the_others_by_their_head_size() -> None:
    """The file holds no query_pre_attn_scalar: llama.cpp's rule (46 blocks: width / heads = 144) gives it."""
    assert gemma2_config(metadata()).query_scale == 144**-0.5
    assert gemma2_config(metadata(**{"gemma2.block_count": 42})).query_scale == 128**-0.5


def test_keys_the_converter_leaves_out_take_llama_cpps_defaults() -> None:
    config = gemma2_config(metadata(**{"gemma2.attn_logit_softcapping": None, "gemma2.final_logit_softcapping": None,
                                       "gemma2.attention.sliding_window": None}))
    assert (config.attn_softcap, config.final_softcap, config.window, config.rope_base) == (50.0, 30.0, 4096, 1e4)
    assert [config.is_global(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize(("changes", "match"), [
    ({"gemma2.attn_logit_softcapping": 0.0}, r"gemma2.attn_logit_softcapping = 0.0 cannot describe a model"),
    ({"gemma2.final_logit_softcapping": float("inf")}, r"gemma2.final_logit_softcapping = inf cannot describe"),
    ({"gemma2.attention.value_length": 64}, r"key_length = 128 and value_length = 64"),
    ({"gemma2.rope.dimension_count": 64}, r"partial rotary embedding \(gemma2.rope.dimension_count = 64"),
    ({"gemma2.rope.scaling.type": "linear"}, r"gemma2.rope.scaling.type = 'linear' is not supported"),
    ({"gemma2.attention.sliding_window": 9000}, r"sliding_window = 9000 is larger than gemma2.context_length = 8192"),
    ({"gemma2.attention.head_count_kv": 5}, r"head_count = 32 is not a multiple of gemma2.attention.head_count_kv"),
    ({"general.architecture": "gemma3"}, r"architecture 'gemma3' is not Gemma 2"),
])
def test_metadata_that_cannot_describe_gemma2_is_refused_by_key(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemma2_config(metadata(**changes))


def test_the_config_refuses_a_cap_by_field_name() -> None:
    with pytest.raises(ValueError, match=r"Gemma2Config final_softcap=-1.0 cannot cap"):
        Gemma2Config(final_softcap=-1.0)
    with pytest.raises(ValueError, match=r"Gemma2Config window=9000 is larger than context_length=8192"):
        Gemma2Config(window=9000)


@pytest.mark.parametrize(("options", "match"), [
    ({"drop": ("blk.2.post_ffw_norm.weight",)}, r"tensor 'blk.2.post_ffw_norm.weight' is missing"),
    ({"extra": {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}}, r"blk.0.attn_q_norm.weight.*not part of"),
    ({"key_length": 8}, r"tensor 'blk.0.attn_q.weight' has shape \(64, 32\), but the metadata implies \(32, 32\)"),
])
def test_a_file_whose_tensors_are_not_gemma2s_is_refused_by_name(tmp_path: Path, options: dict[str, Any],
                                                                 match: str) -> None:
    """A Gemma 3 file's q/k norms under gemma2, a missing norm, heads of another size than the tensors'."""
    write_tiny_gemma2(tmp_path / "bad.gguf", **options)
    with pytest.raises(ValueError, match=match):
        load_gguf(tmp_path / "bad.gguf")
