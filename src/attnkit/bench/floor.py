"""The floor: what PyTorch alone does on attnkit's weights, a gpt-fast-style Llama decoder in one file.

    model = attnkit.models.load_smollm2(weights="int4")
    floor = FloorLlama.from_attnkit(model)         # shares the model's layers: same weights, same kernels
    new = floor.generate(ids, max_new_tokens=64)    # (B, 64) greedy token ids

A contender for the generate benchmarks (:class:`Floor`): plain tensor code,
fused projections, RoPE read from a table, a static KV cache written at
``input_pos``, SDPA with a mask sliced from a causal table, a greedy loop.
Whatever attnkit's framework (checks, step contexts, cache protocol, kernel
dispatch) costs beyond it is overhead: the floor it must not add to. The
embedding, projections, norms' weights and head are the attnkit model's own
modules, not copies, so a packed model (``quantize(model, "int4")``; build the
floor after) runs the very same packed layers. Inputs are checked once, in
:meth:`FloorLlama.generate`; nothing inside a step checks anything.

Legend: B batch, T tokens, S cache slots, C width, I feed-forward width,
V vocabulary, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.bench.generate_contenders import sync, time_steps, token_ids
from attnkit.models.llama import LlamaBlock, LlamaModel


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over C, half precision normalised in float32 (as attnkit's RMSNorm)."""
    if x.dtype in (torch.float32, torch.float64):
        return weight * F.rms_norm(x, x.shape[-1:], eps=eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rope_table(head_dim: int, length: int, base: float, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin (S, D) of positions 0 .. S - 1 divided by ``scaling``, computed in float64, then cast."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = (torch.arange(length, dtype=torch.float64) / scaling)[:, None] * inv_freq[None, :]  # (S, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, D/2) -> (S, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, D) rotated by (T, D) angles, half-split: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, D) -> 2 x (B, H, T, D/2)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # rotate_half: (x1, x2) -> (-x2, x1)


class KVCache(nn.Module):
    """Keys and values (B, G, S, D), preallocated, written at ``input_pos``."""

    k: Tensor
    v: Tensor

    def __init__(self, batch: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        shape = (batch, kv_heads, length, head_dim)  # (B, G, S, D)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.index_copy_(2, input_pos, k)  # (B, G, T, D) into slots input_pos of (B, G, S, D)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class FloorBlock(nn.Module):
    """x + attention(norm(x)), then x + down(silu(gate) * up)(norm(x)), on one attnkit block's modules."""

    def __init__(self, block: LlamaBlock, num_heads: int, num_kv_heads: int, eps: float) -> None:
        super().__init__()
        self.qkv: nn.Module = block.attention.qkv_proj  # C -> (H + 2G) D; rows: queries, keys, values
        self.out: nn.Module = block.attention.out_proj  # H D -> C
        self.gate_up: nn.Module = block.mlp.gate_up_proj  # C -> 2 I; rows: gate, then up
        self.down: nn.Module = block.mlp.down_proj  # I -> C
        self.attention_norm, self.mlp_norm = block.attention_norm.weight, block.mlp_norm.weight  # shared Parameters
        self.h, self.g, self.d, self.eps = num_heads, num_kv_heads, block.attention.head_dim, eps
        self.sizes = (self.h * self.d, self.g * self.d, self.g * self.d)
        self.cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(rms_norm(x, self.attention_norm, self.eps))  # (B, T, C) -> (B, T, (H + 2G) D)
        q, k, v = qkv.split(self.sizes, dim=-1)  # -> (B, T, H D), 2 x (B, T, G D)
        q = q.view(b, t, self.h, self.d).transpose(1, 2)  # (B, T, H D) -> (B, H, T, D)
        k = k.view(b, t, self.g, self.d).transpose(1, 2)  # (B, T, G D) -> (B, G, T, D)
        v = v.view(b, t, self.g, self.d).transpose(1, 2)  # (B, T, G D) -> (B, G, T, D)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = cast(KVCache, self.cache).update(input_pos, k, v)  # (B, G, T, D) -> (B, G, S, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.d**-0.5, enable_gqa=True)  # (B, H, T, D)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, self.h * self.d))  # (B, H, T, D) -> (B, T, H D) -> (B, T, C)
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm, self.eps)).chunk(2, dim=-1)  # (B, T, C) -> 2 x (B, T, I)
        return x + self.down(F.silu(gate) * up)  # (B, T, I) -> (B, T, C)


class FloorLlama(nn.Module):
    """A Llama decoder over an attnkit :class:`~attnkit.models.LlamaModel`'s own modules (shared, not copied).

    ``capacity``: the most positions a generation may fill (prompt + new
    tokens; default the model's context length). The RoPE table is computed
    once for them, in the model's activation dtype as it was when the floor
    was built: convert or quantize the model first, then build the floor.
    """

    cos: Tensor
    sin: Tensor
    causal: Tensor

    def __init__(self, model: LlamaModel, capacity: int | None = None) -> None:
        super().__init__()
        config = model.config
        self.capacity = config.context_length if capacity is None else capacity
        if not 1 <= self.capacity <= config.context_length:
            raise ValueError(f"capacity must be 1 .. the model's context length {config.context_length}, "
                             f"got {self.capacity}")
        self.embed, self.head = model.embed, model.lm_head  # (B, T) -> (B, T, C); (..., C) -> (..., V)
        self.norm, self.eps = model.norm.weight, config.norm_eps
        self.blocks = nn.ModuleList(FloorBlock(cast(LlamaBlock, block), config.num_heads, config.num_kv_heads,
                                               config.norm_eps) for block in model.layers)
        self.dtype, self.device = self.norm.dtype, self.norm.device  # the activations'
        cos, sin = rope_table(config.head_dim, self.capacity, config.rope_base, config.rope_scaling, self.dtype)
        self.register_buffer("cos", cos.to(self.device), persistent=False)  # (capacity, D)
        self.register_buffer("sin", sin.to(self.device), persistent=False)  # (capacity, D)
        self.register_buffer("causal", torch.ones(0, 0, dtype=torch.bool), persistent=False)  # (S, S), per setup

    @classmethod
    def from_attnkit(cls, model: LlamaModel, capacity: int | None = None) -> FloorLlama:
        """The floor over ``model``'s modules (after any quantize: it runs whatever layers the model holds)."""
        return cls(model, capacity)

    def setup_caches(self, batch: int, length: int) -> None:
        """A static cache of ``length`` slots per layer for ``batch`` rows, and the (S, S) causal mask table."""
        for block in self.blocks:
            block = cast(FloorBlock, block)
            block.cache = KVCache(batch, block.g, length, block.d, self.dtype, self.device)  # (B, G, S, D) each
        self.causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()  # (S, S)

    def hidden(self, ids: Tensor, input_pos: Tensor) -> Tensor:
        """Final-normed hidden states (B, T, C) of ids (B, T) at positions input_pos (T,), stored in the caches."""
        x = self.embed(ids)  # (B, T) -> (B, T, C)
        cos, sin = self.cos[input_pos], self.sin[input_pos]  # (capacity, D) -> (T, D)
        mask = self.causal[None, None, input_pos]  # (S, S) -> (1, 1, T, S)
        for block in self.blocks:
            x = block(x, cos, sin, mask, input_pos)  # (B, T, C)
        return rms_norm(x, self.norm, self.eps)

    def forward(self, ids: Tensor, input_pos: Tensor) -> Tensor:
        """Logits (B, T, V) of ids (B, T) at positions input_pos (T,) (after :meth:`setup_caches`)."""
        return self.head(self.hidden(ids, input_pos))  # (B, T, C) -> (B, T, V)

    def steps(self, ids: Tensor, max_new_tokens: int) -> Iterator[Tensor]:
        """The greedy next tokens (B,), one per step: the prompt (B, T) once, then each new token."""
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype != torch.long or 0 in ids.shape:
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"ids must be a (B, T) torch.long tensor with B, T >= 1, got {got}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        t = ids.shape[1]
        if t + max_new_tokens > self.capacity:
            raise ValueError(f"{t} prompt tokens + {max_new_tokens} new ones = {t + max_new_tokens} positions "
                             f"exceed the floor's cache capacity {self.capacity}")
        return self._decode(ids.to(self.device), max_new_tokens)

    @torch.inference_mode()
    def _decode(self, ids: Tensor, max_new_tokens: int) -> Iterator[Tensor]:
        (b, t), length = ids.shape, ids.shape[1] + max_new_tokens
        self.setup_caches(b, length)
        positions = torch.arange(length, device=self.device)  # (S,)
        token = self.head(self.hidden(ids, positions[:t])[:, -1]).argmax(dim=-1)  # (B, T, C) -> (B, C) -> (B,)
        yield token
        for i in range(t, length - 1):
            token = self.head(self.hidden(token[:, None], positions[i : i + 1])[:, -1]).argmax(dim=-1)  # (B,)
            yield token

    def generate(self, ids: Tensor, max_new_tokens: int) -> Tensor:
        """The new greedy tokens (B, max_new_tokens) after the prompt ids (B, T) (no stop tokens)."""
        return torch.stack(list(self.steps(ids, max_new_tokens)), dim=1)  # max_new_tokens x (B,) -> (B, N)


@dataclass
class Floor:
    """The floor on a loaded attnkit model, timed as the generate suite times a contender.

    ``batch`` takes prompts of one length only (the floor has no padding): prompts
    of different lengths raise a ValueError naming the lengths.
    """

    model: LlamaModel
    device: str = "cpu"
    floor: FloorLlama = field(init=False)

    def __post_init__(self) -> None:
        self.floor = FloorLlama.from_attnkit(self.model)

    def single(self, ids: Sequence[int], new_tokens: int) -> tuple[float, float]:
        """Seconds to the first new token of one prompt, and seconds for the other ``new_tokens - 1``."""
        return time_steps(lambda: self.floor.steps(token_ids([ids], self.device), new_tokens), self.device)

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        """Seconds to generate ``new_tokens`` for every prompt (all of one length)."""
        lengths = sorted({len(p) for p in prompts})
        if len(lengths) != 1:
            raise ValueError(f"the floor takes prompts of one length (it has no padding), got lengths {lengths}")
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=self.device)  # (B, T)
        sync(self.device)
        start = time.perf_counter()
        self.floor.generate(ids, new_tokens)
        sync(self.device)
        return time.perf_counter() - start
