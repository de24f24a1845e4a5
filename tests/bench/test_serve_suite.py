"""The serve suite: its offline ceiling runs the weight form attnkit serve runs; its n = 4 and JSON schema rows
beside plain sampling, against a fake streaming server."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

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


class _FakeChat(BaseHTTPRequestHandler):
    """A streaming chat endpoint as attnkit serve answers: a role chunk per choice, each choice's pieces in turn,
    a usage chunk counting every choice's tokens (2 per piece), then [DONE]; a JSON answer when a schema is
    asked for. Each request's body is kept in ``bodies``."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        n = body.get("n", 1)
        pieces = ['{"title": "Light", ', '"story": "A keeper."}'] if "response_format" in body else ["Once ", "upon"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]} for i in range(n)]
        chunks += [{"choices": [{"index": i, "delta": {"content": p}}]} for p in pieces for i in range(n)]
        chunks += [{"choices": [], "usage": {"completion_tokens": 2 * n * len(pieces)}}]
        self.wfile.write(b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_chat() -> Iterator[str]:
    """The URL of a :class:`_FakeChat` server on a free port, in a thread; its bodies cleared."""
    _FakeChat.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChat)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_stream_counts_and_keeps_every_choice(fake_chat: str) -> None:
    """With n = 4 the chunks of four choices interleave: the tokens are usage's (all choices), each text its own."""
    from attnkit.bench.serve import post_stream
    from attnkit.bench.serve_requests import request_body

    stream = post_stream(fake_chat, request_body("n=4", "smollm2"))
    assert stream.tokens == 16 and stream.texts == {i: "Once upon" for i in range(4)}
    assert len(stream.chunks) == 8 and stream.seconds > 0


def test_n4_and_schema_rows_are_ratios_to_plain_sampling_of_the_same_run(fake_chat: str) -> None:
    """The n = 4 and JSON schema requests are timed beside plain sampling, round by round, on one server: the same
    chat, seed and max_tokens, only n or response_format added; vs_plain a ratio of one run."""
    from attnkit.bench.serve_requests import SCHEMA, request_rows

    rows = request_rows(fake_chat, "smollm2", repeats=2)
    assert [(r["request"], r["choices"], r["output_tokens"]) for r in rows] == [("plain", 1, 4), ("n=4", 4, 16),
                                                                               ("json_schema", 1, 4)]
    plain, _, schema = rows
    assert plain["vs_plain"] == plain["decode_vs_plain"] == 1.0 and schema["follows_schema"] == "2/2"
    assert all(r["kind"] == "request" and r["rounds"] == 2 and r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
               and r["vs_plain"] > 0 and r["decode_vs_plain"] > 0 for r in rows)
    bodies = _FakeChat.bodies
    assert len(bodies) == 3 + 3 * 2  # a warm-up round, then two: plain, n=4, schema in turn
    assert [b.get("n", 1) for b in bodies[3:6]] == [1, 4, 1]
    assert bodies[5]["response_format"] == {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
    same = [{k: v for k, v in b.items() if k not in ("n", "response_format")} for b in bodies]
    assert all(b == same[0] for b in same) and same[0]["seed"] == 0 and same[0]["stream"] is True
    with pytest.raises(ValueError, match="repeats >= 1, got 0"):
        request_rows(fake_chat, "smollm2", repeats=0)


def test_the_suite_adds_the_request_rows_and_keeps_its_rows(monkeypatch: pytest.MonkeyPatch, fake_chat: str,
                                                            tmp_path: Path) -> None:
    """run_serve_suite on a fake server: its serve rows per N as before, then the three request rows."""
    from types import SimpleNamespace

    import attnkit.bench.serve as serve

    started: list[tuple[str, ...]] = []

    def attnkit(*options: str, log: Path, threads: int) -> SimpleNamespace:
        started.append(options)
        return SimpleNamespace(url=fake_chat, stop=lambda: None)

    monkeypatch.setattr(serve.ServerProcess, "attnkit", attnkit)
    monkeypatch.setattr(serve, "llama_server_path", lambda: None)
    monkeypatch.setattr(serve, "served_form", lambda: "int4")
    monkeypatch.setattr(serve, "_kv_bytes_per_position", lambda dtype_bytes: 1024)
    monkeypatch.setattr(serve, "offline_ceiling", lambda n, weights, threads: {"output_tokens": 1, "seconds": 1.0,
                                                                               "tokens_per_s": 1.0})
    monkeypatch.setattr(serve, "wait_compiled", lambda url: 2.0)
    monkeypatch.setattr(serve, "compile_state", lambda url: {"state": "ready", "steps": 40})
    monkeypatch.setattr(serve, "floor_single", lambda weights, threads: {"output_tokens": 1, "seconds": 1.0,
                                                                         "tokens_per_s": 2.0})
    rows = serve.run_serve_suite([1], workdir=tmp_path, threads=1, repeats=1)
    assert [(r["kind"], r.get("contender"), r.get("request")) for r in rows[:-2]] == [
        ("skipped", "llama-server", None), ("serve", "attnkit-serve", None), ("serve", "attnkit-serve (graph)", None),
        ("serve", "attnkit-generate (offline ceiling)", None), ("serve", "floor (batch 1)", None),
        ("request", "attnkit-serve", "plain"), ("request", "attnkit-serve", "n=4"),
        ("request", "attnkit-serve", "json_schema")]
    assert rows[-3]["weights"] == "int4" and rows[-3]["threads"] == 1 and "cpu_capability" in rows[-3]
    assert [o[-1] for o in started[:2]] == ["--no-compile", "--compile"]  # eager, then graph mode
    assert rows[2]["compile_wait_s"] == 2.0 and rows[2]["graph_steps"] == 40  # the graph decoded
    graph_vs_floor, eager_vs_floor = rows[-2:]  # the graph-mode server and the eager step against the floor
    assert graph_vs_floor["kind"] == "target" and "graph-mode" in graph_vs_floor["target"]
    assert "floor" in graph_vs_floor["target"] and "eager-step" in eager_vs_floor["target"]
    assert graph_vs_floor["measured"] == pytest.approx(rows[2]["tokens_per_s"] / 2.0, abs=1e-3)
    assert started[-1][:2] == ("--max-batch", "4")  # the n = 4 request's choices decode together


def test_a_graph_that_never_gets_ready_is_a_skipped_row_not_a_lost_run(monkeypatch: pytest.MonkeyPatch,
                                                                          fake_chat: str, tmp_path: Path) -> None:
    """Bug: a compile that failed raised out of the suite, and the minutes of rows measured before it were lost."""
    from types import SimpleNamespace

    import attnkit.bench.serve as serve

    def never(url: str) -> float:
        raise RuntimeError("attnkit serve's compiled step is not ready: {'state': 'failed'}")

    monkeypatch.setattr(serve.ServerProcess, "attnkit", lambda *options, log, threads: SimpleNamespace(
        url=fake_chat, stop=lambda: None))
    monkeypatch.setattr(serve, "llama_server_path", lambda: None)
    monkeypatch.setattr(serve, "served_form", lambda: "int4")
    monkeypatch.setattr(serve, "offline_ceiling", lambda n, weights, threads: {"output_tokens": 1, "seconds": 1.0,
                                                                               "tokens_per_s": 1.0})
    monkeypatch.setattr(serve, "floor_single", lambda weights, threads: {"output_tokens": 1, "seconds": 1.0,
                                                                         "tokens_per_s": 2.0})
    monkeypatch.setattr(serve, "wait_compiled", never)
    rows = serve.run_serve_suite([1], workdir=tmp_path, threads=1, repeats=1)
    skipped = [r for r in rows if r["kind"] == "skipped" and r["contender"] == "attnkit-serve (graph)"]
    assert skipped and "failed" in skipped[0]["why"]
    assert any(r["kind"] == "serve" and r["contender"] == "attnkit-serve" for r in rows)  # the eager row stays
    assert not any(r["kind"] == "target" and "graph-mode" in r["target"] for r in rows)


def test_bench_batch_and_repeats_make_a_short_serve_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`attnkit bench --suite serve --batch 1 --repeats 2`: clients and rounds from the options."""
    import attnkit.bench.serve as serve
    from attnkit.bench import command
    from attnkit.bench.options import Options

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(serve, "run_serve_suite", lambda *args, **kwargs: calls.append((args, kwargs)) or [])
    command.ROW_SUITES["serve"](Options(suite="serve", batch=[1], repeats=2, threads=1))
    command.ROW_SUITES["serve"](Options(suite="serve"))
    assert calls == [(([1],), {"threads": 1, "repeats": 2}), ((), {"threads": 2, "repeats": 5})]


def test_the_launcher_gives_the_server_this_process_threads_unless_told(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """Bug: the launcher always started `attnkit serve --threads 2`; under the suite's one-thread workers such a
    server waited on its second thread whenever the other worker held a core (the HTTP tests 3-10x slower)."""
    import torch

    from attnkit.bench.serve_client import ServerProcess

    commands: list[list[str]] = []
    monkeypatch.setattr(ServerProcess, "__init__", lambda self, command, **kw: commands.append(list(command)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        ServerProcess.attnkit("--kv-memory", "8", log=tmp_path / "a.log")
        ServerProcess.attnkit("--kv-memory", "8", log=tmp_path / "b.log", threads=1)
    finally:
        torch.set_num_threads(before)
    threads = [command[command.index("--threads") + 1] for command in commands]
    assert threads == ["3", "1"]
