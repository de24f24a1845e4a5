"""``attnkit serve``'s options, through a real server process over the tiny Gemma 3 file of test_gemma3.

The tiny file loads in a blink and has no chat template: requests go to /v1/completions.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnkit.cli import main
from tests._util import need

need("fastapi")
need("uvicorn")
need("gguf")
need("tokenizers")
httpx = need("httpx")

from attnkit.bench.serve import ServerProcess  # noqa: E402
from tests.models.test_gemma3 import write_tiny_gemma3  # noqa: E402

KEY = {"Authorization": "Bearer key"}


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve-cli") / "tiny.gguf"
    write_tiny_gemma3(path)
    return path


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess.attnkit("--gguf", str(tiny), "--kv-memory", "1", "--api-key", "key",
                                    "--served-model-name", "gpt-4o-mini", threads=1,
                                    log=tmp_path_factory.mktemp("serve-cli") / "server.log")
    yield process
    process.stop()


def test_a_browser_preflight_needs_no_key_and_any_origin_may_call_by_default(server: ServerProcess) -> None:
    """Bug: no CORS: every browser app on another origin failed at its preflight."""
    preflight = httpx.options(server.url + "/v1/completions", timeout=10, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize(("option", "says"), [
    (["--cors-origins", "http://localhost:3000/"], "--cors-origins 'http://localhost:3000/' is not a web origin"),
    (["--alias", " "], "--alias ' ' is empty"),
])
def test_a_bad_option_is_one_line_naming_it_before_any_load(capsys: pytest.CaptureFixture[str], option: list[str],
                                                            says: str) -> None:
    """A trailing slash never matches the Origin header a browser sends; an empty name matches no client."""
    assert main(["serve", "--gguf", "missing.gguf", *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


def test_served_model_names_are_listed_and_answered(server: ServerProcess) -> None:
    """Bug: the model id was fixed to the file's name: an app configured with another name got a 404."""
    listed = httpx.get(server.url + "/v1/models", headers=KEY, timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "gpt-4o-mini"]
    body = {"model": "gpt-4o-mini", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, headers=KEY, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 2


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: the port was found in use after the model had loaded (16 s) and a banner said the server was up;
    then uvicorn's raw Errno 98 and exit code 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--gguf", str(tiny), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"attnkit serve: error: port {port} on 127.0.0.1 is in use (another server?): choose a free one " \
                  "with --port\n"  # and no banner: nothing was loaded


@pytest.mark.parametrize("quiet", [False, True])
def test_each_request_prints_one_line_unless_no_access_log(tiny: Path, tmp_path: Path, quiet: bool) -> None:
    """Bug: the server logged no requests; --no-access-log keeps them off stderr."""
    process = ServerProcess.attnkit("--gguf", str(tiny), "--kv-memory", "1", *(["--no-access-log"] if quiet else []),
                                    threads=1, log=tmp_path / "server.log")
    try:
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
        assert httpx.post(process.url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        process.stop()  # its output is complete once it has ended
    lines = [line for line in (tmp_path / "server.log").read_text().splitlines() if "POST /v1/completions" in line]
    if quiet:
        assert lines == []
    else:
        assert len(lines) == 1 and " POST /v1/completions 200 prompt_tokens=" in lines[0], lines
        assert "completion_tokens=2 " in lines[0] and "hello" not in lines[0]


def test_serve_answers_at_once_while_its_decode_step_compiles_and_says_so(tiny: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (--compile here: the test harness serves eagerly unless told): the eager step answers while the
    compiled one is built in the background; the log and /health say so (the server is stopped mid-compile)."""
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))  # inherited by the server: its compile cache
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    process = ServerProcess.attnkit("--gguf", str(tiny), "--kv-memory", "1", "--compile", threads=1,
                                    log=tmp_path / "server.log")
    try:
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
        assert httpx.post(process.url + "/v1/completions", json=body, timeout=30).status_code == 200
        health = httpx.get(process.url + "/health", timeout=10).json()
    finally:
        process.stop()
    assert health["status"] == "ok" and health["compile"]["state"] in ("compiling", "ready"), health
    assert "compiling the decode step in the background (cold)" in (tmp_path / "server.log").read_text()


# --threads, --device, --kv-dtype, --compile and --cache mean the same on generate, chat and serve.

SHARED = ("--threads", "--device", "--kv-dtype", "--compile", "--cache")


def _help_of(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Each shared option's entry in ``attnkit COMMAND --help``, whitespace folded."""
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    entries: dict[str, str] = {}
    for block in re.split(r"\n  (?=-)", text.split("options:", 1)[1]):
        words = block.split()
        if words and words[0] in SHARED:
            entries[words[0]] = " ".join(words)
    return entries


def test_the_shared_options_have_one_help_text_and_one_set_of_choices(capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: serve's --kv-dtype lacked int8 and its --threads said less; each command defined its own."""
    monkeypatch.setenv("COLUMNS", "100")
    helps = {command: _help_of(command, capsys) for command in ("generate", "chat", "serve")}
    assert set(helps["serve"]) == set(SHARED)
    assert helps["generate"] == helps["chat"] == helps["serve"]
    assert "{float32,bfloat16,float16,int8}" in helps["serve"]["--kv-dtype"]
    assert "OMP_NUM_THREADS=1" in helps["serve"]["--threads"] and "3.2x" in helps["serve"]["--threads"]
    assert "chat and serve store the same codes and scales in the engine's paged pool" in helps["serve"]["--kv-dtype"]


@pytest.mark.parametrize(("option", "says"), [
    (["--threads", "0"], "--threads must be 1 .. "),
    (["--threads", "99999"], "more only slows PyTorch down"),
    (["--device", "meta"], "--device meta: expected cpu, cuda or cuda:N, got a meta device"),
    (["--device", "tpu"], "--device 'tpu' is not a device: expected cpu, cuda or cuda:N"),
    (["--cache", "sink:4"], "sink:4"),
])
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_bad_shared_option_is_refused_alike_by_every_command(command: str, option: list[str], says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    prompt = ["hi"] if command == "generate" else []
    assert main([command, "--gguf", "missing.gguf", *option, *prompt]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"attnkit {command}: error: ") and says in err


@pytest.mark.parametrize(("option", "says"), [
    (["--compile", "--no-compile"], "--compile and --no-compile contradict each other: give one"),
    (["--cache", "sink:4,1020", "--kv-dtype", "bfloat16"], "--cache sink:4,1020 re-rotates the keys it keeps"),
])
def test_serve_refuses_what_its_engine_cannot_honour_naming_it(option: list[str], says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Values serve cannot honour are refused before any load, never silently ignored."""
    assert main(["serve", "--gguf", "missing.gguf", *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


@pytest.mark.parametrize("option", [["--cache", "sink:4,60"], ["--kv-dtype", "int8"], ["--compile"]])
def test_serve_minilm_refuses_the_text_models_options_rather_than_ignore_them(option: list[str],
                                                                             capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    assert main(["serve", "--model", "minilm", *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{option[0]} is for a text model" in err and "drop it" in err


@pytest.mark.skipif(torch_cuda(), reason="a GPU that is not here; this machine has one")
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_gpu_this_machine_lacks_is_refused_alike_by_every_command(command: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--device means the same on generate, chat and serve (issue 38): serve no longer refuses every GPU, and one
    that is not here is refused before the load, in generate's words."""
    prompt = ["hi"] if command == "generate" else []
    assert main([command, "--gguf", "missing.gguf", "--device", "cuda", *prompt]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda asked for, but this PyTorch" in err and "sees no CUDA GPU" in err


def test_serve_refuses_a_gpu_for_embeddings_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """MiniLM computes on the CPU: --device cuda with --model minilm would be ignored, so it is refused."""
    assert main(["serve", "--model", "minilm", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model minilm computes its embeddings on the CPU: drop --device" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA device")
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_packed_weights_on_a_gpu_are_refused_alike(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = ["hi"] if command == "generate" else []
    assert main([command, "--gguf", "missing.gguf", "--device", "cuda", "--weights", "int4", *prompt]) == 2
    err = capsys.readouterr().err
    says = "--weights int4 packs the weights for PyTorch's CPU kernels; on --device cuda they stay plain"
    assert err.count("\n") == 1 and says in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA device")
def test_serve_on_a_gpu_answers_as_on_the_cpu_and_says_where(tiny: Path, tmp_path: Path) -> None:
    """attnkit serve --device cuda loads the model on the GPU (float32 weights, as generate) and serves from a
    pool there: the greedy answer of the CPU server with the same weights, and the banner names the GPU."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    texts = {}
    for device in ("cpu", "cuda"):
        process = ServerProcess.attnkit("--gguf", str(tiny), "--kv-memory", "1", "--weights", "float32",
                                        "--device", device, threads=1, log=tmp_path / f"{device}.log")
        try:
            reply = httpx.post(process.url + "/v1/completions", json=body, timeout=60)
        finally:
            process.stop()
        assert reply.status_code == 200, reply.text
        texts[device] = reply.json()["choices"][0]["text"]
    assert texts["cuda"] == texts["cpu"]
    (banner,) = [line for line in (tmp_path / "cuda.log").read_text().splitlines() if "attnkit serve:" in line]
    assert "(float32 weights, cuda, " in banner


@pytest.mark.parametrize(("kv_dtype", "cache"), [("bfloat16", "full"), ("int8", "full"), ("float32", "sink:4,28,8")])
def test_serve_takes_the_shared_options_it_can_honour(tiny: Path, tmp_path: Path, kv_dtype: str, cache: str) -> None:
    """--threads, --kv-dtype (int8 too: generate's int8 cache, served by the paged pool since issue 38), --device
    cpu and --cache (a sink window too, since issue 38: an answer longer than the model's context of 64): a server
    that answers, and says so."""
    process = ServerProcess.attnkit("--gguf", str(tiny), "--kv-memory", "1", "--kv-dtype", kv_dtype, "--device",
                                    "cpu", "--cache", cache, threads=1, log=tmp_path / "server.log")
    new = 2 if cache == "full" else 80
    try:
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": new, "temperature": 0,
                "logit_bias": {"1": -100}}  # never the end-of-text id
        reply = httpx.post(process.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == new
    finally:
        process.stop()
    (banner,) = [line for line in (tmp_path / "server.log").read_text().splitlines() if "attnkit serve:" in line]
    assert banner.startswith("attnkit serve: tiny.gguf, model id tiny (") and "; 1 CPU thread)" in banner
    assert f" {kv_dtype} KV blocks of 16 positions" in banner
    assert ("each request keeps --cache" in banner) == (cache != "full")
