"""The generate suite's targets, decided from its rows (the timing itself is a benchmark, not a test)."""

from __future__ import annotations

from attnkit.bench.generate import format_rows, generate_targets


def _gen(contender: str, length: int, decode: float, share: float) -> dict:
    return {"kind": "generate", "contender": contender, "prompt_len": length, "new_tokens": 128,
            "prefill_tokens_per_s": 100.0, "decode_tokens_per_s": decode, "decode_share_of_bound": share}


def test_targets_are_ratios_of_the_same_run_with_verdicts():
    rows = [
        _gen("attnkit-float32", 16, 15.6, 0.82), _gen("transformers-float32", 16, 12.0, 0.63),
        _gen("attnkit-float32", 512, 12.0, 0.63), _gen("transformers-float32", 512, 10.0, 0.53),
        {"kind": "bf16_agreement", "positions": 256, "agreement": 0.94},
    ]
    found = {r["target"]: r for r in generate_targets(rows)}
    assert found["T=16 float32 decode vs transformers float32"]["measured"] == 1.3
    assert found["T=16 float32 decode vs transformers float32"]["met"]
    assert found["T=16 float32 decode vs the measured bound"]["met"]
    assert not found["T=512 float32 decode vs transformers float32"]["met"]  # 1.2x < 1.3x
    assert not found["T=512 float32 decode vs the measured bound"]["met"]  # 63% < 80%
    assert not found["bfloat16 greedy choice = float32's (teacher-forced)"]["met"]  # 94% < 95%
    assert "MISSED" in format_rows(rows + list(found.values()))


def test_bfloat16_is_judged_against_transformers_in_float32():
    rows = [_gen("attnkit-bfloat16", 16, 25.0, 0.7), _gen("transformers-bfloat16", 16, 5.0, 0.1),
            _gen("transformers-float32", 16, 12.0, 0.3)]
    (target,) = generate_targets(rows)
    assert target["target"] == "T=16 bfloat16 decode vs transformers float32"
    assert target["measured"] == round(25 / 12, 3) and target["met"]
