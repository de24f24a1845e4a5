"""A small registry of attention kernels behind one signature.

A backend is a name, a function ``run(call) -> out (B, H, T, Dv)``, a function
``why_not(call)`` that returns the reason it cannot serve a call (or None),
and, for backends that materialise them, ``run_with_weights(call) ->
(out, weights (B, H, T, S))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .call import AttentionCall


def _always(call: AttentionCall) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[AttentionCall], Tensor]
    why_not: Callable[[AttentionCall], str | None] = _always
    run_with_weights: Callable[[AttentionCall], tuple[Tensor, Tensor]] | None = None
    # plan(call): a runner for every call of a step shaped like ``call`` (same T, S, heads, band and mask
    # presence), its decisions made once (a model's StepContext asks once per step); None: ``run`` each call
    plan: Callable[[AttentionCall], Callable[[AttentionCall], Tensor]] | None = None


BACKENDS: dict[str, Backend] = {}
# "auto" tries these in order and takes the first that can serve the call.
AUTO_ORDER: list[str] = ["sdpa", "chunked", "math"]
# Above this many (query, key) pairs, "auto" will not build a dense mask for SDPA.
DENSE_BAND_LIMIT = 2048 * 2048


def needs_dense_band(call: AttentionCall) -> bool:
    """Whether SDPA could serve ``call`` only with a (T, S) causal / window band built in memory.

    A sliding window, causal queries that are not the whole sequence
    (1 < T != S), or causal queries with a mask (SDPA takes ``is_causal`` or a
    mask, not both) cannot be expressed to SDPA without one; nor can score or
    mask modifiers or learned sinks.
    """
    if call.modified or call.sinks is not None:
        return True
    if call.band_hides_nothing():
        return False
    several = call.num_queries > 1
    partial_causal = call.causal and several and call.num_queries != call.num_keys
    causal_with_mask = call.causal and several and call.mask is not None
    return call.window is not None or partial_causal or causal_with_mask


def _auto(call: AttentionCall) -> Backend:
    big = call.num_queries * call.num_keys > DENSE_BAND_LIMIT
    chunked = BACKENDS.get("chunked")
    if big and needs_dense_band(call) and chunked is not None and chunked.why_not(call) is None:
        return chunked  # skips hidden blocks instead of materialising the band
    for candidate in AUTO_ORDER:
        backend = BACKENDS.get(candidate)
        if backend is not None and backend.why_not(call) is None:
            return backend
    raise ValueError("no attention backend can serve this call")


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend under its name."""
    if backend.name == "auto":
        raise ValueError("'auto' is reserved for choosing among the registered backends")
    BACKENDS[backend.name] = backend
    return backend


def _named(name: str) -> Backend:
    if name not in BACKENDS:
        choices = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose from: {choices}")
    return BACKENDS[name]


def choose(name: str, call: AttentionCall, *, return_weights: bool) -> Backend:
    """The backend that serves ``call``: ``name`` itself, or the first able one for "auto".

    "auto" picks the math backend when weights are asked for (it is the one
    that materialises them); "chunked" when SDPA would need a dense mask
    built from the causal / window band (alone or with the caller's mask) of
    more than DENSE_BAND_LIMIT (query, key) pairs; otherwise the first of
    AUTO_ORDER that can serve the call. A named backend that cannot serve the
    call is an error saying why.

    The math and chunked backends support second-order gradients (PyTorch's
    CPU SDPA kernels do not); chunked does it (under
    ``create_graph=True`` its backward recomputes a dense, differentiable
    forward: exact, with O(T * S) memory in that mode only).
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    if name == "auto":
        return _named("math") if return_weights else _auto(call)
    backend = _named(name)
    if return_weights and backend.run_with_weights is None:
        raise ValueError(f"backend {name!r} cannot return attention weights (it never materialises "
                         "them); use backend='math' or 'auto'")
    reason = backend.why_not(call)
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot serve this call: {reason}")
    return backend


def check_backend(name: object, *, dropout_p: float = 0.0, need_weights: bool = False) -> None:
    """Raise if backend ``name`` could never serve a layer with these fixed options.

    For a layer's constructor: asks the backend's own ``why_not`` about a
    one-token call with the layer's dropout, so each backend's limits are
    written once, in the backend.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    if name == "auto":
        return
    backend = _named(name)
    probe = torch.zeros(1, 1, 1, 1)
    reason = backend.why_not(AttentionCall(probe, probe, probe, None, False, None, 1.0, float(dropout_p)))
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot serve this layer: {reason}")
