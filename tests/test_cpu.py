"""Which half-precision dtypes this CPU computes fast, and the warning when one is not."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnkit.cpu import SlowDtypeWarning, cpu_capability, has_fast_bfloat16, warn_if_slow_dtype


def _pretend(monkeypatch: pytest.MonkeyPatch, capability: str, **features: bool) -> None:
    """This CPU reports ``capability``; torch.cpu's feature checks answer ``features`` (others False)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    for name in ("avx512_bf16", "amx_tile", "amx_fp16"):
        answer = features.get(name, False)
        monkeypatch.setattr(torch.cpu, f"_is_{name}_supported", lambda answer=answer: answer)


def test_bfloat16_is_silently_seven_times_slower_on_an_avx2_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 generation ran at 2.5 tok/s against 21.9 in float32 on an AVX2 CPU, without a word."""
    _pretend(monkeypatch, "AVX2")
    assert not has_fast_bfloat16()
    with pytest.warns(SlowDtypeWarning, match=r"capability 'AVX2'.*float32 is faster here") as record:
        warn_if_slow_dtype(torch.bfloat16, "cpu")
    assert len(record) == 1
    assert record[0].filename == __file__  # points at the caller, not at attnkit


def test_capability_string_alone_never_says_bfloat16_is_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch reports "AVX512", never "AVX512_BF16" or "AMX": the extensions are read from torch.cpu."""
    _pretend(monkeypatch, "AVX512")
    assert not has_fast_bfloat16()
    _pretend(monkeypatch, "AVX512", avx512_bf16=True)
    assert has_fast_bfloat16()
    _pretend(monkeypatch, "AVX512", amx_tile=True)
    assert has_fast_bfloat16()


@pytest.mark.parametrize(("capability", "features", "dtype", "device"), [
    ("AVX512", {"avx512_bf16": True}, torch.bfloat16, "cpu"),
    ("AVX2", {}, torch.float32, "cpu"),
    ("AVX2", {}, torch.bfloat16, "cuda"),  # a GPU's speed is not the CPU's business
    ("AVX2", {}, torch.bfloat16, torch.device("meta")),
    ("SVE256", {}, torch.bfloat16, "cpu"),  # not x86: no claim either way
    ("AVX512", {"amx_fp16": True}, torch.float16, "cpu"),
])
def test_no_warning_where_the_dtype_is_fast_or_not_on_the_cpu(monkeypatch: pytest.MonkeyPatch, capability: str,
                                                              features: dict[str, bool], dtype: torch.dtype,
                                                              device: str | torch.device) -> None:
    _pretend(monkeypatch, capability, **features)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_slow_dtype(dtype, device)


def test_float16_without_amx_fp16_warns_too(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend(monkeypatch, "AVX512", avx512_bf16=True)  # bfloat16 fast, float16 not
    with pytest.warns(SlowDtypeWarning, match=r"float16 on this CPU .*without AMX-FP16"):
        warn_if_slow_dtype(torch.float16, "cpu")


def test_a_pytorch_without_the_feature_checks_counts_them_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert not has_fast_bfloat16()


def test_cpu_capability_is_pytorchs() -> None:
    assert cpu_capability() == torch.backends.cpu.get_cpu_capability()
    assert isinstance(SlowDtypeWarning("x"), UserWarning)  # RuntimeWarnings are errors under pytest
