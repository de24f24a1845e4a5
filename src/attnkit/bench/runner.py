"""Running benchmark cases: build, warm up, time, and measure memory in a fresh process.

Cases of one mode and size form a group, and a group is timed in rounds:
each round calls every case once, in an order that rotates from round to
round, so a slow spell of a shared machine falls on all of them alike and
their ratios stay fair. Times are wall-clock medians of ``repeats`` rounds
after ``warmup`` (CUDA is synchronised around each call). Peak extra memory
is measured in a new Python process per case (:mod:`.memory`), so one case's
allocations never colour another's.

Legend: B batch, T tokens, C model width, H heads, D head dim.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit.modules import MultiHeadAttention

from .cases import Case
from .contenders import CONTENDERS


@dataclass
class Result:
    case: Case
    status: str = "ok"  # "ok", "skipped" or "error"
    reason: str = ""
    times_ms: list[float] = field(default_factory=list)
    peak_mib: float | None = None
    flops: float | None = None  # per call; training counts forward x 3

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def gflops(self) -> float | None:
        return None if self.flops is None or not self.times_ms else self.flops / self.median_ms / 1e6

    def to_dict(self) -> dict[str, Any]:
        ok = self.status == "ok" and self.times_ms
        contender = CONTENDERS.get(self.case.contender)
        return {**json.loads(self.case.to_json()), "kind": contender.kind if contender else None,
                "status": self.status, "reason": self.reason,
                "times_ms": self.times_ms, "median_ms": self.median_ms if ok else None,
                "min_ms": min(self.times_ms) if ok else None, "max_ms": max(self.times_ms) if ok else None,
                "peak_mib": self.peak_mib, "flops": self.flops, "gflops": self.gflops if ok else None}


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's CPU threads set to ``threads`` inside the block, the caller's count restored after (the row
    suites run at ``--threads``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def flops(case: Case) -> float | None:
    """Model FLOPs of one call: projections and causal attention (counted as half).

    Training counts forward x 3 (backward ~ twice the forward); decoding is not counted.
    """
    b, t, c = case.batch, case.seq_len, case.d_model
    attention = 4 * b * t * t * c / 2  # q k^T and weights @ v, half of (T, T) under the causal mask
    if case.mode == "decode":
        return None
    contender = CONTENDERS.get(case.contender)
    if contender is not None and contender.kind == "core":
        forward = attention
    else:
        forward = 2 * b * t * c * 3 * c + 2 * b * t * c * c + attention  # qkv and out projections
    return forward * (3 if case.mode == "training" else 1)


def estimated_bytes(case: Case) -> float:
    """A rough peak for contenders that hold (B, H, T, T) scores: three copies forward, six for training."""
    contender = CONTENDERS.get(case.contender)
    if contender is None or case.mode not in contender.materializes:
        return 0.0
    itemsize = torch.tensor([], dtype=getattr(torch, case.dtype)).element_size()
    copies = 6 if case.mode == "training" else 3
    return copies * case.batch * case.num_heads * case.seq_len**2 * itemsize


def _reference(case: Case) -> MultiHeadAttention:
    torch.manual_seed(0)
    layer = MultiHeadAttention(case.d_model, case.d_model, case.num_heads, qkv_bias=True)
    return layer.to(device=case.device, dtype=getattr(torch, case.dtype)).train(case.mode == "training")


def prepare(case: Case) -> tuple[Callable[[], Any], int]:
    """The timed callable of ``case`` and how many tokens (decode) or calls it stands for."""
    reference, dtype = _reference(case), getattr(torch, case.dtype)
    gen = torch.Generator(device=case.device).manual_seed(1)
    contender = CONTENDERS[case.contender]
    if contender.kind == "decode":
        x = torch.randn(case.batch, case.seq_len + 1, case.d_model, generator=gen, device=case.device, dtype=dtype)
        with torch.no_grad():
            step = contender.build(reference, case.seq_len, x)
        return _no_grad(step), contender.per_call
    run = contender.build(reference, case.seq_len)
    training = case.mode == "training"
    shapes = [(case.batch, case.num_heads, case.seq_len, case.head_dim)] * 3 if contender.kind == "core" \
        else [(case.batch, case.seq_len, case.d_model)]
    inputs = [torch.randn(s, generator=gen, device=case.device, dtype=dtype, requires_grad=training) for s in shapes]
    if training:
        return (lambda: run(*inputs).sum().backward()), 1
    return _no_grad(lambda: run(*inputs)), 1


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        with torch.no_grad():
            return fn()

    return call


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def time_group(cases: Sequence[Case], *, repeats: int = 5, warmup: int = 1) -> dict[Case, list[float] | str]:
    """Milliseconds per call (per token when decoding) of each case, timed in interleaved rounds.

    A case that fails to build or run maps to its error message instead.
    """
    ready: dict[Case, tuple[Callable[[], Any], int]] = {}
    out: dict[Case, list[float] | str] = {}
    for case in cases:
        try:
            ready[case] = prepare(case)
            for _ in range(warmup):
                ready[case][0]()
        except (RuntimeError, ValueError, MemoryError) as err:
            out[case] = f"{type(err).__name__}: {err}"[:300]
    order = list(ready)
    times: dict[Case, list[float]] = {case: [] for case in order}
    for round_index in range(repeats):
        shift = round_index % max(1, len(order))
        for case in order[shift:] + order[:shift]:
            fn, per_call = ready[case]
            times[case].append(_timed(fn, case.device) / per_call)
    return {**out, **times}


def peak_memory_mib(case: Case, timeout: float = 900) -> float:
    """Peak extra memory of one call, measured by ``python -m attnkit.bench.memory`` in a new process."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # large blocks go back to the OS when freed
    proc = subprocess.run([sys.executable, "-m", "attnkit.bench.memory", case.to_json()], capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory subprocess failed: {proc.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra_bytes"]) / 2**20


def _missing(case: Case) -> str | None:
    contender = CONTENDERS.get(case.contender)
    if contender is None:
        return f"unknown contender {case.contender!r}"
    if case.mode not in contender.modes:
        return f"{case.contender} does not run in mode {case.mode!r}"
    if contender.requires is not None:
        try:
            __import__(contender.requires)
        except ImportError:
            return f"needs {contender.requires}, not installed"
    return None


def _skip_reason(case: Case, max_bytes: float) -> str | None:
    reason = _missing(case)
    if reason is None and estimated_bytes(case) > max_bytes:
        reason = f"would hold ~{estimated_bytes(case) / 2**30:.0f} GiB of scores (limit {max_bytes / 2**30:.0f})"
    return reason


def run_group(cases: Sequence[Case], *, repeats: int, warmup: int, memory: bool, max_bytes: float) -> list[Result]:
    """Results of cases that share a mode and size: skipped ones say why; the rest timed together."""
    results = {c: Result(c, status="skipped", reason=r) for c in cases if (r := _skip_reason(c, max_bytes))}
    timed = time_group([c for c in cases if c not in results], repeats=repeats, warmup=warmup)
    for case, outcome in timed.items():
        if isinstance(outcome, str):
            results[case] = Result(case, status="error", reason=outcome)
            continue
        results[case] = Result(case, times_ms=outcome, flops=flops(case))
        if memory:
            try:
                results[case].peak_mib = peak_memory_mib(case)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                results[case].reason = f"memory not measured: {err}"[:300]
    return [results[c] for c in cases]


def run_case(case: Case, *, repeats: int, warmup: int, memory: bool, max_bytes: float) -> Result:
    return run_group([case], repeats=repeats, warmup=warmup, memory=memory, max_bytes=max_bytes)[0]


def group_cases(cases: Sequence[Case]) -> list[list[Case]]:
    """Cases by (mode, batch, length, dtype, device), in order of first appearance."""
    groups: dict[tuple[Any, ...], list[Case]] = {}
    for c in cases:
        groups.setdefault((c.mode, c.batch, c.seq_len, c.dtype, c.device), []).append(c)
    return list(groups.values())


def matmul_gflops(dtype: str = "float32", device: str = "cpu", size: int = 2048, repeats: int = 7) -> float:
    """This machine's measured rate for one (size x size) @ (size x size) product."""
    a = torch.randn(size, size, dtype=getattr(torch, dtype), device=device)
    b = torch.randn(size, size, dtype=getattr(torch, dtype), device=device)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_record() -> dict[str, str]:
    """The CPU's name and the vector capability PyTorch's kernels use on it ("AVX2", "AVX512", ...).

    Every benchmark records both: two machines sold under one CPU name can
    report different capabilities, and their numbers are then not comparable.
    """
    return {"cpu": _cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def environment(device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    """What a benchmark ran on: device, dtype, threads, versions, the CPU (name and capability) and its cores."""
    env = {"device": device, "dtype": dtype, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "python": platform.python_version(), **cpu_record(), "cpu_count": os.cpu_count()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env
