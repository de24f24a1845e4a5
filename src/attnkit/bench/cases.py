"""Benchmark cases and the suites that group them.

A case names a contender, a mode and a size. Modes: ``inference`` (eval,
no_grad, forward), ``training`` (train mode, forward + backward) and
``decode`` (per-token latency at a context length, see :mod:`.decode`).
Layer cases use GPT-2 small's width (d_model 768, 12 heads, causal); core
cases time the attention kernel on (B, 12, T, 64).

Suites here are lists of cases, timed by :mod:`.runner`; suites that time
themselves and return their own rows are registered in :mod:`.command`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .contenders import CONTENDERS

MODES = ("inference", "training", "decode")


@dataclass(frozen=True)
class Case:
    contender: str
    mode: str
    batch: int
    seq_len: int
    d_model: int = 768
    num_heads: int = 12
    dtype: str = "float32"
    device: str = "cpu"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Case:
        return cls(**json.loads(text))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


def grid(contenders: list[str], modes: list[str], batches: list[int], seq_lens: list[int]) -> list[Case]:
    """Every combination of these, in the modes each contender runs (decode contenders only decode)."""
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(unknown)}; choose from: {', '.join(sorted(CONTENDERS))}")
    return [Case(c, m, b, t) for m in modes for b in batches for t in seq_lens for c in contenders
            if m in CONTENDERS[c].modes]


LAYER_RIVALS = ["attnkit", "raw-sdpa", "torch-mha", "torch-mha-is-causal", "textbook-mha", "attnkit-chunked"]
EVERY_LAYER = ["attnkit", "attnkit-sdpa", "attnkit-chunked", "attnkit-math", "attnkit-compiled", "raw-sdpa",
               "torch-mha", "torch-mha-is-causal", "torch-mha-weights", "textbook-mha", "textbook-wrapper", "lfs-mha",
               "lfs-wrapper", "hf-gpt2-eager", "hf-gpt2-sdpa"]
CORES = ["core-auto", "core-sdpa", "core-chunked", "core-torch-sdpa", "core-math"]
DECODERS = ["decode-attnkit-cache", "decode-attnkit-cache-keymask", "decode-attnkit-recompute",
            "decode-hf-gpt2-eager-cache", "decode-hf-gpt2-sdpa-cache"]
PADDED = ["attnkit", "attnkit-padded", "core-auto", "core-auto-padded", "core-sdpa-padded", "core-chunked-padded"]


def quick() -> list[Case]:
    """A small, representative run: a few minutes on two CPU cores (round one: under two; 3 min on a shared one)."""
    return (grid(LAYER_RIVALS, ["inference"], [1], [1024])
            + grid(["attnkit", "raw-sdpa", "torch-mha-is-causal", "attnkit-chunked"], ["training"], [1], [1024])
            + grid(["core-auto", "core-chunked"], ["inference"], [1], [2048])
            + grid(["decode-attnkit-cache", "decode-attnkit-cache-keymask", "decode-attnkit-recompute"],
                   ["decode"], [1], [1024]))


def full() -> list[Case]:
    """Scaling in T for the main contenders, every contender at the target sizes, cores, decoding."""
    scaling = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    cases = grid(LAYER_RIVALS, ["inference", "training"], [1], scaling)
    cases += grid(EVERY_LAYER, ["inference", "training"], [1, 8], [1024, 4096])
    cases += grid(EVERY_LAYER, ["inference", "training"], [8], [128])
    cases += grid(CORES, ["inference", "training"], [1], [1024, 4096, 16384])
    cases += grid(DECODERS, ["decode"], [1], [1024, 4096, 16384])
    cases += padding()
    return list(dict.fromkeys(cases))  # without repeats, in order


def targets() -> list[Case]:
    """Only the cases the issue's targets are judged on: run it with more repeats (see BENCHMARKS.md)."""
    cases = grid(["attnkit", "raw-sdpa", "torch-mha", "torch-mha-is-causal"], ["inference"], [1, 8], [1024, 4096])
    cases += grid(["attnkit", "raw-sdpa", "torch-mha-is-causal"], ["training"], [1, 8], [1024, 4096])
    cases += grid(["attnkit", "attnkit-chunked"], ["training"], [1], [1024, 4096, 16384])
    cases += grid(["core-auto", "core-sdpa", "core-chunked"], ["inference", "training"], [1], [1024, 4096, 16384])
    cases += grid(DECODERS, ["decode"], [1], [4096])
    return list(dict.fromkeys(cases))


def padding() -> list[Case]:
    """Causal attention with a key padding mask (the common training case) beside causal alone.

    Time and peak memory of the layer and the kernels, where "auto" must not build a
    dense (B, 1, T, S) mask that chunked avoids.
    """
    return grid(PADDED, ["inference", "training"], [1], [1024, 4096, 8192])


SUITES = {"quick": quick, "full": full, "targets": targets, "padding": padding}
