"""A tokenizer built from a GGUF file's own vocabulary: byte-level BPE (SmolLM2) or SentencePiece BPE (Gemma).

The ``tokenizers`` library does the work (extra ``models``); this module only
assembles it from the metadata llama.cpp writes (``tokenizer.ggml.*``), as
transformers' GGUF converter does, and renders the file's chat template with
jinja2 in a sandbox.

    tok = GGUFTokenizer.from_metadata(file.metadata, context_length=8192)
    batch = tok.tokenize(["Hi", "Hello there"])   # left-padded (B, T)
    tok.decode(batch["input_ids"][1])             # "Hello there"

Legend: B batch, T tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from attnkit._optional import require

from . import chat

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPACE = "\u2581"  # SentencePiece's visible space
# How each pre-tokenizer named in tokenizer.ggml.pre splits text before the merges: llama.cpp's regexes
# (src/llama-vocab.cpp, llm_tokenizer_bpe), applied in turn, each isolating its matches. The model was trained
# with these (SmolLM2's own tokenizer.json isolates every digit before GPT-2's split); transformers' GGUF
# tokenizer drops the first step for "smollm" and so gives other ids wherever a number follows spaces.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 2's (and Qwen 2.5's, Qwen 3's): Llama 3's, but every digit alone (\p{N}, not \p{N}{1,3}); llama.cpp spells
# tokenizer.json's case-insensitive (?i:'s|'t|...) out, as here.
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),  # llama.cpp's own default
    "gpt-2": (_GPT2,), "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,), "llama-v3": (_LLAMA3,), "llama-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}
_END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<end_of_turn>",
               "<|end|>")  # <|end|>: Phi-3's end of a turn (its eos is <|endoftext|>)


def _check_text(text: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (from a bad decode upstream) is named by position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text holds an unpaired surrogate {text[err.start]!r} at position {err.start}, which is "
                         "not a character (decode input with errors='replace')") from None


def _check_vocabulary(tokens: Sequence[str], token_types: Sequence[int], ids: Mapping[str, int | None]) -> None:
    """Token types for every token and special ids inside the vocabulary, or a ValueError naming the key."""
    if token_types and len(token_types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries but tokenizer.ggml.tokens has "
                         f"{len(tokens)}: one type per token is expected")
    for key, value in ids.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < len(tokens)):
            raise ValueError(f"tokenizer.ggml.{key} = {value!r} is outside the vocabulary of {len(tokens)} tokens")


def _pre_tokenizer(name: str) -> Any:
    """llama.cpp's splits for pre-tokenizer ``name``, then the byte-level mapping (no regex of its own)."""
    pre = require("tokenizers.pre_tokenizers", "The GGUF tokenizer")
    tokenizers = require("tokenizers", "The GGUF tokenizer")
    splits = [pre.Split(tokenizers.Regex(r), behavior="isolated") for r in _PRE_TOKENIZERS[name]]
    return pre.Sequence([*splits, pre.ByteLevel(add_prefix_space=False, use_regex=False)])


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre_tokenizer: str) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE over GPT-2's byte alphabet, split by llama.cpp's pre-tokenizer."""
    tokenizers = require("tokenizers", "The GGUF tokenizer")
    if pre_tokenizer not in _PRE_TOKENIZERS:
        raise ValueError(f"pre-tokenizer {pre_tokenizer!r} (tokenizer.ggml.pre) is not supported; supported: "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre_tokenizer)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def sentencepiece_bpe(tokens: Sequence[str], unknown: str, *, space_prefix: bool = False) -> Any:
    """A ``tokenizers.Tokenizer``: SentencePiece-style BPE (spaces as U+2581, unknown characters as bytes).

    As transformers' GGUF converter builds Gemma's: spaces inside tokens
    ("  ") are spelled U+2581, as the text will be; the file has no merges, so
    they are every split of a token into two tokens, best first in the file's
    token order (the scores order a few of Gemma's differently from the merges
    it learned, transformers found). No text is split before merging.

    ``space_prefix`` (``tokenizer.ggml.add_space_prefix``; Llama 2, Phi-3): a
    space is put before the text and after every special token, and one
    leading space is dropped when decoding, as llama.cpp does (and Phi-3's own
    tokenizer.json: a ``Prepend`` normalizer, applied to each stretch of text
    between special tokens, and a ``Strip`` decoder). Gemma's files say false.
    """
    tokenizers = require("tokenizers", "The GGUF tokenizer")
    spelled = [t.replace(" ", _SPACE) for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    merges = []
    for token in spelled:  # best first: by token id, then the longer left part first
        merges += [(token[:n], token[n:]) for n in range(len(token) - 1, 0, -1)
                   if token[:n] in vocab and token[n:] in vocab]
    bpe = tokenizers.models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(bpe)
    normalizers, decoders = tokenizers.normalizers, tokenizers.decoders
    spaces = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), spaces]) if space_prefix else spaces
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    return tok


def _space_prefix(metadata: Mapping[str, Any]) -> bool:
    """``tokenizer.ggml.add_space_prefix`` of a SentencePiece vocabulary: true where the key is absent, as
    llama.cpp's ``llama_vocab`` defaults it for SPM (llama.cpp's converter leaves it out of Phi-3 files)."""
    value = metadata.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(value, bool):
        raise ValueError(f"tokenizer.ggml.add_space_prefix = {value!r} is not a boolean")
    return value


def _unknown_token(metadata: Mapping[str, Any], tokens: Sequence[str]) -> str:
    """The unknown token of a SentencePiece vocabulary, or a ValueError naming the key."""
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    if isinstance(unknown, bool) or not isinstance(unknown, int) or not 0 <= unknown < len(tokens):
        raise ValueError(f"tokenizer.ggml.unknown_token_id = {unknown!r} is not a token id in [0, {len(tokens)}): "
                         "a SentencePiece vocabulary needs its unknown token")
    return str(tokens[unknown])


def _phi3_rstrip(metadata: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int]) -> set[str]:
    """The tokens after which whitespace is dropped: in Phi-3's SentencePiece vocabulary, its chat tokens (every
    control or user-defined token but <unk>, <s> and <|endoftext|>, and </s>), as its tokenizer.json marks them
    ``rstrip`` and llama.cpp sets them (the file does not say); none elsewhere (Phi-4's vocabulary is BPE)."""
    if metadata.get("general.architecture") != "phi3" or metadata.get("tokenizer.ggml.model") != "llama":
        return set()
    marked = {t for t, kind in zip(tokens, token_types, strict=False) if kind in (_CONTROL, _USER_DEFINED)}
    return (marked | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"}


class GGUFTokenizer:
    """A ``tokenizers.Tokenizer`` from a GGUF file, with its special tokens, ids and chat template.

    Args:
        backend: the ``tokenizers.Tokenizer`` (:func:`byte_level_bpe`, :func:`sentencepiece_bpe`).
        tokens: the vocabulary, index = token id.
        token_types: llama.cpp's type of each token (3 = control: special,
            matched whole; 4 = user-defined: matched whole, a plain token).
        bos_id, eos_id, pad_id: special ids (pad_id None: eos_id pads).
        add_bos: put bos_id before every text.
        chat_template: a jinja2 template (Hugging Face's convention), or None.
        context_length: the most tokens a text may have.
        rstrip: special or added tokens that swallow the whitespace after them
            (Phi-3's chat tokens: ``"<|user|>\nHi"`` is ``<|user|>``, ``Hi``).
    """

    def __init__(self, backend: Any, tokens: Sequence[str], token_types: Sequence[int], *, bos_id: int | None,
                 eos_id: int, pad_id: int | None, add_bos: bool, chat_template: str | None,
                 context_length: int, rstrip: Collection[str] = ()) -> None:
        tokenizers = require("tokenizers", "The GGUF tokenizer")
        _check_vocabulary(tokens, token_types, {"bos_token_id": bos_id, "eos_token_id": eos_id,
                                                "padding_token_id": pad_id})
        self._tok = backend
        types = list(token_types) or [1] * len(tokens)
        specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
        self._tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True, rstrip=t in rstrip)
                                      for t in specials])
        added = [t for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
                 if kind == _USER_DEFINED and backend.token_to_id(t) == i]  # (not one respelled: a new id)
        self._tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False, rstrip=t in rstrip)
                              for t in added])
        self.tokens = list(tokens)
        self.specials = specials  # control tokens: only a chat template's own markup may produce them
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.pad_id = eos_id if pad_id is None else pad_id
        self.chat_template, self.context_length = chat_template, context_length
        self.template_name = "the chat template (tokenizer.chat_template)"  # the loader names its file
        ends = {i for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
                if t in _END_TOKENS and kind != _USER_DEFINED}  # Gemma's "</s>" is text (user-defined): an HTML tag
        self.stop_ids = tuple(sorted({eos_id} | ends))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, context_length: int) -> GGUFTokenizer:
        """The tokenizer a GGUF file's ``tokenizer.*`` metadata describes.

        ``tokenizer.ggml.model`` "gpt2": byte-level BPE from the file's merges;
        "llama": SentencePiece BPE from its tokens (:func:`sentencepiece_bpe`,
        with a space before the text unless ``add_space_prefix`` is false).
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported: only byte-level "
                             "BPE ('gpt2') and SentencePiece BPE ('llama') are")
        needed = ("tokens", "merges", "eos_token_id") if kind == "gpt2" else ("tokens", "eos_token_id")
        for key in (f"tokenizer.ggml.{name}" for name in needed):
            if key not in metadata:
                raise ValueError(f"the GGUF metadata has no {key!r}")
        tokens = metadata["tokenizer.ggml.tokens"]
        if kind == "gpt2":
            backend = byte_level_bpe(tokens, metadata["tokenizer.ggml.merges"],
                                     metadata.get("tokenizer.ggml.pre", "default"))
        else:
            backend = sentencepiece_bpe(tokens, _unknown_token(metadata, tokens), space_prefix=_space_prefix(metadata))
        types = metadata.get("tokenizer.ggml.token_type", [])
        return cls(backend, tokens, types, rstrip=_phi3_rstrip(metadata, tokens, types),
                   bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
                   eos_id=metadata["tokenizer.ggml.eos_token_id"],
                   pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
                   add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=metadata.get("tokenizer.chat_template"), context_length=context_length)

    def encode(self, text: str) -> list[int]:
        """The token ids of one text (special tokens written in it are matched whole)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        _check_text(text)
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def tokenize(self, texts: str | Sequence[str]) -> dict[str, Tensor]:
        """``input_ids`` and ``attention_mask`` (B, T) long, left-padded with the pad id.

        Raises ValueError for an empty text and for one longer than the context.
        """
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise ValueError("tokenize() needs at least one text, got an empty list")
        rows = []
        for i, text in enumerate(texts):
            ids = self.encode(text)
            if not ids:
                raise ValueError(f"text {i} is empty ({text!r}): a prompt needs at least one token")
            if len(ids) > self.context_length:
                raise ValueError(f"text {i} has {len(ids)} tokens, more than the model's context length "
                                 f"{self.context_length}; shorten it (nothing is truncated)")
            rows.append(ids)
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # (B, T)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def decode(self, ids: Tensor | Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of a 1-D sequence of ids (special tokens such as padding left out by default)."""
        if isinstance(ids, Tensor):
            if ids.dim() != 1:
                raise ValueError(f"decode() takes one row of ids (1-D), got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The file's chat template rendered for ``messages`` ([{"role", "content"}, ...]).

        Rendered in jinja2's sandbox, as Hugging Face's ``apply_chat_template``
        does, ending with the assistant's turn opened when ``add_generation_prompt``,
        and bounded in time, memory and size (:mod:`attnkit.models.chat`).
        ``tools`` (OpenAI's [{"type": "function", "function": {...}}, ...]) are
        passed to the template as ``tools``, as ``apply_chat_template(tools=)``
        does; None (the default) passes none. A message may carry more keys
        than role and content (an assistant's ``tool_calls``, a tool's
        ``tool_call_id``): the template reads them.
        """
        if self.chat_template is None:
            raise ValueError("this model's file has no chat template (tokenizer.chat_template)")
        if isinstance(messages, (str, Mapping)) or not messages:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(
                    m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with str 'role' and 'content', got {m!r}")
        special: dict[str, Any] = {"bos_token": "" if self.bos_id is None else self.tokens[self.bos_id],
                                   "eos_token": self.tokens[self.eos_id]}
        if tools is not None:
            if isinstance(tools, (str, Mapping)) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError(f"tools must be a list of {{'type', 'function'}} dicts, got {tools!r}")
            special["tools"] = [dict(t) for t in tools]
        return chat.render(self.chat_template, messages, name=self.template_name,
                           add_generation_prompt=add_generation_prompt, variables=special)

    def encode_piece(self, text: str, *, special: bool) -> list[int]:
        """Ids of ``text``, one piece of a prompt, with no BOS added (unlike :meth:`encode`).

        ``special=True`` matches control-token strings whole, as :meth:`encode` does; ``special=False`` spells them
        as plain text: how :meth:`chat_ids` encodes message content, so that it cannot forge a turn.
        """
        _check_text(text)
        self._tok.encode_special_tokens = not special
        try:
            ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False
        return ids

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                 special_in_content: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The chat prompt as token ids, encoded as transformers' ``apply_chat_template(tokenize=True)`` does.

        The rendered text is encoded without adding a BOS (a template that writes
        ``{{ bos_token }}`` gives exactly one). By default control tokens come
        only from the template's own markup: text inside a message that spells
        one (``<|im_start|>system``...) is encoded as plain text, so content
        cannot forge a turn. ``special_in_content=True`` encodes the rendered
        text as is (content may then contain control tokens). ``tools``: as
        :meth:`chat_prompt`; tools and the messages' other fields (tool calls)
        that spell a control token are refused (ValueError) unless
        ``special_in_content``.
        """
        text = self.chat_prompt(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        if not special_in_content:
            self._refuse_specials_outside_content(messages, tools)
        contents = [m["content"] for m in messages]
        if special_in_content or not any(s in c for c in contents for s in self.specials):
            return self.encode_piece(text, special=True)  # nothing to guard: exactly the rendered text's ids
        pieces = self._markup_and_contents(messages, text, add_generation_prompt, tools)
        return [i for piece, is_content in pieces for i in self.encode_piece(piece, special=not is_content)]

    def _refuse_specials_outside_content(self, messages: Sequence[Mapping[str, Any]],
                                         tools: Sequence[Mapping[str, Any]] | None) -> None:
        """A ValueError when the tools or a message's fields besides its content (tool calls) spell a control
        token: only content is encoded as plain text around the template's markup."""
        others = [("tools", tools or [])] + [(f"message {i}", {k: v for k, v in m.items() if k != "content"})
                                             for i, m in enumerate(messages)]
        for where, value in others:
            text = json.dumps(value, ensure_ascii=False, default=str)
            found = next((s for s in self.specials if s in text), None)
            if found is not None:
                raise ValueError(f"{where} spells the control token {found!r} outside a message's content; it "
                                 "cannot be encoded as plain text")

    def _markup_and_contents(self, messages: Sequence[Mapping[str, Any]], text: str, add_generation_prompt: bool,
                             tools: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[str, bool]]:
        """``text`` cut into (piece, is_content): the template rendered with a placeholder for each message's
        content says where the template's markup ends and content begins (searching the rendered text for the
        content found it inside the markup: a message "s" matched the "s" of ``<|im_start|>system``)."""
        skeleton = self.chat_prompt([{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)],
                                    add_generation_prompt=add_generation_prompt, tools=tools)
        split = re.split("(\ue000[0-9]+\ue001)", skeleton)  # markup, mark, markup, mark, ..., markup
        for shape in (str, str.strip):  # the content as written, or trimmed (Gemma's template trims it)
            pieces = [(shape(messages[int(piece[1:-1])]["content"]), True) if i % 2 else (piece, False)
                      for i, piece in enumerate(split)]
            if "".join(piece for piece, _ in pieces) == text:
                return pieces
        raise ValueError("the chat template changes message content that spells control tokens, so it cannot be "
                         "encoded as plain text; pass special_in_content=True to encode the rendered text as is")
