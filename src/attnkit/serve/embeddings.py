"""OpenAI's ``POST /v1/embeddings`` served by MiniLM (:class:`attnkit.models.minilm.MiniLM`).

A request is checked field by field in the event loop (:meth:`Embedder.parse`), then run in a worker thread
(:meth:`Embedder.run`): the texts' token counts, the vectors and the JSON body, so that neither the model nor the
encoding of a large answer holds up the server's other requests. One lock lets a single request at a time use
the model and its tokenizer (whose settings ``embed()`` changes); it is taken per batch, so a one-sentence
request waits behind one batch of a large request, not all of them.

Inputs, as OpenAI takes them: a string, a list of strings, a list of token ids or a list of lists of token ids,
at most :data:`MAX_INPUTS` per request, each at most the model's ``max_seq_length`` tokens (256 for
all-MiniLM-L6-v2: longer is refused, as OpenAI refuses, never cut). Texts are embedded by ``MiniLM.embed()``,
:data:`BATCH` at a time (texts of similar length together: less padding). Token ids are used as given, as vLLM
does: a client that tokenizes itself includes ``[CLS]`` (101) and ``[SEP]`` (102) as MiniLM's tokenizer adds
them, and then gets the vector ``embed()`` gives the text. ``encoding_format: "base64"`` sends each vector as
its little-endian float32 bytes (what OpenAI's client asks for and decodes).

Legend: B inputs in a batch, T tokens, C the embedding's size (384).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .checks import APIError, bad, no_such_model, too_long

if TYPE_CHECKING:
    from attnkit.models.minilm import MiniLM

MAX_INPUTS = 2048  # inputs per request, as OpenAI allows
BATCH = 64  # inputs per model call; a longer request runs in several
_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
_SHAPES = "a non-empty string, a list of them, a list of token ids or a list of lists of token ids"


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked request: its texts or its token ids (one of the two), and how to send the vectors back."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    base64: bool
    single: bool  # one string or one list of token ids: errors name "input", not "input[0]"

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or [])

    def param(self, i: int) -> str:
        """The field that names input ``i``."""
        return "input" if self.single else f"input[{i}]"


class Embedder:
    """A MiniLM serving ``/v1/embeddings`` under the model id ``name``."""

    def __init__(self, model: MiniLM, *, name: str = "minilm") -> None:
        if model.tokenizer is None:
            raise ValueError("the embedder's MiniLM has no tokenizer; build it with load_minilm()")
        self.model, self.name = model.eval(), name
        self.dimensions = model.config.hidden_size
        self.max_tokens = model.max_seq_length or model.config.max_position_embeddings
        self._lock = threading.Lock()
        self._counts = {"embedding_requests_total": 0, "embedding_inputs_total": 0, "embedding_tokens_total": 0}

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)

    # -- checking a request (in the event loop) -----------------------------------------------------------------

    def parse(self, body: Mapping[str, Any], names: Sequence[str], other_names: Sequence[str] = ()) -> \
            EmbeddingRequest:
        """Check every field but the texts' token counts (:meth:`run` counts them); ``names``: the model ids
        this embedder answers to, ``other_names``: the server's text models, which do not embed."""
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
        model = body.get("model")
        if not isinstance(model, str):
            raise bad("model", f"expected the model's name, got {json.dumps(model)}")
        if model in other_names and model not in names:
            raise APIError(404, f"The model '{model}' is a text model and does not embed; this server embeds with "
                           + ", ".join(f"'{n}'" for n in names), param="model", code="model_not_found")
        if model not in names:
            raise no_such_model(model, names)
        encoding = body.get("encoding_format")
        if encoding not in (None, "float", "base64"):
            raise bad("encoding_format", f"expected \"float\" or \"base64\", got {json.dumps(encoding)}")
        dimensions = body.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
            raise bad("dimensions", f"expected an integer, got {json.dumps(dimensions)}")
        if dimensions is not None and dimensions != self.dimensions:
            raise bad("dimensions", f"{self.name}'s embeddings have {self.dimensions} dimensions and cannot be "
                                    f"shortened; got {dimensions} (leave dimensions out)")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise bad("user", f"expected a string, got {json.dumps(body['user'])}")
        return self._inputs(body.get("input"), encoding == "base64")

    def _inputs(self, given: Any, as_base64: bool) -> EmbeddingRequest:
        if isinstance(given, str):
            if not given:
                raise bad("input", "is an empty string; expected text to embed")
            return EmbeddingRequest([given], None, as_base64, single=True)
        if not isinstance(given, list) or not given:
            raise bad("input", f"expected {_SHAPES}, got {json.dumps(given)[:80]}")
        if all(_is_id(x) for x in given):  # one input's token ids
            return EmbeddingRequest(None, [self._ids(given, "input")], as_base64, single=True)
        if len(given) > MAX_INPUTS:
            raise bad("input", f"has {len(given)} inputs; at most {MAX_INPUTS} per request (send several "
                               "requests)")
        if all(isinstance(x, str) for x in given):
            for i, text in enumerate(given):
                if not text:
                    raise bad(f"input[{i}]", "is an empty string; expected text to embed")
            return EmbeddingRequest(list(given), None, as_base64, single=False)
        if all(isinstance(x, list) for x in given):
            return EmbeddingRequest(None, [self._ids(x, f"input[{i}]") for i, x in enumerate(given)], as_base64,
                                    single=False)
        if not _alike(given[0], given[0]):
            raise bad("input[0]", f"expected a string, a token id or a list of token ids, got "
                                  f"{json.dumps(given[0])[:40]}")
        odd = next(i for i, x in enumerate(given) if not _alike(x, given[0]))
        raise bad(f"input[{odd}]", f"is {json.dumps(given[odd])[:40]} where input[0] is "
                                   f"{json.dumps(given[0])[:40]}; expected {_SHAPES}, one kind throughout")

    def _ids(self, ids: list[Any], param: str) -> list[int]:
        """One input's token ids, checked: ints in the vocabulary, 1 to ``max_tokens`` of them."""
        if not ids:
            raise bad(param, "is an empty list of token ids; expected at least one")
        vocab = self.model.config.vocab_size
        for j, token in enumerate(ids):
            if not _is_id(token):
                raise bad(f"{param}[{j}]", f"expected a token id (an integer), got {json.dumps(token)[:40]}")
            if not 0 <= token < vocab:
                raise bad(f"{param}[{j}]", f"token id {token} is outside {self.name}'s vocabulary [0, {vocab})")
        if len(ids) > self.max_tokens:
            raise too_long(param, f"has {len(ids)} tokens; {self.name} takes at most {self.max_tokens}")
        return ids

    # -- running it (in a worker thread) ------------------------------------------------------------------------

    def run(self, request: EmbeddingRequest) -> tuple[bytes, int]:
        """The response body (JSON bytes) and the number of tokens embedded; an over-long text is an
        :class:`APIError` naming its index and its length."""
        lengths = self._lengths(request)
        vectors = torch.empty(len(request), self.dimensions)  # (N, C)
        order = sorted(range(len(request)), key=lengths.__getitem__)  # similar lengths batched together
        for start in range(0, len(order), BATCH):
            rows = order[start:start + BATCH]
            with self._lock:
                if request.texts is not None:
                    vectors[rows] = self.model.embed([request.texts[i] for i in rows]).float()  # (B, C)
                else:
                    assert request.token_ids is not None, "a request has texts or token ids"
                    vectors[rows] = self._embed_ids([request.token_ids[i] for i in rows])  # (B, C)
        tokens = sum(lengths)
        with self._lock:
            self._counts["embedding_requests_total"] += 1
            self._counts["embedding_inputs_total"] += len(request)
            self._counts["embedding_tokens_total"] += tokens
        return self._body(request, vectors, tokens), tokens

    def _lengths(self, request: EmbeddingRequest) -> list[int]:
        """Each input's tokens, [CLS] and [SEP] included; a text too long or without word pieces is refused."""
        if request.token_ids is not None:
            return [len(ids) for ids in request.token_ids]
        assert request.texts is not None, "a request has texts or token ids"
        tokenizer = self.model.tokenizer
        with self._lock:  # embed() sets the tokenizer's truncation: never while another thread encodes
            tokenizer.no_truncation()
            encodings = tokenizer.encode_batch(request.texts)
        for i, encoding in enumerate(encodings):
            if len(encoding.ids) > self.max_tokens:
                raise too_long(request.param(i), f"has {len(encoding.ids)} tokens; {self.name} takes at most "
                                                 f"{self.max_tokens} (shorten it or split it)")
            if all(encoding.special_tokens_mask):
                raise bad(request.param(i), "has no word pieces (only spaces or characters the tokenizer drops); "
                                            "expected text to embed")
        return [len(encoding.ids) for encoding in encodings]

    @torch.inference_mode()
    def _embed_ids(self, rows: list[list[int]]) -> Tensor:
        """Token ids -> unit vectors (B, C), pooled as ``MiniLM.embed()`` pools (the mean of real tokens)."""
        ids = torch.full((len(rows), max(map(len, rows))), self.model.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)  # (B, T), 1 = real token
        for row, given in enumerate(rows):
            ids[row, : len(given)] = torch.tensor(given)
            mask[row, : len(given)] = 1
        return self.model.embed_ids(ids, mask).float()  # (B, C)

    def _body(self, request: EmbeddingRequest, vectors: Tensor, tokens: int) -> bytes:
        if request.base64:  # little-endian float32 bytes, as OpenAI's client decodes them
            little = vectors.numpy().astype("<f4")
            data: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
        else:
            data = vectors.tolist()
        return json.dumps({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
            "model": self.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }).encode()


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _alike(x: object, first: object) -> bool:
    """Whether input ``x`` has the kind of the first input (a text, a token id or a list)."""
    return _is_id(x) if _is_id(first) else isinstance(first, (str, list)) and type(x) is type(first)
