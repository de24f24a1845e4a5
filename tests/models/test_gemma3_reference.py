"""Gemma 3 270M on attnkit against transformers' Gemma3ForCausalLM loaded from the same GGUF file.

transformers dequantises the file itself and runs its own Gemma 3; agreeing
with it in float32 checks the loader (names, fused rows, norm weights), the
blocks (sandwich norms, GeGLU, scaled embeddings, tied head), attnkit's layer
with 256-wide heads, q/k norms, a per-layer rotary base and a 512-token window,
the KV cache across the window's edge, the generation loop and the tokenizer.

transformers' model is loaded once for this module (the slow part: about 40 s
on 2 cores), so is attnkit's, and transformers runs the long prompt once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._util import need, one_gguf_parse

# Five paragraphs of plain prose, 572 tokens with BOS: past the 512-token window of the local layers, so that
# their last 60 queries no longer see the start while the global layers still do.
TEXT = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, gulls argued over the nets, and "
    "the baker on Mill Street opened her shutters to let the smell of bread drift down to the water. Nobody "
    "remembered exactly when the bridge had been built; the oldest stones carried the date 1742, but the "
    "iron railings were newer, painted green every spring by the same family for four generations. Children "
    "crossed it twice a day on their way to school, counting the lamps (there were nineteen) and daring each "
    "other to lean over the parapet where the current ran fastest.\n\n"
    "In the afternoon the library filled with students. They came for the quiet, for the long oak tables and "
    "for the librarian, Mr. Okafor, who could find any book in the building without looking at the catalogue. "
    "He kept a notebook of questions people had asked him: how deep the river was (about six metres at the "
    "bridge), why the church clock ran four minutes slow (a worn gear, replaced in 1998 and still slow), and "
    "whether the town had ever flooded. It had, twice: once in 1872, when the water reached the second step "
    "of the town hall, and again in 1953, when the bakery lost its ovens and baked in the school kitchen for "
    "a month.\n\n"
    "Science teachers liked to bring their classes to the weir. There they measured the speed of the water "
    "with oranges and stopwatches, wrote the numbers on the back of their hands, and argued about whether a "
    "floating orange moves as fast as the river or a little slower. One year a student named Ines built a "
    "small wooden wheel, fixed a magnet to one spoke and counted the pulses with a bicycle computer. Her "
    "measurements showed that the surface flowed about 1.4 metres per second in March and barely half that "
    "in August, and she presented the results at the regional fair in a talk that ended with a joke about "
    "oranges.\n\n"
    "Evenings belonged to music. On Thursdays a brass band rehearsed in the old grain store, and on Saturdays "
    "the cafe by the quay hosted anyone with a guitar and the courage to play. The regulars had their "
    "favourites: a retired postman who sang sea shanties, two sisters who played fiddle tunes faster every "
    "year, and a quiet engineer who performed the same three songs so carefully that the room fell silent "
    "each time.\n\n"
    "When the council proposed a new road along the river, the town argued for a whole year. Some wanted the "
    "traffic out of the narrow streets; others feared for the meadows where herons stood in the shallows. "
    "Maps were drawn, redrawn and pinned to the noticeboard outside the post office. In the end the road was "
    "built further inland, behind the orchards, and the old towpath was resurfaced for walkers and cyclists."
)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Ünïcødé — 42 apples   and 7 pears."]
TOKENIZER_TEXTS = [
    "Ünïcødé — naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽 and a lone \u2028 separator",
    "digits 0 7 42 1234567890 3.14159 -2.5e-3 1,000,000 2026-11-25",
    "def f(x):\n\treturn {'a': [x ** 2, x // 3]}  # code\n\n\nclass A:\n    pass\n",
    "runs of spaces:  two   three    four          ten\n  \n   \t\t tabs and  newlines\n\n\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<bos> a control token in text, </s> an HTML tag",
    "",
]
WINDOW = 512


def need_gemma3() -> Path:
    """The assembled Gemma 3 file (cached by attnkit): skip without its packages locally, fail under CI=true."""
    for module in ("gguf", "tokenizers", "transformers"):
        need(module)
    from attnkit.models.gemma3 import gemma3_path

    try:
        return gemma3_path()
    except ImportError as err:  # a missing package: the message names the five and the command installing them
        if os.environ.get("CI") == "true":
            raise AssertionError(str(err)) from err
        pytest.skip(str(err))


@pytest.fixture(scope="module", autouse=True)
def gguf_parsed_once() -> Iterator[None]:
    """transformers' model and tokenizer read the file's metadata once between them (:func:`one_gguf_parse`)."""
    with one_gguf_parse():
        yield


@pytest.fixture(scope="module")
def path() -> Path:
    return need_gemma3()


@pytest.fixture(scope="module")
def model(path: Path) -> Any:
    """attnkit's Gemma 3 (float32)."""
    from attnkit.models import load_gemma3

    return load_gemma3()


@pytest.fixture(scope="module")
def hf(path: Path) -> Any:
    """transformers' Gemma3ForCausalLM from the same file, loaded once."""
    transformers = need("transformers")
    need("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def long_prompt(model: Any, hf: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """TEXT's ids (1, T) and transformers' logits (1, T, V) for them, computed once."""
    ids = torch.tensor([model.tokenizer.encode(TEXT)])  # (1, T)
    with torch.inference_mode():
        return ids, hf(input_ids=ids).logits


def test_logits_match_transformers_past_the_window(model: Any, long_prompt: tuple[torch.Tensor, torch.Tensor]
                                                    ) -> None:
    """A window off by one, or the wrong layers local (or all global), changes the logits past token 512."""
    ids, theirs = long_prompt
    assert ids.shape[1] > WINDOW + 50
    with torch.inference_mode():
        ours = model(ids)  # (1, T, V)
    assert ours.shape == theirs.shape
    for start in range(0, ids.shape[1], 128):  # 128 positions at a time: each comparison's temporaries 134 MB
        torch.testing.assert_close(ours[:, start : start + 128], theirs[:, start : start + 128], atol=1e-4,
                                   rtol=1e-4, msg=lambda m, start=start: f"positions from {start}: {m}")


def test_the_prompt_is_long_enough_for_the_window_to_matter(model: Any, long_prompt: Any) -> None:
    """The test above would pass with the window ignored if the prompt were short: here ignoring it fails."""
    ids, theirs = long_prompt
    local = [block.attention for block in model.layers if block.attention.window is not None]
    assert len(local) == 15 and all(layer.window == WINDOW for layer in local)
    try:
        for layer in local:
            layer.window = None
        with torch.inference_mode():
            unwindowed = model.step(ids, None, model.new_caches())  # (1, V): the last position only
    finally:
        for layer in local:
            layer.window = WINDOW
    assert (unwindowed - theirs[:, -1]).abs().max() > 1e-2


def test_cached_decoding_across_the_window_edge_matches_transformers(model: Any, long_prompt: Any) -> None:
    """Prefill to just before position 512, then one token per step to past it: a cache that keeps (or drops)
    the wrong keys for a local layer shows as soon as the window starts to slide."""
    ids, theirs = long_prompt
    start, stop = WINDOW - 6, WINDOW + 10
    caches = model.new_caches()
    with torch.inference_mode():
        first = model.step(ids[:, :start], None, caches)  # (1, V): the prefill's last position only
        steps = [model(ids[:, t : t + 1], kv_caches=caches)[:, 0] for t in range(start, stop)]  # (1, V) each
    torch.testing.assert_close(first, theirs[:, start - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(steps, dim=1), theirs[:, start:stop], atol=1e-4, rtol=1e-4)
    assert len(caches[0]) == stop


def test_logits_match_transformers_on_a_left_padded_batch(model: Any, hf: Any) -> None:
    batch = model.tokenize(PROMPTS)
    mask = batch["attention_mask"].bool()
    assert not mask.all()  # the rows really are padded
    with torch.inference_mode():
        ours = model(batch["input_ids"], batch["attention_mask"])
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-4, rtol=1e-4)


def test_32_greedy_tokens_match_transformers_generate(model: Any, hf: Any) -> None:
    """And they continue the issue's example as transformers (and llama.cpp) do."""
    ids = torch.tensor([model.tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                             do_sample=False, pad_token_id=0)
    ours = model.generate(ids, max_new_tokens=32, stop_ids=[])
    assert ours.shape == (1, ids.shape[1] + 32)
    assert ours.tolist() == theirs.tolist()
    assert model.decode(ours[0, ids.shape[1] :]).startswith(" the capital of the country of France. It is the")


@pytest.fixture(scope="module")
def hf_tokenizer(path: Path) -> tuple[Any, dict[str, Any]]:
    """transformers' GGUF tokenizer for the file: the reading and converting ``AutoTokenizer.from_pretrained(...,
    gguf_file=...)`` runs, without its Python wrapper (20 s more here); and its tokenizer config."""
    need("transformers")
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer)
    return backend, config


@pytest.mark.parametrize("text", [*TOKENIZER_TEXTS, TEXT], ids=[*map(str, range(len(TOKENIZER_TEXTS))), "prose"])
def test_token_ids_match_transformers(model: Any, hf_tokenizer: tuple[Any, dict[str, Any]], text: str) -> None:
    """Spaces respelled, merges ordered, bytes as fallback, control tokens whole: each shows in one of these."""
    backend, config = hf_tokenizer
    assert config["add_bos_token"] is True and config["bos_token"] == "<bos>"  # transformers adds BOS: so do we
    expected = [2, *backend.encode(text, add_special_tokens=False).ids]
    assert model.tokenizer.encode(text) == expected


@pytest.mark.parametrize("text", [*TOKENIZER_TEXTS[:4], TEXT])
def test_decode_round_trips_text(model: Any, text: str) -> None:
    ids = model.tokenizer.encode(text)
    assert ids[0] == model.tokenizer.bos_id == 2
    assert model.decode(ids) == text
