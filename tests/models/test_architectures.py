"""The architecture registry, and Mistral: a Llama file with a sliding window, against transformers' Mistral."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._util import need
from tests.models._decoder import (
    CHATML,
    MERGES,
    SPECIALS,
    assert_cached_steps_equal_full,
    assert_greedy_tokens_match,
    assert_padded_logits_match,
    byte_alphabet,
    llama_cpp_permute,
    tiny_weights,
)

need("gguf")
need("tokenizers")

from attnkit.models import LlamaModel, Qwen2Model, load_gguf  # noqa: E402
from attnkit.models.registry import Architecture, lookup, register, registered  # noqa: E402

TOKENS = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
WINDOW = 4


def test_every_architecture_is_registered_by_its_model_file() -> None:
    assert registered() == ("llama", "gemma3", "gemma2", "phi3", "qwen2", "qwen3")
    assert lookup("llama", "x.gguf").model is LlamaModel and lookup("qwen2", "x.gguf").model is Qwen2Model


def test_an_unregistered_architecture_lists_the_registered_ones_and_what_a_registration_needs() -> None:
    with pytest.raises(ValueError, match=r"x.gguf: architecture 'falcon' is not supported \(general.architecture\); "
                                         r"supported: llama, gemma3, gemma2, phi3, qwen2, qwen3; a registration "
                                         r".*needs the architecture's config reader, where each block parameter "
                                         r"lies in the file and its DecoderModel class"):
        lookup("falcon", "x.gguf")
    with pytest.raises(ValueError, match=r"architecture None is not supported"):
        lookup(None, "x.gguf")  # a file without general.architecture


def test_a_second_registration_of_a_name_is_refused() -> None:
    """Registering "llama" again would silently replace the Llama reader for every file."""
    llama = lookup("llama", "x.gguf")
    with pytest.raises(ValueError, match=r"architecture 'llama' is already registered"):
        register(Architecture("llama", config=llama.config, block=llama.block, model=llama.model))
    with pytest.raises(TypeError, match=r"register\(\) takes an Architecture, got dict"):
        register({"name": "phi3"})  # type: ignore[arg-type]
    assert lookup("llama", "x.gguf") is llama


# --- Mistral: general.architecture = "llama" with llama.attention.sliding_window --------------------------------


def write_tiny_mistral(path: Path, window: int | None = WINDOW) -> None:
    """A tiny Llama-architecture file named "mistral" (as llama.cpp converts Mistral), with a sliding window."""
    gguf = need("gguf")
    weights = tiny_weights(vocab=len(TOKENS), seed=3)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny mistral")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if window is not None:
        w.add_sliding_window(window)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    for name, array in weights.items():
        heads = 4 if name.endswith("attn_q.weight") else 2 if name.endswith("attn_k.weight") else None
        w.add_tensor(name, array if heads is None else llama_cpp_permute(array, heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mistral") / "tiny-mistral.gguf"
    write_tiny_mistral(path)
    return path


@pytest.fixture(scope="module")
def hf_mistral(mistral: Path) -> Any:
    """transformers' MistralForCausalLM with the tiny file's weights as transformers' GGUF loader reads them.

    transformers maps a Llama file named exactly "mistral" to Mistral, but then asks gguf-py for a "mistral"
    architecture it does not have (gguf 0.19): the file is read as Llama and its weights (the same names)
    loaded into a Mistral of the same sizes with the window, which transformers does not read from GGUF.
    """
    transformers = need("transformers")
    llama = transformers.AutoModelForCausalLM.from_pretrained(str(mistral.parent), gguf_file=mistral.name,
                                                              dtype=torch.float32)
    config = transformers.MistralConfig(**{**llama.config.to_dict(), "sliding_window": WINDOW},
                                        attn_implementation="eager")
    model = transformers.MistralForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)
    return model


def test_the_window_in_the_file_reaches_every_layer(mistral: Path, hf_mistral: Any) -> None:
    model: Any = load_gguf(mistral)
    assert type(hf_mistral).__name__ == "MistralForCausalLM"
    assert model.config.window == WINDOW and {b.attention.window for b in model.layers} == {WINDOW}


def test_mistral_logits_match_transformers_on_a_left_padded_batch_past_the_window(mistral: Path,
                                                                                   hf_mistral: Any) -> None:
    model: Any = load_gguf(mistral)
    ids = torch.randint(3, len(TOKENS), (3, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :8] = 0, 0  # left padding
    assert_padded_logits_match(model, hf_mistral, ids, mask)


def test_mistral_cached_decoding_equals_the_full_forward_across_the_window(mistral: Path) -> None:
    """A cache that forgets the window (or aligns it by slot, not position) differs after 4 tokens."""
    model: Any = load_gguf(mistral).double()
    ids = torch.randint(3, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(0))
    assert_cached_steps_equal_full(model, ids, prefill=3)


def test_mistral_sixteen_greedy_tokens_match_transformers_generate(mistral: Path, hf_mistral: Any) -> None:
    model: Any = load_gguf(mistral)
    ids = torch.tensor([[5, 40, 41, 200, 100, 7]])
    assert_greedy_tokens_match(model, hf_mistral, ids)


def test_a_window_larger_than_the_context_is_named(tmp_path: Path) -> None:
    write_tiny_mistral(tmp_path / "bad.gguf", window=100)
    with pytest.raises(ValueError, match=r"llama.attention.sliding_window = 100 is larger than "
                                         r"llama.context_length = 64"):
        load_gguf(tmp_path / "bad.gguf")


def test_mistral_tokenizer_gives_transformers_ids_on_hostile_texts(mistral: Path) -> None:
    """The SmolLM2 tests' hostile texts through the Mistral (Llama) file's tokenizer and transformers' GGUF
    tokenizer of the same file."""
    transformers = need("transformers")
    from tests.models.test_tokenizer_reference import TEXTS

    ours = load_gguf(mistral).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(mistral.parent), gguf_file=mistral.name)
    for text in [*TEXTS, "  two  spaces ", "\n\nhello", "a12b 1212"]:
        assert ours.encode(text) == theirs.encode(text), text
