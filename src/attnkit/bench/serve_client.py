"""What the serve suites share: a server process on a free port, and streamed chat requests with their timings.

Used by :mod:`.serve` (N concurrent clients) and :mod:`.serve_requests` (n choices and JSON schemas), and by the
serving tests to start real servers.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnkit._optional import require

SYSTEM = ("You are the friendly assistant of the municipal library of a small town. You answer questions about "
          "books, opening hours and events in a warm and helpful tone, in plain English, and you keep every "
          "answer short, clear and kind to the reader.")
TOPICS = ["a lighthouse", "a lost cat", "the first snow", "a robot gardener", "a night train", "an old map",
          "a summer storm", "a tiny dragon", "a market day", "a broken clock", "the moon", "a paper boat",
          "a quiet forest", "a city at dawn", "a letter never sent", "a mountain village"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server command started on a free 127.0.0.1 port, ready once ``health`` answers 200; ``stop()`` ends it."""

    def __init__(self, command: Sequence[str], *, port: int, log: Path, health: str = "/health",
                 timeout: float = 180.0) -> None:
        httpx = require("httpx", "The serve benchmark")
        self.port, self.url, self._log_path = port, f"http://127.0.0.1:{port}", log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(list(command), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                if httpx.get(self.url + health, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{command[0]} did not answer within {timeout} s: {self.log()[-2000:]}")

    @classmethod
    def attnkit(cls, *options: str, log: Path, threads: int | None = None) -> ServerProcess:
        """``attnkit serve`` with ``options``; with the eager decode step unless they say ``--compile`` (a background
        compile would take a core from what is measured or tested). ``threads`` defaults to this process's PyTorch
        threads: a server with more threads than its share of the cores waits on them (OpenMP's barrier) whenever
        another process holds a core; under the test suite's two workers of one thread each, that made the HTTP
        tests 3-10x slower."""
        threads = torch.get_num_threads() if threads is None else threads
        port = free_port()
        eager = [] if "--compile" in options else ["--no-compile"]
        return cls([sys.executable, "-m", "attnkit.cli", "serve", "--port", str(port), "--threads", str(threads),
                    *eager, *options], port=port, log=log)

    def log(self) -> str:
        self._log.flush()
        return self._log_path.read_text(errors="replace")

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """attnkit's /metrics as numbers, without the ``attnkit_`` prefix."""
        httpx = require("httpx", "The serve benchmark")
        values = {}
        for line in httpx.get(self.url + "/metrics", headers=headers, timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split()
                values[name.removeprefix("attnkit_")] = float(value)
        return values

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self._log.close()


@dataclass
class Stream:
    """One client's request: when it started, when its chunks arrived and when it ended, how many tokens it got
    (every choice's), and each choice's text by its index."""

    start: float
    chunks: list[float]
    tokens: int
    end: float = math.nan
    texts: dict[int, str] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start if self.chunks else float("nan")

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def chat_request(i: int) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Write a long, detailed story about {topic}."}],
            "max_tokens": 64 + (i * 37) % 65, "temperature": 0.7, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}


def stream_chat(url: str, model: str, i: int) -> Stream:
    return post_stream(url, {"model": model, **chat_request(i)})


def post_stream(url: str, body: dict[str, Any]) -> Stream:
    """One streamed chat request ``body``: its chunks' arrival, its completion tokens (usage's: every choice's)
    and each choice's text."""
    httpx = require("httpx", "The serve benchmark")
    start, chunks, tokens, texts = time.perf_counter(), [], 0, dict[int, str]()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = int(data["usage"]["completion_tokens"])
            for choice in data.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chunks.append(time.perf_counter())
                    texts[choice["index"]] = texts.get(choice["index"], "") + content
    return Stream(start, chunks, tokens or len(chunks), time.perf_counter(), texts)
