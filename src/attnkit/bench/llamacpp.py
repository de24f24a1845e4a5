"""llama.cpp as a contender of the generate suite, through llama-cpp-python (optional, built from source).

:class:`LlamaCpp` runs the same GGUF file as attnkit with the same thread
count, fed the same token ids, choosing greedily with llama.cpp's own
sampler: batch 1 (seconds to the first token, then seconds for the rest) and
several prompts one after another (llama-cpp-python serves one sequence at a
time).

This module imports nothing but the standard library (llama_cpp only when
used, torch never): run as a script it measures llama.cpp's load time and
memory in a fresh process that holds nothing else (:func:`main`). The
fresh-process harness (:func:`measure_process`) is shared by every contender
of the suite for the same reason.

    python src/attnkit/bench/llamacpp.py MODEL.gguf THREADS FLASH_ATTN IDS NEW_TOKENS START
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

VERSION = "0.3.36"  # the release the suite was written and measured with
INSTALL = (f'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -c constraints.txt --no-binary llama-cpp-python '
           f'"llama-cpp-python=={VERSION}"')


def missing_reason() -> str | None:
    """None when llama_cpp imports; else why llama.cpp is skipped and how to install it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        return (f"llama.cpp skipped: the optional package 'llama-cpp-python' is not installed ({err}). It is "
                f"built from source, which takes 10-25 minutes: {INSTALL} (or pip install 'attnkit[bench-llama]' "
                "with the same CMAKE_ARGS)")
    return None


def version() -> str:
    """llama-cpp-python's version and the CPU features its llama.cpp was built with ("0.3.36, AVX2 AVX512 ...")."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")  # "CPU : SSE3 = 1 | AVX = 1 | ..."
    features = [part.split("=")[0].split(":")[-1].strip() for part in info.split("|") if part.strip().endswith("= 1")]
    return f"{llama_cpp.__version__}, {' '.join(features)}"


class LlamaCpp:
    """llama.cpp on a GGUF file: greedy generation from token ids, one sequence at a time.

    Args:
        path: the GGUF file.
        threads: threads for prefill and decode alike (``n_threads``, ``n_threads_batch``).
        context: positions the context holds (its KV cache is allocated at load).
        flash_attn: llama.cpp's flash-attention path (llama-cpp-python's default: off).
    """

    def __init__(self, path: str | Path, *, threads: int, context: int, flash_attn: bool = False) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   flash_attn=flash_attn, verbose=False)
        self.context = context
        self._sampler = llama_cpp.llama_sampler_init_greedy()

    def _next(self) -> int:
        """The greedy choice after the last evaluated token."""
        return int(self._lib.llama_sampler_sample(self._sampler, self.llm.ctx, -1))

    def _run(self, ids: Sequence[int], new_tokens: int) -> tuple[float, float, list[int]]:
        """Greedy tokens after ``ids`` from an empty cache, with the seconds to the first and for the rest."""
        if len(ids) + new_tokens > self.context:
            raise ValueError(f"a prompt of {len(ids)} tokens + {new_tokens} new does not fit llama.cpp's context "
                             f"of {self.context} positions")
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(list(ids))
        out = [self._next()]
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval(out[-1:])
            out.append(self._next())
        return first - start, time.perf_counter() - first, out

    def generate(self, ids: Sequence[int], new_tokens: int) -> list[int]:
        """``new_tokens`` greedy tokens after ``ids`` (no stop token), from an empty cache."""
        return self._run(ids, new_tokens)[2]

    def single(self, ids: Sequence[int], new_tokens: int) -> tuple[float, float]:
        """Seconds to the first new token, and seconds for the other ``new_tokens - 1``."""
        to_first, rest, _ = self._run(ids, new_tokens)
        return to_first, rest

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        """Seconds to generate ``new_tokens`` for each prompt, one prompt after another."""
        start = time.perf_counter()
        for ids in prompts:
            self._run(ids, new_tokens)
        return time.perf_counter() - start

    def close(self) -> None:
        """Free the sampler and the model (llama.cpp's memory is not Python's)."""
        if self._sampler is not None:
            self._lib.llama_sampler_free(self._sampler)
            self._sampler = None
        self.llm.close()


def status_kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS now, VmHWM the peak since the last reset), in KiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def measure_process(load: Callable[[], Any], generate: Callable[[Any], object], start: float) -> dict[str, Any]:
    """In a fresh process: seconds from ``start`` (time.time() before the process was started) until
    ``load()`` returns, the resident set then, and the peak while ``generate(model)`` runs once.

    The peak counter is reset after loading, so a loader's transient buffers do
    not hide the generation's own peak (where the reset is refused, the peak
    is the process's since it started: ``peak_reset`` False).
    """
    model = load()
    ready = time.time()
    loaded = status_kib("VmRSS")
    reset = _reset_peak()
    generate(model)
    peak = status_kib("VmHWM")
    return {"load_s": round(ready - start, 3), "loaded_rss_mib": round(loaded / 1024),
            "generate_peak_mib": round(peak / 1024), "generate_extra_mib": round((peak - loaded) / 1024),
            "peak_reset": reset}


def run_measurement(argv: Sequence[str], timeout: float = 900) -> dict[str, Any]:
    """Start ``argv`` + [time.time()] (a process that prints :func:`measure_process`'s dict last) and read it."""
    done = subprocess.run([*argv, repr(time.time())], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"the measuring process exited with {done.returncode}: {last[0]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def process_command(path: str | Path, threads: int, flash_attn: bool, ids: Sequence[int], new_tokens: int) -> list[str]:
    """The command that measures llama.cpp in a fresh process (this file as a script; no torch imported)."""
    runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    return [sys.executable, "-c", runner, __file__, str(path), str(threads), str(int(flash_attn)),
            json.dumps(list(ids)), str(new_tokens)]


def main(argv: Sequence[str]) -> int:
    """Script entry: load llama.cpp, generate once, print :func:`measure_process`'s dict as JSON."""
    if len(argv) != 6:
        print("usage: llamacpp.py MODEL.gguf THREADS FLASH_ATTN IDS NEW_TOKENS START", file=sys.stderr)
        return 2
    path, threads, flash_attn, ids, new_tokens, start = argv
    prompt, new = json.loads(ids), int(new_tokens)
    context = len(prompt) + new

    def load() -> LlamaCpp:
        return LlamaCpp(path, threads=int(threads), context=context, flash_attn=flash_attn == "1")

    print(json.dumps(measure_process(load, lambda llm: llm.generate(prompt, new), float(start))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
