"""The chapter's running example: "Your journey starts with one step".

Six tokens, each with a hand-picked 3-d embedding, as printed in the notebooks.
"""

from __future__ import annotations

import torch
from torch import Tensor

SENTENCE = "Your journey starts with one step"
WORDS: tuple[str, ...] = tuple(SENTENCE.split())

_EMBEDDINGS = (
    (0.43, 0.15, 0.89),  # Your     (x^1)
    (0.55, 0.87, 0.66),  # journey  (x^2)
    (0.57, 0.85, 0.64),  # starts   (x^3)
    (0.22, 0.58, 0.33),  # with     (x^4)
    (0.77, 0.25, 0.10),  # one      (x^5)
    (0.05, 0.80, 0.55),  # step     (x^6)
)


def book_inputs(dtype: torch.dtype = torch.float32) -> Tensor:
    """The notebooks' ``inputs``: a new (6, 3) tensor, one row per word of SENTENCE."""
    return torch.tensor(_EMBEDDINGS, dtype=dtype)


def book_batch(dtype: torch.dtype = torch.float32) -> Tensor:
    """The notebooks' ``batch = torch.stack((inputs, inputs), dim=0)``: shape (2, 6, 3)."""
    inputs = book_inputs(dtype)
    return torch.stack((inputs, inputs), dim=0)  # 2 x (6, 3) -> (2, 6, 3)
