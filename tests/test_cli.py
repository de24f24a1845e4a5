"""`attnkit explain` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnkit import cli
from attnkit.inspect.walkthrough import STEPS
from tests._util import need


@pytest.fixture(autouse=True)
def _eighty_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("FORCE_COLOR", raising=False)


def run(capsys, *args):
    code = cli.main(["explain", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_walkthrough_shows_every_step_in_80_columns(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    for number, title in enumerate(STEPS.values(), start=1):
        assert f"{number}. {title}" in out
    assert "Your journey starts with one step" in out
    assert "0.4300  0.1500  0.8900" in out  # the book's embedding of "Your"
    assert max(len(line) for line in out.splitlines()) <= 80


def test_steps_option_and_numbers_follow_the_seed(capsys):
    _, out1, _ = run(capsys, "--steps", "output", "--seed", "1")
    _, out2, _ = run(capsys, "--steps", "output", "--seed", "2")
    assert "12. Output" in out1 and "1. Input" not in out1
    assert out1 != out2


def test_own_text_says_embeddings_are_random(capsys):
    code, out, _ = run(capsys, "cats", "chase", "mice", "--steps", "inputs")
    assert code == 0
    assert "cats chase mice  (3 tokens)" in out
    assert "random 3-d embeddings from torch.randn with seed 123" in out


def test_long_text_is_cut_to_fit_and_says_so(capsys):
    words = [f"w{i}" for i in range(20)]
    _, out, _ = run(capsys, *words, "--steps", "softmax")
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "of 20 columns" in out and "--json has every number" in out


def test_no_causal_and_dropout_options(capsys):
    _, out, _ = run(capsys, "--no-causal", "--steps", "mask")
    assert "No mask (--no-causal)" in out
    _, out, _ = run(capsys, "--dropout", "0.5", "--steps", "dropout")
    assert "Training mode: each weight is zeroed with p=0.5" in out


def test_json_has_every_step_and_every_number(capsys, tmp_path):
    path = tmp_path / "steps.json"
    code, out, _ = run(capsys, "--heads", "2", "--d-out", "6", "--json", str(path))
    assert code == 0 and str(path) in out.replace("\n", "")  # the console wraps a long path at its width
    doc = json.loads(path.read_text())
    assert doc["tokens"] == "Your journey starts with one step".split()
    assert [s["key"] for s in doc["steps"]] == list(STEPS)
    scaled = next(s for s in doc["steps"] if s["key"] == "scaled")["tensors"]["scaled"]
    assert scaled["shape"] == [2, 6, 6] and scaled["axes"] == ["head", "query", "key"]
    assert scaled["data"][0][0][1] is None  # -inf written as null
    assert doc["head_dim"] == 3 and doc["causal"] is True


@pytest.mark.parametrize(("args", "message"), [
    (["--heads", "3"], "d_out=4 is not divisible by num_heads=3"),
    (["--dropout", "1.0"], "dropout=1.0 is outside [0, 1)"),
    (["--steps", "scores,nope"], "unknown step(s) nope"),
    (["   "], "is empty: give at least one word"),
    (["--d-out", "0"], "d_out must be positive"),
])
def test_bad_input_is_a_clear_error(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("attnkit explain: error: ") and message in err


def test_python_dash_m_runs_the_same_command():
    result = subprocess.run([sys.executable, "-m", "attnkit", "explain", "--steps", "output"],
                            capture_output=True, text=True, check=True)
    assert "12. Output" in result.stdout


def test_png_and_html_for_the_toy_layer(capsys, tmp_path):
    code, _, _ = run(capsys, "--steps", "output", "--png", str(tmp_path / "h.png"),
                     "--html", str(tmp_path / "p.html"))
    assert code == 0
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    page = (tmp_path / "p.html").read_text()
    assert "textbook MultiHeadAttention" in page and '"tokens":["Your","journey"' in page
    assert '"open":{"layer":0,"head":null}' in page  # the toy layer's every head


def test_minilm_walkthrough_png_html_json(capsys, tmp_path):
    code, out, _ = run(capsys, "--model", "minilm", "The cat sat on the mat.", "--layer", "2", "--head", "8",
                       "--png", str(tmp_path / "h.png"), "--html", str(tmp_path / "p.html"),
                       "--json", str(tmp_path / "s.json"))
    assert code == 0, out
    assert "layer 2 (layers.2.attention), head 8" in out and "[CLS]" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    doc = json.loads((tmp_path / "s.json").read_text())
    weights = next(s for s in doc["steps"] if s["key"] == "softmax")["tensors"]["weights"]
    assert weights["shape"] == [9, 9] and doc["tokens"][:3] == ["[CLS]", "the", "cat"]
    assert abs(sum(weights["data"][1]) - 1) < 1e-4
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    page = (tmp_path / "p.html").read_text()
    assert page.count('"name":"layers.') == 6
    assert '"open":{"layer":2,"head":8}' in page  # it opened on layer 0 with every head chosen


def test_smollm2_walkthrough_shows_a_decoder_head_and_rejects_a_missing_layer(capsys, tmp_path):
    need("gguf")
    code, out, _ = run(capsys, "--model", "smollm2", "The cat sat on the mat.", "--layer", "20", "--head", "3",
                       "--steps", "softmax", "--json", str(tmp_path / "s.json"))
    assert code == 0, out
    assert "layer 20 (layers.20.attention), head 3" in out and "SmolLM2-135M-Instruct" in out
    doc = json.loads((tmp_path / "s.json").read_text())
    weights = next(s for s in doc["steps"] if s["key"] == "softmax")["tensors"]["weights"]
    t = len(doc["tokens"])
    assert weights["shape"] == [t, t] and doc["tokens"][:2] == ["The", " cat"]
    rows = [weights["data"][i * t:(i + 1) * t] if isinstance(weights["data"][0], float) else weights["data"][i]
            for i in range(t)]
    assert all(abs(sum(r) - 1) < 1e-4 for r in rows)
    assert all(r[j] == 0 for i, r in enumerate(rows) for j in range(i + 1, t))  # causal: no later token
    code, _, err = run(capsys, "--model", "smollm2", "hi", "--layer", "30")
    assert code == 2 and "layer 30 is out of range: SmolLM2 has layers 0 to 29" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "minilm", "--layer", "6"], "layer 6 is out of range: MiniLM has layers 0 to 5"),
    (["--model", "minilm", "--head", "-1"], "head -1 is out of range: layers.0.attention has heads 0 to 11"),
    (["--model", "minilm", "   "], "tokenizes to nothing"),
    (["--model", "minilm", "--heads", "3"], "--heads sets up the toy layer; it does not apply to --model minilm"),
    (["--layer", "1"], "--layer applies to a real model: add --model minilm"),
    (["--model", "minilm", *(["word"] * 600)], "602 tokens but MiniLM takes at most 512 positions"),
])
def test_model_bad_input(capsys, args, message):
    code, _, err = run(capsys, *args)
    assert code == 2 and message in err


def test_truncate_cuts_long_text_with_a_warning(capsys):
    with pytest.warns(UserWarning, match="truncated to MiniLM's 512 positions"):
        code, out, _ = run(capsys, "--model", "minilm", "--truncate", "--steps", "context", *(["word"] * 600))
    assert code == 0 and "512 word pieces" in out


def test_missing_optional_dependency_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)
    code, _, err = run(capsys)
    assert code == 2 and "pip install -c constraints.txt 'attnkit[cli]'" in err


# The user's text is data, every error is one line and exit code 2.

@pytest.mark.parametrize("words", [["[/red]", "hi"], ["[red]", "cat"], ["\\", "[/]", "[bold"]])
def test_user_text_is_not_read_as_rich_markup(capsys, words):
    """`attnkit explain "[/red]" hi` ended in a MarkupError; `[red]` vanished from every table."""
    code, out, err = run(capsys, *words, "--steps", "inputs,softmax")
    assert code == 0, err
    assert f"text:  {' '.join(words)}  ({len(words)} tokens)" in out
    rows = [line.split()[0] for line in out.splitlines() if line[:1].strip() and line.split()[0] in words]
    assert rows == words * 3  # each token labels its row: in the inputs table, then in each head's weights
    headers = [line.split() for line in out.splitlines() if line[:1] == " " and line.split()[:1] == words[:1]]
    assert headers == [words, words]  # and its column, in each head's weights


def test_model_text_keeps_its_brackets(capsys):
    """`--model minilm "[MASK] sat on [red] mat"` swallowed `[red]`."""
    code, out, _ = run(capsys, "--model", "minilm", "[MASK] sat on [red] mat", "--steps", "softmax")
    assert code == 0
    assert "text:  [MASK] sat on [red] mat  (" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--layer", "0"], "--layer applies to a real model"),
    (["--head", "0"], "--head applies to a real model"),
    (["--model", "minilm", "--seed", "0"], "--seed sets up the toy layer"),
    (["--model", "minilm", "--dropout", "0"], "--dropout sets up the toy layer"),
    (["--model", "minilm", "--heads", "0"], "--heads sets up the toy layer"),
])
def test_zero_counts_as_given_like_one(capsys, args, message):
    """`--layer 0` without --model was accepted where `--layer 1` was refused: 0 was read as "not given"."""
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and message in err


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", ",,"], "--steps ',,' names no step; choose from: inputs, weights"),
    (["--model", "minilm", "--steps", "scores,softmax,mask"],
     "--steps scores,mask: --model minilm shows a traced layer's steps qkv, scaled, softmax, context, output"),
    (["--seed", "99999999999999999999"], "seed=99999999999999999999 is out of range"),
    (["--d-out", "1000000", "--heads", "1"], "d_out=1000000 is too large for the toy walkthrough"),
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--model", "gpt5"], "argument --model: invalid choice: 'gpt5'"),
])
def test_errors_are_one_line_and_exit_code_2(capsys, args, message):
    """`--steps ,,` printed nothing at all; a huge seed or width ended in a traceback; usage errors took lines."""
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("attnkit explain: error: ") and message in err
    assert err.count("\n") == 1


def test_bench_device_without_cuda_is_one_line(capsys, monkeypatch, tmp_path):
    """`attnkit bench --device cuda` on a CPU-only torch ended in a raw traceback."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = cli.main(["bench", "--device", "cuda", "--no-memory", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--device cuda: this torch" in err and "use --device cpu" in err
    assert cli.main(["bench", "--device", "nowhere", "--out", str(tmp_path)]) == 2
    assert "--device 'nowhere' is not a device torch knows" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_bench_plot_hint_names_the_viz_extra(capsys, monkeypatch, tmp_path):
    """Without matplotlib the hint printed `pip install 'attnkit'`: rich took `[viz]` for markup."""
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code = cli.main(["bench", "--suite", "custom", "--contenders", "attnkit", "--seq-lens", "16",
                     "--repeats", "1", "--no-memory", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "no plots:" in out and "pip install -c constraints.txt 'attnkit[viz]'" in " ".join(out.split())


# Every error is one line and exit code 2, output paths are checked before the work.

@pytest.mark.parametrize("command", [["explain"], ["train", "induction"], ["chat"], ["generate", "hi"],
                                     ["bench"], ["serve"]])
def test_a_mistyped_flag_points_to_the_subcommands_help(capsys, command):
    """`attnkit train induction --stpes` said "see attnkit --help", whose page does not list --steps."""
    assert cli.main([*command, "--stpes"]) == 2
    out, err = capsys.readouterr()
    prog = "attnkit " + " ".join(c for c in command if c != "hi")
    assert out == "" and err.count("\n") == 1
    assert err == f"{prog}: error: unrecognized arguments: --stpes (see {prog} --help)\n"


@pytest.mark.parametrize(("option", "where", "message"), [
    ("--png", "missing/h.png", "the folder {tmp}/missing does not exist"),
    ("--html", ".", "{tmp} is a folder: give a file name"),
    ("--json", "afile/s.json", "{tmp}/afile is a file, not a folder"),
])
def test_explain_output_paths_are_checked_before_the_work(capsys, tmp_path, option, where, message):
    """A --png in a missing folder failed with "[Errno 2]" after the whole walkthrough was printed."""
    (tmp_path / "afile").write_text("")
    path = tmp_path / where if where != "." else tmp_path
    code, out, err = run(capsys, option, str(path))
    assert code == 2 and out == ""  # nothing was computed or printed first
    assert err == f"attnkit explain: error: {option} {path}: {message.format(tmp=tmp_path)}\n" or (
        err.startswith(f"attnkit explain: error: {option} {path}") and message.format(tmp=tmp_path) in err)
    assert err.count("\n") == 1


def test_an_output_file_that_may_not_be_written_is_refused_first(capsys, tmp_path, monkeypatch):
    """(root may write anywhere, so the permission is denied by patching os.access.)"""
    import os

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    code, out, err = run(capsys, "--png", str(tmp_path / "h.png"))
    assert code == 2 and out == ""
    assert f"--png {tmp_path / 'h.png'}: no permission to write in the folder {tmp_path}" in err


def test_bench_out_that_is_a_file_is_refused_before_benchmarking(capsys, tmp_path):
    """An --out that exists as a file ended in "[Errno 17] File exists" after the whole benchmark ran."""
    (tmp_path / "taken").write_text("")
    code = cli.main(["bench", "--suite", "custom", "--contenders", "core-chunked", "--seq-lens", "16",
                     "--repeats", "1", "--no-memory", "--out", str(tmp_path / "taken")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == (f"attnkit bench: error: --out {tmp_path / 'taken'} is a file: give a folder "
                   "(it holds several files)\n")


def test_an_os_error_reads_path_colon_reason(capsys, tmp_path, monkeypatch):
    """OSErrors printed as "[Errno 17] File exists: 'x'"."""
    from attnkit.inspect import html

    def taken(*args, **kw):
        raise FileExistsError(17, "File exists", "p.html")

    monkeypatch.setattr(html, "write_html", taken)
    code, _, err = run(capsys, "--steps", "output", "--html", str(tmp_path / "p.html"))
    assert code == 2 and err == "attnkit explain: error: p.html: File exists\n"


def test_ctrl_c_is_exit_130_in_one_line_without_traceback(capsys, monkeypatch):
    from attnkit.inspect import explain

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(explain, "explain_toy", interrupted)
    code, out, err = run(capsys)
    assert code == 130 and out == ""
    assert err.strip() == "attnkit explain: interrupted"


# `explain --model smollm2 --truncate` truncates, to a length whose records fit in memory.

def test_the_decoder_cap_of_help_is_the_librarys():
    from attnkit.inspect import explain

    assert cli.SMOLLM2_MAX_TOKENS == explain.SMOLLM2_MAX_TOKENS == 512
    # 30 layers x 9 heads, scores and weights in float32: 2160 bytes x T^2, about 0.6 GB at the cap
    gigabytes = 2 * 30 * 9 * 4 * explain.SMOLLM2_MAX_TOKENS**2 / 1e9
    assert 0.56 < gigabytes < 0.58


def test_explain_help_states_the_decoder_cap(capsys):
    assert cli.main(["explain", "--help"]) == 0
    assert "to SmolLM2's first 512 tokens" in " ".join(capsys.readouterr().out.split())


def test_smollm2_truncate_cuts_a_text_longer_than_the_context(capsys, monkeypatch):
    """--truncate did nothing for SmolLM2: its tokenizer refused a text over 8192 tokens before the cut."""
    need("gguf")
    from attnkit.inspect import explain

    monkeypatch.setattr(explain, "SMOLLM2_MAX_TOKENS", 12)  # the same path as 512, in a fraction of the time
    words = ["word"] * 9000  # 9000 tokens: more than SmolLM2's 8192-token context
    with pytest.warns(UserWarning, match="text of 9000 tokens truncated to SmolLM2's first 12"):
        code, out, err = run(capsys, "--model", "smollm2", "--truncate", "--steps", "softmax", *words)
    assert code == 0, err
    text = " ".join(out.split())
    assert "word word ... (12 byte-level BPE tokens)" in text
    assert out.count("word") < 100  # the header shows the text that was kept, not 9000 words


def test_smollm2_text_over_the_cap_names_truncate_and_the_cap(capsys):
    need("gguf")
    code, out, err = run(capsys, "--model", "smollm2", *(["word"] * 600))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "the text is 600 tokens; attnkit explain shows SmolLM2 on at most 512" in err
    assert "pass --truncate to cut it to its first 512 tokens" in err


# `explain --gguf FILE`: any registered architecture's file, as `generate --gguf` takes it.


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    need("gguf")
    need("tokenizers")
    from tests.models.test_qwen import write_tiny_qwen

    path = tmp_path_factory.mktemp("explain") / "tiny-qwen2.gguf"
    write_tiny_qwen(path, "qwen2")
    return path


def test_gguf_walkthrough_shows_the_files_own_layer_and_head(capsys, tmp_path, tiny_qwen2):
    """The weights shown are the file's model's, at the layer and head asked for: a walkthrough of the packaged
    SmolLM2, of another layer or head, or of other tokens would differ."""
    import torch

    from attnkit import trace
    from attnkit.models import load_gguf

    code, out, err = run(capsys, "--gguf", str(tiny_qwen2), "the cat sat", "--layer", "1", "--head", "2",
                         "--steps", "softmax", "--json", str(tmp_path / "s.json"))
    assert code == 0, err
    text = " ".join(out.split())
    assert "tiny qwen2 (qwen2: 2 layers x 4 heads of 16 over 2 key/value heads, hidden 64)" in text
    assert "layer 1 (layers.1.attention), head 2" in text and "byte-level BPE tokens" in text
    doc = json.loads((tmp_path / "s.json").read_text())
    shown = torch.tensor(next(s for s in doc["steps"] if s["key"] == "softmax")["tensors"]["weights"]["data"])
    model = load_gguf(tiny_qwen2)
    ids = torch.tensor([model.tokenizer.encode("the cat sat")])
    with trace(model) as recorded, torch.inference_mode():
        model(ids)
    expected = recorded.records[1].weights[0, 2]  # (T, T)
    assert doc["tokens"] == [model.decode([i], skip_special_tokens=False) for i in ids[0].tolist()]
    torch.testing.assert_close(shown.reshape(expected.shape), expected, rtol=0, atol=1e-4)  # printed to 4 places
    assert not torch.allclose(expected, recorded.records[1].weights[0, 1], atol=1e-3)  # the head matters


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "smollm2"], "--model smollm2 and --gguf"),
    (["--heads", "3"], "--heads sets up the toy layer; it does not apply to --gguf"),
    (["--steps", "scores"], "--steps scores: --gguf"),
    (["--layer", "2"], "layer 2 is out of range: tiny qwen2 has layers 0 to 1"),
])
def test_gguf_bad_input_is_one_line(capsys, tiny_qwen2, args, message):
    code, out, err = run(capsys, "--gguf", str(tiny_qwen2), *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert message in err


def test_gguf_of_an_unregistered_architecture_names_the_registered_ones(capsys, tmp_path):
    gguf = need("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = run(capsys, "--gguf", str(tmp_path / "mamba.gguf"))
    assert code == 2 and "architecture 'mamba' is not supported" in err and "qwen2" in err


def test_the_gguf_cap_is_the_budget_of_the_packaged_caps():
    """One rule for any file: 0.6 GB of records, which is where SmolLM2's (512) and Gemma 3's (1024) caps sit."""
    from attnkit.inspect import explain

    assert explain.gguf_max_tokens(30, 9) == 527 and explain.gguf_max_tokens(18, 4) == 1020
    assert 2 * 30 * 9 * 4 * 527**2 <= explain.RECORDS_BUDGET_BYTES < 2 * 30 * 9 * 4 * 528**2


def test_gguf_text_over_the_cap_names_truncate(capsys, monkeypatch, tiny_qwen2):
    from attnkit.inspect import explain

    monkeypatch.setattr(explain, "RECORDS_BUDGET_BYTES", 2 * 2 * 4 * 4 * 5**2)  # 5 tokens for 2 layers x 4 heads
    code, _, err = run(capsys, "--gguf", str(tiny_qwen2), "the cat sat on a mat")
    assert code == 2 and "attnkit explain shows tiny qwen2 on at most 5" in err and "--truncate" in err
    with pytest.warns(UserWarning, match="truncated to tiny qwen2's first 5"):
        code, out, _ = run(capsys, "--gguf", str(tiny_qwen2), "--truncate", "--steps", "softmax",
                           "the cat sat on a mat")
    assert code == 0 and "(5 byte-level BPE tokens)" in " ".join(out.split())
