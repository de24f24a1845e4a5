"""Reporting benchmark results: a table, JSON, markdown, plots, and the targets.

Ratios compare rows of one run only (same mode, batch and length): the
machines are shared and noisy, so absolute times from different runs are not
compared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnkit._optional import require

from .cases import DECODERS, EVERY_LAYER

Row = dict[str, Any]


def _key(row: Row) -> tuple[str, str, int, int]:
    return (row["contender"], row["mode"], row["batch"], row["seq_len"])


BASELINES = {"core": "core-auto", "decode": "decode-attnkit-cache"}  # by kind; layers: the --baseline


def baseline_for(kind: str | None, layer_baseline: str) -> str:
    """The contender a row of this kind is divided by."""
    return BASELINES.get(kind or "layer", layer_baseline)


def with_ratios(rows: Sequence[Row], layer_baseline: str = "attnkit") -> list[Row]:
    """Each row with ``vs_baseline``: its median time / its baseline's, in the same mode, batch and length.

    A row's ``kind`` (layer when absent) picks its baseline: see :data:`BASELINES`.
    """
    by_key = {_key(r): r for r in rows if r["median_ms"] is not None}
    out = []
    for row in rows:
        base_name = baseline_for(row.get("kind"), layer_baseline)
        base = by_key.get((base_name, row["mode"], row["batch"], row["seq_len"]))
        ratio = row["median_ms"] / base["median_ms"] if base and row["median_ms"] is not None else None
        out.append({**row, "baseline": base_name, "vs_baseline": ratio})
    return out


@dataclass(frozen=True)
class Target:
    name: str
    goal: str
    measured: str
    passed: bool


def _ratio_targets(by: dict[tuple[str, str, int, int], Row]) -> list[Target]:
    out = []
    for (name, mode, b, t), row in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        if name != "attnkit" or t < 1024 or mode not in ("inference", "training"):
            continue

        def other(contender: str, r: Row = row) -> float | None:
            o = by.get((contender, r["mode"], r["batch"], r["seq_len"]))
            return None if o is None else o["median_ms"] / r["median_ms"]

        checks = [("raw-sdpa", "within 5% of raw fused QKV + SDPA", lambda x: 1 / x <= 1.05)]
        if mode == "inference":
            checks += [(m, f">= 3x faster than {m}", lambda x: x >= 3) for m in ("torch-mha", "torch-mha-is-causal")]
        else:
            checks += [("torch-mha-is-causal", "no slower than torch-mha-is-causal", lambda x: x >= 1.0)]
        for rival, goal, ok in checks:
            speedup = other(rival)
            if speedup is not None:
                out.append(Target(f"{mode} B={b} T={t}: attnkit vs {rival}", goal,
                                  f"attnkit {speedup:.2f}x as fast", ok(speedup)))
    return out


def _memory_targets(rows: Sequence[Row]) -> list[Target]:
    out = []
    for name in ("attnkit", "attnkit-chunked"):
        points = sorted((r["seq_len"], r["peak_mib"]) for r in rows if r["contender"] == name
                        and r["mode"] == "training" and r["batch"] == 1 and r["peak_mib"] and r["seq_len"] >= 1024)
        if len(points) >= 2:
            (t0, m0), (t1, m1) = points[0], points[-1]
            slope = math.log(m1 / m0) / math.log(t1 / t0)
            out.append(Target(f"training B=1: {name} peak memory growth in T ({t0}..{t1})",
                              "linear in T (log-log slope <= 1.15)", f"slope {slope:.2f}", slope <= 1.15))
        at_16k = [m for t, m in points if t == 16384]
        if at_16k:
            out.append(Target(f"training B=1 T=16384: {name} peak extra memory", "< 1 GiB",
                              f"{at_16k[0]:.0f} MiB", at_16k[0] < 1024))
    return out


def _core_and_decode_targets(by: dict[tuple[str, str, int, int], Row], matmul: float) -> list[Target]:
    out = []
    for (name, mode, b, t), row in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][3])):
        sdpa = by.get(("core-sdpa", mode, b, t))
        if name == "core-chunked" and sdpa is not None:
            limit = 1.5 if mode == "inference" else 2.0
            ratio = row["median_ms"] / sdpa["median_ms"]
            out.append(Target(f"{mode} B={b} T={t}: chunked vs SDPA (attention core)", f"<= {limit}x SDPA's time",
                              f"{ratio:.2f}x", ratio <= limit))
        if name == "core-auto" and mode == "inference" and t == 4096 and row.get("gflops"):
            share = row["gflops"] / matmul
            out.append(Target(f"inference B={b} T=4096: default attention core", ">= 70% of the matmul rate",
                              f"{row['gflops']:.0f} GFLOP/s = {share:.0%} of {matmul:.0f}", share >= 0.70))
        masked = by.get(("decode-attnkit-cache-keymask", mode, b, t))
        if name == "decode-attnkit-cache" and masked is not None:
            ratio = masked["median_ms"] / row["median_ms"]
            out.append(Target(f"decode at {t}: KVCache step with a key mask vs without", "<= 1.15x",
                              f"{ratio:.2f}x", ratio <= 1.15))
        if name == "decode-attnkit-cache" and t == 4096:
            recompute = by.get(("decode-attnkit-recompute", mode, b, t))
            if recompute is not None:
                speedup = recompute["median_ms"] / row["median_ms"]
                out.append(Target("decode at 4096: KVCache step vs recomputing the prefix", ">= 50x faster",
                                  f"{speedup:.0f}x", speedup >= 50))
            for hf in ("decode-hf-gpt2-eager-cache", "decode-hf-gpt2-sdpa-cache"):
                other = by.get((hf, mode, b, t))
                if other is not None:
                    speedup = other["median_ms"] / row["median_ms"]
                    out.append(Target(f"decode at 4096: KVCache step vs {hf}", "no slower",
                                      f"attnkit {speedup:.2f}x as fast", speedup >= 1.0))
    return out


def targets(rows: Sequence[Row], matmul: float) -> list[Target]:
    """The issue's targets that these rows can decide, each with its measured value."""
    by = {_key(r): r for r in rows if r["median_ms"] is not None}
    return _ratio_targets(by) + _memory_targets(rows) + _core_and_decode_targets(by, matmul)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(rows: Sequence[Row], matmul: float) -> list[list[str]]:
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append([r["contender"], str(r["seq_len"]), r["status"], r["reason"][:70], "", "", "", ""])
            continue
        share = None if r["gflops"] is None else 100 * r["gflops"] / matmul
        spread = f"{r['min_ms']:.2f}-{r['max_ms']:.2f}"
        out.append([r["contender"], str(r["seq_len"]), _fmt(r["median_ms"], 2), spread, _fmt(r["peak_mib"], 0),
                    _fmt(r["gflops"], 0), _fmt(share, 0), _fmt(r["vs_baseline"], 2)])
    return out


HEADERS = ["contender", "T", "median ms", "min-max ms", "peak MiB", "GFLOP/s", "% matmul", "x baseline"]


def groups(rows: Sequence[Row]) -> list[tuple[str, list[Row]]]:
    """Rows by mode and batch size, in order of appearance: one table each."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(f"{r['mode']}, B={r['batch']}", []).append(r)
    return list(out.items())


def print_report(console: Any, rows: Sequence[Row], found: Sequence[Target], env: dict[str, Any],
                 matmul: float) -> None:
    rich_table = require("rich.table", "attnkit bench")
    rich_box = require("rich.box", "attnkit bench")
    plain = require("rich.text", "attnkit bench").Text  # names and error messages are data, never markup
    console.print(env_table({**env, "matmul (best sample)": f"{matmul:.0f} GFLOP/s"}))
    console.print("times per call (decode: per token); x baseline = time / baseline's time "
                  "(attnkit, core-auto or decode-attnkit-cache) in the same table and T")
    for title, members in groups(rows):
        table = rich_table.Table(*HEADERS, title=plain(title), box=rich_box.SIMPLE_HEAD, title_justify="left")
        for row in table_rows(members, matmul):
            table.add_row(*map(plain, row))
        console.print(table)
    if found:
        targets_table = rich_table.Table("target", "goal", "measured", "met", title="targets")
        for t in found:
            targets_table.add_row(*map(plain, (t.name, t.goal, t.measured)), "yes" if t.passed else "NO")
        console.print(targets_table)


def env_table(env: dict[str, Any], title: str = "environment") -> Any:
    """``env`` as a rich table of two columns, key and value (a "kind" key left out): one row per key, so a long
    environment stays readable at any width instead of squeezing one column per key."""
    rich_table = require("rich.table", "attnkit bench")
    rich_box = require("rich.box", "attnkit bench")
    plain = require("rich.text", "attnkit bench").Text  # keys and values are data, never markup
    table = rich_table.Table("key", "value", title=plain(title), box=rich_box.SIMPLE_HEAD, title_justify="left")
    for key, value in env.items():
        if key != "kind":
            table.add_row(plain(str(key)), plain(_cell(value)))
    return table


def env_markdown(env: dict[str, Any], title: str = "environment") -> list[str]:
    """``env`` as the lines of a markdown table of two columns, key and value (a "kind" key left out)."""
    lines = [f"**{title}**", "", "| key | value |", "|---|---|"]
    return lines + [f"| {key} | {_cell(value)} |" for key, value in env.items() if key != "kind"]


def env_text(env: dict[str, Any]) -> str:
    """``env`` as plain text in two columns, key and value, one line per key (a "kind" key left out)."""
    shown = {key: _cell(value) for key, value in env.items() if key != "kind"}
    width = max(map(len, shown), default=0)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in shown.items())


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    return "-" if value is None else str(value)


def columns(rows: Sequence[Row]) -> list[str]:
    """Every key of ``rows``, in order of first appearance."""
    return list(dict.fromkeys(key for row in rows for key in row))


def _own_columns(members: Sequence[Row], env: dict[str, Any]) -> list[str]:
    """The columns of a table of ``members``: every key but "kind" and those every row shares with ``env``
    (threads, cpu, ...: said once, in the environment table; results.json keeps them)."""
    return [k for k in columns(members) if k != "kind"
            and not all(k in env and k in row and row[k] == env[k] for row in members)]


def _by_kind(rows: Sequence[Row]) -> list[tuple[str, list[Row]]]:
    """Rows grouped by their "kind" (in order of appearance): one table each, with only its own columns."""
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(str(row.get("kind", "")), []).append(row)
    return list(out.items())


def print_rows(console: Any, title: str, rows: Sequence[Row], env: dict[str, Any]) -> None:
    """A suite's own rows (any keys), one table per kind of row: the suites of :data:`.command.ROW_SUITES`."""
    rich_table = require("rich.table", "attnkit bench")
    plain = require("rich.text", "attnkit bench").Text  # keys and values are data, never markup
    console.print(env_table(env))
    for kind, members in _by_kind(rows):
        if kind == "env":  # a suite's own record of what it ran on: key and value, as the bench's
            for row in members:
                console.print(env_table(row, f"{title}: env"))
            continue
        keys = _own_columns(members, env)
        table = rich_table.Table(title=plain(f"{title}: {kind}" if kind else title), title_justify="left")
        for key in keys:
            table.add_column(plain(key))
        for row in members:
            table.add_row(*(plain(_cell(row.get(k))) for k in keys))
        console.print(table)


def write_rows(out_dir: Path, title: str, rows: Sequence[Row], env: dict[str, Any]) -> list[Path]:
    """A suite's own rows as results.json and summary.md in ``out_dir``; returns both paths."""
    document = {"environment": env, "suite": title, "results": list(rows)}
    (out_dir / "results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    (out_dir / "summary.md").write_text(rows_markdown(title, rows, env))
    return [out_dir / "results.json", out_dir / "summary.md"]


def rows_markdown(title: str, rows: Sequence[Row], env: dict[str, Any]) -> str:
    """A suite's own rows as markdown, one table per kind of row, after the environment."""
    lines = env_markdown(env)
    for kind, members in _by_kind(rows):
        if kind == "env":
            lines += [line for row in members for line in ["", *env_markdown(row, f"{title}: env")]]
            continue
        keys = _own_columns(members, env)
        lines += ["", f"**{title}: {kind}**" if kind else f"**{title}**", "",
                  "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(row.get(k)) for k in keys) + " |" for row in members]
    return "\n".join(lines) + "\n"


def markdown(rows: Sequence[Row], found: Sequence[Target], env: dict[str, Any], matmul: float) -> str:
    lines = env_markdown({**env, "matmul (best sample)": f"{matmul:.0f} GFLOP/s"})
    for title, members in groups(rows):
        lines += ["", f"**{title}**", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(members, matmul)]
    if found:
        lines += ["", "| target | goal | measured | met |", "|---|---|---|---|"]
        lines += [f"| {t.name} | {t.goal} | {t.measured} | {'yes' if t.passed else '**no**'} |" for t in found]
    return "\n".join(lines) + "\n"


def write_json(path: Path, rows: Sequence[Row], found: Sequence[Target], env: dict[str, Any], matmul: float) -> None:
    document = {"environment": env, "matmul_gflops": matmul, "results": list(rows),
                "targets": [asdict(t) for t in found]}
    path.write_text(json.dumps(document, indent=1) + "\n")


_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#7b4173"]
_MARKERS = "os^vDP*Xh<>pd8"
_STYLED = EVERY_LAYER + DECODERS  # the contenders plot() draws, each styled apart


def plot_style(contender: str) -> dict[str, Any]:
    """Keyword arguments of ``Axes.plot`` for ``contender``: a colour and marker fixed per contender (the same in
    every plot, no two of the contenders :func:`plot` draws alike); attnkit's default drawn heavier."""
    i = _STYLED.index(contender) if contender in _STYLED else len(_STYLED)
    if contender == "attnkit":
        return {"color": "black", "marker": "o", "linewidth": 2.5, "markersize": 5, "zorder": 3}
    marker = _MARKERS[(i + i // len(_PALETTE)) % len(_MARKERS)]  # a colour's second use gets another marker
    return {"color": _PALETTE[i % len(_PALETTE)], "marker": marker, "linewidth": 1.2,
            "markersize": 4, "zorder": 2}


def _in_panel(row: Row, mode: str) -> bool:
    """Whether a row belongs on the ``mode`` panel: B=1, a layer (or decode) case, measured or not."""
    kind = "decode" if mode == "decode" else "layer"
    return row["mode"] == mode and row["batch"] == 1 and row.get("kind", "layer") == kind


def _plotted(row: Row, mode: str, metric: str) -> bool:
    """Whether a row is drawn on the ``mode`` panel of the ``metric`` plot: in the panel and measured."""
    return _in_panel(row, mode) and bool(row.get(metric))


def _panels(rows: Sequence[Row]) -> list[str]:
    """The modes a plot shows: inference and training when layer rows were timed, decode when decode rows were."""
    modes = ["inference", "training"] if any(_plotted(r, m, "median_ms") for r in rows
                                             for m in ("inference", "training")) else []
    return modes + (["decode"] if any(_plotted(r, "decode", "median_ms") for r in rows) else [])


def _draw_lines(ax: Any, series: dict[str, list[tuple[int, float]]]) -> None:
    """Each contender's values against T, on log axes."""
    for contender, points in sorted(series.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, label=contender, **plot_style(contender))
    ax.set(xscale="log", yscale="log")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=7)


def _why_no_value(row: Row, metric: str) -> str:
    """What a contender's missing bar says: why it was skipped or failed, or what its value was."""
    if row.get("status", "ok") != "ok":
        reason = str(row.get("reason") or "").strip().splitlines()
        return f"{row['status']}: {reason[0][:60]}" if reason else str(row["status"])
    if row.get(metric) == 0:
        return "0 MiB: no growth of the resident set" if metric == "peak_mib" else "0"
    return str(row.get("reason") or "not measured")[:60]


def _draw_bars(ax: Any, members: Sequence[Row], metric: str, unit: str) -> None:
    """One length only: a horizontal bar per contender on a linear axis, each labelled with its value; a
    contender without a value (skipped, failed, 0 MiB, not measured) keeps its place, with an empty bar
    labelled with why (a dot per contender on a log axis hid how far apart they were, and dropped these)."""
    members = sorted(members, key=lambda r: r["contender"])
    names = [r["contender"] for r in members]
    widths = [float(r[metric]) if r.get(metric) else 0.0 for r in members]
    labels = [f"{w:.3g} {unit}" if w else _why_no_value(r, metric) for r, w in zip(members, widths, strict=True)]
    bars = ax.barh(range(len(names)), widths, color=[plot_style(n)["color"] for n in names], height=0.7)
    ax.bar_label(bars, labels=labels, padding=3, fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()  # the first contender on top
    ax.set_xlim(0, 1.45 * max(widths, default=0.0) or 1.0)  # room for the labels
    ax.grid(True, axis="x", alpha=0.3)


def _draw_panel(ax: Any, rows: Sequence[Row], mode: str, metric: str, label: str, unit: str) -> None:
    """One mode's contenders against T, or as bars at a single T; an empty panel says so."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if _plotted(r, mode, metric):
            series.setdefault(r["contender"], []).append((r["seq_len"], r[metric]))
    lengths = sorted({t for points in series.values() for t, _ in points})
    length = "context length T" if mode == "decode" else "sequence length T"
    if len(lengths) == 1:
        _draw_bars(ax, [r for r in rows if _in_panel(r, mode) and r["seq_len"] == lengths[0]], metric, unit)
        ax.set(xlabel=label, title=f"{mode}, B=1, {length} = {lengths[0]}")
    else:
        _draw_lines(ax, series)
        ax.set(xlabel=length, ylabel=label, title=f"{mode}, B=1")
    if not series:
        ax.text(0.5, 0.5, f"no {mode} rows at B=1 in this run", ha="center", va="center",
                transform=ax.transAxes, color="gray")


def plot(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """Time and peak memory against T (log scales), per mode, for batch 1 layer and decode contenders.

    A contender timed at one length is drawn as a single marker; a panel whose
    contenders share one length (``--quick``) is a horizontal bar chart on a
    linear axis, a labelled bar per contender, one without a value (skipped,
    0 MiB) labelled with why. A plot with
    nothing to draw is not written: a run with no layer or decode rows at B=1
    gets none ([] is returned), and a run that measured no memory
    (``--no-memory``) gets no memory.png.
    """
    from attnkit.inspect.plot import new_figure

    modes = _panels(rows)
    written = []
    for metric, label, unit, name in (("median_ms", "ms per call", "ms", "time.png"),
                                      ("peak_mib", "peak extra MiB", "MiB", "memory.png")):
        if not any(_plotted(r, mode, metric) for r in rows for mode in modes):
            continue
        fig = new_figure(5.5 * len(modes), 4.2)
        axes = fig.subplots(1, len(modes), squeeze=False)[0]
        for ax, mode in zip(axes, modes, strict=True):
            _draw_panel(ax, rows, mode, metric, label, unit)
        fig.savefig(out_dir / name, dpi=110)
        written.append(out_dir / name)
    return written
