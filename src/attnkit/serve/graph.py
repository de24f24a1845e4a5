"""The engine's decode step as one compiled graph: compiled in the background, kept on disk, eager until ready.

Only all-decode forwards (every row one new token) run compiled; prefill
chunks stay eager. The compiled function is a function of tensors
(:func:`decode_step`: the token ids, their positions, the step's
:class:`~attnkit.serve.paged.PagedBatch` and the pool's storage: an int8
pool's scales too, none for a float pool), so dynamo guards on shapes and
dtypes, not on engine objects: one graph serves every batch size B (unbacked:
B = 1 is not a graph of its own), read width S and pool size N (marked
dynamic).

:class:`CompiledDecode` compiles it in a thread of its own, against a scratch
pool of a few slots (the live pool is never touched), while the engine thread
keeps serving with the eager step; once the warm-up has run, the engine's
next all-decode step runs the graph. A compile that fails leaves the eager
step serving and says why (:meth:`CompiledDecode.status`, the log, ``/health``);
a step that the graph cannot take (a guard that fails: the engine thread never
compiles, ``torch.compiler.set_stance("fail_on_recompile")`` around each call)
runs eagerly and marks the graph failed the same way. That stance holds for
the whole process while a compiled step runs: one compiling engine per process
(a second one's background compile could be refused, and would say so).

On a GPU the step is compiled the same way (plain ``torch.compile``, no CUDA
graph: "reduce-overhead" records one graph per shape, and the batch size and
the read width change every step), its scratch pool on the live pool's device.

:class:`~attnkit.serve.compile_cache.CompileCache` keeps what a compile produced
under attnkit's cache folder, so that a restart compiles from it.

With float32 weights the graph's greedy tokens equal the eager step's (its
logits agree to rounding); with packed weights (int4, int8, float16) its
kernels round otherwise, as a batch does, and greedy answers can part at
near ties (docs/bench/round15-graph/).

Legend: B rows (one new token each), S positions read per row, N slots in the
pool, G key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .compile_cache import CompileCache
from .paged import PagedBatch, PagedKVPool, layer_caches

LOG = logging.getLogger("attnkit.serve.compile")  # attnkit serve prints it on stderr


def decode_step(model: Any, ids: Tensor, positions: Tensor, write_slots: Tensor, read_slots: Tensor,
                key_positions: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor], k_scales: Sequence[Tensor] = (),
                v_scales: Sequence[Tensor] = ()) -> Tensor:
    """Logits (B, V) of one all-decode forward: ``ids`` and ``positions`` (B, 1), the step's slots
    (:class:`~attnkit.serve.paged.PagedBatch`'s fields) and each layer's storage ``ks``, ``vs`` (N, G, D), with an
    int8 pool's scales ``k_scales``, ``v_scales`` (N, G) (empty for a float pool)."""
    b = ids.shape[0]  # unbacked while compiling (:func:`mark_dynamic`): tell dynamo every input has this B
    for t in (positions, write_slots, read_slots, key_positions):
        torch._check(t.shape[0] == b)
    torch._check(key_positions.shape[1] == read_slots.shape[1])  # S
    batch = PagedBatch(write_slots, read_slots, key_positions)
    return model.step(ids, positions, layer_caches(ks, vs, batch, k_scales, v_scales))  # (B, V)


def mark_dynamic(ids: Tensor, positions: Tensor, batch: PagedBatch, ks: Sequence[Tensor],
                 vs: Sequence[Tensor], k_scales: Sequence[Tensor] = (), v_scales: Sequence[Tensor] = ()) -> None:
    """Mark B, S and N dynamic on a call's inputs, so that one compile serves every later all-decode step. B is
    unbacked: a backed size is specialised at 1 (a guard on B >= 2 from a stride made B = 1 a graph of its own,
    which doubled the compile and a warm restart)."""
    for t in (ids, positions, batch.write_slots, batch.read_slots, batch.key_positions):
        torch._dynamo.decorators.mark_unbacked(t, 0)  # B
    for t in (batch.read_slots, batch.key_positions):
        torch._dynamo.mark_dynamic(t, 1)  # S
    for t in (*ks, *vs, *k_scales, *v_scales):
        torch._dynamo.mark_dynamic(t, 0)  # N


@dataclass(frozen=True)
class Slots:
    """A pool's per-layer storage: ``num_layers`` tensors (N, G, D) of ``dtype`` on ``device`` (int8: with scales
    (N, G) bfloat16, as :class:`~attnkit.serve.paged.PagedKVPool` keeps them), for the scratch pool (on the live
    pool's device: a graph compiled for the CPU does not run on a GPU)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def warm_up(compiled: Any, model: Any, slots: Slots) -> None:
    """Run ``compiled`` (:func:`decode_step`) once on a scratch pool at B = 2: one graph, B, S and N dynamic
    (:func:`mark_dynamic`). Every write goes to the scratch pool's spare slot; the sizes are distinct (B 2, S 3,
    N 11) so that no two are taken for one. The tensors are made as the engine makes them (dynamo guards on it):
    the pool outside inference mode, each step's inside."""
    n, device = 11, slots.device  # scratch slots, the last the spare
    scratch = PagedKVPool(num_layers=slots.num_layers, num_blocks=1, block_size=n - 1,
                          num_kv_heads=slots.num_kv_heads, head_dim=slots.head_dim, dtype=slots.dtype, device=device)
    ks, vs = scratch.k, scratch.v  # num_layers x (N, G, D)
    k_scales, v_scales = scratch.k_scales, scratch.v_scales  # num_layers x (N, G) for int8; empty for a float pool
    for storage in (*ks, *vs, *k_scales, *v_scales):  # read below before anything is written: zeros, not garbage
        storage.zero_()
    b = 2
    with torch.inference_mode():
        ids = torch.zeros(b, 1, dtype=torch.long, device=device)  # (B, 1)
        positions = torch.full((b, 1), 2, dtype=torch.long, device=device)  # (B, 1): each row's third position
        read = torch.arange(3, device=device).expand(b, 3).clone()  # (B, S): slots 0, 1, 2 at positions 0, 1, 2
        write = torch.full((b, 1), n - 1, dtype=torch.long, device=device)  # (B, 1): the spare slot
        batch = PagedBatch(write, read, read.clone())
        mark_dynamic(ids, positions, batch, ks, vs, k_scales, v_scales)
        compiled(model, ids, positions, batch.write_slots, batch.read_slots, batch.key_positions, ks, vs,
                 k_scales, v_scales)


class CompiledDecode:
    """:func:`decode_step` compiled in a background thread; callable (:meth:`__call__`) once :attr:`ready`.

    Args:
        model: the engine's decoder.
        slots: the pool's per-layer storage (shape of a slot, dtype), for the scratch pool of the warm-up.
        cache: where the compiled artifacts are kept (None: PyTorch's own caches only).
    """

    def __init__(self, model: Any, slots: Slots, cache: CompileCache | None) -> None:
        self.model, self.slots, self.cache = model, slots, cache
        self.state = "compiling"  # then "ready" or "failed"
        self.seconds: float | None = None  # how long the compile took, once it ended
        self.error: str | None = None
        self.steps = 0  # decode steps the graph ran
        self.ready = False  # read by the engine thread each step: set last
        self._compiled: Any = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name="attnkit-compile", daemon=True)

    def start(self) -> None:
        """Compile in the background; the log says when it starts and ends."""
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile ends (or ``timeout`` seconds); True if the graph is ready."""
        self._done.wait(timeout)
        return self.ready

    def status(self) -> dict[str, Any]:
        """{"state": "compiling" | "ready" | "failed", "seconds": ..., "error": ..., "steps": ...} (what /health
        shows)."""
        status: dict[str, Any] = {"state": self.state, "steps": self.steps}
        if self.seconds is not None:
            status["seconds"] = round(self.seconds, 1)
        if self.error is not None:
            status["error"] = self.error
        return status

    def __call__(self, ids: Tensor, positions: Tensor, batch: PagedBatch, ks: Sequence[Tensor],
                 vs: Sequence[Tensor], k_scales: Sequence[Tensor], v_scales: Sequence[Tensor]) -> Tensor | None:
        """Logits (B, V) of an all-decode step through the graph over the pool's storage (an int8 pool's scales
        too; empty lists for a float pool, as the warm-up passed them); None if it cannot take it (then it is
        marked failed and the caller runs the eager step: every write it made is written again, alike)."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"):  # never compile on the engine thread
                logits = self._compiled(self.model, ids, positions, batch.write_slots, batch.read_slots,
                                        batch.key_positions, ks, vs, k_scales, v_scales)  # (B, V)
        except Exception as err:  # the eager step serves on
            self._fail(err, "a step the compiled graph could not take")
            return None
        self.steps += 1
        return logits

    def _build(self) -> None:
        began = time.monotonic()
        try:
            found = "no disk cache"
            if self.cache is not None:
                self.cache.use_kernel_folder()
                found = self.cache.load()
            LOG.info("compiling the decode step in the background (%s); the eager step serves meanwhile", found)
            compiled = torch.compile(decode_step, fullgraph=True)
            warm_up(compiled, self.model, self.slots)
        except Exception as err:  # any failure leaves the eager step serving
            self.seconds = time.monotonic() - began
            self._fail(err, f"compiling the decode step failed after {self.seconds:.1f} s")
            self._done.set()
            return
        self._keep()
        self._compiled, self.seconds, self.state = compiled, time.monotonic() - began, "ready"
        self.ready = True
        self._done.set()
        LOG.info("the compiled decode step is ready after %.1f s: decode steps run it from now on", self.seconds)

    def _keep(self) -> None:
        """Write the compiled artifacts to the cache; a full disk or a read-only folder only makes the next start
        cold."""
        if self.cache is None:
            return
        try:
            self.cache.save()
        except OSError as err:
            LOG.warning("the compiled decode step could not be kept in %s: %s", self.cache.path, err)

    def _fail(self, err: BaseException, what: str) -> None:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""  # a guard's report runs to kilobytes
        self.ready, self.state, self.error = False, "failed", f"{type(err).__name__}: {first[:300]}"
        LOG.warning("%s: %s; the eager step keeps serving", what, self.error)


def compile_in_background(model: Any, kv_dtype: torch.dtype, cache: CompileCache | None = None) -> CompiledDecode:
    """``model``'s decode step over a pool of ``kv_dtype`` on the model's device, compiling from now on; kept in
    ``cache`` (default: :meth:`CompileCache.for_model`, under attnkit's cache folder)."""
    config = model.config
    slots = Slots(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype, next(model.parameters()).device)
    graph = CompiledDecode(model, slots, cache if cache is not None else CompileCache.for_model(model, kv_dtype))
    graph.start()
    return graph
