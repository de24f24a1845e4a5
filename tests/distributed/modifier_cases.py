"""Ring attention with score / mask modifiers and learned sinks: what each rank runs (see workers.py).

Every case builds its modifiers once over the whole sequence of T = 12 * P
positions, runs single-process attention (the math backend, float64) with them
and the ring on shards with the same objects, and compares outputs and
gradients on whole tensors: q, k, v per shard; sinks and the tensors a score
modifier closes over summed over ranks (each rank holds its share, as for a
replicated parameter).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

import attnkit
from attnkit.backends import chunked
from attnkit.distributed import ContextParallel, ring, ring_attention, shard
from attnkit.distributed.layout import chunk_positions
from attnkit.functional import MaskModifier, Visibility, alibi, document_mask, prefix_lm, sink_window, softcap

TOL = dict(atol=1e-10, rtol=1e-10)
KINDS = ("alibi", "alibi-learned", "softcap-learned", "document", "document-prefix-lm", "prefix-lm", "sink-window",
         "sinks", "plain-functions", "hides-everything", "everything")
MOD_CASES = [(layout, kind) for layout in ("contiguous", "zigzag") for kind in KINDS]
# Tolerances are float64's: a modifier evaluated at local instead of global positions moves outputs by far more.


def _doc_ids(gen: torch.Generator, b: int, t: int, world: int) -> torch.Tensor:
    """(B, T) sorted document ids whose boundaries fall inside chunks, so that documents cross chunk and
    shard boundaries."""
    rows = []
    for _ in range(b):
        drawn = torch.randint(1, t, (max(3, world + 2),), generator=gen).tolist()
        cuts = sorted({c for c in drawn if c % 6})  # never at a chunk's edge (chunks are 6 or 12 long)
        ids = torch.zeros(t, dtype=torch.long)
        for cut in cuts:
            ids[cut:] += 1
        rows.append(ids * 3)  # ids need not be consecutive
    return torch.stack(rows)  # (B, T)


def _setup(kind: str, gen: torch.Generator, b: int, h: int, t: int, world: int
           ) -> tuple[dict, list[torch.Tensor], str]:
    """(keyword arguments shared by both sides, the learned tensors, the key mask kind)."""
    if kind == "alibi":
        return dict(causal=True, score_mod=alibi(h)), [], "none"
    if kind == "alibi-learned":
        slopes = torch.rand(h, generator=gen, dtype=torch.float64).requires_grad_()
        return dict(causal=False, score_mod=alibi(slopes=slopes)), [slopes], "rank-padding"
    if kind == "softcap-learned":
        cap = (1.0 + torch.rand(h, generator=gen, dtype=torch.float64)).requires_grad_()
        return dict(causal=True, score_mod=softcap(cap)), [cap], "none"
    if kind == "document":
        return dict(causal=True, mask_mod=document_mask(_doc_ids(gen, b, t, world))), [], "none"
    if kind == "document-prefix-lm":  # positions restart in each document: a global / local mix-up shows
        return dict(causal=False, mask_mod=document_mask(_doc_ids(gen, 1, t, world)[0], prefix_lm(2))), [], "none"
    if kind == "prefix-lm":
        lengths = torch.tensor([t // 2 + 1, 3])  # (B,): one prefix ends inside another rank's chunk
        return dict(causal=False, mask_mod=prefix_lm(lengths)), [], "rank-padding"
    if kind == "sink-window":
        return dict(causal=False, mask_mod=sink_window(2, 5), score_mod=softcap(3.0)), [], "none"
    if kind == "sinks":
        sinks = torch.randn(h, generator=gen, dtype=torch.float64).requires_grad_()
        return dict(causal=True, sinks=sinks), [sinks], "empty-row"
    if kind == "plain-functions":  # FlexAttention's form: no block rule, a closure over a learned table
        table = torch.randn(h, 2 * t, generator=gen, dtype=torch.float64).requires_grad_()

        def relative(score, b_, h_, q_idx, kv_idx):
            return score + table[h_, q_idx - kv_idx + t]

        def stripes(b_, h_, q_idx, kv_idx):
            return (q_idx - kv_idx) % 3 != 1

        return dict(causal=True, score_mod=relative, mask_mod=stripes), [table], "none"
    if kind == "hides-everything":  # its rule skips every pair on every rank: outputs 0, with sinks too
        sinks = torch.randn(h, generator=gen, dtype=torch.float64).requires_grad_()
        return dict(causal=False, mask_mod=_Nothing(), sinks=sinks), [sinks], "none"
    sinks = torch.randn(h, generator=gen, dtype=torch.float64).requires_grad_()
    slopes = torch.rand(h, generator=gen, dtype=torch.float64).requires_grad_()
    return (dict(causal=True, score_mod=alibi(slopes=slopes), mask_mod=document_mask(_doc_ids(gen, b, t, world)),
                 sinks=sinks), [slopes, sinks], "rank-padding")


class _Nothing(MaskModifier):
    """Hides every key, and says so by its block rule (so no rank computes a single pair)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return torch.zeros_like(q_idx - kv_idx, dtype=torch.bool)

    def block_rule(self, batch, q_positions, kv_positions):
        return lambda qs, ks: Visibility.NONE


def _key_mask(kind: str, gen: torch.Generator, b: int, t: int, world: int, layout: str) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.rand(b, t, generator=gen) > 0.3
    if kind == "rank-padding":  # row 0: every key the last rank holds is padding
        mask[0, [p for r in chunk_positions(world - 1, world, layout, t) for p in r]] = False
    else:  # row 1 has no real key at all: its output must be 0 (with sinks too)
        mask[1] = False
    return mask


def modifier_case(layout: str, kind: str) -> None:
    """ring_attention with modifiers and sinks equals single-process attention with the same ones over the whole
    sequence: output and the gradients of q, k, v, sinks and learned modifier tensors."""
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(zlib.crc32(repr((layout, kind)).encode()))
    b, h, g, t, d = 2, 4, (1 if kind == "everything" else 2), 12 * world, 8
    q, k, v = (torch.randn(b, n, t, d, generator=gen, dtype=torch.float64) for n in (h, g, g))
    w = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    options, learned, mask_kind = _setup(kind, gen, b, h, t, world)
    key_mask = _key_mask(mask_kind, gen, b, t, world, layout)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = attnkit.attention(*full, key_mask=key_mask, backend="math", **options)
    expected_grads = torch.autograd.grad((expected * w).sum(), full + learned)
    local = [shard(x, 2, layout=layout).requires_grad_() for x in (q, k, v)]
    local_mask = None if key_mask is None else shard(key_mask, 1, layout=layout)
    with mock.patch.object(chunked, "_block_sizes", lambda b, h, t, s: (4, 5)), \
            mock.patch.object(ring, "_piece_rows", lambda chunk: min(chunk, 4)):
        if kind == "everything":  # through the kernel component, as a layer calls it
            out = ContextParallel(layout=layout).attention(*local, key_mask=local_mask, **options)
        else:
            out = ring_attention(*local, key_mask=local_mask, layout=layout, **options)
        grads = torch.autograd.grad((out * shard(w, 2, layout=layout)).sum(), local + learned)
    torch.testing.assert_close(out, shard(expected.detach(), 2, layout=layout), **TOL)
    for name, got, exp in zip("qkv", grads[:3], expected_grads[:3], strict=True):
        torch.testing.assert_close(got, shard(exp, 2, layout=layout), **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
    for got, exp in zip(grads[3:], expected_grads[3:], strict=True):
        total = got.clone()
        dist.all_reduce(total)  # each rank's share, from its own queries
        torch.testing.assert_close(total, exp, **TOL, msg=lambda m: f"grad of a learned tensor: {m}")


def skipping_case(layout: str) -> None:
    """A document mask whose documents are the layout's chunks: the block rule skips every pair across
    documents (no block kernel runs on one), in the forward and the backward, and the result stays exact."""
    world = dist.get_world_size()
    b, h, t, d = 1, 2, 12 * world, 8
    size = len(chunk_positions(0, world, layout, t)[0])
    ids = torch.arange(t) // size  # (T,): document c is chunk c
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for _ in range(3))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = attnkit.attention(*full, causal=True, mask_mod=document_mask(ids), backend="math")
    expected_grads = torch.autograd.grad(expected.sum(), full)
    pairs: list[tuple[range, range]] = []

    def recorded(kernel: Callable) -> Callable:
        def run(plan, q_rows, k_part, *args):
            first_q = plan.mods.key_start + plan.offset
            pairs.append((range(first_q, first_q + q_rows.shape[2]),
                          range(plan.mods.key_start, plan.mods.key_start + k_part.shape[2])))
            return kernel(plan, q_rows, k_part, *args)
        return run

    local = [shard(x, 2, layout=layout).requires_grad_() for x in (q, k, v)]
    with mock.patch.object(ring, "_piece_rows", lambda chunk: min(chunk, 4)), \
            mock.patch.object(ring, "block_forward", recorded(ring.block_forward)), \
            mock.patch.object(ring, "block_gradients", recorded(ring.block_gradients)):
        out = ring_attention(*local, causal=True, layout=layout, mask_mod=document_mask(ids))
        grads = torch.autograd.grad(out.sum(), local)
    own = chunk_positions(dist.get_rank(), world, layout, t)
    pieces = -(-size // min(size, 4))
    assert len(pairs) == 2 * len(own) * pieces, pairs  # one pair per own chunk and piece, forward and backward
    for queries, keys in pairs:
        assert queries.start // size == keys.start // size == (keys.stop - 1) // size, (queries, keys)
    torch.testing.assert_close(out, shard(expected.detach(), 2, layout=layout), **TOL)
    for got, exp in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, shard(exp, 2, layout=layout), **TOL)


def layer_case(layout: str) -> None:
    """MultiHeadAttention with ALiBi, a document mask and learned sinks, backend=ContextParallel, equals the
    single-process layer (output, and parameter gradients summed over ranks, the sinks' included)."""
    world = dist.get_world_size()
    b, t = 2, 4 * world
    gen = torch.Generator().manual_seed(11)
    ids = _doc_ids(gen, b, t, world)
    x = torch.randn(b, t, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(b, t, 16, generator=gen, dtype=torch.float64)

    def make() -> attnkit.MultiHeadAttention:
        torch.manual_seed(7)
        sinks = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        return attnkit.MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=True, causal=True, score_mod=alibi(4),
                                          mask_mod=document_mask(ids), sinks=sinks, dtype=torch.float64)

    single, layer = make(), make()
    expected = single(x)
    expected_grads = torch.autograd.grad((expected * w).sum(), list(single.parameters()))
    parallel = ContextParallel(layout=layout)
    layer.backend = parallel
    out = layer(parallel.shard(x))
    grads = torch.autograd.grad((out * parallel.shard(w)).sum(), list(layer.parameters()))
    torch.testing.assert_close(out, parallel.shard(expected.detach()), **TOL)
    for grad, exp in zip(grads, expected_grads, strict=True):
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, exp, **TOL)


def cases() -> dict[str, Callable[[], None]]:
    """Every modifier case by name."""
    out: dict[str, Callable[[], None]] = {}
    for layout, kind in MOD_CASES:
        out[f"mods-{layout}-{kind}"] = lambda layout=layout, kind=kind: modifier_case(layout, kind)
    for layout in ("contiguous", "zigzag"):
        out[f"mods-skipping-{layout}"] = lambda layout=layout: skipping_case(layout)
        out[f"mods-layer-{layout}"] = lambda layout=layout: layer_case(layout)
    return out


NAMES = [f"mods-{layout}-{kind}" for layout, kind in MOD_CASES] + [
    f"mods-{what}-{layout}" for layout in ("contiguous", "zigzag") for what in ("skipping", "layer")]
