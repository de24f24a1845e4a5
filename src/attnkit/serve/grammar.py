"""Structured outputs: decoding constrained by a JSON Schema, as a mask on each request's logits.

A request may carry a :class:`Constraint` (``Engine.submit(..., constraint=...)``): before each of its tokens
is sampled the runner sets every token the constraint does not allow to -inf (before penalties, sampling and
logprobs, so the logprobs are those of the masked distribution the sampler saw); the engine advances it with
the token sampled and ends the request with finish_reason "stop" once it is :attr:`~Constraint.done`. Rows of
one batch each carry their own constraint, so requests with different schemas run together.

:class:`JSONSchemas` is the constraint factory the server uses: JSON Schemas compiled by llguidance against
the model's tokenizer (why llguidance: ``docs/bench/round13-grammar/measure.py``; a schema compiles in 1-2
ms and each token's mask takes about 0.1 ms, beside a SmolLM2 decode step's tens of milliseconds). The
JSON is written on one line with ``", "`` and ``": "`` between items: no free whitespace, which a small model
would otherwise repeat until ``max_tokens``. An answer cut by ``max_tokens`` (finish_reason "length") or by a
stop string is the only one that does not parse. A tool call that ``tool_choice`` forces is a lark grammar of the
template's call syntax with the functions' schemas embedded (:mod:`attnkit.serve.tools`), compiled by
:meth:`JSONSchemas.compile_lark` and applied as any other constraint.

Legend: V vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, Protocol

import torch
from torch import Tensor

from attnkit._optional import require

# One line, OpenAI's separators; no other whitespace (also the layout of a tool call's JSON: attnkit.serve.tools).
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Constraint(Protocol):
    """Which tokens may come next in one request's answer, advanced token by token."""

    def allowed(self) -> Tensor:
        """(V,) bool: True where a token may come next."""
        ...

    def advance(self, token: int) -> None:
        """Take the token sampled; raises ValueError for a token :meth:`allowed` did not allow."""
        ...

    @property
    def done(self) -> bool:
        """The answer is complete: nothing may follow (the request stops)."""
        ...


@lru_cache(maxsize=1)
def _gpt2_byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE vocabulary writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


def token_bytes(tokenizer: Any) -> list[bytes]:
    """Each token's bytes, from a GGUF tokenizer's ``tokens`` (byte-level BPE as SmolLM2, or SentencePiece as
    Gemma: U+2581 for a space, ``<0xNN>`` for a byte); control tokens (``tokenizer.specials``) as 0xFF and their
    name, which no text can produce (llguidance's convention)."""
    specials = set(tokenizer.specials)
    byte_of = _gpt2_byte_of()
    sentencepiece = "<0x0A>" in tokenizer.tokens
    out = []
    for piece in tokenizer.tokens:
        if piece in specials:
            out.append(b"\xff" + piece.encode())
        elif sentencepiece:
            is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
            out.append(bytes([int(piece[3:5], 16)]) if is_byte else piece.replace("\u2581", " ").encode())
        elif all(c in byte_of for c in piece):
            out.append(bytes(byte_of[c] for c in piece))
        else:  # an added token written as plain text
            out.append(piece.encode())
    return out


class JSONSchemas:
    """Compiles JSON Schemas into :class:`JSONConstraint` s for one tokenizer (llguidance, extra ``serve``).

    Args:
        tokenizer: the model's GGUF tokenizer (``tokens``, ``specials``, ``encode``, ``stop_ids``).
        vocab_size: the model's logits' width (at least the tokenizer's; the rest is never allowed).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int) -> None:
        self._ll = require("llguidance", "Structured outputs (response_format)")
        pieces = token_bytes(tokenizer)
        if vocab_size < len(pieces):
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(pieces)} tokens")
        pieces += [b""] * (vocab_size - len(pieces))

        class Wrapped:  # what llguidance.TokenizerWrapper reads
            tokens, eos_token_id, bos_token_id = pieces, tokenizer.eos_id, tokenizer.bos_id

            def __call__(self, text: bytes) -> list[int]:
                return list(tokenizer.encode(text.decode("utf-8", errors="replace")))

        self.vocab_size = vocab_size
        self.stop_ids: Sequence[int] = tuple(tokenizer.stop_ids)
        self._tokenizer = self._ll.LLTokenizer(self._ll.TokenizerWrapper(Wrapped()), n_vocab=vocab_size,
                                               eos_token=list(self.stop_ids))
        self._compile = lru_cache(maxsize=256)(self._compile_text)
        self._compile_lark = lru_cache(maxsize=256)(self._lark_text)

    def compile(self, schema: Mapping[str, Any]) -> str:
        """``schema`` (a JSON Schema object) as a grammar; ValueError naming what llguidance refuses (an unknown
        type, an unsupported keyword such as ``uniqueItems``, a regex with look-around, a dangling ``$ref``)."""
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON Schema is an object, got {json.dumps(schema)[:80]}")
        return self._compile(json.dumps(schema))  # in its order: properties are written in it

    def compile_lark(self, lark: str) -> str:
        """A lark grammar (llguidance's dialect, JSON Schemas embedded as ``%json {...}``) checked against the
        tokenizer; ValueError naming what llguidance refuses."""
        return self._compile_lark(lark)

    def _lark_text(self, lark: str) -> str:
        grammar = self._ll.LLMatcher.grammar_from_lark(lark)
        error = self._ll.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(error.strip())
        return grammar

    def _compile_text(self, schema: str) -> str:
        try:
            grammar = self._ll.LLMatcher.grammar_from_json_schema(schema, overrides=LAYOUT)
        except ValueError as err:
            raise ValueError(f"not a JSON Schema: {err}") from err
        error = self._ll.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(error.strip())
        return grammar

    def constraint(self, grammar: str) -> JSONConstraint:
        """A fresh constraint (at the answer's start) for a grammar from :meth:`compile` or :meth:`compile_lark`."""
        return JSONConstraint(self._ll.LLMatcher(self._tokenizer, grammar), self.vocab_size)


_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()  # (256, 8): each byte's bits, lowest first


class JSONConstraint:
    """One answer's place in a compiled JSON Schema: an llguidance matcher (see :class:`Constraint`)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> Tensor:
        if self._matcher.is_error():
            raise ValueError(f"the grammar stopped: {self._matcher.get_error()}")
        packed = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)  # (V / 8,)
        bits = _BITS.index_select(0, packed.int())  # (V / 8, 8): a lookup is ten times faster than shifts here
        return bits.flatten()[: self.vocab_size]  # (V,)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token} does not follow the grammar: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_stopped())
