"""One self-contained HTML page to explore attention weights, offline.

The page (``page.html`` beside this file) inlines its CSS, JavaScript and
data: no CDN, no network. A head view draws a line from each query token to
each key token, one colour per head, opacity = weight; hovering a token
shows its lines alone. A heatmap view shows one head's weights as a grid.

Legend: H heads, T queries, S keys.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from torch import Tensor

from .trace import Trace

MAX_NUMBERS = 4_000_000  # about 30 MB of page; beyond that a browser struggles


def _layer(name: str, weights: Tensor, t: int, s: int) -> dict[str, object]:
    if not isinstance(weights, Tensor) or weights.dim() != 3 or tuple(weights.shape[1:]) != (t, s):
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"layer {name!r}: weights must be (H, T={t}, S={s}), got {shape}")
    rounded = weights.detach().float().cpu().clamp(0, 1).mul(1e4).round().div(1e4)
    return {"name": name, "weights": rounded.tolist()}


def render_page(tokens: Sequence[str], layers: Sequence[tuple[str, Tensor]], *, title: str = "attnkit",
                subtitle: str = "", key_tokens: Sequence[str] | None = None, layer: int = 0,
                head: int | None = None) -> str:
    """The page's HTML for ``layers``: (name, weights (H, T, S)) pairs. It opens on ``layers[layer]`` with
    ``head`` alone chosen (in the head view and the heatmap), or every head (None)."""
    tokens, keys = list(tokens), list(key_tokens) if key_tokens is not None else None
    if not tokens or not layers:
        raise ValueError("a page needs at least one token and one layer")
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer {layer} is out of range: the page has layers 0 to {len(layers) - 1}")
    heads = layers[layer][1].shape[0]
    if head is not None and not 0 <= head < heads:
        raise ValueError(f"head {head} is out of range: layer {layer} has heads 0 to {heads - 1}")
    t, s = len(tokens), len(keys) if keys is not None else len(tokens)
    numbers = sum(w.numel() for _, w in layers)
    if numbers > MAX_NUMBERS:
        raise ValueError(f"{numbers} weights are too many for one page (at most {MAX_NUMBERS}): "
                         "use a shorter text or fewer layers")
    data = {"tokens": tokens, "key_tokens": keys, "subtitle": subtitle, "open": {"layer": layer, "head": head},
            "layers": [_layer(name, w, t, s) for name, w in layers]}
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # no "</script>" inside
    template = resources.files("attnkit.inspect").joinpath("page.html").read_text(encoding="utf-8")
    fill = {"__TITLE__": html.escape(title), "__DATA__": payload}
    # One pass over the template: text that holds a placeholder's name is never filled in again.
    return re.sub("__TITLE__|__DATA__", lambda m: fill[m.group(0)], template)


def write_html(path: str | Path, tokens: Sequence[str], layers: Sequence[tuple[str, Tensor]], *,
               title: str = "attnkit", subtitle: str = "", key_tokens: Sequence[str] | None = None, layer: int = 0,
               head: int | None = None) -> Path:
    """Write :func:`render_page` to ``path``; returns the path."""
    path = Path(path)
    path.write_text(render_page(tokens, layers, title=title, subtitle=subtitle, key_tokens=key_tokens, layer=layer,
                                head=head), encoding="utf-8")
    return path


def trace_layers(trace: Trace, batch_index: int = 0) -> list[tuple[str, Tensor]]:
    """(name, weights (H, T, S)) of each record of ``trace``, for one sequence of the batch."""
    return [(record.name, record.weights[batch_index]) for record in trace.records]


@dataclass(frozen=True)
class HeadView:
    """The interactive page as an object: shown inline by Jupyter (``_repr_html_``), or written to a file.

        HeadView(tokens, trace_layers(t), title="MiniLM")      # last line of a notebook cell

    The page sits in a sandboxed ``<iframe>`` so its styles and scripts stay apart from the notebook's.
    """

    tokens: Sequence[str]
    layers: Sequence[tuple[str, Tensor]]
    title: str = "attnkit"
    subtitle: str = ""
    key_tokens: Sequence[str] | None = None
    height: int = 640

    def html(self) -> str:
        """The whole page (see :func:`render_page`)."""
        return render_page(self.tokens, self.layers, title=self.title, subtitle=self.subtitle,
                           key_tokens=self.key_tokens)

    def save(self, path: str | Path) -> Path:
        """Write the page to ``path``; returns the path."""
        return write_html(path, self.tokens, self.layers, title=self.title, subtitle=self.subtitle,
                          key_tokens=self.key_tokens)

    def _repr_html_(self) -> str:
        page = html.escape(self.html(), quote=True)
        return (f'<iframe srcdoc="{page}" sandbox="allow-scripts" '
                f'style="width:100%;height:{int(self.height)}px;border:0"></iframe>')


def view(trace: Trace, tokens: Sequence[str], *, batch_index: int = 0, title: str = "attnkit") -> HeadView:
    """A :class:`HeadView` of every record of ``trace`` for one sequence of the batch."""
    return HeadView(list(tokens), trace_layers(trace, batch_index), title=title)
