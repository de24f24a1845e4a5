"""What every decoder model shares: the stack of blocks, its KV caches and checks, ``forward`` and ``step``.

A decoder here is token embedding -> blocks -> final RMSNorm -> output head
(tied to the embedding unless the file has its own). The architectures differ
in their blocks and in how tokens are embedded, and nothing else: each model
file (:mod:`attnkit.models.llama`, :mod:`attnkit.models.gemma3`) builds its
blocks and hands them to :class:`DecoderModel`, which runs them with one KV
cache per layer for the generation loop (:mod:`attnkit.models.generation`).

A block is any module with ``forward(x, context, kv_cache) -> x`` (B, T, C)
whose attention layer is its ``attention`` attribute (for :func:`attnkit.trace`
and the cache transaction), called as ``attention(h, context=context,
kv_cache=kv_cache)``. The model checks its inputs once at the door
(:meth:`DecoderModel.forward`) and builds one
:class:`~attnkit.modules.context.StepContext` per step, which every layer
reads without checking anything again.

Legend: B batch, T tokens, S positions incl. cached ones, C model width,
I feed-forward width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar, cast

import torch
from torch import Tensor, nn

from attnkit.functional.norm import RMSNorm
from attnkit.modules import KVCache, StaticKVCache
from attnkit.modules.cache_protocol import (
    STORAGE_DTYPES,
    Cache,
    check_cache,
    check_narrowing,
    check_positions,
    check_storage_dtype,
    transaction,
)
from attnkit.modules.context import StepContext
from attnkit.modules.int8_storage import ACTIVATIONS as INT8_ACTIVATIONS
from attnkit.modules.kv_cache import KV_DTYPES
from attnkit.modules.quantize import check_conversion, quantize, resolve_form

from .generation import GenerationMixin, Tokenizer
from .generation_options import check_input_ids, mask_to_bool


class DecoderConfig(Protocol):
    """The sizes :class:`DecoderModel` reads from a model's config (LlamaConfig, Gemma3Config)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def d_model(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    @property
    def norm_eps(self) -> float: ...

    @property
    def tie_embeddings(self) -> bool: ...


def transposed_storage(weight: Tensor) -> Tensor:
    """The same (out, in) matrix stored column-major: a (out, in) view of an (in, out) tensor.

    ``F.linear`` over it reads the (in, out) layout, which measured 1.7x faster
    than row-major for SmolLM2's (49152, 576) head at batch 1 on an AVX2 CPU
    (BENCHMARKS.md); embedding lookups gather columns, a negligible cost.
    """
    return weight.t().contiguous().t()


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with SiLU (Llama), GeGLU with tanh-GELU (Gemma).

    gate and up are one fused ``nn.Linear`` (rows: gate, then up), stored
    column-major (:func:`transposed_storage`) once loaded.
    """

    def __init__(self, d_model: int, ffn_size: int, activation: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(d_model, 2 * ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, d_model, bias=False)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, C) -> 2 x (B, T, I)
        return self.down_proj(self.activation(gate) * up)  # (B, T, I) -> (B, T, C)


class DecoderModel(GenerationMixin, nn.Module):
    """A decoder: token ids in, logits out; with a tokenizer, text in and out (GenerationMixin).

    ``forward(input_ids, attention_mask=None, kv_caches=None, positions=None)``
    returns logits (B, T, V). Attention layers are ``layers.<i>.attention``
    (for :func:`attnkit.trace`). Subclasses pass their blocks and may embed
    tokens their own way (:meth:`embed_tokens`).
    """

    # the weight forms (attnkit.modules.quantize) measured to meet the accuracy bar on this architecture;
    # weights="auto" takes the fastest of them here. A subclass that measured none keeps float32.
    accurate_forms: tuple[str, ...] = ("float32",)

    def __init__(self, config: DecoderConfig, layers: Sequence[nn.Module], tokenizer: Tokenizer | None = None) -> None:
        super().__init__()
        self.config = config
        head = torch.empty(config.vocab_size, config.d_model)  # (V, C)
        if not head.is_meta:  # built on "meta" to be loaded (assemble): normal_ there imports torch._dynamo (1.4 s)
            head.normal_()
        head = transposed_storage(head)
        self.embed = nn.Embedding(config.vocab_size, config.d_model, _weight=head)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        self.tokenizer = tokenizer
        # what the generation loop reads (attnkit.models.generation_options.CausalLM)
        self.vocab_size, self.context_length = config.vocab_size, config.context_length
        self.pad_token_id: int = 0 if tokenizer is None else tokenizer.pad_id  # type: ignore[attr-defined]
        self.stop_token_ids: tuple[int, ...] = () if tokenizer is None else tokenizer.stop_ids  # type: ignore

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> DecoderModel:
        check_conversion(self, fn)  # a quantized model refuses .half() / .cuda() before any module converts
        return super()._apply(fn, recurse)

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """Token vectors (B, T, C) of input_ids (B, T): the embedding's rows."""
        return self.embed(input_ids)  # (B, T) -> (B, T, C)

    def tie_weights(self) -> None:
        """With tied embeddings, the head is the embedding matrix (one Parameter, as after loading)."""
        if self.config.tie_embeddings and isinstance(self.lm_head, nn.Linear) and isinstance(self.embed, nn.Embedding):
            self.lm_head.weight = self.embed.weight  # (a quantized model's packed head and table stay as they are)

    def new_caches(self, capacity: int | None = None, *, static: bool = False,
                   dtype: torch.dtype | None = None) -> list[Cache]:
        """One empty cache per layer: a growing :class:`attnkit.KVCache` (up to ``capacity`` positions,
        or unbounded), or with ``static`` a :class:`attnkit.StaticKVCache` of ``capacity`` slots; ``dtype``:
        the dtype they store keys and values in (None: the model's; bfloat16 / float16: half the bytes;
        int8: int8 codes read by an int8 kernel, :mod:`attnkit.modules.int8_storage`, growing only)."""
        dtype = check_storage_dtype(dtype, KV_DTYPES)
        self._check_storage(dtype)
        if dtype == torch.int8 and static:
            raise ValueError("an int8 cache grows (KVCache(dtype=torch.int8)): there is no static one; use "
                             "static=False, or dtype None, bfloat16 or float16 with static=True")
        if static:
            if capacity is None:
                raise ValueError("a static cache needs a capacity (positions 0 .. capacity - 1)")
            return [StaticKVCache(capacity, dtype=dtype) for _ in self.layers]
        return [KVCache(capacity, dtype=dtype) for _ in self.layers]

    def _check_storage(self, dtype: torch.dtype | None) -> None:
        """Keys stored in ``dtype`` must come from layers it can take (the caches' own check, once for all)."""
        keys = cast(nn.Module, self.layers[0].attention).get_buffer("activation").dtype  # every layer's keys' dtype
        if dtype in STORAGE_DTYPES:
            probe = torch.empty(0, dtype=keys)  # what the layers will hand the caches
            check_narrowing(dtype, probe, probe)
        if dtype == torch.int8 and keys not in INT8_ACTIVATIONS:
            raise ValueError(f"KVCache(dtype=torch.int8) takes float32 or bfloat16 keys and values of one dtype, "
                             f"got {keys} (the model's dtype)")

    def _hidden(self, input_ids: Tensor, context: StepContext, kv_caches: Sequence[Cache | None]) -> Tensor:
        x = self.embed_tokens(input_ids)  # (B, T) -> (B, T, C)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, context, cache)
        return self.norm(x)

    def _run(self, input_ids: Tensor, positions: Tensor | None, key_mask: Tensor | None,
             kv_caches: Sequence[Cache] | None, checked: bool = False) -> Tensor:
        """Final-normed hidden states (B, T, C). ``checked`` (``forward``): every cache checks its update and a
        call that raises leaves them all as they were; ``step`` runs raw over caches its caller built."""
        b, t = input_ids.shape
        if kv_caches is None:
            context = StepContext(t, positions=positions, key_mask=key_mask)
            return self._hidden(input_ids, context, [None] * len(self.layers))
        if positions is None:  # the caches advance together: the first one says where this step goes
            at = kv_caches[0].next_positions(b, t, input_ids.device)  # int, or (B, T)
            context = StepContext(t, offset=at, key_mask=key_mask, check_caches=checked) if isinstance(at, int) \
                else StepContext(t, positions=at, key_mask=key_mask, check_caches=checked)
        else:
            context = StepContext(t, positions=positions, key_mask=key_mask, check_caches=checked)
        if not checked:
            return self._hidden(input_ids, context, kv_caches)
        with transaction(kv_caches, [block.attention for block in self.layers]):  # all caches, or none, change
            return self._hidden(input_ids, context, kv_caches)

    def _check_caches(self, kv_caches: object) -> Sequence[Cache] | None:
        if kv_caches is None:
            return None
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches must be a list of {len(self.layers)} caches (one per layer), e.g. "
                             f"model.new_caches(); got {type(kv_caches).__name__}")
        return [check_cache(c, f"kv_caches[{i}]") for i, c in enumerate(kv_caches)]

    def _key_mask(self, input_ids: Tensor, attention_mask: object, kv_caches: Sequence[Cache] | None
                  ) -> Tensor | None:
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 or (
                attention_mask.shape[0] != input_ids.shape[0] or attention_mask.shape[1] < input_ids.shape[1]):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be (B, S) with B = {input_ids.shape[0]} and S = the cache's "
                             f"positions + {input_ids.shape[1]} new ones, got {got}")
        return mask_to_bool(attention_mask).to(input_ids.device)

    def _check_room(self, input_ids: Tensor, positions: Tensor | None, caches: Sequence[Cache] | None) -> None:
        """Every position must lie in the context window."""
        b, t = input_ids.shape
        if positions is None:
            at = 0 if caches is None else caches[0].next_positions(b, t, input_ids.device)
            if isinstance(at, int):
                if at + t > self.context_length:
                    raise ValueError(f"{at} cached + {t} new positions exceed the model's context length "
                                     f"{self.context_length}")
                return
            positions = at
        if int(positions.max()) >= self.context_length:
            raise ValueError(f"position {int(positions.max())} is beyond the model's context length "
                             f"{self.context_length} (positions 0 .. {self.context_length - 1})")

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                kv_caches: Sequence[Cache] | None = None, positions: Tensor | None = None) -> Tensor:
        """Logits (B, T, V) for input_ids (B, T).

        Args:
            attention_mask: (B, S) bool or 0/1, True/1 = real token, False/0 =
                padding; S = cached + T positions. None = all real.
            kv_caches: one cache per layer (``new_caches()``); the new
                positions are stored and attention covers all they hold.
            positions: (B, T) long, each token's position (-1: padding, a
                token nobody sees); rows may sit at different positions, so
                left padding is not needed. None = 0 .. T - 1 or after what
                the caches hold.
        """
        check_input_ids(self, input_ids)
        caches = self._check_caches(kv_caches)
        if positions is not None:
            positions = check_positions(positions, *input_ids.shape)
        self._check_room(input_ids, positions, caches)
        key_mask = self._key_mask(input_ids, attention_mask, caches)
        return self.lm_head(self._run(input_ids, positions, key_mask, caches, checked=True))  # (B, T, V)

    def step(self, input_ids: Tensor, positions: Tensor | None, kv_caches: Sequence[Cache]) -> Tensor:
        """Logits (B, V) of the last position only; no checks and no cache transaction (the generation loop and
        the serving engine check at their doors and build the caches)."""
        return self.lm_head(self._run(input_ids, positions, None, kv_caches)[:, -1])  # (B, T, C) -> (B, V)


M = TypeVar("M", bound=DecoderModel)


def assemble(make: Callable[[], M], state: dict[str, Tensor], dtype: torch.dtype) -> M:
    """The model ``make()`` builds, on the meta device (no random initialisation), given ``state``'s tensors.

    Every parameter comes from ``state`` (strict); the head is tied again
    (assignment gave it a Parameter of its own over the same storage);
    buffers outside the state dict (the layers' activation dtype) are created
    in ``dtype``. Returned in eval mode.
    """
    with torch.device("meta"):
        model = make()
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                kind = dtype if buffer.is_floating_point() else buffer.dtype
                module.register_buffer(name, torch.empty(buffer.shape, dtype=kind), persistent=False)
    return model.eval()


def release_freed_memory() -> None:
    """Hand the heap that loading freed back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    Dequantised float32 weights are freed once packed, but glibc keeps the
    freed heap mapped: SmolLM2 in int4 held 1127 MiB resident after loading,
    597 MiB after this call.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def pack(model: M, weights: str, grids: Mapping[str, tuple[Tensor, Tensor, Tensor]] | None = None) -> M:
    """``model``'s linear layers in ``weights``' form ("auto": the fastest its class measured accurate), then the
    heap the dropped float32 weights held handed back to the OS. ``grids``: 4-bit grids read from the file for
    int4 (see :func:`attnkit.modules.quantize.quantize`)."""
    quantize(model, resolve_form(weights, model.accurate_forms), grids=grids)
    release_freed_memory()
    return model
