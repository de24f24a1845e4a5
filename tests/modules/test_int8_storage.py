"""KVCache(dtype=torch.int8): int8 keys and values, read by the int8 kernel, against float64 attention over what it
holds.

The reference below is written from the definition (softmax over q k^T * scale
with the band, window and padding masks, then the values), over the cache's
own dequantised keys and values (``keys_and_values(torch.float64)``): it
measures the kernel's rounding (queries, scores and probabilities in
bfloat16), not the int8 storage's, which separate tests bound against the full
forward and a float cache.

Legend: B batch, G key/value heads, H query heads, T new positions, S positions held, D head dim.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnkit import KVCache, MultiHeadAttention
from attnkit.modules.int8_storage import CHUNK, Int8Keys, quantize_rows

# The kernel path against the float64 reference, on layers fed 2 * randn (scores up to ~10, outputs up to ~1).
# It takes the scaled queries in bfloat16 and returns the scores in bfloat16 (each off by up to |score| * 2^-9,
# so each weight by up to ~2%), then takes the probabilities in bfloat16 and returns bfloat16 outputs: measured
# after out_proj at most 5.6e-3 (float32 layers, every case below, 5 seeds) and 3.3e-3 (the bfloat16 layer,
# whose out_proj rounds again); the bounds are about 3x (6x for bfloat16) that.
KERNEL = dict(atol=1.5e-2, rtol=1e-2)
KERNEL_BF16 = dict(atol=2e-2, rtol=1e-2)
# The dequantised path is float32 attention over exactly the keys the reference reads: measured < 1e-6.
EXACT = dict(atol=1e-5, rtol=1e-5)


def _layer(*, d_in: int = 128, heads: int = 4, kv_heads: int = 2, head_dim: int = 32, window: int | None = None,
           dtype: torch.dtype = torch.float32) -> MultiHeadAttention:
    """A causal RoPE layer: ``heads`` heads of ``head_dim`` over ``kv_heads`` key/value heads, d_out = H * D."""
    torch.manual_seed(0)
    return MultiHeadAttention(d_in, heads * head_dim, heads, num_kv_heads=kv_heads, rope=True,
                              window=window).to(dtype).eval()


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The q shape of every call of :meth:`Int8Keys.attention` (the int8 kernels), in order."""
    calls: list[tuple[int, ...]] = []
    attention = Int8Keys.attention

    def spy(self: Int8Keys, q: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        calls.append(tuple(q.shape))
        return attention(self, q, *args, **kwargs)

    monkeypatch.setattr(Int8Keys, "attention", spy)
    return calls


# --- quantize_rows ---------------------------------------------------------------------------------------------


def _check_rows(x: Tensor, codes: Tensor, scale: Tensor, scale_dtype: torch.dtype) -> None:
    """Codes int8 in [-127, 127], one ``scale_dtype`` scale per row, each entry within half a step of x."""
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scale.dtype == scale_dtype and scale.shape == x.shape[:-1]
    assert int(codes.min()) >= -127 and int(codes.max()) <= 127  # -128 would make the grid lopsided
    assert bool(torch.isfinite(scale).all())
    x64, step = x.double(), scale.double()[..., None]  # (..., D), (..., 1)
    err = (x64 - codes.double() * step).abs()
    # x / scale is taken in float32 (off by <= 127 * 2^-24 steps); the largest entry may exceed 127 steps by
    # 127 * 2^-9 when the scale rounded down to bfloat16 and is clamped to 127: still within half a step
    assert bool((err <= step * (0.5 + 1e-4)).all()), float((err / step).max())
    amax = x64.abs().amax(dim=-1)  # (...)
    real = amax > 0
    # the step is the row's largest magnitude / 127 (rounded to scale_dtype), so the largest code is +-127
    torch.testing.assert_close(scale.double()[real], amax[real] / 127, rtol=2**-8, atol=0)
    assert bool((codes.abs().amax(dim=-1)[real] == 127).all())
    assert bool((codes[~real] == 0).all())  # an all-zero row: codes 0 (not NaN turned into an integer)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_round_each_entry_to_the_nearest_step_of_its_row(scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 32, generator=gen) * torch.logspace(-6, 6, 5)[:, None]  # rows of very different sizes
    x[1, 2] = 0.0  # an all-zero row
    x[2, 0, 7] = 1e4  # an outlier: the rest of its row is rounded to a coarse grid
    codes, scale = quantize_rows(x, scale_dtype)
    _check_rows(x, codes, scale, scale_dtype)
    assert bool((codes[1, 2].double() * scale[1, 2].double() == 0).all())  # it reads back as 0


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), d=st.sampled_from([1, 3, 16, 33]),
       exponent=st.integers(-20, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scale_dtype=st.sampled_from([torch.bfloat16, torch.float32]), zero_row=st.booleans(),
       seed=st.integers(0, 2**16))
def test_quantize_rows_property(shape: list[int], d: int, exponent: int, dtype: torch.dtype,
                                scale_dtype: torch.dtype, zero_row: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, d, generator=gen) * 10.0**exponent).to(dtype)
    if zero_row:
        x.view(-1, d)[0] = 0
    codes, scale = quantize_rows(x, scale_dtype)
    _check_rows(x, codes, scale, scale_dtype)


# --- the cache's bookkeeping ------------------------------------------------------------------------------------


def _kv(b: int, g: int, t: int, d: int = 16, dv: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, g, t, d, generator=gen), torch.randn(b, g, t, dv or d, generator=gen)


def _assert_holds(held: Tensor, given_: Tensor) -> None:
    """``held`` (B, G, S, D) is ``given_`` rounded to int8 codes of one step per vector: within half that step."""
    step = given_.double().abs().amax(dim=-1, keepdim=True) / 127  # (B, G, S, 1)
    err = (held.double() - given_.double()).abs()
    assert bool((err <= step * (0.5 + 2**-8) + 1e-12).all()), float((err / step).max())


def test_len_positions_and_next_positions_mirror_kv_cache() -> None:
    cache = KVCache(dtype=torch.int8)
    assert len(cache) == 0 and cache.positions is None and cache.keys_and_values() is None
    k, v = _kv(2, 2, 5)
    keys = cache.update(k, v, None)
    assert isinstance(keys, Int8Keys) and keys.length == 5 and keys.positions is None and len(cache) == 5
    assert cache.positions is None and cache.next_positions(2, 3, k.device) == 5  # prefix mode: slot = position
    held = cache.keys_and_values()
    assert held is not None and held.k.shape == (2, 2, 5, 16) and held.positions is None
    _assert_holds(held.k, k)
    _assert_holds(held.v, v)  # values are stored transposed: a mixed-up transpose fails here
    k2, v2 = _kv(2, 2, 2, seed=1)
    keys = cache.update(k2, v2, torch.tensor([[9, 10], [5, 6]]))  # explicit positions: rows part ways
    assert len(cache) == 7 and keys.positions is not None
    assert cache.positions.tolist() == [[0, 1, 2, 3, 4, 9, 10], [0, 1, 2, 3, 4, 5, 6]]
    assert cache.next_positions(2, 2, k.device).tolist() == [[11, 12], [7, 8]]
    held = cache.keys_and_values(torch.float64)
    assert held is not None and held.k.dtype == torch.float64
    _assert_holds(held.k, torch.cat([k, k2], dim=2))
    _assert_holds(held.v, torch.cat([v, v2], dim=2))
    assert "len=7" in repr(cache)


@pytest.mark.parametrize("dv", [16, 24], ids=["dv=d", "dv!=d"])
def test_growth_past_a_chunk_keeps_what_was_held(dv: int) -> None:
    """Storage grows in chunks of CHUNK positions; the copy into the larger storage must keep every slot."""
    cache = KVCache(dtype=torch.int8)
    k, v = _kv(2, 2, CHUNK + 20, dv=dv)
    first = CHUNK - 3
    keys = cache.update(k[:, :, :first], v[:, :, :first], None)
    assert keys.v_codes_t.shape[-1] == CHUNK  # the value product reads the whole allocation
    before = cache.keys_and_values()
    for t in range(first, first + 6):  # one at a time across the boundary
        keys = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], None)
    keys = cache.update(k[:, :, first + 6 :], v[:, :, first + 6 :], None)
    assert keys.v_codes_t.shape[-1] == 2 * CHUNK and len(cache) == CHUNK + 20
    after = cache.keys_and_values()
    assert before is not None and after is not None
    torch.testing.assert_close(after.k[:, :, :first], before.k, atol=0, rtol=0)
    torch.testing.assert_close(after.v[:, :, :first], before.v, atol=0, rtol=0)
    _assert_holds(after.k, k)
    _assert_holds(after.v, v)


def test_keys_values_and_append_read_the_codes_as_floats() -> None:
    """``cache.keys`` / ``cache.values`` are the dequantised codes (float32), as ``keys_and_values()``; append
    returns them in the keys' dtype; repr names the storage dtype."""
    cache = KVCache(dtype=torch.int8)
    assert cache.keys is None and cache.values is None and cache.allocated == 0
    k, v = _kv(1, 2, 3)
    keys, values = cache.append(k, v)
    held = cache.keys_and_values()
    assert held is not None and keys.dtype == values.dtype == torch.float32 and cache.allocated == CHUNK
    for got in (keys, cache.keys):
        torch.testing.assert_close(got, held.k, atol=0, rtol=0)
    for got in (values, cache.values):
        torch.testing.assert_close(got, held.v, atol=0, rtol=0)
    _assert_holds(keys, k)
    _assert_holds(values, v)
    assert "len=3" in repr(cache) and "dtype=torch.int8" in repr(cache)


def test_growth_with_explicit_positions_keeps_them() -> None:
    cache = KVCache(dtype=torch.int8)
    k, v = _kv(2, 1, CHUNK + 4)
    positions = torch.stack([torch.arange(CHUNK + 4), torch.arange(CHUNK + 4) + 100])  # (2, S)
    positions[1, :3] = -1  # padding
    cache.update(k[:, :, :CHUNK], v[:, :, :CHUNK], positions[:, :CHUNK])
    cache.update(k[:, :, CHUNK:], v[:, :, CHUNK:], positions[:, CHUNK:])
    assert torch.equal(cache.positions, positions)


def test_crop_rewinds_and_the_next_update_writes_over_the_dropped_slots() -> None:
    cache = KVCache(dtype=torch.int8)
    k, v = _kv(1, 2, 6)
    cache.update(k, v, None)
    before = cache.keys_and_values()
    cache.crop(4)
    assert len(cache) == 4 and cache.next_positions(1, 1, k.device) == 4
    cropped = cache.keys_and_values()
    assert before is not None and cropped is not None
    torch.testing.assert_close(cropped.k, before.k[:, :, :4], atol=0, rtol=0)
    k2, v2 = _kv(1, 2, 1, seed=5)
    cache.update(k2, v2, None)
    held = cache.keys_and_values()
    assert held is not None
    _assert_holds(held.k, torch.cat([k[:, :, :4], k2], dim=2))  # slot 4 holds the new key, not the dropped one
    _assert_holds(held.v, torch.cat([v[:, :, :4], v2], dim=2))
    for bad in (9, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"crop length must be an int in \[0, 5\], got"):
            cache.crop(bad)  # type: ignore[arg-type]


def test_crop_with_explicit_positions_continues_after_the_kept_ones() -> None:
    cache = KVCache(dtype=torch.int8)
    k, v = _kv(2, 1, 6)
    cache.update(k, v, torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]]))
    cache.crop(4)
    assert cache.positions.tolist() == [[0, 1, 2, 3], [-1, -1, 0, 1]]
    assert cache.next_positions(2, 1, k.device).tolist() == [[4], [2]]
    cache.update(*_kv(2, 1, 1, seed=1), torch.tensor([[4], [2]]))  # the positions crop gave back are free again
    with pytest.raises(ValueError, match=r"positions repeat what the cache holds: row 1 holds positions up to 2"):
        cache.update(*_kv(2, 1, 1, seed=2), torch.tensor([[5], [2]]))


def test_reset_forgets_everything_and_frees_it_for_another_layer() -> None:
    first, second = _layer(d_in=64, head_dim=16), _layer(d_in=64, head_dim=16)
    cache = KVCache(dtype=torch.int8)
    x = torch.randn(1, 4, 64)
    with torch.no_grad():
        first(x, kv_cache=cache, positions=torch.arange(4)[None])
        with pytest.raises(ValueError, match=r"already holds the keys of another layer; .* one KVCache per layer"):
            second(x, kv_cache=cache)
        assert len(cache) == 4  # the refused layer stored nothing
        cache.reset()
        assert len(cache) == 0 and cache.positions is None and cache.keys_and_values() is None
        second(torch.randn(3, 2, 64), kv_cache=cache)  # another layer, another batch size
    assert len(cache) == 2 and cache.positions is None


def test_restore_undoes_growth_and_the_first_explicit_positions() -> None:
    cache, owner = KVCache(dtype=torch.int8), object()
    k, v = _kv(1, 2, CHUNK + 10)
    cache.claim(owner)
    cache.update(k[:, :, :100], v[:, :, :100], None)
    before = cache.keys_and_values()
    checkpoint = cache.claim(owner)
    cache.update(k[:, :, 100:], v[:, :, 100:], torch.arange(100, CHUNK + 10)[None])  # grows, and keeps positions
    assert len(cache) == CHUNK + 10 and cache.positions is not None
    cache.restore(checkpoint)
    after = cache.keys_and_values()
    assert len(cache) == 100 and cache.positions is None and cache.next_positions(1, 1, k.device) == 100
    assert before is not None and after is not None
    torch.testing.assert_close(after.k, before.k, atol=0, rtol=0)
    torch.testing.assert_close(after.v, before.v, atol=0, rtol=0)
    assert cache.update(k[:, :, 100:101], v[:, :, 100:101], None).v_codes_t.shape[-1] == CHUNK  # old storage
    with pytest.raises(ValueError, match="already holds the keys of another layer"):
        cache.claim(object())  # the owner is restored too


def test_a_call_that_raises_leaves_the_cache_as_it_was() -> None:
    """A bad second call through the layer (a key_mask of the wrong shape, after the keys were stored and the
    storage grew past a chunk) must leave the cache as the good first call left it, usable as before."""
    layer = _layer()
    x = torch.randn(1, 260, 128)
    cache, twin = KVCache(dtype=torch.int8), KVCache(dtype=torch.int8)
    with torch.no_grad():
        layer(x[:, :200], kv_cache=cache)
        layer(x[:, :200], kv_cache=twin)
        before = cache.keys_and_values()
        with pytest.raises(ValueError, match="key_mask"):
            layer(x[:, 200:], kv_cache=cache, key_mask=torch.ones(1, 3, dtype=torch.bool))
        with pytest.raises(ValueError, match="key_mask"):  # one token: the call the kernel would serve
            layer(x[:, 200:201], kv_cache=cache, key_mask=torch.ones(1, 3, dtype=torch.bool))
        assert len(cache) == 200 and cache.positions is None
        after = cache.keys_and_values()
        assert before is not None and after is not None
        torch.testing.assert_close(after.k, before.k, atol=0, rtol=0)
        retried, expected = layer(x[:, 200:201], kv_cache=cache), layer(x[:, 200:201], kv_cache=twin)
    torch.testing.assert_close(retried, expected, atol=0, rtol=0)


def test_capacity() -> None:
    cache = KVCache(capacity=6, dtype=torch.int8)
    cache.update(*_kv(1, 2, 4), None)
    cache.update(*_kv(1, 2, 2), None)  # exactly full
    with pytest.raises(ValueError, match=r"KVCache capacity 6 exceeded: it holds 6 positions and 1 more"):
        cache.update(*_kv(1, 2, 1), None)
    assert len(cache) == 6
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match=r"capacity must be a positive int or None, got capacity="):
            KVCache(capacity=bad, dtype=torch.int8)  # type: ignore[arg-type]


@pytest.mark.parametrize(("k_dtype", "v_dtype"), [(torch.float16, torch.float16), (torch.float64, torch.float64),
                                                  (torch.float32, torch.bfloat16)])
def test_other_dtypes_are_refused_by_name(k_dtype: torch.dtype, v_dtype: torch.dtype) -> None:
    k, v = _kv(1, 2, 3)
    with pytest.raises(ValueError, match=rf"KVCache\(dtype=torch\.int8\) takes float32 or bfloat16 keys and values of "
                                         rf"one dtype, got {k_dtype} and {v_dtype}"):
        KVCache(dtype=torch.int8).update(k.to(k_dtype), v.to(v_dtype), None)


def test_keys_that_need_gradients_are_refused_under_grad_mode() -> None:
    k, v = _kv(1, 2, 3)
    cache = KVCache(dtype=torch.int8)
    with pytest.raises(ValueError, match=r"KVCache\(dtype=torch\.int8\) is for inference: call under torch\.no_grad"):
        cache.update(k.requires_grad_(), v, None)
    layer = _layer(d_in=64, head_dim=16)
    with pytest.raises(ValueError, match=r"KVCache\(dtype=torch\.int8\) is for inference"):
        layer(torch.randn(1, 3, 64), kv_cache=cache)  # the layer's parameters need gradients
    assert len(cache) == 0
    with torch.no_grad():
        cache.update(k, v, None)  # the same keys, under no_grad
    assert len(cache) == 3


def test_mismatched_shapes_and_repeated_positions_are_refused() -> None:
    cache = KVCache(dtype=torch.int8)
    cache.update(*_kv(2, 2, 4), None)
    with pytest.raises(ValueError, match=r"holds \(B, G, D, Dv\)=\(2, 2, 16, 16\) but got \(3, 2, 16, 16\); .*reset"):
        cache.update(*_kv(3, 2, 1), None)
    with pytest.raises(ValueError, match=r"holds \(B, G, D, Dv\)=\(2, 2, 16, 16\) but got \(2, 2, 16, 8\)"):
        cache.update(_kv(2, 2, 1)[0], _kv(2, 2, 1, d=8)[1], None)
    with pytest.raises(ValueError, match=r"keys and values must be \(B, G, T, D\) and agree on B, G, T"):
        cache.update(_kv(2, 2, 2)[0], _kv(2, 2, 1)[1], None)
    with pytest.raises(ValueError, match=r"positions repeat what the cache holds: row 1 holds positions up to 3 but "
                                         r"this call starts at 3"):
        cache.update(*_kv(2, 2, 1), torch.tensor([[4], [3]]))
    assert len(cache) == 4 and cache.positions is None  # nothing was stored by the refused calls


def test_copies_and_pickles_belong_to_no_layer() -> None:
    first, second = _layer(d_in=64, head_dim=16), _layer(d_in=64, head_dim=16)
    x = torch.randn(1, 5, 64)
    cache = KVCache(dtype=torch.int8)
    with torch.no_grad():
        first(x, kv_cache=cache)
        held = cache.keys_and_values()
        for twin in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache), copy.copy(cache)):
            assert len(twin) == 5
            kept = twin.keys_and_values()
            assert held is not None and kept is not None
            torch.testing.assert_close(kept.k, held.k, atol=0, rtol=0)
            second(x[:, :1], kv_cache=twin)  # the copy is free for another layer
        with pytest.raises(ValueError, match="already holds the keys of another layer"):
            second(x[:, :1], kv_cache=cache)  # the original is still the first layer's


def test_a_shallow_copy_does_not_share_storage() -> None:
    """copy.copy gives an independent cache (as KVCache's does): were the storage shared, the copy's next update
    would write into the slot the original's next update uses, and each would overwrite the other's keys."""
    layer = _layer(d_in=64, head_dim=16)
    x = torch.randn(2, 6, 64)
    cache = KVCache(dtype=torch.int8)
    with torch.no_grad():
        full = layer(x)
        layer(x[:, :3], kv_cache=cache)
        twin = copy.copy(cache)
        layer(x[:, 3:4], kv_cache=cache)
        held = cache.keys_and_values()
        layer(torch.randn(2, 1, 64), kv_cache=twin)
        after = cache.keys_and_values()
        out = layer(x[:, 4:5], kv_cache=cache)
    assert held is not None and after is not None
    torch.testing.assert_close(after.k, held.k, atol=0, rtol=0)
    torch.testing.assert_close(out, full[:, 4:5], atol=5e-3, rtol=0)


def test_a_cache_filled_under_inference_mode_works_outside_it() -> None:
    layer = _layer()
    x = torch.randn(1, 258, 128)
    inside, outside = KVCache(dtype=torch.int8), KVCache(dtype=torch.int8)
    with torch.inference_mode():
        layer(x[:, :254], kv_cache=inside)
    with torch.no_grad():
        layer(x[:, :254], kv_cache=outside)
        for t in range(254, 258):  # across a chunk: the growth copies inference tensors too
            out = layer(x[:, t : t + 1], kv_cache=inside)  # before a copy: "Inplace update to inference tensor"
            torch.testing.assert_close(out, layer(x[:, t : t + 1], kv_cache=outside), atol=0, rtol=0)
    assert len(inside) == 258


def test_positions_first_given_under_inference_mode_work_outside_it() -> None:
    """A cache filled outside inference mode, then given its first explicit positions inside it, keeps its
    storage (an ordinary tensor) but makes its positions there: an inference tensor. Were only the key codes
    looked at, the next call outside would write into those positions and raise "Inplace update to inference
    tensor outside InferenceMode"; KVCache is held to the same."""
    layer = _layer()
    x = torch.randn(1, 6, 128)
    for cache in (KVCache(dtype=torch.int8), KVCache()):
        with torch.no_grad():
            layer(x[:, :4], kv_cache=cache)
        with torch.inference_mode():
            layer(x[:, 4:5], kv_cache=cache, positions=torch.tensor([[4]]))
        with torch.no_grad():
            layer(x[:, 5:6], kv_cache=cache)
        assert cache.positions is not None and cache.positions.tolist() == [[0, 1, 2, 3, 4, 5]], cache


def test_decoding_after_a_crop_ignores_the_codes_left_past_it(kernel_calls: list[tuple[int, ...]]) -> None:
    """A rejected draft of 8 tokens, cropped: the kernel reads the whole allocation, so the codes the draft left
    past the held length must get probability 0 (the next step equals a float KVCache's, cropped alike)."""
    layer = _layer()
    x, draft = torch.randn(1, 201, 128), torch.randn(1, 8, 128)
    int8, floats = KVCache(dtype=torch.int8), KVCache()
    with torch.inference_mode():
        for cache in (int8, floats):
            layer(x[:, :200], kv_cache=cache)
            layer(draft * 50, kv_cache=cache)  # large keys and values, left behind by the crop
            cache.crop(200)
        out, expected = (layer(x[:, 200:], kv_cache=cache) for cache in (int8, floats))
    assert kernel_calls  # the draft and the step went through the kernel
    torch.testing.assert_close(out, expected, **KERNEL)


def test_a_compiled_layer_over_an_int8_cache_equals_eager(fresh_dynamo: None) -> None:
    """Inductor cannot lower the int8 kernel: under torch.compile the layer reads the dequantised keys."""
    layer = _layer()
    x = torch.randn(1, 201, 128)
    eager_cache, compiled_cache = KVCache(dtype=torch.int8), KVCache(dtype=torch.int8)
    compiled = torch.compile(layer)
    with torch.no_grad():
        layer(x[:, :200], kv_cache=eager_cache)
        compiled(x[:, :200], kv_cache=compiled_cache)
        torch.testing.assert_close(compiled(x[:, 200:], kv_cache=compiled_cache),
                                   layer(x[:, 200:], kv_cache=eager_cache), **KERNEL)


def test_trace_records_decoding_over_an_int8_cache(kernel_calls: list[tuple[int, ...]]) -> None:
    """While attnkit.trace watches, the layer takes the dequantised path, which the trace records."""
    import attnkit

    layer = _layer()
    x = torch.randn(1, 201, 128)
    cache = KVCache(dtype=torch.int8)
    with torch.no_grad():
        layer(x[:, :200], kv_cache=cache)
        with attnkit.trace(layer) as seen:
            layer(x[:, 200:], kv_cache=cache)
    assert len(seen.records) == 1 and not kernel_calls


def test_int8_keys_attention_refuses_what_its_kernel_cannot_read() -> None:
    cache = KVCache(dtype=torch.int8)
    with torch.no_grad():
        keys = cache.update(*_kv(1, 1, 4, d=24), None)
        with pytest.raises(ValueError, match="head dim that is a multiple of 16, got head dim 24"):
            keys.attention(torch.randn(1, 1, 1, 24), 1.0, None)


# --- attention against float64 -----------------------------------------------------------------------------------


def _reference(layer: MultiHeadAttention, x: Tensor, q_pos: Tensor, cache: KVCache,
               key_mask: Tensor | None = None, *, band: bool = True) -> Tensor:
    """float64 attention of x's queries (B, T) at q_pos over the keys and values ``cache`` holds, through out_proj.

    A query at position p sees a held key at position j >= 0 where j <= p (and p - j < window), and key_mask
    (B, S) allows it; a query that sees none gets 0. ``band=False``: every key (to show that a case tests the mask).
    """
    held = cache.keys_and_values(torch.float64)
    assert held is not None
    b, t, _ = x.shape
    s = held.k.shape[2]
    k_pos = held.positions if held.positions is not None else torch.arange(s).expand(b, s)  # (B, S)
    with torch.no_grad():
        q, k, _ = layer.project(x)  # (B, H, T, D)
        assert layer.rope is not None
        q, _ = layer.rope(q, k, positions=q_pos)
    q = q.double()
    r = q.shape[1] // held.k.shape[1]
    k, v = held.k.repeat_interleave(r, dim=1), held.v.repeat_interleave(r, dim=1)  # (B, G, S, D) -> (B, H, S, D)
    scores = q @ k.transpose(-1, -2) * layer.scale  # (B, H, T, S)
    j, p = k_pos[:, None, :], q_pos[:, :, None]  # (B, 1, S), (B, T, 1)
    visible = (j >= 0) & (j <= p) if band else torch.ones(b, t, s, dtype=torch.bool)  # (B, T, S)
    if band and layer.window is not None:
        visible &= j > p - layer.window
    if band and key_mask is not None:
        visible &= key_mask[:, None, :]
    weights = torch.softmax(scores.masked_fill(~visible[:, None], -torch.inf), dim=-1).nan_to_num(0.0)
    out = (weights @ v).transpose(1, 2).reshape(b, t, -1)  # (B, H, T, D) -> (B, T, H * D)
    w = layer.out_proj.weight.double()
    return F.linear(out, w, None if layer.out_proj.bias is None else layer.out_proj.bias.double())


def _left_padded(b: int, total: int, pad: int) -> tuple[Tensor, Tensor]:
    """key_mask (B, total) with ``pad`` padding tokens first in the last row, and positions (-1 for padding)."""
    key_mask = torch.ones(b, total, dtype=torch.bool)
    key_mask[-1, :pad] = False
    return key_mask, (key_mask.long().cumsum(1) - 1).masked_fill(~key_mask, -1)


def _decode(layer: MultiHeadAttention, x: Tensor, prefill: int, *, positions: Tensor | None = None,
            key_mask: Tensor | None = None, band: bool = True) -> tuple[Tensor, Tensor, KVCache]:
    """Prefill x[:, :prefill] into a KVCache in int8, then one token a step: (outputs, float64 references, cache)."""
    b, total, _ = x.shape
    q_pos = positions if positions is not None else torch.arange(total).expand(b, total)  # (B, total)
    cache, outs, refs = KVCache(dtype=torch.int8), [], []
    with torch.no_grad():
        layer(x[:, :prefill], kv_cache=cache, positions=None if positions is None else positions[:, :prefill],
              key_mask=None if key_mask is None else key_mask[:, :prefill])
        for t in range(prefill, total):
            mask = None if key_mask is None else key_mask[:, : t + 1]
            outs.append(layer(x[:, t : t + 1], kv_cache=cache, key_mask=mask,
                              positions=None if positions is None else positions[:, t : t + 1]))
            refs.append(_reference(layer, x[:, t : t + 1], q_pos[:, t : t + 1], cache, mask, band=band))
    return torch.cat(outs, dim=1), torch.cat(refs, dim=1), cache


CASES = [
    pytest.param(dict(batch=1, prefill=140), id="batch1"),
    pytest.param(dict(batch=2, prefill=270), id="batch2"),
    pytest.param(dict(batch=2, prefill=270, heads=4, kv_heads=1, head_dim=64), id="mqa-head_dim64"),
    pytest.param(dict(batch=2, prefill=270, kv_heads=4), id="mha"),
    pytest.param(dict(batch=1, prefill=CHUNK - 3, steps=6), id="across-a-chunk"),
    pytest.param(dict(batch=2, prefill=270, window=40), id="window"),
    pytest.param(dict(batch=2, prefill=270, hide=(60, 200)), id="key_mask-hides-keys"),
    pytest.param(dict(batch=2, prefill=270, pad=90, key_mask=True), id="left-padding-with-key_mask"),
    pytest.param(dict(batch=2, prefill=270, pad=90, window=40), id="left-padding-window"),
]


@pytest.mark.parametrize("case", CASES)
def test_decoding_steps_equal_float64_attention_over_the_held_keys(case: dict[str, Any],
                                                                    kernel_calls: list[tuple[int, ...]]) -> None:
    """Each one-token step goes through the int8 kernel (S >= 128 * B, head_dim % 16 == 0, CPU) and equals
    float64 attention over the dequantised keys, with the band, the window, padding and key_mask applied
    (where a case has a mask, attending to every key is farther from the output than the tolerance)."""
    b, prefill, steps = case["batch"], case["prefill"], case.get("steps", 3)
    layer = _layer(heads=case.get("heads", 4), kv_heads=case.get("kv_heads", 2), head_dim=case.get("head_dim", 32),
                   window=case.get("window"))
    total = prefill + steps
    x = 2 * torch.randn(b, total, 128)
    key_mask = positions = None
    if "hide" in case:
        key_mask = torch.ones(b, total, dtype=torch.bool)
        key_mask[0, slice(*case["hide"])] = False  # row 0 may not see these keys (prefix positions)
    if "pad" in case:
        mask, positions = _left_padded(b, total, case["pad"])
        key_mask = mask if case.get("key_mask") else None
    out, ref, cache = _decode(layer, x, prefill, positions=positions, key_mask=key_mask)
    assert len(kernel_calls) == steps and all(shape[2] == 1 for shape in kernel_calls)
    torch.testing.assert_close(out.double(), ref, **KERNEL)
    if "hide" in case or "pad" in case or "window" in case:
        with torch.no_grad():
            q_pos = torch.full((b, 1), total - 1) if positions is None else positions[:, -1:]
            unmasked = _reference(layer, x[:, -1:], q_pos, cache, band=False)
        assert float((out[:, -1:].double() - unmasked).abs().max()) > 3 * KERNEL["atol"]


def test_a_query_that_sees_no_key_gets_zero(kernel_calls: list[tuple[int, ...]]) -> None:
    """A padding query (position -1) in a decoding step sees no key: its attention is 0, its output
    out_proj(0), not NaN; the other row is unaffected."""
    layer = _layer()
    x = 2 * torch.randn(2, 271, 128)
    cache = KVCache(dtype=torch.int8)
    with torch.no_grad():
        layer(x[:, :270], kv_cache=cache)
        out = layer(x[:, 270:], kv_cache=cache, positions=torch.tensor([[270], [-1]]))
        ref = _reference(layer, x[:, 270:], torch.tensor([[270], [-1]]), cache)
        nothing = layer.out_proj(torch.zeros(1, 128))
    assert len(kernel_calls) == 1
    torch.testing.assert_close(out[1, 0], nothing[0], atol=0, rtol=0)
    torch.testing.assert_close(out.double(), ref, **KERNEL)


def test_int8_keys_attention_applies_a_visible_mask_per_query_row() -> None:
    """Int8Keys.attention on its own: query rows (R heads x T positions per key/value head) each get their own
    row of ``visible``; an all-False row gives 0; None equals an all-True mask."""
    gen = torch.Generator().manual_seed(0)
    b, g, r, t, s, d = 2, 2, 2, 3, 300, 32
    cache = KVCache(dtype=torch.int8)
    k, v = torch.randn(b, g, s, d, generator=gen), torch.randn(b, g, s, d, generator=gen)
    keys = cache.update(k, v, None)
    q = 2 * torch.randn(b, g * r, t, d, generator=gen)
    visible = torch.rand(b, 1, t, s, generator=gen) < 0.3
    visible[1, 0, 1] = False  # row 1's second query sees nothing
    out = keys.attention(q, d**-0.5, visible)  # (B, H, T, D)
    held = cache.keys_and_values(torch.float64)
    assert held is not None
    kk, vv = held.k.repeat_interleave(r, dim=1), held.v.repeat_interleave(r, dim=1)  # (B, H, S, D)
    scores = (q.double() @ kk.transpose(-1, -2) * d**-0.5).masked_fill(~visible, -torch.inf)
    expected = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vv  # (B, H, T, D)
    assert out.shape == (b, g * r, t, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)  # measured <= 1.3e-2 * (1 + |out|)
    torch.testing.assert_close(out[1, :, 1], torch.zeros(g * r, d), atol=0, rtol=0)
    assert float(out[0].abs().min(dim=-1).values.max()) > 0  # the others are not 0
    every = torch.ones(b, 1, t, s, dtype=torch.bool)
    torch.testing.assert_close(keys.attention(q, d**-0.5, None), keys.attention(q, d**-0.5, every), atol=0, rtol=0)


def test_a_head_dim_the_kernel_cannot_read_attends_over_dequantised_keys(kernel_calls: list[tuple[int, ...]]) -> None:
    """head_dim 24 is not a multiple of 16 (the kernel returns wrong numbers or crashes for it): every call
    dequantises, and equals the float64 reference to float32 precision."""
    layer = _layer(head_dim=24)
    x = 2 * torch.randn(1, 143, 128)
    out, ref, _ = _decode(layer, x, 140)
    assert kernel_calls == []
    torch.testing.assert_close(out.double(), ref, **EXACT)


@pytest.mark.parametrize(("new", "window", "kernel"), [(40, None, False), (8, None, True), (8, 6, True)])
def test_a_call_of_several_tokens(new: int, window: int | None, kernel: bool,
                                  kernel_calls: list[tuple[int, ...]]) -> None:
    """40 new tokens (80 query rows per key/value head) dequantise; 8 (16 rows) take the kernel, which must
    apply the causal band (and window) among the new tokens: each sees only those before it."""
    layer = _layer(window=window)
    x = 2 * torch.randn(1, 140 + new, 128)
    q_pos = torch.arange(140, 140 + new)[None]  # (1, T)
    cache = KVCache(dtype=torch.int8)
    with torch.no_grad():
        layer(x[:, :140], kv_cache=cache)
        kernel_calls.clear()
        out = layer(x[:, 140:], kv_cache=cache)
        ref = _reference(layer, x[:, 140:], q_pos, cache)
        every_key = _reference(layer, x[:, 140:], q_pos, cache, band=False)
    assert kernel_calls == ([(1, 4, new, 32)] if kernel else [])
    tolerance = KERNEL if kernel else EXACT
    torch.testing.assert_close(out.double(), ref, **tolerance)
    if window is not None or not kernel:  # (8 tokens without a window: the band moves the output by ~4e-2 only)
        assert float((out.double() - every_key).abs().max()) > 3 * tolerance["atol"]


def test_a_bfloat16_layer_decodes_through_the_kernel(kernel_calls: list[tuple[int, ...]]) -> None:
    layer = _layer(dtype=torch.bfloat16)
    x = (2 * torch.randn(2, 273, 128)).bfloat16()
    _, positions = _left_padded(2, 273, 50)  # positions alone: -1 hides the padding
    out, ref, _ = _decode(layer, x, 270, positions=positions)
    assert len(kernel_calls) == 3 and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, **KERNEL_BF16)


# The int8 storage itself: keys and values rounded to 1/254 of each vector's largest entry, then the kernel's
# rounding. Measured on these layers (2 * randn inputs, 8 seeds): at most 9.7e-3 from the full forward and from a
# float32 cache (outputs up to ~1); the bound is 4x that.
STORAGE = dict(atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 40])
def test_int8_decoding_stays_close_to_the_full_forward_and_a_float_cache(window: int | None,
                                                                         kernel_calls: list[tuple[int, ...]]) -> None:
    layer = _layer(window=window)
    x = 2 * torch.randn(2, 276, 128)
    out, _, _ = _decode(layer, x, 270)
    assert len(kernel_calls) == 6
    cache = KVCache()
    with torch.no_grad():
        full = layer(x)[:, 270:]
        layer(x[:, :270], kv_cache=cache)
        floats = torch.cat([layer(x[:, t : t + 1], kv_cache=cache) for t in range(270, 276)], dim=1)
    torch.testing.assert_close(floats, full, atol=1e-5, rtol=1e-5)  # the float cache is the full forward
    torch.testing.assert_close(out, full, **STORAGE)
    torch.testing.assert_close(out, floats, **STORAGE)
    assert float((out - full).abs().max()) > 1e-4  # the rounding is real: the int8 cache is what was read


# --- wiring: new_caches, generate, the serve engine and the command line ---------------------------------------


def _tiny(dtype: torch.dtype = torch.float32) -> Any:
    """A random Llama of head_dim 16 (the kernel reads it), 2 layers, context 512."""
    from attnkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                         context_length=512)
    model = LlamaModel(config).to(dtype).eval()
    model.stop_token_ids = ()
    return model


def test_new_caches_in_int8_grow_and_are_never_static() -> None:
    model = _tiny()
    caches = model.new_caches(300, dtype=torch.int8)
    assert len(caches) == 2 and all(type(c) is KVCache and c.dtype == torch.int8 and c.capacity == 300 for c in caches)
    assert all(c.capacity is None for c in model.new_caches(dtype=torch.int8))
    with pytest.raises(ValueError, match=r"an int8 cache grows \(KVCache\(dtype=torch\.int8\)\): there is no static"):
        model.new_caches(300, static=True, dtype=torch.int8)


@pytest.mark.parametrize(("options", "message"), [
    (dict(kv_dtype="int8", compile=True), r"compile=True runs over static caches, and kv_dtype='int8' is a growing"),
    (dict(kv_dtype=torch.int8, compile=True), r"compile=True runs over static caches, and kv_dtype='int8'"),
    (dict(kv_dtype="int8", cache="sink:4,64"), r"kv_dtype=torch\.int8 is for the full caches: cache='sink:4,64' "
                                               r"re-rotates the keys it keeps"),
])
def test_generate_refuses_int8_with_compile_or_a_sink_cache(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _tiny().generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, stop_ids=[], **options)


def test_generation_options_take_int8_by_name_or_dtype() -> None:
    from attnkit.models.generation_options import GenerationOptions

    assert GenerationOptions(kv_dtype="int8").kv_dtype is torch.int8
    assert GenerationOptions(kv_dtype=torch.int8).kv_dtype is torch.int8


def test_generate_int8_on_a_float64_model_names_the_dtypes_it_takes() -> None:
    with pytest.raises(ValueError, match=r"KVCache\(dtype=torch\.int8\) takes float32 or bfloat16 keys .*got "
                                         r"torch\.float64"):
        _tiny(torch.float64).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, stop_ids=[], kv_dtype="int8")


@pytest.mark.parametrize("kv_dtype", ["int8", torch.int8])
def test_the_serve_engine_stores_int8_too(kv_dtype: Any) -> None:
    """kv_dtype=int8 means the same in the engine as in generate (issue 38; tests/serve/test_int8_pool.py checks
    the numbers): it was refused."""
    from attnkit.serve import Engine

    assert Engine(_tiny(), lambda ids: "", kv_memory_mib=1, block_size=4, kv_dtype=kv_dtype).pool.dtype == torch.int8


def test_the_command_line_refuses_int8_with_compile(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.cli import main
    from tests._util import need
    from tests.models._decoder import write_tiny_llama

    need("gguf")
    need("tokenizers")
    need("rich")
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, context=64)
    assert main(["generate", "--gguf", str(path), "--kv-dtype", "int8", "--compile", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--compile runs over static caches and --kv-dtype int8 is a growing cache" in err
    assert err.count("\n") == 1


def test_generate_int8_gives_each_left_padded_row_what_it_gets_alone(kernel_calls: list[tuple[int, ...]]) -> None:
    """Row independence: a batch of a 300-token and a 263-token prompt (37 padding tokens first) decodes
    through the kernel and each row gets the greedy tokens it gets alone, also with kv_dtype='int8'."""
    model = _tiny()
    gen = torch.Generator().manual_seed(1)
    long, short = torch.randint(3, 64, (1, 300), generator=gen), torch.randint(3, 64, (1, 263), generator=gen)
    ids = torch.cat([long, F.pad(short, (37, 0), value=model.pad_token_id)])  # (2, 300)
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, :37] = 0
    out = model.generate(ids, mask, max_new_tokens=8, stop_ids=[], kv_dtype="int8")
    assert out.shape == (2, 308) and torch.equal(out[:, :300], ids)
    assert len(kernel_calls) == 7 * 2  # every decoding step of both layers (the prompt dequantises)
    for row, prompt in enumerate((long, short)):
        alone = model.generate(prompt, max_new_tokens=8, stop_ids=[], kv_dtype="int8")
        assert torch.equal(out[row, 300:], alone[0, prompt.shape[1] :]), row


# --- SmolLM2 ------------------------------------------------------------------------------------------------------


def _teacher_forced(model: Any, ids: Tensor, dtype: torch.dtype | None, prefill: int) -> Tensor:
    """Greedy choices (T,) at every position: the first ``prefill`` tokens in one call, the rest one at a time."""
    caches = model.new_caches(dtype=dtype)
    with torch.inference_mode():
        logits = [model(ids[:, :prefill], kv_caches=caches)[0]]  # (prefill, V)
        logits += [model.step(ids[:, t : t + 1], None, caches) for t in range(prefill, ids.shape[1])]  # (1, V) each
    return torch.cat(logits).argmax(dim=-1)


@pytest.mark.slow
def test_smollm2_int4_with_an_int8_cache_misses_the_greedy_bar_by_a_point(kernel_calls: list[tuple[int, ...]]) -> None:
    """int4 weights over int8 caches: greedy choices at the 256 positions of the quantize test's text (it has
    257 tokens: 128 prefilled, then 128 decoded one at a time through the kernel, teacher-forced) against the
    float32 model's full forward. The bar is the weight forms' (>= 97%): measured 96.1% (10 of 256 choices
    differ, near-ties: float32's top two logits 0.004-0.2 apart there), against 98.4% for int4 over a float32
    cache, so the int8 cache is opt-in, never a default (BENCHMARKS.md). This pins the measured levels: a
    regression below them fails, and so does the kernel path not being taken."""
    from attnkit.models import load_smollm2
    from tests.models._decoder import smollm2
    from tests.modules.test_quantize import TEXT

    reference = smollm2()
    ids = reference.tokenize(TEXT)["input_ids"][:, :256]
    assert ids.shape[1] == 256
    with torch.inference_mode():
        expected = reference(ids)[0].argmax(dim=-1)  # (256,)
    model = load_smollm2(weights="int4")
    int8 = _teacher_forced(model, ids, torch.int8, 128)
    assert len(kernel_calls) == 128 * len(model.layers)  # every decoding step, every layer
    floats = _teacher_forced(model, ids, None, 128)
    agreement = float((int8 == expected).double().mean())
    decoded = float((int8[128:] == expected[128:]).double().mean())
    float_cache = float((floats == expected).double().mean())
    report = (f"int4 + int8 cache {agreement:.2%} of float32's choices ({decoded:.2%} of the 128 decoded through "
              f"the kernel); int4 + float32 cache {float_cache:.2%}; int8 vs float32 cache, both int4: "
              f"{float((int8 == floats).double().mean()):.2%}")
    assert agreement >= 0.955, report
    assert float((int8 == floats).double().mean()) >= 0.97, report  # the cache alone changes few choices
