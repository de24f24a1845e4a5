"""``attnkit chat`` as people use it, on a tiny GGUF file (--gguf).

Typed lines come from a patched ``input()``; Ctrl-C is a KeyboardInterrupt raised where the terminal would raise
it. Undecodable bytes go through a real pipe into a subprocess. Line editing and history (readline) were checked by
hand in tmux: see the issue's notes.
"""

from __future__ import annotations

import builtins
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from attnkit.cli import main
from attnkit.models import loader
from tests._util import need
from tests.models._decoder import write_tiny_llama

need("gguf")
need("tokenizers")
need("rich")
need("jinja2")

Messages = list[dict[str, str]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    write_tiny_llama(path, context=64)
    return str(path)


@pytest.fixture(scope="module")
def model(tiny: str) -> Any:
    from attnkit.models import load_gguf

    return load_gguf(tiny, weights="auto")  # the form the command loads by default


def _typing(monkeypatch: pytest.MonkeyPatch, lines: Sequence[str | type[BaseException]]) -> None:
    """``input()`` returns each line in turn (an exception class is raised instead), then Ctrl-D."""
    queue = iter(lines)

    def typed(prompt: str = "") -> str:
        line = next(queue, EOFError)
        if isinstance(line, type):
            raise line
        return line

    monkeypatch.setattr(builtins, "input", typed)


def _prompts(monkeypatch: pytest.MonkeyPatch) -> list[Messages]:
    """Every conversation the chat encodes (a spy on GGUFTokenizer.chat_ids), the template probe first."""
    from attnkit.models.tokenizer import GGUFTokenizer

    seen: list[Messages] = []
    original = GGUFTokenizer.chat_ids

    def spy(self: GGUFTokenizer, messages: Sequence[Mapping[str, str]], **kw: Any) -> list[int]:
        seen.append([dict(m) for m in messages])
        return original(self, messages, **kw)

    monkeypatch.setattr(GGUFTokenizer, "chat_ids", spy)
    return seen


def _answer(model: Any, messages: Messages, n: int) -> str:
    import torch

    ids = torch.tensor([model.tokenizer.chat_ids(messages)])  # (1, T)
    return str(model.decode(model.generate(ids, max_new_tokens=n)[0, ids.shape[1]:]))


def test_help_lists_every_command_and_unknown_commands_point_to_it(tiny: str, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _typing(monkeypatch, ["/help", "/nope"])
    assert main(["chat", "--gguf", tiny]) == 0
    out, err = capsys.readouterr()
    assert out == "\n"  # no answer was written: /help and /nope are not messages (the newline is Ctrl-D's)
    for command in ("/help", "/reset", "/exit"):
        assert command in err
    assert "unknown command /nope: /help lists the commands" in err


def _ctrl_c_at_event(monkeypatch: pytest.MonkeyPatch, n: int) -> list[Any]:
    """Ctrl-C while the chat waits for the first answer's ``n``-th event; returns the engines the chat made."""
    from attnkit.serve import chat_cli
    from attnkit.serve.driver import Answering

    calls, made = {"n": 0}, []
    next_event, make = Answering.__next__, chat_cli.conversation_engine

    def pressed(self: Answering) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return next_event(self)

    def noted(*args: Any) -> Any:
        made.append(make(*args))
        return made[-1]

    monkeypatch.setattr(Answering, "__next__", pressed)
    monkeypatch.setattr(chat_cli, "conversation_engine", noted)
    return made


def _chat(tiny: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], lines: list[str],
          new: int, *options: str) -> tuple[str, str]:
    """``attnkit chat`` over the tiny file with ``lines`` typed, ``new`` tokens an answer, and ``options``; its
    (stdout, stderr), every patch undone."""
    _typing(monkeypatch, lines)
    assert main(["chat", "--gguf", tiny, "--max-new-tokens", str(new), *options]) == 0
    out, err = capsys.readouterr()
    monkeypatch.undo()
    return out, err


def _holds_nothing(engine: Any) -> bool:
    """Nothing waits or runs, and every block is free (cached prefixes may stay)."""
    return bool(engine.idle and engine.blocks.free_blocks == engine.blocks.num_blocks)


def test_ctrl_c_during_an_answer_stops_it_and_keeps_what_was_written(
        tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C during an answer ended the whole session; now it ends the answer, whose first part stays, and the
    engine holds nothing of it afterwards."""
    made = _ctrl_c_at_event(monkeypatch, 4)
    prompts = _prompts(monkeypatch)
    out, err = _chat(tiny, monkeypatch, capsys, ["hi", "the"], 8)
    full = _answer(model, [{"role": "user", "content": "hi"}], 8)
    partial = out.split("\n")[0]
    assert partial and full.startswith(partial) and partial != full  # cut after three tokens
    assert "answer stopped by Ctrl-C; what was written stays in the conversation" in err
    assert prompts[-1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": partial},
                           {"role": "user", "content": "the"}]
    second = _answer(model, prompts[-1], 8)
    assert out.split("\n")[1] == second  # the conversation went on, with the partial answer in it
    assert len(made) == 1 and _holds_nothing(made[0])


def test_ctrl_c_before_the_first_token_drops_the_message(tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C before the first answer's first event: the message goes, the request is cancelled (it ran on,
    unseen, before the next answer), and the next turn answers as alone."""
    made = _ctrl_c_at_event(monkeypatch, 1)
    prompts = _prompts(monkeypatch)
    out, err = _chat(tiny, monkeypatch, capsys, ["hi", "the"], 3)
    assert "before it began; your message is dropped" in err
    assert prompts[-1] == [{"role": "user", "content": "the"}]
    assert out.split("\n")[1] == _answer(model, prompts[-1], 3)  # the next answer, as alone
    assert err.count("generation: 3 tokens") == 1
    assert len(made) == 1 and _holds_nothing(made[0])


def _first_step_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's first forward raises (out of memory, a bug), which ends that engine; later forwards run."""
    from attnkit.serve.runner import Runner

    forward, calls = Runner.forward, []

    def fails_once(self: Runner, rows: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return forward(self, rows)

    monkeypatch.setattr(Runner, "forward", fails_once)


def test_after_the_engine_dies_a_new_one_answers_the_next_message(
        tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed step (out of memory, a bug) ended the engine, and the next message crashed the chat."""
    _first_step_fails(monkeypatch)
    prompts = _prompts(monkeypatch)
    out, err = _chat(tiny, monkeypatch, capsys, ["hi", "the"], 3)
    assert "out of memory" in err and "a new one answers from now on" in err
    assert prompts[-1] == [{"role": "user", "content": "the"}]  # the failed message left no trace
    assert out.split("\n")[1] == _answer(model, prompts[-1], 3)


def test_ctrl_c_while_the_speed_line_is_written_does_not_end_the_session(
        tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The answer has ended when its speed line is written: a Ctrl-C then (meant for the answer) ended the whole
    session with a KeyboardInterrupt; it is dropped, and the next message is answered."""
    from attnkit.serve import chat_cli

    report, pressed = chat_cli.report_speed, []

    def pressed_meanwhile(*args: Any, **kwargs: Any) -> None:
        pressed.append(1)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, while the line is written
        report(*args, **kwargs)

    monkeypatch.setattr(chat_cli, "report_speed", pressed_meanwhile)
    prompts = _prompts(monkeypatch)
    out, err = _chat(tiny, monkeypatch, capsys, ["hi", "the"], 3)
    assert len(pressed) == 2  # both answers ended with their speed line, the session went on after the first
    assert err.count("generation: 3 tokens") == 2
    assert out.split("\n")[1] == _answer(model, prompts[-1], 3)


def test_with_compile_the_engine_that_replaces_a_dead_one_is_waited_for_too(
        tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--compile: the chat waits for the compiled step before its first answer; a new engine after one died
    compiled beside the eager answers instead (slowing them severely on a CPU), and said nothing."""
    _first_step_fails(monkeypatch)
    monkeypatch.setattr("attnkit.serve.engine.compile_in_background", lambda *args: None)  # the wait, not a compile

    def wait_compiled(self: Any, timeout: float | None = None) -> bool:  # a compile that fails, as its log says
        logging.getLogger("attnkit.serve.compile").warning("the compile failed: boom")
        return False

    monkeypatch.setattr("attnkit.serve.engine.Engine.wait_compiled", wait_compiled)
    prompts = _prompts(monkeypatch)
    out, err = _chat(tiny, monkeypatch, capsys, ["hi", "the"], 3, "--compile")
    assert "a new one answers from now on" in err
    assert err.count("compiling the decoding step") == 2  # at the start, and for the new engine
    assert err.count("the compile failed: boom") == 2  # each wait's warning said once, not once per engine made
    assert out.split("\n")[1] == _answer(model, prompts[-1], 3)


def test_ctrl_c_over_typed_text_clears_the_line_and_at_an_empty_prompt_ends(tiny: str, monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """As in a shell: Ctrl-C with text typed (readline's line buffer) gives a fresh prompt; with none, it ends."""

    class Readline:
        buffer = "half a question"

        def get_line_buffer(self) -> str:
            return self.buffer

    fake = Readline()
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)  # a person at a terminal: chat takes up readline
    monkeypatch.setitem(sys.modules, "readline", fake)
    typed = iter([KeyboardInterrupt, "/reset", KeyboardInterrupt, "never read"])

    def keys(prompt: str = "") -> str:
        key = next(typed)
        if key is KeyboardInterrupt:
            raise KeyboardInterrupt
        fake.buffer = ""
        return str(key)

    monkeypatch.setattr(builtins, "input", keys)
    assert main(["chat", "--gguf", tiny]) == 0
    assert "conversation reset" in capsys.readouterr().err  # read after the first Ctrl-C
    assert next(typed) == "never read"  # the second Ctrl-C, at an empty prompt, ended the session


def test_an_answer_cut_by_max_new_tokens_says_so(tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A cut answer looked like a finished one."""
    _typing(monkeypatch, ["hi"])
    assert main(["chat", "--gguf", tiny, "--max-new-tokens", "3"]) == 0
    assert "(answer cut at --max-new-tokens 3)" in capsys.readouterr().err


def test_an_answer_the_model_ends_is_not_called_cut(tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The answer ends with a stop id exactly at --max-new-tokens: finished, not cut."""
    import torch

    ids = torch.tensor([model.tokenizer.chat_ids([{"role": "user", "content": "hi"}])])
    sampled = model.generate(ids, max_new_tokens=8, stop_ids=[], temperature=5.0, seed=0)  # (1, T + 8)
    tokens = sampled[0, ids.shape[1]:].tolist()
    n = next(j + 1 for j in range(1, len(tokens)) if tokens[j] not in tokens[:j])  # a first occurrence
    load = loader.load_gguf

    def stops_at_token_n(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        loaded.stop_token_ids = (tokens[n - 1],)
        return loaded

    monkeypatch.setattr(loader, "load_gguf", stops_at_token_n)  # what `attnkit chat` loads the file with
    _typing(monkeypatch, ["hi"])
    assert main(["chat", "--gguf", tiny, "--max-new-tokens", str(n), "--temperature", "5", "--seed", "0"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"generation: {n} tokens" in err and "answer cut" not in err


def test_a_conversation_past_the_context_drops_its_oldest_turns_once(
        tiny: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A conversation that outgrew the context was refused mid-session; now its oldest turns go, the system stays."""
    prompts = _prompts(monkeypatch)
    lines = [f"the sin {i}" for i in range(8)]
    _typing(monkeypatch, lines)
    assert main(["chat", "--gguf", tiny, "--system", "be brief", "--max-new-tokens", "6"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "error" not in err
    assert err.count("outgrew the model's context of 64 tokens") == 1
    assert err.count("generation:") == len(lines)  # every line was answered
    last = prompts[-1]
    assert last[0] == {"role": "system", "content": "be brief"} and last[-1]["content"] == lines[-1]
    assert [m["role"] for m in last[1:]] == ["user", "assistant"] * ((len(last) - 2) // 2) + ["user"]
    assert len(last) < 2 * len(lines) + 1  # turns were dropped
    assert last[1]["content"] != lines[0]


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(
        tiny: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _typing(monkeypatch, ["the " * 80, "hi"])
    assert main(["chat", "--gguf", tiny, "--max-new-tokens", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "no room left in the model's context length 64" in err
    assert err.count("generation:") == 1  # "hi" was answered


@pytest.mark.parametrize("template", ["{% for m in messages %}", "{{ messages[0]['content'] | nofilter }}"])
def test_a_broken_chat_template_is_one_line_and_exit_2(tiny: str, template: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A template syntax error in the model file ended `attnkit chat` in a jinja2 traceback."""
    load = loader.load_gguf

    def broken(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        loaded.tokenizer.chat_template = template
        return loaded

    monkeypatch.setattr(loader, "load_gguf", broken)  # what `attnkit chat` and `attnkit generate` load with
    _typing(monkeypatch, ["hi"])
    assert main(["chat", "--gguf", tiny]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("attnkit chat: error: ")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n")  # one line, the last (after the load note)
    assert "chat template" in errors[0]
    assert main(["generate", "--chat", "--gguf", tiny, "hi"]) == 2
    assert "chat template" in capsys.readouterr().err


def _chat_process(tiny: str, stdin: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    code = "import sys; from attnkit.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "chat", "--gguf", tiny, *args], input=stdin,
                          capture_output=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"})  # strict utf-8 stdin


def test_undecodable_bytes_on_stdin_do_not_end_the_conversation(tiny: str, model: Any) -> None:
    """A non-UTF-8 byte on stdin ended the session ("TextInputSequence must be str")."""
    result = _chat_process(tiny, b"a\xe9\xff b\n\xc3\n/exit\n", "--max-new-tokens", "3")
    err = result.stderr.decode()
    assert result.returncode == 0, err
    first = [{"role": "user", "content": "a\ufffd\ufffd b"}]  # one U+FFFD per byte that starts no character
    second = [*first, {"role": "assistant", "content": _answer(model, first, 3)},
              {"role": "user", "content": "\ufffd"}]
    assert result.stdout.decode() == f"{_answer(model, first, 3)}\n{_answer(model, second, 3)}\n"
    assert err.count("not valid UTF-8 is kept as \ufffd") == 1  # said once


def test_sigint_during_an_answer_in_a_real_process_keeps_the_session(tmp_path: Path) -> None:
    """The same Ctrl-C as above, delivered as a real SIGINT to a chat reading a pipe."""
    import signal
    import time

    path = tmp_path / "long.gguf"
    write_tiny_llama(path, context=100_000)
    code = "import sys; from attnkit.cli import main; sys.exit(main(sys.argv[1:]))"
    # a shell starting this run in the background (``bash .ci/run &``) ignores SIGINT in its children, and Python
    # keeps an ignored SIGINT ignored: the chat gets the default disposition back, as a terminal would give it
    chat = subprocess.Popen([sys.executable, "-c", code, "chat", "--gguf", str(path), "--max-new-tokens", "90000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert chat.stdin is not None and chat.stdout is not None
    chat.stdin.write(b"hi\n")
    chat.stdin.flush()
    assert chat.stdout.read(1) != b""  # the answer has started
    time.sleep(0.5)
    chat.send_signal(signal.SIGINT)
    _, err = chat.communicate(b"/exit\n", timeout=120)
    assert chat.returncode == 0, err.decode()
    assert b"answer stopped by Ctrl-C" in err and b"Traceback" not in err


# A conversation is found in the engine's prefix cache: each turn prefills only what it does not hold.

SPEED = re.compile(r"^prompt: (?:(\d+) tokens|prefilled (\d+) new tokens \((\d+) cached\)) in ")


def _speeds(err: str) -> list[tuple[str, ...]]:
    """Each speed line's prompt part: ("fresh", n) with nothing cached, or ("continued", new, cached)."""
    found = []
    for line in err.splitlines():
        m = SPEED.match(line)
        if m is not None:
            fresh, new, cached = m.groups()
            found.append(("fresh", fresh) if fresh else ("continued", new, cached))
    return found


def test_the_next_turn_prefills_only_its_new_tokens_and_answers_as_recomputing(
        tiny: str, model: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: each turn recomputed the whole conversation (37, 60, 138 prompt tokens). The engine's prefix cache
    holds the earlier turns in whole blocks of 16; after /reset only the template's opening is found again."""
    prompts = _prompts(monkeypatch)
    _typing(monkeypatch, ["hi", "the sin", "/reset", "hi"])
    assert main(["chat", "--gguf", tiny, "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    monkeypatch.undo()
    first, second = prompts[1], prompts[2]
    n1, n2 = (len(model.tokenizer.chat_ids(m)) for m in (first, second))
    speeds = _speeds(err)
    assert len(speeds) == 3, err
    assert speeds[0] == ("fresh", str(n1))
    kind, new, cached = speeds[1]
    assert kind == "continued" and int(new) + int(cached) == n2 and int(cached) % 16 == 0, speeds[1]
    assert int(cached) >= n1 - 16, speeds[1]  # the first turn's whole blocks, at least
    again = speeds[2]  # the first prompt again: at most its own whole blocks are found
    assert (again[0] == "fresh" and again[1] == str(n1)) or (again[0] == "continued" and (
        int(again[1]) + int(again[2]) == n1 and int(again[2]) <= n1 - 1)), again
    assert out.split("\n")[:3] == [_answer(model, first, 6), _answer(model, second, 6), _answer(model, first, 6)]


def _counting_template_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A tiny file whose template opens with the number of messages: each turn re-renders the conversation's
    first tokens differently."""
    from tests.models import _decoder

    counting = "{{ messages | length }}" + _decoder.CHATML
    with monkeypatch.context() as patch:
        patch.setattr(_decoder, "CHATML", counting)
        write_tiny_llama(path, context=128)
    return str(path)


@pytest.mark.parametrize("how", ["template", "sink", "trimmed"])
def test_a_history_that_changes_finds_only_what_it_shares_and_answers_as_recomputing(
        tiny: str, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A template that re-renders earlier turns finds nothing cached; a sink cache reuses the blocks written
    before its first eviction; a history cut to fit finds the template's opening. Each answers as the whole
    prompt recomputed would."""
    import torch

    from attnkit.models import load_gguf

    path = _counting_template_file(tmp_path / "counting.gguf", monkeypatch) if how == "template" else tiny
    options = {"template": [], "sink": ["--cache", "sink:4,16,8"], "trimmed": []}[how]
    lines = ["the sin " * 6, "hi", "the sin " * 4, "a"] if how == "trimmed" else ["hi", "the sin"]
    prompts = _prompts(monkeypatch)
    _typing(monkeypatch, lines)
    assert main(["chat", "--gguf", path, "--max-new-tokens", "4", *options]) == 0
    out, err = capsys.readouterr()
    monkeypatch.undo()
    speeds = _speeds(err)
    assert speeds[0][0] == "fresh" and len(speeds) == len(lines), err
    model = load_gguf(path, weights="auto")
    last = len(model.tokenizer.chat_ids(prompts[-1]))
    counted = int(speeds[-1][1]) + (int(speeds[-1][2]) if speeds[-1][0] == "continued" else 0)
    assert counted == last, speeds  # the whole conversation, prefilled or found
    if how == "template":
        assert all(kind == "fresh" for kind, *_ in speeds), speeds
    else:
        assert any(kind == "continued" for kind, *_ in speeds[1:]), speeds
    if how == "trimmed":
        assert "outgrew the model's context of 64 tokens" in " ".join(err.split())
    ids = torch.tensor([model.tokenizer.chat_ids(prompts[-1])])  # (1, T)
    cache = {"cache": "sink:4,16,8"} if how == "sink" else {}
    alone = model.decode(model.generate(ids, max_new_tokens=4, **cache)[0, ids.shape[1]:])
    assert out.endswith(f"{alone}\n\n"), (out, alone)  # each answer ends with a newline, the chat with one more
