"""The serve suite's offline ceiling runs the weight form attnkit serve runs."""

from __future__ import annotations

import pytest

import attnkit.modules.quantize as quantize
from attnkit.bench.serve import served_form


def test_the_ceiling_runs_the_form_attnkit_serve_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without fbgemm (an ARM CPU) the ceiling took int8, every form counted accurate, while attnkit serve loads
    SmolLM2 in float32 there: int8 misses the accuracy bar on it."""
    monkeypatch.setattr(quantize, "has_fast_bfloat16", lambda: True)
    monkeypatch.setattr(quantize, "available_forms", lambda: quantize.WEIGHT_FORMS)
    assert served_form() == "int4"
    monkeypatch.setattr(quantize, "available_forms", lambda: ("float32", "int8"))
    assert served_form() == "float32"


def test_the_ceiling_runs_on_the_servers_threads_and_restores_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    """It ran at the caller's count while its rows said --threads."""
    import torch

    from attnkit.bench import serve

    seen: list[int] = []
    monkeypatch.setattr(serve, "_offline_run", lambda clients, weights: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    serve._offline(1, "float32", threads=1 if before != 1 else 2)
    assert seen == [1 if before != 1 else 2] and torch.get_num_threads() == before
