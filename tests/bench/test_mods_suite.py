"""The mods benchmark suite at tiny sizes: every case and target present, every contender checked before timing.

No timings are asserted: only that the rows exist, carry what they should, and
that a contender computing the wrong thing is caught instead of timed.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnkit import cli
from attnkit.backends import attention
from attnkit.bench import command, mods
from attnkit.bench.mods import ATOL, CASES, Case, Contender, ModsSuite, mods_targets, run_case, run_mods_suite
from attnkit.functional.masks import position_mask
from attnkit.functional.modifiers import sliding_window

TINY = dict(long_len=256, short_len=128, window=32, documents=4, num_heads=3, num_kv_heads=1, head_dim=8)
CONTENDERS = {  # the keys of each case without FlexAttention
    "window": ["chunked window", "chunked mask_mod", "chunked dense mask"],
    "documents": ["chunked causal", "chunked and_masks", "chunked causal+document"],
    "modifiers": ["chunked causal", "chunked softcap", "chunked alibi", "sdpa causal"],
    "backward": ["chunked causal", "chunked softcap", "math softcap"],
}


def _suite(**fields) -> ModsSuite:
    return ModsSuite.small(**{**TINY, "flex": False, **fields})


def _case_rows(rows, suite: ModsSuite, name: str) -> dict[str, dict]:
    return {r["contender"]: r for r in rows if r["kind"] == mods.case_title(name, suite)}


def _targets(rows) -> list[dict]:
    return [r for r in rows if r["kind"] == "target"]


def test_every_case_is_checked_timed_and_decides_its_targets():
    """A case or contender left out, an unchecked contender, or a target that never finds its rows."""
    suite, threads = _suite(), torch.get_num_threads()
    rows = run_mods_suite(suite)
    assert torch.get_num_threads() == threads  # the suite's 2 threads are undone
    env = rows[0]
    assert env["kind"] == "env" and env["threads"] == 2
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    for name in CASES:
        found = _case_rows(rows, suite, name)
        assert list(found) == CONTENDERS[name]
        references = {r["contender"]: r["checked_against"] for r in rows
                      if r["kind"] == "contenders" and r["case"] == name}
        assert list(references) == CONTENDERS[name]
        for key, row in found.items():
            assert row["status"] == "ok", row
            low, high = map(float, row["spread_ms"].split("-"))
            assert 0 < low <= row["median_ms"] * 1.001 and row["median_ms"] <= high * 1.001  # spread: 4 digits
            if references[key] == "(reference)":
                assert row["max_diff"] is None
            else:  # compared with its reference before it was timed
                assert references[key] in found and row["max_diff"] <= ATOL, key
        base = "chunked window" if name == "window" else "chunked causal"
        assert found[base]["x_baseline"] == 1.0
    targets = _targets(rows)
    assert len(targets) == 6
    assert all(t["measured"] is not None and t["verdict"] in ("met", "MISSED") for t in targets)
    assert all(t["met"] == (t["verdict"] == "met") for t in targets)


def test_a_dense_mask_one_key_too_wide_is_caught_and_not_timed():
    """An off-by-one in the dense band (> q - window - 1): its output differs, so it is neither timed nor judged."""
    suite = _suite(cases=("window",))
    t, w = suite.long_len, suite.window
    q = torch.randn(suite.batch, suite.num_heads, t, suite.head_dim)  # (B, H, T, D)
    k, v = torch.randn(2, suite.batch, suite.num_kv_heads, t, suite.head_dim)  # (B, G, S, D) each
    positions = torch.arange(t)[None]  # (1, T)
    too_wide = position_mask(positions, positions, causal=True, window=w + 1)[0, 0]  # (T, S): one key too many
    def chunked(**kwargs):  # a contender's build, as the suite's: chunked attention over the same q, k, v
        return lambda: lambda: attention(q, k, v, backend="chunked", **kwargs)

    case = Case("window", mods.case_title("window", suite), "chunked window", (
        Contender("chunked window", "window", chunked(causal=True, window=w)),
        Contender("chunked mask_mod", "mask_mod", chunked(mask_mod=sliding_window(w)), "chunked window"),
        Contender("chunked dense mask", "dense band", chunked(mask=too_wide), "chunked window")))
    rows = run_case(case, repeats=suite.repeats, warmup=suite.warmup)
    dense = _case_rows(rows, suite, "window")["chunked dense mask"]
    assert dense["status"] == "wrong" and dense["median_ms"] is None
    assert dense["reason"].startswith("differs from chunked window") and "Mismatched elements" in dense["reason"]
    window_targets = [t for t in mods_targets(rows, suite) if "dense-mask" in t["target"]]
    assert [t["verdict"] for t in window_targets] == ["not measured in this run"] * 2
    assert _case_rows(rows, suite, "window")["chunked mask_mod"]["status"] == "ok"


def test_a_wrong_gradient_alone_is_caught():
    """A contender whose output is right but whose gradient is off: forward+backward compares both."""
    out, grad = torch.randn(2, 3), torch.randn(2, 3)
    case = Case("backward", "tiny", "ref", (
        Contender("ref", "reference", lambda: lambda: (out, grad)),
        Contender("good", "same", lambda: lambda: (out.clone(), grad.clone()), same_as="ref"),
        Contender("bad", "wrong gradient", lambda: lambda: (out.clone(), grad * 1.01 + 0.01), same_as="ref")))
    rows = {r["contender"]: r for r in run_case(case, repeats=2, warmup=0)}
    assert rows["good"]["status"] == "ok" and rows["good"]["max_diff"] == 0.0
    assert rows["bad"]["status"] == "wrong" and "item [1]" in rows["bad"]["reason"]
    assert rows["bad"]["median_ms"] is None and rows["bad"]["x_baseline"] is None


def test_a_contender_whose_reference_failed_is_not_checked_against_nothing():
    def broken() -> mods.Call:
        raise RuntimeError("kernel exploded")

    case = Case("x", "tiny", "ref", (Contender("ref", "reference", broken),
                                     Contender("other", "other", lambda: lambda: torch.zeros(2), same_as="ref")))
    rows = {r["contender"]: r for r in run_case(case, repeats=1, warmup=0)}
    assert rows["ref"]["status"] == "error" and "RuntimeError: kernel exploded" in rows["ref"]["reason"]
    assert rows["other"]["status"] == "error" and "reference 'ref' did not run" in rows["other"]["reason"]


def test_a_flex_compile_failure_is_a_row_not_a_crash(monkeypatch):
    pytest.importorskip("torch.nn.attention.flex_attention")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InductorError: no working C++ compiler\nsecond line")

    monkeypatch.setattr(torch, "compile", no_compiler)
    suite = _suite(cases=("window",), flex=True)
    found = _case_rows(run_mods_suite(suite), suite, "window")
    assert found["flex window"]["status"] == "error"
    assert found["flex window"]["reason"] == "RuntimeError: InductorError: no working C++ compiler; second line"
    assert all(found[key]["status"] == "ok" for key in CONTENDERS["window"])


def test_flex_backward_on_cpu_is_reported_in_its_row():
    """FlexAttention has no CPU backward: the row carries its own error (raised before compiling)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    suite = _suite(cases=("backward",), flex=True)
    flex = _case_rows(run_mods_suite(suite), suite, "backward")["flex softcap"]
    assert flex["status"] == "error" and flex["median_ms"] is None
    assert "backward" in flex["reason"]


def test_compiled_flex_equals_chunked_on_the_window_case():
    """The built-in modifiers drive FlexAttention too; its compile time is its own column (one compile, seconds)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    suite = _suite(cases=("window",), flex=True)
    rows = run_mods_suite(suite)
    flex = _case_rows(rows, suite, "window")["flex window"]
    assert flex["status"] == "ok", flex["reason"]
    assert flex["max_diff"] <= ATOL
    assert flex["setup_s"] > 0 and flex["compile_s"] is not None and flex["first_call_s"] >= flex["compile_s"]
    assert all(r["compile_s"] is None for key, r in _case_rows(rows, suite, "window").items() if key != "flex window")
    assert "flex window / this" in next(t for t in _targets(rows) if "dense-mask" in t["target"])["note"]


def test_options_choose_lengths_and_refuse_what_the_suite_does_not_vary():
    suite = ModsSuite.from_options(command.Options(suite="mods", seq_lens=[1024, 512], repeats=2, warmup=0))
    assert (suite.long_len, suite.short_len, suite.repeats, suite.warmup, suite.threads) == (1024, 512, 2, 0, 2)
    assert ModsSuite.from_options(command.Options(suite="mods", seq_lens=[4096])).short_len == 4096
    assert ModsSuite.from_options(command.Options(suite="mods")) == ModsSuite(repeats=5, warmup=1)
    with pytest.raises(ValueError, match="float32 on cpu; got --dtype float64"):
        ModsSuite.from_options(command.Options(suite="mods", dtype="float64"))
    with pytest.raises(ValueError, match="fixed"):
        ModsSuite.from_options(command.Options(suite="mods", contenders=["attnkit"]))
    with pytest.raises(ValueError, match="long_len=1020 is not divisible by documents=8"):
        ModsSuite(long_len=1020)
    with pytest.raises(ValueError, match="cases must be some of"):
        ModsSuite(cases=("windows",))


def test_bench_suite_mods_writes_its_rows_and_targets(monkeypatch, tmp_path, capsys):
    """`attnkit bench --suite mods` is a row suite: its tables and targets land in results.json and summary.md."""
    assert {"mods", "streaming"} <= set(command.ROW_SUITES) and "mods" in command.suite_names()
    real = mods.run_mods_suite
    monkeypatch.setattr(mods, "run_mods_suite",
                        lambda suite, log=None: real(dataclasses.replace(suite, **TINY, flex=False), log))
    assert cli.main(["bench", "--suite", "mods", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    kinds = [r["kind"] for r in doc["results"]]
    assert kinds.count("target") == 6 and kinds[0] == "env"
    summary = (tmp_path / "summary.md").read_text()
    assert "**suite mods: target**" in summary and "| target | goal | measured | met | verdict | note |" in summary
    out = capsys.readouterr().out
    assert "suite mods: target" in out and "suite mods: contenders" in out
