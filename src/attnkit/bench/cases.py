"""Benchmark cases and the suites that group them.

A case names a contender, a mode and a size. Modes: ``inference`` (eval,
no_grad, forward), ``training`` (train mode, forward + backward) and
``decode`` (per-token latency at a context length, see :mod:`.decode`).
Layer cases use GPT-2 small's width (d_model 768, 12 heads, causal); core
cases time the attention kernel on (B, 12, T, 64).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

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
    """Every combination, except that decode-* contenders only decode and the others never do."""
    return [Case(c, m, b, t) for m in modes for b in batches for t in seq_lens for c in contenders
            if c.startswith("decode-") == (m == "decode")]


LAYER_RIVALS = ["attnkit", "raw-sdpa", "torch-mha", "torch-mha-is-causal", "textbook-mha", "attnkit-chunked"]
EVERY_LAYER = ["attnkit", "attnkit-sdpa", "attnkit-chunked", "attnkit-math", "raw-sdpa", "torch-mha",
               "torch-mha-is-causal", "torch-mha-weights", "textbook-mha", "textbook-wrapper", "lfs-mha",
               "lfs-wrapper", "hf-gpt2-eager", "hf-gpt2-sdpa"]
CORES = ["core-auto", "core-sdpa", "core-chunked", "core-torch-sdpa", "core-math"]
DECODERS = ["decode-attnkit-cache", "decode-attnkit-recompute", "decode-hf-gpt2-eager-cache",
            "decode-hf-gpt2-sdpa-cache"]


def quick() -> list[Case]:
    """A small, representative run: under two minutes on two CPU cores."""
    return (grid(LAYER_RIVALS, ["inference"], [1], [1024])
            + grid(["attnkit", "raw-sdpa", "torch-mha-is-causal", "attnkit-chunked"], ["training"], [1], [1024])
            + grid(["core-auto", "core-chunked"], ["inference"], [1], [2048])
            + grid(["decode-attnkit-cache", "decode-attnkit-recompute"], ["decode"], [1], [1024]))


def full() -> list[Case]:
    """Scaling in T for the main contenders, every contender at the target sizes, cores, decoding."""
    scaling = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    cases = grid(LAYER_RIVALS, ["inference", "training"], [1], scaling)
    cases += grid(EVERY_LAYER, ["inference", "training"], [1, 8], [1024, 4096])
    cases += grid(EVERY_LAYER, ["inference", "training"], [8], [128])
    cases += grid(CORES, ["inference", "training"], [1], [1024, 4096, 16384])
    cases += grid(DECODERS, ["decode"], [1], [1024, 4096, 16384])
    return list(dict.fromkeys(cases))  # without repeats, in order


def targets() -> list[Case]:
    """Only the cases the issue's targets are judged on: run it with more repeats (see BENCHMARKS.md)."""
    cases = grid(["attnkit", "raw-sdpa", "torch-mha", "torch-mha-is-causal"], ["inference"], [1, 8], [1024, 4096])
    cases += grid(["attnkit", "raw-sdpa", "torch-mha-is-causal"], ["training"], [1, 8], [1024, 4096])
    cases += grid(["attnkit", "attnkit-chunked"], ["training"], [1], [1024, 4096, 16384])
    cases += grid(["core-auto", "core-sdpa", "core-chunked"], ["inference", "training"], [1], [1024, 4096, 16384])
    cases += grid(DECODERS, ["decode"], [1], [4096])
    return list(dict.fromkeys(cases))


SUITES = {"quick": quick, "full": full, "targets": targets}
