"""Weights in fewer bytes: every ``nn.Linear`` of a model swapped for a packed form.

    model = quantize(load_smollm2(), "int4")   # or load_smollm2(weights="int4")

Decoding reads every weight once per token, so its speed follows the bytes it
reads. The forms are PyTorch's own kernels, swapped in as modules
(:mod:`attnkit.modules.packed`: nothing hand-written).

- ``"float32"``: the weights as they are.
- ``"float16"``: half-precision weights, float32 activations (fbgemm, x86
  CPUs): half the bytes.
- ``"int8"``: int8 weights with one scale per output channel: a quarter of
  the bytes.
- ``"int4"``: 4-bit weights in groups of 32 inputs, each group with its own
  scale and minimum: exactly GGUF's Q4_1 block (a file's Q4_1 weights come
  back on the same grid, tested against the file's raw blocks). A matrix tied
  to an embedding (the vocabulary head, stored 8-bit in such files) is kept
  in float16 (in int8 it cost SmolLM2 1.5 points of greedy agreement), and
  one whose inputs are not a multiple of 32 (or outputs not a multiple of 16)
  in int8; int8 needs inputs in multiples of 16 and leaves other layers in
  float32, as float16 does a layer with magnitudes beyond 65504. A warning
  names every layer kept in another form than the one asked (the tied head's
  float16 aside).

Every form but float32 also keeps embedding tables in float16
(:class:`attnkit.modules.packed.Float16Embedding`): rows are looked up, not
multiplied, so this saves memory (57 MB of SmolLM2's 113 MB table), not time.
float16 and int4 meet the accuracy bar on SmolLM2
(tests/modules/test_quantize.py: >= 97% greedy agreement, perplexity within
3%); int8 keeps perplexity (within 0.4%) but agrees on 96.1% of greedy
choices: one scale per row is coarser than the file's 4-bit groups. On
other texts int4 agrees on 96.7-98.8% and int8 on 93.4-96.2% (BENCHMARKS.md,
round ten).

Refused, by name: an unknown form, a form this CPU's PyTorch cannot run, a
model (or part of one) quantized twice, a model off the CPU or none of whose
layers fits the form, and a quantized model asked to train, to differentiate
through its packed weights, to move off the CPU or to leave float32 (attnkit's
decoders and MiniLM refuse before any module converts, leaving the model as it
was; in another model each packed layer refuses as it is reached). A
float16 layer (fbgemm's opaque matrix, also int4's head) cannot be saved,
loaded or copied: quantize a copy of the float32 model instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from attnkit.cpu import has_fast_bfloat16

from .packed import (
    Float16Linear,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    fits_float16,
    float16_table,
    int4_fits,
    refuse_conversion,
)

WEIGHT_FORMS = ("float32", "float16", "int8", "int4")


def available_forms() -> tuple[str, ...]:
    """The weight forms this machine's PyTorch can run (float16 needs the fbgemm engine: x86 CPUs)."""
    if "fbgemm" in torch.backends.quantized.supported_engines:
        return WEIGHT_FORMS
    return ("float32", "int8")  # float16, and int4's float16 head, need fbgemm


def default_form(accurate: Sequence[str] = WEIGHT_FORMS) -> str:
    """The fastest of the ``accurate`` forms on this CPU (BENCHMARKS.md has the measurements).

    ``accurate``: the forms measured to meet the accuracy bar on the model at
    hand (a model class's ``accurate_forms``). Fastest first, as measured on
    SmolLM2 (BENCHMARKS.md, round twelve): int4, then float16 where bfloat16
    arithmetic is native (AVX512-BF16 or AMX), else int8 and never float16
    (with PyTorch's AVX2 kernels, int4 decoded at 22.6-22.8 tokens/s, int8 at
    20.2-21.6, float32 at 17.5-21.9 and float16 at 13.4-14.1), then float32. What each form promises
    per CPU: a row's logits are bit-equal alone and in a batch of its length
    with int8 everywhere, and with float16 or int4 (whose head is float16) only
    where fbgemm runs its AVX512 kernels (``attnkit.cpu.float16_rows_batch_invariant``);
    with AVX2 they move in the last bits.
    """
    order = ("int4", "float16", "int8") if has_fast_bfloat16() else ("int4", "int8")
    here = available_forms()
    return next((form for form in order if form in accurate and form in here), "float32")


def resolve_form(weights: str, accurate: Sequence[str]) -> str:
    """``weights`` itself, or for "auto" the :func:`default_form` of the ``accurate`` forms."""
    return default_form(accurate) if weights == "auto" else weights


def weight_form(model: nn.Module) -> str:
    """The form a model's linear layers are in ("float32" when none was swapped)."""
    return str(getattr(model, "weight_form", "float32"))


def check_conversion(model: nn.Module, fn: Callable[[Tensor], Tensor]) -> None:
    """Raise before anything converts if ``fn`` would have to change a packed layer of ``model``.

    A model's ``_apply`` calls this first: ``nn.Module._apply`` converts
    children in order, so a packed layer refusing on its own would leave the
    modules before it (the embedding, the first norm) already converted.
    """
    packed = next((m for m in model.modules() if isinstance(m, PackedLinear)), None)
    if packed is not None:
        refuse_conversion(packed.form, fn)


def _refuse_training(module: nn.Module, _: object) -> None:
    if module.training and torch.is_grad_enabled():
        raise ValueError(f"a model with {weight_form(module)} weights cannot train: its weights are packed for "
                         "inference (no gradients); load it with weights='float32' to train")


def _tied_to_embedding(model: nn.Module) -> set[int]:
    """The storage pointers of every embedding table in ``model`` (a head tied to one shares it)."""
    return {m.weight.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}


Made = tuple[nn.Module, str | None]  # a layer to put in place, and why it is not in the form asked (None: it is)


def _float16(linear: nn.Linear) -> Made:
    """float16, or the float32 layer as it is where float16 cannot hold its weights."""
    if not fits_float16(linear.weight):
        return linear, "weights beyond float16's range, +-65504"
    return Float16Linear(linear.weight, linear.bias), None


def _int8(linear: nn.Linear) -> Made:
    """int8, or the float32 layer as it is where its inputs are not a multiple of 16 (the kernel's)."""
    if linear.in_features % 16:
        return linear, "inputs not a multiple of 16, which int8's kernel needs"
    return Int8Linear(linear.weight, linear.bias), None


Grids = Mapping[str, tuple[Tensor, Tensor, Tensor]]  # module name -> (codes, scale, minimum) of its weight


def _int4_with_float16_head(model: nn.Module, grids: Grids) -> Callable[[nn.Linear, str], Made]:
    """int4 (from ``grids`` where given); float16 for a head tied to an embedding (by design: not reported);
    int8 (or float32) where the sizes do not fit int4's tiles."""
    tied = _tied_to_embedding(model)

    def make(linear: nn.Linear, name: str) -> Made:
        if name in grids:
            return Int4Linear(linear.weight, linear.bias, grid=grids[name]), None
        if linear.weight.untyped_storage().data_ptr() in tied:
            return _float16(linear)
        if not int4_fits(linear.out_features, linear.in_features):
            layer, why = _int8(linear)
            tiles = "sizes outside int4's tiles (inputs in groups of 32, outputs in multiples of 16)"
            return layer, tiles if why is None else f"{tiles}; {why}"
        return Int4Linear(linear.weight, linear.bias), None
    return make


def _check_grid_names(model: nn.Module, grids: Grids) -> None:
    """Every grid must name a linear layer of ``model`` (a misspelt name would leave its layer unread)."""
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    unknown = sorted(set(grids) - linears)
    if unknown:
        raise ValueError(f"grids {unknown[:3]} name no linear layer of this model (layer names, e.g. "
                         f"{sorted(linears)[:2]})")


Swap = tuple[nn.Module, str, str, Made]  # parent, attribute, qualified name, (replacement, why)


def _planned(module: nn.Module, make: Callable[[nn.Module, str], Made | None], prefix: str = "") -> list[Swap]:
    """Each module below ``module`` that ``make(it, its qualified name)`` replaces (where ``make`` gives None,
    what is inside it), with its replacement built: nothing is swapped yet, so an error leaves the model whole."""
    planned: list[Swap] = []
    for name, child in module.named_children():
        made = make(child, prefix + name)
        if made is not None:
            planned.append((module, name, prefix + name, made))
        else:
            planned += _planned(child, make, prefix + name + ".")
    return planned


def _linears(make: Callable[[nn.Linear, str], Made]) -> Callable[[nn.Module, str], Made | None]:
    """``make`` for ``nn.Linear`` modules, None (look inside) for the others."""
    return lambda module, name: make(module, name) if isinstance(module, nn.Linear) else None


def _table(module: nn.Module, name: str) -> Made | None:
    table = float16_table(module, name)
    return None if table is None else (table, None)


def _report_kept(planned: list[Swap], weights: str) -> None:
    """Refuse a model none of whose linear layers takes ``weights``; warn, naming them, where some keep another
    form (never a silent fallback)."""
    kept = [(name, layer, why) for _, _, name, (layer, why) in planned if why is not None]
    if not kept:
        return
    listed = "; ".join(f"{name} ({getattr(layer, 'form', 'float32')}: {why})" for name, layer, why in kept[:3])
    more = f"; and {len(kept) - 3} more" if len(kept) > 3 else ""
    if len(kept) == len(planned):
        raise ValueError(f"none of the model's {len(planned)} linear layers can take {weights} weights: {listed}{more}")
    warnings.warn(f"quantize(model, {weights!r}): {len(kept)} of {len(planned)} linear layers keep another form: "
                  f"{listed}{more}", stacklevel=3)


def _check(model: nn.Module, weights: str, grids: Grids) -> None:
    """Raise for a form that is unknown or not here, a model (or any part of it) quantized before, a single
    layer, and linear layers not in float32 or not on the CPU."""
    if weights not in WEIGHT_FORMS:
        raise ValueError(f"unknown weight form {weights!r}; known: {', '.join(WEIGHT_FORMS)}")
    if weights not in available_forms():
        raise ValueError(f"weight form {weights!r} needs PyTorch's fbgemm engine (float16 matrices), which this "
                         f"machine's PyTorch "
                         f"lacks (engines: {', '.join(torch.backends.quantized.supported_engines)})")
    if weight_form(model) != "float32":
        raise ValueError(f"this model's weights are already {weight_form(model)}: quantize a float32 model, once")
    packed = [name or "the model" for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    if packed:
        raise ValueError(f"parts of this model are already quantized ({len(packed)} packed layers: {packed[:3]}): "
                         "quantize a float32 model, once")
    if isinstance(model, nn.Linear):
        raise ValueError("quantize() swaps the nn.Linear layers inside a model, and was given a single nn.Linear: "
                         "wrap it (nn.Sequential(layer)) or build a packed layer from it (attnkit.modules.packed: "
                         "Int8Linear(layer.weight, layer.bias), Int4Linear, Float16Linear)")
    floats = {p.dtype for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    if floats - {torch.float32}:
        raise ValueError(f"quantize() takes a float32 model; its linear layers are {sorted(map(str, floats))}")
    read = [p for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in grids
            for p in m.parameters()]  # a layer with a grid is built from it: its weight may be an unread placeholder
    devices = {str(p.device) for p in read} - {"cpu"}
    if devices:
        raise ValueError(f"quantize() packs weights for PyTorch's CPU kernels, and this model's linear layers are "
                         f"on {sorted(devices)}: quantize it on the CPU (model.cpu()), or run it there in float32")


def quantize(model: nn.Module, weights: str, *, grids: Grids | None = None) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for ``weights``' form, in place; the model is returned in eval mode.

    Works on attnkit's decoders and MiniLM, whose attention layers check their
    input against an activation dtype, never a weight's (modules that read a
    linear layer's ``.weight`` themselves, such as the textbook's, cannot run
    packed). Layers a form cannot hold keep another (int8 needs inputs in
    multiples of 16, int4 its tiles, float16 magnitudes up to 65504): a
    warning names them, and a model none of whose layers fits is refused. ``grids``
    (int4 only): for layers named in it, their 4-bit grid as read from a file
    (:func:`attnkit.models.gguf.q4_1_grid`), used instead of their weight.
    """
    if grids and weights != "int4":
        raise ValueError(f"grids are 4-bit weights: they go with weights='int4', not {weights!r}")
    if weights == "float32" and weight_form(model) == "float32":
        return model.eval()  # nothing to swap, whatever the model's dtype (a bfloat16 model stays as it is)
    _check(model, weights, grids or {})
    make: Callable[[nn.Linear, str], Made] = {
        "float16": lambda linear, _: _float16(linear),
        "int8": lambda linear, _: _int8(linear),
    }.get(weights) or _int4_with_float16_head(model, grids or {})
    _check_grid_names(model, grids or {})
    linears = _planned(model, _linears(make))  # every packed layer built before anything is swapped
    if not linears:
        raise ValueError(f"this model has no nn.Linear layer to take {weights} weights")
    _report_kept(linears, weights)
    for parent, name, _, (layer, _) in linears + _planned(model, _table):
        setattr(parent, name, layer)
    model.weight_form = weights  # type: ignore[assignment]
    model.register_forward_pre_hook(_refuse_training)
    return model.eval()
