"""What this CPU computes fast: a warning before a half-precision dtype makes a model several times slower.

PyTorch has native bfloat16 arithmetic on x86 only with AVX512-BF16 or AMX;
without them (an AVX2 CPU, say) every bfloat16 matmul is emulated, and
SmolLM2 generated 2.5 tok/s in bfloat16 against 21.9 in float32 on one.
float16 is fast only with AMX-FP16. ``torch.backends.cpu.get_cpu_capability()``
reports the vector ISA PyTorch dispatches to ("DEFAULT", "AVX2", "AVX512",
"VSX", "Z VECTOR", "SVE256", ...), never these extensions: they are read from
``torch.cpu``'s feature checks.

    warn_if_slow_dtype(torch.bfloat16, "cpu")   # SlowDtypeWarning on an AVX2 CPU

Every check here starts from the capability PyTorch dispatches to, so
``ATEN_CPU_CAPABILITY=avx2`` (which makes PyTorch run its AVX2 kernels on an
AVX512 CPU) makes attnkit choose as it would on an AVX2 CPU too. Two libraries
inside PyTorch read their own variables: ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``
(fbgemm: the float16 weight form) and ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN:
bfloat16 products). With all three an AVX512 machine runs the kernels an AVX2 one
runs (``scripts/test.sh`` runs the weight-form,
model and serving tests a second time so, and the test suite sets the other
two when only ``ATEN_CPU_CAPABILITY=avx2`` is given).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

# Capabilities PyTorch reports for x86 CPUs: the only ones whose half-precision speed is known here.
_X86 = ("DEFAULT", "NO AVX", "AVX2", "AVX512")


class SlowDtypeWarning(UserWarning):
    """The dtype asked for has no fast arithmetic on this CPU; float32 is faster."""


def cpu_capability() -> str:
    """The vector instruction set PyTorch's CPU kernels use, e.g. "AVX2" or "AVX512"."""
    return str(torch.backends.cpu.get_cpu_capability())


def _cpu_feature(name: str) -> bool:
    """``torch.cpu._is_<name>_supported()``, False where this PyTorch lacks the check."""
    check: Callable[[], bool] | None = getattr(torch.cpu, f"_is_{name}_supported", None)
    return bool(check()) if check is not None else False


def has_fast_bfloat16() -> bool:
    """False on an x86 CPU without AVX512-BF16 or AMX (bfloat16 emulated), or where PyTorch dispatches to less
    than AVX512 (``ATEN_CPU_CAPABILITY=avx2``); True otherwise.

    On other architectures the speed is not known here, and no claim is made (True).
    """
    capability = cpu_capability()
    if capability not in _X86:
        return True
    return capability == "AVX512" and (_cpu_feature("avx512_bf16") or _cpu_feature("amx_tile"))


def has_fast_float16() -> bool:
    """False on an x86 CPU without AMX-FP16 (float16 emulated) or below AVX512; True otherwise, as for bfloat16."""
    capability = cpu_capability()
    return capability not in _X86 or (capability == "AVX512" and _cpu_feature("amx_fp16"))


def float16_rows_batch_invariant() -> bool:
    """Whether fbgemm's float16-weight product computes a row the same, bit for bit, alone or in any batch.

    Measured: its AVX512 kernels do; its AVX2 kernels block rows by the batch's
    size, so a row's result moves in the last bits (up to 1.5e-5 on a tiny
    model's logits, tests/modules/test_quantize.py). The float16 weight form
    and int4's float16 head run on it. fbgemm picks its kernels by the CPU's
    own features, or by ``FBGEMM_ENABLE_INSTRUCTIONS`` where that is set (not by
    ``ATEN_CPU_CAPABILITY``); False where it runs AVX2 (and where fbgemm is
    absent: other architectures have no float16 form).
    """
    forced = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper()
    if forced:
        return forced.startswith("AVX512")
    return _cpu_feature("avx512")


def warn_if_slow_dtype(dtype: torch.dtype, device: torch.device | str, *, stacklevel: int = 1) -> None:
    """One :class:`SlowDtypeWarning` when ``dtype`` has no fast arithmetic on ``device`` (a CPU).

    The warning points at the line that calls this function (``stacklevel=1``),
    or at its caller's caller (2: a loader blaming the line that called it), ...
    """
    if torch.device(device).type != "cpu":
        return
    fast = {torch.bfloat16: has_fast_bfloat16, torch.float16: has_fast_float16}.get(dtype)
    if fast is None or fast():
        return
    name = str(dtype).removeprefix("torch.")
    needs = "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AMX-FP16"
    warnings.warn(f"{name} on this CPU (PyTorch capability {cpu_capability()!r}, without {needs}) has no native "
                  f"{name} arithmetic and runs several times slower than float32: float32 is faster here",
                  SlowDtypeWarning, stacklevel=stacklevel + 1)
