"""The mods suite: score and mask modifiers on the chunked kernel, beside dense masks and compiled FlexAttention.

    attnkit bench --suite mods --out docs/bench/mods
    python -m attnkit.bench.mods --quick            # small sizes, seconds

Cases, float32, shapes of SmolLM2 by default (B = 1, H = 9, G = 3, D = 64):

- ``window``: T = 8192, a causal sliding window of 256: chunked with
  ``window=256`` and with ``mask_mod=sliding_window(256)``, against the same
  call given the window as a dense bool (T, S) ``mask=`` (built here with
  ``arange``, not by attnkit);
- ``documents``: T = 8192 packed as 8 equal documents, causal within each:
  chunked with ``mask_mod=and_masks(causal(), document_mask(ids))`` and with
  ``causal=True, mask_mod=document_mask(ids)``, against plain causal chunked
  attention over the whole sequence;
- ``modifiers``: T = 2048 causal: chunked with ``score_mod=softcap(30)`` and
  with ``score_mod=alibi(H)`` against plain causal chunked (and SDPA's causal
  kernel, for scale);
- ``backward``: the same at T = 2048, forward + backward: chunked plain and
  with softcap, the math backend with softcap (a check of the chunked
  gradients), FlexAttention (it has no backward on CPU: its row carries the
  error it raises).

Compiled FlexAttention (``torch.compile(flex_attention)``, its
``create_block_mask``, the same built-in modifiers; T = S, so its top-left
positions are attnkit's) is a contender in every case; ``compile_s`` = its
first call - its median call. Compiled code is reset before each case, so
each compiles afresh (Inductor's on-disk cache may serve a rerun: env row).
A contender that fails to build, compile or run is a row with the error text
(status "error"), never a crash.

Per case, every contender is built (``setup_s``: a dense mask or block mask,
made once, outside the timed call), called once (``first_call_s``), and its
output (forward + backward: output and gradients) compared with its
reference's by ``torch.testing.assert_close``; one that disagrees is not timed
(status "wrong", the mismatch in ``reason``). Then ``warmup`` untimed calls
each, and ``repeats`` rounds calling every contender once in an order that
rotates (as :mod:`.runner`), so a slow spell of the shared machine falls on
all alike: median, min, max, and ``x_baseline`` = median / the case's
baseline's. The targets are rows too (kind "target").

Legend: B batch, H query heads, G key/value heads, T queries = S keys, D head dim.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit.backends import attention
from attnkit.functional.modifiers import alibi, and_masks, causal, document_mask, sliding_window, softcap

from .runner import cpu_record, torch_threads

Row = dict[str, Any]
Output = Tensor | tuple[Tensor, ...]
Call = Callable[[], Output]
CASES = ("window", "documents", "modifiers", "backward")
ATOL = RTOL = 1e-4  # float32 sums in other orders agree to ~1e-6; a wrong mask is off by ~0.1
CAP = 30.0  # the soft-cap (Grok-1's)
_ROW_KEYS = ("kind", "contender", "status", "median_ms", "spread_ms", "x_baseline", "setup_s", "first_call_s",
             "compile_s", "max_diff", "reason")


@dataclass(frozen=True)
class ModsSuite:
    """Sizes and settings of the suite; the defaults are the ones its targets are judged at.

    Args:
        long_len: T of the window and documents cases.
        short_len: T of the modifiers and backward cases.
        window: the sliding window of the window case.
        documents: equal documents packed into ``long_len`` positions.
        batch, num_heads, num_kv_heads, head_dim: B, H, G, D.
        repeats: timed rounds per case.
        warmup: untimed calls per contender after its first (checked) call.
        threads: torch's threads during the run.
        flex: include compiled FlexAttention.
        cases: which of :data:`CASES` to run.
    """

    long_len: int = 8192
    short_len: int = 2048
    window: int = 256
    documents: int = 8
    batch: int = 1
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    repeats: int = 3
    warmup: int = 1
    threads: int = 2
    flex: bool = True
    cases: tuple[str, ...] = CASES

    def __post_init__(self) -> None:
        for name in ("long_len", "short_len", "window", "documents", "batch", "num_heads", "num_kv_heads",
                     "head_dim", "repeats", "warmup", "threads"):
            value, low = getattr(self, name), 0 if name == "warmup" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {name}={value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
        if self.long_len % self.documents:
            raise ValueError(f"long_len={self.long_len} is not divisible by documents={self.documents}: the "
                             "documents must be of equal length")
        unknown = [c for c in self.cases if c not in CASES]
        if unknown or not self.cases:
            raise ValueError(f"cases must be some of {', '.join(CASES)}; got {self.cases!r}")

    @classmethod
    def small(cls, **fields: Any) -> ModsSuite:
        """Sizes that run in seconds (tests, ``--quick``); ``fields`` override them."""
        sizes = dict(long_len=512, short_len=256, window=64, documents=4, num_heads=3, num_kv_heads=1,
                     head_dim=16, repeats=1, warmup=0)
        return cls(**{**sizes, **fields})

    @classmethod
    def from_options(cls, options: Any) -> ModsSuite:
        """The suite ``attnkit bench --suite mods`` asks for (``options``: :class:`.options.Options`).

        ``--seq-lens L`` or ``L,S`` sets the long and short lengths; the shapes are otherwise fixed.
        """
        if options.dtype != "float32" or options.device != "cpu":
            raise ValueError(f"the mods suite runs float32 on cpu; got --dtype {options.dtype} --device "
                             f"{options.device}")
        if options.contenders or options.modes or options.batch:
            raise ValueError("the mods suite's contenders, modes and batch are fixed; --seq-lens L or L,S sets "
                             "its long (window, documents) and short (modifiers, backward) lengths")
        lengths = options.seq_lens or [cls.long_len, cls.short_len]
        if len(lengths) > 2:
            raise ValueError(f"--seq-lens takes one or two lengths for the mods suite, got {lengths}")
        return cls(long_len=lengths[0], short_len=lengths[-1], repeats=options.repeats, warmup=options.warmup,
                   threads=options.threads)


@dataclass(frozen=True)
class Contender:
    """One way to compute a case: ``build()`` makes what it needs (untimed) and returns the timed call."""

    key: str  # short name, the same at every size: what targets look up
    call: str  # the call, as a reader would write it
    build: Callable[[], Call]
    same_as: str | None = None  # key of the contender whose output this one must equal; None: a reference
    compiled: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    baseline: str  # key of the contender the ratios divide by
    contenders: tuple[Contender, ...]


def case_title(name: str, suite: ModsSuite) -> str:
    """The title of case ``name`` at ``suite``'s sizes: its rows' kind, one table each."""
    titles = {"window": f"T={suite.long_len}, sliding window {suite.window}, forward",
              "documents": f"T={suite.long_len}, {suite.documents} documents of "
                           f"{suite.long_len // suite.documents}, causal, forward",
              "modifiers": f"T={suite.short_len}, causal, score modifiers, forward",
              "backward": f"T={suite.short_len}, causal, forward+backward"}
    return titles[name]


def _inputs(suite: ModsSuite, t: int, seed: int, grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(suite.batch, suite.num_heads, t, suite.head_dim, generator=gen)  # (B, H, T, D)
    k, v = (torch.randn(suite.batch, suite.num_kv_heads, t, suite.head_dim, generator=gen)
            for _ in range(2))  # (B, G, S, D)
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad)


def _attnkit(q: Tensor, k: Tensor, v: Tensor, backend: str = "chunked", **kwargs: Any) -> Callable[[], Call]:
    return lambda: lambda: attention(q, k, v, backend=backend, **kwargs)


def _dense_window(q: Tensor, k: Tensor, v: Tensor, window: int) -> Callable[[], Call]:
    """Chunked attention told the window only through a dense bool (T, S) mask, True = may attend."""
    def build() -> Call:
        t, s = q.shape[2], k.shape[2]
        rows, cols = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]  # (T, 1), (1, S)
        mask = (cols <= rows) & (cols > rows - window)  # (T, S)
        return lambda: attention(q, k, v, mask=mask, backend="chunked")
    return build


def _flex(q: Tensor, k: Tensor, v: Tensor, mask_mod: Any, score_mod: Any = None) -> Callable[[], Call]:
    """Compiled FlexAttention with the block mask of ``mask_mod``, made once in ``build``."""
    def build() -> Call:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=str(q.device))
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    return build


def _window_case(suite: ModsSuite) -> Case:
    q, k, v = _inputs(suite, suite.long_len, seed=1)
    w = suite.window
    found = [Contender("chunked window", f"attention(causal=True, window={w})", _attnkit(q, k, v, causal=True,
                                                                                          window=w)),
             Contender("chunked mask_mod", f"attention(mask_mod=sliding_window({w}))",
                       _attnkit(q, k, v, mask_mod=sliding_window(w)), "chunked window"),
             Contender("chunked dense mask", "attention(mask=<(T, S) bool band>)", _dense_window(q, k, v, w),
                       "chunked window")]
    if suite.flex:
        found.append(Contender("flex window", f"flex_attention(block_mask=sliding_window({w}))",
                               _flex(q, k, v, sliding_window(w)), "chunked window", compiled=True))
    return Case("window", case_title("window", suite), "chunked window", tuple(found))


def _documents_case(suite: ModsSuite) -> Case:
    q, k, v = _inputs(suite, suite.long_len, seed=2)
    ids = torch.arange(suite.long_len) // (suite.long_len // suite.documents)  # (T,): each position's document
    per_doc = and_masks(causal(), document_mask(ids))
    found = [Contender("chunked causal", "attention(causal=True) over the whole sequence",
                       _attnkit(q, k, v, causal=True)),
             Contender("chunked and_masks", "attention(mask_mod=and_masks(causal(), document_mask(ids)))",
                       _attnkit(q, k, v, mask_mod=per_doc)),
             Contender("chunked causal+document", "attention(causal=True, mask_mod=document_mask(ids))",
                       _attnkit(q, k, v, causal=True, mask_mod=document_mask(ids)), "chunked and_masks")]
    if suite.flex:
        found += [Contender("flex causal", "flex_attention(block_mask=causal())", _flex(q, k, v, causal()),
                            "chunked causal", compiled=True),
                  Contender("flex documents", "flex_attention(block_mask=and_masks(causal(), document_mask(ids)))",
                            _flex(q, k, v, per_doc), "chunked and_masks", compiled=True)]
    return Case("documents", case_title("documents", suite), "chunked causal", tuple(found))


def _modifiers_case(suite: ModsSuite) -> Case:
    q, k, v = _inputs(suite, suite.short_len, seed=3)
    h = suite.num_heads
    found = [Contender("chunked causal", "attention(causal=True)", _attnkit(q, k, v, causal=True)),
             Contender("chunked softcap", f"attention(causal=True, score_mod=softcap({CAP:g}))",
                       _attnkit(q, k, v, causal=True, score_mod=softcap(CAP))),
             Contender("chunked alibi", f"attention(causal=True, score_mod=alibi({h}))",
                       _attnkit(q, k, v, causal=True, score_mod=alibi(h))),
             Contender("sdpa causal", "attention(causal=True, backend='sdpa')",
                       _attnkit(q, k, v, backend="sdpa", causal=True), "chunked causal")]
    if suite.flex:
        found += [Contender(f"flex {name}", f"flex_attention({mod}block_mask=causal())",
                            _flex(q, k, v, causal(), score), f"chunked {name}", compiled=True)
                  for name, mod, score in (("causal", "", None), ("softcap", f"score_mod=softcap({CAP:g}), ",
                                                                  softcap(CAP)),
                                           ("alibi", f"score_mod=alibi({h}), ", alibi(h)))]
    return Case("modifiers", case_title("modifiers", suite), "chunked causal", tuple(found))


def _with_grads(build: Callable[[], Call], inputs: tuple[Tensor, ...], grad_out: Tensor) -> Callable[[], Call]:
    """``build``'s call followed by its backward: returns the output and the gradients of q, k and v."""
    def wrapped() -> Call:
        forward = build()

        def call() -> Output:
            out = forward()
            if not isinstance(out, Tensor):
                raise TypeError(f"a forward call returned {type(out).__name__}, expected one tensor")
            return (out.detach(), *torch.autograd.grad(out, inputs, grad_out))
        return call
    return wrapped


def _backward_case(suite: ModsSuite) -> Case:
    q, k, v = _inputs(suite, suite.short_len, seed=4, grad=True)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))  # (B, H, T, D)
    mod = f"softcap({CAP:g})"

    def grads(build: Callable[[], Call]) -> Callable[[], Call]:
        return _with_grads(build, (q, k, v), grad_out)

    found = [Contender("chunked causal", "attention(causal=True)", grads(_attnkit(q, k, v, causal=True))),
             Contender("chunked softcap", f"attention(causal=True, score_mod={mod})",
                       grads(_attnkit(q, k, v, causal=True, score_mod=softcap(CAP)))),
             Contender("math softcap", f"attention(causal=True, score_mod={mod}, backend='math')",
                       grads(_attnkit(q, k, v, backend="math", causal=True, score_mod=softcap(CAP))),
                       "chunked softcap")]
    if suite.flex:
        found.append(Contender("flex softcap", f"flex_attention(score_mod={mod}, block_mask=causal())",
                               grads(_flex(q, k, v, causal(), softcap(CAP))), "chunked softcap", compiled=True))
    return Case("backward", case_title("backward", suite), "chunked causal", tuple(found))


BUILDERS: dict[str, Callable[[ModsSuite], Case]] = {"window": _window_case, "documents": _documents_case,
                                                    "modifiers": _modifiers_case, "backward": _backward_case}


def _error_text(err: BaseException, limit: int = 400) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {'; '.join(lines)}"[:limit]


def _max_abs_diff(out: Output, reference: Output) -> float:
    pairs = zip(out, reference, strict=True) if isinstance(out, tuple) else [(out, reference)]
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)  # type: ignore[union-attr]


def _prepare(contender: Contender, outputs: dict[str, Output], row: Row, warmup: int) -> Call | None:
    """Build, call once, check and warm up ``contender`` (filling ``row``); its call, or None if it is not to be
    timed."""
    try:
        start = time.perf_counter()
        call = contender.build()
        row["setup_s"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        out = call()
        row["first_call_s"] = round(time.perf_counter() - start, 3)
        for _ in range(warmup):
            call()
    except Exception as err:  # compilers fail in many types; the row carries the text instead of a crash
        row.update(status="error", reason=_error_text(err))
        return None
    if contender.same_as is not None:
        reference = outputs.get(contender.same_as)
        if reference is None:
            row.update(status="error", reason=f"not checked: its reference {contender.same_as!r} did not run")
            return None
        try:
            torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)
        except (AssertionError, TypeError) as err:
            row.update(status="wrong", reason=f"differs from {contender.same_as}: {_error_text(err)}")
            return None
        row["max_diff"] = _max_abs_diff(out, reference)
    outputs[contender.key] = out
    return call


def _time_rounds(calls: dict[str, Call], rows: dict[str, Row], repeats: int) -> dict[str, list[float]]:
    """Milliseconds per call in ``repeats`` rounds, the order rotating; a call that fails leaves the rounds."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    order = list(calls)
    for round_index in range(repeats):
        shift = round_index % max(1, len(order))
        for key in order[shift:] + order[:shift]:
            start = time.perf_counter()
            try:
                calls[key]()
            except Exception as err:  # as in _prepare: the row says what went wrong
                rows[key].update(status="error", reason=f"failed while timed: {_error_text(err)}")
                order.remove(key)
                continue
            times[key].append(1e3 * (time.perf_counter() - start))
    return {key: times[key] for key in order}


def run_case(case: Case, *, repeats: int, warmup: int, log: Callable[[str], None] = lambda _: None) -> list[Row]:
    """One row per contender of ``case``: checked against its reference, then timed beside the others."""
    if any(c.compiled for c in case.contenders):
        torch.compiler.reset()  # every case compiles afresh, and under dynamo's recompile limit
    outputs: dict[str, Output] = {}
    rows: dict[str, Row] = {}
    calls: dict[str, Call] = {}
    for contender in case.contenders:
        log(f"{case.title}: {contender.key}")
        rows[contender.key] = row = dict.fromkeys(_ROW_KEYS)
        row.update(kind=case.title, contender=contender.key, status="ok")
        call = _prepare(contender, outputs, row, warmup)
        if call is not None:
            calls[contender.key] = call
    for key, times in _time_rounds(calls, rows, repeats).items():
        rows[key].update(median_ms=statistics.median(times), spread_ms=f"{min(times):.4g}-{max(times):.4g}")
    base = rows[case.baseline]["median_ms"]
    for contender in case.contenders:
        row = rows[contender.key]
        if row["median_ms"] is not None:
            row["x_baseline"] = None if base is None else row["median_ms"] / base
            if contender.compiled:
                row["compile_s"] = round(row["first_call_s"] - row["median_ms"] / 1e3, 3)
    return [rows[c.key] for c in case.contenders]


def _target(name: str, goal: str, measured: float | None, met: Callable[[float], bool], note: str = "") -> Row:
    """A target row: its goal, the measured ratio (None: not measured in this run) and the verdict."""
    passed = None if measured is None else met(measured)
    return {"kind": "target", "target": name, "goal": goal,
            "measured": None if measured is None else round(measured, 3), "met": passed,
            "verdict": {True: "met", False: "MISSED", None: "not measured in this run"}[passed], "note": note}


def _ratios(rows: Sequence[Row], case: str) -> Callable[[str, str], float | None]:
    """ratio(top, bottom): the median time of contender ``top`` over ``bottom``'s in ``case`` (a row's kind)."""
    median = {r["contender"]: r["median_ms"] for r in rows if r["kind"] == case and r.get("median_ms")}

    def ratio(top: str, bottom: str) -> float | None:
        return median[top] / median[bottom] if top in median and bottom in median else None
    return ratio


def _notes(*parts: tuple[str, float | None]) -> str:
    """"label: 1.23x" for each measured ratio, joined."""
    return "; ".join(f"{label}: {value:.2f}x" for label, value in parts if value is not None)


def mods_targets(rows: Sequence[Row], suite: ModsSuite) -> list[Row]:
    """The targets (BENCHMARKS.md), decided from the rows of one run; FlexAttention's ratios as notes."""
    window, docs, mods = (_ratios(rows, case_title(n, suite)) for n in ("window", "documents", "modifiers"))
    w, long, short = suite.window, suite.long_len, suite.short_len
    found = []
    for key, label in (("chunked window", f"window={w}"), ("chunked mask_mod", f"sliding_window({w})")):
        found.append(_target(f"T={long}, window {w}: dense-mask time / {label} time", ">= 3x",
                             window("chunked dense mask", key), lambda x: x >= 3,
                             _notes(("flex window / this", window("flex window", key)))))
    for key, label in (("chunked and_masks", "and_masks(causal(), document_mask)"),
                       ("chunked causal+document", "causal=True + document_mask")):
        found.append(_target(f"T={long}, {suite.documents} documents: {label} time / plain causal time",
                             "<= 0.25x", docs(key, "chunked causal"), lambda x: x <= 0.25,
                             _notes(("flex documents / flex causal", docs("flex documents", "flex causal")),
                                    ("flex documents / this", docs("flex documents", key)))))
    for name, label in (("softcap", f"softcap({CAP:g})"), ("alibi", f"alibi({suite.num_heads})")):
        found.append(_target(f"T={short} causal: {label} time / plain causal time", "<= 1.6x",
                             mods(f"chunked {name}", "chunked causal"), lambda x: x <= 1.6,
                             _notes((f"flex {name} / flex causal", mods(f"flex {name}", "flex causal")),
                                    (f"flex {name} / this", mods(f"flex {name}", f"chunked {name}")))))
    return found


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _env_row(suite: ModsSuite) -> Row:
    """What the run ran on: shapes, threads, versions, the CPU (name and vector capability)."""
    row: Row = {"kind": "env", "shapes": f"B={suite.batch} H={suite.num_heads} G={suite.num_kv_heads} "
                f"D={suite.head_dim} float32", "threads": suite.threads, "torch": torch.__version__, **cpu_record(),
                "repeats": suite.repeats, "warmup": suite.warmup, "tolerance": f"atol={ATOL:g} rtol={RTOL:g}"}
    if suite.flex:
        from torch._inductor import config as inductor_config

        row["fx_graph_cache"] = bool(inductor_config.fx_graph_cache)  # on: a rerun may compile faster
    return {**row, "load_start": _load_average()}


def run_mods_suite(suite: ModsSuite | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """The suite's rows (dicts, each with a "kind"): env, the contenders' calls, one table per case, and the
    targets they decide."""
    suite = suite or ModsSuite()
    say = log or (lambda _: None)
    with torch_threads(suite.threads):
        rows = [_env_row(suite)]
        cases = [BUILDERS[name](suite) for name in suite.cases]
        rows += [{"kind": "contenders", "case": case.name, "contender": c.key, "call": c.call,
                  "checked_against": c.same_as or "(reference)"} for case in cases for c in case.contenders]
        for case in cases:
            rows += run_case(case, repeats=suite.repeats, warmup=suite.warmup, log=say)
    rows[0]["load_end"] = _load_average()
    return rows + mods_targets(rows, suite)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnkit.bench.mods [--quick] [--no-flex]``: the rows as markdown (``attnkit bench --suite
    mods`` also writes results.json and summary.md)."""
    from .report import rows_markdown

    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.mods", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds): a smoke run, not a measurement")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-flex", action="store_true", help="leave compiled FlexAttention out")
    args = parser.parse_args(argv)
    fields = dict(cases=tuple(args.cases.split(",")), repeats=args.repeats, flex=not args.no_flex)
    rows = run_mods_suite(ModsSuite.small(**fields) if args.quick else ModsSuite(**fields), log=print)
    print(rows_markdown("suite mods", rows[1:], {k: v for k, v in rows[0].items() if k != "kind"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
