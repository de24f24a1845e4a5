"""The generate suite's report: its targets decided from its rows, a plain-text table, and plots.

Every target is a ratio (or a time) from one run, judged on attnkit's
default weight form (SmolLM2, :func:`generate_targets`) or on attnkit float32
against transformers float32 (Gemma 3, :func:`gemma3_targets`); a target this
run did not measure (a length left out, llama.cpp not installed) is a row
that says so, never a silent gap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .report import env_text

Row = dict[str, Any]
_B1 = "batch 1"
_BATCHED = "batched"
_PROCESS = "load and memory"


def _target(name: str, goal: str, measured: float | None, met: Callable[[float], bool], note: str = "") -> Row:
    """A target row: its goal, measured value (None: not measured in this run) and verdict (met: None then)."""
    passed = None if measured is None else met(measured)
    return {"kind": "target", "target": name, "goal": goal,
            "measured": None if measured is None else round(measured, 3), "met": passed,
            "verdict": {True: "met", False: "MISSED", None: "not measured in this run"}[passed], "note": note}


def _ratio(table: dict[Any, Row], key: Any, other: Any, field: str) -> float | None:
    """table[key][field] / table[other][field], or None when either row is missing."""
    if key not in table or other not in table or not table[other][field]:
        return None
    return float(table[key][field] / table[other][field])


def _notes(parts: Sequence[tuple[str, float | None]]) -> str:
    """"label: 1.23x" for each measured ratio, joined."""
    return "; ".join(f"{label}: {value:.2f}x" for label, value in parts if value is not None)


def _batch1_targets(rows: Sequence[Row], a: str, who: str) -> list[Row]:
    one = {(r["contender"], r["context"]): r for r in rows if r["kind"] == _B1}
    dec, pre = "decode_tokens_per_s", "prefill_tokens_per_s"

    def fa_note(t: int, field: str) -> str:
        return _notes([("vs llama.cpp with flash attention", _ratio(one, (a, t), ("llama.cpp-fa", t), field))])

    return [
        _target(f"batch 1, 16-token prompt: decode tokens/s, {who} / attnkit float32", ">= 1.8x",
                _ratio(one, (a, 16), ("attnkit-float32", 16), dec), lambda v: v >= 1.8,
                _notes([("vs llama.cpp", _ratio(one, (a, 16), ("llama.cpp", 16), dec)),
                        ("vs llama.cpp with flash attention", _ratio(one, (a, 16), ("llama.cpp-fa", 16), dec))])),
        _target(f"batch 1, 4000-token context: decode tokens/s, {who} / llama.cpp", ">= 0.8x",
                _ratio(one, (a, 4000), ("llama.cpp", 4000), dec), lambda v: v >= 0.8, fa_note(4000, dec)),
        _target(f"batch 1, 4000-token context: prefill tokens/s, {who} / llama.cpp", ">= 2x",
                _ratio(one, (a, 4000), ("llama.cpp", 4000), pre), lambda v: v >= 2.0, fa_note(4000, pre)),
        _target(f"batch 1, 7900-token context: decode tokens/s, {who} / llama.cpp", ">= 0.7x",
                _ratio(one, (a, 7900), ("llama.cpp", 7900), dec), lambda v: v >= 0.7, fa_note(7900, dec)),
    ]


def _batched_targets(rows: Sequence[Row], a: str, who: str) -> list[Row]:
    batched = {r["contender"]: r for r in rows if r["kind"] == _BATCHED}
    b = next((r["batch"] for r in batched.values()), 8)
    rate = "new_tokens_per_s"
    return [
        _target(f"batch {b}: aggregate new tokens/s, {who} / attnkit float32 batched", ">= 3x",
                _ratio(batched, a, "attnkit-float32", rate), lambda v: v >= 3.0),
        _target(f"batch {b}: aggregate new tokens/s, {who} / llama.cpp one prompt after another", ">= 2x",
                _ratio(batched, a, "llama.cpp", rate), lambda v: v >= 2.0,
                _notes([("vs llama.cpp with flash attention", _ratio(batched, a, "llama.cpp-fa", rate))])),
    ]


def _process_targets(rows: Sequence[Row], a: str, who: str) -> list[Row]:
    process = {r["contender"]: r for r in rows if r["kind"] == _PROCESS}
    others = "; ".join(f"{name} {r['load_s']:.2f} s" for name, r in process.items() if name != a)
    mine = process.get(a)
    f32 = process.get("attnkit-float32")
    memory = f"{mine['loaded_rss_mib']:.0f} MiB vs {f32['loaded_rss_mib']:.0f} MiB" if mine and f32 else ""
    return [
        _target(f"load: process start to model ready, {who}, seconds", "<= 3 s",
                None if mine is None else float(mine["load_s"]), lambda v: v <= 3.0, others),
        _target(f"resident memory with the model loaded, {who} / attnkit float32", "<= 0.5x",
                _ratio(process, a, "attnkit-float32", "loaded_rss_mib"), lambda v: v <= 0.5, memory),
    ]


def generate_targets(rows: Sequence[Row], default: str) -> list[Row]:
    """Every target of the suite, decided from ``rows``, with attnkit = its ``default`` weight form."""
    a, who = f"attnkit-{default}", f"attnkit {default} (the default form)"
    return _batch1_targets(rows, a, who) + _batched_targets(rows, a, who) + _process_targets(rows, a, who)


def gemma3_targets(rows: Sequence[Row], accurate: str, lengths: Sequence[int] = (16, 2000)) -> list[Row]:
    """Gemma 3's targets: batch-1 decode tokens/s of attnkit float32 over transformers float32 at each of
    ``lengths``, with the ratios of attnkit's ``accurate`` form (the fastest accurate one) and to llama.cpp as
    notes."""
    one = {(r["contender"], r["context"]): r for r in rows if r["kind"] == _B1}
    a, hf = f"attnkit-{accurate}", "transformers-float32"
    found = []
    for t in lengths:
        def ratio(top: str, bottom: str, t: int = t) -> float | None:
            return _ratio(one, (top, t), (bottom, t), "decode_tokens_per_s")

        notes = [("attnkit float32 / llama.cpp", ratio("attnkit-float32", "llama.cpp"))]
        if accurate != "float32":
            notes = [(f"attnkit {accurate} (fastest accurate form) / transformers float32", ratio(a, hf)), *notes,
                     (f"attnkit {accurate} / llama.cpp", ratio(a, "llama.cpp"))]
        found.append(_target(f"gemma3 batch 1, {t}-token context: decode tokens/s, attnkit float32 / transformers "
                             "float32", ">= 1.3x", ratio("attnkit-float32", hf), lambda v: v >= 1.3, _notes(notes)))
    return found


_LINES: dict[str, Callable[[Row], str]] = {
    "env": env_text,
    "skipped": lambda r: f"skipped {r['contender']}: {r['reason']}",
    "note": lambda r: str(r["text"]),
    "bound": lambda r: (f"decode bound ({r['weights']} weights): {r['seconds_per_pass'] * 1e3:.1f} ms per pass of "
                        f"all weights = {r['decode_tokens_per_s']:.1f} tokens/s"),
    _B1: lambda r: (f"{r['contender']:>20} B=1 T={r['context']:>5} +{r['new_tokens']}: first token "
                    f"{r['ttft_s'] * 1e3:8.1f} ms, prefill {r['prefill_tokens_per_s']:7.1f} tok/s, decode "
                    f"{r['decode_tokens_per_s']:6.1f} tok/s"),
    _BATCHED: lambda r: (f"{r['contender']:>20} B={r['batch']} T={r['prompt_len']} +{r['new_tokens']} ({r['how']}): "
                         f"{r['new_tokens_per_s']:.1f} new tok/s in all ({r['seconds']:.1f} s)"),
    _PROCESS: lambda r: (f"{r['contender']:>20} load {r['load_s']:.2f} s (process start to ready), loaded "
                         f"{r['loaded_rss_mib']:.0f} MiB, +{r['generate_extra_mib']:.0f} MiB generating"),
    "target": lambda r: (f"target {r['target']}: {r['goal']}, measured {r['measured']}: {r['verdict']}"
                         + (f" ({r['note']})" if r["note"] else "")),
}


def format_rows(rows: Sequence[Row]) -> str:
    """A plain-text table of the suite's rows."""
    return "\n".join(_LINES[row["kind"]](row) for row in rows)


def _bars(ax: Any, groups: list[str], values: dict[str, list[float]], colors: dict[str, Any]) -> None:
    """Grouped bars: one group per label of ``groups``, one bar per contender (0 where it was not measured)."""
    width = 0.8 / max(1, len(values))
    for i, (name, heights) in enumerate(values.items()):
        bars = ax.bar([g + i * width for g in range(len(groups))], heights, width, label=name, color=colors[name])
        ax.bar_label(bars, fmt="%.1f", fontsize=6)
    ax.set_xticks([g + width * (len(values) - 1) / 2 for g in range(len(groups))], groups)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def plot(rows: Sequence[Row], out_dir: Any) -> list[Path]:
    """decode.png (batch-1 decode tokens/s per context, batched aggregate new tokens/s) and prefill.png
    (batch-1 prefill tokens/s per context, log scale), each contender in its own colour; [] if nothing to draw."""
    from attnkit.inspect.plot import new_figure

    one = [r for r in rows if r["kind"] == _B1]
    batched = [r for r in rows if r["kind"] == _BATCHED]
    names = list(dict.fromkeys(r["contender"] for r in one + batched))
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    contexts = sorted({r["context"] for r in one})
    env = next((r for r in rows if r["kind"] == "env"), {})
    model = f"{env['model']}, " if "model" in env else ""
    where = f"{env['gpu']}, {env.get('dtype', '?')}" if "gpu" in env else f"{env.get('threads', '?')} threads"

    def per_context(field: str) -> dict[str, list[float]]:
        table = {(r["contender"], r["context"]): r[field] for r in one}
        return {n: [table.get((n, t), 0.0) for t in contexts] for n in names if any((n, t) in table for t in contexts)}

    written = []
    panels = [p for p in (bool(one), bool(batched)) if p]
    if panels:
        fig = new_figure(6.5 * len(panels), 4.2)
        axes = list(fig.subplots(1, len(panels), squeeze=False)[0])
        if one:
            ax = axes.pop(0)
            _bars(ax, [f"T={t}" for t in contexts], per_context("decode_tokens_per_s"), colors)
            ax.set(ylabel="decode tokens/s", title=f"{model}batch 1 decode, {where}")
        if batched:
            ax = axes.pop(0)
            _bars(ax, [f"B={batched[0]['batch']}, T={batched[0]['prompt_len']}"],
                  {r["contender"]: [r["new_tokens_per_s"]] for r in batched}, colors)
            ax.set(ylabel="new tokens/s, all prompts", title="batched (llama.cpp: one prompt after another)")
        fig.savefig(Path(out_dir) / "decode.png", dpi=100)
        written.append(Path(out_dir) / "decode.png")
    if one:
        fig = new_figure(6.5, 4.2)
        ax = fig.subplots()
        _bars(ax, [f"T={t}" for t in contexts], per_context("prefill_tokens_per_s"), colors)
        ax.set(yscale="log", ylabel="prefill tokens/s (prompt / time to first token)",
               title=f"{model}batch 1 prefill, {where}")
        fig.savefig(Path(out_dir) / "prefill.png", dpi=100)
        written.append(Path(out_dir) / "prefill.png")
    return written
