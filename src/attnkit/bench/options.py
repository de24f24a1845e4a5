"""The options of ``attnkit bench``: the values (:class:`Options`), the flags the suites read
(:func:`add_suite_options`), and the device check they share (:func:`check_device`).

The suites read their options from here (``GenerateSuite.from_options``,
``python -m attnkit.bench.generate``); :mod:`.command`, which runs the suites,
adds the choice of suite (``--suite``, ``--quick``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class Options:
    """The options of ``attnkit bench``, named as its flags (``--seq-lens`` is ``seq_lens``)."""

    suite: str = "full"
    contenders: list[str] | None = None
    modes: list[str] | None = None
    batch: list[int] | None = None
    seq_lens: list[int] | None = None
    repeats: int = 5
    warmup: int = 1
    no_memory: bool = False
    baseline: str = "attnkit"
    max_memory_gib: float = 8.0
    device: str = "cpu"
    dtype: str = "float32"
    out: str = "bench-out"
    forms: list[str] | None = None
    compiled: list[str] | None = None
    kv_int8: list[str] | None = None
    new_tokens: int = 128
    threads: int = 2
    no_transformers: bool = False
    no_llamacpp: bool = False
    llamacpp_fa: str = "both"
    model: str = "smollm2"

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> Options:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _csv(kind: type) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            items = [kind(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {text!r}") from err
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
        return items

    return parse


def add_suite_options(p: argparse.ArgumentParser) -> None:
    """The flags of ``attnkit bench`` that the suites read (all but which suite: :func:`.command.add_arguments`),
    added to ``p``."""
    p.add_argument("--contenders", type=_csv(str), help="comma-separated contenders (filter, or grid for custom)")
    p.add_argument("--modes", type=_csv(str), help="inference, training, decode")
    p.add_argument("--batch", type=_csv(int), help="batch sizes, e.g. 1,8 (generate: 1 = the batch-1 cases, "
                   "another size = the batched case's prompts; default 1,8; serve: the numbers of concurrent "
                   "clients, default 1,4,16,64)")
    p.add_argument("--seq-lens", "--lengths", type=_csv(int),
                   help="sequence lengths (context lengths for decode; generate: batch-1 prompt lengths, "
                   "default 16,4000,7900; gemma3: 16,2000; mods: L or L,S, its long and short lengths, "
                   "default 8192,2048)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5; serve: rounds of the "
                   "n = 4 and JSON schema requests beside plain sampling)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses "
                   "(generate: the load-time and memory processes)")
    p.add_argument("--baseline", default="attnkit", help="layer contender the ratios divide by (default attnkit)")
    p.add_argument("--max-memory-gib", type=float, default=8.0,
                   help="skip cases whose (T, T) scores would need more (default 8)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="float32 (default); generate: float32 on the CPU, the activation dtype with --device cuda")
    p.add_argument("--out", default="bench-out", help="folder for results.json, summary.md and plots")
    generate = p.add_argument_group("the generate suite")
    generate.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2",
                          help="the model: smollm2 (default; every case) or gemma3 (batch 1 at 16 and 2000 tokens, "
                          "attnkit float32 and its fastest accurate form, transformers, llama.cpp)")
    generate.add_argument("--forms", type=_csv(str), help="attnkit weight forms, e.g. float32,int4 "
                          "(default: every form this CPU runs; --device cuda: float32 only, the plain weights in "
                          "--dtype)")
    generate.add_argument("--compiled", type=_csv(str), help="weight forms to run also with the compiled "
                          "decoding step (generate(compile=True)), e.g. int4; compiled in the warm-up rounds")
    generate.add_argument("--kv-int8", type=_csv(str), help="weight forms to run also over the int8 KV cache "
                          "(generate(kv_dtype='int8')), e.g. int4; CPU only")
    generate.add_argument("--new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    generate.add_argument("--threads", type=int, default=2, help="threads of every contender (default 2)")
    generate.add_argument("--no-transformers", action="store_true", help="leave transformers out")
    generate.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    generate.add_argument("--llamacpp-fa", choices=["off", "on", "both"], default="both",
                          help="llama.cpp's flash attention: off (llama-cpp-python's default), on, or both as two "
                          "contenders (default)")


def check_device(device: str) -> None:
    """Raise a one-line ValueError unless torch can put a tensor on ``device``."""
    try:
        where = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a device torch knows ({err})") from err
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch {torch.__version__} sees no CUDA device "
                         "(torch.cuda.is_available() is False); use --device cpu")
    try:
        torch.empty(0, device=where)
    except (RuntimeError, AssertionError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--device {device} cannot be used: {first}") from err
