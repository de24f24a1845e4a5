"""Weights in fewer bytes: every ``nn.Linear`` of a model swapped for a packed form.

    model = quantize(load_smollm2(), "int4")   # or load_smollm2(weights="int4")

Decoding reads every weight once per token, so its speed follows the bytes it
reads. The forms are PyTorch's own kernels, swapped in as modules: nothing
hand-written.

- ``"float32"``: the weights as they are.
- ``"float16"``: half-precision weights, float32 activations (fbgemm's
  ``fbgemm_linear_fp16_weight`` through ``torch.ao``'s module swap): half the
  bytes.
- ``"int8"``: int8 weights with one scale per output channel
  (``torch._weight_int8pack_mm``): a quarter of the bytes.
- ``"int4"``: 4-bit weights in groups of 32 inputs, each group with its own
  scale and minimum (``torch._weight_int4pack_mm_for_cpu``). This is exactly
  GGUF's Q4_1 block: a file's Q4_1 weights come back on the same grid
  (tested against the file's raw blocks). A matrix tied to an embedding (the
  vocabulary head, stored 8-bit in such files) is kept in float16 (in int8 it
  cost SmolLM2 1.5 points of greedy agreement), and one whose inputs are not
  a multiple of 32 (or outputs not a multiple of 16) in int8.

The int8 and int4 kernels take bfloat16 activations: their float32 path
measured 4-25x slower on this project's CPU (BENCHMARKS.md), so those layers
round their input to bfloat16 and return float32. Every form meets the
accuracy bar on SmolLM2 (tests/modules/test_quantize.py: >= 97% greedy
agreement, perplexity within 3%).

Refused, by name: an unknown form, a form this CPU's PyTorch cannot run, a
model quantized twice, and a quantized model asked to train or to
differentiate through its packed weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnkit._cpu import has_fast_bfloat16

WEIGHT_FORMS = ("float32", "float16", "int8", "int4")
GROUP = 32  # inputs per int4 group: GGUF's Q4_1 block


def available_forms() -> tuple[str, ...]:
    """The weight forms this machine's PyTorch can run (float16 needs the fbgemm engine: x86 CPUs)."""
    if "fbgemm" in torch.backends.quantized.supported_engines:
        return WEIGHT_FORMS
    return ("float32", "int8")  # float16, and int4's float16 head, need fbgemm


def default_form() -> str:
    """The fastest form that meets the accuracy bar on this CPU (BENCHMARKS.md has the measurements).

    int4 where bfloat16 arithmetic is native (its kernel computes in
    bfloat16), else float16 where fbgemm runs it, else float32.
    """
    if has_fast_bfloat16():
        return "int4"
    return "float16" if "float16" in available_forms() else "float32"


def weight_form(model: nn.Module) -> str:
    """The form a model's linear layers are in ("float32" when none was swapped)."""
    return str(getattr(model, "weight_form", "float32"))


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed for one of PyTorch's low-bit kernels (inference only).

    Subclasses pack in their constructor and define :meth:`matmul`
    over 2-D bfloat16 input; this class keeps the float32 interface.
    """

    form = "packed"
    bias: Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def matmul(self, x: Tensor) -> Tensor:
        """(M, in) bfloat16 -> (M, out) bfloat16."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"a linear layer with {self.form} weights has no gradient (its weights are packed for "
                             "inference): load the model with weights='float32' to differentiate through it")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input (..., {self.in_features}), got {tuple(x.shape)}")
        out = self.matmul(x.reshape(-1, self.in_features).to(torch.bfloat16))  # (..., in) -> (M, out)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (M, out) -> (..., out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(PackedLinear):
    """int8 weights, one bfloat16 scale per output channel (symmetric): ``torch._weight_int8pack_mm``."""

    form = "int8"
    codes: Tensor  # int8 (out, in)
    scale: Tensor  # bfloat16 (out,)

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        w = weight.detach().float()  # (out, in)
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)  # (out,)
        codes = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()  # (out, in)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    def matmul(self, x: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scale)  # (M, in) -> (M, out)


def int4_grid(weight: Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit codes of ``weight`` (out, in) in groups of 32 inputs: Q4_1's grid.

    Returns codes int32 (out, in) in 0..15, scale and minimum (out, in / 32)
    in ``dtype``, with weight ~= minimum + codes * scale per group.
    """
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)  # (N, K) -> (N, K/32, 32)
    low, high = groups.amin(dim=2), groups.amax(dim=2)  # (N, K/32)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)  # (N, K/32)
    low = low.to(dtype)
    codes = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)  # (N, K/32, 32)
    return codes.to(torch.int32).reshape(out_features, in_features), scale, low


class Int4Linear(PackedLinear):
    """4-bit weights in groups of 32 inputs with a scale and minimum each: ``torch._weight_int4pack_mm_for_cpu``."""

    form = "int4"
    packed: Tensor  # uint8 (out, in / 2), the kernel's tiles
    scale_zero: Tensor  # bfloat16 (in / 32, out, 2)

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        if in_features % GROUP or out_features % 16:
            raise ValueError(f"int4 weights need inputs in groups of {GROUP} and outputs in multiples of 16 (the "
                             f"kernel's tiles), got in_features={in_features}, out_features={out_features}")
        super().__init__(in_features, out_features, bias)
        codes, scale, low = int4_grid(weight)  # (N, K), (N, K/32), (N, K/32)
        # the kernel reads w = (code - 8) * scale + zero: zero = low + 8 * scale, per group (K/32, N, 2)
        zero = (low.float() + 8 * scale.float()).to(torch.bfloat16)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))  # (N, K / 2) uint8
        self.register_buffer("scale_zero", torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous())

    def matmul(self, x: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)  # (M, K) -> (M, N)


def _refuse_training(module: nn.Module, _: object) -> None:
    if module.training and torch.is_grad_enabled():
        raise ValueError(f"a model with {weight_form(module)} weights cannot train: its weights are packed for "
                         "inference (no gradients); load it with weights='float32' to train")


def _tied_heads(model: nn.Module) -> dict[str, object]:
    """float16 qconfigs for the linear layers that share their weight with an embedding table (a tied head)."""
    tables = {m.weight.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    return {name: torch.ao.quantization.float16_dynamic_qconfig for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.weight.untyped_storage().data_ptr() in tables}


def _float16(model: nn.Module, spec: set[type[nn.Module]] | dict[str, object]) -> None:
    """fbgemm's float16 linear swapped in for ``spec`` (types or module names), through torch.ao."""
    with warnings.catch_warnings():  # torch.ao announces its move to torchao on every call
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*|.*quantize_per_tensor.*")
        torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.float16, inplace=True)


def _int4(linear: nn.Linear) -> PackedLinear:
    """int4, or int8 where the sizes do not fit the kernel's tiles (inputs in groups of 32, outputs by 16)."""
    if linear.in_features % GROUP or linear.out_features % 16:
        return Int8Linear(linear.weight, linear.bias)
    return Int4Linear(linear.weight, linear.bias)


def _swap(module: nn.Module, make: Callable[[nn.Linear], PackedLinear]) -> None:
    """Replace every ``nn.Linear`` below ``module`` by ``make(linear)``, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _swap(child, make)


def _check(model: nn.Module, weights: str) -> None:
    if weights not in WEIGHT_FORMS:
        raise ValueError(f"unknown weight form {weights!r}; known: {', '.join(WEIGHT_FORMS)}")
    if weights not in available_forms():
        raise ValueError(f"weight form {weights!r} needs PyTorch's fbgemm engine (float16 matrices), which this "
                         f"machine's PyTorch "
                         f"lacks (engines: {', '.join(torch.backends.quantized.supported_engines)})")
    if weight_form(model) != "float32":
        raise ValueError(f"this model's weights are already {weight_form(model)}: quantize a float32 model, once")
    floats = {p.dtype for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    if floats - {torch.float32}:
        raise ValueError(f"quantize() takes a float32 model; its linear layers are {sorted(map(str, floats))}")


def quantize(model: nn.Module, weights: str) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for ``weights``' form, in place; the model is returned in eval mode.

    Works on any attnkit model (the decoders, MiniLM): attention layers check
    their input against an activation dtype, never a weight's.
    """
    _check(model, weights)
    if weights == "float32":
        return model
    if weights == "float16":
        _float16(model, {nn.Linear})
    elif weights == "int8":
        _swap(model, lambda linear: Int8Linear(linear.weight, linear.bias))
    else:  # the head tied to the embedding in float16 (int8 there cost 1.5 points of greedy agreement)
        _float16(model, _tied_heads(model))
        _swap(model, _int4)
    model.weight_form = weights  # type: ignore[assignment]
    model.register_forward_pre_hook(_refuse_training)
    return model.eval()
