"""Weights in fewer bytes: every ``nn.Linear`` of a model swapped for a packed form, activations kept float32.

    model = quantize(load_smollm2(), "float16")   # or load_smollm2(weights="float16")

Decoding reads every weight once per token, so its speed follows the bytes it
reads. The forms are PyTorch's own kernels, swapped in as modules
(``torch.ao.quantization.quantize_dynamic``): nothing hand-written.

- ``"float32"``: the weights as they are.
- ``"float16"``: half-precision weights, float32 activations (fbgemm's
  ``fbgemm_linear_fp16_weight``): half the bytes; greedy choices equal
  float32's on SmolLM2 (BENCHMARKS.md, tests/modules/test_quantize.py).

Refused, by name: an unknown form, a form this CPU's PyTorch cannot run, a
model quantized twice, and a quantized model asked to train.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

WEIGHT_FORMS = ("float32", "float16")


def available_forms() -> tuple[str, ...]:
    """The weight forms this machine's PyTorch can run (float16 needs the fbgemm engine: x86 CPUs)."""
    return WEIGHT_FORMS if "fbgemm" in torch.backends.quantized.supported_engines else ("float32",)


def default_form() -> str:
    """The fastest form that meets the accuracy bar here: float16 where fbgemm runs it, else float32."""
    return "float16" if "float16" in available_forms() else "float32"


def weight_form(model: nn.Module) -> str:
    """The form a model's linear layers are in ("float32" when none was swapped)."""
    return str(getattr(model, "weight_form", "float32"))


def _refuse_training(module: nn.Module, _: object) -> None:
    if module.training and torch.is_grad_enabled():
        raise ValueError(f"a model with {weight_form(module)} weights cannot train: its weights are packed for "
                         "inference (no gradients); load it with weights='float32' to train")


def quantize(model: nn.Module, weights: str) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for ``weights``' form, in place; the model is returned in eval mode.

    Works on any attnkit model (the decoders, MiniLM): attention layers check
    their input against an activation dtype, never a weight's.
    """
    if weights not in WEIGHT_FORMS:
        raise ValueError(f"unknown weight form {weights!r}; known: {', '.join(WEIGHT_FORMS)}")
    if weights not in available_forms():
        raise ValueError(f"weight form {weights!r} needs PyTorch's fbgemm engine, which this machine's PyTorch "
                         f"lacks (engines: {', '.join(torch.backends.quantized.supported_engines)})")
    if weight_form(model) != "float32":
        raise ValueError(f"this model's weights are already {weight_form(model)}: quantize a float32 model, once")
    if weights == "float32":
        return model
    floats = {p.dtype for m in model.modules() if type(m) is nn.Linear for p in m.parameters()}
    if floats - {torch.float32}:
        raise ValueError(f"quantize() takes a float32 model; its linear layers are {sorted(map(str, floats))}")
    with warnings.catch_warnings():  # torch.ao announces its move to torchao on every call
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*|.*quantize_per_tensor.*")
        torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.float16, inplace=True)
    model.weight_form = weights  # type: ignore[assignment]
    model.register_forward_pre_hook(_refuse_training)
    return model.eval()
