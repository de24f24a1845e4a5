"""``attnkit serve``'s options, through a real server process over the tiny Gemma 3 file of test_gemma3.

The tiny file loads in a blink and has no chat template: requests go to /v1/completions.
"""

from __future__ import annotations

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
