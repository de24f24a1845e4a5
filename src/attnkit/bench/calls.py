"""Python calls in one decode step of SmolLM2, per decoder layer: what the framework costs besides the kernels;
and the files of attnkit a serving engine's decode step crosses.

    python -m attnkit.bench.calls            # growing and static caches, batch 1, as a table
    python -m attnkit.bench.calls --json     # the same as JSON
    python -m attnkit.bench.calls --graph    # also the files of a serving step in graph mode (compiles: ~1 min)

Counted with ``sys.setprofile``: every function called from Python, Python
functions and C ones alike ("call" and "c_call" events: a torch op called from
Python counts once, what it runs inside does not) during one ``model.step`` of one new
token after a 16-token prompt, divided by the number of layers. The model is a
random SmolLM2-shaped Llama (30 layers, float32): the count depends on the code
path, not on the weights, so no model file is needed.

The files a serving step crosses are counted twice with ``--graph``: with the
eager step, and in graph mode (the server's default), where the model's code
runs inside one compiled function (:mod:`attnkit.serve.graph`) and Python
crosses only what schedules, feeds and samples the step. The graph-mode count
compiles a 2-layer model of the same shapes (the files do not depend on the
number of layers; the compile does), its compiled step kept in a scratch
folder (Inductor's kernels too, unless ``TORCHINDUCTOR_CACHE_DIR`` names a
folder already).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

PROMPT = 16


def _model(num_layers: int = 30) -> Any:
    from attnkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, context_length=256, num_layers=num_layers)  # SmolLM2's layers
    return LlamaModel(config).eval()


def count_step(model: Any, static: bool) -> tuple[int, Counter[str]]:
    """Python calls (and the functions called, by file:name) in one decode step after a 16-token prompt."""
    caches = model.new_caches(64, static=static)
    ids = torch.randint(0, model.vocab_size, (1, PROMPT))
    positions = torch.arange(PROMPT)[None] if static else None
    with torch.inference_mode():
        model.step(ids, positions, caches)  # prefill (not counted)
        token = torch.randint(0, model.vocab_size, (1, 1))
        at = torch.tensor([[PROMPT]]) if static else None
        model.step(token, at, caches)  # one step to warm every path once
        at = torch.tensor([[PROMPT + 1]]) if static else None
        seen: Counter[str] = Counter()

        def profile(frame: FrameType, event: str, arg: object) -> None:
            if event == "call":
                seen[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
            elif event == "c_call":
                seen[f"{getattr(arg, '__qualname__', type(arg).__name__)} (C)"] += 1

        sys.setprofile(profile)
        try:
            model.step(token, at, caches)
        finally:
            sys.setprofile(None)
    return sum(seen.values()), seen


def engine_step_files(model: Any, compiled: bool = False) -> list[str]:
    """attnkit's source files (relative to the package) whose code runs in one decoding step of the serving
    engine (``Engine.step``, one request decoding after a 16-token prompt), in the order first reached;
    ``compiled``: in graph mode, once the compiled step is ready (its compile kept in a scratch folder)."""
    from attnkit.models.generation_options import GenerationOptions
    from attnkit.serve import Engine
    from attnkit.serve.compile_cache import CompileCache

    kernels = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # the compile cache may point it into the scratch folder
    with tempfile.TemporaryDirectory() as scratch, _restored("TORCHINDUCTOR_CACHE_DIR", kernels):
        cache = CompileCache.for_model(model, torch.float32, Path(scratch)) if compiled else None
        engine = Engine(model, lambda ids: "", kv_memory_mib=8, block_size=16, max_batch=2, compile=compiled,
                        compile_cache=cache)
        if compiled and not engine.wait_compiled(timeout=900):
            raise RuntimeError(f"the decode step did not compile: {engine.compile_status()}")
        engine.submit(list(range(1, PROMPT + 1)), GenerationOptions(max_new_tokens=8), lambda event: None)
        with torch.inference_mode():
            engine.step()  # the prefill and the first token
            engine.step()  # one decoding step to warm every path once
            files: dict[str, None] = {}

            def profile(frame: FrameType, event: str, arg: object) -> None:
                name = frame.f_code.co_filename
                if event == "call" and "/attnkit/" in name and "/attnkit/bench/" not in name:  # not this callback
                    files.setdefault(name.rsplit("/attnkit/", 1)[-1], None)

            sys.setprofile(profile)
            try:
                engine.step()
            finally:
                sys.setprofile(None)
        if compiled and engine.compile_status().get("steps", 0) < 2:
            raise RuntimeError(f"the counted step did not run compiled: {engine.compile_status()}")
    return list(files)


@contextlib.contextmanager
def _restored(name: str, value: str | None) -> Iterator[None]:
    """Set the environment variable ``name`` back to ``value`` (None: unset) on the way out."""
    try:
        yield
    finally:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.calls", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--top", type=int, default=0, help="also list the N most called functions")
    parser.add_argument("--graph", action="store_true", help="also count the files of a serving step in graph "
                        "mode (compiles a 2-layer model first)")
    args = parser.parse_args(argv)
    model = _model()
    layers = len(model.layers)
    rows: dict[str, dict[str, Any]] = {}
    for name, static in (("growing", False), ("static", True)):
        total, seen = count_step(model, static)
        rows[name] = {"calls_per_step": total, "calls_per_layer": total / layers,
                      "top": seen.most_common(args.top)}
    capability = str(torch.backends.cpu.get_cpu_capability())
    files = engine_step_files(model)
    graph = engine_step_files(_model(num_layers=2), compiled=True) if args.graph else None
    if args.json:
        print(json.dumps({"layers": layers, "cpu_capability": capability, "torch": torch.__version__, **rows,
                          "engine_step_files": files, "graph_step_files": graph}))
        return
    print(f"Python calls in one decode step, batch 1, {layers} layers (torch {torch.__version__}, {capability})")
    for name, row in rows.items():
        print(f"  {name:8} cache: {row['calls_per_step']:6d} per step, {row['calls_per_layer']:6.1f} per layer")
        for function, n in row["top"]:
            print(f"      {n:6d}  {function}")
    print(f"attnkit files one serving engine decode step crosses: {len(files)}")
    print("  " + ", ".join(files))
    if graph is not None:
        print(f"the same in graph mode (the server's default): {len(graph)}")
        print("  " + ", ".join(graph))


if __name__ == "__main__":
    main()
