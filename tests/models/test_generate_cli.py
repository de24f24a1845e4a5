"""``attnkit generate`` and ``attnkit chat`` on a tiny GGUF file (--gguf), so they run in a second."""

from __future__ import annotations

import builtins
import getpass
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnkit.cli import main
from tests._util import need
from tests.models._decoder import write_tiny_llama

need("gguf")
need("tokenizers")
need("rich")


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_tiny_llama(path, context=64)
    return str(path)


def _expected(path: str, prompt: str, n: int) -> str:
    from attnkit.models import load_gguf

    model = load_gguf(path, weights="auto")  # the form the command loads by default
    ids = model.tokenize(prompt)["input_ids"]
    return model.decode(model.generate(ids, max_new_tokens=n)[0, ids.shape[1] :])


def test_generate_streams_the_greedy_continuation_and_reports_speed(tiny: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--gguf", tiny, "--max-new-tokens", "6", "the", "sin"]) == 0
    out, err = capsys.readouterr()
    assert out == _expected(tiny, "the sin", 6) + "\n"
    assert "tokens/s" in err and "prompt:" in err
    (speed,) = [line for line in err.splitlines() if line.startswith("prompt:")]
    assert speed.rstrip().endswith("tokens/s") and "generation:" in speed  # one line, not wrapped at 80 columns


def test_generate_with_a_bfloat16_cache_says_so_and_decodes_over_it(tiny: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.models import load_gguf

    assert main(["generate", "--gguf", tiny, "--max-new-tokens", "6", "--kv-dtype", "bfloat16", "the"]) == 0
    out, err = capsys.readouterr()
    assert "bfloat16 KV cache" in err
    model = load_gguf(tiny, weights="auto")
    ids = model.tokenize("the")["input_ids"]
    new = model.generate(ids, max_new_tokens=6, kv_dtype="bfloat16")[0, ids.shape[1] :]
    assert out == model.decode(new) + "\n"


def test_generate_compiled_gives_the_eager_text(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--gguf", tiny, "--max-new-tokens", "5", "--compile", "the", "sin"]) == 0
    assert capsys.readouterr().out == _expected(tiny, "the sin", 5) + "\n"


def test_generate_chat_wraps_the_prompt_in_the_template(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--gguf", tiny, "--chat", "--max-new-tokens", "5", "hi"]) == 0
    out, _ = capsys.readouterr()
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out == _expected(tiny, chat, 5) + "\n"


def test_generate_repetition_penalty_is_the_library_s(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: the command took --repetition-penalty and dropped it."""
    import torch

    from attnkit.models import load_gguf

    assert main(["generate", "--gguf", tiny, "--max-new-tokens", "8", "--repetition-penalty", "2", "the"]) == 0
    model = load_gguf(tiny, weights="auto")
    ids = model.tokenize("the")["input_ids"]
    new = model.generate(ids, max_new_tokens=8, repetition_penalty=2.0)[0, ids.shape[1] :]
    plain = model.generate(ids, max_new_tokens=8)[0, ids.shape[1] :]
    assert capsys.readouterr().out == model.decode(new) + "\n" and not torch.equal(new, plain)


def test_generate_sampling_with_a_seed_repeats(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--gguf", tiny, "--max-new-tokens", "8", "--temperature", "50", "--top-p", "0.9",
            "--seed", "3", "the"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(("args", "message"), [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--temperature", "-1"], "temperature=-1.0"),
    (["--top-p", "1.5"], "top_p=1.5"),
    (["--repetition-penalty", "0"], "repetition_penalty=0.0"),
    (["--frequency-penalty", "3"], "frequency_penalty=3.0"),
    (["--seed", "3", "--top-k", "5"], "--top-k 5, --seed 3 shape sampling, and --temperature 0 (the default)"),
    ([" "], "the prompt is empty"),
    (["--kv-dtype", "bfloat16", "--dtype", "bfloat16"], "--dtype bfloat16 computes in the model's dtype"),
    (["--kv-dtype", "float16", "--cache", "sink:4,20"], "--cache sink:4,20 re-rotates the keys it keeps at each "
                                                         "eviction, which would round them again every time"),
    (["--compile", "--cache", "sink:4,20"], "--compile runs over static caches and --cache sink:4,20 evicts"),
])
def test_generate_bad_options_exit_2_with_one_line(tiny: str, capsys: pytest.CaptureFixture[str],
                                                   args: list[str], message: str) -> None:
    prompt = [] if args == [" "] else ["hi"]
    assert main(["generate", "--gguf", tiny, *args, *prompt]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_generate_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--gguf", str(tmp_path / "none.gguf"), "hi"]) == 2
    assert "none.gguf" in capsys.readouterr().err


def _typing(lines: list[str]) -> Iterator[str]:
    yield from lines
    raise EOFError  # Ctrl-D


def test_chat_keeps_the_conversation_and_resets(tiny: str, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.models import load_gguf

    lines = _typing(["hi", "the", "/reset", "the"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "--gguf", tiny, "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out.split("\n")
    model = load_gguf(tiny, weights="auto")

    def answer(messages: list[dict[str, str]]) -> str:
        ids = model.tokenize(model.chat_prompt(messages))["input_ids"]
        return model.decode(model.generate(ids, max_new_tokens=4)[0, ids.shape[1] :])

    first = answer([{"role": "user", "content": "hi"}])
    second = answer([{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "the"}])
    after_reset = answer([{"role": "user", "content": "the"}])
    assert out[:3] == [first, second, after_reset]


@pytest.mark.usefixtures("uncached_compile")
def test_chat_compiled_answers_as_eager_and_compiles_once(tiny: str, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """chat --compile compiles the serving engine's decoding step before the first answer: one graph for every
    turn, every decoding step through it, its answers the eager ones, and the conversation still found in the
    prefix cache (the static caches of generate's compiled step recomputed every turn)."""
    from torch._dynamo.utils import counters

    from attnkit.serve.graph import CompiledDecode

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))  # the compiled step is kept on disk there
    default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"  # Inductor's kernels kept warm
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(default))
    call, ran = CompiledDecode.__call__, []

    def counted(self: CompiledDecode, *args: Any) -> Any:
        logits = call(self, *args)
        ran.append(logits is not None)
        return logits

    monkeypatch.setattr(CompiledDecode, "__call__", counted)
    answers = []
    for extra in ([], ["--compile"]):
        lines = _typing(["hi", "the", "the sin"])
        monkeypatch.setattr(builtins, "input", lambda prompt="", lines=lines: next(lines))
        before = counters["stats"]["unique_graphs"]
        assert main(["chat", "--gguf", tiny, "--max-new-tokens", "4", *extra]) == 0
        out, err = capsys.readouterr()
        answers.append(out)
    assert answers[1] == answers[0] and counters["stats"]["unique_graphs"] - before == 1
    assert len(ran) >= 6 and all(ran), ran  # three answers of four tokens: at least two decode steps each
    assert err.count("compiling the decoding step (") == 1 and "decoding step is ready after" in err
    assert err.count(" cached) in ") == 1  # turn 2 continues the conversation (turn 3 drops the first: trimmed)
    assert list((tmp_path / "compile").glob("decode-*.bin")), "the compiled step was not kept on disk"


@pytest.mark.parametrize("ending", [EOFError, KeyboardInterrupt])
def test_chat_ends_cleanly_on_ctrl_d_and_ctrl_c(tiny: str, monkeypatch: pytest.MonkeyPatch,
                                                 ending: type[BaseException]) -> None:
    def press(prompt: str = "") -> str:
        raise ending

    monkeypatch.setattr(builtins, "input", press)
    assert main(["chat", "--gguf", tiny]) == 0


def test_chat_exit_command(tiny: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lines = iter(["/exit", "never read"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "--gguf", tiny]) == 0
    assert capsys.readouterr().out == ""


# Every error of a malformed model file is one line and exit code 2.

def _corrupted(tiny: str, tmp_path: Path, how: str) -> Path:
    """The tiny file cut short, with bytes overwritten in its header or metadata, or with a bad value."""
    import random

    data = bytearray(Path(tiny).read_bytes())
    path = tmp_path / f"{how}.gguf"
    if how == "directory":
        path.mkdir()
        return path
    if how == "truncated":
        data = data[: len(data) // 3]
    elif how == "empty":
        data = bytearray()
    elif how == "version":
        data[4:8] = (99).to_bytes(4, "little")
    elif how == "bad-head-count":
        at = data.find(b"llama.attention.head_count") + len(b"llama.attention.head_count")
        data[at + 4 : at + 8] = (0).to_bytes(4, "little")  # the value after its 4-byte type
    else:  # scrambled: random bytes over the metadata
        rng = random.Random(how)
        for _ in range(40):
            data[rng.randrange(24, 4000)] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["truncated", "empty", "version", "bad-head-count", "directory",
                                 *(f"scrambled-{i}" for i in range(6))])
def test_a_malformed_gguf_file_is_one_line_and_exit_2(tiny: str, tmp_path: Path, how: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever is wrong with the file, `attnkit generate --gguf` says so in one line (or runs, if it still can)."""
    path = _corrupted(tiny, tmp_path, how)
    code = main(["generate", "--gguf", str(path), "--max-new-tokens", "2", "the"])
    err = capsys.readouterr().err
    if code == 0:  # a flipped byte can land in a weight: the file is still a model
        assert how.startswith("scrambled") and "tokens/s" in err
        return
    assert code == 2, err
    assert err.startswith("attnkit generate: error: ") and err.count("\n") == 1
    assert "Traceback" not in err and len(err) < 600


def test_generate_says_when_max_new_tokens_cut_the_text(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--gguf", tiny, "--max-new-tokens", "3", "the"]) == 0
    assert "(answer cut at --max-new-tokens 3)" in capsys.readouterr().err


def test_generate_ctrl_c_stops_with_exit_130_and_no_traceback(tiny: str, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.models.text import IncrementalDecoder

    def press_ctrl_c(self: IncrementalDecoder, token: int) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(IncrementalDecoder, "add", press_ctrl_c)
    assert main(["generate", "--gguf", tiny, "the"]) == 130
    assert capsys.readouterr().out == "\n"


def test_a_slow_dtype_is_one_warning_line(tiny: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype bfloat16 on a CPU without it printed Python's two-line warning (file, line, then the source)."""
    import attnkit.cpu

    monkeypatch.setattr(attnkit.cpu, "has_fast_bfloat16", lambda: False)
    monkeypatch.setattr(attnkit.cpu, "cpu_capability", lambda: "AVX2")
    assert main(["generate", "--gguf", tiny, "--dtype", "bfloat16", "--max-new-tokens", "2", "the"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert len(lines) == 1 and "float32" in lines[0] and "SlowDtypeWarning" not in err
    assert "tiny.gguf (bfloat16 weights, CPU capability" in err  # plain weights in --dtype, not "float32 weights"
    assert "): bfloat16 compute" in err


# The options generate, chat and serve share; the load line.

def test_the_load_line_names_the_model_and_its_threads_not_a_path(tiny: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: the load line was a long site-packages path; --threads is said there, and applied."""
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["generate", "--gguf", tiny, "--threads", "2", "--max-new-tokens", "2", "the"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "KV cache" in line]
    assert line.startswith("tiny.gguf (") and str(Path(tiny).parent) not in line
    assert line.endswith(", 2 CPU threads")


def test_the_packaged_model_is_called_by_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.models._decoder import need_smollm2

    need_smollm2()
    assert main(["generate", "--max-new-tokens", "1", "hi"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("SmolLM2-135M-Instruct (") and "site-packages" not in err


@pytest.mark.skipif(torch_cuda(), reason="checks the error given without a CUDA device")
def test_cuda_without_a_gpu_is_one_line_naming_it(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["generate", "hi"], ["chat"]):
        assert main([command[0], "--gguf", tiny, "--device", "cuda", *command[1:]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--device cuda asked for, but this PyTorch" in err and "no CUDA GPU" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA device")
def test_generate_and_chat_on_a_gpu_answer_as_on_the_cpu(tiny: str, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda runs the plain weights there: the greedy text of the CPU's plain weights (tiny margins
    aside), and packed weights are refused by name."""
    args = ["generate", "--gguf", tiny, "--weights", "float32", "--max-new-tokens", "6", "the"]
    assert main(args) == 0
    on_cpu = capsys.readouterr().out
    assert main([*args, "--device", "cuda"]) == 0
    out, err = capsys.readouterr()
    assert out == on_cpu and "(float32 weights, cuda, " in err
    assert main([*args, "--device", "cuda", "--kv-dtype", "int8"]) == 0  # dequantised there: no CPU kernel
    assert "int8 KV cache" in capsys.readouterr().err
    lines = _typing(["hi", "the"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "--gguf", tiny, "--device", "cuda", "--max-new-tokens", "4"]) == 0
    assert "prefilled " in capsys.readouterr().err
    assert main(["generate", "--gguf", tiny, "--device", "cuda", "--weights", "int4", "hi"]) == 2
    assert "--weights int4 packs the weights for PyTorch's CPU kernels" in capsys.readouterr().err
