"""Where ``attnkit serve``'s process spends the GIL while it streams one answer: py-spy (``pip install py-spy``)
sampling the server's threads, GIL holders only.

    OMP_NUM_THREADS=2 python docs/bench/round19-thread/spy.py OUT_FILE

SmolLM2-135M-Instruct in its default form, ``--no-compile``, 2 threads; a warm-up request, then py-spy records 8 s
at 200 samples/s (``--threads --gil``, raw collapsed stacks to OUT_FILE) while the serving suite's first chat
request streams 400 greedy tokens. Prints the request's decode rate.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnkit.bench.serve_client import ServerProcess, chat_request, post_stream


def main() -> None:
    out = sys.argv[1]
    with tempfile.TemporaryDirectory() as work:
        server = ServerProcess.attnkit("--max-batch", "4", log=Path(work) / "server.log", threads=2)
        try:
            body = {**chat_request(0), "model": "smollm2", "max_tokens": 400, "temperature": 0}
            post_stream(server.url, body)  # warm-up
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                    str(server.proc.pid), "-d", "8", "-r", "200", "--format", "raw", "-o", out,
                                    "--threads", "--gil"])
            time.sleep(1)
            stream = post_stream(server.url, body)
            print("decode tokens/s", (len(stream.chunks) - 1) / (stream.chunks[-1] - stream.chunks[0]))
            spy.wait()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
