"""The generation loop on a tiny random Llama (fast, float64-exact) and on SmolLM2 (real weights).

Bugs these catch: a cache step that sees the wrong positions (rotary offset,
mask alignment), left padding that changes a row's result, sampling that
ignores the seed or its filters, stop ids that do not stop or do not pad,
and bad inputs that slip through.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._util import need
from tests.models._decoder import smollm2, write_tiny_llama

need("gguf")
need("tokenizers")

import attnkit  # noqa: E402
from attnkit.models import GenerationStats, load_gguf  # noqa: E402
from attnkit.models.sampling import Sampler  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "tiny.gguf"
    write_tiny_llama(path, context=64)
    return path


@pytest.fixture(scope="module")
def tiny64(tiny_path: Path) -> Any:
    return load_gguf(tiny_path, dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny32(tiny_path: Path) -> Any:
    return load_gguf(tiny_path)


def _cached_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor | None, prefill: int) -> torch.Tensor:
    """Logits from a prefill of ``prefill`` tokens, then one token per step through the caches."""
    caches = model.new_caches()
    out = [model(ids[:, :prefill], None if mask is None else mask[:, :prefill], kv_caches=caches)]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], None if mask is None else mask[:, : t + 1], kv_caches=caches))
    return torch.cat(out, dim=1)  # (B, T, V)


@pytest.mark.parametrize("prefill", [1, 3, 9])
def test_cached_steps_equal_full_forward_float64(tiny64: Any, prefill: int) -> None:
    """Every cached step equals the full forward to 1e-9 (float64), padded rows included."""
    g = torch.Generator().manual_seed(prefill)
    ids = torch.randint(3, tiny64.vocab_size, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row
    with torch.no_grad():
        full = tiny64(ids, mask)
        cached = _cached_logits(tiny64, ids, mask, prefill)
    torch.testing.assert_close(cached[mask], full[mask], atol=1e-9, rtol=1e-9)


def test_cached_steps_equal_full_forward_float32_smollm2() -> None:
    model = smollm2()
    ids = model.tokenize("The quick brown fox jumps over the lazy dog because")["input_ids"]
    with torch.inference_mode():
        full = model(ids)
        cached = _cached_logits(model, ids, None, 4)
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)


def test_left_padded_batch_equals_each_row_alone_tiny(tiny64: Any) -> None:
    """Padding shifts a row's rotary positions; relative positions, hence results, must not change."""
    texts = ["the sin", "a", "the the a sin in"]
    batch = tiny64.tokenize(texts)
    together = tiny64.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, stop_ids=[])
    width = batch["input_ids"].shape[1]
    for row, text in enumerate(texts):
        alone = tiny64.generate(tiny64.tokenize(text)["input_ids"], max_new_tokens=6, stop_ids=[])
        n = alone.shape[1]
        assert together[row, width:].tolist() == alone[0, n - 6 :].tolist()
    with torch.no_grad():
        logits = tiny64(batch["input_ids"], batch["attention_mask"])
        alone_logits = tiny64(tiny64.tokenize(texts[1])["input_ids"])
    torch.testing.assert_close(logits[1, -1], alone_logits[0, -1], atol=1e-9, rtol=1e-9)


def test_left_padded_batch_equals_each_row_alone_smollm2() -> None:
    model = smollm2()
    texts = ["The capital of France is", "One, two, three, four,", "def fibonacci(n):"]
    batch = model.tokenize(texts)
    together = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=8, stop_ids=[])
    width = batch["input_ids"].shape[1]
    for row, text in enumerate(texts):
        ids = model.tokenize(text)["input_ids"]
        alone = model.generate(ids, max_new_tokens=8, stop_ids=[])
        assert together[row, width:].tolist() == alone[0, ids.shape[1] :].tolist(), text
        with torch.inference_mode():
            padded = model(batch["input_ids"][row : row + 1], batch["attention_mask"][row : row + 1])[0, -1]
            single = model(ids)[0, -1]
        torch.testing.assert_close(padded, single, atol=1e-4, rtol=1e-4)


def test_stats_of_a_batch_count_real_prompt_tokens_and_every_rows_new_tokens(tiny32: Any) -> None:
    """A batch's prompt_tokens counted its left padding and new_tokens its steps (one row's tokens)."""
    batch = tiny32.tokenize(["the sin", "a much longer prompt than the first one"])
    free = tiny32.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, stop_ids=[])
    width = batch["input_ids"].shape[1]
    stop = int(free[0, width + 1])  # row 0 stops by its second new token
    stats = GenerationStats()
    out = tiny32.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, stop_ids=[stop], stats=stats)
    new = out[:, width:]
    per_row = [int((row == stop).nonzero()[0]) + 1 if bool((row == stop).any()) else new.shape[1] for row in new]
    assert per_row[0] <= 2 < new.shape[1]  # the pad ids after row 0's stop are not new tokens
    assert (stats.prompt_tokens, stats.new_tokens) == (int(batch["attention_mask"].sum()), sum(per_row))
    assert (stats.steps, stats.rows) == (new.shape[1], 2)
    assert stats.decode_tokens_per_s == (sum(per_row) - 2) / stats.decode_seconds


def test_generate_returns_prompt_then_new_tokens_and_fills_stats(tiny32: Any) -> None:
    ids = tiny32.tokenize("the sin")["input_ids"]
    stats = GenerationStats()
    out = tiny32.generate(ids, max_new_tokens=5, stop_ids=[], stats=stats)
    assert out.shape == (1, ids.shape[1] + 5) and out.dtype == torch.long
    assert torch.equal(out[:, : ids.shape[1]], ids)
    assert (stats.prompt_tokens, stats.new_tokens) == (ids.shape[1], 5)
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    with torch.no_grad():  # greedy: each new token is the argmax of the full forward over what precedes it
        logits = tiny32(out[:, :-1])
    assert torch.equal(logits[0, ids.shape[1] - 1 :].argmax(-1), out[0, ids.shape[1] :])


def test_stop_ids_end_a_row_and_pad_it(tiny32: Any) -> None:
    """A row that emits a stop id keeps it, then only pad ids; the batch ends when all rows stopped."""
    batch = tiny32.tokenize(["the sin", "a"])
    free = tiny32.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=8, stop_ids=[])
    width = batch["input_ids"].shape[1]
    rows = [free[r, width:].tolist() for r in range(2)]
    stops = [rows[0][2], rows[1][1]]  # a token of each row's answer ends it (or an earlier stop id does)
    ends = [min(row.index(s) for s in stops if s in row) for row in rows]  # where each row stops
    out = tiny32.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=8, stop_ids=stops)
    assert out.shape[1] == width + max(ends) + 1  # the batch ended as soon as every row had stopped
    for r in range(2):
        new = out[r, width:].tolist()
        assert new[: ends[r] + 1] == rows[r][: ends[r] + 1]  # unchanged up to and with its stop id
        assert all(t == tiny32.pad_token_id for t in new[ends[r] + 1 :])  # then only padding


def test_default_stop_ids_are_end_of_turn_tokens(tiny32: Any) -> None:
    assert set(tiny32.stop_token_ids) == {0, 2}  # <|endoftext|>, <|im_end|>


def test_sampling_is_reproducible_with_a_seed(tiny32: Any) -> None:
    ids = tiny32.tokenize("the")["input_ids"]
    runs = [tiny32.generate(ids, max_new_tokens=10, temperature=100.0, seed=s, stop_ids=[]) for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])  # another seed, other tokens (10 nearly uniform draws)


@pytest.mark.parametrize("options", [{"top_k": 1}, {"top_p": 1e-6}])
def test_top_k_1_and_tiny_top_p_are_greedy(tiny32: Any, options: dict[str, Any]) -> None:
    ids = tiny32.tokenize("the sin")["input_ids"]
    greedy = tiny32.generate(ids, max_new_tokens=8, stop_ids=[])
    sampled = tiny32.generate(ids, max_new_tokens=8, temperature=5.0, seed=0, stop_ids=[], **options)
    assert torch.equal(sampled, greedy)


def _draws(sampler: Sampler, logits: torch.Tensor, n: int = 300) -> set[int]:
    """The tokens ``sampler`` picks for one row of logits over n steps of one seed."""
    steps = torch.arange(n)
    return set(sampler(logits.expand(n, -1), torch.zeros(n, dtype=torch.long), steps).tolist())


def test_sampler_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert _draws(Sampler(1.0, None, 0.75), probs.log()) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_sampler_top_k_keeps_k_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0, 2.7]])
    assert _draws(Sampler(1.0, 3, None), logits) == {0, 1, 2}


def test_sampler_frequencies_match_the_distribution() -> None:
    """Inverse-CDF sampling from hashed uniforms: a biased or off-by-one search would shift these."""
    probs = torch.tensor([0.0, 0.1, 0.2, 0.0, 0.7], dtype=torch.float64)
    n = 20000
    ids = Sampler(1.0)(probs.log().expand(n, -1), torch.full((n,), 5), torch.arange(n))
    freq = torch.bincount(ids, minlength=5).double() / n
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    assert freq[0] == 0 and freq[3] == 0  # a zero-probability token is never drawn


def test_uniforms_are_uniform_and_differ_by_seed_and_step() -> None:
    from attnkit.models.sampling import uniform

    u = uniform(torch.full((50000,), 123), torch.arange(50000))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    torch.testing.assert_close(torch.histc(u.float(), 10, 0, 1) / 50000, torch.full((10,), 0.1), atol=0.01, rtol=0)
    by_seed = uniform(torch.arange(50000), torch.zeros(50000, dtype=torch.long))
    assert by_seed.unique().numel() == 50000


def test_a_seeded_row_samples_the_same_alone_or_in_any_batch(tiny64: Any) -> None:
    """The batch shared one torch.Generator: a row's tokens depended on which rows came before it.

    float64, so that batched and single-row logits agree to ~1e-15 and no sample sits on a rounding boundary.
    """
    texts = ["the sin", "a", "the the a sin in"]
    batch = tiny64.tokenize(texts)
    width = batch["input_ids"].shape[1]
    options = dict(max_new_tokens=8, temperature=3.0, stop_ids=[])
    together = tiny64.generate(batch["input_ids"], batch["attention_mask"], seed=[11, 12, 13], **options)
    reordered = tiny64.generate(batch["input_ids"].flip(0), batch["attention_mask"].flip(0), seed=[13, 12, 11],
                                **options)
    assert torch.equal(together[:, width:], reordered[:, width:].flip(0))
    for row, text in enumerate(texts):
        ids = tiny64.tokenize(text)["input_ids"]
        alone = tiny64.generate(ids, seed=11 + row, **options)
        assert together[row, width:].tolist() == alone[0, ids.shape[1]:].tolist(), text
    # an int seed s gives row r the seed s + r
    assert torch.equal(tiny64.generate(batch["input_ids"], batch["attention_mask"], seed=11, **options), together)


@pytest.mark.parametrize("seed", [-1, 2**62, [1, 2], "3", 1.5])
def test_bad_seeds_are_named(tiny32: Any, seed: Any) -> None:
    ids = tiny32.tokenize("the")["input_ids"]
    with pytest.raises(ValueError, match="seed must be"):
        tiny32.generate(ids, max_new_tokens=1, temperature=1.0, seed=seed)


def test_stream_decodes_a_window_not_the_whole_answer_each_token(tiny32: Any) -> None:
    """Streaming decoded every id again at every token: quadratic in the answer's length."""
    from attnkit.models.text import TextStream

    ids = tiny32.tokenize("the sin a in " * 5)["input_ids"][0]
    decoded = []

    def decode(window: list[int]) -> str:
        decoded.append(len(window))
        return tiny32.decode(window)

    text = TextStream(decode)
    pieces = [text.add(int(t)) for t in ids] + [text.flush()]
    assert "".join(pieces) == tiny32.decode(ids)
    assert max(decoded) <= 4 and sum(decoded) <= 6 * len(ids)


def test_stream_yields_the_generated_text(tiny32: Any) -> None:
    ids = tiny32.tokenize("the")["input_ids"]
    out = tiny32.generate(ids, max_new_tokens=10, stop_ids=[])
    pieces = list(tiny32.stream(ids, max_new_tokens=10, stop_ids=[]))
    assert len(pieces) > 1
    assert "".join(pieces) == tiny32.decode(out[0, ids.shape[1] :])


def test_stream_holds_back_incomplete_utf8(tiny32: Any) -> None:
    """Bytes of one character arrive as separate tokens: no piece may show a replacement character."""
    from attnkit.models.text import TextStream

    ids = tiny32.tokenize("é€")["input_ids"][0]  # 2 + 3 bytes, one token each
    text = TextStream(tiny32.decode)
    pieces = [p for p in [text.add(int(t)) for t in ids] + [text.flush()] if p]
    assert pieces == ["é", "€"]


@pytest.mark.parametrize("text", [b"\x80" * 10 + b"a", b"\x80\x80\x80" + "\u00e9a".encode(),
                                  b"x\x80\x80\x80" + "\u20aca".encode(), b"\x80" * 5 + "\U0001f600".encode()])
def test_stream_shows_undecodable_bytes_by_the_fourth_token_and_every_character_after(text: bytes) -> None:
    """Bug: a run of stray continuation bytes (no character: a UTF-8 character has at most 4 bytes) was held back
    as long as it lasted, decoded again at every token and shown only at the end; a first bound then dropped a
    character that began as the run's fourth token. Every piece joined is the decoded text, and the run shows
    by its fourth token."""
    from attnkit.models.text import TextStream

    def decode(ids: list[int]) -> str:  # one token per byte
        return bytes(ids).decode("utf-8", errors="replace")

    ids = list(text)
    stream = TextStream(decode)
    pieces = [stream.add(t) for t in ids]
    assert "".join([*pieces, stream.flush()]) == decode(ids)  # no character lost, each whole
    run = ids.index(0x80)
    assert "\ufffd" in "".join(pieces[: run + 4])  # shown by the run's fourth token, not held to the end


def test_stream_ends_at_a_stop_string_and_never_shows_it(tiny32: Any) -> None:
    """A stop string that spans tokens ends the text where it starts; nothing of it or after it is shown."""
    ids = tiny32.tokenize("the")["input_ids"]
    full = "".join(tiny32.stream(ids, max_new_tokens=12, stop_ids=[]))
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # three characters from the middle, across tokens
    pieces = list(tiny32.stream(ids, max_new_tokens=12, stop_ids=[], stop=[stop]))
    assert "".join(pieces) == full[: full.find(stop)]


def test_generate_refuses_stop_strings_it_cannot_see(tiny32: Any) -> None:
    """generate() returns ids: a stop string would be silently ignored."""
    ids = tiny32.tokenize("the")["input_ids"]
    with pytest.raises(ValueError, match=r"stop=.*returns token ids"):
        tiny32.generate(ids, max_new_tokens=4, stop=["x"])


BAD = [
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=2, temperature=-0.5), "temperature=-0.5"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p=0.0"),
    (dict(max_new_tokens=2, top_p=1.5), "top_p=1.5"),
    (dict(max_new_tokens=2, top_k=0), "top_k=0"),
    (dict(max_new_tokens=2, stop_ids=[10**6]), "stop id 1000000"),
    (dict(max_new_tokens=2, stop_ids=2), r"stop_ids must be a list of token ids .* got stop_ids=2"),
    (dict(max_new_tokens=61), "exceeds the model.s context length \\(64 positions\\); ask for at most 60"),
]


@pytest.mark.parametrize(("options", "message"), BAD)
def test_bad_options_are_named(tiny32: Any, options: dict[str, Any], message: str) -> None:
    ids = tiny32.tokenize("the sin")["input_ids"]
    with pytest.raises(ValueError, match=message):
        tiny32.generate(ids, **options)


@pytest.mark.parametrize(("ids", "mask", "message"), [
    (torch.zeros(1, 0, dtype=torch.long), None, "empty"),
    (torch.tensor([[5, 265]]), None, "token id 265, outside the vocabulary"),
    (torch.tensor([[5, -1]]), None, "token id -1"),
    (torch.tensor([[5.0, 6.0]]), None, "torch.long"),
    (torch.ones(1, 70, dtype=torch.long), None, "more than the model's context length \\(64 positions\\)"),
    (torch.tensor([[5, 6]]), torch.ones(1, 3), "shape of input_ids"),
    (torch.tensor([[5, 6]]), torch.ones(1, 2), "dtype torch.float32"),
    (torch.tensor([[5, 6]]), torch.tensor([[1, 0]]), "left-padded"),
    (torch.tensor([[5, 6]]), torch.tensor([[0, 0]]), "no real token"),
    (torch.tensor([[5, 6]]), torch.tensor([[2, 1]]), "only 0 and 1, got 2 at"),
    (torch.tensor([[5, 6]]), torch.tensor([[-1, 1]]), "only 0 and 1, got -1 at"),
])
def test_bad_prompts_are_named(tiny32: Any, ids: torch.Tensor, mask: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny32.generate(ids, mask, max_new_tokens=1)


def test_forward_checks_inputs(tiny32: Any) -> None:
    with pytest.raises(ValueError, match=r"\(B, S\) = \(1, 3\)"):
        tiny32(torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.long), kv_caches=_filled(tiny32, 2))
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        tiny32(torch.tensor([[5, 6]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"only 0 and 1, got -1 at \(0, 0\)"):
        tiny32(torch.tensor([[5, 6]]), torch.tensor([[-1, 1]]))
    with pytest.raises(ValueError, match=r"only 0 and 1, got 2 at \(0, 1\)"):
        tiny32(torch.tensor([[5, 6]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"list of 2 caches"):
        tiny32(torch.tensor([[5]]), kv_caches=[])
    with pytest.raises(TypeError, match=r"kv_caches\[1\] must implement the cache protocol.*lacks next_positions"):
        tiny32(torch.tensor([[5]]), kv_caches=[attnkit.KVCache(), object()])
    with pytest.raises(ValueError, match="position 64 is beyond the model's context length 64"):
        tiny32(torch.tensor([[5]]), positions=torch.tensor([[64]]))
    with pytest.raises(ValueError, match="exceed the model's context length 64"):
        tiny32(torch.ones(1, 65, dtype=torch.long))


def _filled(model: Any, n: int) -> list[Any]:
    caches = model.new_caches()
    with torch.no_grad():
        model(torch.full((1, n), 5), kv_caches=caches)
    return caches


def test_stream_takes_one_prompt(tiny32: Any) -> None:
    with pytest.raises(ValueError, match="batch of 2"):
        tiny32.stream(torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)


def test_an_interrupted_forward_leaves_every_cache_as_it_was() -> None:
    """Review finding: an exception in layer 1 left the caches at [5, 5, 0] and the prompt lost."""
    from attnkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=32, d_model=16, num_layers=3, num_heads=2, num_kv_heads=1,
                                   ffn_size=32, context_length=64)).eval()
    ids = torch.randint(0, 32, (1, 5))
    caches = model.new_caches()
    model(ids[:, :2], kv_caches=caches)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    handle = model.layers[1].mlp.register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 2:], kv_caches=caches)
    finally:
        handle.remove()
    assert [len(c) for c in caches] == [2, 2, 2]
    torch.testing.assert_close(model(ids[:, 2:], kv_caches=caches), model(ids)[:, 2:])


def test_a_tiny_temperature_samples_the_greedy_token_and_infinity_is_refused(tiny32: Any) -> None:
    """1e-40 overflowed logits / temperature to inf and softmax to NaN (a RuntimeError from multinomial)."""
    ids = tiny32.tokenize("the")["input_ids"]
    greedy = tiny32.generate(ids, max_new_tokens=4, stop_ids=[])
    torch.testing.assert_close(tiny32.generate(ids, max_new_tokens=4, temperature=1e-40, seed=0, stop_ids=[]), greedy)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        tiny32.generate(ids, max_new_tokens=1, temperature=float("inf"))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_the_compiled_decode_step_equals_the_eager_one(tiny64: Any) -> None:
    """generate(compile=True): one fullgraph graph per step over static caches, the same tokens as eager, here
    sampled over a bfloat16 cache, a left-padded batch (greedy: the next test, at nine cache sizes). One graph
    costs half a minute to a minute of compiling on 2 cores."""
    batch = tiny64.tokenize(["the sin", "a", "the the a sin in"])
    float32 = copy.deepcopy(tiny64).float()  # a bfloat16 cache stores a float32 model's keys
    options = dict(kv_dtype="bfloat16", temperature=2.0, top_k=20, seed=[4, 5, 6])
    eager = float32.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, stop_ids=[], **options)
    compiled = float32.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, stop_ids=[],
                                compile=True, **options)
    assert torch.equal(compiled, eager)


@pytest.mark.slow
@pytest.mark.usefixtures("uncached_compile")
def test_the_compiled_step_compiles_one_graph_for_every_cache_size(tiny64: Any) -> None:
    """Nine cache sizes (a chat's nine turns), one graph: the first step found its static caches unclaimed and
    compiled a second graph for every later step, each capacity was a graph of its own (a range() in the band
    check fixed the key count), and dynamo's limit of 8 per function made the fifth call a hard error."""
    from torch._dynamo.utils import counters

    ids = tiny64.tokenize("the sin")["input_ids"]
    before = counters["stats"]["unique_graphs"]
    for n in range(2, 11):
        eager = tiny64.generate(ids, max_new_tokens=n, stop_ids=[])
        assert torch.equal(tiny64.generate(ids, max_new_tokens=n, stop_ids=[], compile=True), eager), n
    assert counters["stats"]["unique_graphs"] - before == 1


def test_the_decode_step_compiles_without_graph_breaks(tiny64: Any) -> None:
    """A host sync (bool(done.all()), .item(), a Python branch on a tensor) inside the step breaks the graph."""
    from attnkit.models.generation import DecodeState, decode_step
    from attnkit.models.sampling import Sampler

    caches = tiny64.new_caches(16, static=True)
    ids = tiny64.tokenize("the sin")["input_ids"]
    with torch.inference_mode():
        tiny64.step(ids, torch.arange(ids.shape[1])[None], caches)
        zeros = torch.zeros(1, dtype=torch.long)
        state = DecodeState(ids[:, -1], torch.tensor([ids.shape[1]]), zeros.bool(), zeros)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(decode_step)(tiny64, caches, state, Sampler(1.0), zeros,
                                                        torch.tensor([0]))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_a_model_whose_new_caches_predates_the_dtype_keyword_still_generates(tiny64: Any) -> None:
    """new_caches(capacity, static=...) without dtype: generate passes dtype only when kv_dtype is asked for."""

    class Older:
        def __init__(self, model: Any) -> None:
            self.model = model
            self.vocab_size, self.context_length = model.vocab_size, model.context_length
            self.pad_token_id, self.stop_token_ids = model.pad_token_id, model.stop_token_ids

        def new_caches(self, capacity: int | None = None, *, static: bool = False) -> list[Any]:
            return self.model.new_caches(capacity, static=static)

        def step(self, input_ids: torch.Tensor, positions: Any, kv_caches: Any) -> torch.Tensor:
            return self.model.step(input_ids, positions, kv_caches)

    from attnkit.models.generation import generate

    ids = tiny64.tokenize("the sin")["input_ids"]
    for compiled in (False, True):
        out = generate(Older(tiny64), ids, max_new_tokens=4, stop_ids=[], compile=compiled)
        assert torch.equal(out, tiny64.generate(ids, max_new_tokens=4, stop_ids=[])), compiled


def test_a_narrower_cache_under_a_model_that_is_not_float32_is_refused_naming_dtype(tiny64: Any) -> None:
    ids = tiny64.tokenize("the sin")["input_ids"]
    model = copy.deepcopy(tiny64).double()
    with pytest.raises(ValueError, match=r"dtype=torch\.bfloat16 stores a float32 layer's keys in fewer bytes, got "
                                         r"torch\.float64 keys"):
        model.generate(ids, max_new_tokens=2, kv_dtype="bfloat16")


def test_a_stream_keeps_the_space_a_sentencepiece_decoder_drops_at_a_text_s_start() -> None:
    """Bug: " Paris" after a prompt ending in "is" streamed as "Paris" (the decoder strips a text's first space)."""
    from attnkit.models.text import TextStream

    pieces = {1: "\u2581is", 2: "\u2581Paris", 3: "!"}

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).replace("\u2581", " ").removeprefix(" ")

    alone, after = TextStream(decode), TextStream(decode, context=[1])
    assert [alone.add(2), alone.add(3)] == ["Paris", "!"]  # no prompt before it: nothing to keep
    assert [after.add(2), after.add(3)] == [" Paris", "!"]


# Kept caches: a conversation's next prompt prefills only its new tokens.

def _continued(model: Any, first: torch.Tensor, more: list[int]) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """Generate after ``first``, then after its output plus ``more``, over one KeptCaches: both outputs, the
    kept caches and the second run's stats."""
    from attnkit.models.generation import KeptCaches

    kept, stats = KeptCaches(), GenerationStats()
    out = model.generate(first, max_new_tokens=5, stop_ids=[], kept=kept)
    second = torch.cat([out, torch.tensor([more])], dim=1)  # (1, T + 5 + len(more))
    return out, model.generate(second, max_new_tokens=5, stop_ids=[], kept=kept, stats=stats), kept, stats


def test_kept_caches_prefill_only_the_new_tokens_and_answer_as_a_fresh_run_float64(tiny64: Any) -> None:
    """Bug: each chat turn recomputed the whole conversation; continuing must give the fresh run's answer."""
    first = tiny64.tokenize("the sin")["input_ids"]
    out, again, kept, stats = _continued(tiny64, first, [7, 8, 9])
    second = again[:, : out.shape[1] + 3]
    assert torch.equal(again, tiny64.generate(second, max_new_tokens=5, stop_ids=[]))
    assert stats.prompt_tokens == 1 + 3  # the first run's last token (never fed back) and the three added
    assert torch.equal(kept.ids, again[:, :-1]) and kept.length == again.shape[1] - 1  # the last one is not fed
    with torch.inference_mode():  # the continued caches hold what a full forward computes
        logits = tiny64(again[:, :-1])[0, second.shape[1] - 1 :]
    assert torch.equal(logits.argmax(-1), again[0, second.shape[1] :])


def test_kept_caches_under_quantized_weights_and_an_int8_cache_answer_as_a_fresh_run(tiny_path: Path) -> None:
    """The chat's default form (int4 / int8 weights) and --kv-dtype int8: greedy answers equal a fresh run."""
    model = load_gguf(tiny_path, weights="auto")
    first = model.tokenize("the sin")["input_ids"]
    for kv_dtype in (None, "int8"):
        from attnkit.models.generation import KeptCaches

        kept = KeptCaches()
        out = model.generate(first, max_new_tokens=4, stop_ids=[], kept=kept, kv_dtype=kv_dtype)
        second = torch.cat([out, model.tokenize(" a")["input_ids"]], dim=1)
        again = model.generate(second, max_new_tokens=4, stop_ids=[], kept=kept, kv_dtype=kv_dtype)
        assert torch.equal(again, model.generate(second, max_new_tokens=4, stop_ids=[], kv_dtype=kv_dtype)), kv_dtype


def test_kept_caches_refuse_a_prompt_that_does_not_continue_them(tiny32: Any) -> None:
    """Continuing caches with another history, batch size or position count would answer something else."""
    first = tiny32.tokenize("the sin")["input_ids"]
    _, _, kept, _ = _continued(tiny32, first, [7])
    held = kept.ids
    with pytest.raises(ValueError, match=rf"does not continue the {kept.length} tokens the kept caches hold"):
        tiny32.generate(torch.cat([held[:, 1:], held[:, :2]], dim=1), max_new_tokens=2, kept=kept)
    with pytest.raises(ValueError, match=rf"does not continue the {kept.length} tokens"):
        tiny32.generate(held, max_new_tokens=2, kept=kept)  # no new token to prefill
    with pytest.raises(ValueError, match=r"the kept caches hold 1 rows and input_ids has 2"):
        tiny32.generate(torch.cat([held, held]), max_new_tokens=2, kept=kept)
    assert torch.equal(kept.ids, held)  # a refused run changes nothing
    kept.caches[0].crop(kept.length - 1)
    with pytest.raises(ValueError, match=r"hold a different number of positions"):
        tiny32.generate(torch.cat([held, held[:, :1]], dim=1), max_new_tokens=2, kept=kept)


@pytest.mark.parametrize(("options", "message"), [
    (dict(compile=True), "compile=True runs over static caches"),
    (dict(cache="sink:4,8,8"), "cache='sink:4,8,8' evicts positions"),
    (dict(kv_dtype="bfloat16"), r"kept caches store the model's dtype and this run asks for kv_dtype=torch\.bfloat16"),
])
def test_kept_caches_refuse_options_they_cannot_continue_under(tiny32: Any, options: dict[str, Any],
                                                               message: str) -> None:
    from attnkit.models.generation import KeptCaches

    kept = KeptCaches()
    out = tiny32.generate(tiny32.tokenize("the sin")["input_ids"], max_new_tokens=2, stop_ids=[], kept=kept)
    with pytest.raises(ValueError, match=message):
        tiny32.generate(torch.cat([out, out], dim=1), max_new_tokens=2, kept=kept, **options)
    batch = tiny32.tokenize(["the sin", "a"])
    with pytest.raises(ValueError, match="prompts without padding"):
        tiny32.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=2, kept=KeptCaches())


def test_kept_caches_refuse_caches_with_eviction(tiny32: Any) -> None:
    """Bug: kept caches are cropped to what every layer holds after a run, and a crop cannot undo an eviction:
    sink caches given as kept caches ran silently. Refused before the first token, naming the eviction."""
    from attnkit.models.generation import KeptCaches
    from attnkit.models.sink_caches import sink_caches

    kept = KeptCaches(caches=sink_caches(tiny32, sinks=2, window=8, chunk=4))
    with pytest.raises(ValueError, match=r"a cache with eviction=SinkWindow\(sinks=2, window=8, chunk=4\) cannot be "
                                         r"\(an eviction cannot be undone\)"):
        tiny32.generate(tiny32.tokenize("the sin")["input_ids"], max_new_tokens=2, kept=kept)
    assert kept.ids is None and all(len(cache) == 0 for cache in kept.caches)


def test_kept_caches_note_what_they_hold_when_a_run_stops_early(tiny32: Any) -> None:
    """An answer stopped after three tokens (a closed stream, Ctrl-C) leaves the prompt and two fed tokens."""
    from attnkit.models.generation import KeptCaches, generate_steps

    kept, ids = KeptCaches(), tiny32.tokenize("the sin")["input_ids"]
    steps = generate_steps(tiny32, ids, max_new_tokens=8, stop_ids=[], kept=kept)
    tokens = [int(next(steps)[0]) for _ in range(3)]
    steps.close()
    assert kept.ids.tolist() == [ids[0].tolist() + tokens[:2]]
    assert all(len(cache) == kept.length for cache in kept.caches)
    go_on = torch.tensor([kept.ids[0].tolist() + tokens[2:] + [7]])
    assert torch.equal(tiny32.generate(go_on, max_new_tokens=3, kept=kept, stop_ids=[]),
                       tiny32.generate(go_on, max_new_tokens=3, stop_ids=[]))


def test_a_stream_over_kept_caches_ends_at_its_stop_string_with_the_caches_noted(tiny32: Any) -> None:
    from attnkit.models.generation import KeptCaches, stream_text

    ids = tiny32.tokenize("the sin")["input_ids"]
    free = "".join(stream_text(tiny32, tiny32.decode, ids, max_new_tokens=8, stop_ids=[]))
    kept = KeptCaches()
    cut = "".join(stream_text(tiny32, tiny32.decode, ids, max_new_tokens=8, stop_ids=[], stop=free[3:5], kept=kept))
    assert free.startswith(cut) and len(cut) < len(free)
    assert kept.length > ids.shape[1] and all(len(cache) == kept.length for cache in kept.caches)


@pytest.mark.parametrize("compiled", [False, True])
def test_logit_bias_forces_bans_and_leaves_other_tokens_alone(tiny64: Any, compiled: bool) -> None:
    """OpenAI's logit_bias in generate(): +100 forces a token at every step, -100 on the greedy choice gives the
    runner-up of the unbiased logits, and a bias on an unlikely token changes nothing (a bias applied to the
    wrong token, only at the first step, or not in the compiled step would break one of these)."""
    ids = tiny64.tokenize("the sin")["input_ids"]
    plain = tiny64.generate(ids, max_new_tokens=5, stop_ids=[], compile=compiled)[0, ids.shape[1]:]
    forced = tiny64.generate(ids, max_new_tokens=5, stop_ids=[], compile=compiled, logit_bias={"7": 100})
    assert forced[0, ids.shape[1]:].tolist() == [7] * 5
    with torch.inference_mode():
        logits = tiny64(ids)[0, -1]  # (V,)
    first, second = logits.topk(2).indices.tolist()
    assert int(plain[0]) == first
    banned = tiny64.generate(ids, max_new_tokens=1, stop_ids=[], compile=compiled, logit_bias={first: -100})
    assert int(banned[0, -1]) == second
    unlikely = int(logits.argmin())
    same = tiny64.generate(ids, max_new_tokens=5, stop_ids=[], compile=compiled, logit_bias={unlikely: 1.0})
    assert same[0, ids.shape[1]:].tolist() == plain.tolist()
