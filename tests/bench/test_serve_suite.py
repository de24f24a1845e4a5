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
    from types import SimpleNamespace

    import torch

    import attnkit.models
    from attnkit.bench.serve import offline_ceiling

    seen: list[int] = []
    loaded: list[str] = []

    def generate(ids: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int, **_: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return torch.cat([ids, torch.ones(ids.shape[0], max_new_tokens, dtype=ids.dtype)], dim=1)  # (B, T + new)

    model = SimpleNamespace(tokenizer=SimpleNamespace(chat_ids=lambda messages: [5, 6, 7]), pad_token_id=0,
                            generate=generate)
    monkeypatch.setattr(attnkit.models, "load_smollm2", lambda weights: loaded.append(weights) or model)
    before = torch.get_num_threads()
    row = offline_ceiling(1, "float32", threads=1 if before != 1 else 2)
    assert seen == [1 if before != 1 else 2] and torch.get_num_threads() == before
    assert loaded == ["float32"] and row["output_tokens"] == 64  # client 0 asks for 64 new tokens
