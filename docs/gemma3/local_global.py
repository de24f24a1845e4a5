"""README's Gemma 3 picture: a local and a global layer of Gemma 3 270M on the same text (1,043 tokens).

    python docs/gemma3/local_global.py   # writes docs/gemma3/local-global.png and local-global.json

Layer 4 is local (each query sees its 512 most recent tokens), layer 5 global
(every earlier token). The weights are recorded with attnkit.trace, averaged
over the 4 heads of each layer and drawn on a log scale where a weight of
exactly 0 (a key the query cannot see) is white.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import attnkit
from attnkit.inspect.plot import plot_side_by_side
from attnkit.models import load_gemma3

HERE = Path(__file__).resolve().parent
LAYERS = {4: "local", 5: "global"}


def measure(weights: torch.Tensor, window: int) -> dict[str, float]:
    """What a layer's weights (H, T, S) do, averaged over heads and over queries after the first."""
    t = weights.shape[-1]
    distance = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).clamp(min=0)  # (T, S): how far back a key is
    late = weights[:, window:]  # (H, T - window, S): queries whose window no longer reaches the start
    return {"weight beyond the window, queries past it": float((late * (distance[window:] >= window)).sum(-1).mean()),
            "mean distance to the keys (tokens)": float((weights * distance).sum(-1)[:, 1:].mean()),
            "weight on the first token": float(weights[:, 1:, 0].mean())}


def main() -> None:
    model = load_gemma3()
    window = model.config.window
    ids = torch.tensor([model.tokenizer.encode((HERE / "prose.txt").read_text().rstrip("\n"))])  # (1, T)
    with attnkit.trace(model) as recorded, torch.inference_mode():
        model(ids)
    weights = {i: recorded.named(f"layers.{i}.attention")[0].weights[0] for i in LAYERS}  # (H, T, S) each
    measured = {f"layer {i} ({kind})": measure(weights[i], window) for i, kind in LAYERS.items()}
    names = [f"layer {i}: {kind}" + (f" (window {window})" if kind == "local" else "") for i, kind in LAYERS.items()]
    figure = plot_side_by_side(torch.stack([weights[i].mean(0) for i in LAYERS]), names, log=True,
                               title=f"Gemma 3 270M on {ids.shape[1]} tokens of prose: attention weights, "
                               "mean of 4 heads")
    figure.savefig(HERE / "local-global.png", dpi=120)
    (HERE / "local-global.json").write_text(json.dumps({"tokens": ids.shape[1], **measured}, indent=2) + "\n")
    print(json.dumps(measured, indent=2))


if __name__ == "__main__":
    main()
