"""Showing walkthrough steps in a terminal (rich) and writing them as JSON.

Tables fit the console's width (80 columns when output is not a terminal):
columns and rows beyond what fits are cut, and the screen says so; the JSON
file always holds every number. Tokens, names and notes are data, never rich
markup: they are printed as ``rich.text.Text``, so a token such as ``[red]``,
``[/b]`` or ``\\`` prints as itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from attnkit._optional import require

from .walkthrough import STEPS, Step

if TYPE_CHECKING:
    from rich.console import Console

TOKEN_AXES = ("token", "query", "key")
CELL = 7  # "-0.1234"
MAX_ROWS = 16


def plain(text: str, style: str = "") -> Any:
    """``text`` as a rich Text: shown as written, never read as markup."""
    return require("rich.text", "attnkit explain").Text(text, style=style)


def _labels(axis: str, n: int, tokens: Sequence[str]) -> list[str]:
    if axis in TOKEN_AXES:
        return [t if len(t) <= 8 else t[:7] + "…" for t in tokens[:n]]
    return [str(i) for i in range(n)]


def _cell(value: float | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def _matrix_table(matrix: Tensor, axes: tuple[str, str], tokens: Sequence[str], width: int) -> Any:
    rich_table = require("rich.table", "attnkit explain")
    rows, cols = matrix.shape
    row_labels, col_labels = _labels(axes[0], rows, tokens), _labels(axes[1], cols, tokens)
    label_width = max(len(label) for label in row_labels)
    fit = max(1, (width - label_width - 4) // (CELL + 1))
    shown_cols, shown_rows = min(cols, fit), min(rows, MAX_ROWS)
    table = rich_table.Table(box=None, padding=(0, 1, 0, 0), show_edge=False, pad_edge=False)
    table.add_column("", style="bold")
    for label in col_labels[:shown_cols]:
        table.add_column(plain(label[:CELL]), justify="right", min_width=CELL, max_width=CELL, no_wrap=True)
    values = matrix.tolist()
    for label, row in zip(row_labels[:shown_rows], values[:shown_rows], strict=False):
        table.add_row(plain(label), *(_cell(v) for v in row[:shown_cols]))
    cut = []
    if shown_cols < cols:
        cut.append(f"{shown_cols} of {cols} columns")
    if shown_rows < rows:
        cut.append(f"{shown_rows} of {rows} rows")
    return table, cut


def _render_tensor(console: Console, name: str, tensor: Tensor, axes: tuple[str, ...],
                   tokens: Sequence[str]) -> None:
    shape = " x ".join(f"{a}={n}" for a, n in zip(axes, tensor.shape, strict=True))
    console.print(plain(name, "cyan") + plain(f" ({shape})", "dim"))
    if tensor.dim() == 1:
        tensor, axes = tensor.unsqueeze(0), ("row", *axes)
    blocks = [(None, tensor)] if tensor.dim() == 2 else [(f"{axes[0]} {i}", t) for i, t in enumerate(tensor)]
    for label, matrix in blocks:
        if label:
            console.print(plain(f"  {label}", "dim"))
        table, cut = _matrix_table(matrix, (axes[-2], axes[-1]), tokens, console.width - 2)
        console.print(table)
        if cut:
            console.print(f"  [dim]showing {', '.join(cut)}; --json has every number[/dim]")


def render(console: Console, steps: Sequence[Step], tokens: Sequence[str]) -> None:
    """Print each step: its number and title, its one-line note, then its tensors."""
    order = list(STEPS)
    for step in steps:
        number = order.index(step.key) + 1 if step.key in STEPS else "-"
        console.print()
        console.rule(plain(f"{number}. {step.title}", "bold"), align="left")
        console.print(plain(step.note))
        for name, tensor in step.tensors.items():
            _render_tensor(console, name, tensor.detach(), step.axes[name], tokens)


def _jsonable(tensor: Tensor) -> Any:
    """Nested lists; a non-finite float (a blocked -inf score) becomes None (JSON null)."""
    values = tensor.detach().cpu().tolist()

    def clean(v: Any) -> Any:
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v if isinstance(v, bool) or math.isfinite(v) else None

    return clean(values)


def steps_to_json(steps: Sequence[Step], tokens: Sequence[str], meta: dict[str, Any]) -> dict[str, Any]:
    """Every step's tensors as nested lists, with shapes, axes and notes."""
    return {
        "tokens": list(tokens),
        **meta,
        "null_means": "a blocked score (-inf before softmax)",
        "steps": [
            {
                "key": s.key,
                "title": s.title,
                "note": s.note,
                "tensors": {
                    name: {"shape": list(t.shape), "axes": list(s.axes[name]), "data": _jsonable(t)}
                    for name, t in s.tensors.items()
                },
            }
            for s in steps
        ],
    }


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
