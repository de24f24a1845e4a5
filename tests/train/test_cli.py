"""`attnkit train induction` from the command line: the files it writes and its errors."""

from __future__ import annotations

import json
import time

import pytest
import torch

from attnkit import cli
from tests._util import need


def test_a_short_run_writes_metrics_curves_heatmap_and_page(tmp_path, capsys):
    need("rich")
    need("matplotlib")
    code = cli.main(["train", "induction", "--steps", "4", "--seed", "2", "--vocab-size", "7", "--seq-len", "10",
                     "--out", str(tmp_path)])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "induction head L" in out and "previous-token head L" in out and "every induction head" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["steps"] == 4 and metrics["config"]["seed"] == 2 and metrics["config"]["vocab_size"] == 7
    assert [h["step"] for h in metrics["history"]] == [1, 4]
    assert len(metrics["final"]["induction"]) == 2 and len(metrics["final"]["induction"][0]) == 4
    assert set(metrics["ablation"]) == {"none", "induction_head", "previous_token_head", "induction_heads",
                                        "previous_token_heads"}
    for name in ("training.png", "induction_head.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "attention.html").read_text()
    assert '"name":"layer 0"' in page and '"name":"layer 1"' in page


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "steps=0"),
    (["--seq-len", "3"], "seq_len=3 is too short to repeat"),
    (["--vocab-size", "1"], "vocab_size=1"),
    (["--device", "tpu9"], "device='tpu9'"),
    (["--device", "meta"], "takes 'cpu' or 'cuda', got a meta device"),
])
def test_bad_input_is_one_line_naming_the_value(tmp_path, capsys, args, message):
    code = cli.main(["train", "induction", *args, "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "metrics.json").exists()


def test_cuda_without_a_gpu_is_an_error_naming_it(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["train", "induction", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "device='cuda'" in capsys.readouterr().err


def test_a_missing_matplotlib_hint_keeps_its_brackets(monkeypatch, tmp_path, capsys):
    """rich read "[viz]" in the hint as markup and printed pip install 'attnkit'."""
    import sys

    from attnkit import cli

    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    assert cli.main(["train", "induction", "--steps", "2", "--out", str(tmp_path)]) == 0
    assert "pip install -c constraints.txt 'attnkit[viz]'" in " ".join(capsys.readouterr().out.split())


# A huge size, an --out that is a file and Ctrl-C are one line (Ctrl-C: exit 130, files saved).

@pytest.mark.parametrize(("args", "message"), [
    (["--vocab-size", "100000000"], "--vocab-size 100000000 with --seq-len 32 needs about 4577.6 GiB"),
    (["--seq-len", "100000"], "--vocab-size 32 with --seq-len 100000 needs about"),
])
def test_a_size_that_cannot_fit_in_memory_is_refused_up_front(tmp_path, capsys, args, message):
    """`--vocab-size 100000000` ended in an allocator traceback."""
    code = cli.main(["train", "induction", *args, "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert message in err and "more than the 8 GiB this command allows: lower --vocab-size or --seq-len" in err


def test_running_out_of_memory_anyway_is_one_line(tmp_path, capsys, monkeypatch):
    from attnkit.train import induction

    def allocator(*args, **kw):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes.\nError code 12")

    monkeypatch.setattr(induction, "train_induction", allocator)
    code = cli.main(["train", "induction", "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert "out of memory with --vocab-size 32 and --seq-len 32 ([enforce fail" in err


def test_an_out_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    """`--out results` where results is a file trained for minutes, then failed with "[Errno 17] File exists"."""
    (tmp_path / "results").write_text("")
    code = cli.main(["train", "induction", "--out", str(tmp_path / "results")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == (f"attnkit train: error: --out {tmp_path / 'results'} is a file: give a folder "
                   "(it holds several files)\n")


def test_ctrl_c_stops_after_the_step_and_saves_what_was_done(tmp_path, capsys, monkeypatch, request):
    """Ctrl-C during `attnkit train` was a traceback and lost every step done."""
    import signal

    # Python's own handler, as in a terminal (a job started in the background by a shell inherits SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, inherited))
    need("rich")
    need("matplotlib")
    from attnkit.train import induction

    make_batch, batches = induction.make_batch, []

    def ctrl_c_during_the_third_step(*args, **kw):
        batches.append(1)
        if len(batches) == 4:  # the evaluation batch, then steps 1, 2 and 3
            signal.raise_signal(signal.SIGINT)
        return make_batch(*args, **kw)

    monkeypatch.setattr(induction, "make_batch", ctrl_c_during_the_third_step)
    code = cli.main(["train", "induction", "--steps", "50", "--out", str(tmp_path)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 130
    assert "stopped by Ctrl-C after step 3 of 50: saving what was done" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["stopped_at"] == 3 and [h["step"] for h in metrics["history"]] == [1, 3]
    for name in ("training.png", "induction_head.png", "attention.html"):
        assert (tmp_path / name).stat().st_size > 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler before it is back


def test_sigint_to_a_real_training_process(tmp_path):
    """The same, with a real SIGINT to `python -m attnkit train induction`: exit 130, files written."""
    import signal
    import subprocess
    import sys

    need("rich")
    need("matplotlib")
    train = subprocess.Popen([sys.executable, "-m", "attnkit", "train", "induction", "--steps", "1000000",
                              "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert train.stdout is not None
    assert train.stdout.readline().startswith(b"attnkit train induction:")  # about to train
    time.sleep(1.0)
    train.send_signal(signal.SIGINT)
    out, err = train.communicate(timeout=300)
    assert train.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"stopped by Ctrl-C after step" in b" ".join(out.split())
    assert json.loads((tmp_path / "metrics.json").read_text())["stopped_at"] >= 1
    assert (tmp_path / "training.png").exists()
