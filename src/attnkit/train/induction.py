"""Train a two-layer attention-only transformer and watch an induction head form.

Each training sequence is random tokens in which a segment of random length
reappears later at a random offset (Olsson et al., 2022, "In-context learning
and induction heads"). The tokens of the second copy are unpredictable from
position alone; a model predicts them only by finding the earlier copy: a
*previous-token head* in the first layer writes "my previous token was X" into each
position, and an *induction head* in the second layer attends from the current token to
the position just after its earlier occurrence and copies what it finds there.

- the data (:func:`~attnkit.train.data.make_batch`) and the per-head scores
  (:mod:`attnkit.train.scores`) live beside this file;
- :class:`AttentionOnlyTransformer`: token embedding, layers of
  :class:`attnkit.MultiHeadAttention` with RoPE (or a learned position
  embedding) on a residual stream, unembedding; no MLPs;
- :func:`train_induction`: AdamW on fresh batches, metrics on a fixed
  evaluation batch every ``eval_every`` steps, the heads it found and
  ablations (:func:`ablate_heads`).

Legend: B batch, T positions (queries), S keys (= T), H heads, L layers,
V vocabulary, C model width.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import MultiHeadAttention

from .data import MIN_SEGMENT, Batch, make_batch
from .scores import induction_scores, previous_token_scores

STRONG = 0.3  # a head whose score passes this counts as a head of that kind in the ablations


@dataclass(frozen=True)
class InductionConfig:
    """Everything that decides a run; a fixed ``seed`` gives the same numbers (see :func:`train_induction`)."""

    steps: int = 1500
    seed: int = 0
    vocab_size: int = 32
    seq_len: int = 32
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    batch_size: int = 32
    lr: float = 5e-3
    weight_decay: float = 0.01
    warmup: int = 50
    eval_every: int = 25
    eval_batch_size: int = 128
    rope: bool = True  # rotary position embedding; False for a learned position embedding
    device: str = "cpu"
    threads: int = 1  # CPU threads during the run (restored after); see _run_settings

    def __post_init__(self) -> None:
        for name in ("steps", "threads", "d_model", "num_heads", "num_layers", "batch_size", "eval_every",
                     "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(f"vocab_size={self.vocab_size!r}: expected an integer >= 2 (random tokens need a choice)")
        if not isinstance(self.seq_len, int) or self.seq_len < 2 * MIN_SEGMENT:
            raise ValueError(f"seq_len={self.seq_len!r} is too short to repeat a segment: expected an integer "
                             f">= {2 * MIN_SEGMENT} (two copies of at least {MIN_SEGMENT} tokens)")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if not (0 < self.lr < float("inf") and 0 <= self.weight_decay < float("inf") and self.warmup >= 0):
            raise ValueError(f"lr={self.lr}, weight_decay={self.weight_decay}, warmup={self.warmup}: "
                             "expected lr > 0, weight_decay >= 0 and warmup >= 0")


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, or a ValueError naming it when it cannot be used here."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device name such as 'cpu' or 'cuda'") from err
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the training run takes 'cpu' or 'cuda', got a {resolved.type} device")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but torch sees no CUDA GPU here; use 'cpu'")
    return resolved


# ---------------------------------------------------------------------------------------------------------------
# The model


class AttentionOnlyTransformer(nn.Module):
    """Embeddings, ``num_layers`` causal :class:`attnkit.MultiHeadAttention` layers on a residual stream, unembedding.

    Each layer reads a LayerNorm of the residual stream and adds its output to it (pre-norm); there are no MLPs.
    Positions come from rotary embedding inside attention, or with ``rope=False`` from a learned embedding.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, d_model: int, num_heads: int, num_layers: int,
                 rope: bool = True) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = None if rope else nn.Embedding(seq_len, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(num_layers))
        self.layers = nn.ModuleList(MultiHeadAttention(d_model, d_model, num_heads, causal=True, rope=rope)
                                    for _ in range(num_layers))
        self.norm_out = nn.LayerNorm(d_model)
        self.unembed = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: Tensor, *, need_weights: bool = False) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Logits (B, T, V) for tokens (B, T); with ``need_weights`` also each layer's weights (B, H, T, T)."""
        if tokens.dim() != 2 or not 1 <= tokens.shape[1] <= self.seq_len:
            raise ValueError(f"tokens must be (B, T) with 1 <= T <= {self.seq_len}, got {tuple(tokens.shape)}")
        x = self.tok_emb(tokens)  # (B, T) -> (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))  # + (T, C)
        weights = []
        for norm, layer in zip(self.norms, self.layers, strict=True):
            if need_weights:
                out, w = layer(norm(x), need_weights=True)  # (B, T, C), (B, H, T, T)
                weights.append(w)
            else:
                out = layer(norm(x))  # (B, T, C)
            x = x + out
        logits = self.unembed(self.norm_out(x))  # (B, T, C) -> (B, T, V)
        return (logits, weights) if need_weights else logits


@contextmanager
def ablate_heads(model: AttentionOnlyTransformer, heads: Iterable[tuple[int, int]]) -> Iterator[None]:
    """Zero the output of each (layer, head) inside the block (its columns of ``out_proj``); restored on leaving."""
    layers = [cast(MultiHeadAttention, layer) for layer in model.layers]
    saved = []
    try:
        for layer, head in heads:
            if not (0 <= layer < len(layers) and 0 <= head < layers[layer].num_heads):
                raise ValueError(f"no head ({layer}, {head}): the model has {len(layers)} layers of "
                                 f"{layers[0].num_heads} heads")
            weight, size = layers[layer].out_proj.weight, layers[layer].head_dim
            cols = slice(head * size, (head + 1) * size)  # the head's slice of the merged (B, T, C)
            saved.append((weight, cols, weight.data[:, cols].clone()))  # (C, D)
            weight.data[:, cols] = 0
        yield
    finally:
        for weight, cols, columns in reversed(saved):
            weight.data[:, cols] = columns


# ---------------------------------------------------------------------------------------------------------------
# Evaluation and training


@torch.no_grad()
def evaluate(model: AttentionOnlyTransformer, batch: Batch) -> dict[str, Any]:
    """Losses on unpredictable and on predictable (repeated) targets, and every head's scores (L x H lists)."""
    was_training = model.training
    model.eval()
    logits, weights = model(batch.tokens, need_weights=True)  # (B, T, V), L x (B, H, T, T)
    model.train(was_training)
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch.tokens[:, 1:].flatten(),
                             reduction="none").view_as(batch.tokens[:, 1:])  # (B, T - 1)
    predictable = batch.predictable_targets()  # (B, T - 1)
    return {
        "loss_random": losses[~predictable].mean().item(),
        "loss_repeat": losses[predictable].mean().item(),
        "induction": [induction_scores(w, batch).tolist() for w in weights],
        "previous_token": [previous_token_scores(w).tolist() for w in weights],
    }


def find_heads(metrics: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(layer, head) of the best induction head, and of the best previous-token head in a layer below it.

    When the induction head is in the first layer there is no layer below; the previous-token head is then
    searched in every layer.
    """
    ind = torch.tensor(metrics["induction"])  # (L, H)
    prev = torch.tensor(metrics["previous_token"])  # (L, H)
    layer, head = divmod(int(ind.argmax()), ind.shape[1])
    below = prev[:layer] if layer > 0 else prev  # (L', H)
    p_layer, p_head = divmod(int(below.argmax()), prev.shape[1])
    return (layer, head), (p_layer, p_head)


def strong_heads(scores: list[list[float]], layers: Iterable[int], threshold: float = STRONG) -> list[tuple[int, int]]:
    """Every (layer, head) of ``layers`` whose score passes ``threshold``, in order."""
    return [(layer, head) for layer in layers for head, score in enumerate(scores[layer]) if score > threshold]


def ablations(model: AttentionOnlyTransformer, batch: Batch, final: dict[str, Any], induction_head: tuple[int, int],
              previous_head: tuple[int, int]) -> dict[str, dict[str, Any]]:
    """Repeated-segment loss with heads zeroed: none, each found head, every strong head of each kind.

    Strong heads score above ``STRONG``; the previous-token ones are taken from the layers below the induction
    head (a head can only feed the layers above it). Several heads often share a job, so zeroing one found head
    hurts less than zeroing all heads of its kind.
    """
    below = range(induction_head[0]) if induction_head[0] > 0 else range(len(final["induction"]))
    groups = {"none": [], "induction_head": [induction_head], "previous_token_head": [previous_head],
              "induction_heads": strong_heads(final["induction"], [induction_head[0]]),
              "previous_token_heads": strong_heads(final["previous_token"], below)}
    result: dict[str, dict[str, Any]] = {}
    for name, heads in groups.items():
        with ablate_heads(model, heads):
            loss = evaluate(model, batch)["loss_repeat"]
        result[name] = {"heads": [list(h) for h in heads], "loss_repeat": loss}
    return result


@dataclass
class InductionRun:
    """A finished run: the trained model, its metrics over training and at the end."""

    model: AttentionOnlyTransformer
    config: InductionConfig
    history: list[dict[str, Any]]  # one entry per evaluation: step, train_loss and :func:`evaluate`'s metrics
    final: dict[str, Any]
    induction_head: tuple[int, int]
    previous_token_head: tuple[int, int]
    ablation: dict[str, dict[str, Any]]  # see :func:`ablations`
    formed_at: int | None  # first evaluated step where some head's induction score exceeded 0.5
    seconds: float
    eval_batch: Batch = field(repr=False)
    stopped_at: int | None = None  # the last step done when ``should_stop`` ended training early, else None


@contextmanager
def _run_settings(device: torch.device, threads: int) -> Iterator[None]:
    """``threads`` CPU threads, and on CUDA deterministic kernels, inside the block; the previous settings after.

    One thread is the fastest for this small model (BENCHMARKS.md, "Figures moved from docstrings"). The
    CPU kernels used here are deterministic for a fixed thread count, so on the CPU the slow
    ``torch.use_deterministic_algorithms`` (seconds on its first call) is left alone; CUDA needs it, and a
    cuBLAS workspace setting.
    """
    before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.use_deterministic_algorithms(before[0])
        torch.set_num_threads(before[1])


def _schedule(config: InductionConfig) -> Callable[[int], float]:
    """Learning-rate factor: linear warmup, constant, then a cosine decay to 10% over the last 30% of steps.

    The constant stretch matters: the induction head forms at full learning rate (a decay over the whole
    run slowed it enough that a 1000-step run missed it).
    """
    decay_start = max(config.warmup, int(0.7 * config.steps))

    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, config.steps - decay_start)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor


Progress = Callable[[int, float, float], None]  # (step done, training loss, best induction score so far)


def train_induction(config: InductionConfig | None = None, *, progress: Progress | None = None,
                    should_stop: Callable[[], bool] | None = None) -> InductionRun:
    """Train an :class:`AttentionOnlyTransformer` on repeated segments; see the module docstring.

    ``progress`` is called after every step. ``should_stop`` is asked after every step: when it answers
    True, training ends there (``attnkit train`` answers so after Ctrl-C), that step is evaluated, and the run
    is finished as usual (final metrics, heads, ablations) with ``stopped_at`` set to it.

    The same config (seed included) gives identical numbers on the same machine and torch build, whatever the
    caller's thread count: the weights come from ``torch.manual_seed(seed)`` (on a forked RNG: the caller's random
    state is left as it was), the data from generators seeded from ``seed``, and the run uses ``config.threads`` CPU
    threads (a different count could change the last bits of CPU matmuls, and so the numbers).
    """
    config = InductionConfig() if config is None else config
    device = resolve_device(config.device)
    start = time.perf_counter()
    rng_devices = [device] if device.type == "cuda" else []
    with _run_settings(device, config.threads), torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(config.seed)
        model = AttentionOnlyTransformer(vocab_size=config.vocab_size, seq_len=config.seq_len,
                                         d_model=config.d_model, num_heads=config.num_heads,
                                         num_layers=config.num_layers, rope=config.rope).to(device)
        data = torch.Generator().manual_seed(config.seed)
        eval_batch = make_batch(config.eval_batch_size, config.seq_len, config.vocab_size,
                                generator=torch.Generator().manual_seed(config.seed + 1_000_003), device=device)
        history, stopped_at = _train_loop(model, config, data, eval_batch, device, progress, should_stop)
        final = evaluate(model, eval_batch)
        induction_head, previous_head = find_heads(final)
        ablation = ablations(model, eval_batch, final, induction_head, previous_head)
    formed = [h["step"] for h in history if max(max(row) for row in h["induction"]) > 0.5]
    return InductionRun(model=model, config=config, history=history, final=final, induction_head=induction_head,
                        previous_token_head=previous_head, ablation=ablation, formed_at=formed[0] if formed else None,
                        seconds=time.perf_counter() - start, eval_batch=eval_batch, stopped_at=stopped_at)


def _train_loop(model: AttentionOnlyTransformer, config: InductionConfig, data: torch.Generator, eval_batch: Batch,
                device: torch.device, progress: Progress | None,
                should_stop: Callable[[], bool] | None) -> tuple[list[dict[str, Any]], int | None]:
    """Every evaluation's metrics, and the step where ``should_stop`` ended training (None: all steps done)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # biases and norms
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    history: list[dict[str, Any]] = []
    best = 0.0
    model.train()
    for step in range(1, config.steps + 1):
        batch = make_batch(config.batch_size, config.seq_len, config.vocab_size, generator=data, device=device)
        logits = model(batch.tokens)  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch.tokens[:, 1:].flatten())  # (B(T-1), V)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        stop = should_stop is not None and step < config.steps and should_stop()
        if step % config.eval_every == 0 or step == config.steps or step == 1 or stop:
            metrics = evaluate(model, eval_batch)
            best = max(best, max(max(row) for row in metrics["induction"]))
            history.append({"step": step, "train_loss": loss.item(), **metrics})
        if progress is not None:
            progress(step, loss.item(), best)
        if stop:
            return history, step
    return history, None
