"""The attention implementations the benchmark compares, all with the same weights.

Every contender is built from one reference :class:`attnkit.MultiHeadAttention`
(causal, d_model C, H heads, biases on), copying its weights into each
layout, so that wherever layouts allow they compute the same function (the
tests check it). Its ``kind`` says how it is called and timed:

- ``"layer"``: ``build(reference, T)`` returns ``run(x)`` for x (B, T, C);
- ``"core"``: ``build(reference, T)`` returns ``run(q, k, v)`` for (B, H, T, D)
  inputs: the attention kernel alone;
- ``"decode"``: ``build(reference, S, x)`` returns ``step()``, which decodes
  ``per_call`` tokens after a context of S positions (see :mod:`.decode`).

Contenders whose name ends in ``-padded`` add a key padding mask to the causal
mask (the common training case): sequence b of the batch keeps its first
T - T * (b % 4 + 1) // 8 tokens (see :func:`padding_mask`).

Legend: B batch, T tokens, S keys, C model width, H heads, D = C / H.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import attention
from attnkit import textbook as tb
from attnkit.modules import MultiHeadAttention

from . import decode
from .hf import gpt2_attention

Run = Callable[..., Any]
Kind = Literal["layer", "core", "decode"]
BOTH = ("inference", "training")


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    build: Callable[..., Run]  # layer and core: (reference, T) -> run; decode: (reference, S, x) -> step
    kind: Kind = "layer"
    materializes: tuple[str, ...] = ()  # modes in which it holds (B, H, T, T) scores: memory grows with T^2
    requires: str | None = None  # optional package needed
    per_call: int = 1  # tokens one timed call stands for (decode steps several)

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes it runs in: decode contenders only decode, the others never do."""
        return ("decode",) if self.kind == "decode" else BOTH


def padding_mask(batch: int, seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Key padding (B, T), True = real token: row b keeps its first T - T * (b % 4 + 1) // 8 tokens."""
    real = torch.tensor([seq_len - seq_len * (b % 4 + 1) // 8 for b in range(batch)], device=device)  # (B,)
    return torch.arange(seq_len, device=device) < real[:, None]  # (T,) < (B, 1) -> (B, T)


def _qkv(reference: MultiHeadAttention) -> nn.Linear:
    if reference.qkv_proj is None or reference.qkv_proj.bias is None:
        raise ValueError("the reference layer must be a self-attention layer with qkv_bias=True")
    return reference.qkv_proj


def _copy(reference: MultiHeadAttention, backend: str) -> Run:
    layer = MultiHeadAttention(reference.d_in, reference.d_out, reference.num_heads, qkv_bias=True,
                               backend=backend).to(reference.out_proj.weight)
    layer.load_state_dict(reference.state_dict())
    return layer.train(reference.training)


def _raw_sdpa(reference: MultiHeadAttention, seq_len: int) -> Run:
    """Fused QKV + F.scaled_dot_product_attention(is_causal=True): the floor for module overhead."""
    w, b = _qkv(reference).weight, _qkv(reference).bias
    wo, bo = reference.out_proj.weight, reference.out_proj.bias
    h, d = reference.num_heads, reference.head_dim

    def run(x: Tensor) -> Tensor:
        bsz, t, c = x.shape
        qkv = F.linear(x, w, b).view(bsz, t, 3, h, d).permute(2, 0, 3, 1, 4)  # -> (3, B, H, T, D)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # (B, H, T, D)
        return F.linear(out.transpose(1, 2).reshape(bsz, t, c), wo, bo)  # (B, H, T, D) -> (B, T, C)

    return run


def _torch_mha(style: str) -> Callable[[MultiHeadAttention, int], Run]:
    """nn.MultiheadAttention as its users call it: a float causal mask, a bool mask + is_causal, or weights."""

    def build(reference: MultiHeadAttention, seq_len: int) -> Run:
        m = reference.to_torch()
        weight = reference.out_proj.weight
        blocked = torch.ones(seq_len, seq_len, dtype=torch.bool, device=weight.device).triu(1)
        float_mask = torch.zeros(seq_len, seq_len, dtype=weight.dtype, device=weight.device)
        float_mask = float_mask.masked_fill(blocked, -torch.inf)
        if style == "is_causal":
            return lambda x: m(x, x, x, attn_mask=blocked, is_causal=True, need_weights=False)[0]
        need_weights = style == "weights"
        return lambda x: m(x, x, x, attn_mask=float_mask, need_weights=need_weights)[0]

    return build


def _textbook_mha(module: Callable[..., nn.Module]) -> Callable[[MultiHeadAttention, int], Run]:
    def build(reference: MultiHeadAttention, seq_len: int) -> Run:
        c, h = reference.d_out, reference.num_heads
        m: Any = module(c, c, seq_len, 0.0, h, qkv_bias=True).to(reference.out_proj.weight)
        qkv = _qkv(reference)
        with torch.no_grad():
            for i, name in enumerate(("W_query", "W_key", "W_value")):
                getattr(m, name).weight.copy_(qkv.weight[i * c : (i + 1) * c])
                getattr(m, name).bias.copy_(qkv.bias[i * c : (i + 1) * c])
            m.out_proj.load_state_dict(reference.out_proj.state_dict())
        return m.train(reference.training)

    return build


def _textbook_wrapper(module: Callable[..., nn.Module]) -> Callable[[MultiHeadAttention, int], Run]:
    """Per-head CausalAttention modules (the reference's head slices); the wrapper has no out_proj."""

    def build(reference: MultiHeadAttention, seq_len: int) -> Run:
        c, h, d = reference.d_out, reference.num_heads, reference.head_dim
        m: Any = module(c, d, seq_len, 0.0, h, qkv_bias=True).to(reference.out_proj.weight)
        qkv = _qkv(reference)
        with torch.no_grad():
            for i, name in enumerate(("W_query", "W_key", "W_value")):
                rows = qkv.weight[i * c : (i + 1) * c]  # (C, C): this projection's rows
                bias = qkv.bias[i * c : (i + 1) * c]
                for j, head in enumerate(m.heads):
                    getattr(head, name).weight.copy_(rows[j * d : (j + 1) * d])
                    getattr(head, name).bias.copy_(bias[j * d : (j + 1) * d])
        return m.train(reference.training)

    return build


def _llms_from_scratch(name: str) -> Callable[..., nn.Module]:
    def make(*args: Any, **kwargs: Any) -> nn.Module:
        from llms_from_scratch import ch03

        return getattr(ch03, name)(*args, **kwargs)

    return make


def _hf_gpt2(implementation: str) -> Callable[[MultiHeadAttention, int], Run]:
    """transformers' GPT2Attention with the reference's weights (Conv1D stores them transposed).

    Called alone, its eager path applies no causal mask (GPT2Model builds one):
    it gets the additive mask the model would pass; the sdpa path uses is_causal.
    """

    def build(reference: MultiHeadAttention, seq_len: int) -> Run:
        attn = gpt2_attention(reference, implementation)
        weight = reference.out_proj.weight
        mask = None
        if implementation == "eager":
            mask = torch.full((seq_len, seq_len), torch.finfo(weight.dtype).min, dtype=weight.dtype,
                              device=weight.device).triu(1)[None, None]  # (1, 1, T, T)
        return lambda x: attn(x, attention_mask=mask)[0]

    return build


def _core(backend: str) -> Callable[[MultiHeadAttention, int], Run]:
    return lambda reference, seq_len: (lambda q, k, v: attention(q, k, v, causal=True, backend=backend))


def _padded_layer(reference: MultiHeadAttention, seq_len: int) -> Run:
    """attnkit's default layer, causal, with a key padding mask (B, T) as a padded batch brings."""
    layer = _copy(reference, "auto")
    return lambda x: layer(x, key_mask=padding_mask(x.shape[0], x.shape[1], x.device))


def _padded_core(backend: str) -> Callable[[MultiHeadAttention, int], Run]:
    """attention(causal=True) with the padding mask as (B, 1, 1, S): the broadcastable key-mask form."""

    def run(q: Tensor, k: Tensor, v: Tensor) -> Any:
        keys = padding_mask(k.shape[0], k.shape[2], k.device)[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        return attention(q, k, v, mask=keys, causal=True, backend=backend)

    return lambda reference, seq_len: run


def _contenders() -> dict[str, Contender]:
    items = [
        Contender("attnkit", "attnkit.MultiHeadAttention, backend auto", lambda r, t: _copy(r, "auto")),
        Contender("attnkit-sdpa", "attnkit.MultiHeadAttention, backend sdpa", lambda r, t: _copy(r, "sdpa")),
        Contender("attnkit-chunked", "attnkit.MultiHeadAttention, backend chunked", lambda r, t: _copy(r, "chunked")),
        Contender("attnkit-math", "attnkit.MultiHeadAttention, backend math", lambda r, t: _copy(r, "math"),
                  materializes=BOTH),
        Contender("attnkit-compiled", "torch.compile(attnkit.MultiHeadAttention) (compiled in the warm-up call)",
                  lambda r, t: torch.compile(_copy(r, "auto"))),
        Contender("raw-sdpa", "fused QKV + F.scaled_dot_product_attention(is_causal=True)", _raw_sdpa),
        Contender("torch-mha", "nn.MultiheadAttention, float causal mask", _torch_mha("mask")),  # SDPA + (T, T) mask
        Contender("torch-mha-is-causal", "nn.MultiheadAttention, bool causal mask + is_causal hint",
                  _torch_mha("is_causal"), materializes=("inference",)),  # fast path; SDPA in training
        Contender("torch-mha-weights", "nn.MultiheadAttention, causal mask, need_weights=True",
                  _torch_mha("weights"), materializes=BOTH),
        Contender("textbook-mha", "attnkit.textbook.MultiHeadAttention (weight splits)",
                  _textbook_mha(tb.MultiHeadAttention), materializes=BOTH),
        Contender("textbook-wrapper", "attnkit.textbook.MultiHeadAttentionWrapper (no out_proj)",
                  _textbook_wrapper(tb.MultiHeadAttentionWrapper), materializes=BOTH),
        Contender("lfs-mha", "llms_from_scratch.ch03.MultiHeadAttention",
                  _textbook_mha(_llms_from_scratch("MultiHeadAttention")), materializes=BOTH,
                  requires="llms_from_scratch"),
        Contender("lfs-wrapper", "llms_from_scratch.ch03.MultiHeadAttentionWrapper (no out_proj)",
                  _textbook_wrapper(_llms_from_scratch("MultiHeadAttentionWrapper")), materializes=BOTH,
                  requires="llms_from_scratch"),
        Contender("hf-gpt2-eager", "transformers GPT2Attention, eager", _hf_gpt2("eager"), materializes=BOTH,
                  requires="transformers"),
        Contender("hf-gpt2-sdpa", "transformers GPT2Attention, sdpa", _hf_gpt2("sdpa"), requires="transformers"),
    ]
    items += [Contender(f"core-{b}", f"attnkit.attention(q, k, v, causal=True, backend={b!r})", _core(b),
                        kind="core", materializes=BOTH if b == "math" else ())
              for b in ("auto", "sdpa", "chunked", "math")]
    items.append(Contender("core-torch-sdpa", "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                           lambda r, t: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           kind="core"))
    items.append(Contender("attnkit-padded", "attnkit.MultiHeadAttention, backend auto, causal + key_mask (B, T)",
                           _padded_layer))
    items += [Contender(f"core-{b}-padded", f"attnkit.attention(causal=True, mask=(B, 1, 1, S), backend={b!r})",
                        _padded_core(b), kind="core") for b in ("auto", "sdpa", "chunked")]
    return {c.name: c for c in items + _decoders()}


def _decoders() -> list[Contender]:
    hf = "transformers"
    return [
        Contender("decode-attnkit-cache", "attnkit layer + KVCache, one token", decode.attnkit_cache,
                  kind="decode", per_call=decode.STEPS),
        Contender("decode-attnkit-cache-keymask", "attnkit layer + KVCache + key mask, one token",
                  decode.attnkit_cache_keymask, kind="decode", per_call=decode.STEPS),
        Contender("decode-attnkit-recompute", "attnkit layer, whole prefix recomputed", decode.recompute,
                  kind="decode"),
        Contender("decode-hf-gpt2-eager-cache", "transformers GPT2Attention (eager) + DynamicCache",
                  decode.hf_cache("eager"), kind="decode", per_call=decode.STEPS, requires=hf),
        Contender("decode-hf-gpt2-sdpa-cache", "transformers GPT2Attention (sdpa) + DynamicCache",
                  decode.hf_cache("sdpa"), kind="decode", per_call=decode.STEPS, requires=hf),
    ]


CONTENDERS = _contenders()
