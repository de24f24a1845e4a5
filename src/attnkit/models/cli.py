"""``attnkit generate``: a real decoder (SmolLM2-135M-Instruct, Gemma 3 270M) continuing a prompt in the terminal.

    attnkit generate "Once upon a time"
    attnkit generate --chat "What is the capital of France?"
    attnkit generate --model gemma3 "The capital of France is"   # a base model: it continues text, no --chat
    attnkit generate --cache sink:4,1020 --max-new-tokens 20000 "Once upon a time"   # constant memory
    attnkit generate --threads 2 --device cuda "Hello"   # options shared with chat and serve

Text streams to stdout; loading progress, speed (tokens/s) and notes go to stderr.

Here: generate's parser and the options it shares with ``attnkit chat`` (:mod:`attnkit.serve.chat_cli`, a
conversation over the serving engine); loading and streaming, :mod:`attnkit.models.terminal`; the options
shared with serve, :mod:`attnkit.models.runtime_options`. Imports stay light: torch and the model load only
when a command runs.
"""

from __future__ import annotations

import argparse

from attnkit.models.runtime_options import MODELS, add_runtime_options, set_threads
from attnkit.models.terminal import (
    chat_ids,
    check_options,
    gguf_tokenizer,
    load_model,
    report_speed,
    stderr_console,
    stream_answer,
    tell_ending,
)


def add_generation_options(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """The options ``generate`` and ``chat`` share: sampling, the model and its form, the runtime's."""
    from attnkit.modules.quantize import WEIGHT_FORMS

    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"the most tokens to generate per answer (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with probability >= p, "
                   "p in (0, 1]")
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same text)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the logits of tokens already in the prompt or the answer by R (transformers' and "
                   "llama.cpp's; 1 = off, the default; 1.1 to 1.3 stops a greedy answer looping)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: subtract F per earlier occurrence in the answer, in [-2, 2] (default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="OpenAI's: subtract P from every token the answer holds, in [-2, 2] (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute type (default float32; BENCHMARKS.md has the speed of each)")
    p.add_argument("--weights", choices=list(WEIGHT_FORMS),
                   help="the form of the weights with float32 compute (fewer bytes: each token reads them all); "
                   "default: the fastest form that meets the accuracy bar on this CPU (said at load); with "
                   "--dtype bfloat16 the weights stay plain bfloat16")
    p.add_argument("--model", choices=list(MODELS), help="the packaged model (default smollm2): "
                   + "; ".join(f"{name}: {what}" for name, what in MODELS.items()))
    p.add_argument("--gguf", metavar="FILE", help="a GGUF file of any registered architecture instead of a "
                   "packaged model (attnkit models lists what is found)")
    add_runtime_options(p)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand (``chat``'s is :func:`attnkit.serve.chat_cli.add_parser`)."""
    p = sub.add_parser("generate", help="continue a prompt with a real language model (SmolLM2-135M, Gemma 3)",
                       description="Stream the continuation of PROMPT from SmolLM2-135M-Instruct (or --model "
                       "gemma3: Gemma 3 270M), running on attnkit's attention with a KV cache. Speed is reported "
                       "on stderr; Ctrl-C stops (exit 130).")
    p.add_argument("prompt", nargs="+", help="the text to continue")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template "
                   "(a user turn) and answer it (not with --model gemma3: a base model has no chat template)")
    add_generation_options(p, max_new_tokens=128)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    check_options(args, chat=args.chat)
    text = " ".join(args.prompt)
    if not text.strip():
        raise ValueError("the prompt is empty: give some text to continue")
    set_threads(args)
    console = stderr_console()
    model = load_model(args, console)
    if args.chat:
        ids = chat_ids(gguf_tokenizer(model), [{"role": "user", "content": text}])
    else:
        ids = model.tokenize(text)["input_ids"][0].tolist()
    answer = stream_answer(model, ids, args)
    if answer.ending == "interrupted":
        return 130
    tell_ending(console, answer, args, model.context_length)
    report_speed(console, answer.stats)
    return 0
