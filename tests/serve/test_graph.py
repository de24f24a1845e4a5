"""The engine's compiled decode step (attnkit.serve.graph) on a tiny float32 decoder: the eager step's tokens, a
compile that fails leaves the eager step serving, and a cache file that is not ours is never loaded."""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from attnkit.models import LlamaConfig, LlamaModel
from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine, PagedBatch, PagedKVPool
from attnkit.serve.compile_cache import FORMAT, CompileCache
from attnkit.serve.graph import decode_step


def _model() -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                         context_length=128)
    model = LlamaModel(config).eval()
    model.stop_token_ids = ()
    return model


def _decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def _engine(model: LlamaModel, **options: Any) -> Engine:
    return Engine(model, _decode, kv_memory_mib=1, block_size=4, **options)


def _tokens(engine: Engine, prompts: list[list[int]], new: int = 10) -> list[list[int]]:
    """Greedy answers of ``prompts`` submitted together, stepped until all finish."""
    answers: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, GenerationOptions(max_new_tokens=new), lambda e, i=i: answers[i].extend(e.token_ids))
    while not engine.idle:
        engine.step()
    return answers


@pytest.fixture(autouse=True)
def inductor_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's kernels where PyTorch keeps them by default (warm across runs), not under a test's tmp folder,
    and the variable as it was after the test: a CompileCache sets TORCHINDUCTOR_CACHE_DIR only where it is unset."""
    default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(default))


@pytest.mark.slow  # one graph compiled (B = 1 included): tens of seconds on two cores with a cold Inductor cache
def test_the_compiled_decode_step_gives_the_eager_tokens_and_a_restart_loads_it_warm(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Greedy tokens of a batch (B = 4, then rows ending) and of one request alone (B = 1) equal the eager engine's;
    every decode step after the compile ran the graph (a guard that failed would have marked it failed)."""
    model = _model()
    cache = CompileCache.for_model(model, torch.float32, tmp_path)
    caplog.set_level(logging.INFO, logger="attnkit.serve.compile")
    engine = _engine(model, compile=True, compile_cache=cache)
    assert engine.wait_compiled(timeout=900), engine.compile_status()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 9, 17, 5)]
    eager = _engine(model)
    assert _tokens(engine, prompts) == _tokens(eager, prompts)
    assert _tokens(engine, prompts[1:2], new=20) == _tokens(eager, prompts[1:2], new=20)
    status = engine.compile_status()
    assert status["state"] == "ready" and status["steps"] >= 9 + 19 and status["seconds"] > 0
    assert "compiling the decode step in the background (cold)" in caplog.text and "ready after" in caplog.text
    header = json.loads(cache.path.read_bytes().partition(b"\n")[0])
    assert header["key"] == cache.key
    caplog.clear()
    again = _engine(model, compile=True, compile_cache=CompileCache.for_model(model, torch.float32, tmp_path))
    assert again.wait_compiled(timeout=900) and "(warm)" in caplog.text
    assert _tokens(again, prompts[:2]) == _tokens(eager, prompts[:2])


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_graph_takes_every_decode_step_shape_a_one_token_prompt_included(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo's guards without Inductor's minutes (backend "eager"): a prompt of one token alone (S = 1), one row
    (B = 1) and more rows than the warm-up's two. Bug: a one-token prompt's step failed the graph's guard on S,
    and the server decoded eagerly until a restart."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, **options, backend="eager"))
    model = _model()
    engine = _engine(model, compile=True, compile_cache=CompileCache.for_model(model, torch.float32, tmp_path))
    assert engine.wait_compiled(timeout=300), engine.compile_status()
    eager = _engine(model)
    for prompts in ([[7]], [[3, 4, 5]], [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]]):
        assert _tokens(engine, prompts, new=4) == _tokens(eager, prompts, new=4), prompts
    status = engine.compile_status()
    assert status["state"] == "ready" and status["steps"] >= 3 * 3, status


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_graph_takes_every_step_of_requests_sliding_a_sink_window(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With a sink window the evictions run between steps and positions are those in the window: the graph
    (dynamo's guards, backend "eager") takes every decode step of requests past their window, with the eager
    engine's tokens, and stays ready."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, **options, backend="eager"))
    model = _model()
    window = "sink:4,12,4"
    engine = _engine(model, compile=True, compile_cache=CompileCache.for_model(model, torch.float32, tmp_path),
                     cache=window)
    assert engine.wait_compiled(timeout=300), engine.compile_status()
    prompts = [[1, 2, 3], list(range(30))]
    assert _tokens(engine, prompts, new=40) == _tokens(_engine(model, cache=window), prompts, new=40)
    status = engine.compile_status()
    assert status["state"] == "ready" and status["steps"] >= 39, status


def test_a_compile_that_fails_leaves_the_eager_step_serving_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Bug to avoid: a failed background compile took the engine down, or left it waiting on a graph."""
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    caplog.set_level(logging.INFO, logger="attnkit.serve.compile")
    model = _model()
    engine = _engine(model, compile=True, compile_cache=CompileCache.for_model(model, torch.float32, tmp_path))
    assert not engine.wait_compiled(timeout=60)
    status = engine.compile_status()
    assert status["state"] == "failed" and "no C++ compiler here" in status["error"] and status["steps"] == 0
    assert "failed after" in caplog.text and "the eager step keeps serving" in caplog.text
    prompts = [[1, 2, 3], [4, 5]]
    assert _tokens(engine, prompts) == _tokens(_engine(model), prompts)
    assert engine.alive


def test_health_shows_the_compile_state_and_nothing_more_without_compile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests._util import need

    need("fastapi")
    testclient = need("fastapi.testclient")
    from attnkit.serve.api import Server, create_app

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    model = _model()
    engine = _engine(model, compile=True, compile_cache=CompileCache.for_model(model, torch.float32, tmp_path))
    engine.wait_compiled(timeout=60)
    client = testclient.TestClient(create_app(Server(engine, None, model_name="tiny", context_length=128)))
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["compile"]["state"] == "failed"
    assert "no C++ compiler here" in health["compile"]["error"]
    plain = testclient.TestClient(create_app(Server(_engine(model), None, model_name="tiny", context_length=128)))
    assert plain.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("problem", ["garbage", "another key", "a checksum that does not match",
                                     "artifacts PyTorch refuses"])
def test_a_corrupt_or_foreign_cache_file_is_removed_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           problem: str) -> None:
    """A file that is not this key's, or whose payload changed, never reaches PyTorch's loader; one PyTorch refuses
    is removed too. Either way the compile runs cold (and writes the file again)."""
    cache = CompileCache(tmp_path, {"torch": torch.__version__, "model": "tiny"})
    payload = b"\x80\x04 not really artifacts"
    header = {"format": FORMAT, "key": cache.key, "sha256": hashlib.sha256(payload).hexdigest()}
    if problem == "garbage":
        data = b"\x00\xff" * 64
    elif problem == "another key":
        data = json.dumps({**header, "key": {**cache.key, "torch": "1.0"}}).encode() + b"\n" + payload
    elif problem == "a checksum that does not match":
        data = json.dumps(header).encode() + b"\n" + payload + b"!"
    else:
        data = json.dumps(header).encode() + b"\n" + payload
    loaded: list[bytes] = []

    def load(artifacts: bytes) -> None:
        loaded.append(artifacts)
        return None  # what PyTorch returns for artifacts it cannot read

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    cache.folder.mkdir(exist_ok=True)
    cache.path.write_bytes(data)
    said = cache.load()
    assert said.startswith("cold: ") and "removed unread" in said and not cache.path.exists()
    assert loaded == ([payload] if problem == "artifacts PyTorch refuses" else [])
    assert cache.load() == "cold"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_the_decode_step_traces_as_one_graph(dtype: torch.dtype) -> None:
    """A graph break inside the layers (a host sync, a Python branch on a tensor) or in the int8 pool's layer cache
    (quantising, writing codes and scales) would fail the fullgraph compile: the engine would serve eagerly
    forever."""
    model = _model()
    pool = PagedKVPool(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    positions = torch.tensor([[5], [2]])
    batch = PagedBatch.build([[0, 1], [2]], positions, [6, 3], 4, pool.spare)
    with torch.inference_mode():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(decode_step)(model, torch.tensor([[7], [8]]), positions,
                                                        batch.write_slots, batch.read_slots, batch.key_positions,
                                                        pool.k, pool.v, pool.k_scales, pool.v_scales)
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_a_compiling_engine_answers_at_once_with_the_eager_step(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug to avoid: requests waited for the compile (minutes on a CPU) instead of being answered eagerly."""
    release = threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Any:  # a compile that has not ended while the engine serves
        release.wait(timeout=60)
        raise RuntimeError("released")

    monkeypatch.setattr(torch, "compile", slow)
    model = _model()
    engine = _engine(model, compile=True, compile_cache=CompileCache.for_model(model, torch.float32, tmp_path))
    try:
        assert _tokens(engine, [[1, 2, 3]]) == _tokens(_engine(model), [[1, 2, 3]])
        assert engine.compile_status() == {"state": "compiling", "steps": 0}
    finally:
        release.set()
    assert not engine.wait_compiled(timeout=60) and engine.compile_status()["state"] == "failed"
