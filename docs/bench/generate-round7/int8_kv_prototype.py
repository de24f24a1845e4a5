"""A measurement prototype, not library code: decoding over an int8 KV cache read by ``torch._weight_int8pack_mm``.

    .venv/bin/python docs/bench/generate-round7/int8_kv_prototype.py 4000   # and 7900

Keys are stored as int8 rows with one bfloat16 scale per key and head: exactly the int8 kernel's weight
format, so the scores of a key/value head's query rows are one kernel call. Values are stored transposed
(head dim x capacity, int8, one float32 scale per key folded into the probabilities), capacity grown in
chunks of 1,024 keys, and the whole capacity is read with zero probabilities past the last key (the kernel
refuses strided weights). The float32 cache is still written beside it (the prototype reuses KVCache for the
prompt and the cache protocol), but decoding steps read only the int8 copies. It patches
``AttentionHeads.attend`` for one-row decoding at batch 1 and prints decode tokens/s against the float32
cache, alternating, with how many greedy tokens agree.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

import attnkit.models.generation as gen
from attnkit.bench.generate import prompt_ids
from attnkit.models import load_smollm2
from attnkit.models.generation import generate_steps
from attnkit.modules import heads
from attnkit.modules.kv_cache import KVCache

CHUNK = 1024  # keys per growth of the int8 storage
CURRENT: list[Int8Prototype] = []  # the cache the layer being run just wrote (layers run one after another)
ONES = torch.ones(64, dtype=torch.bfloat16)  # the value product's per-output scale (values scaled per key instead)


def _grown(old: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, dim: int) -> torch.Tensor:
    new = torch.zeros(shape, dtype=dtype)
    if old is not None:
        new.narrow(dim, 0, old.shape[dim]).copy_(old)
    return new


class Int8Prototype(KVCache):
    """KVCache (batch 1) that also keeps int8 keys (G, cap, D) and transposed int8 values (G, D, cap)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = self.cap = 0
        self.kc: Any = None
        self.ks: Any = None
        self.vt: Any = None
        self.vs: Any = None

    def _grow(self, need: int, g: int, d: int) -> None:
        cap = -(-need // CHUNK) * CHUNK
        if cap > self.cap:
            self.kc = _grown(self.kc, (g, cap, d), torch.int8, 1)
            self.ks = _grown(self.ks, (g, cap), torch.bfloat16, 1)
            self.vt = _grown(self.vt, (g, d, cap), torch.int8, 2)
            self.vs = _grown(self.vs, (g, cap), torch.float32, 1)
            self.cap = cap

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None) -> Any:
        out = super().update(k, v, positions)
        _, g, t, d = k.shape
        self._grow(self.n + t, g, d)
        kk, vv = k[0].float(), v[0].float()  # (G, T, D)
        ks = (kk.abs().amax(-1) / 127).clamp_min(1e-30).bfloat16()  # (G, T)
        vs = (vv.abs().amax(-1) / 127).clamp_min(1e-30)  # (G, T)
        new = slice(self.n, self.n + t)
        self.kc[:, new] = torch.round(kk / ks.float()[..., None]).clamp(-127, 127).to(torch.int8)
        self.ks[:, new] = ks
        self.vt[:, :, new] = torch.round(vv / vs[..., None]).clamp(-127, 127).to(torch.int8).transpose(1, 2)
        self.vs[:, new] = vs
        self.n += t
        CURRENT[:] = [self]
        return out


ATTEND = heads.AttentionHeads.attend


def int8_attend(self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
    cache = CURRENT[0] if CURRENT else None
    if cache is None or q.shape[2] != 1 or q.shape[0] != 1:
        return ATTEND(self, q, k, v, **kw)
    g, s, d = cache.kc.shape[0], cache.n, q.shape[-1]
    qg = (q[0, :, 0] * self.scale).reshape(g, -1, d).bfloat16()  # (H, D) -> (G, R, D)
    outs = []
    for h in range(g):
        scores = torch._weight_int8pack_mm(qg[h], cache.kc[h, :s], cache.ks[h, :s]).float()  # (R, S)
        p = torch.softmax(scores, -1) * cache.vs[h, :s]  # (R, S): value scales folded in
        padded = p.new_zeros(p.shape[0], cache.cap)  # (R, cap): zero past the last key
        padded[:, :s] = p
        outs.append(torch._weight_int8pack_mm(padded.bfloat16(), cache.vt[h], ONES).float())  # (R, D)
    return self.merge(torch.stack(outs).reshape(1, -1, 1, d))  # (G, R, D) -> (1, H, 1, D)


def run(model: Any, ids: torch.Tensor, prototype: bool, new_tokens: int) -> tuple[float, list[int]]:
    make = gen._new_caches
    CURRENT.clear()
    if prototype:
        gen._new_caches = lambda model, *a, **kw: [Int8Prototype() for _ in model.layers]  # type: ignore
        heads.AttentionHeads.attend = int8_attend  # type: ignore[method-assign]
    try:
        steps = generate_steps(model, ids, max_new_tokens=new_tokens, stop_ids=[])
        tokens = [int(next(steps)[0])]
        start = time.perf_counter()
        tokens += [int(token[0]) for token in steps]
        return (new_tokens - 1) / (time.perf_counter() - start), tokens
    finally:
        gen._new_caches, heads.AttentionHeads.attend = make, ATTEND  # type: ignore[method-assign]


def main(context: int, rounds: int = 3, new_tokens: int = 65) -> None:
    torch.set_num_threads(2)
    model = load_smollm2(weights="int4")
    ids = torch.tensor([prompt_ids(model.tokenizer, context)])
    print(f"context {context}, int4 weights, {new_tokens} new tokens, cpu {torch.backends.cpu.get_cpu_capability()}")
    for _ in range(rounds):
        base_rate, base = run(model, ids, False, new_tokens)
        rate, tokens = run(model, ids, True, new_tokens)
        same = sum(a == b for a, b in zip(tokens, base, strict=True))
        print(f"float32 cache {base_rate:.1f} tok/s, int8 prototype {rate:.1f} tok/s, {same}/{len(base)} tokens agree")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4000)
