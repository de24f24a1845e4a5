"""The chat page at / against a scripted stand-in server (no model), driven in headless Chromium like test_page.

The page is what the real ``page()`` route renders (through ``create_app``); the stand-in answers its
``POST /v1/chat/completions`` by the question's first word: ``slow`` streams for seconds, ``hold`` sends
nothing after the stream opens, ``busy`` is a 429, ``toolong`` the 400 of a conversation with no room left,
``room`` a 400 for ``max_tokens`` over the room until it asks for at most 7, ``cut`` closes the stream
without a finish_reason or [DONE]; anything else is answered at once with ``Answer to: <question>``.
"""

from __future__ import annotations

import json
import threading
import time
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests._util import need

need("fastapi")
testclient = need("fastapi.testclient")

from attnkit.serve.api import create_app  # noqa: E402

MODEL = "stub-model"
HOSTILE = 'a\\b "q" \'s & <b>bold</b> "</script><script>window.pwned=1</script>'
CHAT_TOKENIZER = types.SimpleNamespace(chat_template="{{ messages }}")  # a chat model: the page opens in chat mode


def _render(model: str, api_key: str | None = None) -> Any:
    """GET / of the real app; the page route reads nothing of the server but its model name and key."""
    app = create_app(types.SimpleNamespace(model_name=model, api_key=api_key, tokenizer=CHAT_TOKENIZER))
    return testclient.TestClient(app).get("/")


def _chunk(content: str | None = None, reason: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    event = {"object": "chat.completion.chunk", "model": MODEL,
             "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
    return f"data: {json.dumps(event)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class Stub(ThreadingHTTPServer):
    daemon_threads = True
    pages: dict[str, bytes]
    sent: list[dict[str, Any]]  # the bodies of every chat request, in order
    keys: list[str | None]  # the Authorization header of every chat request, in order


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Stub

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, code: str | None, param: str | None = None) -> None:
        error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
        self._reply(status, json.dumps({"error": error}).encode())

    def do_GET(self) -> None:
        page = self.server.pages.get(self.path)
        if page is None:
            self._error(404, f"Invalid URL (GET {self.path})", None)
        else:
            self._reply(200, page, "text/html; charset=utf-8")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.sent.append(body)
        self.server.keys.append(self.headers.get("Authorization"))
        question = body["messages"][-1]["content"]
        first = question.split()[0]
        if first == "busy":
            return self._error(429, "The server is busy (1 requests are waiting already); retry later",
                               "rate_limit_exceeded")
        if first == "toolong":
            return self._error(400, "messages: the prompt has 9030 tokens: no room left in the context window "
                                    "of 8192", "context_length_exceeded", "messages")
        if first == "room" and body.get("max_tokens", 8) > 7:
            return self._error(400, f"max_tokens: {body['max_tokens']} new tokens do not fit: the prompt has 57 "
                                    "tokens, the context window is 64 and the KV memory 64 positions; ask for "
                                    "at most 7", None, "max_tokens")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        write = self.wfile
        try:
            write.write(_chunk(""))
            write.flush()
            if first == "slow":
                for i in range(400):
                    write.write(_chunk(f"word{i}\n"))
                    write.flush()
                    time.sleep(0.03)
                write.write(_chunk(None, "stop") + DONE)
            elif first == "hold":
                for _ in range(100):
                    write.write(b": waiting\n\n")  # a comment: no answer yet (and notices a client that left)
                    write.flush()
                    time.sleep(0.1)
            elif first == "room":
                write.write(_chunk("one two three four five six seven") + _chunk(None, "length") + DONE)
            elif first == "cut":
                write.write(_chunk("an answer cut off by a proxy"))
            else:
                write.write(_chunk(f"Answer to: {question}") + _chunk(None, "stop") + DONE)
            write.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    server = Stub(("127.0.0.1", 0), Handler)
    server.pages = {"/": _render(MODEL).content, "/hostile": _render(HOSTILE).content,
                    "/keyed": _render(MODEL, api_key="secret").content}
    server.sent, server.keys = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture
def tab(browser: Any, stub: Stub) -> Iterator[Any]:
    """A fresh page at /; its script errors are checked at the end."""
    stub.sent.clear()
    stub.keys.clear()
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(f"http://127.0.0.1:{stub.server_port}/")
    yield page
    page.close()
    assert errors == []


def _ask(tab: Any, question: str, wait: bool = True) -> None:
    tab.fill("#input", question)
    tab.press("#input", "Enter")
    if wait:
        _idle(tab)


def _idle(tab: Any) -> None:
    tab.wait_for_function("document.querySelector('#stop').disabled === true", timeout=10_000)


def _shown(tab: Any) -> list[str]:
    return tab.eval_on_selector_all(".msg", "els => els.map(e => e.className.replace('msg ', '') + ': ' + "
                                            "e.textContent)")


def _history(stub: Stub) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in stub.sent[-1]["messages"]]


def _streaming(tab: Any) -> None:
    """Wait until the last answer has some text."""
    tab.wait_for_function("[...document.querySelectorAll('.assistant')].pop()?.textContent.length > 20",
                          timeout=10_000)


@pytest.mark.browser
def test_new_chat_during_an_answer_leaves_nothing_of_it(tab: Any, stub: Stub) -> None:
    """Bug: the aborted answer added '(stopped)' to the new log and its partial text to the new history."""
    _ask(tab, "Hi")
    _ask(tab, "slow story please", wait=False)
    _streaming(tab)
    tab.click("#new")
    assert tab.is_disabled("#stop") and tab.is_enabled("#send")
    tab.wait_for_timeout(500)  # the aborted request settles meanwhile
    assert _shown(tab) == ["note: New conversation"]
    _ask(tab, "What is 2+2?")
    assert _history(stub) == [("user", "What is 2+2?")]
    assert _shown(tab) == ["note: New conversation", "user: What is 2+2?", "assistant: Answer to: What is 2+2?"]


def _fail_by_network(tab: Any) -> None:
    tab.route("**/v1/chat/completions", lambda route: route.abort())


@pytest.mark.browser
@pytest.mark.parametrize(("question", "says"), [
    ("busy please", "error: The server is busy (1 requests are waiting already); retry later"),
    ("toolong please", "start a New chat"),
    ("network please", "could not reach the server"),
])
def test_a_failed_question_is_not_resent_and_goes_back_into_the_box(tab: Any, stub: Stub, question: str,
                                                                    says: str) -> None:
    """Bug: a refused (429, 400) or unsent question and an empty answer stayed in the history of every later
    question, and the box was left empty; a conversation too long for the model did not say to start anew."""
    _ask(tab, "Hi")
    if question.startswith("network"):
        _fail_by_network(tab)
    _ask(tab, question)
    tab.unroute("**/v1/chat/completions")
    assert tab.input_value("#input") == question
    shown = _shown(tab)
    assert shown[:2] == ["user: Hi", "assistant: Answer to: Hi"] and len(shown) == 3, shown
    assert shown[2].startswith("error: ") and says in shown[2], shown
    assert tab.get_attribute(".error", "role") == "alert"
    _ask(tab, "What next?")
    assert _history(stub) == [("user", "Hi"), ("assistant", "Answer to: Hi"), ("user", "What next?")]


def _refuse_every_key(tab: Any) -> list[str | None]:
    """Answer every chat request with the server's 401; returns the keys they carried."""
    keys: list[str | None] = []

    def refuse(route: Any) -> None:
        keys.append(route.request.headers.get("authorization"))
        route.fulfill(status=401, content_type="application/json",
                      body=json.dumps({"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}))

    tab.route("**/v1/chat/completions", refuse)
    return keys


@pytest.mark.browser
@pytest.mark.parametrize(("typed", "says"), [
    ("", "error: this server needs an API key: enter the one it was started with (attnkit serve --api-key) in the "
         "API key field above, then send again"),
    ("wrong", "error: the server refused this API key (Incorrect API key provided): check the API key field above, "
              "then send again"),
])
def test_a_refused_key_says_so_on_the_page_and_points_to_the_key_field(tab: Any, stub: Stub, typed: str,
                                                                       says: str) -> None:
    """Bug: with --api-key the page could not send a key: every question failed with a bare 401 (later, a
    prompt() dialog asked for it). Now a 401 says where the key goes; the question goes back into the box and is
    not resent with the refused key."""
    dialogs: list[str] = []
    tab.on("dialog", lambda dialog: (dialogs.append(dialog.type), dialog.dismiss()))
    tab.goto(f"http://127.0.0.1:{stub.server_port}/keyed")
    tab.fill("#key", typed)
    keys = _refuse_every_key(tab)
    _ask(tab, "Hi there")
    tab.unroute("**/v1/chat/completions")
    assert keys == [f"Bearer {typed}" if typed else None]  # asked once, with what the field held
    assert _shown(tab) == [f"error: {says}"] and tab.get_attribute(".error", "role") == "alert"
    assert tab.input_value("#input") == "Hi there"
    assert tab.evaluate("document.activeElement.id") == "key" and dialogs == []
    _ask(tab, "What next?")
    assert _history(stub) == [("user", "What next?")]


@pytest.mark.browser
def test_the_key_field_sends_a_bearer_key_and_the_browser_keeps_it(tab: Any, stub: Stub) -> None:
    """A server started with --api-key: its page shows the key field; the key typed there goes with every
    question and is still there on the next visit. A server without a key shows no field."""
    assert tab.is_hidden("#key")
    tab.goto(f"http://127.0.0.1:{stub.server_port}/keyed")
    assert tab.is_visible("#key") and tab.input_value("#key") == ""
    assert tab.get_by_label("API key").count() == 1
    tab.fill("#key", "secret")
    _ask(tab, "Hi")
    assert stub.keys == ["Bearer secret"]
    assert _shown(tab) == ["user: Hi", "assistant: Answer to: Hi"]
    tab.reload()
    assert tab.input_value("#key") == "secret"
    _ask(tab, "Again")
    assert stub.keys == ["Bearer secret", "Bearer secret"]


@pytest.mark.browser
def test_the_model_name_is_text_and_never_script(browser: Any, stub: Stub) -> None:
    """Bug: page() pasted the name raw into the HTML and a JavaScript string: a quote broke the script and
    '</script><script>…' ran."""
    stub.sent.clear()
    tab = browser.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    try:
        tab.goto(f"http://127.0.0.1:{stub.server_port}/hostile")
        tab.wait_for_timeout(200)
        assert tab.evaluate("window.pwned") is None
        assert tab.title() == f"attnkit chat · {HOSTILE}"
        assert tab.text_content("h1 .model") == f"· {HOSTILE}"
        assert tab.locator("h1 b").count() == 0
        _ask(tab, "Hi")
        assert stub.sent[-1]["model"] == HOSTILE  # the script has the exact name, backslash and quotes included
        assert errors == []
    finally:
        tab.close()


def test_page_escapes_the_model_name_and_favicon_needs_no_key() -> None:
    html = _render(HOSTILE).text
    assert "<script>window.pwned" not in html and "<b>" not in html
    assert "&lt;/script&gt;&lt;script&gt;window.pwned=1&lt;/script&gt;" in html
    app = create_app(types.SimpleNamespace(model_name=MODEL, api_key="secret", tokenizer=CHAT_TOKENIZER))
    icon = testclient.TestClient(app).get("/favicon.ico")
    assert (icon.status_code, icon.content) == (204, b"")  # browsers ask for it on every load


@pytest.mark.browser
@pytest.mark.parametrize("event", [{"isComposing": True}, {"keyCode": 229}])
def test_enter_that_confirms_an_ime_conversion_does_not_send(tab: Any, stub: Stub, event: dict[str, Any]) -> None:
    """Bug: Enter pressed to confirm a Japanese, Chinese or Korean conversion sent the half-composed text."""
    tab.fill("#input", "にほん")
    tab.dispatch_event("#input", "keydown", {"key": "Enter", "code": "Enter", "bubbles": True, "cancelable": True,
                                             **event})
    tab.wait_for_timeout(300)
    assert stub.sent == [] and _shown(tab) == [] and tab.input_value("#input") == "にほん"
    tab.press("#input", "Enter")  # once the conversion is confirmed, Enter sends
    _idle(tab)
    assert _history(stub) == [("user", "にほん")]


@pytest.mark.browser
def test_less_room_than_512_tokens_asks_for_what_fits(tab: Any, stub: Stub) -> None:
    """Bug: max_tokens 512 was refused once less room was left, with an error the page offered no way out of."""
    _ask(tab, "room please")
    assert [body["max_tokens"] for body in stub.sent] == [512, 7]
    assert _shown(tab) == ["user: room please", "assistant: one two three four five six seven",
                           "note: (the answer reached its length limit)"]


@pytest.mark.browser
def test_stop_before_the_first_token_leaves_no_turn(tab: Any, stub: Stub) -> None:
    _ask(tab, "hold on", wait=False)
    tab.wait_for_timeout(200)
    tab.click("#stop")
    _idle(tab)
    assert _shown(tab) == ["note: (stopped)"]
    assert tab.input_value("#input") == "hold on"
    _ask(tab, "What next?")
    assert _history(stub) == [("user", "What next?")]


@pytest.mark.browser
def test_escape_stops_an_answer_and_the_stopped_part_is_kept(tab: Any, stub: Stub) -> None:
    _ask(tab, "slow story please", wait=False)
    _streaming(tab)
    tab.press("#input", "Escape")
    _idle(tab)
    shown = _shown(tab)
    assert shown[0] == "user: slow story please" and shown[1].startswith("assistant: word0\nword1\n")
    assert shown[2:] == ["note: (stopped)"]
    _ask(tab, "What next?")
    assert [role for role, _ in _history(stub)] == ["user", "assistant", "user"]


@pytest.mark.browser
def test_a_stream_that_ends_without_its_end_is_shown_as_cut_off(tab: Any, stub: Stub) -> None:
    """Bug: a stream closed with neither finish_reason nor [DONE] (a proxy's timeout) looked complete."""
    _ask(tab, "cut please")
    shown = _shown(tab)
    assert shown[:2] == ["user: cut please", "assistant: an answer cut off by a proxy"]
    assert len(shown) == 3 and "cut off" in shown[2], shown


@pytest.mark.browser
def test_the_log_follows_the_answer_only_while_the_reader_is_at_the_bottom(tab: Any, stub: Stub) -> None:
    tab.set_viewport_size({"width": 800, "height": 400})
    _ask(tab, "slow story please", wait=False)
    tab.wait_for_function("document.querySelector('#log').scrollHeight > 3 * document.querySelector('#log')"
                          ".clientHeight && document.querySelector('#log').scrollTop > 0", timeout=10_000)
    tab.eval_on_selector("#log", "log => { log.scrollTop = 0; }")
    tab.wait_for_timeout(300)
    assert tab.eval_on_selector("#log", "log => log.scrollTop") == 0  # it used to jump back to the bottom
    tab.click("#stop")
    _idle(tab)


@pytest.mark.browser
def test_who_said_what_is_in_the_accessibility_tree(tab: Any, stub: Stub) -> None:
    assert tab.get_by_label("Your question").count() == 1  # not just a placeholder
    _ask(tab, "Hi")
    assert tab.get_by_role("article", name="You").text_content() == "Hi"
    assert tab.get_by_role("article", name="Assistant").text_content() == "Answer to: Hi"
    assert tab.eval_on_selector_all("[aria-live], [role=log], [role=status]",
                                    "els => els.map(e => e.id)") == ["status"]  # not the log, token by token
    assert tab.text_content("#status") == "Assistant: Answer to: Hi"
