"""What every attnkit attention layer shares: heads, the output projection, and the call to attention().

:class:`~attnkit.MultiHeadAttention` (self-attention) and
:class:`~attnkit.CrossAttention` differ only in how they make queries, keys
and values; both then go through :meth:`AttentionHeads.attend`, the one path
from a layer to :func:`attnkit.backends.run`.

Notation (shape comments): B batch, T queries, S keys, H query heads,
G key/value heads, D head dim, C = H * D (= d_out unless :class:`Heads` gives D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.backends import check_backend, check_options, make_call, run
from attnkit.backends.kernel import Kernel, check_kernel
from attnkit.functional import combine_masks
from attnkit.functional.modifiers import MaskMod, ScoreMod


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return value


@dataclass(frozen=True)
class Heads:
    """How a layer cuts attention into heads, and how it scales their scores.

    ``MultiHeadAttention(640, 640, Heads(4, num_kv_heads=1, head_dim=256))``
    is Gemma 3 270M's layer: 4 query heads of 256 over one key/value head in a
    640-wide model. A plain int ``num_heads`` is ``Heads(num_heads)``.

    Args:
        num_heads: query heads (H).
        num_kv_heads: key/value heads (G), dividing num_heads; None: num_heads.
        head_dim: size of each head (D); None: d_out // num_heads. Given, the
            heads are H * D wide together, which may differ from d_out:
            ``out_proj`` maps H * D to d_out.
        scale: the factor on q . k before softmax; None: 1 / sqrt(head_dim).
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        positive_int("num_heads", self.num_heads)
        if self.num_kv_heads is not None and self.num_heads % positive_int("num_kv_heads", self.num_kv_heads):
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim is not None:
            positive_int("head_dim", self.head_dim)
        scale = self.scale
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not (math.isfinite(scale) and scale > 0)):
            raise ValueError(f"scale must be a finite number > 0 (or None: 1 / sqrt(head_dim)), got scale={scale!r}")

    @classmethod
    def of(cls, num_heads: int | Heads, num_kv_heads: int | None) -> Heads:
        """A layer's ``num_heads`` argument (an int or Heads) and its ``num_kv_heads`` as one Heads."""
        if not isinstance(num_heads, Heads):
            return cls(num_heads, num_kv_heads)
        if num_kv_heads is not None:
            raise TypeError(f"num_kv_heads={num_kv_heads} given beside {num_heads}: give it once, inside "
                            "Heads(..., num_kv_heads=...)")
        return num_heads

    def resolve(self, d_out: int) -> tuple[int, int, int, float]:
        """(H, G, D, scale) for a layer of output size ``d_out``, every default filled in."""
        if self.head_dim is None and d_out % self.num_heads:
            raise ValueError(f"d_out={d_out} is not divisible by num_heads={self.num_heads} (or give head_dim: "
                             "Heads(num_heads, head_dim=...))")
        head_dim = d_out // self.num_heads if self.head_dim is None else self.head_dim
        return (self.num_heads, self.num_heads if self.num_kv_heads is None else self.num_kv_heads, head_dim,
                head_dim**-0.5 if self.scale is None else float(self.scale))


@dataclass(frozen=True)
class Modifiers:
    """What one call hands :func:`attnkit.attention` besides q, k, v: score and mask modifiers, sinks (H,)."""

    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    sinks: Tensor | None = None

    @property
    def empty(self) -> bool:
        return self.score_mod is None and self.mask_mod is None and self.sinks is None

    @property
    def modified(self) -> bool:
        """Whether scores or visibility change (sinks alone change neither)."""
        return self.score_mod is not None or self.mask_mod is not None

    def as_kwargs(self) -> dict[str, Any]:
        return {"score_mod": self.score_mod, "mask_mod": self.mask_mod, "sinks": self.sinks}


class AttentionHeads(nn.Module):
    """Base of attnkit's layers: H query heads over G key/value heads, and ``out_proj``.

    Subclasses make q (B, H, T, D) and k, v (B, G, S, D) and call
    :meth:`attend` (a registered backend, by name) or :meth:`attend_with`
    (a kernel component); both merge the heads with :meth:`merge`. Options
    are checked here once, with the backends' own checks
    (:func:`attnkit.backends.check_options`, ``check_backend``,
    ``check_kernel``).
    """

    def __init__(self, d_in: int, d_out: int, num_heads: int | Heads, *, num_kv_heads: int | None, causal: bool,
                 window: int | None, dropout: float, out_bias: bool, backend: str | Kernel,
                 factory: dict[str, Any]) -> None:
        super().__init__()
        for name, value in (("d_in", d_in), ("d_out", d_out)):
            positive_int(name, value)
        h, g, d, scale = Heads.of(num_heads, num_kv_heads).resolve(d_out)
        check_options(causal=causal, window=window, dropout_p=dropout, dropout_name="dropout")
        if isinstance(backend, str):
            check_backend(backend, dropout_p=float(dropout))
        else:
            check_kernel(backend)
        self.d_in, self.d_out = d_in, d_out
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = h, g, d, scale
        self.heads = Heads(h, g, d, scale)  # every field filled in: another layer like this one takes it
        self.causal, self.window, self.dropout = causal, window, float(dropout)
        self.backend: str | Kernel = backend
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, d_out, bias=out_bias, **factory)  # C -> d_out
        # the dtype and device of activations, converted by .to() / .double() like a parameter: a module swap
        # (quantize_dynamic, LoRA) may replace the projections' weights, but inputs stay in this dtype
        self.register_buffer("activation", torch.empty(0, **factory), persistent=False)

    def reset_parameters(self) -> None:
        """Re-initialise every projection (and component with parameters) as the constructor does.

        For a layer built on ``device="meta"``, after ``to_empty()``.
        """
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if module is not self and callable(reset):
                reset()

    def __prepare_scriptable__(self) -> nn.Module:
        raise TypeError(f"{type(self).__name__} does not support TorchScript (torch.jit.script); "
                        "use torch.compile(layer) instead, which attnkit supports and tests")

    def _heads_repr(self) -> str:
        scale = "" if self.scale == self.head_dim**-0.5 else f", scale={self.scale:g}"
        return (f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{scale}")

    def torch_problems(self) -> list[str]:
        """What ``torch.nn.MultiheadAttention`` cannot express of this layer (beyond what the converter checks)."""
        problems = []
        if self.num_heads * self.head_dim != self.d_out:
            problems.append(f"heads of their own size (num_heads * head_dim = {self.num_heads} * {self.head_dim} "
                            f"!= d_out={self.d_out})")
        if self.scale != self.head_dim**-0.5:
            problems.append(f"a scale of its own (scale={self.scale:g}, not 1 / sqrt(head_dim))")
        return problems

    def check_torch_equivalent(self) -> None:
        """A ValueError naming what ``torch.nn.MultiheadAttention`` cannot express here, if anything."""
        problems = self.torch_problems()
        if problems:
            raise ValueError(f"torch.nn.MultiheadAttention has no equivalent of {'; '.join(problems)}")

    def split(self, x: Tensor, heads: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)  # (B, S, heads * D) -> (B, heads, S, D)

    def check_x(self, x: object, name: str = "x", width: int | None = None) -> Tensor:
        """x must be (B, T, width) with T >= 1, in the layer's activation dtype and on its device."""
        width = self.d_in if width is None else width
        length, label = ("T", "d_in") if name == "x" else ("S", "d_context")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != width or x.shape[1] == 0:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a (B, {length}, {label}={width}) tensor with {length} >= 1, got {shape}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
        want = self.activation
        if (x.dtype, x.device) != (want.dtype, want.device):
            raise ValueError(f"{name} is {x.dtype} on {x.device} but the layer computes in {want.dtype} on "
                             f"{want.device}; move one to the other (e.g. layer.to({name}.dtype))")
        return x

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, key_mask: object, attn_mask: object,
               need_weights: object, band: Tensor | None = None, modifiers: Modifiers | None = None,
               positions: tuple[Tensor, Tensor] | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attention over q (B, H, T, D), k, v (B, G, S, D), merged and projected: (B, T, d_out).

        ``band`` (B, 1, T, S) bool, from explicit positions, replaces the layer's
        causal / window band (which is otherwise aligned bottom-right by index).
        ``modifiers`` go to :func:`attnkit.attention` as they are; with them,
        ``positions`` (queries (B, T), keys (B, S)) are the positions the
        modifiers and the band read, in place of ``band``.
        """
        if not isinstance(need_weights, bool):
            raise TypeError(f"need_weights must be a bool, got {need_weights!r}")
        if not isinstance(self.backend, str):
            raise TypeError(f"attend runs a backend by name, got {type(self.backend).__name__}: a kernel component "
                            "goes through attend_with")
        causal, window = (self.causal, self.window) if band is None else (False, None)
        mods = Modifiers() if modifiers is None else modifiers
        call = make_call(q, k, v, mask=attn_mask, key_mask=key_mask, causal=causal, window=window, scale=self.scale,
                         dropout_p=self.dropout if self.training else 0.0, score_mod=mods.score_mod,
                         mask_mod=mods.mask_mod, sinks=mods.sinks, positions=positions, mask_name="attn_mask")
        if band is not None:
            call = replace(call, mask=combine_masks(call.mask, band))
        result = run(call, backend=self.backend, return_weights=need_weights)
        out, weights = result if isinstance(result, tuple) else (result, None)
        return (self.merge(out), weights) if weights is not None else self.merge(out)

    def attend_with(self, kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None,
                    modifiers: Modifiers | None = None) -> Tensor:
        """Attention by a kernel component (after its ``prepare``), merged and projected: (B, T, d_out).

        ``modifiers`` are passed on as keywords only when there are some, so a
        kernel without modifiers keeps working for layers without them.
        """
        extra = {} if modifiers is None or modifiers.empty else modifiers.as_kwargs()
        k, v = k.to(q.dtype), v.to(q.dtype)  # a kernel component takes one dtype (a cache may store fewer bytes)
        out = kernel.attention(q, k, v, causal=self.causal, key_mask=key_mask, scale=self.scale, **extra)
        return self.merge(out)  # (B, H, T, D) -> (B, T, d_out)

    def merge(self, out: Tensor) -> Tensor:
        """The heads' outputs (B, H, T, D) merged and projected: (B, T, d_out)."""
        b, h, t, d = out.shape
        out = out.transpose(1, 2).reshape(b, t, h * d)  # (B, H, T, D) -> (B, T, H, D) -> (B, T, C)
        return self.out_proj(out)  # (B, T, C) -> (B, T, d_out)


def factory_kwargs(device: torch.device | str | None, dtype: torch.dtype | None) -> dict[str, Any]:
    """``device=`` and ``dtype=`` for parameters, as ``nn.Linear`` takes them."""
    return {"device": device, "dtype": dtype}
