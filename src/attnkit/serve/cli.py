"""``attnkit serve``: a decoder behind an OpenAI-compatible HTTP API, with a chat page at ``/``.

    attnkit serve                          # SmolLM2-135M-Instruct on http://127.0.0.1:8000
    attnkit serve --model gemma3           # Gemma 3 270M: a base model, for /v1/completions
    attnkit serve --gguf model.gguf --port 9000 --api-key secret

Imports stay light: torch, the model and FastAPI load only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

from attnkit._optional import require


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    from attnkit.models.cli import MODELS
    from attnkit.modules.quantize import WEIGHT_FORMS

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
                       description="Serve SmolLM2-135M-Instruct (or Gemma 3 270M, or a GGUF file) with continuous "
                       "batching over a "
                       "paged KV cache: POST /v1/chat/completions, /v1/completions; GET /v1/models, /v1/models/{id}, "
                       "/health, /metrics; a chat page at /. Binds 127.0.0.1 unless --host says otherwise.")
    p.add_argument("--model", choices=list(MODELS), help="the packaged model (default smollm2): "
                   + "; ".join(f"{name}: {what}" for name, what in MODELS.items())
                   + ". A base model has no chat template: it serves /v1/completions")
    p.add_argument("--gguf", metavar="FILE", help="a Llama- or Gemma 3-architecture GGUF file instead of a "
                   "packaged model")
    p.add_argument("--weights", choices=list(WEIGHT_FORMS),
                   help="the form of the weights, float32 activations (fewer bytes: each token reads them all); "
                   "default: the fastest form that meets the accuracy bar on this CPU (printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=16, help="most requests decoded together (default 16)")
    p.add_argument("--kv-memory", type=float, default=512, metavar="MiB",
                   help="memory for the KV cache of every layer, in MiB (default 512)")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the dtype KV blocks store keys and values in (default float32): bfloat16 or float16 fit "
                   "twice the positions in --kv-memory")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block (default 16)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="most requests waiting; more get HTTP 429 (default 256)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health and /")
    p.add_argument("--threads", type=int, help="CPU threads for PyTorch (default: PyTorch's choice)")
    p.set_defaults(func=_serve)


def _check(args: argparse.Namespace) -> None:
    if args.gguf is not None and args.model is not None:
        raise ValueError(f"--model {args.model} and --gguf name two models: give one")
    for name in ("max_batch", "block_size", "max_waiting"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_memory <= 0:
        raise ValueError(f"--kv-memory must be > 0 MiB, got {args.kv_memory}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")


def _serve(args: argparse.Namespace) -> int:
    _check(args)
    uvicorn = require("uvicorn", "attnkit serve")
    require("fastapi", "attnkit serve")
    import torch

    from attnkit.models.cli import packaged_path
    from attnkit.models.loader import load_gguf
    from attnkit.modules.quantize import weight_form

    from .api import Server, create_app
    from .engine import Engine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = args.gguf or packaged_path(args.model or "smollm2")
    model = load_gguf(path, weights=args.weights or "auto")  # auto: the fastest accurate form for the architecture
    weights = weight_form(model)
    name = (args.model or "smollm2") if args.gguf is None else str(path).rsplit("/", 1)[-1].removesuffix(".gguf")
    engine = Engine(model, model.decode, kv_memory_mib=args.kv_memory, block_size=args.block_size,
                    max_batch=args.max_batch, max_waiting=args.max_waiting,
                    kv_dtype=None if args.kv_dtype == "float32" else args.kv_dtype)
    engine.start()
    server = Server(engine, model.tokenizer, model_name=name, api_key=args.api_key,
                    context_length=model.context_length)
    print(f"attnkit serve: {name} ({weights} weights, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}) on http://{args.host}:{args.port} "
          f"({engine.blocks.num_blocks} {args.kv_dtype} KV blocks of {args.block_size} positions)", file=sys.stderr,
          flush=True)
    try:
        uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0
