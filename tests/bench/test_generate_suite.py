"""The generate suite: its targets and report decided from rows, its options, llama.cpp's skip and a tiny run.

The timing itself is a benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import pytest
import torch

from attnkit.bench import llamacpp
from attnkit.bench.command import Options, add_arguments
from attnkit.bench.generate import (
    MODELS,
    GenerateSuite,
    format_rows,
    gemma3_targets,
    generate_targets,
    plot,
    prompt_ids,
    rounds,
    run_generate_suite,
)
from attnkit.bench.generate_contenders import GEMMA3_LENGTHS
from tests._util import need
from tests.models._decoder import need_smollm2, smollm2


def _b1(contender: str, context: int, decode: float, prefill: float = 100.0) -> dict:
    return {"kind": "batch 1", "contender": contender, "context": context, "new_tokens": 128,
            "ttft_s": context / prefill, "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}


def _batched(contender: str, rate: float) -> dict:
    how = "one after another" if contender.startswith("llama.cpp") else "batched"
    return {"kind": "batched", "contender": contender, "batch": 8, "prompt_len": 64, "new_tokens": 128, "how": how,
            "seconds": 8 * 128 / rate, "new_tokens_per_s": rate}


def _process(contender: str, load: float, rss: float) -> dict:
    return {"kind": "load and memory", "contender": contender, "load_s": load, "loaded_rss_mib": rss,
            "generate_peak_mib": rss + 10, "generate_extra_mib": 10, "generate_prompt": 16,
            "generate_new_tokens": 8, "peak_reset": True}


# the figures from a side-by-side run, with attnkit int4 as the default form
ROWS = [
    _b1("attnkit-float32", 16, 22.7), _b1("attnkit-int4", 16, 45.4), _b1("llama.cpp", 16, 124.0),
    _b1("llama.cpp-fa", 16, 130.0),
    _b1("attnkit-int4", 4000, 36.0, prefill=380.0), _b1("llama.cpp", 4000, 44.1, prefill=184.0),
    _b1("attnkit-int4", 7900, 20.0), _b1("llama.cpp", 7900, 31.5),
    _batched("attnkit-float32", 65.6), _batched("attnkit-int4", 180.0), _batched("llama.cpp", 85.0),
    _process("attnkit-float32", 8.4, 842.0), _process("attnkit-int4", 2.5, 430.0), _process("llama.cpp", 0.5, 160.0),
]


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["target"]: r for r in rows}


def test_every_target_is_a_ratio_of_the_default_form_with_its_verdict():
    """Each of the issue's targets, judged on the default form: a ratio taken the wrong way round, against the
    wrong contender or with the wrong threshold flips a verdict or a value here."""
    found = generate_targets(ROWS, "int4")
    assert len(found) == 8
    assert all("attnkit int4 (the default form)" in t["target"] for t in found)
    got = {t["goal"] + " " + t["target"].split(":")[0]: (t["measured"], t["met"]) for t in found}
    assert got[">= 1.8x batch 1, 16-token prompt"] == (2.0, True)  # 45.4 / 22.7
    assert got[">= 0.8x batch 1, 4000-token context"] == (round(36.0 / 44.1, 3), True)
    assert got[">= 2x batch 1, 4000-token context"] == (round(380 / 184, 3), True)  # prefill
    assert got[">= 0.7x batch 1, 7900-token context"] == (round(20 / 31.5, 3), False)
    assert got[">= 3x batch 8"] == (round(180 / 65.6, 3), False)
    assert got[">= 2x batch 8"] == (round(180 / 85, 3), True)
    assert got["<= 3 s load"] == (2.5, True)
    assert [t["verdict"] for t in found] == ["met", "met", "met", "MISSED", "MISSED", "met", "met", "MISSED"]
    assert got["<= 0.5x resident memory with the model loaded, attnkit int4 (the default form) / attnkit float32"] \
        == (round(430 / 842, 3), False)


def test_the_16_token_target_also_reports_the_ratio_to_llama_cpp():
    first = generate_targets(ROWS, "int4")[0]
    assert "vs llama.cpp: 0.37x" in first["note"]  # 45.4 / 124
    assert "vs llama.cpp with flash attention: 0.35x" in first["note"]  # 45.4 / 130


def test_a_target_this_run_did_not_measure_says_so_instead_of_passing_or_failing():
    """No llama.cpp rows (not installed) and no long contexts: those targets are present, undecided."""
    rows = [r for r in ROWS if not r["contender"].startswith("llama.cpp")]
    found = _by_name(generate_targets(rows, "int4"))
    undecided = [name for name, t in found.items() if t["met"] is None]
    assert len(undecided) == 4 and all(found[n]["measured"] is None for n in undecided)
    assert all("llama.cpp" in n for n in undecided)
    assert "not measured in this run" in format_rows(list(found.values()))


def test_float32_as_the_default_form_is_judged_against_itself():
    """On a CPU whose default is float32 the 1.8x target reads 1.0x: missed, never skipped."""
    first = generate_targets(ROWS, "float32")[0]
    assert first["measured"] == 1.0 and first["met"] is False
    assert "attnkit float32 (the default form)" in first["target"]


def test_format_rows_shows_every_kind_of_row_with_its_numbers():
    rows = [{"kind": "env", "threads": 2, "cpu_capability": "AVX2"},
            {"kind": "skipped", "contender": "llama.cpp", "reason": "not installed"},
            {"kind": "bound", "weights": "float32", "seconds_per_pass": 0.037, "decode_tokens_per_s": 27.0},
            *ROWS, *generate_targets(ROWS, "int4")]
    text = format_rows(rows)
    lines = text.splitlines()
    assert len(lines) == len(rows) + 1  # the env row: one line per key
    # two columns, key and value: the env was one comma-joined line, squeezed into a 16-column table in a terminal
    assert lines[:2] == ["threads         2", "cpu_capability  AVX2"]
    assert lines[2] == "skipped llama.cpp: not installed"
    assert "37.0 ms per pass" in lines[3]
    assert "attnkit-int4 B=1 T= 4000 +128" in text and "prefill   380.0 tok/s, decode   36.0 tok/s" in text
    assert "llama.cpp B=8 T=64 +128 (one after another): 85.0 new tok/s" in text
    assert "attnkit-int4 load 2.50 s" in text and "loaded 430 MiB" in text
    assert text.count(": met") == 5 and text.count(": MISSED") == 3


def test_plot_draws_decode_and_prefill_per_contender(tmp_path: Path):
    pytest.importorskip("matplotlib")
    written = plot([{"kind": "env", "threads": 2}, *ROWS], tmp_path)
    assert [p.name for p in written] == ["decode.png", "prefill.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert plot([r for r in ROWS if r["kind"] == "load and memory"], tmp_path / "none") == []


def test_rounds_rotate_the_order_so_no_contender_always_runs_first():
    order: list[str] = []
    contenders = {name: name for name in "abc"}
    out = rounds(contenders, lambda c: order.append(c) or c.upper(), 3, lambda _: None, "case")
    assert order == list("abcbcacab")
    assert out == {"a": ["A"] * 3, "b": ["B"] * 3, "c": ["C"] * 3}


def test_options_choose_cases_and_contenders():
    suite = GenerateSuite.from_options(Options(suite="generate", seq_lens=[16], batch=[8], forms=["float32", "int4"],
                                               no_transformers=True, llamacpp_fa="off", new_tokens=4, repeats=1))
    assert suite.lengths == () and suite.batch == 8  # --batch 8: only the batched case
    assert suite.names(llamacpp_installed=True) == ["attnkit-float32", "attnkit-int4", "llama.cpp"]
    assert suite.names(llamacpp_installed=False) == ["attnkit-float32", "attnkit-int4"]
    suite = GenerateSuite.from_options(Options(suite="generate", seq_lens=[16], batch=[1], no_llamacpp=True))
    assert suite.lengths == (16,) and suite.batch == 0 and suite.llamacpp == ()
    assert GenerateSuite.from_options(Options(suite="generate")).lengths == (16, 4000, 7900)
    suite = GenerateSuite.from_options(Options(suite="generate", forms=["int4"], compiled=["int4"],
                                               no_transformers=True, no_llamacpp=True))
    assert suite.names(llamacpp_installed=True) == ["attnkit-int4", "attnkit-int4-compiled"]
    suite = GenerateSuite.from_options(Options(suite="generate", forms=["int4"], kv_int8=["int4"],
                                               no_transformers=True, no_llamacpp=True))
    assert suite.attnkit_names() == {"attnkit-int4": "int4", "attnkit-int4-kv8": "int4"}


def test_an_int8_cache_contender_generates_with_kv_dtype_int8_and_loads_its_form(monkeypatch: pytest.MonkeyPatch):
    """attnkit-<form>-kv8 loads <form> and passes kv_dtype="int8" to the loop; the plain contender passes None."""
    import attnkit.models.generation as generation
    from attnkit.bench import generate_contenders as contenders

    loaded, calls = [], []
    monkeypatch.setitem(contenders.MODELS, "smollm2", replace(
        contenders.MODELS["smollm2"], load=lambda form, dtype: loaded.append(form) or object()))
    monkeypatch.setattr(generation, "generate_steps", lambda model, ids, **kw: calls.append(kw) or iter([0, 1]))
    for name in ("attnkit-int4-kv8", "attnkit-int4"):
        contenders.load_contender("smollm2", name, context=64, threads=1).single([1, 2, 3], 2)
    assert loaded == ["int4", "int4"]
    assert [kw["kv_dtype"] for kw in calls] == ["int8", None]


def _tiny_smollm2(monkeypatch: pytest.MonkeyPatch, path: Path, load: Callable[[str, torch.dtype], object]) -> None:
    """The suite's "smollm2" reads a tiny Llama file at ``path`` (its tokenizer, its context) and loads with
    ``load(form, dtype)``."""
    from attnkit.bench import generate
    from tests.models._decoder import write_tiny_llama

    write_tiny_llama(path, context=128)
    monkeypatch.setitem(generate.MODELS, "smollm2", replace(MODELS["smollm2"], path=lambda: path, load=load))


def test_a_compiled_contender_runs_the_compiled_step_and_warms_up_on_the_case_itself(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Its graph is made for the case's cache size: a short warm-up would leave the compilation in the timing."""
    need("gguf")
    import attnkit.models.generation as generation

    calls = []
    loaded: list[str] = []
    _tiny_smollm2(monkeypatch, tmp_path / "tiny.gguf", lambda form, dtype: loaded.append(form) or object())
    monkeypatch.setattr(generation, "generate_steps", lambda model, ids, **kw: calls.append((ids.shape, kw)) or
                        iter([0, 1, 2]))
    rows = run_generate_suite(GenerateSuite(forms=(), compiled=("int4",), lengths=(16,), batch=0, new_tokens=3,
                                            repeats=1, transformers=False, llamacpp=(), memory=False))
    assert loaded == ["int4"]
    assert [shape for shape, _ in calls] == [(1, 16), (1, 16)]  # the warm-up is the case itself, then one round
    assert all(kw["compile"] is True for _, kw in calls)
    (one,) = [r for r in rows if r["kind"] == "batch 1"]
    assert one["contender"] == "attnkit-int4-compiled" and one["context"] == 16


@pytest.mark.parametrize(("options", "message"), [
    (Options(suite="generate", batch=[1, 4, 8]), "one batched case: --batch takes 1 (the batch-1 cases) and one other "
                                                 "size, got --batch 1,4,8"),
    (Options(suite="generate", warmup=5), "leave --warmup out, got --warmup 5"),
])
def test_options_the_suite_would_drop_are_refused(options: Options, message: str):
    """--batch 4,8 ran batch 8 only and --warmup was accepted and never read: both silently."""
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerateSuite.from_options(options)


@pytest.mark.parametrize(("options", "message"), [
    (Options(suite="generate", dtype="bfloat16"), "keeps float32 activations"),
    (Options(suite="generate", contenders=["attnkit"]), "--forms"),
    (Options(suite="generate", forms=["int3"]), "unknown weight form 'int3'; known: float32, float16, int8, int4"),
    (Options(suite="generate", new_tokens=1), "new_tokens must be an int >= 2, got new_tokens=1"),
    (Options(suite="generate", threads=0), "threads must be an int >= 1"),
    (Options(suite="generate", compiled=["int5"]), "unknown weight form 'int5'"),
    (Options(suite="generate", forms=["int4"], compiled=["int4", "int4"]), "weight form 'int4' is named twice"),
    (Options(suite="generate", kv_int8=["int4", "int4"]), "weight form 'int4' is named twice"),
    (Options(suite="generate", kv_int8=["int5"]), "unknown weight form 'int5'"),
    (Options(suite="generate", device="cuda", dtype="bfloat16", kv_int8=["float32"]),
     "the int8 KV cache reads its keys with a CPU kernel: on device 'cuda'"),
    (Options(suite="generate", device="cuda", dtype="bfloat16", forms=["float32", "int4"]),
     "weight form 'int4' is a packed CPU kernel: on device 'cuda' attnkit runs its plain weights in dtype bfloat16 "
     "(forms: float32 only)"),
    (Options(suite="generate", device="cuda:0", dtype="float16", compiled=["int8"]),
     "weight form 'int8' is a packed CPU kernel: on device 'cuda:0'"),
    (Options(suite="generate", device="cuda", forms=["int3"]), "unknown weight form 'int3'"),
    (Options(suite="generate", device="cuda", dtype="float64"),
     "dtype must be one of float32, bfloat16, float16 on device 'cuda', got dtype='float64'"),
    (Options(suite="generate", device="mps"), "the generate suite runs on 'cpu' or 'cuda' (or 'cuda:N'), got "
     "device='mps'"),
    (Options(suite="generate", device="gpu"), "device must be 'cpu', 'cuda' or 'cuda:N', got device='gpu'"),
])
def test_bad_options_are_refused_by_name(options: Options, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerateSuite.from_options(options)


def test_missing_llama_cpp_is_skipped_with_the_command_that_builds_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    reason = llamacpp.missing_reason()
    assert reason is not None and reason.startswith("llama.cpp skipped")
    assert 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install' in reason and "llama-cpp-python==0.3.36" in reason
    assert "10-25 minutes" in reason


def test_the_llama_cpp_module_imports_no_torch():
    """Its load time is measured in a fresh process: importing torch there would be charged to llama.cpp."""
    code = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='check'); "
            "print(sorted(m for m in ('torch', 'attnkit', 'llama_cpp') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, llamacpp.__file__], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_a_fresh_process_measurement_counts_from_the_given_start():
    started = time.time() - 5  # as if the process had started 5 s ago
    result = llamacpp.measure_process(lambda: bytearray(1 << 20), lambda buffer: bytes(buffer), started)
    assert result["load_s"] >= 5
    assert result["generate_peak_mib"] >= result["loaded_rss_mib"] > 0


def test_missing_transformers_is_skipped_with_a_row_before_anything_loads(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path):
    """It aborted the run while loading contenders; now a skipped row says how to install it or leave it out."""
    need("gguf")
    from attnkit.models import load_gguf

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # CI has no llama.cpp: a run without it asked for none
    loaded: list[str] = []
    path = tmp_path / "tiny.gguf"
    _tiny_smollm2(monkeypatch, path, lambda form, dtype: loaded.append(form) or load_gguf(path, weights=form))
    rows = run_generate_suite(GenerateSuite(forms=("float32",), lengths=(8,), batch=0, new_tokens=3, repeats=1,
                                            llamacpp=(), memory=False))
    assert [r["kind"] for r in rows][:3] == ["env", "skipped", "bound"]  # the skip said before the timed rows
    (skipped,) = [r for r in rows if r["kind"] == "skipped"]
    assert skipped["contender"] == "transformers-float32"
    assert "pip install 'attnkit[hf]'" in skipped["reason"] and "--no-transformers" in skipped["reason"]
    assert loaded == ["float32"] and rows[0]["transformers"] == "not installed"  # attnkit's contender alone ran
    assert [r["contender"] for r in rows if r["kind"] == "batch 1"] == ["attnkit-float32"]
    assert rows[0]["llama_cpp"] == "not run"


def test_the_report_records_the_threads_the_suite_ran_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """results.json's environment said the caller's thread count (restored after the suite), not --threads."""
    import json

    from attnkit.bench import command

    monkeypatch.setitem(command.ROW_SUITES, "generate", lambda options: [{"kind": "note", "text": "stub"}])
    monkeypatch.setitem(command.ROW_PLOTS, "generate", lambda rows, out: [])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # the caller's count
    command.run(Options(suite="generate", threads=1, out=str(tmp_path)), console=_quiet_console())
    assert json.loads((tmp_path / "results.json").read_text())["environment"]["threads"] == 1


def _quiet_console():  # type: ignore[no-untyped-def]
    import io

    from rich.console import Console

    return Console(file=io.StringIO())


@pytest.mark.slow
def test_tiny_run_end_to_end_with_llama_cpp_missing(monkeypatch: pytest.MonkeyPatch):
    """attnkit float32 only, 8-token prompt, 3 new tokens, one round: every kind of row, the skip, the targets."""
    need_smollm2()
    import attnkit.models

    model = smollm2()  # loaded once per session
    monkeypatch.setattr(attnkit.models, "load_smollm2", lambda **_: model)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    rows = run_generate_suite(GenerateSuite(forms=("float32",), lengths=(8,), batch=2, new_tokens=3, repeats=1,
                                            transformers=False, llamacpp=("off",), memory=False))
    kinds = [r["kind"] for r in rows]
    assert kinds[:3] == ["env", "skipped", "bound"] and kinds.count("target") == 8
    assert rows[1]["contender"] == "llama.cpp" and "CMAKE_ARGS" in rows[1]["reason"]
    (one,) = [r for r in rows if r["kind"] == "batch 1"]
    assert one["contender"] == "attnkit-float32" and one["context"] == 8 and one["decode_tokens_per_s"] > 0
    (batched,) = [r for r in rows if r["kind"] == "batched"]
    assert batched["batch"] == 2 and batched["prompt_len"] == 64 and batched["new_tokens_per_s"] > 0
    assert rows[0]["llama_cpp"] == "not installed" and rows[0]["threads"] == 2 and rows[0]["model"] == "smollm2"


def test_llama_cpp_is_fed_attnkits_token_ids():
    """Same file, same ids, greedy: llama.cpp's first new tokens are attnkit float32's (a BOS token added, or a
    token evaluated twice, would change them)."""
    need_smollm2()
    pytest.importorskip("llama_cpp")
    import torch

    from attnkit.models.loader import smollm2_path

    model = smollm2()
    ids = prompt_ids(model.tokenizer, 16, offset=3)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=4, stop_ids=[])[0, 16:].tolist()  # (1, 16 + 4)
    llm = llamacpp.LlamaCpp(smollm2_path(), threads=2, context=32, flash_attn=False)
    try:
        assert llm.generate(ids, 4) == expected
        too_long = re.escape("a prompt of 30 tokens + 4 new does not fit llama.cpp's context of 32")
        with pytest.raises(ValueError, match=too_long):
            llm.single(ids + ids[:-2], 4)
    finally:
        llm.close()


# Gemma 3: batch 1 at 16 and 2000 tokens, attnkit float32 and float16 beside transformers and llama.cpp
GEMMA_ROWS = [
    _b1("attnkit-float32", 16, 26.0), _b1("attnkit-float16", 16, 39.0), _b1("transformers-float32", 16, 20.0),
    _b1("llama.cpp", 16, 52.0),
    _b1("attnkit-float32", 2000, 18.0), _b1("attnkit-float16", 2000, 30.0), _b1("transformers-float32", 2000, 15.0),
]


def test_gemma3_target_is_attnkit_float32_over_transformers_float32_at_each_length():
    """1.3x at 16 tokens (met), 1.2x at 2000 (missed): a ratio against the wrong contender or form, or the wrong
    threshold, changes a value or a verdict; the accurate form's ratio and llama.cpp's come as notes."""
    found = gemma3_targets(GEMMA_ROWS, "float16", GEMMA3_LENGTHS)
    assert [t["target"] for t in found] == [
        f"gemma3 batch 1, {t}-token context: decode tokens/s, attnkit float32 / transformers float32"
        for t in (16, 2000)]
    assert [(t["goal"], t["measured"], t["met"]) for t in found] == [(">= 1.3x", 1.3, True),
                                                                     (">= 1.3x", 1.2, False)]
    assert found[0]["note"] == ("attnkit float16 (fastest accurate form) / transformers float32: 1.95x; "
                                "attnkit float32 / llama.cpp: 0.50x; attnkit float16 / llama.cpp: 0.75x")
    assert found[1]["note"] == "attnkit float16 (fastest accurate form) / transformers float32: 2.00x"


def test_gemma3_target_without_transformers_is_not_measured_and_float32_has_no_second_form():
    rows = [r for r in GEMMA_ROWS if r["contender"] != "transformers-float32"]
    found = gemma3_targets(rows, "float32", GEMMA3_LENGTHS)
    assert [(t["measured"], t["met"], t["verdict"]) for t in found] == [(None, None, "not measured in this run")] * 2
    assert found[0]["note"] == "attnkit float32 / llama.cpp: 0.50x" and found[1]["note"] == ""


def test_gemma3_options_default_to_batch_1_at_16_and_2000_with_float32_and_the_fastest_accurate_form():
    from attnkit.models.gemma3 import Gemma3Model
    from attnkit.modules.quantize import default_form

    suite = GenerateSuite.from_options(Options(suite="generate", model="gemma3"))
    assert suite.model == "gemma3" and suite.lengths == GEMMA3_LENGTHS == (16, 2000)
    assert suite.batch == 0 and suite.memory is False
    assert suite.forms == tuple(dict.fromkeys(("float32", default_form(Gemma3Model.accurate_forms))))
    assert suite.names(llamacpp_installed=True)[-3:] == ["transformers-float32", "llama.cpp", "llama.cpp-fa"]
    assert GenerateSuite.from_options(Options(suite="generate", model="gemma3", seq_lens=[16])).lengths == (16,)
    assert GenerateSuite.from_options(Options(suite="generate")).model == "smollm2"


def test_the_model_option_parses_and_offers_every_model():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--suite", "generate", "--model", "gemma3", "--lengths", "16"])
    assert Options.from_namespace(args).model == "gemma3"
    assert Options.from_namespace(parser.parse_args(["--suite", "generate"])).model == "smollm2"
    (action,) = [a for a in parser._actions if a.dest == "model"]
    assert list(action.choices or []) == list(MODELS)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "llama"])


@pytest.mark.parametrize(("options", "message"), [
    (Options(suite="generate", model="gemma3", batch=[1, 8]), "the gemma3 suite runs batch 1 only: batch must be 0"),
    (Options(suite="generate", model="phi"), "unknown --model 'phi'; choose from: smollm2, gemma3"),
])
def test_bad_model_options_are_refused_by_name(options: Options, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerateSuite.from_options(options)


def test_a_gemma3_suite_built_directly_is_refused_its_batched_case_and_memory():
    with pytest.raises(ValueError, match=re.escape("batch=8, memory=True")):
        GenerateSuite(model="gemma3")
    assert GenerateSuite.for_model("gemma3", forms=("float32",)).lengths == (16, 2000)


class _BosTokenizer:
    """Puts BOS (2) before every text, as Gemma's does."""

    add_bos, bos_id = True, 2

    def encode(self, text: str) -> list[int]:
        return [2, 10, 11, 12]


def test_prompt_ids_put_bos_once_first_for_a_tokenizer_that_adds_it():
    assert prompt_ids(_BosTokenizer(), 8) == [2, 10, 11, 12, 10, 11, 12, 10]
    assert prompt_ids(_BosTokenizer(), 5, offset=1) == [2, 11, 12, 10, 11]


def test_format_rows_shows_the_note_that_gemma3_runs_batch_1_only():
    rows = [{"kind": "note", "text": "Gemma 3 270M: batch 1 only"}, *gemma3_targets(GEMMA_ROWS, "float16")]
    lines = format_rows(rows).splitlines()
    assert lines[0] == "Gemma 3 270M: batch 1 only"
    assert lines[1].startswith("target gemma3 batch 1, 16-token context") and lines[1].count(": met") == 1


# On a GPU: attnkit's plain weights in --dtype beside transformers, no CPU measurements, every clock synchronised

def test_a_cuda_suite_names_its_contenders_by_dtype_and_leaves_out_what_the_cpu_measures():
    """--device cuda: the plain form only, named by its dtype (attnkit-float32 would claim float32 activations);
    llama.cpp and the load/memory processes dropped even when not asked to be."""
    suite = GenerateSuite.from_options(Options(suite="generate", device="cuda", dtype="bfloat16", batch=[1, 8],
                                               seq_lens=[16, 4000, 7900], new_tokens=64, repeats=3))
    assert (suite.device, suite.dtype, suite.forms) == ("cuda", "bfloat16", ("float32",))
    assert suite.lengths == (16, 4000, 7900) and suite.batch == 8 and suite.new_tokens == 64
    assert suite.llamacpp == () and suite.memory is False and not suite.on_cpu
    assert suite.names(llamacpp_installed=True) == ["attnkit-bfloat16", "transformers-bfloat16"]
    assert suite.attnkit_names() == {"attnkit-bfloat16": "float32"}
    compiled = GenerateSuite.from_options(Options(suite="generate", device="cuda:0", dtype="float16",
                                                  compiled=["float32"], no_transformers=True))
    assert compiled.attnkit_names() == {"attnkit-float16": "float32", "attnkit-float16-compiled": "float32"}


def test_cpu_names_are_unchanged_by_the_device_fields():
    """The CPU report and its targets read attnkit-<form> and transformers-float32."""
    suite = GenerateSuite(forms=("float32", "int4"), llamacpp=("off",), compiled=("int4",))
    assert suite.on_cpu and suite.attnkit_names() == {"attnkit-float32": "float32", "attnkit-int4": "int4",
                                                      "attnkit-int4-compiled": "int4"}
    assert suite.names(llamacpp_installed=True)[-2:] == ["transformers-float32", "llama.cpp"]


def test_a_cuda_suite_built_directly_is_refused_cpu_measurements_and_a_cpu_one_any_dtype_but_float32():
    with pytest.raises(ValueError, match=re.escape("llama.cpp and the load-time and memory processes are CPU "
                                                   "measurements: on device 'cuda' leave them out")):
        GenerateSuite(device="cuda", dtype="bfloat16", forms=("float32",))
    with pytest.raises(ValueError, match=re.escape("on the CPU the generate suite keeps float32 activations, got "
                                                   "dtype='bfloat16'")):
        GenerateSuite(forms=("float32",), dtype="bfloat16")
    suite = GenerateSuite.for_model("smollm2", device="cuda", dtype="bfloat16")  # the model's defaults, for CUDA
    assert (suite.forms, suite.llamacpp, suite.memory, suite.batch) == (("float32",), (), False, 8)
    assert GenerateSuite.for_model("gemma3", device="cuda", dtype="bfloat16").forms == ("float32",)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without a CUDA device")
def test_a_cuda_run_without_cuda_says_so_before_any_work(monkeypatch: pytest.MonkeyPatch):
    from attnkit.bench import generate

    def no_work(*_: object) -> NoReturn:
        raise AssertionError("the model file was read or loaded before the device was checked")

    monkeypatch.setitem(generate.MODELS, "smollm2", replace(MODELS["smollm2"], path=no_work, load=no_work))
    with pytest.raises(ValueError, match=re.escape("--device cuda: this torch") + ".*sees no CUDA device"):
        run_generate_suite(GenerateSuite.for_model("smollm2", device="cuda", dtype="bfloat16"))


class _Events:
    """A log of synchronisations and clock reads, for the generate module's clock and torch.cuda.synchronize."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from attnkit.bench import generate_contenders

        self.log: list[str] = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.log.append("sync"))
        monkeypatch.setattr(generate_contenders, "time",
                            SimpleNamespace(perf_counter=lambda: self.log.append("clock") or 0.0))
        # a (B, T) tensor on the CPU stands in for one on the GPU, which this machine may not have
        monkeypatch.setattr(generate_contenders, "token_ids",
                            lambda rows, device: torch.tensor([list(r) for r in rows]))

    def every_clock_follows_a_sync(self) -> bool:
        return all(i > 0 and self.log[i - 1] == "sync" for i, e in enumerate(self.log) if e == "clock")


def test_on_cuda_attnkit_reads_every_clock_after_a_synchronize(monkeypatch: pytest.MonkeyPatch):
    """Without it the clock would time the kernel launches, not the work: the first token would look instant."""
    import attnkit.models.generation as generation
    from attnkit.bench import generate_contenders as contenders

    events = _Events(monkeypatch)

    def steps(model: object, ids: torch.Tensor, **kw: object):
        for _ in range(3):
            events.log.append("token")
            yield ids[:, 0]

    monkeypatch.setattr(generation, "generate_steps", steps)
    contenders.Attnkit(model=None, device="cuda").single(list(range(4)), 3)
    assert events.log == ["sync", "clock", "token", "sync", "clock", "token", "token", "sync", "clock"]
    model = SimpleNamespace(generate=lambda *a, **kw: events.log.append("generate"))
    events.log.clear()
    contenders.Attnkit(model=model, device="cuda").batch([[1, 2], [3, 4]], 2)
    assert events.log == ["sync", "clock", "generate", "sync", "clock"]


def test_on_cuda_transformers_reads_every_clock_after_a_synchronize(monkeypatch: pytest.MonkeyPatch):
    from attnkit.bench import generate_contenders as contenders

    events = _Events(monkeypatch)

    def hf_generate(ids: torch.Tensor, streamer: object = None, max_new_tokens: int = 0, **kw: object) -> None:
        events.log.append("generate")
        for _ in range(max_new_tokens + 1 if streamer is not None else 0):  # the prompt, then each new token
            streamer.put(ids)  # type: ignore[attr-defined]

    contender = contenders.Transformers(SimpleNamespace(generate=hf_generate), device="cuda")
    contender.single([1, 2, 3], 2)
    assert events.log.count("clock") == 4 and events.every_clock_follows_a_sync()  # the start and 3 puts
    events.log.clear()
    contender.batch([[1, 2], [3, 4]], 2)
    assert events.log == ["sync", "clock", "generate", "sync", "clock"]


def test_on_the_cpu_nothing_synchronises(monkeypatch: pytest.MonkeyPatch):
    """CPU runs keep working on a PyTorch built without CUDA (where synchronize would raise)."""
    from attnkit.bench import generate_contenders as contenders

    events = _Events(monkeypatch)
    model = SimpleNamespace(generate=lambda *a, **kw: None)
    contenders.Attnkit(model=model).batch([[1, 2]], 2)
    contenders.Transformers(model).batch([[1, 2]], 2)
    assert "sync" not in events.log and events.log.count("clock") == 4


def test_the_cuda_path_end_to_end_on_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Everything --device cuda does but the device itself, on a tiny Llama file: loaded in bfloat16 as its plain
    form, timed with synchronisations, llama.cpp and the load/memory processes skipped with a row each, no
    targets but a note saying why, the GPU's name and the dtype in the env row."""
    need("gguf")
    from attnkit.bench import generate, generate_contenders
    from attnkit.models import load_gguf
    from tests.models._decoder import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, context=128)
    loads: list[tuple[str, torch.dtype]] = []

    def load(weights: str, dtype: torch.dtype) -> object:
        loads.append((weights, dtype))
        return load_gguf(path, dtype=dtype, weights=weights)

    monkeypatch.setitem(generate.MODELS, "smollm2", replace(MODELS["smollm2"], path=lambda: path, load=load))
    real = generate.device_type
    for module in (generate, generate_contenders):  # the suite's checks and the contenders' clocks
        monkeypatch.setattr(module, "device_type", lambda device: "cuda" if device == "cpu" else real(device))
    syncs: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", syncs.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(generate, "check_device", lambda device: None)
    suite = GenerateSuite.for_model("smollm2", device="cpu", dtype="bfloat16", lengths=(8,), batch=2, new_tokens=3,
                                    repeats=1, transformers=False)
    rows = run_generate_suite(suite)
    assert loads == [("float32", torch.bfloat16)] and len(syncs) >= 10
    assert [r["kind"] for r in rows] == ["env", "skipped", "note", "bound", "batch 1", "batched", "note"]
    env, skipped, memory, bound, one, batched, targets = rows
    assert (env["device"], env["dtype"], env["gpu"]) == ("cpu", "bfloat16", "Fake GPU") and "default_form" not in env
    assert skipped["contender"] == "llama.cpp" and "runs on the CPU" in skipped["reason"]
    assert "load time and memory" in memory["text"] and bound["weights"] == "bfloat16"
    assert one["contender"] == batched["contender"] == "attnkit-bfloat16" and one["decode_tokens_per_s"] > 0
    assert "targets: not judged on cpu" in targets["text"]
