"""KVCache(eviction=SinkWindow(...)): a KV cache before its window fills, exact re-rotation after evictions,
bounded memory, SmolLM2.

Bugs these catch: evicted keys left at their old rotation (queries then see
keys "in the future"), an off-by-one in what is kept or where the next call
starts (next_positions disagreeing with what update returns, so the causal
band is misaligned), storage that grows with the tokens seen, a failed call
that leaves an eviction behind, and generation that pads, compiles or checks
the context as if the cache grew.
"""

from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import KVCache, MultiHeadAttention, RotaryEmbedding, SinkWindow

TEXT = Path(__file__).resolve().parents[1] / "data" / "python_reference.txt"


def _layer(seed: int = 0, rope: bool = True) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=rope).double().eval()


def _kept(cache: KVCache) -> list[int]:
    """The tokens a cache holds, derived from its length alone: the first sinks, then the most recent."""
    sinks = min(cache.eviction.sinks, cache.seen)
    return list(range(sinks)) + list(range(cache.seen - (len(cache) - sinks), cache.seen))


def _feed(layer: MultiHeadAttention, x: torch.Tensor, cache: Any, steps: list[int]) -> list[torch.Tensor]:
    outs, start = [], 0
    for size in steps:
        outs.append(layer(x[:, start : start + size], kv_cache=cache))
        start += size
    return outs


def test_before_the_window_fills_it_is_a_kv_cache():
    """Up to its capacity nothing is evicted: outputs and keys are bit for bit a KVCache's."""
    layer = _layer()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    sink, full = KVCache(eviction=SinkWindow(sinks=2, window=12, chunk=7, rope=layer.rope)), KVCache()
    assert sink.eviction.capacity == 20
    steps = [5, 1, 1, 6, 1, 2, 4]
    for got, expected in zip(_feed(layer, x, sink, steps), _feed(layer, x, full, steps), strict=True):
        assert torch.equal(got, expected)
    assert torch.equal(sink.keys, full.keys) and torch.equal(sink.values, full.values)
    assert (len(sink), sink.seen) == (20, 20)


@pytest.mark.parametrize("steps", [[1] * 60, [7, 1, 3, 1, 4, 4, 4, 1, 2, 4, 1, 1, 4, 4, 4, 4, 4, 4, 3],
                                   [30, 1, 1, 4, 20, 1, 1, 2]])
def test_after_eviction_each_call_equals_a_full_forward_over_the_kept_tokens(steps):
    """Re-rotation is exact: a call over the cache equals attention over the kept tokens at in-cache positions.

    A cache that forgets to re-rotate, keeps the wrong tokens or starts a call at the wrong position fails.
    """
    layer = _layer()
    x = torch.randn(2, sum(steps), 16, dtype=torch.float64)
    cache = KVCache(eviction=SinkWindow(sinks=3, window=9, chunk=4, rope=layer.rope))
    start, evictions = 0, 0
    for size in steps:
        held = len(cache)
        out = layer(x[:, start : start + size], kv_cache=cache)
        start += size
        evictions += len(cache) < held + size
        reference = layer(x[:, _kept(cache)])[:, -size:]  # no cache: positions 0 .. len - 1
        torch.testing.assert_close(out, reference, atol=1e-12, rtol=1e-12)
    assert evictions >= 3


@settings(max_examples=40, deadline=None)
@given(sinks=st.integers(1, 4), window=st.integers(1, 10), chunk=st.integers(1, 6), seed=st.integers(0, 99),
       calls=st.lists(st.integers(1, 8), min_size=1, max_size=25))
def test_keys_are_the_kept_tokens_rotated_at_their_in_cache_positions(sinks, window, chunk, seed, calls):
    """Driven as a layer drives it (rotate at next_positions, then update); checked against raw keys."""
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(4)
    raw_k = torch.randn(1, 2, sum(calls), 4, generator=g, dtype=torch.float64)  # (B, G, N, D), unrotated
    raw_v = torch.randn(1, 2, sum(calls), 3, generator=g, dtype=torch.float64)
    cache, start = KVCache(eviction=SinkWindow(sinks=sinks, window=window, chunk=chunk, rope=rope)), 0
    for t in calls:
        held_window = max(len(cache) - sinks, 0)
        at = cache.next_positions(1, t, raw_k.device)
        k = rope.rotate(raw_k[:, :, start : start + t], torch.arange(at, at + t))
        keys = cache.update(k, raw_v[:, :, start : start + t], None)
        start += t
        assert keys.positions is None and keys.k.shape[2] == at + t == len(cache)  # the band's alignment
        tail, new_in_window = len(cache) - min(sinks, start), min(t, max(start - sinks, 0))
        assert tail >= min(window - 1, held_window) + new_in_window  # the call's first query sees its window
        if t <= chunk:
            assert len(cache) <= cache.eviction.capacity
        kept = _kept(cache)
        expected = rope.rotate(raw_k[:, :, kept], torch.arange(len(kept)))
        torch.testing.assert_close(keys.k, expected, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(keys.v, raw_v[:, :, kept], atol=0, rtol=0)


def test_memory_stays_bounded_and_evictions_come_a_chunk_at_a_time():
    layer = _layer(rope=True).float()
    policy = SinkWindow(sinks=4, window=20, chunk=8, rope=layer.rope)
    cache = KVCache(eviction=policy)
    evictions = 0
    with torch.inference_mode():
        for _ in range(2000):
            held = len(cache)
            layer(torch.randn(1, 1, 16), kv_cache=cache)
            evictions += len(cache) <= held
            assert len(cache) <= policy.capacity == 31 and cache.allocated == policy.capacity
        assert cache.seen == 2000 and cache.keys.shape == (1, 2, len(cache), 4)
        assert evictions == (2000 - policy.capacity + policy.chunk - 1) // policy.chunk  # one eviction per chunk
        layer(torch.randn(1, 100, 16), kv_cache=cache)  # a call longer than a chunk is stored whole
        assert len(cache) == 4 + 19 + 100 and cache.allocated == len(cache)
        layer(torch.randn(1, 1, 16), kv_cache=cache)  # and the next call shrinks the cache back
        assert len(cache) == 4 + 20 and cache.allocated == policy.capacity


def test_a_failed_call_undoes_its_eviction():
    """The error is raised after update evicted and re-rotated: restore must bring back the old keys."""
    layer = _layer()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    cache = KVCache(eviction=SinkWindow(sinks=2, window=6, chunk=3, rope=layer.rope))
    _feed(layer, x, cache, [10])
    assert len(cache) == cache.eviction.capacity == 10
    keys, values, seen = cache.keys.clone(), cache.values.clone(), cache.seen
    with pytest.raises(ValueError, match=r"key_mask"):
        layer(x[:, 10:11], kv_cache=cache, key_mask=torch.ones(1, 3, dtype=torch.bool))
    assert (len(cache), cache.seen) == (10, seen)
    torch.testing.assert_close(cache.keys, keys, atol=0, rtol=0)
    torch.testing.assert_close(cache.values, values, atol=0, rtol=0)
    out = layer(x[:, 10:11], kv_cache=cache)  # as if the failed call never happened
    torch.testing.assert_close(out, layer(x[:, _kept(cache)])[:, -1:], atol=1e-12, rtol=1e-12)


def test_claim_and_restore_directly():
    rope = RotaryEmbedding(4)
    cache = KVCache(eviction=SinkWindow(sinks=1, window=2, chunk=1, rope=rope))
    k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    cache.update(k, v, None)
    before = cache.keys.clone()
    checkpoint = cache.claim(owner="layer")
    cache.update(k[:, :, :1], v[:, :, :1], None)  # evicts one key and re-rotates the other
    assert not torch.equal(cache.keys[:, :, :2], before[:, :, :2])
    cache.restore(checkpoint)
    assert torch.equal(cache.keys, before) and cache.seen == 3
    cache.claim(owner="layer")  # restore undid the claim too: claim it again, and keep it
    with pytest.raises(ValueError, match=r"already holds the keys of another layer.*one KVCache per layer"):
        cache.claim(owner="another layer")
    cache.reset()
    assert (len(cache), cache.seen, cache.keys) == (0, 0, None)
    cache.claim(owner="another layer")  # after reset it may serve another layer


def test_a_second_layer_is_told_the_cache_belongs_to_another_layer():
    """Bug: the rope was checked before the owner, so a second layer (its own RotaryEmbedding(4), or another
    base) was told the cache "rotates evicted keys with RotaryEmbedding(head_dim=4, base=10000) but the layer ...
    rotates them with RotaryEmbedding(head_dim=4, base=10000)" instead of that it holds another layer's keys."""
    first, second = _layer(0), _layer(1)
    other_base = MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=RotaryEmbedding(4, base=500.0)).double().eval()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    cache = KVCache(eviction=SinkWindow(sinks=1, window=4, rope=first.rope))
    first(x, kv_cache=cache)
    for layer in (second, other_base):
        with pytest.raises(ValueError, match=r"already holds the keys of another layer; a model needs one KVCache per "
                                             r"layer"):
            layer(x[:, :1], kv_cache=cache)
    assert len(cache) == 4


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_cache_serves_its_layer_with_a_copy_of_the_rope(how: str):
    """Bug: a deep copy or an unpickled evicting cache holds a copy of the layer's rope, which was compared by
    identity, so no layer could ever use the copy (though copies belong to no layer yet). Ropes are compared by
    what they compute: the copy goes on as the original does, bit for bit."""
    layer = _layer()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    cache = KVCache(eviction=SinkWindow(sinks=2, window=6, chunk=3, rope=layer.rope))
    _feed(layer, x, cache, [5, 1, 1, 1, 1, 1, 1])  # past the capacity of 10: evicted once
    twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    assert twin.eviction.rope is not layer.rope and twin.seen > len(twin)
    for got, expected in zip(_feed(layer, x[:, 11:], twin, [1] * 19), _feed(layer, x[:, 11:], cache, [1] * 19),
                             strict=True):
        assert torch.equal(got, expected)
    assert twin.seen == cache.seen == 30


def test_gradients_reach_the_current_call_as_with_a_kv_cache():
    """Held keys are constants, this call's carry gradients: as a KVCache holding the kept tokens."""
    layer = _layer().train()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    cache = KVCache(eviction=SinkWindow(sinks=1, window=4, chunk=2, rope=layer.rope))
    with torch.no_grad():
        _feed(layer, x, cache, [10])
    out = layer(x[:, 10:12], kv_cache=cache)  # evicts, then attends with gradients
    out.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    kept, reference_cache = _kept(cache), KVCache()
    with torch.no_grad():
        layer(x[:, kept[:-2]], kv_cache=reference_cache)
    reference = layer(x[:, kept[-2:]], kv_cache=reference_cache)
    reference.square().sum().backward()
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=1e-12)
    for got, expected in zip(grads, (p.grad for p in layer.parameters()), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_eviction_with_a_capacity_is_refused():
    """A capacity would contradict the policy's bound."""
    window = SinkWindow(sinks=1, window=4, chunk=8, rope=None)  # holds up to 1 + 4 + 8 - 1 = 12
    with pytest.raises(ValueError, match=r"holds what the policy keeps \(up to 12 positions\): give capacity=None, "
                                         r"got capacity=64"):
        KVCache(64, eviction=window)
    with pytest.raises(TypeError, match=r"eviction must be None or a SinkWindow, got str"):
        KVCache(eviction="sink:4,1020")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_eviction_with_16_bit_or_int8_storage_is_refused(dtype: torch.dtype):
    """Bug: bfloat16 / float16 storage with eviction rounded the kept keys again at every eviction's re-rotation
    (5% relative error at chunk=1), as int8 codes would be: refused, naming the dtype given, with one message."""
    with pytest.raises(ValueError, match=rf"re-rotates the keys it keeps at every eviction, which dtype={dtype} "
                                         r"storage would round again each time .*use dtype=None"):
        KVCache(dtype=dtype, eviction=SinkWindow(sinks=1, window=4, rope=None))


def test_the_sink_window_class_itself_is_refused_with_what_to_give():
    """Bug: KVCache(eviction=SinkWindow) said "got type", not that it needs an instance."""
    with pytest.raises(TypeError, match=r"eviction takes a SinkWindow instance, got the class itself: give "
                                        r"eviction=SinkWindow\(sinks=\.\.\., window=\.\.\., rope=layer\.rope\)"):
        KVCache(eviction=SinkWindow)  # type: ignore[arg-type]


def test_crop_cannot_undo_an_eviction():
    """Bug: crop after a call that evicted left a cache that differed from one that never saw the call (crop(1),
    below the sinks, gave len=1 and seen=5): a cache with eviction refuses every crop, naming its eviction, and
    stays as it was."""
    layer = _layer()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    cache = KVCache(eviction=SinkWindow(sinks=2, window=4, chunk=2, rope=layer.rope))  # holds up to 7
    _feed(layer, x, cache, [5, 1, 1, 1])  # the last call evicts 2
    assert (len(cache), cache.seen) == (6, 8)
    keys = cache.keys.clone()
    for length in (5, 1, 0):
        with pytest.raises(ValueError, match=r"eviction=SinkWindow\(sinks=2, window=4, chunk=2\) cannot be cropped: "
                                             r"an eviction cannot be undone"):
            cache.crop(length)
    assert (len(cache), cache.seen) == (6, 8) and torch.equal(cache.keys, keys)


def test_a_copy_keeps_the_policy_and_shares_no_storage():
    """copy.copy of an evicting cache goes on as a fresh cache fed the same tokens would: were its storage shared,
    the original's next key would overwrite the copy's."""
    layer = _layer()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    window = SinkWindow(sinks=2, window=6, chunk=3, rope=layer.rope)
    cache, fresh = KVCache(eviction=window), KVCache(eviction=window)
    _feed(layer, x, cache, [5])
    _feed(layer, x, fresh, [5])
    twin = copy.copy(cache)
    assert twin.eviction is window and "eviction=SinkWindow(sinks=2, window=6, chunk=3), seen=5" in repr(twin)
    assert "capacity=10," in repr(twin)  # the eviction's bound (it showed capacity=None)
    layer(torch.randn(1, 1, 16, dtype=torch.float64), kv_cache=cache)  # the original's slot 5 takes another key
    for got, expected in zip(_feed(layer, x[:, 5:], twin, [1] * 25), _feed(layer, x[:, 5:], fresh, [1] * 25),
                             strict=True):
        assert torch.equal(got, expected)
    assert twin.seen == fresh.seen == 30 and len(twin) == len(fresh) < 30


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(sinks=0, window=4), "sinks must be an int >= 1, got sinks=0"),
    (dict(sinks=2, window=0), "window must be an int >= 1, got window=0"),
    (dict(sinks=2, window=4, chunk=0), "chunk must be an int >= 1, got chunk=0"),
    (dict(sinks=True, window=4), "sinks must be an int >= 1, got sinks=True"),
    (dict(sinks=2, window=4.0), "window must be an int >= 1, got window=4.0"),
])
def test_bad_sizes_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SinkWindow(rope=None, **kwargs)


def test_bad_use_is_refused_with_the_reason():
    layer = _layer()
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="rope must be the layer's RotaryEmbedding"):
        SinkWindow(sinks=1, window=4, rope=True)
    with pytest.raises(TypeError, match="rope"):
        SinkWindow(sinks=1, window=4)  # the rope must be given (None for a layer without one)
    cache = KVCache(eviction=SinkWindow(sinks=1, window=4, rope=layer.rope))
    with pytest.raises(ValueError, match=r"assigns positions inside the cache.*no explicit positions.*left padding"):
        layer(x, positions=torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]), kv_cache=cache)
    assert len(cache) == 0
    layer(x, kv_cache=cache)
    with pytest.raises(ValueError, match=r"holds \(B, G, D, Dv\)=\(2, 2, 4, 4\) but got \(1, 2, 4, 4\).*reset"):
        layer(x[:1], kv_cache=cache)
    for rope in (None, RotaryEmbedding(4, base=500.0), RotaryEmbedding(8)):  # no rope, or another rotation
        with pytest.raises(ValueError, match=r"rotates evicted keys with .* but the layer writing to it "
                                             r"\(MultiHeadAttention\) rotates them with .*rope=layer\.rope"):
            layer(x, kv_cache=KVCache(eviction=SinkWindow(sinks=1, window=4, rope=rope)))
    layer(x, kv_cache=KVCache(eviction=SinkWindow(sinks=1, window=4, rope=RotaryEmbedding(4))))  # rotates alike
    with pytest.raises(ValueError, match="rope has head_dim=8 but the keys have D=4"):
        KVCache(eviction=SinkWindow(sinks=1, window=4, rope=RotaryEmbedding(8))).update(
            torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), None)


# ---------------------------------------------------------------------------------------------------------------
# generation


def _tiny(tmp_path: Path, dtype: torch.dtype) -> Any:
    from tests._util import need
    from tests.models._decoder import write_tiny_llama

    need("gguf")
    need("tokenizers")
    from attnkit.models import load_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, context=64)
    return load_gguf(path, dtype=dtype)


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _tiny(tmp_path_factory.mktemp("sink"), torch.float64)


def test_every_layer_keeps_the_same_tokens_and_the_first_layer_holds_their_keys(tiny64: Any):
    """All layers evict together, past the model's context; layer 0's keys (context-free: they come from the
    embeddings alone) are the kept tokens' keys rotated at their in-cache positions, values unchanged (float64).

    Later layers' keys are not a recomputation over the kept tokens: they were computed when their token
    came, over what the cache held then (as in StreamingLLM).
    """
    from attnkit.models.sink_caches import sink_caches

    caches = sink_caches(tiny64, sinks=2, window=10, chunk=4)
    block = tiny64.layers[0]
    ids = torch.randint(3, tiny64.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny64(ids[:, :8], kv_caches=caches)
        for t in range(8, 150):  # past the model's context of 64
            tiny64(ids[:, t : t + 1], kv_caches=caches)
            kept = _kept(caches[0])
            assert all((len(c), c.seen) == (len(kept), t + 1) for c in caches)
            _, k, v = block.attention.project(block.attention_norm(tiny64.embed_tokens(ids[:, kept])))
            _, k = block.attention.rope(k, k)  # (B, G, S, D) at 0 .. S - 1
            torch.testing.assert_close(caches[0].keys, k, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(caches[0].values, v, atol=1e-12, rtol=1e-12)


def test_generate_with_a_sink_cache_equals_the_full_cache_until_it_fills(tiny64: Any):
    ids = tiny64.tokenize("the sin a in the")["input_ids"]
    room = 2 + 16 + 8 - 1 - ids.shape[1] + 1  # the last new token is never stored: the cache just fills
    full = tiny64.generate(ids, max_new_tokens=room, stop_ids=[])
    assert torch.equal(tiny64.generate(ids, max_new_tokens=room, stop_ids=[], cache="sink:2,16,8"), full)


def test_generate_past_the_context_length_with_a_long_prompt(tiny64: Any):
    """A 100-token prompt (context 64) goes in pieces; 200 new tokens; each token is the greedy choice."""
    from attnkit.models.sink_caches import SinkSpec, sink_caches

    ids = torch.randint(3, tiny64.vocab_size, (1, 100), generator=torch.Generator().manual_seed(1))
    out = tiny64.generate(ids, max_new_tokens=200, stop_ids=[], cache="sink:2,16,8")
    assert out.shape == (1, 300) and torch.equal(out[:, :100], ids)
    spec = SinkSpec(2, 16, 8)
    assert spec.pieces(100) == [25, 8, 8, 8, 8, 8, 8, 8, 8, 8, 3] and sum(spec.pieces(100)) == 100
    caches, start = sink_caches(tiny64, sinks=2, window=16, chunk=8), 0
    with torch.no_grad():
        for size in spec.pieces(100):
            logits = tiny64(ids[:, start : start + size], kv_caches=caches)
            start += size
        for t in range(100, 300):
            assert int(logits[0, -1].argmax()) == int(out[0, t]), t
            logits = tiny64(out[:, t : t + 1], kv_caches=caches)
    assert max(len(c) for c in caches) <= spec.capacity


@pytest.mark.parametrize(("options", "message"), [
    (dict(cache="sink"), 'cache must be "full".*"sink:SINKS,WINDOW".*got cache=.sink.'),
    (dict(cache="sink:4"), "got cache='sink:4'"),
    (dict(cache="window:4,8"), "got cache='window:4,8'"),
    (dict(cache="sink:0,8"), "sinks must be an int >= 1, got sinks=0"),
    (dict(cache="sink:4,60"), "holds up to 127 positions.*beyond the model's context length 64"),
    (dict(cache="sink:2,8", compile=True), "compile=True runs over static caches.*use one or the other"),
])
def test_bad_cache_options_are_named(tiny64: Any, options: dict[str, Any], message: str):
    ids = tiny64.tokenize("the sin")["input_ids"]
    with pytest.raises(ValueError, match=message):
        tiny64.generate(ids, max_new_tokens=2, **options)


def test_padded_prompts_are_refused_with_a_sink_cache(tiny64: Any):
    batch = tiny64.tokenize(["the sin", "a"])
    with pytest.raises(ValueError, match=r"assigns positions inside the cache.*without padding"):
        tiny64.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=2, cache="sink:2,8")
    ids = torch.randint(3, tiny64.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    out = tiny64.generate(ids, max_new_tokens=80, stop_ids=[], cache="sink:2,8,4")  # rows of one length: fine
    assert out.shape == (2, 85)
    for row in range(2):
        alone = tiny64.generate(ids[row : row + 1], max_new_tokens=80, stop_ids=[], cache="sink:2,8,4")
        assert torch.equal(out[row : row + 1], alone)


def test_the_generate_command_takes_a_sink_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from tests._util import need
    from tests.models._decoder import write_tiny_llama

    need("gguf")
    need("tokenizers")
    need("rich")
    from attnkit.cli import main

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, context=64)
    assert main(["generate", "--gguf", str(path), "--cache", "sink:2,16,8", "--max-new-tokens", "100", "the"]) == 0
    assert "generation: 100 tokens" in capsys.readouterr().err  # past the context of 64
    assert main(["generate", "--gguf", str(path), "--cache", "sink:2", "the"]) == 2
    assert "got cache='sink:2'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 on a long text


def _nll(model: Any, ids: torch.Tensor, caches: Any, piece: int) -> float:
    total = 0.0
    with torch.inference_mode():
        for start in range(0, ids.shape[1] - 1, piece):
            end = min(start + piece, ids.shape[1] - 1)
            logits = model(ids[:, start:end], kv_caches=caches)  # (1, P, V)
            total += float(torch.nn.functional.cross_entropy(logits[0], ids[0, start + 1 : end + 1], reduction="sum"))
    return total / (ids.shape[1] - 1)


def test_smollm2_perplexity_with_sinks_stays_within_1_5x_of_the_full_cache():
    """1,024 tokens of the Python Language Reference (tests/data), a window of 124: measured 14.2 against 12.7.

    Without the re-rotation the same run measured 96.7 (7.6x).
    """
    from attnkit.models.sink_caches import sink_caches
    from tests.models._decoder import smollm2

    model = smollm2()
    text = TEXT.read_text(encoding="utf-8").split("# ---\n", 1)[1]
    ids = torch.tensor([model.tokenizer.encode(text)[:1025]])  # (1, 1025)
    full = math.exp(_nll(model, ids, model.new_caches(), 512))
    caches = sink_caches(model, sinks=4, window=124, chunk=32)
    sink = math.exp(_nll(model, ids, caches, 32))
    assert caches[0].seen == 1024 and len(caches[0]) <= caches[0].eviction.capacity == 159
    assert sink <= 1.5 * full, (sink, full)


def test_the_long_text_is_kept_with_its_source_and_licence():
    header, text = TEXT.read_text(encoding="utf-8").split("# ---\n", 1)
    assert "Python Software Foundation License" in header and "pydoc_data/topics.py" in header
    assert len(text) > 38_000 and text.startswith("Objects, values and types")


def test_half_precision_keys_are_re_rotated_in_float32():
    """A bfloat16 layer's keys re-rotated once per chunk (16 times here): rotating in float32 keeps the error within
    a few bfloat16 roundings of the directly rotated keys (rotating in bfloat16 measured 7.6x one rounding).

    (A float32 layer's keys in bfloat16 storage are refused with eviction: test_eviction_with_16_bit_or_int8_storage_
    is_refused.)"""
    torch.manual_seed(0)
    rope = RotaryEmbedding(64)
    cache = KVCache(eviction=SinkWindow(sinks=2, window=64, chunk=4, rope=rope))
    raw = []
    with torch.no_grad():
        for _ in range(300):
            k = torch.randn(1, 1, 1, 64, dtype=torch.float64)
            raw.append(k)
            at = cache.next_positions(1, 1, k.device)
            rotated = rope.rotate(k, torch.tensor([at]))
            rotated = rotated.bfloat16()
            cache.update(rotated, rotated, None)
    assert cache.keys.dtype == torch.bfloat16 and cache.seen == 300
    held = cache.keys.double()
    s = held.shape[2]
    want = rope.rotate(torch.cat(raw[:2] + raw[-(s - 2):], 2), torch.arange(s))  # (1, 1, S, 64) at 0 .. S - 1
    error = (held - want).norm() / want.norm()
    one_rounding = (want.bfloat16().double() - want).norm() / want.norm()
    assert float(error / one_rounding) < 5.5


def test_a_cache_spec_with_non_ascii_digits_is_refused_by_name():
    from attnkit.models.sink_caches import SinkSpec

    with pytest.raises(ValueError, match=r"cache='sink:²,10'"):
        SinkSpec.parse("sink:²,10")
    assert SinkSpec.parse(" sink: 4 , 1020 ") == SinkSpec(4, 1020)
