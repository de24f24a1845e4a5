"""What ``attnkit explain`` shows: the toy layer of the notebooks, or a real model.

Each builder returns an :class:`Explanation`: the tokens, the walkthrough
steps, a header, one layer's weights for ``--png`` and every layer's for
``--html``. The command line only prints and writes them. A real model is a
packaged one (:func:`explain_model`) or any GGUF file of a registered
architecture (:func:`explain_gguf`, ``--gguf FILE``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from attnkit import textbook as tb

from . import walkthrough as wt
from .html import trace_layers
from .trace import trace

MAX_TOY_D_OUT = 4096  # the toy's out_proj is (d_out, d_out): 64 MiB of float32 at 4096; no table shows more
SEEDS = (-(2**63), 2**64 - 1)  # the range torch.manual_seed takes
# The decoder's cap: its attention records (scores and weights, (1, 9, T, T) float32 each, in each of 30 layers)
# take 2 * 30 * 9 * 4 = 2160 bytes x T^2: 0.57 GB at 512 tokens, 2.3 GB at 1024, 145 GB at its 8192-token context.
SMOLLM2_MAX_TOKENS = 512
# Gemma 3 270M's records take 2 * 18 layers * 4 heads * 4 bytes = 576 bytes x T^2: 0.6 GB at 1024 tokens, enough
# to see its local layers' 512-token window slide.
GEMMA3_MAX_TOKENS = 1024
# Any other GGUF file: as many tokens as keep its records (2 x layers x heads x 4 bytes x T^2) within 0.6 GB, the
# budget of both caps above (SmolLM2: 527 tokens, Gemma 3: 1020), and within its context.
RECORDS_BUDGET_BYTES = 600_000_000


@dataclass(frozen=True)
class Explanation:
    tokens: tuple[str, ...]
    steps: list[wt.Step]
    header: list[str]
    heads_title: str
    heads: Tensor  # (H, T, S): the weights of the layer shown, for --png
    layers: list[tuple[str, Tensor]]  # every layer's (name, weights (H, T, S)), for --html
    meta: dict[str, Any] = field(default_factory=dict)
    layer: int = 0  # the layer --html opens on: the one shown
    head: int | None = None  # the head --html opens on (None: every head, as the toy layer shows them)


def explain_toy(text: str | None, *, d_out: int = 4, num_heads: int = 2, seed: int = 123,
                dropout: float = 0.0, causal: bool = True) -> Explanation:
    """The notebooks' textbook MultiHeadAttention on their sentence, or on ``text`` with random embeddings."""
    _check_toy(d_out, seed)
    example = wt.book_example() if text is None else wt.text_example(text, seed=seed)
    d_in = example.embeddings.shape[1]
    mha = wt.build_layer(d_in, d_out, num_heads, len(example.tokens), seed=seed, dropout=dropout)
    mha.train(dropout > 0)
    steps = wt.walkthrough(mha, example, causal=causal)
    weights = next(s for s in steps if s.key == "softmax").tensors["weights"]  # (H, T, T)
    name = f"textbook MultiHeadAttention(d_in={d_in}, d_out={d_out}, num_heads={num_heads})"
    header = [
        f"text:  {' '.join(example.tokens)}  ({len(example.tokens)} tokens)",
        f"embeddings: {example.source}",
        f"layer: {name}, head_dim={mha.head_dim}",
        f"       {'causal' if causal else 'not causal'}, dropout={dropout}, weights from torch.manual_seed({seed})",
    ]
    meta = {"text": " ".join(example.tokens), "source": example.source, "d_in": d_in, "d_out": d_out,
            "num_heads": num_heads, "head_dim": mha.head_dim, "causal": causal, "dropout": dropout, "seed": seed}
    return Explanation(example.tokens, steps, header, f"attnkit explain: {name}", weights, [(name, weights)], meta)


def _check_toy(d_out: int, seed: int) -> None:
    """Refuse sizes and seeds that would fail late (allocating, or inside torch) with a clear message."""
    if isinstance(d_out, int) and d_out > MAX_TOY_D_OUT:
        raise ValueError(f"d_out={d_out} is too large for the toy walkthrough (at most {MAX_TOY_D_OUT}): "
                         f"its out_proj alone would hold {d_out}**2 weights")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not SEEDS[0] <= seed <= SEEDS[1]:
        raise ValueError(f"seed={seed} is out of range: torch takes seeds from -2**63 to 2**64 - 1")


@dataclass(frozen=True)
class _Traced:
    """A model run once under :func:`trace`: its tokens, records and how to describe it."""

    name: str  # e.g. "MiniLM"
    description: str  # one header line
    tokens: tuple[str, ...]
    token_note: str
    recorded: Any  # Trace
    text: str | None = None  # the text the tokens spell when it was cut (--truncate); None: the text given


def _run_minilm(text: str, truncate: bool) -> _Traced:
    from attnkit.models import load_minilm

    model = load_minilm()
    batch = model.tokenize(text, truncate=truncate)
    tokens = tuple(model.token_strings(batch["input_ids"])[0])
    with trace(model) as recorded:
        model(batch["input_ids"], attention_mask=batch["attention_mask"])
    return _Traced("MiniLM", "all-MiniLM-L6-v2 (6 layers x 12 heads, hidden 384) on attnkit layers", tokens,
                   "word pieces, with [CLS] and [SEP]", recorded)


def _run_smollm2(text: str, truncate: bool) -> _Traced:
    from attnkit.models import load_smollm2

    model = load_smollm2()
    c = model.config
    return _run_decoder(model, text, truncate, "SmolLM2", SMOLLM2_MAX_TOKENS,
                        f"SmolLM2-135M-Instruct ({c.num_layers} layers x {c.num_heads} heads over "
                        f"{c.num_kv_heads} key/value heads, hidden {c.d_model}, RoPE) on attnkit layers",
                        "byte-level BPE tokens")


def _run_gemma3(text: str, truncate: bool) -> _Traced:
    from attnkit.models import load_gemma3

    model = load_gemma3()
    c = model.config
    kinds = ", ".join(str(i) for i in range(c.num_layers) if c.is_global(i))
    return _run_decoder(model, text, truncate, "Gemma 3", GEMMA3_MAX_TOKENS,
                        f"Gemma 3 270M ({c.num_layers} layers x {c.num_heads} heads of {c.head_dim} over "
                        f"{c.num_kv_heads} key/value head, hidden {c.d_model}; layers {kinds} global, the others a "
                        f"{c.window}-token window) on attnkit layers", "SentencePiece tokens")


def _run_decoder(model: Any, text: str, truncate: bool, name: str, cap: int, about: str, pieces: str) -> _Traced:
    """A decoder's attention on the text (at most ``cap`` tokens), recorded by trace."""
    ids, total = _capped_ids(model, text, truncate, name, cap)  # (1, T), and the text's length
    tokens = tuple(model.decode([i], skip_special_tokens=False) for i in ids[0].tolist())
    with trace(model) as recorded:
        model(ids)
    cut = model.decode(ids[0], skip_special_tokens=False) + " ..." if ids.shape[1] < total else None
    return _Traced(name, about, tokens, pieces, recorded, cut)


def gguf_max_tokens(num_layers: int, num_heads: int) -> int:
    """The most tokens ``explain --gguf`` shows a decoder of ``num_layers`` x ``num_heads`` on
    (:data:`RECORDS_BUDGET_BYTES` of attention records)."""
    return max(1, math.isqrt(RECORDS_BUDGET_BYTES // (2 * num_layers * num_heads * 4)))


def _run_gguf(path: str | Path, text: str, truncate: bool) -> _Traced:
    """Any registered architecture's GGUF file (float32 weights, as ``generate --gguf`` loads it by default)."""
    from attnkit.models import load_gguf
    from attnkit.models.gguf import read_gguf

    metadata = read_gguf(path).metadata
    model: Any = load_gguf(path)
    attention = model.layers[0].attention
    layers, heads = len(model.layers), attention.num_heads
    arch = str(metadata.get("general.architecture"))
    name = str(metadata.get("general.name") or Path(path).name)
    about = (f"{name} ({arch}: {layers} layers x {heads} heads of {attention.head_dim} over "
             f"{attention.num_kv_heads} key/value heads, hidden {model.config.d_model}) from {path}, on attnkit "
             "layers")
    pieces = "byte-level BPE tokens" if metadata.get("tokenizer.ggml.model") == "gpt2" else "SentencePiece tokens"
    return _run_decoder(model, text, truncate, name, gguf_max_tokens(layers, heads), about, pieces)


def _capped_ids(model: Any, text: str, truncate: bool, name: str, cap: int) -> tuple[Tensor, int]:
    """The text's ids (1, T), at most ``cap`` (cut with a warning if ``truncate``, else refused), and how many
    tokens the whole text has.

    Encoded without the tokenizer's context check, so that --truncate cuts a text longer than the context too.
    """
    import torch

    from attnkit.models.tokenizer import GGUFTokenizer

    if not isinstance(model.tokenizer, GGUFTokenizer):
        raise TypeError(f"{name}'s tokenizer should be a GGUFTokenizer, got {type(model.tokenizer).__name__}")
    ids = model.tokenizer.encode(text)
    if not ids:
        raise ValueError(f"the text {text!r} tokenizes to nothing: give at least one character")
    cap = min(cap, model.context_length)
    if len(ids) > cap:
        if not truncate:
            raise ValueError(f"the text is {len(ids)} tokens; attnkit explain shows {name} on at most {cap} "
                             f"(the attention records of more would not fit in memory): pass --truncate to cut "
                             f"it to its first {cap} tokens")
        warnings.warn(f"text of {len(ids)} tokens truncated to {name}'s first {cap} (--truncate)", stacklevel=3)
    return torch.tensor([ids[:cap]], dtype=torch.long), len(ids)  # (1, T)


_RUNNERS = {"minilm": _run_minilm, "smollm2": _run_smollm2, "gemma3": _run_gemma3}
MODELS = tuple(_RUNNERS)


def explain_model(model_name: str, text: str | None, *, layer: int = 0, head: int = 0,
                  truncate: bool = False) -> Explanation:
    """A packaged model's real tokens and weights: the walkthrough of one layer and head."""
    if model_name not in _RUNNERS:
        raise ValueError(f"unknown model {model_name!r}; choose from: {', '.join(MODELS)}")
    text = tb.SENTENCE if text is None else text
    return _explain_run(_RUNNERS[model_name](text, truncate), text, layer, head)


def explain_gguf(path: str | Path, text: str | None, *, layer: int = 0, head: int = 0,
                 truncate: bool = False) -> Explanation:
    """A GGUF file's model (any registered architecture, :func:`attnkit.models.load_gguf`): the walkthrough of
    one layer and head on its own tokens and weights, on at most :func:`gguf_max_tokens` tokens."""
    text = tb.SENTENCE if text is None else text
    return _explain_run(_run_gguf(path, text, truncate), text, layer, head)


def _explain_run(run: _Traced, text: str, layer: int, head: int) -> Explanation:
    """The walkthrough of ``layer`` and ``head`` of a traced run, each checked against the model."""
    layers = len(run.recorded.records)
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is out of range: {run.name} has layers 0 to {layers - 1}")
    record = run.recorded.records[layer]
    steps = wt.record_steps(record, head)
    text = text if run.text is None else run.text
    header = [
        f"text:  {text}  ({len(run.tokens)} {run.token_note})",
        f"model: {run.description}",
        f"shown: layer {layer} ({record.name}), head {head}; weights are the model's own",
    ]
    meta = {"text": text, "model": run.name, "layer": layer, "head": head}
    return Explanation(run.tokens, steps, header, f"{run.name} layer {layer}: {text}", record.weights[0],
                       trace_layers(run.recorded), meta, layer=layer, head=head)
