"""The generate suite's models and contenders: which file, and how each contender loads and times a generation.

A contender is named (``attnkit-<form>``, ``attnkit-<form>-compiled``,
``attnkit-<form>-kv8``, ``transformers-<dtype>``, ``llama.cpp``,
``llama.cpp-fa``) and loaded by :func:`load_contender`; every one times one
prompt (seconds to the first token, seconds for the rest) and a batch of
prompts (:class:`Contender`), reading the clock after ``torch.cuda.synchronize()``
on a GPU. The suite itself (cases, rounds, rows) is :mod:`.generate`.

Legend: B batch, T prompt tokens.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from attnkit._optional import require
from attnkit.cpu import SlowDtypeWarning
from attnkit.modules.quantize import available_forms, default_form

from . import llamacpp
from .generate_report import gemma3_targets, generate_targets

Row = dict[str, Any]
_TEXT = ("The Roman Empire was the post-Republican state of ancient Rome. It is generally understood to mean "
         "the period and territory ruled by the Romans following Octavian's assumption of sole rule under the "
         "Principate in 27 BC. It included territories in Europe, North Africa, and Western Asia, and was "
         "ruled by emperors. The fall of the Western Roman Empire in 476 AD conventionally marks the end of "
         "classical antiquity and the beginning of the Middle Ages. ")
FLASH_ATTN = {"off": "llama.cpp", "on": "llama.cpp-fa"}  # llama.cpp's flash-attention path -> contender
GEMMA3_LENGTHS = (16, 2000)  # the context lengths Gemma 3's targets are judged at
PLAIN = "float32"  # the weight form of plain nn.Linear layers: the one form that runs off the CPU


@dataclass(frozen=True)
class BenchModel:
    """A model the suite can run: where its file is, how attnkit loads it, what the suite measures on it.

    Args:
        name: the ``--model`` name.
        title: its name in messages.
        path: the GGUF file every contender loads.
        load: attnkit's model in a weight form and an activation dtype, on the CPU (``load(weights, dtype)``).
        context_length: the model's context length, from the file's metadata.
        accurate_forms: the weight forms that meet the accuracy bar on it.
        lengths: the default batch-1 context lengths.
        batch: prompts in the default batched case; 0 = batch 1 only, and no load-time or memory processes.
        pad_id: the pad token id transformers is given.
        targets: the rows' targets (``targets(rows)``).
    """

    name: str
    title: str
    path: Callable[[], Path]
    load: Callable[[str, torch.dtype], Any]
    context_length: Callable[[dict[str, Any]], int]
    accurate_forms: Callable[[], Sequence[str]]
    lengths: tuple[int, ...]
    batch: int
    pad_id: int
    targets: Callable[[Sequence[Row]], list[Row]]

    def default_forms(self) -> tuple[str, ...]:
        """attnkit's forms by default: every form this CPU runs, or (batch 1 only) float32 and the fastest
        accurate form."""
        if self.batch:
            return available_forms()
        return tuple(dict.fromkeys(("float32", self.default_form())))

    def default_form(self) -> str:
        """The fastest of its accurate forms on this CPU."""
        return default_form(self.accurate_forms())


def _smollm2_path() -> Path:
    from attnkit.models.loader import smollm2_path

    return smollm2_path()


def _smollm2_load(weights: str, dtype: torch.dtype) -> Any:
    from attnkit import models

    return models.load_smollm2(weights=weights, dtype=dtype)


def _smollm2_context(metadata: dict[str, Any]) -> int:
    from attnkit.models.loader import llama_config

    return llama_config(metadata).context_length


def _smollm2_forms() -> Sequence[str]:
    from attnkit.models.llama import LlamaModel

    return tuple(LlamaModel.accurate_forms)


def _gemma3_path() -> Path:
    from attnkit.models.gemma3 import gemma3_path

    return gemma3_path()


def _gemma3_load(weights: str, dtype: torch.dtype) -> Any:
    from attnkit import models

    return models.load_gemma3(weights=weights, dtype=dtype)


def _gemma3_context(metadata: dict[str, Any]) -> int:
    from attnkit.models.gemma3 import gemma3_config

    return gemma3_config(metadata).context_length


def _gemma3_forms() -> Sequence[str]:
    from attnkit.models.gemma3 import Gemma3Model

    return tuple(Gemma3Model.accurate_forms)


MODELS: dict[str, BenchModel] = {
    # each model's targets are judged on attnkit's default form there: the fastest of its accurate forms
    "smollm2": BenchModel(name="smollm2", title="SmolLM2-135M", path=_smollm2_path, load=_smollm2_load,
                          context_length=_smollm2_context, accurate_forms=_smollm2_forms,
                          lengths=(16, 4000, 7900), batch=8, pad_id=2,
                          targets=lambda rows: generate_targets(rows, default_form(_smollm2_forms()))),
    "gemma3": BenchModel(name="gemma3", title="Gemma 3 270M", path=_gemma3_path, load=_gemma3_load,
                         context_length=_gemma3_context, accurate_forms=_gemma3_forms, lengths=GEMMA3_LENGTHS,
                         batch=0, pad_id=0,
                         targets=lambda rows: gemma3_targets(rows, default_form(_gemma3_forms()), GEMMA3_LENGTHS)),
}


COMPILED = "-compiled"  # the suffix of a contender running the compiled decoding step
KV8 = "-kv8"  # the suffix of a contender decoding over the int8 KV cache (generate(kv_dtype="int8"))


def device_type(device: str) -> str:
    """"cpu" or "cuda" for a device name ("cuda:1" too); a ValueError naming any other."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got device={device!r}") from err
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"the generate suite runs on 'cpu' or 'cuda' (or 'cuda:N'), got device={device!r}")
    return kind


def sync(device: str) -> None:
    """Wait for the work queued on ``device`` (CUDA runs asynchronously): before every clock read."""
    if device_type(device) == "cuda":
        torch.cuda.synchronize(torch.device(device))


def prompt_ids(tokenizer: Any, length: int, offset: int = 0) -> list[int]:
    """``length`` ids of the fixed text (repeated as needed), from its ``offset``-th token; a tokenizer that
    puts BOS before every text gets it once, first."""
    ids = tokenizer.encode(_TEXT)
    bos = getattr(tokenizer, "bos_id", None)
    head = ids[:1] if getattr(tokenizer, "add_bos", False) and ids[:1] == [bos] else []
    body, n = ids[len(head) :], length - len(head)
    reps = -(-(n + offset) // len(body))
    return head + (body * reps)[offset : offset + n]


def time_steps(start_steps: Callable[[], Iterator[Any]], device: str) -> tuple[float, float]:
    """Seconds to the first step of the generation ``start_steps()`` begins (its checks and prefill included),
    and seconds for the rest of its steps, read after the device finishes each part."""
    sync(device)
    start = time.perf_counter()
    steps = start_steps()
    next(steps)
    sync(device)
    first = time.perf_counter()
    for _ in steps:
        pass
    sync(device)
    return first - start, time.perf_counter() - first


class Contender(Protocol):
    """One way to generate, timed by the suite."""

    def single(self, ids: Sequence[int], new_tokens: int) -> tuple[float, float]:
        """Seconds to the first new token of one prompt, and seconds for the other ``new_tokens - 1``."""
        ...

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        """Seconds to generate ``new_tokens`` for every prompt (of equal length)."""
        ...


def token_ids(rows: Sequence[Sequence[int]], device: str) -> torch.Tensor:
    """Prompts of equal length as a (B, T) long tensor, made on ``device``."""
    return torch.tensor([list(row) for row in rows], dtype=torch.long, device=device)  # (B, T)


@dataclass
class Attnkit:
    """attnkit's generation loop (:mod:`attnkit.models.generation`) on a loaded model (on ``device``)."""

    model: Any
    compile: bool = False  # the compiled decoding step
    device: str = "cpu"
    kv_dtype: str | None = None  # the KV cache's storage (generate's kv_dtype)

    def single(self, ids: Sequence[int], new_tokens: int) -> tuple[float, float]:
        from attnkit.models.generation import generate_steps

        return time_steps(lambda: generate_steps(self.model, token_ids([ids], self.device), max_new_tokens=new_tokens,
                                                 stop_ids=[], compile=self.compile, kv_dtype=self.kv_dtype),
                          self.device)  # (1, T)

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        ids = token_ids(prompts, self.device)  # (B, T)
        sync(self.device)
        start = time.perf_counter()
        self.model.generate(ids, torch.ones_like(ids), max_new_tokens=new_tokens, stop_ids=[], compile=self.compile,
                            kv_dtype=self.kv_dtype)
        sync(self.device)
        return time.perf_counter() - start


class _Clock:
    """A transformers streamer that notes when each ``put`` comes: the prompt first, then every new token
    (each once ``device`` has finished the work queued before it)."""

    def __init__(self, device: str = "cpu") -> None:
        self.times: list[float] = []
        self.device = device

    def put(self, _: object) -> None:
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class Transformers:
    """transformers' ``generate`` (greedy, exactly ``new_tokens`` new tokens), its model on ``device``."""

    model: Any
    pad_id: int = 2
    device: str = "cpu"

    def _generate(self, ids: torch.Tensor, new_tokens: int, streamer: _Clock | None = None) -> None:
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=self.pad_id,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer)

    def single(self, ids: Sequence[int], new_tokens: int) -> tuple[float, float]:
        clock = _Clock(self.device)
        sync(self.device)
        start = time.perf_counter()
        self._generate(token_ids([ids], self.device), new_tokens, clock)  # (1, T)
        if len(clock.times) != new_tokens + 1:
            raise RuntimeError(f"transformers streamed {len(clock.times) - 1} tokens, expected {new_tokens}")
        return clock.times[1] - start, clock.times[-1] - clock.times[1]

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        sync(self.device)
        start = time.perf_counter()
        self._generate(token_ids(prompts, self.device), new_tokens)  # (B, T)
        sync(self.device)
        return time.perf_counter() - start


def load_transformers(model: str = "smollm2", device: str = "cpu", dtype: str = "float32") -> Any:
    """transformers' model (LlamaForCausalLM, Gemma3ForCausalLM) from the same GGUF file, in ``dtype`` on
    ``device``."""
    transformers = require("transformers", "The generate benchmark's transformers contender")
    path = MODELS[model].path()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=getattr(torch, dtype))
    return (loaded if device_type(device) == "cpu" else loaded.to(device)).eval()


def load_contender(model: str, name: str, context: int, threads: int, device: str = "cpu",
                   dtype: str = "float32") -> Contender:
    """A contender by name, on ``model``: attnkit and transformers on ``device`` (in ``dtype`` there: on CUDA an
    attnkit name gives the dtype, the weights being plain); llama.cpp with ``context`` positions."""
    spec, cpu = MODELS[model], device_type(device) == "cpu"
    if name.startswith("attnkit-"):
        form = name.removeprefix("attnkit-").removesuffix(COMPILED).removesuffix(KV8) if cpu else PLAIN
        with warnings.catch_warnings():
            if not cpu:  # built on the CPU to run on the GPU: the CPU's bfloat16 speed does not matter
                warnings.simplefilter("ignore", SlowDtypeWarning)
            loaded = spec.load(form, getattr(torch, dtype))
        return Attnkit(loaded if cpu else loaded.to(device), compile=name.endswith(COMPILED), device=device,
                       kv_dtype="int8" if name.endswith(KV8) else None)
    if name.startswith("transformers-"):
        return Transformers(load_transformers(model, device, dtype), pad_id=spec.pad_id, device=device)
    return llamacpp.LlamaCpp(spec.path(), threads=threads, context=context, flash_attn=name == FLASH_ATTN["on"])


def decode_bound_seconds(model: Any, repeats: int = 5) -> float:
    """Median seconds of one matrix-vector product with every weight matrix (the head included), in the
    weights' dtype on their device."""
    # every matrix as (out, in) rows, the layout F.linear uses (attnkit keeps some transposed, which reads faster)
    mats = [(p.t() if n.endswith("weight_t") else p).contiguous() for n, p in model.named_parameters() if p.dim() == 2]
    vecs = [torch.randn(1, m.shape[1], dtype=m.dtype, device=m.device) for m in mats]
    device = str(mats[0].device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            for m, v in zip(mats, vecs, strict=True):
                torch.nn.functional.linear(v, m)  # (1, in) -> (1, out)
            sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
