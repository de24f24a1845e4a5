"""A real ``attnkit serve`` process on a free 127.0.0.1 port, for tests that talk to it over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``attnkit serve`` with the given options; ``url``, ``log()``, and ``stop()`` (bounded in time)."""

    def __init__(self, *options: str, log: Path, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen([sys.executable, "-m", "attnkit.cli", "serve", "--port", str(self.port),
                                      "--threads", "2", *options], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"attnkit serve exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"attnkit serve did not answer within {timeout} s: {self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self._log_path.read_text()

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        values = {}
        for line in text.splitlines():
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
