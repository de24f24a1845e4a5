"""attnkit as a Hugging Face transformers attention backend.

    from attnkit.integrations.transformers import register
    register()                                    # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")
    model.set_attn_implementation("attnkit")      # or switch a loaded model

Every model whose attention goes through transformers' ``AttentionInterface``
then computes attention with :func:`attnkit.attention`:

- masks: transformers builds them with its SDPA mask function (registered for
  "attnkit" too): None when the pattern is plain causal (or full) attention,
  else a 4-d bool mask, True = may attend, which is attnkit's convention. A
  4-d float mask given by the caller is added to the scores, as in eager.
- causal attention without a mask uses attnkit's ``causal=True`` (aligned
  bottom-right) and the model's ``sliding_window`` becomes ``window=``: in
  transformers query i sees key j when i - W < j <= i, that is its W most
  recent keys, itself included, which is exactly attnkit's ``window=W``.
  When transformers passes a mask, the mask already holds the window.
- grouped-query attention: keys and values keep their G heads (no repeat).
- ``scaling`` is attnkit's ``scale``; ``dropout`` applies only while the
  module is in training mode.
- logit soft-capping (Gemma 2's ``softcap=c``) is attnkit's
  ``score_mod=softcap(c)``: c * tanh(s / c) on the scaled scores, before the
  mask, as in transformers' eager attention.
- learned attention sinks (gpt-oss's ``s_aux``, or ``sinks``), one logit per
  query head (H,), are attnkit's ``sinks=``: one more term exp(sinks[h]) in
  each row's softmax denominator, dropped after the softmax (rows sum to less
  than 1); gradients reach them. Per-token sinks of another shape are refused.
- ``output_attentions=True`` returns the real weights (B, H, T, S), computed
  by the math backend (taken before dropout; soft-capped, without the sink).
- What attnkit cannot compute (a position bias, sinks that are not one logit
  per head, any other argument that would change the result) raises
  NotImplementedError naming it: never a silently different result.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from attnkit._optional import MissingDependencyError, install_hint
from attnkit.backends import BACKENDS, attention, check_mask
from attnkit.functional import modifiers

NAME = "attnkit"
MIN_TRANSFORMERS = "5.0"
_INSTALL = f"{install_hint('transformers', 'hf')} (transformers>={MIN_TRANSFORMERS})"

# transformers' own implementations: registering over them would hide them.
_BUILTIN = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                      "flash_attention_4", "paged|eager"})

# Keyword arguments that do not change the result once the mask is given (sdpa and eager ignore them too).
_HARMLESS = frozenset({
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "use_cache",
    "position_ids", "cache_position", "position_embeddings", "past_key_values", "past_key_value",
    "layer_idx", "num_items_in_batch", "token_type_ids", "deterministic",
    # packed sequences: transformers puts them in the mask it builds from position_ids (flash kernels only read these)
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
})
# Features that change the math and that attnkit does not compute.
_UNSUPPORTED = {
    "position_bias": "an additive position bias",
}


def _version_tuple(version: str) -> tuple[int, ...]:
    """'5.23.0.dev0' -> (5, 23, 0): the leading numeric parts."""
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def _import_transformers() -> tuple[Any, Any, Callable[..., Any]]:
    """transformers' AttentionInterface, AttentionMaskInterface and sdpa_mask; ImportError naming the extra."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as err:
        raise MissingDependencyError(
            f"the Hugging Face backend needs the optional package 'transformers', which is not installed: {_INSTALL}"
        ) from err
    version = getattr(transformers, "__version__", "0")
    if _version_tuple(version) < _version_tuple(MIN_TRANSFORMERS):
        raise MissingDependencyError(
            f"the Hugging Face backend needs transformers>={MIN_TRANSFORMERS}, found {version}: {_INSTALL}")
    masking = importlib.import_module("transformers.masking_utils")
    return transformers.AttentionInterface, masking.AttentionMaskInterface, masking.sdpa_mask


def _check_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise NotImplementedError for any argument that would change the result and that attnkit ignores."""
    for key, value in kwargs.items():
        if key in _HARMLESS or value is None or value is False:
            continue
        what = _UNSUPPORTED.get(key, "an argument attnkit does not know")
        raise NotImplementedError(
            f"attnkit cannot compute {what}: {type(module).__name__} passed {key}={_short(value)}. "
            "Use attn_implementation='eager' (or another implementation the model supports).")


def _weights_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the caller wants weights: ``output_attentions`` in kwargs, or transformers collecting attentions.

    Some models (GPT-2) drop ``output_attentions`` before calling attention and
    read the weights through transformers' output-capturing hooks instead.
    """
    if kwargs.get("output_attentions"):
        return True
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    return isinstance(collected, dict) and ("attentions" in collected or "cross_attentions" in collected)


def _short(value: object) -> str:
    if isinstance(value, Tensor):
        return f"<tensor of shape {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_mask(mask: object, query: Tensor, key: Tensor) -> Tensor | None:
    """transformers' attention mask as attnkit reads it, or ValueError naming its shape and dtype.

    Accepted: None, or a 4-d bool (True = may attend) or float (added to the
    scores) tensor that broadcasts to (B, H, T, S), on the query's device.
    Beyond the 4 dimensions transformers always passes, the checks are
    :func:`attnkit.backends.check_mask`'s, the ones every attnkit call runs.
    """
    if mask is None:
        return None
    full = (*query.shape[:3], key.shape[2])  # (B, H, T, S)
    problem = "it is not a 4-d tensor"
    if isinstance(mask, Tensor) and mask.dim() == 4:
        try:
            return check_mask(mask, query, key.shape[2], name="attention_mask")
        except (TypeError, ValueError) as err:
            problem = str(err)
    shape = tuple(getattr(mask, "shape", ()))
    dtype = getattr(mask, "dtype", type(mask).__name__)
    raise ValueError(
        f"attnkit cannot read an attention mask of shape {shape} and dtype {dtype}: it reads a 4-d bool "
        f"(True = may attend) or float (added to the scores) mask that broadcasts to (B, H, T, S) = {full} "
        f"({problem})")


def _band(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, is_causal: bool | None,
          sliding_window: int | None) -> tuple[Tensor, Tensor, bool, int | None]:
    """Keys, values, causal and window for a call without a mask (transformers then relies on the kernel)."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    t, s = query.shape[2], key.shape[2]
    if causal and 1 < t < s:
        # As transformers' sdpa: only a static cache's prefill gets here (its slots after T are empty).
        key, value = key[:, :, :t], value[:, :, :t]  # (B, G, S, D) -> (B, G, T, D)
    if sliding_window is None:
        return key, value, causal, None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if not causal:
        if key.shape[2] > sliding_window:
            raise NotImplementedError(
                f"attnkit cannot compute a bidirectional sliding window (sliding_window={sliding_window}) without "
                f"a mask: {type(module).__name__} is not causal")
        return key, value, causal, None
    return key, value, causal, sliding_window


def _score_mod(module: nn.Module, softcap: float | None) -> modifiers.Softcap | None:
    """attnkit's ``softcap(c)`` score modifier for transformers' ``softcap=c``, or ValueError naming the value."""
    if softcap is None:
        return None
    try:
        return modifiers.softcap(softcap)
    except ValueError as err:
        raise ValueError(f"{type(module).__name__} passed softcap={_short(softcap)}: {err}") from err


def _sinks(module: nn.Module, query: Tensor, s_aux: Tensor | None, sinks: Tensor | None) -> Tensor | None:
    """The (H,) sink logits transformers passes as ``s_aux`` (gpt-oss) or ``sinks``; refuses any other shape."""
    if s_aux is not None and sinks is not None and s_aux is not sinks:
        raise ValueError(f"{type(module).__name__} passed both s_aux={_short(s_aux)} and sinks={_short(sinks)}: "
                         "expected one tensor of learned sink logits")
    name, logits = ("s_aux", s_aux) if s_aux is not None else ("sinks", sinks)
    if logits is None:
        return None
    heads = query.shape[1]
    if not isinstance(logits, Tensor) or tuple(logits.shape) != (heads,):
        raise NotImplementedError(
            f"attnkit computes learned attention sinks of shape (H,) = ({heads},), one logit per query head: "
            f"{type(module).__name__} passed {name}={_short(logits)}. "
            "Use attn_implementation='eager' (or another implementation the model supports).")
    return logits


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None, *,
                      softcap: float | None = None, s_aux: Tensor | None = None, sinks: Tensor | None = None,
                      backend: str = "auto", **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature, computed by :func:`attnkit.attention`.

    Args:
        module: the calling attention module (its ``training`` gates dropout;
            its ``is_causal`` is used when ``is_causal`` is None).
        query: (B, H, T, D); key: (B, G, S, D); value: (B, G, S, Dv).
        attention_mask: None, or 4-d bool (True = may attend) or float
            (added to the scores), broadcastable to (B, H, T, S).
        dropout: probability of dropping a weight, used only in training mode.
        scaling: multiplies the scores; None means 1 / sqrt(D).
        is_causal: overrides ``module.is_causal``; used only without a mask.
        sliding_window: each query sees its W most recent keys (HF's
            ``i - W < j <= i``); used only without a mask (a mask holds it).
        softcap: logit soft-capping c: scores become c * tanh(s / c) after
            scaling and before the mask (Gemma 2); None: no capping.
        s_aux: learned sink logits (H,), one per query head (gpt-oss): each
            row's softmax denominator gains exp(s_aux[h]); gradients reach it.
        sinks: the same as ``s_aux``, under the name some models use.
        backend: attnkit backend for calls without weights.
        kwargs: ``output_attentions=True`` asks for weights; see the module
            docstring for what else is accepted.

    Returns:
        (out (B, T, H, Dv), weights (B, H, T, S) or None).
    """
    _check_kwargs(module, kwargs)
    mask = read_mask(attention_mask, query, key)
    if mask is None:
        key, value, causal, window = _band(module, query, key, value, is_causal, sliding_window)
    else:
        causal, window = False, None  # transformers' mask already holds the causal and window pattern
    options: dict[str, Any] = dict(mask=mask, causal=causal, window=window, scale=scaling,
                                   dropout_p=float(dropout) if module.training else 0.0,
                                   score_mod=_score_mod(module, softcap), sinks=_sinks(module, query, s_aux, sinks))
    weights: Tensor | None = None
    if _weights_requested(kwargs):
        out, weights = attention(query, key, value, backend="math", return_weights=True, **options)
    else:
        out = attention(query, key, value, backend=backend, **options)
    out = out.transpose(1, 2).contiguous()  # (B, H, T, Dv) -> (B, T, H, Dv)
    return out, weights


_MISREAD_PARTS = ("flash", "sdpa", "flex_attention", "|")  # transformers matches these inside a name


def register(*, name: str = NAME, backend: str = "auto") -> str:
    """Register attnkit with transformers as ``attn_implementation=name``; returns the name.

    Registers an attention function (:func:`attention_forward` with
    ``backend``) and the SDPA mask function (bool masks, True = may attend)
    under ``name``. Calling it again replaces the earlier registration.

    Raises:
        ImportError: transformers is missing or older than MIN_TRANSFORMERS.
        ValueError: ``backend`` is not an attnkit backend, or ``name`` is
            empty, one of transformers' own implementations, or holds a part
            transformers reads by substring ("flash", "sdpa", "flex_attention",
            "|": such a name is taken for a hub kernel or for SDPA).
    """
    if not isinstance(name, str) or not name or name in _BUILTIN:
        raise ValueError(f"name must be a new implementation name, got {name!r} "
                         f"(transformers' own are {sorted(_BUILTIN)})")
    misread = [part for part in _MISREAD_PARTS if part in name]
    if misread:
        raise ValueError(f"name {name!r} contains {misread[0]!r}, which transformers reads by substring (it would "
                         f"take the name for a hub kernel or for SDPA): choose a name without "
                         f"{', '.join(repr(p) for p in _MISREAD_PARTS)}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attnkit backend {backend!r}; expected 'auto' or one of {sorted(BACKENDS)}")
    attention_interface, mask_interface, sdpa_mask = _import_transformers()

    def forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    forward.__name__ = forward.__qualname__ = f"attnkit_attention_forward_{backend}"
    forward.__doc__ = f"attnkit.attention (backend {backend!r}) behind transformers' attention interface."
    attention_interface.register(name, forward)
    mask_interface.register(name, sdpa_mask)
    return name


__all__ = ["MIN_TRANSFORMERS", "NAME", "attention_forward", "read_mask", "register"]
