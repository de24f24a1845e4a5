"""A paged KV cache: one pool of fixed-size blocks per layer, read through each sequence's block table.

Storage per layer is ``(num_blocks * block_size + 1, G, D)`` slots (the last,
the spare, takes padding's writes and is read, masked, for positions past a
row's length: it is kept zero, where the other slots start uninitialised and are
read only once written). Position p of a sequence lives in slot
``table[p // block_size] * block_size + p % block_size``. Which blocks a
sequence holds is :class:`attnkit.serve.blocks.BlockManager`'s business; this
module only moves tensors.

For each forward, the engine describes the batch once (:class:`PagedBatch`:
where each new token is written, which slots each row reads, at which
positions) and hands the model one :class:`PagedLayerCache` per layer over it
(:func:`layer_caches`: plain tensors, so that a compiled step builds them
inside its graph), which serve the cache protocol of :mod:`attnkit.modules.kv_cache`:
the decoder and ``MultiHeadAttention`` run unchanged. Reading gathers each row's slots into a
contiguous (B, G, S, D) tensor, then attends with the usual kernels; one row alone whose blocks are
consecutive (the block manager gives a sequence the block after its last when it can) is read as a slice
of the pool instead, without a copy, in the eager step (:func:`read_rows`), an int8 pool's codes and scales too.

An int8 pool (``PagedKVPool(dtype=torch.int8)``, ``Engine(kv_dtype="int8")``)
stores what ``KVCache(dtype=torch.int8)`` stores
(:mod:`attnkit.modules.int8_storage`): int8 codes, and one bfloat16 scale per
(slot, key/value head) for keys and one for values, each the vector's largest
magnitude / 127 (:func:`attnkit.modules.packed.quantize_rows`). Its layer
caches (:class:`PagedInt8LayerCache`) quantise what they write and hand back
the rows' keys and values dequantised to the layer's dtype: the numbers
``Int8Keys.dequantized`` gives, attended by the usual kernels (not the int8
kernel ``generate`` decodes with).

Legend: B sequences in the batch, T new tokens per row, S positions read per
row, G key/value heads, D head dim, N slots in the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit.models.generation_options import kv_storage
from attnkit.modules.int8_storage import ACTIVATIONS
from attnkit.modules.kv_cache import CachedKeys
from attnkit.modules.packed import quantize_rows

SCALE_DTYPE = torch.bfloat16  # an int8 pool's scales: one per (slot, head), for keys and for values


@dataclass(frozen=True)
class PagedBatch:
    """Where one forward writes and what it reads, shared by every layer."""

    write_slots: Tensor  # (B, T) long: the slot of each new token (padding: the spare slot)
    read_slots: Tensor  # (B, S) long: the slots each row attends to (beyond a row's length: the spare slot)
    key_positions: Tensor  # (B, S) long: each read slot's position, -1 = nothing there
    span: tuple[int, int] | None = None  # (first slot, S): one row in consecutive slots, read as a slice (eager only)

    @classmethod
    def build(cls, tables: Sequence[Sequence[int]], positions: Tensor, lengths: Sequence[int], block_size: int,
              spare: int) -> PagedBatch:
        """The batch of rows with block ``tables``, new tokens at ``positions`` (B, T; -1 = padding),
        each row holding ``lengths[b]`` positions once they are written."""
        device = positions.device
        width = max(len(t) for t in tables)
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        s = max(*lengths, 2)  # S >= 2: the compiled step's graph is traced with S dynamic, which excludes S = 1
        pos = torch.arange(s, device=device)  # (S,)
        read = slots(table, pos.expand(len(tables), s), block_size)  # (B, S)
        valid = pos[None, :] < torch.tensor(list(lengths), device=device)[:, None]  # (B, S)
        write = slots(table, positions.clamp(min=0), block_size)  # (B, T)
        return cls(write.masked_fill(positions < 0, spare), read.masked_fill(~valid, spare),
                   torch.where(valid, pos, -1), _span(tables, lengths, s, block_size))


def _span(tables: Sequence[Sequence[int]], lengths: Sequence[int], s: int, block_size: int) -> tuple[int, int] | None:
    """(first slot, S) when one row reads all its S positions from consecutive blocks: its keys are a slice of the
    pool, read without a copy; else None (the rows' slots are gathered)."""
    if len(tables) != 1 or lengths[0] != s:
        return None
    blocks = list(tables[0][: -(-s // block_size)])  # the blocks its S positions lie in
    return (blocks[0] * block_size, s) if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None


def slots(table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """The pool slot of each of a sequence's ``positions`` (..., P) through its block ``table`` (..., W)."""
    return table.gather(-1, positions // block_size) * block_size + positions % block_size  # (..., P)


def pool_dtype(model_dtype: torch.dtype, kv_dtype: torch.dtype | str | None) -> torch.dtype:
    """The paged pool's dtype: the model's, a narrower float under a float32 model, or int8 (codes and scales)
    under a float32 or bfloat16 model."""
    stored = kv_storage(kv_dtype)
    if stored is None:
        return model_dtype
    if stored is torch.int8:
        if model_dtype not in ACTIVATIONS:  # the dtypes KVCache(dtype=torch.int8) takes
            raise ValueError(f"kv_dtype=int8 stores a float32 or bfloat16 model's keys as int8 codes (as "
                             f"KVCache(dtype=torch.int8)); this model computes in {model_dtype}: use kv_dtype=None")
        return stored
    if model_dtype != torch.float32:
        raise ValueError(f"kv_dtype={stored} stores a float32 model's keys in fewer bytes; this model computes in "
                         f"{model_dtype}: use kv_dtype=None")
    return stored


def engine_device(model: Any, device: torch.device | str | None) -> torch.device:
    """The device the engine runs on: the model's parameters', which ``device``, if given, must name."""
    held, given = next(model.parameters()).device, None if device is None else str(device)
    try:
        asked = held if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Engine(device={given!r}) is not a device: expected cpu, cuda or cuda:N") from None
    if "meta" in (held.type, asked.type):
        raise ValueError(f"Engine(device={given!r}) with the model's parameters on {held}: the meta device holds "
                         "shapes, no numbers; serve a model on the cpu or a GPU (its weights loaded)")
    if asked.type != held.type or asked.index not in (None, held.index):
        raise ValueError(f"Engine(device={given!r}) and the model's parameters on {held}: move the model first "
                         f"(model.to({given!r})), or leave device=None (the model's)")
    return held


class PagedKVPool:
    """Keys and values of every layer: ``num_blocks`` blocks of ``block_size`` positions each.

    ``dtype=torch.int8`` stores int8 codes in :attr:`k` and :attr:`v` and their bfloat16 scales in
    :attr:`k_scales` and :attr:`v_scales` (N, G) (see the module docstring); a float pool has no scales (empty
    lists).
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.spare = num_blocks * block_size  # the slot padding is written to
        shape = (self.spare + 1, num_kv_heads, head_dim)  # (N, G, D)
        # Uninitialised but the spare slot: a slot is read only once written (a row's positions past its length
        # read the spare), so on a CPU memory is taken as positions are written, not all when the pool is made (a
        # GPU's allocator takes it all at once)
        self.k = [_spare_zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_spare_zeroed(shape, dtype, device) for _ in range(num_layers)]
        scaled = num_layers if dtype == torch.int8 else 0  # a float pool holds no scales
        self.k_scales = [_spare_zeroed(shape[:2], SCALE_DTYPE, device) for _ in range(scaled)]  # (N, G)
        self.v_scales = [_spare_zeroed(shape[:2], SCALE_DTYPE, device) for _ in range(scaled)]  # (N, G)
        self.batch: PagedBatch | None = None  # what :attr:`layers` read

    @classmethod
    def for_model(cls, model: Any, *, kv_memory_mib: float, block_size: int = 16,
                  kv_dtype: torch.dtype | str | None = None, device: torch.device | str | None = None
                  ) -> PagedKVPool:
        """The pool for ``model``'s layers in ``kv_memory_mib`` MiB, on the model's device (which ``device``, if
        given, must name), storing ``kv_dtype`` (None: the model's dtype; see :func:`pool_dtype`)."""
        config = model.config
        held = engine_device(model, device)
        dtype = pool_dtype(next(model.parameters()).dtype, kv_dtype)
        per_block = cls.bytes_per_block(num_layers=config.num_layers, block_size=block_size,
                                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)
        num_blocks = int(kv_memory_mib * 2**20 // per_block)
        if num_blocks < 2:
            raise ValueError(f"{kv_memory_mib} MiB of KV memory (kv_memory_mib, serve's --kv-memory) holds "
                             f"{num_blocks} blocks of {block_size} positions ({per_block / 2**20:.2f} MiB each); "
                             f"give at least {2 * per_block / 2**20:.2f} MiB")
        return cls(num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
                   num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype, device=held)

    @property
    def dtype(self) -> torch.dtype:
        """What the storage holds keys and values in (int8: codes, with :attr:`k_scales` and :attr:`v_scales`)."""
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        """Where the storage lives: each step's ids, positions and :class:`PagedBatch` are built there."""
        return self.k[0].device

    @property
    def layers(self) -> list[PagedLayerCache]:
        """One cache per layer over :attr:`batch` (set it first): what a model's ``forward`` takes."""
        return layer_caches(self.k, self.v, self.batch, self.k_scales, self.v_scales)

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Memory one block takes over every layer (keys and values; int8: codes and their bfloat16 scales)."""
        vectors = 2 * num_layers * block_size * num_kv_heads  # a key and a value per (layer, position, head)
        if dtype == torch.int8:
            return vectors * (head_dim + torch.empty(0, dtype=SCALE_DTYPE).element_size())
        return vectors * head_dim * torch.empty(0, dtype=dtype).element_size()


def _spare_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> Tensor:
    """A pool tensor (N, ...) left uninitialised but its last slot, the spare, which padding reads."""
    storage = torch.empty(shape, dtype=dtype, device=device)
    storage[-1].zero_()
    return storage


def layer_caches(ks: Sequence[Tensor], vs: Sequence[Tensor], batch: PagedBatch | None,
                 k_scales: Sequence[Tensor] = (), v_scales: Sequence[Tensor] = ()) -> list[PagedLayerCache]:
    """One cache per layer over the pool's tensors ``ks``, ``vs`` (N, G, D) and ``batch``: a
    :class:`PagedLayerCache`, or with an int8 pool's ``k_scales``, ``v_scales`` (N, G) a
    :class:`PagedInt8LayerCache`."""
    if not k_scales:
        return [PagedLayerCache(k, v, batch) for k, v in zip(ks, vs, strict=True)]
    return [PagedInt8LayerCache(k, v, batch, k_scale, v_scale)
            for k, v, k_scale, v_scale in zip(ks, vs, k_scales, v_scales, strict=True)]


def gather(storage: Tensor, slots: Tensor) -> Tensor:
    """``storage[slots]``: the rows (B, S, ...) at slots (B, S) of storage (N, ...), through ``index_select``,
    which copies them faster than indexing does on a CPU (BENCHMARKS.md, round seventeen)."""
    rows = storage.index_select(0, slots.flatten())  # (B * S, ...)
    return rows.view(*slots.shape, *storage.shape[1:])  # (B, S, ...)


def read_rows(storage: Tensor, batch: PagedBatch) -> Tensor:
    """The batch's rows (B, S, ...) of a layer's ``storage`` (N, ...): a slice, without a copy, when one row lies
    in consecutive slots (``batch.span``; BENCHMARKS.md, round eighteen), else :func:`gather`."""
    if batch.span is None:
        return gather(storage, batch.read_slots)
    start, s = batch.span
    return storage[start : start + s][None]  # (S, ...) -> (1, S, ...)


class PagedLayerCache:
    """One layer's storage (N, G, D) seen through one forward's :class:`PagedBatch`: the cache protocol.

    Built for each forward (:func:`layer_caches`): plain tensors in, so that a compiled step
    (:mod:`attnkit.serve.graph`) builds it inside its graph.
    """

    def __init__(self, keys: Tensor, values: Tensor, batch: PagedBatch | None) -> None:
        self.keys, self.values, self.batch = keys, values, batch

    def next_positions(self, batch: int, length: int, device: torch.device) -> int | Tensor:
        raise ValueError("a paged cache needs explicit positions (the engine gives them)")

    def claim(self, owner: object) -> None:
        """Nothing to save: a forward that fails is discarded with its sequences by the engine."""

    def restore(self, checkpoint: object) -> None:
        """See :meth:`claim`."""

    def read_through(self, positions: Tensor | None) -> PagedBatch:
        """The step's batch; a paged cache is only read through one, with explicit positions."""
        if self.batch is None or positions is None:
            raise ValueError("a paged cache is read through a PagedBatch with explicit positions")
        return self.batch

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys:
        """Write k, v (B, G, T, D) to the batch's slots; return every row's keys (B, G, S, D) and positions."""
        batch = self.read_through(positions)
        # (B, G, T, D) -> (B, T, G, D) at slots (B, T), in the pool's dtype (Engine(kv_dtype=...) may store fewer
        # bytes): no flattened copy of the projection's view (which index_copy_ needed: slower at decode), and no
        # guard on B inside a compiled step
        self.keys.index_put_((batch.write_slots,), k.transpose(1, 2).to(self.keys.dtype))
        self.values.index_put_((batch.write_slots,), v.transpose(1, 2).to(self.values.dtype))
        k_all = read_rows(self.keys, batch).transpose(1, 2)  # (B, S, G, D) -> (B, G, S, D)
        v_all = read_rows(self.values, batch).transpose(1, 2)
        return CachedKeys(k_all, v_all, batch.key_positions)

    write = update  # nothing to check: the engine built the batch


class PagedInt8LayerCache(PagedLayerCache):
    """One layer of an int8 pool: codes (N, G, D) int8 and scales (N, G) bfloat16, for keys and for values.

    Writes quantise as ``KVCache(dtype=torch.int8)`` does (:func:`attnkit.modules.packed.quantize_rows`); reads
    hand back the rows' keys and values dequantised to the layer's dtype (``codes * scale``, as
    :meth:`attnkit.modules.int8_storage.Int8Keys.dequantized` computes them).
    """

    def __init__(self, keys: Tensor, values: Tensor, batch: PagedBatch | None, key_scales: Tensor,
                 value_scales: Tensor) -> None:
        super().__init__(keys, values, batch)
        self.key_scales, self.value_scales = key_scales, value_scales

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys:
        """Quantise k, v (B, G, T, D) to the batch's slots; return every row's keys (B, G, S, D), dequantised to
        k's dtype, and positions."""
        batch = self.read_through(positions)
        kv = torch.stack((k, v)).transpose(2, 3)  # 2 x (B, G, T, D) -> (2, B, T, G, D)
        codes, scales = quantize_rows(kv, SCALE_DTYPE)  # (2, B, T, G, D) int8, (2, B, T, G) bfloat16
        self.keys.index_put_((batch.write_slots,), codes[0])  # (B, T, G, D) at slots (B, T)
        self.values.index_put_((batch.write_slots,), codes[1])
        self.key_scales.index_put_((batch.write_slots,), scales[0])  # (B, T, G) at slots (B, T)
        self.value_scales.index_put_((batch.write_slots,), scales[1])
        k_scale = read_rows(self.key_scales, batch).float()[..., None]  # (B, S, G) -> (B, S, G, 1)
        v_scale = read_rows(self.value_scales, batch).float()[..., None]
        k_all = (read_rows(self.keys, batch).float() * k_scale).to(k.dtype)  # (B, S, G, D)
        v_all = (read_rows(self.values, batch).float() * v_scale).to(v.dtype)
        return CachedKeys(k_all.transpose(1, 2), v_all.transpose(1, 2), batch.key_positions)  # (B, G, S, D)

    write = update  # nothing to check: the engine built the batch
