"""What each rank runs in the spawned worlds of test_ring.py: every case once, its result by name.

A case returns "ok" or the text of its failure, so that one spawn per world
size serves many parametrized tests.
"""

from __future__ import annotations

import time
import traceback
import zlib
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit.backends import chunked
from attnkit.distributed import ContextParallel, ring, ring_attention, ring_timing, shard, timing, unshard
from attnkit.functional import alibi, document_mask, prefix_lm, sink_window

from . import modifier_cases

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}
LAYOUTS = ("contiguous", "zigzag")
# (layout, causal, dtype name, (H, G), key mask kind)
EXACT_CASES = [
    (layout, causal, dtype, heads, masks)
    for layout in LAYOUTS for causal in (False, True) for dtype in ("float32", "float64")
    for heads, masks in (((4, 2), "none"), ((4, 1), "rank-padding"), ((2, 2), "empty-row"))
]
LAYER_CASES = [(layout, causal, dtype) for layout in LAYOUTS for causal in (False, True)
               for dtype in ("float32", "float64")]
ERROR_CASES = ["heads", "dtype", "layout", "causal", "length", "bad-key-mask", "odd-zigzag", "shard-length",
               "grads-on-one-rank", "unshard-lengths", "layer-dropout-on-one-rank", "layer-odd-shard-on-one-rank",
               "layer-kv-cache", "layer-x-on-one-rank", "layer-width-on-one-rank", "shard-dim", "not-a-strategy",
               "scale", "bad-scale", "layer-positions-on-one-rank",
               "score-mod-on-one-rank", "mask-mods-differ", "sinks-on-one-rank", "bad-sinks",
               "sinks-grad-on-one-rank", "doc-ids-of-the-shard", "mask-mod-not-bool", "score-mod-wrong-shape"]
OTHER_CASES = ["exact-scale", "ring-timing"]


def _other_error(kind: str, rank: int) -> tuple[Callable[[], object], str] | None:
    """(call, message) of the error cases beyond ring_attention's arguments; rank 1 is the odd one."""
    odd = rank == 1
    torch.manual_seed(0)
    parallel = ContextParallel()
    layer = attnkit.MultiHeadAttention(16, 16, 4, rope=True, causal=True, dropout=0.1, backend=parallel)
    layer.train(odd)  # dropout in training on rank 1 only
    x = torch.randn(1, 3 if odd and kind == "layer-odd-shard-on-one-rank" else 4, 16)
    if kind == "grads-on-one-rank":
        q = torch.randn(1, 2, 4, 8, requires_grad=odd)
        return (lambda: ring_attention(q, q.detach(), q.detach()),
                r"ranks disagree on gradients needed: rank 0 has False, rank 1 has True")
    if kind == "unshard-lengths":
        part = torch.zeros(2, 6 if odd else 4)
        return lambda: unshard(part, 1), r"unshard: ranks disagree on shape: rank 0 has \(2, 4\), rank 1 has \(2, 6\)"
    if kind == "layer-dropout-on-one-rank":
        return (lambda: layer(x),
                r"context-parallel attention: invalid arguments on rank 1: .*no dropout; got dropout=0.1 in training")
    if kind == "layer-odd-shard-on-one-rank":
        layer.eval()
        return (lambda: layer(x),
                r"invalid arguments on rank 1: a 'zigzag' shard holds 2 equal chunks, so its length n=3 must be even")
    if kind == "shard-dim":
        return (lambda: shard(torch.zeros(2, 4), 7),
                r"shard: dim must be an int in \[-2, 2\) for a 2-d tensor, got dim=7")
    if kind == "not-a-strategy":
        with pytest.raises(TypeError, match=r"a kernel component with methods prepare and attention .* object lacks "
                                            r"prepare, attention"):
            attnkit.MultiHeadAttention(16, 16, 4, backend=object())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'parallel'"):  # removed: CHANGELOG.md
            layer(x, parallel=parallel)
        return lambda: shard([1, 2], 0), r"shard takes a torch.Tensor, got list"
    if kind == "layer-x-on-one-rank":  # the layer's own check failed on rank 1 alone: rank 0 waited in the ring
        layer.eval()
        return (lambda: layer(x.double() if odd else x),
                r"context-parallel attention: invalid arguments on rank 1: x is torch.float64 on cpu but the layer "
                r"computes in torch.float32")
    if kind == "layer-width-on-one-rank":
        layer.eval()
        return (lambda: layer(torch.randn(1, 4, 15) if odd else x),
                r"invalid arguments on rank 1: x must be a \(B, T, d_in=16\) tensor with T >= 1, got \(1, 4, 15\)")
    if kind == "layer-kv-cache":
        layer.eval()
        return (lambda: layer(x, kv_cache=attnkit.KVCache() if odd else None),
                r"invalid arguments on rank 1: a context-parallel call takes no positions, kv_cache.*; got kv_cache")
    if kind == "layer-positions-on-one-rank":
        layer.eval()
        return (lambda: layer(x, positions=torch.arange(4).expand(1, 4) if odd else None),
                r"invalid arguments on rank 1: a context-parallel call takes no positions.*; got positions")
    return None


def case_name(*parts: object) -> str:
    return "-".join(str(p) for p in parts)


def _key_mask(kind: str, b: int, t: int, world: int, layout: str, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.rand(b, t, generator=gen) > 0.3
    if kind == "rank-padding":  # row 0: every key the last rank holds is padding
        mask[0, torch.tensor(_positions_of(world - 1, world, layout, t))] = False
    else:  # row 1 has no real key at all: its output must be 0
        mask[1] = False
    return mask


def _positions_of(rank: int, world: int, layout: str, t: int) -> list[int]:
    from attnkit.distributed.layout import chunk_positions

    return [p for r in chunk_positions(rank, world, layout, t) for p in r]


def exact_case(layout: str, causal: bool, dtype_name: str, heads: tuple[int, int], masks: str,
               scale: float | None = None) -> None:
    """ring_attention's output and q, k, v gradients equal single-process attention on whole tensors."""
    world, dtype = dist.get_world_size(), getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((layout, causal, dtype_name, heads, masks)).encode()))
    (h, g), b, t, d = heads, 2, 12 * world, 8
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype) for shape in ((b, h, t, d), (b, g, t, d), (b, g, t, d)))
    w = torch.randn(b, h, t, d, generator=gen, dtype=dtype)
    key_mask = _key_mask(masks, b, t, world, layout, gen)
    full = [x.double().requires_grad_() for x in (q, k, v)]
    expected = attnkit.attention(*full, causal=causal, key_mask=key_mask, scale=scale, backend="math")
    expected_grads = torch.autograd.grad((expected * w.double()).sum(), full)
    local = [shard(x, 2, layout=layout).requires_grad_() for x in (q, k, v)]
    local_mask = None if key_mask is None else shard(key_mask, 1, layout=layout)
    # tiles inside each block, and pieces of 4 positions (chunks of 6 travel as 4 + 2, of 12 as 4 + 4 + 4)
    with mock.patch.object(chunked, "_block_sizes", lambda b, h, t, s: (4, 5)), \
            mock.patch.object(ring, "_piece_rows", lambda chunk: min(chunk, 4)):
        out = ring_attention(*local, causal=causal, key_mask=local_mask, scale=scale, layout=layout)
        grads = torch.autograd.grad((out * shard(w, 2, layout=layout)).sum(), local)
    assert out.dtype == dtype and out.shape == (b, h, t // world, d)
    torch.testing.assert_close(out.double(), shard(expected.detach(), 2, layout=layout), **TOL[dtype])
    for name, got, exp in zip("qkv", grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), shard(exp, 2, layout=layout), **TOL[dtype],
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
    torch.testing.assert_close(unshard(out, 2, layout=layout).double(), expected.detach(), **TOL[dtype])


def layer_case(layout: str, causal: bool, dtype_name: str) -> None:
    """MultiHeadAttention(..., backend=ContextParallel(...)) on shards equals the single-process layer."""
    world, dtype = dist.get_world_size(), getattr(torch, dtype_name)
    torch.manual_seed(7)
    layer = attnkit.MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=True, causal=causal).to(dtype)
    single = attnkit.MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=True, causal=causal).to(dtype)
    gen = torch.Generator().manual_seed(3)
    b, t = 2, 4 * world
    x = torch.randn(b, t, 16, generator=gen, dtype=dtype)
    key_mask = torch.rand(b, t, generator=gen) > 0.25
    key_mask[:, 0] = True
    w = torch.randn(b, t, 16, generator=gen, dtype=dtype)
    single.load_state_dict(layer.state_dict())
    expected = single(x, key_mask=key_mask)
    expected_grads = torch.autograd.grad((expected * w).sum(), list(single.parameters()))
    parallel = ContextParallel(layout=layout)
    layer.backend = parallel  # the same layer, its attention now a ring
    out = layer(parallel.shard(x), key_mask=parallel.shard(key_mask))
    grads = torch.autograd.grad((out * parallel.shard(w)).sum(), list(layer.parameters()))
    torch.testing.assert_close(out, parallel.shard(expected.detach()), **TOL[dtype])
    for grad, exp in zip(grads, expected_grads, strict=True):
        dist.all_reduce(grad)  # parameters are replicated: their gradients sum over ranks
        torch.testing.assert_close(grad, exp, **TOL[dtype])


def timing_case() -> None:
    """ring_timing sums the ring's ranges (computing on every rank, waiting where there are peers) within the
    block's wall time; an inner block counts only its own calls, a closed block nothing more; every range is a
    torch.profiler.record_function range of the ring's names (what any profiler sees). No profiler runs here: a
    profiler leaves kineto's config thread in the process (suspected in a rank's abort at exit)."""
    world = dist.get_world_size()
    q = torch.randn(1, 2, 8 * world, 8, requires_grad=True)
    names: list[str] = []
    real = timing.record_function

    def recorded(name: str):
        names.append(name)
        return real(name)

    start = time.perf_counter()
    with mock.patch.object(timing, "record_function", recorded), ring_timing() as spent:
        ring_attention(q, q, q, causal=True).sum().backward()
        with ring_timing() as inner:
            ring_attention(q, q, q, causal=True).sum().backward()
        nested = (inner.compute_s, inner.wait_s)
    elapsed = time.perf_counter() - start
    assert spent.compute_s > 0 and (spent.wait_s > 0 or world == 1), spent
    assert spent.compute_s + spent.wait_s <= elapsed, (spent, elapsed)
    assert 0 < inner.compute_s < spent.compute_s and inner.wait_s <= spent.wait_s, (inner, spent)
    ring_attention(q, q, q, causal=True).sum().backward()  # after both blocks: counted by neither
    assert (inner.compute_s, inner.wait_s) == nested
    assert set(names) == {timing.COMPUTE_EVENT, timing.WAIT_EVENT}, set(names)


_MOD_ERRORS: dict[str, tuple[Callable[[bool], dict], str]] = {  # modifiers: (rank 1 odd?) -> arguments, message
    "score-mod-on-one-rank": (lambda odd: dict(score_mod=alibi(4) if odd else None),
                              r"ranks disagree on score_mod: rank 0 has None, rank 1 has 'alibi\(4 heads\)'"),
    "mask-mods-differ": (lambda odd: dict(mask_mod=sink_window(1, 2) if odd else prefix_lm(2)),
                         r"ranks disagree on mask_mod: rank 0 has 'or_masks\(causal\(\), prefix_length=2\)'"),
    "sinks-on-one-rank": (lambda odd: dict(sinks=torch.zeros(4) if odd else None),
                          r"ranks disagree on sinks given: rank 0 has False, rank 1 has True"),
    "bad-sinks": (lambda odd: dict(sinks=torch.zeros(3 if odd else 4)),
                  r"invalid arguments on rank 1: sinks must be a floating-point \(H,\) = \(4,\) tensor"),
    "sinks-grad-on-one-rank": (lambda odd: dict(sinks=torch.zeros(4, requires_grad=odd)),
                               r"ranks disagree on gradients needed: rank 0 has False, rank 1 has True"),
    "doc-ids-of-the-shard": (lambda odd: dict(mask_mod=document_mask(torch.zeros(4, dtype=torch.long))),
                             r"rank 0: document_mask\(doc_ids \(4,\)\): doc_ids must label positions 0 \.\. "
                             r"{last} .*; rank 1: document_mask"),  # the whole sequence's T - 1, not n - 1
    "mask-mod-not-bool": (lambda odd: dict(mask_mod=(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx).float())
                                           if odd else None),
                          r"invalid arguments on rank 1: mask_mod .*<lambda> returned a torch.float32 tensor; "
                          r"expected a bool tensor"),
    "score-mod-wrong-shape": (lambda odd: dict(score_mod=lambda s, b, h, q_idx, kv_idx: s.flatten()),
                              r"rank 0: score_mod .*<lambda> returned shape \(4,\); expected the scores' shape "
                              r"\(1, 4, 1, 1\)"),
}


def _error_args(kind: str, rank: int) -> tuple[dict, str]:
    """ring_attention arguments where rank 1 differs (or all are wrong), and the message every rank must get."""
    q, k, v = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    args: dict = dict(q=q, k=k, v=v, causal=False, layout="zigzag", key_mask=None)
    odd = rank == 1
    if kind == "heads" and odd:
        args.update(q=torch.randn(1, 2, 4, 8))
    elif kind == "dtype" and odd:
        args.update(q=q.double(), k=k.double(), v=v.double())
    elif kind == "layout" and odd:
        args.update(layout="contiguous")
    elif kind == "causal" and odd:
        args.update(causal=True)
    elif kind == "length" and odd:
        args.update(q=torch.randn(1, 4, 6, 8), k=torch.randn(1, 2, 6, 8), v=torch.randn(1, 2, 6, 8))
    elif kind == "bad-key-mask" and odd:
        args.update(key_mask=torch.ones(1, 5, dtype=torch.bool))
    elif kind == "odd-zigzag":
        args.update(q=q[:, :, :3], k=k[:, :, :3], v=v[:, :, :3])
    elif kind == "scale" and odd:
        args.update(scale=0.5)
    elif kind == "bad-scale" and odd:
        args.update(scale=-1.0)
    elif kind in _MOD_ERRORS:
        args.update(_MOD_ERRORS[kind][0](odd))
    expected = {
        "heads": r"ranks disagree on query heads H: rank 0 has 4, rank 1 has 2",
        "dtype": r"ranks disagree on dtype: rank 0 has 'torch.float32', rank 1 has 'torch.float64'",
        "layout": r"ranks disagree on layout: rank 0 has 'zigzag', rank 1 has 'contiguous'",
        "causal": r"ranks disagree on causal: rank 0 has False, rank 1 has True",
        "length": r"ranks disagree on shard length n: rank 0 has 4, rank 1 has 6",
        "bad-key-mask": r"invalid arguments on rank 1: key_mask must be a bool \(B, n\) = \(1, 4\)",
        "odd-zigzag": r"rank 0: a 'zigzag' shard holds 2 equal chunks, so its length n=3 must be even",
        "scale": r"ranks disagree on scale: rank 0 has None, rank 1 has 0.5",
        "bad-scale": r"invalid arguments on rank 1: scale must be a positive finite number or None, got scale=-1.0",
        **{name: message.replace("{last}", str(4 * dist.get_world_size() - 1))
           for name, (_, message) in _MOD_ERRORS.items()},
    }[kind]
    return args, expected


def error_case(kind: str) -> None:
    """Every rank raises the same clear ValueError, and the process group still works afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "shard-length":
        with pytest.raises(ValueError, match=rf"must be a positive multiple of {2 * world} \(2P\)"):
            shard(torch.zeros(1, 2 * world + 1), 1, layout="zigzag")
        return
    other = _other_error(kind, rank)
    if other is not None:
        call, expected = other
        with pytest.raises(ValueError, match=expected):
            call()
    else:
        args, expected = _error_args(kind, rank)
        with pytest.raises(ValueError, match=expected):
            ring_attention(**args)
    probe = torch.ones(1)
    dist.all_reduce(probe)
    assert probe.item() == world


def run_cases(rank: int, world: int) -> dict[str, str]:
    """Every case in this world; each one's "ok" or failure text."""
    cases: dict[str, Callable[[], None]] = {}
    for c in EXACT_CASES:
        cases[case_name("exact", *c[:3], f"H{c[3][0]}G{c[3][1]}", c[4])] = lambda c=c: exact_case(*c)
    for c in LAYER_CASES:
        cases[case_name("layer", *c)] = lambda c=c: layer_case(*c)
    cases["exact-scale"] = lambda: exact_case("zigzag", True, "float64", (4, 2), "rank-padding", scale=0.3)
    cases["ring-timing"] = timing_case
    cases.update(modifier_cases.cases())
    for kind in ERROR_CASES if world > 1 else ():  # one rank has no peer to disagree with
        cases[case_name("error", kind)] = lambda kind=kind: error_case(kind)
    results = {}
    for name, run in cases.items():
        try:
            run()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()  # keep the ranks in step whatever a case did
    return results


def hang_or_die(rank: int, world: int, how: str) -> None:
    """Rank 1 hangs or dies while rank 0 enters the ring."""
    if rank == 1:
        if how == "die":
            import os

            os._exit(3)
        time.sleep(600)
    ring_attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


def sleep_forever(rank: int, world: int) -> None:
    time.sleep(600)
